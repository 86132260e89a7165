"""Watching the processes a rank started: each rank's sleepers (``Supervised.spawn_tree``)
and phalanx's own processes, which a test must see gone within the promise, on any backend.

The ``tracked`` fixture (tests/conftest.py) gives a :class:`Tracked`; whatever is left
when the test ends is SIGKILLed, so that a failing test leaks nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest

from tests import helpers

GONE_WITHIN = 2.0  # seconds, the promise
# What the checks wait before failing: the promise plus slack for a loaded CI machine
# (the failure message reports the time it really took).
WAIT = GONE_WITHIN + 1.0
KINDS = {"same_group": "1000", "new_session": "1001", "shell_background": "1002",
         "double_fork": "1003"}


def _every(label: str) -> bool:
    return True


class Tracked:
    """Processes a test must see gone (psutil refuses to signal a pid that was reused)."""

    def __init__(self) -> None:
        self.procs: dict[int, tuple[str, psutil.Process]] = {}

    def add(self, pid: int, label: str) -> None:
        try:
            self.procs[pid] = (label, psutil.Process(pid))
        except psutil.NoSuchProcess:
            pytest.fail(f"{label} (pid {pid}) was gone before the test could check it")

    def add_trees(self, trees: list[dict[str, int]], ranks: list[int] | None = None) -> None:
        """The sleepers of ``spawn_tree`` on each rank, checked to be what they claim."""
        for rank, tree in zip(ranks or range(len(trees)), trees, strict=True):
            assert sorted(tree) == sorted(KINDS)
            for kind, pid in tree.items():
                label = f"rank {rank}'s {kind} sleeper"
                self.add(pid, label)
                proc = self.procs[pid][1]
                # a shell's background job may be reported just before its exec
                assert helpers.wait_until(
                    lambda p=proc, k=kind: p.cmdline() == ["sleep", KINDS[k]], 5), \
                    f"{label} runs {proc.cmdline()}"

    def _running(self, which: Callable[[str], bool] = _every) -> list[tuple[str, psutil.Process]]:
        running = []
        for label, proc in self.procs.values():
            if not which(label):
                continue
            try:  # a zombie has ended; an orphan's may wait a while for its reaper
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    running.append((label, proc))
            except psutil.NoSuchProcess:
                pass
        return running

    def alive(self, which: Callable[[str], bool] = _every) -> list[str]:
        """Those ``which`` accepts (by label) that still run."""
        return [f"{label} (pid {proc.pid})" for label, proc in self._running(which)]

    def assert_gone(self, since: float, what: str, which: Callable[[str], bool] = _every) -> None:
        """Those ``which`` accepts (by label) are gone within the promise."""
        helpers.wait_until(lambda: not self.alive(which), WAIT, interval=0.01)
        took = time.monotonic() - since
        left = self.alive(which)
        assert not left, f"{len(left)} process(es) outlived {what} by {took:.1f} s " \
                         f"(must be < {GONE_WITHIN:g} s): {left}"
        assert took < WAIT, f"{what}: took {took:.1f} s (must be < {GONE_WITHIN:g} s)"

    def kill_all(self) -> None:
        # zombies are left out: one whose parent died waits for this machine's init to
        # reap it, which may take a while, and it is harmless meanwhile
        procs = [proc for _, proc in self._running()]
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=3)
