"""Which collective this rank is inside, for the controller to tell a stuck one.

A rank blocked in a collective looks like any busy rank: it answers heartbeats, its call
is pending. What tells a wedge from a slow step is which of the collective's members are
*not* in it. So every blocking collective of ``torch.distributed`` (``all_reduce``,
``broadcast``, ``barrier``, ... -- :data:`TRACKED`) is wrapped, once ``torch.distributed``
is imported (:func:`arm` installs an import hook; nothing is imported here), to note
around the call:

- the process group's name and the collective's sequence number on it (the n-th
  collective this rank entered on that group: members at the same n are in the same one);
- the operation, and a signature of its arguments (the first tensor's shape and dtype), so
  that ranks in the same collective with different shapes are told apart;
- the group's members (global ranks) and this rank's own global rank;
- when it entered (wall clock: the controller compares ranks on several hosts).

When it leaves, the group's last collective (number, operation, entered, left) is kept:
the controller learns from it how late a straggler entered one that completed.

:func:`report` gives that state as plain data and :func:`changed` says whether it moved
since the last report: the rank's heartbeat thread sends it (``COLLECTIVE``) only then. A
collective that starts and ends between two heartbeats costs two dictionary writes.
A collective run inside another (``all_gather_object`` gathers sizes, then data) is part
of the outer one: only the outer is counted. Asynchronous collectives (``async_op=True``)
and point-to-point operations are not tracked: their wait happens elsewhere, and a pair is
not a group whose absent member can be named.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a rank's start-up imports neither (importlib.abc alone costs ~6 ms)
    import importlib.machinery
    import types
    from collections.abc import Callable, Sequence

TRACKED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "reduce", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "gather",
    "gather_object", "scatter", "scatter_object_list",
)
"""The blocking collectives of ``torch.distributed`` that are tracked."""

_MARK = "__phalanx_tracked__"

# thread id -> [group name, sequence number, operation, members, signature, entered, me]
_inside: dict[int, list[Any]] = {}
# group name -> [sequence number, operation, entered, left] of its last completed one
_last: dict[str, list[Any]] = {}
_seq: dict[str, int] = {}  # group name -> collectives entered on it
_members: dict[int, tuple[str, list[int]]] = {}  # id(process group) -> name, members
_moves = 0  # bumped on every enter and leave
_reported = 0
_armed = False


def arm() -> None:
    """Track collectives from now on: at once if ``torch.distributed`` is imported, else
    as soon as it is (idempotent)."""
    global _armed
    if _armed:
        return
    _armed = True
    if "torch.distributed" in sys.modules:
        install(sys.modules["torch.distributed"])
    else:
        sys.meta_path.insert(0, _Hook())


class _Hook:
    """A finder on ``sys.meta_path`` (duck-typed: ``find_spec`` is the protocol) that wraps
    ``torch.distributed``'s collectives right after the module is executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.distributed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)  # type: ignore[assignment]  # one by protocol
                return spec
        return None


class _Loader:
    """The loader found for ``torch.distributed``, with :func:`install` after it ran."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        for hook in list(sys.meta_path):
            if isinstance(hook, _Hook):
                sys.meta_path.remove(hook)
        install(module)


def install(dist: Any) -> None:
    """Wrap ``dist``'s (``torch.distributed``'s) collectives, and the same functions in
    ``distributed_c10d`` where they are defined (once)."""
    c10d = getattr(dist, "distributed_c10d", None)
    for op in TRACKED:
        for module in (dist, c10d):
            fn = getattr(module, op, None) if module is not None else None
            if fn is None or getattr(fn, _MARK, False):
                continue
            setattr(module, op, _wrapped(op, fn, dist))


def _wrapped(op: str, fn: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    import inspect

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    group_at = names.index("group") if "group" in names else None

    def tracked(*args: Any, **kwargs: Any) -> Any:
        # async: its wait is elsewhere; nested (all_gather_object runs all_gather and
        # more): the outer one is the collective the rank is in, counted once
        if kwargs.get("async_op") or threading.get_ident() in _inside:
            return fn(*args, **kwargs)
        if "group" in kwargs:
            group = kwargs["group"]
        else:
            group = args[group_at] if group_at is not None and len(args) > group_at else None
        mark = _enter(op, group, args, dist)
        if mark is None:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            _leave(mark)

    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(tracked, attribute, getattr(fn, attribute, None))
    tracked.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(tracked, _MARK, True)
    return tracked


def _enter(op: str, group: Any, args: tuple[Any, ...], dist: Any) -> list[Any] | None:
    global _moves
    try:
        if group is None:
            group = dist.group.WORLD
        known = _members.get(id(group))
        if known is None:
            name = str(getattr(group, "group_name", "") or id(group))
            known = _members[id(group)] = (name, list(dist.get_process_group_ranks(group)))
        me = dist.get_rank()
    except Exception:  # noqa: BLE001 - not initialised, or a group of another kind: untracked
        return None
    name, members = known
    seq = _seq[name] = _seq.get(name, 0) + 1
    mark = [name, seq, op, members, _signature(args), time.time(), me]
    _inside[threading.get_ident()] = mark
    _moves += 1
    return mark


def _leave(mark: list[Any]) -> None:
    global _moves
    _inside.pop(threading.get_ident(), None)
    _last[mark[0]] = [mark[1], mark[2], mark[5], time.time()]
    _moves += 1


def _signature(args: tuple[Any, ...]) -> str:
    """The first tensor argument's shape and dtype ("" when there is none)."""
    for value in args:
        shape = getattr(value, "shape", None)
        if shape is not None and hasattr(value, "dtype"):
            return f"{tuple(shape)} {value.dtype}"
        if isinstance(value, list) and value and hasattr(value[0], "shape"):
            first = value[0]
            return f"{len(value)} x {tuple(first.shape)} {first.dtype}"
    return ""


def changed() -> bool:
    """Whether the state moved since the last :func:`report`."""
    return _moves != _reported


def report() -> tuple[list[list[Any]], list[list[Any]]]:
    """The state as plain data: the collectives this rank's threads are inside
    (``[group, seq, op, members, signature, entered, me]``) and, per group, the last one
    completed (``[group, seq, op, entered, left]``)."""
    global _reported
    _reported = _moves
    inside = [list(mark) for mark in list(_inside.values())]
    last = [[name, *done] for name, done in list(_last.items())]
    return inside, last
