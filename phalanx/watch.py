"""Watching and signalling a group's ranks: ``health()`` and ``send_signal()``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.selection import Workers, select_ranks

if TYPE_CHECKING:
    from phalanx.dispatch import Dispatcher, Slot


@dataclasses.dataclass(frozen=True)
class RankHealth:
    """One rank's state as seen by the controller."""

    rank: int
    node: int
    pid: int | None
    alive: bool
    calls_in_flight: int
    exitcode: int | None


class Watching:
    """Mixin of :class:`~phalanx.group.WorkerGroup` over its slots and dispatcher."""

    _closed: bool
    _slots: list[Slot | None]
    _dispatcher: Dispatcher
    _check_open: Callable[[], None]

    def health(self) -> list[RankHealth]:
        """Every rank's state now (deaths that already happened are taken into account)."""
        if not self._closed:
            self._dispatcher.poll_now()
        report = []
        for rank, slot in enumerate(self._slots):
            if slot is None:
                continue
            report.append(
                RankHealth(
                    rank=rank,
                    node=slot.node,
                    pid=slot.pid,
                    alive=slot.alive and not self._closed,
                    calls_in_flight=len(slot.pending),
                    exitcode=slot.failure.exitcode if slot.failure else None,
                )
            )
        return report

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
