"""A call's options, apart from the method's arguments (pure): the :class:`CallOptions`
record that ``group.options(...)`` makes and the one call path reads.

A call's keywords are the method's. phalanx's own settings for a call (which ranks, how
long to wait, whether the results stay on the ranks, ``call_sharded``'s axes) travel in a
frozen record, checked once when it is made, before anything is sent::

    group.options(timeout=5, workers=[0, 1]).call("step", timeout=30)  # the method's timeout

The call forms of a group or a slice also take the option keywords that each form always
took (:data:`FORM_OPTIONS`) as a convenience: ``group.call("step", timeout=5)``. A keyword
taken so that names a parameter of the method too is refused (:func:`refuse_clash`),
never silently given to one side: the user then says which side it is for with
``options()``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.options import check_seconds
from phalanx.world.selection import Workers, check_workers

OPTION_NAMES = (
    "workers", "timeout", "keep", "rank0_only_axes", "common_kwargs", "in_sharded_axes",
    "replicate_on_axes", "output_is_replicated", "dummy_calls_to_free_axes",
)

# The option keywords each call form takes beside the method's own (the convenience
# form), in the order its signature declares them; every other keyword goes to the method.
FORM_OPTIONS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "call": ("workers", "timeout", "rank0_only_axes", "keep"),
    "call_async": ("workers", "rank0_only_axes", "keep"),
    "map": ("workers", "timeout", "rank0_only_axes", "common_kwargs", "keep"),
    "map_async": ("workers", "rank0_only_axes", "common_kwargs", "keep"),
    "call_one": ("timeout", "keep"),
    "call_stream": ("workers", "timeout"),
    "call_sharded": ("in_sharded_axes", "replicate_on_axes", "output_is_replicated",
                     "dummy_calls_to_free_axes", "common_kwargs", "keep"),
})


def _axes(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (Sequence, set, frozenset)):
        raise TypeError(f"{name} must be a list of axis names, got {value!r}")
    axes = tuple(value)
    for axis in axes:
        if not isinstance(axis, str):
            raise TypeError(f"{name} must hold axis names (str), got {axis!r}")
    return axes


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _common(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"common_kwargs must be a mapping of keywords, got {value!r}")
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"common_kwargs must have str keys, got {key!r}")
    return types.MappingProxyType(dict(value))


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "workers": check_workers,
    "timeout": check_seconds,
    "keep": lambda v: _flag(v, "keep"),
    "rank0_only_axes": lambda v: _axes(v, "rank0_only_axes"),
    "common_kwargs": _common,
    "in_sharded_axes": lambda v: _axes(v, "in_sharded_axes"),
    "replicate_on_axes": lambda v: _axes(v, "replicate_on_axes"),
    "output_is_replicated": lambda v: _axes(v, "output_is_replicated"),
    "dummy_calls_to_free_axes": lambda v: _flag(v, "dummy_calls_to_free_axes"),
}


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """How a call is made (see the module docstring); every field checked when made.

    ``workers``: the selection (``"all"``, ``"any"``, ``"ready"``, a rank or ranks);
    ``timeout``: seconds the waiting forms wait (None: no limit; the ``*_async`` forms and
    ``call_sharded`` return futures whose ``result(timeout)`` says it); ``keep``: results
    stay on the ranks, handles come back; ``rank0_only_axes``: only the ranks at
    coordinate 0 of those mesh axes; ``common_kwargs``: keywords every rank of a ``map`` or
    ``call_sharded`` gets unchanged; ``in_sharded_axes``, ``replicate_on_axes``,
    ``output_is_replicated``, ``dummy_calls_to_free_axes``: ``call_sharded``'s rules.
    """

    workers: Workers = "all"
    timeout: float | None = None
    keep: bool = False
    rank0_only_axes: tuple[str, ...] = ()
    common_kwargs: Mapping[str, Any] | None = None
    in_sharded_axes: tuple[str, ...] = ()
    replicate_on_axes: tuple[str, ...] = ()
    output_is_replicated: tuple[str, ...] = ()
    dummy_calls_to_free_axes: bool = False

    def with_options(self, options: Mapping[str, Any]) -> CallOptions:
        """This record with ``options`` changed, each checked (TypeError for an unknown
        name or a value of the wrong type, ValueError for one out of range)."""
        if not options:
            return self
        # A copy of the fields, not dataclasses.replace(): the call forms' option keywords
        # make one record per call, and replace() (with __init__ setting each frozen
        # field) cost more than the rest of a call's way to the sender.
        record = object.__new__(CallOptions)
        fields = record.__dict__
        fields.update(self.__dict__)
        for name, value in options.items():
            check = _CHECKS.get(name)
            if check is None:
                raise _unknown(name)
            fields[name] = check(value)
        return record


DEFAULT = CallOptions()


def _unknown(name: str) -> TypeError:
    return TypeError(f"{name!r} is not a call option; the options are: "
                     f"{', '.join(OPTION_NAMES)}")


def refuse_clash(form: str, method: str, given: Sequence[str],
                 parameters: Sequence[str] | None) -> None:
    """TypeError if an option keyword given to ``form`` is also the name of one of
    ``method``'s parameters (None: they are not known): the keyword could be meant for
    either, and a guess would hand one side the other's value."""
    if not parameters:
        return
    clash = [name for name in given if name in parameters]
    if clash:
        names = ", ".join(f"{name}=" for name in clash)
        raise TypeError(
            f"{form}({method!r}, {names}...): {method}() has a parameter of that name, "
            f"so it is unclear whether {names} is for the method or for the call. Give the "
            f"call's options apart: group.options({names}...).{form}({method!r}, ...), "
            f"where every keyword goes to the method")
