"""The interface phalanx's own parts drive a group through, apart from the public class:
built-in calls of the rank runtime (weight sync, traces) and the watching of every call
(traces, dashboards). ``internals(group)`` gives a group's :class:`GroupInternals`; user
code has no use for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.rank.kept import BUILTIN

if TYPE_CHECKING:
    from phalanx.controller.calls import Sender
    from phalanx.controller.futures import Call
    from phalanx.controller.observe import Observer
    from phalanx.controller.ranks import RankTable
    from phalanx.controller.state import Gate

_BY_GROUP: weakref.WeakKeyDictionary[object, GroupInternals] = weakref.WeakKeyDictionary()


class GroupInternals:
    """What phalanx's own parts that drive a group's ranks use of it, and user code does
    not: the built-in calls of the rank runtime (weight sync, traces) and the watching of
    every call (traces, dashboards). Reached with :func:`internals`."""

    def __init__(self, gate: Gate, table: RankTable, sender: Sender,
                 node_address: Callable[[int], str]) -> None:
        self._gate = gate
        self._table = table
        self._sender = sender
        self._node_address = node_address

    def node_address(self, node: int) -> str:
        """How the other nodes reach node ``node`` of the group (where a rank there
        listens for peers of phalanx's own, never on the wildcard)."""
        return self._node_address(node)

    def watch_calls(self, observer: Observer, on: bool = True) -> None:
        """Have ``observer`` watch every call from now on (``on=False``: stop): the
        interface of traces and dashboards (:mod:`phalanx.controller.observe`)."""
        self._sender.observe(observer, on)

    def send_builtin(self, method: str, ranks: Sequence[int],
                     args: Sequence[tuple[Any, ...]], *, defer: bool = False,
                     watched: bool = True) -> Call:
        """Run phalanx's own call ``method`` (a built-in of the rank runtime, named
        ``@...``: see :func:`phalanx.rank.kept.builtin`) on ``ranks``, ``ranks[i]`` with
        ``args[i]``. GroupClosed or WorkerDied before anything is sent; ``defer``: sent at
        the future's first wait (so that several groups' calls are all checked before any
        goes out); ``watched``: False keeps the call out of traces and dashboards
        (phalanx's own housekeeping)."""
        self._gate.check()
        if not method.startswith(BUILTIN):
            raise ValueError(f"{method!r} is not the name of a built-in call")
        chosen = self._table.select(list(ranks))
        if chosen != list(ranks) or len(args) != len(chosen):
            raise ValueError(f"send_builtin(): ranks {list(ranks)} must be increasing, "
                             f"with one argument tuple each ({len(args)} given)")
        payloads = [self._sender.encode(tuple(a), {}, rank)
                    for a, rank in zip(args, chosen, strict=True)]
        return self._sender.send(method, chosen, payloads,  # type: ignore[no-any-return]
                                 defer=defer, watched=watched, builtin=True)



def register(group: object, parts: GroupInternals) -> None:
    """``group``'s internals are ``parts`` (the group, as it builds them)."""
    _BY_GROUP[group] = parts


def internals(group: object) -> GroupInternals:
    """The interface phalanx's own parts drive ``group`` through; TypeError for anything
    that is not a started group."""
    parts = _BY_GROUP.get(group)
    if parts is None:
        raise TypeError(f"expected a started WorkerGroup, got {group!r}")
    return parts
