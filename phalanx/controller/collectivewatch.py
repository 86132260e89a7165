"""Stuck collectives told, and the ranks waiting in them released (``collective_timeout``).

Every rank reports which collectives it is inside (:mod:`phalanx.rank.collectives`, sent
with its heartbeats when that changes). On each of the watchdog's ticks
:meth:`CollectiveWatch.check` gathers the reports (:func:`phalanx.world.stuck.gather`):
for every collective some ranks are in, the members that are not (``absent``) and those in
it with other arguments (``odd``). A collective with neither is only slow, and left alone.
Otherwise:

- after ``straggler_warning`` seconds, a warning names the ranks not in it and where their
  code is (the ranks the others wait *for*, not the ones waiting); when such a rank enters
  late and the collective completes, how late it entered is logged;
- after ``collective_timeout`` seconds -- at once when an absent member is dead, as it can
  never enter -- the collective is stuck. The calls pending on the group's ranks are taken
  from them, the ranks are released, and then those calls fail with
  :class:`~phalanx.errors.CollectiveStuck` naming the culprits (what each was doing:
  returned from the method, in another call or collective, stopped, dead, or in it with
  another shape), the waiting ranks, and how they were released.

Releasing: gloo cannot abort a collective in flight (its ``abort()`` returns, the wait goes
on), and a fresh rank cannot join a world whose other members still hold the old one. So
every rank of the group is recreated on a new rendezvous (``release``, the group's
lifecycle's), as a restart does: the constructors form the world again, and the group
answers calls once they are up. The error, the log and ``group.health()``'s ranks say so.
A rank that died inside the collective has already failed its call (``WorkerDied``); the
survivors are released the same way, and the log says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.dumps import innermost_user_frames
from phalanx.errors import CollectiveStuck
from phalanx.world import stuck

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import Completion
    from phalanx.controller.ranks import RankEntry, RankTable

logger = logging.getLogger(__name__)

Release = Callable[[str], str]  # why -> what was done (raises when it could not be)
StackTaker = Callable[[list["RankEntry"]], dict[int, str]]


class CollectiveWatch:
    """Judges a group's collectives on each tick (see the module docstring). ``release``
    is set by the group once its lifecycle exists."""

    def __init__(self, dispatcher: Dispatcher, table: RankTable, take_stacks: StackTaker, *,
                 timeout: float | None, straggler_warning: float | None,
                 interval: float) -> None:
        self._dispatcher = dispatcher
        self._table = table
        self._take_stacks = take_stacks
        self.timeout = timeout
        self.straggler_warning = straggler_warning
        # seconds between a rank's reports; two missed (and a margin) mean "stopped"
        self._interval = interval
        self._silence = 2 * interval + 0.5
        self.release: Release | None = None
        self._first: dict[tuple[str, int], float] = {}  # first seen incomplete (monotonic)
        self._warned: dict[tuple[str, int], stuck.Waiting] = {}  # late entrants to report
        self._gone: dict[tuple[str, int], float] = {}  # warned, no rank in it since (when)
        self._releasing = threading.Event()

    @property
    def active(self) -> bool:
        return self.timeout is not None or self.straggler_warning is not None

    def check(self, now: float) -> None:
        """One look at every live rank's reports (the watchdog's thread)."""
        if self._releasing.is_set():
            return
        reports = []
        reporters = self._dispatcher.collective_reporters
        # (a copy made at once, the pump adds to it; in rank order, as the reports are told)
        for entry in sorted(list(reporters), key=_rank_of):
            current = self._table.entries
            if not entry.alive or not (0 <= entry.rank < len(current)
                                       and current[entry.rank] is entry):
                reporters.discard(entry)  # a dead or replaced rank's reports are no state
                continue
            if entry.collectives is None:
                continue
            for fields in entry.collectives[0]:
                try:
                    reports.append(stuck.Inside.parse(entry.rank, fields))
                except ValueError:
                    continue
        waits = stuck.gather(reports, len(self._table))
        keys = {w.key for w in waits}
        self._report_late_entries(keys, now)
        for key in [k for k in self._first if k not in keys]:
            del self._first[key]
        for waiting in waits:
            if waiting.complete or self._completed(waiting):
                continue
            first = self._first.setdefault(waiting.key, now)
            waited = now - first
            # a dead member never enters: stuck once the others' reports are fresh
            dead = [r for r in waiting.absent if not self._alive(r)]
            if self.timeout is not None and (
                    (dead and waited >= 2 * self._interval) or waited >= self.timeout):
                self._stuck(waiting, dead)
                return  # every rank is being released: the rest is moot
            if (self.straggler_warning is not None and waited >= self.straggler_warning
                    and waiting.key not in self._warned):
                self._warn(waiting, waited)

    # -- reading the table ----------------------------------------------------------------

    def _entry(self, rank: int) -> RankEntry | None:
        return self._table.entries[rank] if 0 <= rank < len(self._table) else None

    def _alive(self, rank: int) -> bool:
        entry = self._entry(rank)
        return entry is not None and entry.alive

    def _completed(self, waiting: stuck.Waiting) -> bool:
        """Whether an absent member has completed it already: the others' reports are
        older than their leaving it (a heartbeat late), not a wait."""
        for rank in waiting.absent:
            entry = self._entry(rank)
            done = None if entry is None else _last_of(entry, waiting.group)
            if done is not None and done[0] >= waiting.seq:
                return True
        return False

    def _doing(self, rank: int, waiting: stuck.Waiting, method: str | None) -> str:
        """What an absent (or odd) member was doing instead of waiting with the others."""
        if rank in waiting.odd:
            return f"it entered {waiting.odd[rank]} where the others entered {waiting.common}"
        entry = self._entry(rank)
        if entry is None or not entry.alive:
            cause = entry.failure.cause if entry is not None and entry.failure else None
            where = " inside it" if entry is not None and _was_inside(entry, waiting) else ""
            return f"it died{where} ({cause})" if cause else f"it died{where}"
        silent = time.monotonic() - entry.last_sign
        if silent > self._silence:
            return f"it is stopped or hung (silent for {silent:.1f} s)"
        if entry.collectives is not None:
            for fields in entry.collectives[0]:
                try:
                    other = stuck.Inside.parse(rank, fields)
                except ValueError:
                    continue
                return (f"it is in {other.op} #{other.seq} of process group {other.group} "
                        f"instead (the others are at #{waiting.seq})")
        calls = sorted({f.method for f in entry.pending.values() if f.method != method})
        if calls:
            return f"it is in {', '.join(c + '()' for c in calls)}"
        if method is not None and any(f.method == method for f in entry.pending.values()):
            return f"it is still in {method}()"
        if method is not None:
            return f"it returned from {method}()"
        return "it is idle"

    def _method_of(self, waiting: stuck.Waiting) -> str | None:
        """The method the waiting ranks' call runs (the one they are in)."""
        for rank in waiting.inside:
            entry = self._entry(rank)
            if entry is not None:
                for future in entry.pending.values():
                    return future.method
        return None

    # -- slow: name who the others wait for ------------------------------------------------

    def _warn(self, waiting: stuck.Waiting, waited: float) -> None:
        self._warned[waiting.key] = waiting
        method = self._method_of(waiting)
        absent = list(waiting.absent) + list(waiting.odd)
        live = [e for e in (self._entry(r) for r in absent) if e is not None and e.alive]
        stacks = self._take_stacks(live) if live else {}
        lines = ""
        for rank in absent:
            frames = innermost_user_frames(stacks.get(rank, ""))
            lines += (f"\n  rank {rank}: {self._doing(rank, waiting, method)}"
                      + (f", at {'; '.join(frames)}" if frames else ""))
        logger.warning(
            "ranks %s of group %s have waited %.0f s in %s (#%d of process group %s) for "
            "ranks %s:%s", stuck.ranges(waiting.inside), self._dispatcher.group_name, waited,
            waiting.op, waiting.seq, waiting.group, stuck.ranges(absent), lines)

    def _report_late_entries(self, current: set[tuple[str, int]], now: float) -> None:
        """A warned-about collective whose absent ranks entered it since: how late. One
        that no rank is in any more, and that they did not complete, ended otherwise (an
        error, a death): it is forgotten."""
        for key, waiting in list(self._warned.items()):
            group, seq = key
            entered = {}
            for rank in waiting.absent:
                entry = self._entry(rank)
                if entry is None or not entry.alive:
                    del self._warned[key]
                    break
                done = _last_of(entry, group)
                if done is None or done[0] < seq:
                    # its report may come a heartbeat after the others': a grace first
                    if key in current:
                        self._gone.pop(key, None)
                    elif now - self._gone.setdefault(key, now) > 3 * self._interval:
                        del self._warned[key]
                        del self._gone[key]
                    break
                entered[rank] = done[2]
            else:
                del self._warned[key]
                self._gone.pop(key, None)
                for rank, at in sorted(entered.items()):
                    logger.warning(
                        "rank %d of group %s entered %s (#%d of process group %s) %.1f s after "
                        "ranks %s did", rank, self._dispatcher.group_name, waiting.op, seq,
                        group, at - waiting.since, stuck.ranges(waiting.inside))

    # -- stuck: fail the calls, release the ranks ----------------------------------------

    def _stuck(self, waiting: stuck.Waiting, dead: list[int]) -> None:
        method = self._method_of(waiting)
        culprits = {r: self._doing(r, waiting, method)
                    for r in [*waiting.absent, *waiting.odd]}
        name = self._dispatcher.group_name
        since = time.strftime("%H:%M:%S", time.localtime(waiting.since))
        waiting_ranks = [r for r in waiting.inside if r not in waiting.odd]
        parts = []
        for rank, doing in culprits.items():
            if rank in waiting.odd or doing.startswith("it died inside"):
                parts.append(f"rank {rank}: {doing}")
            else:
                parts.append(f"rank {rank} never entered {waiting.op} ({doing})")
        head = (f"{'; '.join(parts)}: ranks {stuck.ranges(waiting_ranks)} of group {name} "
                f"wait in {waiting.op} (#{waiting.seq} of process group {waiting.group}) "
                f"since {since}")
        # Their calls are taken now: the kills below must not fail them as deaths.
        taken: list[tuple[int, Completion]] = []
        for entry in self._table.live():
            taken.extend((entry.rank, f) for f in entry.take_pending())
        logger.warning("%s; releasing them", head)
        self._releasing.set()
        threading.Thread(target=self._release, args=(waiting, culprits, head, taken),
                         name="phalanx-release", daemon=True).start()

    def _release(self, waiting: stuck.Waiting, culprits: dict[int, str], head: str,
                 taken: list[tuple[int, Completion]]) -> None:
        began = time.monotonic()
        try:
            if self.release is None:
                released = "nothing was released (the group is not running)"
            else:
                released = self.release(head)
        except Exception as exc:  # noqa: BLE001 - told in the error, whatever it was
            released = f"releasing them failed: {exc}"
        else:
            released += f" in {time.monotonic() - began:.1f} s"
        finally:
            self._first.clear()
            self._warned.clear()
            self._gone.clear()
            self._releasing.clear()
        logger.warning("group %s: %s", self._dispatcher.group_name, released)
        name = self._dispatcher.group_name
        waits = {r: waiting.op for r in waiting.inside if r not in waiting.odd}
        for rank, future in taken:
            future.fail_rank(rank, CollectiveStuck(
                f"{future.method}() on group {name}: {head}; {released}",
                culprits=culprits, waiting=waits, collective=waiting.op,
                since=waiting.since, released=released, group=name))
        self._dispatcher.wake_waiters()


def _rank_of(entry: RankEntry) -> int:
    return entry.rank


def _was_inside(entry: RankEntry, waiting: stuck.Waiting) -> bool:
    """Whether ``entry`` last reported being inside ``waiting``'s collective."""
    if entry.collectives is None:
        return False
    return any(len(f) == 7 and f[0] == waiting.group and f[1] == waiting.seq
               for f in entry.collectives[0])


def _last_of(entry: RankEntry, group: str) -> list[float] | None:
    """``[seq, op, entered, left]`` of the last collective ``entry`` completed on
    process group ``group`` (None when it reported none)."""
    if entry.collectives is None:
        return None
    for fields in entry.collectives[1]:
        if len(fields) == 5 and fields[0] == group and isinstance(fields[1], int):
            return list(fields[1:])
    return None
