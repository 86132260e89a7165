"""Watching and signalling a group's ranks: ``health()``, ``stacks()``,
``startup_report()`` and ``send_signal()``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx import config
from phalanx.dumps import format_report
from phalanx.options import check_seconds
from phalanx.world.selection import Workers, select_ranks

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher, Slot


@dataclasses.dataclass(frozen=True)
class RankHealth:
    """One rank's state as seen by the controller.

    ``state`` is ``"starting"``, ``"ready"``, ``"unresponsive"`` (silent past
    ``heartbeat_timeout``: being killed) or ``"dead"``; ``last_seen`` is how many seconds
    ago the rank last gave a sign of life (a heartbeat or any message; None once dead).
    """

    rank: int
    node: int
    pid: int | None
    alive: bool
    calls_in_flight: int
    exitcode: int | None
    state: str = "ready"
    last_seen: float | None = None
    code_version: str | None = None  # the shipped code it runs (ClusterBackend(sync=...))


class StackReport(dict):
    """``rank -> text`` of every thread's Python stack; ``str()`` shows them all, each
    under a header naming the rank, its node and pid."""

    def __init__(self, stacks: dict[int, str], titles: dict[int, str]) -> None:
        super().__init__(stacks)
        self.titles = titles

    def __str__(self) -> str:
        return format_report(dict(self), self.titles)


@dataclasses.dataclass(frozen=True)
class RankStartup:
    """Where one rank's start-up time went, in seconds (None: not measured)."""

    rank: int
    total: float | None  # from its launch to READY, seen from the controller
    spawn: float | None  # launching the process, until its interpreter ran (the rest)
    interpreter: float | None  # the interpreter's own start and phalanx's imports
    waiting: float | None  # from then until its INIT arrived
    framework: float | None  # the framework's set-up (env, services)
    imports: float | None  # unpickling the target: importing the user's modules
    constructor: float | None  # the worker object's constructor


class StartupReport(list):
    """One :class:`RankStartup` per rank; ``str()`` is a table."""

    def __str__(self) -> str:
        def cell(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        head = ("rank", "total", "spawn", "interpreter", "waiting", "framework", "imports",
                "constructor")
        rows = [head] + [(str(r.rank), *(cell(getattr(r, f)) for f in head[1:])) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                         for row in rows)


def _startup(slot: Slot) -> RankStartup:
    t = slot.timings
    total = t.get("total")
    parts = [t.get(k) for k in ("interpreter", "waiting", "framework", "import", "constructor")]
    spawn = None if total is None else max(0.0, total - sum(p or 0.0 for p in parts[1:])
                                           - (parts[0] or 0.0))
    return RankStartup(slot.rank, total, spawn, *parts)


class Watching:
    """Mixin of :class:`~phalanx.controller.group.WorkerGroup` over its slots and dispatcher."""

    _closed: bool
    _slots: list[Slot | None]
    _dispatcher: Dispatcher
    _check_open: Callable[[], None]

    def health(self) -> list[RankHealth]:
        """Every rank's state now (deaths that already happened are taken into account)."""
        if not self._closed:
            self._dispatcher.poll_now()
        now = time.monotonic()
        report = []
        for rank, slot in enumerate(self._slots):
            if slot is None:
                continue
            alive = slot.alive and not self._closed
            if not alive:
                state = "dead"
            elif slot.unresponsive:
                state = "unresponsive"
            else:
                state = "ready" if slot.ready else "starting"
            report.append(
                RankHealth(
                    rank=rank,
                    node=slot.node,
                    pid=slot.pid,
                    alive=alive and not slot.unresponsive,
                    calls_in_flight=len(slot.pending),
                    exitcode=slot.failure.exitcode if slot.failure else None,
                    state=state,
                    last_seen=now - slot.seen if alive else None,
                    code_version=slot.code_version,
                )
            )
        return report

    def stacks(self, ranks: Workers = "ready",
               timeout: float = config.STACKS_TIMEOUT) -> StackReport:
        """Every thread's Python stack of the selected ranks, taken now, even while their
        main thread is stuck in user code or in a C call (``str()`` of the result shows
        them with a header per rank). A rank that cannot dump (stopped with SIGSTOP, still
        starting) gets a line saying why."""
        self._check_open()
        timeout = check_seconds(timeout, "stacks timeout", allow_zero=False)
        self._dispatcher.poll_now()
        alive = [s is not None and s.alive for s in self._slots]
        slots = [self._slots[r] for r in select_ranks(ranks, alive)]
        return self._take_stacks([s for s in slots if s is not None], timeout)

    def _live_slots(self) -> list[Slot]:
        return [s for s in self._slots if s is not None and s.alive]

    def _take_stacks(self, slots: list[Slot],
                     timeout: float = config.STACKS_TIMEOUT) -> StackReport:
        def take(slot: Slot) -> str:
            if not slot.alive:
                return "(no stack: the rank is dead)"
            return slot.channel.stacks(slot.rank, timeout)

        if len(slots) == 1:
            texts = [take(slots[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(32, len(slots) or 1)) as pool:
                texts = list(pool.map(take, slots))
        titles = {s.rank: f"rank {s.rank} (node {s.node}, pid {s.pid})" for s in slots}
        return StackReport({s.rank: t for s, t in zip(slots, texts, strict=True)}, titles)

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        slots = [self._slots[r] for r in ranks]
        return dict(self._take_stacks([s for s in slots if s is not None and s.alive]))

    def startup_report(self) -> StartupReport:
        """Where each rank's start-up time went (spawning, the interpreter, the framework,
        importing the user's code, the constructor); ``str()`` is a table."""
        return StartupReport(_startup(s) for s in self._slots if s is not None)

    def send_signal(self, sig: int, workers: Workers = "all") -> None:
        """Send a signal (``signal.SIGINT``, ...) to the selected live ranks' processes and
        their process groups; ranks already dead are skipped. SIGINT raises
        ``KeyboardInterrupt`` in a running method, which fails that call with
        :class:`~phalanx.errors.WorkerError`."""
        self._check_open()
        alive = [s is not None and s.alive for s in self._slots]
        for rank in select_ranks(workers, alive):
            slot = self._slots[rank]
            if slot is not None and slot.alive:
                slot.channel.signal(rank, sig)
