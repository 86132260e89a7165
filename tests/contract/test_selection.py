"""Selections and dead ranks: ``"ready"``/``"any"`` skip them, explicit calls fail at once."""

from __future__ import annotations

import signal
import time

import pytest

from phalanx import GroupClosed, WorkerDied
from tests import helpers
from tests.workers import Probe


@pytest.fixture
def group(make_group):
    return make_group(Probe, procs_per_node=3)


@pytest.fixture
def kill(ranks):
    def kill(group, rank: int) -> int:
        """SIGKILL one rank (through the backend) and wait until the group has noticed."""
        pid = group.call_one(rank, "pid")
        ranks.kill(group, rank)
        assert helpers.wait_dead(pid)
        return pid

    return kill


def test_ready_and_any_skip_a_killed_rank(group, kill):
    kill(group, 0)
    assert group.call("rank", workers="ready") == [1, 2]
    assert group.call("rank", workers="any") == [1]
    assert group.map("add", [1, 2], b=[10, 10], workers="ready") == [11, 12]
    kill(group, 1)
    assert group.call("rank", workers="any") == [2]
    assert group.call("rank", workers=[2]) == [2]


def test_any_with_no_live_rank_raises(make_group, kill):
    group = make_group(Probe)
    kill(group, 0)
    with pytest.raises(GroupClosed):
        group.call("rank", workers="any")


def test_calling_a_dead_rank_raises_worker_died_at_once(group, kill):
    pid = kill(group, 1)
    assert [h.alive for h in group.health()] == [True, False, True]
    for call in (
        lambda: group.call_one(1, "rank"),
        lambda: group.call("rank"),
        lambda: group.call("rank", workers=[0, 1]),
        lambda: group.map("rank", workers=[1]),
    ):
        started = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            call()
        # from what the group knows, waiting on nothing (the fault: a call that never
        # ends); generous for a loaded machine
        assert time.monotonic() - started < 2
        assert info.value.rank == 1 and info.value.pid == pid
        assert info.value.exitcode == -signal.SIGKILL and info.value.signal == "SIGKILL"
    assert group.call("rank", workers=[0, 2]) == [0, 2]


def test_a_pipelined_selection_sees_its_ranks_death_and_their_recreation(group, kill):
    # the same selection again and again (one record of options: the pipelined loop's)
    view = group.options(workers=[0, 1])
    for _ in range(3):
        assert view.call("rank") == [0, 1]
        assert [f.result(timeout=30) for f in
                [group.call_async("rank", workers=[1]) for _ in range(50)]] == [[1]] * 50
    kill(group, 1)
    with pytest.raises(WorkerDied) as info:  # at once: nothing is sent
        group.call_async("rank", workers=[1])
    assert info.value.rank == 1
    with pytest.raises(WorkerDied) as info:
        view.call("rank")
    assert info.value.rank == 1
    assert group.call_async("rank", workers=[0]).result(timeout=30) == [0]
    group.recreate(1)
    assert group.call_async("rank", workers=[1]).result(timeout=30) == [1]
    assert view.call("rank") == [0, 1]


def test_a_call_racing_a_fresh_death_fails_promptly(group, ranks):
    group.call_one(2, "pid")
    ranks.kill(group, 2, wait=False)  # the controller has not noticed yet
    started = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        group.call("sleep", 0.0, timeout=10)
    assert time.monotonic() - started < 3
    assert info.value.rank == 2
