"""A controller that holds descriptors numbered past 1023 (``select``'s ``FD_SETSIZE``), as
one with a few hundred ranks does, three descriptors each: its ranks start, are replaced,
die and stop as fast as with few, on every backend. ``select.select`` refuses such a number;
waits that used it spun until their deadline (a shutdown took 35 s, a recreate 1 s)."""

from __future__ import annotations

import os
import time

import pytest

from phalanx import WorkerDied
from tests.workers import Probe

FD_SETSIZE = 1024


@pytest.fixture
def high_descriptors():
    """Every descriptor number below FD_SETSIZE + 64 taken: what opens now gets a higher one."""
    held = []
    try:
        while not held or held[-1] < FD_SETSIZE + 64:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.timeout(60)
def test_ranks_on_descriptors_past_fd_setsize_start_recreate_die_and_stop_promptly(
        high_descriptors, make_group, ranks):
    group = make_group(Probe, procs_per_node=2, start_timeout=30)
    assert group.call("rank", timeout=10) == [0, 1]

    started = time.monotonic()
    group.recreate(1, timeout=20)
    assert group.call("identity", "x", timeout=10) == ["x", "x"]
    took = time.monotonic() - started
    assert took < 5, f"recreate and a call took {took:.1f} s"

    future = group.call_async("sleep", 30, workers=[0])
    ranks.kill(group, 0, wait=False)
    started = time.monotonic()
    with pytest.raises(WorkerDied):
        future.result(10)
    took = time.monotonic() - started
    assert took < 3, f"a killed rank's call failed after {took:.1f} s"

    started = time.monotonic()
    group.shutdown(timeout=5)
    took = time.monotonic() - started
    assert took < 8, f"shutdown(timeout=5) took {took:.1f} s"
