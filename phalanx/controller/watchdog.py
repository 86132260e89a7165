"""Watching a group's ranks from the controller, whatever its own threads are doing.

One daemon thread per group wakes every ``tick`` seconds and

- processes what has arrived when no thread is waiting on a future (heartbeats, results),
  and leads the dispatcher while futures with done-callbacks are pending and no thread
  waits (see :mod:`phalanx.controller.futures`);
- declares a rank *unresponsive* once it has given no sign of life for
  ``heartbeat_timeout`` seconds (every rank sends a heartbeat from a thread of its own, so
  silence means a stopped process, a C call holding the GIL, or a wedged interpreter): its
  stacks are taken if they can be, its pending calls fail with
  :class:`~phalanx.errors.WorkerUnresponsive`, and it is killed so that it cannot come
  back half-alive;
- logs once per call when some ranks answered it ``straggler_warning`` seconds ago and
  others still have not, naming the late ranks and where their code is;
- judges the collectives the ranks are in (:mod:`phalanx.controller.collectivewatch`):
  the ranks the others wait for, named, and a stuck one's waiting ranks released.

It moves an entry only through the entry's transitions (``suspect()``, then
``clear_suspicion()`` if the rank spoke meanwhile); the death that follows the kill is the
dispatcher's to record, like any other.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.controller.ranks import RankState
from phalanx.dumps import innermost_user_frames
from phalanx.errors import ProcessFailure
from phalanx.wire import protocol

if TYPE_CHECKING:
    from phalanx.controller.collectivewatch import CollectiveWatch
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import Completion
    from phalanx.controller.ranks import RankEntry

logger = logging.getLogger(__name__)

StackTaker = Callable[[list["RankEntry"]], dict[int, str]]
_WATCHED = (RankState.STARTING, RankState.READY)  # the states a silence is judged in


class Watchdog:
    """The supervision thread of one group (see the module docstring): :meth:`start` it
    once the group's backend is open, :meth:`stop` it at shutdown.

    ``entries()`` gives the live ranks' entries; ``take_stacks(entries)`` their stacks.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        entries: Callable[[], list[RankEntry]],
        take_stacks: StackTaker,
        *,
        heartbeat_timeout: float | None,
        straggler_warning: float | None,
        collectives: CollectiveWatch | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._entries = entries
        self._take_stacks = take_stacks
        self.heartbeat_timeout = heartbeat_timeout
        self.straggler_warning = straggler_warning
        self._collectives = collectives if collectives is not None and collectives.active \
            else None
        timeouts = (heartbeat_timeout, straggler_warning,
                    None if collectives is None else collectives.timeout)
        limits = [t / 4 for t in timeouts if t]
        self.tick = max(0.02, min([1.0, *limits]))
        self._partial: dict[Completion, tuple[float, bool]] = {}  # first answer, warned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (idempotent; a watchdog never started just stays so)."""
        self._stop.set()
        self._dispatcher.background_wanted.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        dispatcher = self._dispatcher
        last = time.monotonic()
        while not self._stop.is_set():
            if dispatcher.has_background_work():
                if not dispatcher.pump_in_background(self.tick, self._stop.is_set):
                    self._stop.wait(0.005)  # a waiting thread leads, and delivers meanwhile
            elif dispatcher.background_wanted.wait(self.tick):
                dispatcher.background_wanted.clear()
            now = time.monotonic()
            if now - last < self.tick or self._stop.is_set():
                continue
            # Woken far later than asked (this process was stopped or starved): the ranks'
            # heartbeats wait unread in the pipes. Read them before judging anyone.
            stalled = now - last > 4 * self.tick + 1.0
            last = now
            try:
                dispatcher.poll_now()
                if self.heartbeat_timeout and not stalled:
                    self._check_silence(time.monotonic())
                if self.straggler_warning:
                    self._check_stragglers(time.monotonic())
                if self._collectives is not None and not stalled:
                    self._collectives.check(time.monotonic())
            except Exception:  # the watchdog must keep watching
                logger.exception("phalanx watchdog check failed")

    # -- silence ----------------------------------------------------------------------

    def _check_silence(self, now: float) -> None:
        limit = self.heartbeat_timeout
        for entry in self._entries():
            # A rank is judged from its first message on: before that it is starting (an
            # interpreter on a slow disk), which start_timeout bounds.
            seen = entry.seen
            if (seen is not None and now - seen > limit  # type: ignore[operator]
                    and entry.state in _WATCHED):
                self._declare_unresponsive(entry, now - seen)

    def _declare_unresponsive(self, entry: RankEntry, silent: float) -> None:
        if not entry.suspect():
            return
        stack = self._take_stacks([entry]).get(entry.rank)
        self._dispatcher.poll_now()
        if time.monotonic() - entry.last_sign < self.heartbeat_timeout:  # type: ignore[operator]
            entry.clear_suspicion()  # it spoke meanwhile (the dump's signal woke it)
            return
        failure = ProcessFailure(
            entry.rank, entry.node, entry.pid, None,
            reason=(f"it gave no sign of life for {silent:.1f} s (heartbeat_timeout="
                    f"{self.heartbeat_timeout:g} s) and was killed: stopped, deadlocked, or "
                    "stuck in a C call that holds the GIL"),
            silent_for=silent, stack=stack,
        )
        where = innermost_user_frames(stack or "")
        logger.info("rank %d of group %s (node %d, pid %s) is unresponsive: silent for %.1f s%s; "
                    "killing it", entry.rank, self._dispatcher.group_name, entry.node, entry.pid,
                    silent, f", at {'; '.join(where)}" if where else "")
        # The record goes first: the rank's real death, reported after the kill, only adds
        # its exit status to it (see ProcessFailure.merged).
        self._dispatcher.post(entry.channel, [protocol.exited_message(entry.rank,
                                                                     failure.as_dict())])
        entry.channel.signal(entry.rank, signal.SIGKILL)
        self._dispatcher.poll_now()

    # -- stragglers -------------------------------------------------------------------

    def _check_stragglers(self, now: float) -> None:
        entries = {entry.rank: entry for entry in self._entries() if entry.alive}
        current: dict[Completion, None] = {}
        for entry in entries.values():
            for future in entry.pending.calls():
                current[future] = None
        for future in [f for f in self._partial if f not in current]:
            del self._partial[future]
        for future in current:
            late = future.late_ranks()
            called = len(future)
            if not late or len(late) == called or future.cancelled():
                continue
            first, warned = self._partial.setdefault(future, (now, False))
            if warned or now - first < self.straggler_warning:  # type: ignore[operator]
                continue
            self._partial[future] = (first, True)
            stacks = self._take_stacks([entries[r] for r in late if r in entries])
            where = ""
            for rank in late:
                frames = innermost_user_frames(stacks.get(rank, ""))
                where += f"\n  rank {rank}: " + ("; ".join(frames) or "(no user frame found)")
            logger.warning(
                "%s() was answered by %d of %d ranks of group %s %.0f s ago; still waiting for "
                "ranks %s (group.stacks() shows every thread). Where the late ranks are:%s",
                future.method, called - len(late), called, self._dispatcher.group_name,
                now - first, late, where,
            )
