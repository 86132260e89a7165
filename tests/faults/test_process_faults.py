"""Process-level faults: controller SIGKILL, stopped workers, deaths mid-call and their reports."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

from phalanx import CallTimeout, WorkerDied, WorkerGroup
from tests import helpers
from tests.workers import Probe


@pytest.mark.parametrize("nodes", [1, 2])
def test_workers_exit_when_the_controller_is_sigkilled(backend, tmp_path, nodes):
    script = helpers.write_script(tmp_path, f"""
        import json, time
        import phalanx as px
        from tests.workers import Probe

        group = px.WorkerGroup(Probe, nodes={nodes}, procs_per_node={4 // nodes},
                               backend={backend!r}, echo_output=False)
        print(json.dumps(group.call("pid")), flush=True)
        time.sleep(60)
    """)
    with helpers.running_script(script) as controller:
        ready, _, _ = select.select([controller.stdout], [], [], 30)
        assert ready, "the controller script did not start its workers"
        pids = json.loads(controller.stdout.readline())
        assert len(pids) == 4 and all(helpers.pid_alive(p) for p in pids)
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(10)
        assert helpers.wait_dead(pids, 2), "workers outlived their SIGKILLed controller"


@pytest.fixture
def pair(make_group):
    group = make_group(Probe, procs_per_node=2)
    return group, group.call("pid")


def test_a_stopped_worker_times_out_and_resumes(pair, ranks):
    group, _ = pair
    future = group.call_async("sleep", 0.3, value="finished", workers=[1])
    ranks.stop(group, 1)
    try:
        started = time.monotonic()
        with pytest.raises(CallTimeout) as info:
            future.result(timeout=1.0)
        assert 0.9 < time.monotonic() - started < 5  # its 1 s, room for a loaded machine
        assert info.value.pending_ranks == [1]
        assert group.call("rank", workers=[0], timeout=5) == [0]  # the others are unaffected
    finally:
        ranks.resume(group, 1)
    assert future.result(timeout=10) == ["finished"]
    assert group.call("rank", timeout=10) == [0, 1]


def test_a_stopped_worker_that_is_killed_is_reported_dead(pair, ranks):
    group, _ = pair
    future = group.call_async("sleep", 0.3)
    ranks.stop(group, 0)
    with pytest.raises(CallTimeout) as info:
        future.result(timeout=0.5)
    assert info.value.pending_ranks == [0]
    ranks.kill(group, 0, wait=False)
    with pytest.raises(WorkerDied) as info:
        future.result(timeout=5)
    assert (info.value.rank, info.value.signal) == (0, "SIGKILL")
    group.recreate(0)
    assert group.call("rank", timeout=10) == [0, 1]


def test_a_worker_killed_while_a_large_argument_is_in_transit(pair, ranks):
    group, _ = pair
    array = np.ones(32 * 1024 * 1024 // 8)  # 32 MiB: more than the socket buffers hold
    future = group.call_async("array_summary", array)
    ranks.kill(group, 1, wait=False)
    with pytest.raises(WorkerDied) as info:
        future.result(timeout=10)
    assert info.value.rank == 1
    group.recreate(1)
    assert [s["sum"] for s in group.call("array_summary", array, timeout=30)] == [array.size] * 2


def test_worker_died_carries_the_last_stderr_lines(pair):
    group, pids = pair
    lines = [f"diagnostic line {i}" for i in range(30)]
    with pytest.raises(WorkerDied) as info:
        group.call_one(1, "exit_with", 3, tuple(lines), timeout=10)
    died = info.value
    assert (died.rank, died.pid, died.exitcode, died.signal) == (1, pids[1], 3, None)
    assert died.method == "exit_with"
    assert died.stderr_tail, "the last stderr lines must be kept"
    assert list(died.stderr_tail) == lines[-len(died.stderr_tail):]
    assert "diagnostic line 29" in str(died)
    assert "code 3" in died.cause


def test_lines_written_just_before_a_sigkill_are_in_its_error(pair):
    """The death is told as soon as the exit status is known, before the output's reader
    has seen the pipes end: what the rank wrote last must still be in the record."""
    group, _ = pair
    for attempt in range(6):
        lines = tuple(f"attempt {attempt} line {i}" for i in range(3))
        with pytest.raises(WorkerDied) as info:
            group.call_one(1, "kill_self", lines, timeout=10)
        died = info.value
        assert died.signal == "SIGKILL"
        assert list(died.stderr_tail)[-3:] == list(lines), died.stderr_tail
        group.recreate(1)


def test_sigkill_mid_call_fails_fast_and_suggests_out_of_memory(pair, ranks):
    group, _ = pair
    future = group.call_async("sleep", 5)
    time.sleep(0.1)
    ranks.kill(group, 1, wait=False)
    started = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        future.result(timeout=10)
    # rank 0 sleeps 5 s: the report comes well before (room for a loaded machine)
    assert time.monotonic() - started < 4, "rank 0's sleep must not delay the report"
    died = info.value
    assert (died.rank, died.exitcode, died.signal) == (1, -9, "SIGKILL")
    assert died.method == "sleep"
    assert "out-of-memory" in died.cause and "out-of-memory" in str(died)
    group.shutdown(timeout=0.2)  # rank 0 is still sleeping: do not wait for it


def test_ctrl_c_while_a_group_starts_leaves_no_worker_behind(backend):
    from tests.workers import SlowConstructor

    # SIGINT to ourselves mid-start, as a user pressing Ctrl-C in a terminal
    timer = threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            WorkerGroup(SlowConstructor, args=(30,), procs_per_node=2, backend=backend,
                        echo_output=False, start_timeout=60)
    finally:
        timer.cancel()
    # the no-leftover fixture checks that both workers are gone
