"""Fault injection for users' own tests: ``WorkerGroup.inject_fault(rank, method, kind)``.

The controller checks the request and sends the rank an INJECT message; the rank arms it
and its next call of that method fails the chosen way instead of running -- a real
failure, on any backend, which the controller sees exactly as it would see the real one:

- ``"signal"``: the rank's process sends itself ``signal`` (default SIGKILL: WorkerDied
  naming the signal; SIGSEGV a crash; SIGSTOP a frozen process, declared unresponsive once
  ``heartbeat_timeout`` passes);
- ``"exit"``: the process exits with ``code`` at once, skipping cleanup (WorkerDied);
- ``"hang"``: the call never returns, while the process stays alive and answers
  heartbeats (a deadlocked collective: the caller's ``timeout`` raises CallTimeout);
- ``"raise"``: the method raises :class:`InjectedFault` (WorkerError, the rank stays up).
"""

from __future__ import annotations

import os
import signal as signals
import sys
import time
from typing import Any

KINDS = ("signal", "exit", "hang", "raise")


class InjectedFault(RuntimeError):
    """Raised in a rank by a fault injected with ``inject_fault(..., "raise")``."""


def argument_for(kind: str, *, signal: int, code: int, message: str | None) -> Any:
    """What the rank needs to fail as ``kind`` says; ValueError naming what was wrong."""
    if kind not in KINDS:
        raise ValueError(f"fault kind must be one of {', '.join(map(repr, KINDS))}, "
                         f"got {kind!r}")
    if kind == "signal":
        try:
            return int(signals.Signals(signal))
        except (ValueError, TypeError):
            raise ValueError(f"signal must be a signal number, got {signal!r}") from None
    if kind == "exit":
        if type(code) is not int or not 0 <= code <= 255:
            raise ValueError(f"exit code must be an int from 0 to 255, got {code!r}")
        return code
    if kind == "raise":
        if message is not None and not isinstance(message, str):
            raise TypeError(f"message must be a string, got {type(message).__name__}")
        return message
    return None


def perform(method: str, kind: str, argument: Any) -> None:
    """In the rank, instead of running ``method``: fail as armed."""
    if kind == "raise":
        raise InjectedFault(argument or f"fault injected into {method}()")
    sys.stdout.flush()
    sys.stderr.flush()
    if kind == "exit":
        os._exit(argument)
    if kind == "signal":
        os.kill(os.getpid(), argument)
        time.sleep(0.1)  # a signal that does not end the process: the call goes on
        return
    while True:  # "hang"
        time.sleep(3600)

