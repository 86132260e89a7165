"""Watching and signalling a group's ranks: the :class:`Watcher` part behind
``health()``, ``stacks()``, ``startup_report()`` and ``send_signal()``, and the reports
they return.

The watcher only reads the rank table (each entry's state, its last sign of life, its
start-up timings) and asks the ranks' channels for stacks and signals; it changes no
entry. The watchdog (:mod:`phalanx.controller.watchdog`) uses its stack taking.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import TYPE_CHECKING

from phalanx import config
from phalanx.dumps import format_report
from phalanx.options import check_seconds
from phalanx.world.selection import Workers, select_ranks

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.ranks import RankEntry, RankTable
    from phalanx.controller.state import Gate


@dataclasses.dataclass(frozen=True)
class RankHealth:
    """One rank's state as seen by the controller.

    ``state`` is ``"starting"``, ``"ready"``, ``"unresponsive"`` (silent past
    ``heartbeat_timeout``: being killed) or ``"dead"`` (the words of the rank's
    :class:`~phalanx.controller.ranks.RankState`); ``last_seen`` is how many seconds
    ago the rank last gave a sign of life (a heartbeat or any message; None once dead);
    ``cause`` says how a dead rank's process ended (None while it runs, or when it was
    stopped).
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
    cause: str | None = None
    restarts: int = 0  # how many times its rank was started again (recreate, restart, ...)


class StackReport(dict[int, str]):
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


class StartupReport(list[RankStartup]):
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


def _startup(entry: RankEntry) -> RankStartup:
    t = entry.timings
    total = t.get("total")
    parts = [t.get(k) for k in ("interpreter", "waiting", "framework", "import", "constructor")]
    spawn = None if total is None else max(0.0, total - sum(p or 0.0 for p in parts[1:])
                                           - (parts[0] or 0.0))
    return RankStartup(entry.rank, total, spawn, *parts)


class Watcher:
    """Reads one group's rank table for its reports, takes stacks, sends signals.

    Interface: :meth:`health`, :meth:`stacks`, :meth:`startup_report`,
    :meth:`send_signal` (documented on the group's methods of the same names), and
    :meth:`take_stacks` / :meth:`stacks_of` for the watchdog and the dispatcher.
    """

    def __init__(self, table: RankTable, dispatcher: Dispatcher, gate: Gate) -> None:
        self._table = table
        self._dispatcher = dispatcher
        self._gate = gate

    def health(self) -> list[RankHealth]:
        """Every rank's state now (deaths that already happened are taken into account)."""
        closed = self._gate.closed
        if not closed:
            self._dispatcher.poll_now()
        now = time.monotonic()
        report = []
        for rank, entry in enumerate(self._table.entries):
            if entry is None:
                continue
            alive = entry.alive and not closed
            state = entry.state.health if alive else "dead"
            report.append(
                RankHealth(
                    rank=rank,
                    node=entry.node,
                    pid=entry.pid,
                    alive=alive and state != "unresponsive",
                    calls_in_flight=len(entry.pending),
                    exitcode=entry.failure.exitcode if entry.failure else None,
                    state=state,
                    last_seen=now - entry.last_sign if alive else None,
                    code_version=entry.code_version,
                    restarts=entry.restarts,
                    cause=(entry.failure.cause if entry.failure is not None and not alive
                           else None),
                )
            )
        return report

    def stacks(self, ranks: Workers, timeout: float) -> StackReport:
        """See :meth:`WorkerGroup.stacks <phalanx.controller.group.WorkerGroup.stacks>`."""
        self._gate.check()
        bound = check_seconds(timeout, "stacks timeout", allow_zero=False)
        self._dispatcher.poll_now()
        entries = [self._table.entries[r] for r in select_ranks(ranks, self._table.alive_flags())]
        return self.take_stacks([s for s in entries if s is not None],
                                config.STACKS_TIMEOUT if bound is None else bound)

    def take_stacks(self, entries: list[RankEntry],
                    timeout: float = config.STACKS_TIMEOUT) -> StackReport:
        """Every thread's stack of each of ``entries``, taken at once."""
        def take(entry: RankEntry) -> str:
            if not entry.alive:
                return "(no stack: the rank is dead)"
            return entry.channel.stacks(entry.rank, timeout)

        if len(entries) == 1:
            texts = [take(entries[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(32, len(entries) or 1)) as pool:
                texts = list(pool.map(take, entries))
        titles = {s.rank: f"rank {s.rank} (node {s.node}, pid {s.pid})" for s in entries}
        return StackReport({s.rank: t for s, t in zip(entries, texts, strict=True)}, titles)

    def stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """The stacks of those of ``ranks`` that are alive (for a CallTimeout)."""
        entries = [self._table.entries[r] for r in ranks]
        return dict(self.take_stacks([s for s in entries if s is not None and s.alive]))

    def startup_report(self) -> StartupReport:
        """Where each rank's start-up time went (a row per rank started)."""
        return StartupReport(_startup(s) for s in self._table.known())

    def send_signal(self, sig: int, workers: Workers) -> None:
        """See :meth:`WorkerGroup.send_signal
        <phalanx.controller.group.WorkerGroup.send_signal>`."""
        self._gate.check()
        entries = self._table.entries
        for rank in select_ranks(workers, self._table.alive_flags()):
            entry = entries[rank]
            if entry is not None and entry.alive:
                entry.channel.signal(rank, sig)
