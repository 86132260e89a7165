"""Calls: results in rank order, one serialisation per call, clear errors before sending."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from phalanx import CallTimeout, SerializationError, WorkerError
from phalanx.errors import RemoteTraceback
from tests import helpers
from tests.workers import CountingPickles, Probe

WORLD = 4


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Probe, procs_per_node=WORLD, backend=backend, echo_output=False
    ) as group:
        yield group


@pytest.fixture
def clean(group):
    group.call("clear")
    return group


class Accumulator:
    """A worker class defined in the test module itself."""

    def __init__(self, start: int) -> None:
        self.total = start

    def add(self, x: int) -> int:
        self.total += x
        return self.total


def test_call_returns_one_result_per_rank_in_rank_order(group):
    assert group.call("rank") == [0, 1, 2, 3]
    assert group.call("add", 1, b=2) == [3] * WORLD
    assert group.call("echo", 1, "two", three=[3]) == [((1, "two"), {"three": [3]})] * WORLD


def test_map_gives_each_rank_its_own_arguments(group):
    assert group.map("add", [0, 1, 2, 3], b=[10, 20, 30, 40]) == [10, 21, 32, 43]
    assert group.map("add", [5, 7], workers=[1, 3]) == [5, 7]
    assert group.map("add", a=[1, 2, 3, 4]) == [1, 2, 3, 4]


def test_call_one_returns_a_single_value(group):
    assert group.call_one(2, "rank") == 2
    assert group.call_one(3, "add", 4, b=5) == 9


def test_methods_are_reachable_as_attributes(group):
    assert group.add.call(1, b=1) == [2] * WORLD
    assert group.rank.call_one(1) == 1
    assert group.add.map([1, 2, 3, 4]) == [1, 2, 3, 4]
    assert group.rank.call_async().result(timeout=10) == [0, 1, 2, 3]
    assert {"add", "rank", "sleep", "record"} <= set(group.methods)


def test_call_pickles_the_arguments_once_for_all_ranks(group):
    CountingPickles.pickled = 0
    results = group.call("identity", CountingPickles())
    assert CountingPickles.pickled == 1
    assert all(isinstance(r, CountingPickles) for r in results) and len(results) == WORLD


def test_map_length_mismatch_names_both_lengths_and_sends_nothing(clean):
    with pytest.raises(ValueError) as info:
        clean.map("record", [1, 2, 3])
    assert "3" in str(info.value) and "4" in str(info.value)
    with pytest.raises(ValueError) as info:
        clean.map("record", item=[1, 2, 3, 4, 5])
    assert "5" in str(info.value) and "4" in str(info.value) and "item" in str(info.value)
    with pytest.raises(ValueError, match="1 items"):
        clean.map("record", [1], workers=[0, 1])
    assert clean.call("history") == [[]] * WORLD  # no rank ran the method
    assert clean.map("record", ["a", "b", "c", "d"]) == [1] * WORLD


def test_unpicklable_argument_raises_at_the_call_site_and_sends_nothing(clean):
    lock = threading.Lock()
    with pytest.raises(SerializationError) as info:
        clean.call("record", lock)
    assert info.value.stage == "pickling the arguments"
    assert "lock" in str(info.value)
    with pytest.raises(SerializationError) as info:
        clean.map("record", [1, 2, lock, 4])
    assert info.value.rank == 2
    assert clean.call("history") == [[]] * WORLD
    assert clean.call("rank") == [0, 1, 2, 3]


def test_unknown_method_names_the_method_and_the_available_ones(group):
    with pytest.raises(AttributeError) as info:
        group.call("no_such_method")
    message = str(info.value)
    assert "no_such_method" in message
    assert "record" in message and "sleep" in message
    with pytest.raises(AttributeError, match="no_such_method"):
        group.map("no_such_method", [1] * WORLD)
    with pytest.raises(AttributeError, match="no_such_method"):
        group.no_such_method  # noqa: B018
    assert group.call("rank") == [0, 1, 2, 3]


def test_explicit_and_named_selections(group):
    assert group.call("rank", workers=[3, 0]) == [0, 3]
    assert group.call("rank", workers=2) == [2]
    assert group.call("rank", workers="any") == [0]
    assert group.call("rank", workers="ready") == [0, 1, 2, 3]
    assert group.call("rank", workers=[]) == []
    with pytest.raises(ValueError, match="outside"):
        group.call("rank", workers=[WORLD])
    with pytest.raises(ValueError):
        group.call("rank", workers="some")


def test_timeout_raises_call_timeout_naming_the_pending_ranks(group):
    # rank 2 sleeps past the timeout, which leaves the others time to answer on a
    # loaded machine too (the timeout coming late shows as no CallTimeout at all)
    future = group.map_async("sleep", [0, 0, 2.5, 0])
    started = time.monotonic()
    with pytest.raises(CallTimeout) as info:
        future.result(timeout=1.0)
    assert time.monotonic() - started < 2.0
    assert info.value.pending_ranks == [2]
    assert isinstance(info.value, TimeoutError)
    assert group.call_one(2, "rank", timeout=10) == 2  # its sleep is over: free for the next
    assert future.result(timeout=10) == [None] * WORLD  # the call kept running there
    with pytest.raises(CallTimeout):
        group.call("sleep", 0.5, workers=[1], timeout=0.05)
    assert group.call_one(1, "rank", timeout=10) == 1


def test_many_calls_in_flight_per_worker_run_in_order(clean):
    futures = [clean.call_async("record", i) for i in range(300)]
    assert [f.result(timeout=30) for f in futures] == [[i + 1] * WORLD for i in range(300)]
    assert clean.call("history") == [list(range(300))] * WORLD


def test_calls_from_several_threads(group):
    results: dict[int, list] = {}

    def caller(i: int) -> None:
        results[i] = group.call("add", i, b=1, timeout=30)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {i: [i + 1] * WORLD for i in range(8)}


def test_user_exception_becomes_worker_error_with_the_original_as_cause(group):
    pids = group.call("pid")
    with pytest.raises(WorkerError) as info:
        group.call("raise_value_error", "bad input 42", workers=[2])
    error = info.value
    assert (error.rank, error.node, error.pid) == (2, 0, pids[2])
    assert error.exc_type == "ValueError"
    assert error.stage == "running the method"
    assert error.method == "raise_value_error"
    assert "bad input 42" in str(error)
    assert "raise_value_error" in error.traceback and "ValueError: bad input 42" in error.traceback
    cause = error.__cause__
    assert type(cause) is ValueError and cause.args == ("bad input 42",)
    assert isinstance(cause.__cause__, RemoteTraceback)
    assert "raise_value_error" in str(cause.__cause__)
    assert group.call("rank") == [0, 1, 2, 3]  # the workers keep serving


def test_classes_defined_in_a_test_module_and_in_a_test_function(make_group):
    group = make_group(Accumulator, args=(10,), procs_per_node=2)
    assert group.call("add", 5) == [15, 15]
    assert group.map("add", [1, 2]) == [16, 17]

    offset = 100

    class Local:
        def value(self) -> int:
            return offset

    assert make_group(Local).call("value") == [100]


def test_large_numpy_arrays_travel_intact(group):
    array = np.random.default_rng(1).standard_normal(2 * 1024 * 1024)  # 16 MiB
    summaries = group.call("array_summary", array)
    assert [s["sha256"] for s in summaries] == [hashlib.sha256(array.tobytes()).hexdigest()] * 4
    for summary in summaries:
        assert summary["shape"] == array.shape and summary["dtype"] == "float64"
        assert summary["sum"] == pytest.approx(float(array.sum()))
    arrays = [np.full(1000, r, dtype=np.int32) for r in range(WORLD)]
    assert [s["sum"] for s in group.map("array_summary", arrays)] == [1000.0 * r for r in range(4)]
    for back in group.call("identity", {"x": array}):  # 4 x 16 MiB back at once
        np.testing.assert_array_equal(back["x"], array)


def test_a_method_can_return_a_numpy_array(group):
    arrays = group.call("make_array", 5)
    for rank, array in enumerate(arrays):
        np.testing.assert_array_equal(array, np.arange(5) * (rank + 1))
