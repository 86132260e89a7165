"""A group's one state (:class:`GroupState`) and the :class:`Gate` that holds it.

Every call and every operation on a group's ranks checks the gate first: a group that is
closing or closed raises :class:`~phalanx.errors.GroupClosed` before anything else is
looked at (an unknown method on a closed group is GroupClosed, not AttributeError).

The operations that replace or stop ranks (``recreate``, ``restart``, ``reload``,
``resize``, ``shutdown``) exclude each other: each holds the gate's operation lock for its
whole length (:meth:`Gate.operation`), so two threads recreating ranks, or a shutdown
racing a restart, run one after the other, never interleaved. Calls do not take the lock:
they go on while ranks are replaced (a call on a rank being replaced fails as a call on a
dead rank does).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from phalanx.errors import GroupClosed


class GroupState(enum.Enum):
    """Where a group is in its life (``group.state``). The legal moves::

        STARTING  -> RUNNING     every rank is ready: the constructor returns
        STARTING  -> CLOSING     the start failed: what it took is given back
        RUNNING   -> REPLACING   recreate(), restart(), reload() or resize() began
        REPLACING -> RUNNING     it ended (whether it succeeded or raised)
        RUNNING   -> CLOSING     shutdown() began (also at interpreter exit)
        REPLACING -> CLOSING     shutdown() while an operation outlived its wait for it
        CLOSING   -> CLOSED      every rank is stopped, every resource given back

    - ``STARTING``: the constructor is starting the ranks (no handle exists yet).
    - ``RUNNING``: it serves calls.
    - ``REPLACING``: some or all ranks are being replaced; calls are still served on the
      others.
    - ``CLOSING``: shutting down; calls raise GroupClosed.
    - ``CLOSED``: shut down; calls raise GroupClosed.
    """

    STARTING = "starting"
    RUNNING = "running"
    REPLACING = "replacing"
    CLOSING = "closing"
    CLOSED = "closed"


MOVES: dict[GroupState, frozenset[GroupState]] = {
    GroupState.STARTING: frozenset({GroupState.RUNNING, GroupState.CLOSING}),
    GroupState.RUNNING: frozenset({GroupState.REPLACING, GroupState.CLOSING}),
    GroupState.REPLACING: frozenset({GroupState.RUNNING, GroupState.CLOSING}),
    GroupState.CLOSING: frozenset({GroupState.CLOSED}),
    GroupState.CLOSED: frozenset(),
}
"""The legal moves of :class:`GroupState` (its docstring draws them)."""

_CLOSING, _CLOSED = GroupState.CLOSING, GroupState.CLOSED


class Gate:
    """A group's state and its operation lock (see the module docstring; ``name``: the
    group's, for messages).

    Interface: :attr:`state`, :attr:`closed`, :meth:`check` (before every call),
    :meth:`move`, :meth:`operation` (around every replacing operation) and :meth:`closing`
    (around the shutdown).
    """

    def __init__(self, name: str | None = None) -> None:
        self._state = GroupState.STARTING
        # True once closing or closed, never False again (set with the state, at every
        # move to CLOSING or CLOSED): what a call reads first, and what check() and
        # closed say
        self.shut = False
        self._what = "this WorkerGroup" if name is None else f"group {name}"
        self._moving = threading.Lock()  # guards a move (read and write of the state)
        # One replacing operation or shutdown at a time; re-entrant: reload() restarts.
        self._operation = threading.RLock()

    @property
    def state(self) -> GroupState:
        return self._state

    @property
    def closed(self) -> bool:
        """Whether the group is shutting down or shut down."""
        return self.shut

    def check(self) -> None:
        """GroupClosed if the group is shutting down or shut down (before every call)."""
        if self.shut:
            raise GroupClosed(f"{self._what} has been shut down")

    def move(self, to: GroupState) -> None:
        """Go to ``to``: RuntimeError if the current state has no such move (a bug in
        the group, not the user's doing)."""
        with self._moving:
            if to not in MOVES[self._state]:
                raise RuntimeError(f"{self._what}: no move from {self._state.name} to "
                                   f"{to.name}")
            if to is _CLOSING or to is _CLOSED:
                self.shut = True  # (first: a call is refused from the move on)
            self._state = to

    @contextmanager
    def operation(self, what: str) -> Iterator[None]:
        """Hold the operation lock around replacing ranks (``what``: its name), the state
        REPLACING meanwhile; GroupClosed if the group is shut, or shuts while waiting."""
        with self._operation:
            self.check()
            nested = self._state is GroupState.REPLACING  # reload() -> restart()
            if not nested:
                self.move(GroupState.REPLACING)
            try:
                yield
            finally:
                with self._moving:  # a shutdown that could not wait may have moved it
                    if not nested and self._state is GroupState.REPLACING:
                        self._state = GroupState.RUNNING

    @contextmanager
    def closing(self, timeout: float) -> Iterator[bool]:
        """Hold the operation lock (waiting at most ``timeout`` seconds for an operation
        in progress in another thread) and move to CLOSING; yields False if the group was
        already closing or closed (nothing to do). Leaves it CLOSED."""
        locked = self._operation.acquire(timeout=max(0.0, min(timeout, threading.TIMEOUT_MAX)))
        try:
            with self._moving:
                first = not self.closed
                if first:
                    # from REPLACING too: an operation that outlived the wait (or the
                    # thread's own, at exit) ends as its ranks go
                    self.shut = True
                    self._state = GroupState.CLOSING
            try:
                yield first
            finally:
                if first:
                    self.move(GroupState.CLOSED)
        finally:
            if locked:
                self._operation.release()
