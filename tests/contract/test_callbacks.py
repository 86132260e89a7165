"""Futures in the ecosystem: done-callbacks (delivered when no thread waits),
``concurrent.futures.wait``/``as_completed`` through ``as_concurrent()``, and ``await``
without a thread per awaiting coroutine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from phalanx import WorkerError
from tests import helpers
from tests.workers import Probe


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Probe, procs_per_node=2, backend=backend, echo_output=False
    ) as group:
        yield group


def test_a_done_callback_runs_once_the_call_completes_with_nobody_waiting(group):
    called = threading.Event()
    seen = []
    future = group.call_async("sleep", 0.2, value="v")
    future.add_done_callback(lambda f: (seen.append(f.result()), called.set()))
    assert called.wait(10), "the callback never ran although nobody waited on the future"
    assert seen == [["v", "v"]]


def test_a_callback_added_to_a_done_future_runs_at_once(group):
    future = group.call_async("sleep", 0.0, value=1)
    future.result(timeout=10)
    seen = []
    future.add_done_callback(seen.append)
    assert seen == [future]


def test_a_failing_call_runs_its_callbacks_with_the_failure(group):
    called = threading.Event()
    future = group.call_async("raise_value_error", "boom")
    errors = []
    future.add_done_callback(lambda f: (errors.append(f.exception()), called.set()))
    assert called.wait(10)
    assert isinstance(errors[0], WorkerError)


def test_a_raising_callback_does_not_stop_the_others(group):
    called = threading.Event()
    future = group.call_async("sleep", 0.05)
    future.add_done_callback(lambda f: 1 / 0)
    future.add_done_callback(lambda f: called.set())
    assert called.wait(10)


def test_concurrent_futures_as_completed_yields_calls_in_completion_order(group):
    futures = {group.call_async("sleep", t, value=t, workers=[1]).as_concurrent(): t
               for t in (0.5, 0.1)}
    futures[group.call_async("sleep", 0.05, value=0.05, workers=[0]).as_concurrent()] = 0.05
    order = [f.result() for f in concurrent.futures.as_completed(futures, timeout=20)]
    assert order == [[0.05], [0.5], [0.1]]  # rank 1 runs its calls in the order sent


def test_concurrent_futures_wait_returns_when_the_first_completes(group):
    slow = group.call_async("sleep", 1.0, workers=[0]).as_concurrent()
    fast = group.call_async("sleep", 0.05, workers=[1]).as_concurrent()
    done, pending = concurrent.futures.wait([slow, fast], timeout=20,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
    assert done == {fast} and pending == {slow}
    assert slow.result(timeout=20) == [None]


def test_many_awaits_use_no_thread_each(group):
    async def main():
        before = threading.active_count()
        calls = [group.call_async("sleep", 0.3, value=i, workers=[i % 2]) for i in range(8)]
        started = time.monotonic()
        results = await asyncio.gather(*calls)
        return results, time.monotonic() - started, threading.active_count() - before

    results, elapsed, new_threads = asyncio.run(main())
    assert results == [[i] for i in range(8)]
    assert new_threads <= 0, f"{new_threads} threads were started to await"
    assert elapsed < 20


def test_an_awaited_failure_raises_in_the_coroutine(group):
    async def main():
        await group.call_async("raise_value_error", "boom")

    with pytest.raises(WorkerError):
        asyncio.run(main())

