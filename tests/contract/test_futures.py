"""Asynchronous calls: GroupFuture behaviour against real workers, concurrency, async methods."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from phalanx import GroupFuture, RankFuture, WorkerError
from tests import helpers
from tests.workers import Probe


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Probe, procs_per_node=2, backend=backend, echo_output=False
    ) as group:
        yield group


def test_iteration_yields_rank_futures_as_they_complete(group):
    future = group.map_async("sleep", [0.6, 0.05], value=["slow", "fast"])
    assert isinstance(future, GroupFuture)
    order = []
    for rank_future in future:
        assert isinstance(rank_future, RankFuture) and rank_future.done()
        order.append((rank_future.rank, rank_future.result()))
    assert order == [(1, "fast"), (0, "slow")]
    assert future.result() == ["slow", "fast"]


def test_done_and_exception(group):
    future = group.call_async("sleep", 0.3, value="v")
    assert future.done() is False
    assert future.exception(timeout=10) is None
    assert future.done() is True
    assert future.result() == ["v", "v"]

    failing = group.call_async("raise_value_error", "nope")
    error = failing.exception(timeout=10)
    assert isinstance(error, WorkerError) and "nope" in str(error)
    assert failing.done()
    with pytest.raises(WorkerError):
        failing.result()


def test_per_rank_futures(group):
    future = group.call_async("rank")
    assert [rf.rank for rf in future.futures] == [0, 1]
    assert [rf.result(timeout=10) for rf in future.futures] == [0, 1]
    assert future.ranks == [0, 1] and len(future) == 2


def test_each_result_is_a_list_of_its_own_and_the_rank_future_agrees(group):
    # pipelined one-rank calls, the form whose answers are kept the leanest way
    futures = [group.call_async("add", i, 1, workers=[1]) for i in range(200)]
    for i, future in enumerate(futures):
        first = future.result(timeout=30)
        assert first == [i + 1]
        first.append("changed by the caller")
        assert future.result() == [i + 1]
        assert future.futures[0].result() == i + 1 and future.futures[0].rank == 1
    late = group.call_async("add", 2, 3, workers=[0])
    (rank_future,) = late.futures  # read through the rank's future first
    assert rank_future.result(timeout=30) == 5 and late.result() == [5]


def test_await_inside_asyncio_run(group):
    async def main():
        first = group.call_async("sleep", 0.2, value="a")
        second = group.map_async("add", [1, 2], b=[10, 20])
        return await first, await second

    assert asyncio.run(main()) == (["a", "a"], [11, 22])


def test_async_def_methods_run_to_completion(group):
    assert group.call("async_sleep", 0.05, value="done") == ["done", "done"]
    assert group.map("async_sleep", [0.01, 0.02], value=[1, 2]) == [1, 2]


def test_serial_calls_run_one_after_another_on_the_main_thread(group):
    assert group.call("on_main_thread") == [True, True]
    started = time.monotonic()
    first = group.call_async("sleep", 0.3, workers=[0])
    second = group.call_async("sleep", 0.3, workers=[0])
    first.result(timeout=10)
    second.result(timeout=10)
    assert time.monotonic() - started >= 0.55


def test_cancel_stops_waiting_and_the_group_keeps_working(group):
    future = group.call_async("sleep", 0.3)
    assert future.cancel() is True
    assert future.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=5)
    assert group.call("rank", timeout=10) == [0, 1]  # the late answers are discarded


@pytest.mark.parametrize("method", ["sleep", "async_sleep"])
def test_concurrency_runs_calls_at_the_same_time(make_group, method):
    group = make_group(Probe, concurrency=2)
    started = time.monotonic()
    futures = [group.call_async(method, 1.5, value=i) for i in range(2)]
    assert [f.result(timeout=10) for f in futures] == [[0], [1]]
    # one after the other would take 3 s; side by side 1.5 s, and room for a loaded machine
    assert time.monotonic() - started < 2.7


def test_fail_fast_on_a_user_exception(make_group):
    """Rank 1 raises at once while rank 0 sleeps 5 s: the call raises without waiting."""
    group = make_group(Probe, procs_per_node=2)
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.call("fail_on_rank", 1, 5, timeout=30)
    assert time.monotonic() - started < 3.5  # rank 0's 5 s not waited for (room for load)
    assert info.value.rank == 1
    assert info.value.exc_type == "KeyError"
    group.shutdown(timeout=0.2)  # rank 0 is still sleeping: do not wait for it
