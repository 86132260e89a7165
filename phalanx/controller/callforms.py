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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.methods import MethodProxy
from phalanx.world.calloptions import DEFAULT, FORM_OPTIONS, CallOptions, refuse_clash

if TYPE_CHECKING:
    from phalanx.controller.callpath import CallPath
    from phalanx.controller.futures import GroupFuture, ShardedFuture, StreamFuture
    from phalanx.controller.meshcalls import Mesh
    from phalanx.world.selection import Workers

_SLICE_FORM_OPTIONS = {form: names - {"workers"} for form, names in FORM_OPTIONS.items()}


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
    _form_options: Mapping[str, frozenset[str]] | None  # None: every keyword is the method's

    def _init_forms(self, path: CallPath, scope: Scope, options: CallOptions = DEFAULT,
                    convenience: bool = True) -> None:
        self._path = path
        self._scope = scope
        self._options = options
        self._form_options = None if not convenience else (
            FORM_OPTIONS if scope.workers is None else _SLICE_FORM_OPTIONS)

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

    def _split(self, form: str, method: str,
               kwargs: dict[str, Any]) -> tuple[CallOptions, dict[str, Any]]:
        """The options a convenience form's keywords give, and the method's keywords."""
        accepted = self._form_options[form]  # type: ignore[index]
        taken: dict[str, Any] | None = None
        for name in kwargs:
            if name in accepted:
                if taken is None:
                    taken = {}
                taken[name] = kwargs[name]
        if taken is None:
            return self._options, kwargs
        path = self._path
        path.check_open()  # a closed group says so before any other complaint
        parameters = path.methods.parameters(method)
        if parameters:
            refuse_clash(form, method, list(taken), parameters)
        for name in taken:
            del kwargs[name]  # a dict of this call's own (**kwargs)
        return self._options.with_options(taken), kwargs

    # -- the forms --------------------------------------------------------------------

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the selected ranks (arguments pickled once)
        and wait; results in rank order. Options (on a group: also as keywords):
        ``workers``, ``timeout``, ``rank0_only_axes``, ``keep``."""
        options = self._options
        if kwargs and self._form_options is not None:
            options, kwargs = self._split("call", method, kwargs)
        return self._path.call(method, args, kwargs, options, self._scope)

    def call_async(self, method: str, /, *args: Any, **kwargs: Any) -> GroupFuture:
        """:meth:`call` without waiting: a :class:`~phalanx.controller.futures.GroupFuture`.
        Options: ``workers``, ``rank0_only_axes``, ``keep``."""
        options = self._options
        if kwargs and self._form_options is not None:
            options, kwargs = self._split("call_async", method, kwargs)
        return self._path.call_async(method, args, kwargs, options, self._scope)

    def call_one(self, rank: int, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on ``rank`` and return its value. Options: ``timeout``,
        ``keep``."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"rank must be an integer, got {rank!r}")
        members = self._scope.members
        if members is not None and rank not in members:
            raise ValueError(f"rank {rank!r} is not in this slice (its ranks are "
                             f"{sorted(members)})")
        options = self._options
        if kwargs and self._form_options is not None:
            options, kwargs = self._split("call_one", method, kwargs)
        return self._path.call(method, args, kwargs, options, self._scope, [rank])[0]

    def map_async(self, method: str, /, *arg_lists: Sequence[Any],
                  **kwarg_lists: Any) -> GroupFuture:
        """Each positional/keyword argument is a list with one item per called rank
        (matched to them in rank order). Options: ``workers``, ``rank0_only_axes``,
        ``common_kwargs`` (keywords every called rank gets unchanged), ``keep``."""
        options = self._options
        if kwarg_lists and self._form_options is not None:
            options, kwarg_lists = self._split("map_async", method, kwarg_lists)
        return self._path.map_async(method, arg_lists, kwarg_lists, options, self._scope)

    def map(self, method: str, /, *arg_lists: Sequence[Any], **kwarg_lists: Any) -> list[Any]:
        """:meth:`map_async`, waited for; results in rank order. Options as there, and
        ``timeout``."""
        options = self._options
        if kwarg_lists and self._form_options is not None:
            options, kwarg_lists = self._split("map", method, kwarg_lists)
        return self._path.map(method, arg_lists, kwarg_lists, options, self._scope)

    def call_stream(self, method: str, /, *args: Any, **kwargs: Any) -> StreamFuture:
        """Call a generator method on the selected ranks and iterate ``(rank, item)`` pairs
        as they arrive (a method that is not a generator streams its value as one item).
        Options: ``workers``, ``timeout`` (the wait for each next item: CallTimeout)."""
        options = self._options
        if kwargs and self._form_options is not None:
            options, kwargs = self._split("call_stream", method, kwargs)
        return self._path.call_stream(method, args, kwargs, options, self._scope)

    def call_sharded(self, method: str, /, *args: Any, **kwargs: Any) -> ShardedFuture:
        """Send each rank its slice of nested-list data (NeMo-RL's sharded-data rules; see
        :mod:`phalanx.world.sharding`); the future's result holds one value per data shard.
        Options: ``in_sharded_axes``, ``replicate_on_axes``, ``output_is_replicated``,
        ``dummy_calls_to_free_axes``, ``common_kwargs``, ``keep``."""
        options = self._options
        if kwargs and self._form_options is not None:
            options, kwargs = self._split("call_sharded", method, kwargs)
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
