"""Waiting for a group's workers to become ready, and the errors when they do not."""

from __future__ import annotations

import time

from phalanx import config
from phalanx.controller.dispatch import Dispatcher, Slot
from phalanx.errors import StartupError, death_error
from phalanx.output.console import Progress


def await_ready(
    dispatcher: Dispatcher,
    slots: list[Slot],
    *,
    timeout: float,
    progress: bool | None,
    target_name: str,
    limit: str | None = None,
) -> None:
    """Return once every slot is ready; raise :class:`StartupError` at the first failure
    (a constructor that raised, a worker that died) or when ``timeout`` passes (``limit``
    names the setting that gave it, for the message)."""
    bar = Progress(f"starting {len(slots)} workers", len(slots), enabled=progress)
    deadline = time.monotonic() + timeout

    def failed() -> list[Slot]:
        return [s for s in slots if s.init_failure is not None or not s.alive]

    try:
        while True:
            step = deadline - time.monotonic()
            if bar.enabled:
                step = min(0.1, step)
            all_ready = dispatcher.wait(
                lambda: all(s.settled_start() for s in slots) or bool(failed()),
                max(step, 0.0),
            )
            bar.update(sum(s.ready for s in slots))
            if failed():
                raise startup_error(min(failed(), key=lambda s: s.rank))
            if all_ready:
                return
            if time.monotonic() >= deadline:
                late = [s.rank for s in slots if not s.ready]
                limit = limit or f"start_timeout= (or {config.ENV_START_TIMEOUT})"
                raise StartupError(
                    f"ranks {late} did not become ready within {timeout:g} s; raise "
                    f"{limit} if {target_name}() is slow to construct, or see what it "
                    "waits for",
                    rank=late[0],
                )
    finally:
        bar.close()


def startup_error(slot: Slot) -> StartupError:
    """The error for a slot whose constructor raised or whose process died."""
    failure = slot.init_failure
    if failure is not None:
        error = StartupError(
            f"rank {slot.rank} (node {slot.node}, pid {slot.pid}) failed while "
            f"{failure.stage}: {failure.exc_type}: {failure.message}\n\n"
            f"Remote traceback:\n{failure.traceback.rstrip()}",
            rank=slot.rank,
            traceback=failure.traceback,
        )
        original = failure.rebuild()
        if original is not None:
            error.__cause__ = original
        return error
    if slot.failure is None:  # pragma: no cover - a dead slot always has its record
        raise RuntimeError(f"rank {slot.rank} failed without a failure record")
    died = death_error(slot.failure)
    error = StartupError(f"rank {slot.rank} died during start-up: {died}", rank=slot.rank)
    error.__cause__ = died
    return error
