"""A controller that holds descriptors numbered past 1023 (``select``'s ``FD_SETSIZE``), as
one with a few hundred ranks does, three descriptors each: its ranks start, are replaced,
die and stop as fast as with few, on every backend. ``select.select`` refuses such a number;
waits that used it spun until their deadline (a shutdown took 35 s, a recreate 1 s)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from phalanx import WorkerDied
from tests.workers import Probe

FD_SETSIZE = 1024


# Each step's time beside the same step's with few descriptors, on this machine as loaded
# now: the fault spun each wait to its deadline (seconds to tens of seconds), while a
# loaded machine slows both measurements alike. The slack absorbs a burst of load between.
SLOWER = 3.0
SLACK = 2.0  # seconds


def _timed(step: Callable[[], object]) -> float:
    started = time.monotonic()
    step()
    return time.monotonic() - started


@pytest.fixture
def hold_high_descriptors():
    """A function that takes every descriptor number below FD_SETSIZE + 64: what opens
    after it gets a higher one. They are given back when the test ends."""
    held: list[int] = []

    def hold() -> None:
        while not held or held[-1] < FD_SETSIZE + 64:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))

    try:
        yield hold
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.timeout(120)
def test_ranks_on_descriptors_past_fd_setsize_start_recreate_die_and_stop_promptly(
        hold_high_descriptors, make_group, ranks):
    group = make_group(Probe, procs_per_node=2, start_timeout=30)
    assert group.call("rank", timeout=10) == [0, 1]

    def recreate_both() -> None:  # fresh ranks: their descriptors are taken now
        group.recreate([0, 1], timeout=20)
        assert group.call("identity", "x", timeout=10) == ["x", "x"]

    def kill_one() -> None:  # a killed rank's pending call fails
        future = group.call_async("sleep", 30, workers=[0])
        ranks.kill(group, 0, wait=False)
        with pytest.raises(WorkerDied):
            future.result(10)

    baseline_recreate = _timed(recreate_both)  # with few descriptors
    baseline_kill = _timed(kill_one)

    hold_high_descriptors()
    took = _timed(recreate_both)  # both ranks' streams now past FD_SETSIZE
    bound = SLOWER * baseline_recreate + SLACK
    assert took < bound, (f"recreate and a call took {took:.1f} s past FD_SETSIZE, "
                          f"{baseline_recreate:.1f} s below it")
    took = _timed(kill_one)
    bound = SLOWER * baseline_kill + SLACK
    assert took < bound, (f"a killed rank's call failed after {took:.1f} s past FD_SETSIZE, "
                          f"{baseline_kill:.1f} s below it")

    took = _timed(lambda: group.shutdown(timeout=5))
    # its timeout, and as much again for a loaded machine: the fault made it 35 s
    assert took < 10, f"shutdown(timeout=5) took {took:.1f} s"
