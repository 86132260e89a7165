"""The seven call forms, declared once: ``call``, ``call_async``, ``map``, ``map_async``,
``call_one``, ``call_stream`` and ``call_sharded`` (:class:`CallForms`), shared by a group,
its slices and the views that ``options()`` makes.

Each form takes the method's name and the method's arguments. phalanx's own settings for
the call come from a frozen :class:`~phalanx.world.calloptions.CallOptions` record:

- on a :class:`CallView` (``group.options(timeout=5)``) every keyword goes to the method,
  so a method with parameters named ``timeout``, ``keep`` or ``workers`` receives them;
- on a group or a slice, each form also takes the option keywords it always took
  (:data:`~phalanx.world.calloptions.FORM_OPTIONS`) as a convenience. One that names a
  parameter of the method too is refused before anything is sent (TypeError), never given
  silently to one side; a slice's forms take no ``workers=`` (its ranks are its selection).

Whatever the form, one record and the form's scope (the ranks it may call and the mesh it
reads axes against: :class:`Scope`) go to the one
:class:`~phalanx.controller.callpath.CallPath`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.methods import MethodProxy
from phalanx.world.calloptions import DEFAULT, FORM_OPTIONS, CallOptions, refuse_clash
from phalanx.world.selection import Workers

if TYPE_CHECKING:
    from phalanx.controller.callpath import CallPath, Route
    from phalanx.controller.futures import GroupFuture, ShardedFuture, StreamFuture
    from phalanx.controller.meshcalls import Mesh

# On a slice, workers= is the method's keyword (its ranks are its selection).
_SLICE_FORM_OPTIONS = {form: tuple(name for name in names if name != "workers")
                       for form, names in FORM_OPTIONS.items()}
_MADE = 256  # records a form's option keywords made, kept per group, slice or view
_UNSET: Any = object()  # an option keyword not given
_WORKERS_FIRST = frozenset(form for form, names in FORM_OPTIONS.items()
                           if names[0] == "workers")


def _key(form: str, method: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
    """What identifies the record a form's option values make for ``method``: the values
    with their types (``keep=1`` is no ``keep=True``, ``[True]`` no ``[1]``). A list as the
    first option (``workers``, ``in_sharded_axes``: the usual) is keyed as a tuple; where
    another value is not hashable, neither is the key (see :meth:`CallForms._given`).
    C-level work only: this runs on every call that names an option."""
    first = values[0]
    if type(first) is list:
        first = tuple(first)
        return (form, method, first, tuple(map(type, first)), values[1:],
                tuple(map(type, values)))
    return (form, method, values, tuple(map(type, values)))


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where a form's calls go: ``workers`` None for the group's own selection (the
    options' ``workers``), or a slice's fixed selection with its ``members``; ``mesh``: the
    mesh ``rank0_only_axes`` and ``call_sharded`` read (the group's, or the slice's)."""

    mesh: Mesh
    workers: Workers | None = None
    members: frozenset[int] | None = None


class CallForms:
    """The call forms on one :class:`Scope` with one options record (see the module
    docstring). Subclasses: the group, a slice, an options view."""

    # Set by the subclass's constructor (:meth:`_init_forms`).
    _path: CallPath
    _scope: Scope
    _options: CallOptions
    _form_options: Mapping[str, tuple[str, ...]] | None  # None: every keyword is the method's

    def _init_forms(self, path: CallPath, scope: Scope, options: CallOptions = DEFAULT,
                    convenience: bool = True) -> None:
        self._path = path
        self._scope = scope
        self._options = options
        self._form_options = None if not convenience else (
            FORM_OPTIONS if scope.workers is None else _SLICE_FORM_OPTIONS)
        # The records the option keywords made, by form, method and values: a loop of
        # calls with the same keywords (pipelined call_async(..., workers=[0])) checks
        # and makes its record once. Checked records only; a value that is not plain
        # data is checked each time.
        self._made: dict[tuple[Any, ...], CallOptions] = {}
        # call_async(method, workers=[rank]) alone, the pipelined loop's call: its routes
        # (see CallPath.call_routed) by method and rank, looked up without making a key
        self._async_one: dict[str, dict[int, Route]] = {}

    def options(self, **options: Any) -> CallView:
        """A view of these ranks whose calls are made with ``options`` (any of
        :class:`~phalanx.world.calloptions.CallOptions`'s fields: ``workers``,
        ``timeout``, ``keep``, ``rank0_only_axes``, ``common_kwargs``, ``call_sharded``'s
        axes), each checked now. Its call forms pass every keyword to the method::

            group.options(timeout=5).call("step", timeout=30)  # step(timeout=30), 5 s wait
        """
        if "workers" in options and self._scope.workers is not None:
            raise TypeError("options(workers=...): a slice calls its own ranks; "
                            "take a slice of it, or use call_one(rank, ...)")
        return CallView(self._path, self._scope, self._options.with_options(options))

    def _given(self, form: str, method: str, kwargs: dict[str, Any],
               *values: Any) -> CallOptions:
        """The record a form's option keywords make (``values``: each of the form's
        options in the order :data:`~phalanx.world.calloptions.FORM_OPTIONS` gives, or
        ``_UNSET``). On a view every one of them is the method's keyword, and so is
        ``workers`` on a slice: those go into ``kwargs``."""
        first = values[0]
        key: tuple[Any, ...] | None
        if type(first) is list and len(first) == 1 and type(first[0]) is int:
            # workers=[r]: one int rank, the commonest pipelined call; its record, if
            # made, is that of the general branch below (keyed by the same tuple)
            options = self._made.get((form, method, (first[0],)))
            if (options is not None and values.count(_UNSET) == len(values) - 1
                    and type(options.workers[0]) is int):  # type: ignore[index]  # (1,) == (True,)
                return options
        if (type(first) is list and form in _WORKERS_FIRST
                and values.count(_UNSET) == len(values) - 1):
            # workers=[...] alone, the pipelined loop's call: keyed by its ranks only, and
            # taken when they are the very objects of the record's (True is not 1)
            ranks = tuple(first)
            key = (form, method, ranks)
            try:
                options = self._made.get(key)
            except TypeError:
                key = options = None
            if options is not None and all(map(operator.is_, ranks, options.workers)):  # type: ignore[arg-type]
                return options
        else:
            key = _key(form, method, values)
            try:
                options = self._made.get(key)
            except TypeError:  # a value that is not hashable (a dict, a list of lists)
                key = options = None
            if options is not None:
                return options
        accepted = self._form_options[form] if self._form_options is not None else ()
        taken: dict[str, Any] = {}
        for name, value in zip(FORM_OPTIONS[form], values, strict=True):
            if value is _UNSET:
                continue
            if name in accepted:
                taken[name] = value
            else:
                kwargs[name] = value  # the method's own
                key = None  # a record with it would not say where it went
        if not taken:
            return self._options
        path = self._path
        path.check_open()  # a closed group says so before any other complaint
        parameters = path.methods.parameters(method)
        if parameters:
            refuse_clash(form, method, list(taken), parameters)
        options = self._options.with_options(taken)
        if key is not None and len(self._made) < _MADE:
            self._made[key] = options
            if (form == "call_async" and list(taken) == ["workers"]
                    and type(first) is list and len(first) == 1 and type(first[0]) is int):
                route = self._path.route(options, self._scope)
                if route is not None:
                    self._async_one.setdefault(method, {})[first[0]] = route
        return options

    # -- the forms --------------------------------------------------------------------

    def call(self, method: str, /, *args: Any, workers: Workers = _UNSET,
             timeout: float | None = _UNSET, rank0_only_axes: Sequence[str] | None = _UNSET,
             keep: bool = _UNSET, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the selected ranks (arguments pickled once)
        and wait; results in rank order. Options: ``workers``, ``timeout``,
        ``rank0_only_axes``, ``keep`` (see :meth:`options`)."""
        options = self._options
        if not (workers is _UNSET and timeout is _UNSET and rank0_only_axes is _UNSET
                and keep is _UNSET):
            options = self._given("call", method, kwargs, workers, timeout,
                                  rank0_only_axes, keep)
        return self._path.call(method, args, kwargs, options, self._scope)

    def call_async(self, method: str, /, *args: Any, workers: Workers = _UNSET,
                   rank0_only_axes: Sequence[str] | None = _UNSET, keep: bool = _UNSET,
                   **kwargs: Any) -> GroupFuture:
        """:meth:`call` without waiting: a :class:`~phalanx.controller.futures.GroupFuture`.
        Options: ``workers``, ``rank0_only_axes``, ``keep``."""
        options = self._options
        if not (workers is _UNSET and rank0_only_axes is _UNSET and keep is _UNSET):
            if (type(workers) is list and len(workers) == 1 and type(workers[0]) is int
                    and rank0_only_axes is _UNSET and keep is _UNSET):
                by_rank = self._async_one.get(method)
                if by_rank is not None:
                    route = by_rank.get(workers[0])
                    if route is not None:
                        return self._path.call_routed(route, method, args, kwargs,
                                                      self._scope)
            options = self._given("call_async", method, kwargs, workers, rank0_only_axes,
                                  keep)
        return self._path.call_async(method, args, kwargs, options, self._scope)

    def call_one(self, rank: int, method: str, /, *args: Any, timeout: float | None = _UNSET,
                 keep: bool = _UNSET, **kwargs: Any) -> Any:
        """Call ``method`` on ``rank`` and return its value. Options: ``timeout``,
        ``keep``."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"rank must be an integer, got {rank!r}")
        members = self._scope.members
        if members is not None and rank not in members:
            raise ValueError(f"rank {rank!r} is not in this slice (its ranks are "
                             f"{sorted(members)})")
        options = self._options
        if not (timeout is _UNSET and keep is _UNSET):
            options = self._given("call_one", method, kwargs, timeout, keep)
        return self._path.call(method, args, kwargs, options, self._scope, [rank])[0]

    def map_async(self, method: str, /, *arg_lists: Sequence[Any], workers: Workers = _UNSET,
                  rank0_only_axes: Sequence[str] | None = _UNSET,
                  common_kwargs: Mapping[str, Any] | None = _UNSET, keep: bool = _UNSET,
                  **kwarg_lists: Any) -> GroupFuture:
        """Each positional/keyword argument is a list with one item per called rank
        (matched to them in rank order). Options: ``workers``, ``rank0_only_axes``,
        ``common_kwargs`` (keywords every called rank gets unchanged), ``keep``."""
        options = self._options
        if not (workers is _UNSET and rank0_only_axes is _UNSET and common_kwargs is _UNSET
                and keep is _UNSET):
            options = self._given("map_async", method, kwarg_lists, workers,
                                  rank0_only_axes, common_kwargs, keep)
        return self._path.map_async(method, arg_lists, kwarg_lists, options, self._scope)

    def map(self, method: str, /, *arg_lists: Sequence[Any], workers: Workers = _UNSET,
            timeout: float | None = _UNSET, rank0_only_axes: Sequence[str] | None = _UNSET,
            common_kwargs: Mapping[str, Any] | None = _UNSET, keep: bool = _UNSET,
            **kwarg_lists: Any) -> list[Any]:
        """:meth:`map_async`, waited for; results in rank order. Options as there, and
        ``timeout``."""
        options = self._options
        if not (workers is _UNSET and timeout is _UNSET and rank0_only_axes is _UNSET
                and common_kwargs is _UNSET and keep is _UNSET):
            options = self._given("map", method, kwarg_lists, workers, timeout,
                                  rank0_only_axes, common_kwargs, keep)
        return self._path.map(method, arg_lists, kwarg_lists, options, self._scope)

    def call_stream(self, method: str, /, *args: Any, workers: Workers = _UNSET,
                    timeout: float | None = _UNSET, **kwargs: Any) -> StreamFuture:
        """Call a generator method on the selected ranks and iterate ``(rank, item)`` pairs
        as they arrive (a method that is not a generator streams its value as one item).
        Options: ``workers``, ``timeout`` (the wait for each next item: CallTimeout)."""
        options = self._options
        if not (workers is _UNSET and timeout is _UNSET):
            options = self._given("call_stream", method, kwargs, workers, timeout)
        return self._path.call_stream(method, args, kwargs, options, self._scope)

    def call_sharded(self, method: str, /, *args: Any,
                     in_sharded_axes: Sequence[str] = _UNSET,
                     replicate_on_axes: Sequence[str] = _UNSET,
                     output_is_replicated: Sequence[str] = _UNSET,
                     dummy_calls_to_free_axes: bool = _UNSET,
                     common_kwargs: Mapping[str, Any] | None = _UNSET, keep: bool = _UNSET,
                     **kwargs: Any) -> ShardedFuture:
        """Send each rank its slice of nested-list data (NeMo-RL's sharded-data rules; see
        :mod:`phalanx.world.sharding`); the future's result holds one value per data shard.
        Options: ``in_sharded_axes``, ``replicate_on_axes``, ``output_is_replicated``,
        ``dummy_calls_to_free_axes``, ``common_kwargs``, ``keep``."""
        options = self._options
        values = (in_sharded_axes, replicate_on_axes, output_is_replicated,
                  dummy_calls_to_free_axes, common_kwargs, keep)
        if values.count(_UNSET) != len(values):
            options = self._given("call_sharded", method, kwargs, *values)
        return self._path.call_sharded(method, args, kwargs, options, self._scope)

    def __getattr__(self, name: str) -> MethodProxy:
        """``group.train.call(batch)`` for ``group.call("train", batch)``; an unknown name
        lists the worker object's methods, as ``call("trian")`` does."""
        path = self.__dict__.get("_path")
        if path is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if name in path.methods:
            return MethodProxy(self, name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}, and "
            f"{path.methods.target_name} has no method {name!r}; its methods: "
            f"{', '.join(path.methods.names()) or 'none'}")


class CallView(CallForms):
    """The calls of a group or slice with fixed options (``group.options(...)``): every
    keyword of a call goes to the method. ``options()`` again gives a view with more."""

    def __init__(self, path: CallPath, scope: Scope, options: CallOptions) -> None:
        self._init_forms(path, scope, options, convenience=False)

    @property
    def call_options(self) -> CallOptions:
        """The options this view's calls are made with."""
        return self._options

    def __repr__(self) -> str:
        changed = {f.name: getattr(self._options, f.name)
                   for f in dataclasses.fields(self._options)
                   if getattr(self._options, f.name) != f.default}
        return f"<CallView {changed}>"
