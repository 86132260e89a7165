"""Crash matrix (in the style of loky's reusable-executor crash tests).

Every crash point of a call x every way of failing -> the error the controller must raise,
naming the right rank; afterwards the group still works (after ``recreate`` where the
worker died). Rank 1 gets the crashing argument or result, rank 0 a harmless one.
"""

from __future__ import annotations

import time

import pytest

from phalanx import SerializationError, WorkerDied, WorkerError
from tests import helpers
from tests.workers import CRASH_KINDS, CrashError, CrashOnPickle, CrashOnUnpickle, Probe

# crash point -> (side, stage as phalanx names it)
POINTS = {
    "pickle-args": ("controller", "pickling the arguments"),
    "unpickle-args": ("worker", "unpickling the arguments"),
    "run-method": ("worker", "running the method"),
    "pickle-result": ("worker", "pickling the result"),
    "unpickle-result": ("controller", "unpickling the result"),
}

# kind -> (exit code, signal name) of a worker that dies that way
DEATHS = {
    "sys.exit": (5, None),
    "os._exit": (3, None),
    "SIGSEGV": (-11, "SIGSEGV"),
    "SIGKILL": (-9, "SIGKILL"),
}


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Probe, procs_per_node=2, backend=backend, echo_output=False
    ) as group:
        yield group


@pytest.fixture
def live_group(group):
    """Start every case with both ranks alive (a failed case must not poison the next)."""
    for health in group.health():
        if not health.alive:
            group.recreate(health.rank)
    return group


def run_crashing_call(group, point: str, kind: str):
    if point == "pickle-args":
        return group.map("identity", ["fine", CrashOnPickle(kind)], timeout=30)
    if point == "unpickle-args":
        return group.map("identity", ["fine", CrashOnUnpickle(kind)], timeout=30)
    if point == "run-method":
        return group.map("crash_running", [None, kind], timeout=30)
    if point == "pickle-result":
        return group.map("return_crash_on_pickle", [None, kind], timeout=30)
    if point == "unpickle-result":
        return group.map("return_crash_on_unpickle", [None, kind], timeout=30)
    raise AssertionError(point)


@pytest.mark.parametrize("kind", CRASH_KINDS)
@pytest.mark.parametrize("point", list(POINTS))
def test_crash(live_group, point, kind):
    side, stage = POINTS[point]
    if side == "controller" and kind != "exception":
        pytest.skip(f"{kind} while {stage} would end the controller (the test process) itself")
    group = live_group
    pids = group.call("pid")

    started = time.monotonic()
    if side == "controller":
        with pytest.raises(SerializationError) as info:
            run_crashing_call(group, point, kind)
        assert info.value.stage == stage
        assert info.value.rank == 1
        assert isinstance(info.value.__cause__, CrashError)
    elif kind == "exception":
        with pytest.raises(WorkerError) as info:
            run_crashing_call(group, point, kind)
        error = info.value
        assert error.stage == stage
        assert (error.rank, error.pid) == (1, pids[1])
        assert error.exc_type == "CrashError"
        assert isinstance(error.__cause__, CrashError)
        assert "injected failure" in error.traceback
        if stage != "running the method":
            assert f"while {stage}" in str(error)
    else:
        with pytest.raises(WorkerDied) as info:
            run_crashing_call(group, point, kind)
        died = info.value
        exitcode, signal_name = DEATHS[kind]
        assert (died.rank, died.pid) == (1, pids[1])
        assert died.exitcode == exitcode
        assert died.signal == signal_name
    assert time.monotonic() - started < 5, "the failure must be reported promptly"

    worker_died = side == "worker" and kind != "exception"
    assert [h.alive for h in group.health()] == [True, not worker_died]
    if worker_died:
        with pytest.raises(WorkerDied):
            group.call("pid")
        group.recreate(1)
    after = group.call("pid", timeout=10)
    assert after[0] == pids[0]
    assert (after[1] != pids[1]) is worker_died
    assert group.map("add", [1, 2], b=[1, 1], timeout=10) == [2, 3]
