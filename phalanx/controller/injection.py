"""``WorkerGroup.inject_fault()``: a real failure on a rank's next call of a method, for
testing recovery code (what the rank does is :mod:`phalanx.rank.faults`)."""

from __future__ import annotations

import signal as signals
from typing import Any

from phalanx.rank.faults import argument_for
from phalanx.wire import protocol


class FaultInjection:
    """Mixin of :class:`~phalanx.controller.group.WorkerGroup`: ``inject_fault()``."""

    _slots: list[Any]
    _check_open: Any
    _check_method: Any
    world_size: int

    def inject_fault(self, rank: int, method: str, kind: str, *,
                     signal: int = signals.SIGKILL, code: int = 1,
                     message: str | None = None) -> None:
        """Make the next call of ``method`` on ``rank`` fail instead of running, for
        testing recovery code against real failures (on every backend):

        - ``"signal"``: the rank's process gets ``signal`` (default SIGKILL);
        - ``"exit"``: it exits with ``code`` at once;
        - ``"hang"``: the call never returns (the process stays alive and answers
          heartbeats, like a deadlocked collective; use a call ``timeout``);
        - ``"raise"``: the method raises :class:`InjectedFault` (``message``).

        Only the next call of ``method`` on ``rank`` is affected (including streamed
        calls); injecting again before it replaces the fault.
        """
        self._check_open()
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in 0..{self.world_size - 1}, got {rank!r}")
        self._check_method(method)
        argument = argument_for(kind, signal=signal, code=code, message=message)
        slot = self._slots[rank]
        if slot is None or not slot.alive:
            raise ValueError(f"rank {rank} is not running: there is nothing to inject into")
        slot.channel.send(protocol.inject_frame(rank, method, kind, argument))
