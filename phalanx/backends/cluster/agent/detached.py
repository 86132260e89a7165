"""Groups that outlive their controller on this agent: the book of detached sessions and
what a session keeps while no controller drives it.

A controller marks its session detachable (DETACH: the group's name, how long to wait for
another controller, and the group's description, opaque to the agent). When its connection
then ends -- the controller process killed, its machine gone, ``group.detach()`` -- the
session does not stop its ranks: it *waits*. Its ranks run on; a call that was running runs
to its end, and its answer (or error) is kept as an *orphan* with the rank, the call's id
and its method, since no controller asked for it; output and signs of life go nowhere.
Another controller proving the token takes the session over with ATTACH, naming the group:
the connection moves to the waiting session, which answers with the ranks' pids and sends
each rank's READY again, as a start would; from there the group is driven as before. If
nobody attaches within the timeout, the session ends as any other: every rank stopped.

Attaching to a session a live controller still holds is refused, naming that controller,
unless the attach says ``force``: then the old controller is sent a FAULT saying another
controller took the group over, and its connection is closed.

:class:`DetachedBook` is the agent's (one per process): the sessions by group name, so that
a new connection finds the one it names. :class:`Detachment` is a session's record.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

# The most orphaned answers a waiting session keeps; older ones go first.
MAX_ORPHANS = 10_000


@dataclasses.dataclass
class Orphan:
    """An answer no controller asked for: a call of the controller that left, answered
    after it left (``ok``: a RESULT; else an ERROR), its segments as the rank sent them
    (the header first)."""

    rank: int
    node: int
    pid: int | None
    call_id: int
    method: str
    ok: bool
    segments: list[bytes]

    def as_plain(self) -> list[Any]:
        return [self.rank, self.node, self.pid, self.call_id, self.method, self.ok,
                self.segments]


@dataclasses.dataclass
class Detachment:
    """What makes a session detachable, and its state: held by a controller (``holder``,
    its address) or waiting since ``left`` (monotonic seconds)."""

    name: str
    timeout: float
    spec: bytes  # the group's description, for the controller that attaches
    holder: str
    created: float = dataclasses.field(default_factory=time.time)
    left: float | None = None
    why_left: str = ""
    # the calls sent down before the controller left, not answered then: rank -> {id: method}
    inherited: dict[int, dict[int, str]] = dataclasses.field(default_factory=dict)
    orphans: list[Orphan] = dataclasses.field(default_factory=list)

    def waiting(self) -> bool:
        return self.left is not None

    def expired(self, now: float) -> bool:
        return self.left is not None and now - self.left > self.timeout

    def remaining(self, now: float) -> float:
        return self.timeout if self.left is None else max(0.0, self.left + self.timeout - now)

    def orphaned(self, rank: int, node: int, pid: int | None, call_id: int, ok: bool,
                 segments: list[Any]) -> bool:
        """Keep an answer to an inherited call (True), or say it is none (False)."""
        calls = self.inherited.get(rank)
        if not calls or call_id not in calls:
            return False
        self.add(Orphan(rank, node, pid, call_id, calls.pop(call_id), ok,
                        [bytes(s) for s in segments]))
        return True

    def keep(self, rank: int, call_id: int, method: str, ok: bool,
             segments: list[Any]) -> None:
        """Keep an answer to an inherited call of a rank below this node in a tree (its
        node and pid are the controller's to know)."""
        self.add(Orphan(rank, -1, None, call_id, method, ok, segments))

    def add(self, orphan: Orphan) -> None:
        if len(self.orphans) >= MAX_ORPHANS:
            del self.orphans[0]
        self.orphans.append(orphan)

    def describe(self, ranks: list[int]) -> dict[str, Any]:
        """What DESCRIBE answers: enough for ``px.attach`` to rebuild the group."""
        return {"name": self.name, "spec": self.spec, "ranks": ranks,
                "holder": None if self.waiting() else self.holder,
                "since": self.created, "waiting_for": (
                    0.0 if self.left is None else time.monotonic() - self.left),
                "timeout": self.timeout, "left_because": self.why_left,
                "orphans": len(self.orphans)}


class DetachedBook:
    """The agent's detachable sessions by group name (any object: the agent's sessions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Any] = {}

    def enter(self, name: str, session: Any) -> None:
        """Book ``session`` under ``name``; ValueError if another session holds it."""
        with self._lock:
            other = self._by_name.get(name)
            if other is not None and other is not session:
                raise ValueError(f"a group named {name!r} is already detachable on this "
                                 "node (names of detached groups are unique per agent)")
            self._by_name[name] = session

    def find(self, name: str) -> Any:
        with self._lock:
            return self._by_name.get(name)

    def leave(self, session: Any) -> None:
        with self._lock:
            for name in [n for n, s in self._by_name.items() if s is session]:
                del self._by_name[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)
