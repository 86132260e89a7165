"""call_stream: generator methods stream (rank, item) pairs as they are produced."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from phalanx import CallTimeout, WorkerDied, WorkerError
from tests import helpers


class Streamer:
    def rank(self) -> int:
        return int(os.environ["RANK"])

    def count(self, n: int, delay: float = 0.0):
        for i in range(n):
            if delay:
                time.sleep(delay)
            yield (self.rank(), i)

    async def acount(self, n: int):
        for i in range(n):
            await asyncio.sleep(0.001)
            yield i * 10

    def plain(self) -> int:
        return 7

    def fails_after_one(self):
        yield "first"
        raise ValueError("mid-stream failure")

    def first_then_hang(self, seconds: float):
        yield "first"
        time.sleep(seconds)
        yield "late"

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Streamer, procs_per_node=2, backend=backend, echo_output=False
    ) as group:
        yield group


def test_items_arrive_per_rank_in_order_and_all_of_them(group):
    pairs = list(group.call_stream("count", 4))
    for rank in (0, 1):
        assert [item for r, item in pairs if r == rank] == [(rank, i) for i in range(4)]


def test_items_are_delivered_while_the_generator_still_runs(group):
    stream = group.call_stream("first_then_hang", 3.0, workers=[0])
    started = time.monotonic()
    rank, item = next(iter(stream))
    assert (rank, item) == (0, "first")
    # well before the 3 s the rest waits for (room for a loaded machine)
    assert time.monotonic() - started < 2.0, "the first item must not wait for the rest"
    assert [x for _, x in stream] == ["late"]


def test_async_generators_stream_too(group):
    assert group.call_stream("acount", 3).result() == [[0, 10, 20], [0, 10, 20]]


def test_a_plain_method_streams_its_value_as_one_item(group):
    assert group.call_stream("plain").result() == [[7], [7]]


def test_an_exception_mid_stream_raises_worker_error_after_the_items_before_it(group):
    seen = []
    with pytest.raises(WorkerError) as info:
        for _, item in group.call_stream("fails_after_one", workers=[1]):
            seen.append(item)
    assert seen == ["first"]
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert group.call("plain") == [7, 7], "the group stays usable"


def test_each_item_must_arrive_within_the_timeout(group):
    stream = group.call_stream("first_then_hang", 1.0, workers=[0], timeout=0.3)
    iterator = iter(stream)
    assert next(iterator) == (0, "first")
    with pytest.raises(CallTimeout):
        next(iterator)
    time.sleep(0.8)  # let the generator finish before the next test uses rank 0


def test_a_worker_killed_mid_stream_raises_worker_died(make_group, backend, ranks):
    group = make_group(Streamer, procs_per_node=1, backend=backend, echo_output=False)
    group.call("pid")
    iterator = iter(group.call_stream("first_then_hang", 30.0))
    assert next(iterator) == (0, "first")
    ranks.kill(group, 0, wait=False)
    with pytest.raises(WorkerDied) as info:
        next(iterator)
    assert info.value.signal == "SIGKILL"


def test_a_plain_call_of_a_generator_method_points_to_call_stream(group):
    with pytest.raises(WorkerError) as info:
        group.call("count", 2)
    assert info.value.exc_type == "TypeError"
    assert "call_stream" in str(info.value)
    assert group.call("plain") == [7, 7]
