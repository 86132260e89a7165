"""Supervision on the Ray backend: stacks taken by each rank's actor on its node, heartbeats
carried over the rank's channel, and an unresponsive rank killed through its actor."""

from __future__ import annotations

import signal
import time

import pytest

import phalanx as px
from tests.workers import Probe

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    return ray_cluster


class Stuck(Probe):
    def deadlock_holding_the_gil(self):
        import ctypes

        libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)


def test_stacks_of_ray_ranks_name_what_their_main_thread_runs():
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        future = group.call_async("sleep", 30, workers=[1])
        try:
            # the call reaches rank 1's main thread a moment after call_async returns
            stacks: dict = {}
            deadline = time.monotonic() + 20
            while "in sleep" not in stacks.get(1, "") and time.monotonic() < deadline:
                stacks = group.stacks()
        finally:
            group.send_signal(signal.SIGINT, workers=[1])
        assert sorted(stacks) == [0, 1]
        assert "in sleep" in stacks[1]
        assert f"=== rank 1 (node {group.health()[1].node}" in str(stacks)
        with pytest.raises(px.WorkerError):
            future.result(timeout=30)


def test_a_ray_rank_deadlocked_holding_the_gil_is_declared_unresponsive_and_killed():
    with px.WorkerGroup(Stuck, procs_per_node=2, backend="ray", echo_output=False,
                        heartbeat_timeout=1.5) as group:
        with pytest.raises(px.WorkerUnresponsive) as info:
            group.call("deadlock_holding_the_gil", workers=[1], timeout=60)
        assert info.value.rank == 1 and info.value.silent_for >= 1.5
        assert "deadlock_holding_the_gil" in info.value.stack
        assert [h.alive for h in group.health()] == [True, False]
        assert group.call("rank", workers="ready") == [0]
