"""``WorkerGroup.inject_fault()``: a real failure on a rank's next call of a method, for
testing recovery code. The controller only checks the request and sends one INJECT frame
to the rank; what the rank then does is :mod:`phalanx.rank.faults`."""

from __future__ import annotations

import signal as signals
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.rank.faults import argument_for
from phalanx.wire import protocol

if TYPE_CHECKING:
    from phalanx.controller.ranks import RankTable


def inject_fault(table: RankTable, check_method: Callable[[str], None], rank: int,
                 method: str, kind: str, *, signal: int = signals.SIGKILL, code: int = 1,
                 message: str | None = None) -> None:
    """Have ``rank``'s next call of ``method`` fail as ``kind`` says (see
    :meth:`WorkerGroup.inject_fault <phalanx.controller.group.WorkerGroup.inject_fault>`):
    ValueError for a rank outside the group or not running, the method checked by
    ``check_method``, the fault's arguments by :func:`~phalanx.rank.faults.argument_for`."""
    if type(rank) is not int or not 0 <= rank < len(table):
        raise ValueError(f"rank must be an int in 0..{len(table) - 1}, got {rank!r}")
    check_method(method)
    argument = argument_for(kind, signal=signal, code=code, message=message)
    entry = table.entries[rank]
    if entry is None or not entry.alive:
        raise ValueError(f"rank {rank} is not running: there is nothing to inject into")
    entry.channel.send(protocol.inject_frame(rank, method, kind, argument))
