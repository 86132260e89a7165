"""The controller's event pump: routes frames from worker connections to futures, and turns
a worker's death into ``WorkerDied`` for every call pending on it.

There is no background thread. Whichever thread waits on a future becomes the *leader*
and polls every connection and death descriptor (pidfd) for the group; other waiting
threads sleep on a condition until the leader completes their future or steps down
(leader/followers). A result therefore reaches the waiting thread with no thread hand-off,
and a death is noticed the moment its descriptor becomes readable, not on a timer.
"""

from __future__ import annotations

import logging
import select
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx import streams, wire
from phalanx.errors import (
    ProcessFailure,
    RemoteFailure,
    WorkerDied,
    WorkerError,
    chain_remote,
)

if TYPE_CHECKING:
    from phalanx.backends.base import WorkerHandle
    from phalanx.futures import GroupFuture

logger = logging.getLogger(__name__)

_CALL_ID = struct.Struct("<Q").unpack_from
_RESULT = wire.RESULT
_YIELD = wire.YIELD
_EXIT_WAIT = 1.0  # after end of stream, how long the process may take to finish exiting
_OUTPUT_WAIT = 0.2  # how long to wait for a dead worker's last stderr lines


class Slot:
    """The controller's view of one incarnation of one rank."""

    def __init__(self, rank: int, node: int, handle: WorkerHandle) -> None:
        self.rank = rank
        self.node = node
        self.handle = handle
        self.conn: wire.Connection = handle.conn
        self.pid: int | None = handle.pid
        self.pending: dict[int, GroupFuture] = {}  # call id -> its future
        self.alive = True
        self.dying = False  # death is being processed
        self.ready = False
        self.methods: list[str] = []
        self.init_failure: RemoteFailure | None = None
        self.failure: ProcessFailure | None = None

    def settled_start(self) -> bool:
        return self.ready or self.init_failure is not None or not self.alive


class Dispatcher:
    """Receives for every worker of one group; driven by the threads that wait."""

    def __init__(self, on_death: Callable[[Slot], None] | None = None) -> None:
        # epoll: waiting costs the same however many workers the group has.
        self._poller = select.epoll() if hasattr(select, "epoll") else select.poll()
        self._by_fd: dict[int, tuple[Slot, bool]] = {}  # fd -> (slot, is_death_fd)
        self._cond = threading.Condition(threading.Lock())
        self._lead = threading.Lock()  # held by the thread that pumps (the leader)
        self._followers = 0  # threads waiting for the leader to finish their future
        self._wakeup = streams.WakePipe()
        self._poller.register(self._wakeup.fd, select.POLLIN)
        self._poll = self._poller.poll
        self._epoll = hasattr(select, "epoll")
        self._on_death = on_death
        self._released = False
        self.deaths = 0  # incremented on every death and removal: a cheap change counter

    # -- membership -------------------------------------------------------------------

    def add(self, slot: Slot) -> None:
        self._by_fd[slot.conn.read_fd] = (slot, False)  # (slot, is its death descriptor)
        self._poller.register(slot.conn.read_fd, select.POLLIN)
        death_fd = slot.handle.death_fd
        if death_fd is not None:
            self._by_fd[death_fd] = (slot, True)
            self._poller.register(death_fd, select.POLLIN)
        self._wakeup.wake()  # a leader blocked in poll() must pick up the new descriptors

    def _forget(self, slot: Slot) -> None:
        for fd in (slot.conn.read_fd, slot.handle.death_fd):
            if fd is not None and fd in self._by_fd and self._by_fd[fd][0] is slot:
                del self._by_fd[fd]
                try:
                    self._poller.unregister(fd)
                except KeyError:
                    pass

    # -- waiting ----------------------------------------------------------------------

    def wait(
        self,
        is_done: Callable[[], bool],
        timeout: float | None,
        kickoff: Callable[[], None] | None = None,
    ) -> bool:
        """Wait until ``is_done()`` or ``timeout``; drive the pump while nobody else does.

        ``kickoff`` (the sends of a synchronous call) runs once, as late as possible: right
        before this thread's first poll. Nothing then stands between the last send and
        sleeping, which lets the scheduler run the woken worker on this CPU at once instead
        of waking an idle one (a difference of tens of microseconds per call).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._lead.acquire(False):
                return self._lead_until(is_done, deadline, kickoff)
            if kickoff is not None:
                kickoff()  # another thread leads: send now, then wait as a follower
                kickoff = None
            cond = self._cond
            with cond:
                self._followers += 1
                try:
                    while True:
                        if is_done():
                            return True
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            return False
                        if self._lead.acquire(False):
                            self._lead.release()
                            break  # the leader stepped down: try to lead
                        cond.wait(remaining)
                finally:
                    self._followers -= 1

    def _lead_until(
        self,
        is_done: Callable[[], bool],
        deadline: float | None,
        kickoff: Callable[[], None] | None,
    ) -> bool:
        """Pump as the leader (``self._lead`` held) until done or the deadline."""
        try:
            if kickoff is not None:
                kickoff()
            if deadline is None:
                while not is_done():
                    self._pump(None)
                return True
            while not is_done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._pump(remaining)
            return True
        finally:
            self._lead.release()
            if self._followers:  # one of them may lead now, or its future completed
                with self._cond:
                    self._cond.notify_all()

    def poll_now(self) -> None:
        """Process what has already arrived, without blocking (no-op if another thread pumps)."""
        if not self._lead.acquire(False):
            return
        try:
            self._pump(0)
        finally:
            self._lead.release()
            if self._followers:
                with self._cond:
                    self._cond.notify_all()

    def _pump(self, timeout: float | None) -> None:
        if self._released:
            return
        if self._epoll:
            wait = -1 if timeout is None else timeout
        elif timeout is None:
            wait = None
        else:
            wait = int(timeout * 1000) + 1 if timeout > 0 else 0
        try:
            events = self._poll(wait)
        except InterruptedError:  # pragma: no cover
            return
        for fd, _ in events:
            if fd == self._wakeup.fd:
                self._wakeup.drain()
                continue
            entry = self._by_fd.get(fd)
            if entry is None:
                continue
            slot, is_death = entry
            if is_death:
                self._declare_dead(slot)
                continue
            try:
                frames = slot.conn.reader.recv_frames(block=False)
            except wire.ConnectionLost:
                self._declare_dead(slot)
                continue
            if frames:
                self._on_frames(slot, frames)
        if self._followers:
            with self._cond:
                self._cond.notify_all()

    # -- frames -----------------------------------------------------------------------

    def _on_frames(self, slot: Slot, frames: list[list[Any]]) -> None:
        pending = slot.pending
        for segs in frames:
            first = segs[0]
            if first[0] == _RESULT:  # the hot path, without building a header tuple
                future = pending.pop(_CALL_ID(first, 1)[0], None)
                if future is not None:
                    future._resolve_rank(slot.rank, segs[1:])
                continue
            if first[0] == _YIELD:  # an item of a streamed call; RESULT ends the stream
                future = pending.get(_CALL_ID(first, 1)[0])
                if future is not None:
                    future._yield_rank(slot.rank, segs[1:])  # type: ignore[attr-defined]
                continue
            head = wire.parse_header(first)
            kind = head[0]
            if kind == wire.ERROR:
                future = pending.pop(head[1], None)
                if future is not None:
                    failure = RemoteFailure(*head[2])
                    error = WorkerError(
                        failure,
                        rank=slot.rank,
                        node=slot.node,
                        pid=slot.pid,
                        method=future.method,
                    )
                    future._fail_rank(slot.rank, chain_remote(error, failure))
            elif kind == wire.READY:
                slot.pid = head[2]
                slot.methods = head[3]
                slot.ready = True
            elif kind == wire.INIT_ERROR:
                slot.init_failure = RemoteFailure(*head[2])
            else:
                logger.error("rank %d sent an unknown message kind %r", slot.rank, kind)

    # -- death ------------------------------------------------------------------------

    def _drain(self, slot: Slot) -> None:
        """Take in what a dead worker sent before it died: results first, then the death."""
        for _ in range(10_000):
            try:
                frames = slot.conn.reader.recv_frames(block=False)
            except wire.ConnectionLost:
                return
            if not frames:
                return
            self._on_frames(slot, frames)

    def _declare_dead(self, slot: Slot) -> None:
        if slot.dying:
            return
        slot.dying = True
        self._drain(slot)
        self._forget(slot)
        handle = slot.handle
        exitcode = handle.exitcode(_EXIT_WAIT)
        if exitcode is None:
            # The control stream ended but the process lives on: it is unusable; end it.
            handle.kill()
            exitcode = handle.exitcode(5.0)
        self.bury(slot, exitcode)
        if self._on_death is not None:
            self._on_death(slot)

    def bury(self, slot: Slot, exitcode: int | None) -> None:
        """Record how a slot's process ended and fail every call pending on it."""
        slot.handle.wait_output_closed(_OUTPUT_WAIT)
        slot.failure = ProcessFailure(
            rank=slot.rank,
            node=slot.node,
            pid=slot.pid,
            exitcode=exitcode,
            stderr_tail=slot.handle.stderr_tail(),
        )
        slot.alive = False  # after .failure is set: senders that see this fail on their own
        self.deaths += 1
        pending, slot.pending = slot.pending, {}
        for future in pending.values():
            future._fail_rank(slot.rank, WorkerDied(slot.failure, method=future.method))

    @staticmethod
    def fail_if_dead(slot: Slot, call_id: int, future: GroupFuture) -> None:
        """Close the race between sending to a slot and its death being processed."""
        if not slot.alive:
            slot.pending.pop(call_id, None)
            failure = slot.failure
            future._fail_rank(slot.rank, WorkerDied(failure, method=future.method))  # type: ignore[arg-type]

    def remove(self, slot: Slot) -> None:
        self.deaths += 1
        self._forget(slot)
        self._wakeup.wake()

    def close(
        self, error_factory: Callable[[str, int], BaseException], slots: list[Slot]
    ) -> None:
        """Fail every pending call (e.g. with GroupClosed) and stop watching all slots."""
        for slot in slots:
            self._forget(slot)
            pending, slot.pending = slot.pending, {}
            for future in pending.values():
                future._fail_rank(slot.rank, error_factory(future.method, slot.rank))
        self._wakeup.wake()
        with self._cond:
            self._cond.notify_all()

    def release(self) -> None:
        # Let a leader finish its last poll (close() woke it) before the fds go away.
        if self._lead.acquire(timeout=5.0):
            self._released = True
            self._lead.release()
        else:
            self._released = True
        if self._epoll:
            self._poller.close()
        self._wakeup.close()
