"""GroupFuture / RankFuture semantics with a scripted dispatcher (no processes).

The scripted dispatcher stands in for the group's event pump: each time a future waits, it
runs the next scripted completion, as frames arriving from workers would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

import pytest

from phalanx.controller.futures import GroupFuture, RankFuture
from phalanx.errors import CallTimeout, GroupClosed, SerializationError
from phalanx.wire import pickling


class ScriptedDispatcher:
    def __init__(self) -> None:
        self.events: list[Callable[[], None]] = []
        self.polls = 0

    def wait(self, is_done: Callable[[], bool], timeout: float | None, kickoff=None) -> bool:
        if kickoff is not None:
            kickoff()
        while not is_done():
            if not self.events:
                return False  # nothing more will arrive: a timeout
            self.events.pop(0)()
        return True

    def poll_now(self) -> None:
        self.polls += 1


class RankHandle:
    """A rank's future, plus the dispatcher-side calls that complete it."""

    def __init__(self, group_future: GroupFuture, future: RankFuture) -> None:
        self.future = future
        self._group_future = group_future

    def _resolve(self, segments: list) -> None:
        self._group_future._resolve_rank(self.future.rank, segments)

    def _fail(self, error: BaseException) -> None:
        self._group_future._fail_rank(self.future.rank, error)

    def __getattr__(self, name: str):
        return getattr(self.future, name)


def make(ranks=(0, 1, 2), method="step"):
    dispatcher = ScriptedDispatcher()
    group_future = GroupFuture(method, list(ranks), dispatcher)
    handles = [RankHandle(group_future, f) for f in group_future.futures]
    return group_future, handles, dispatcher


def encoded(value) -> list:
    return [bytes(memoryview(s).cast("B")) for s in pickling.dumps(value)]


class CountingLoads:
    loads = 0

    def __reduce__(self):
        return (_count_load, ())


def _count_load():
    CountingLoads.loads += 1
    return "decoded"


class Unloadable:
    def __reduce__(self):
        return (_fail_load, ())


def _fail_load():
    raise RuntimeError("cannot rebuild")


def test_results_come_back_in_rank_order_whatever_the_completion_order():
    group, futures, dispatcher = make()
    dispatcher.events = [lambda i=i: futures[i]._resolve(encoded(i * 10)) for i in (2, 0, 1)]
    assert group.result(timeout=1) == [0, 10, 20]
    assert group.done()
    assert group.exception() is None
    assert group.ranks == [0, 1, 2] and len(group) == 3
    assert [f.rank for f in group.futures] == [0, 1, 2]


def test_first_failure_raises_at_once_without_waiting_for_other_ranks():
    group, futures, dispatcher = make()
    error = GroupClosed("rank 1 failed")
    dispatcher.events = [lambda: futures[1]._fail(error)]  # ranks 0 and 2 never answer
    with pytest.raises(GroupClosed) as info:
        group.result(timeout=10)
    assert info.value is error
    assert group.done()
    assert group.exception() is error
    assert not futures[0].done()


def test_timeout_names_the_ranks_still_pending():
    group, futures, dispatcher = make()
    dispatcher.events = [lambda: futures[1]._resolve(encoded("x"))]
    with pytest.raises(CallTimeout) as info:
        group.result(timeout=0.25)
    assert info.value.pending_ranks == [0, 2]
    assert info.value.timeout == 0.25
    assert info.value.method == "step"
    assert not group.done()
    with pytest.raises(CallTimeout) as info:
        futures[0].result(timeout=0.1)
    assert info.value.pending_ranks == [0]


def test_iteration_yields_rank_futures_in_completion_order_including_failures():
    group, futures, dispatcher = make()
    error = ValueError("rank 0 failed")
    dispatcher.events = [
        lambda: futures[2]._resolve(encoded("two")),
        lambda: futures[0]._fail(error),
        lambda: futures[1]._resolve(encoded("one")),
    ]
    seen = []
    for rf in group:
        seen.append(rf.rank)
        assert rf.done()
    assert seen == [2, 0, 1]
    assert futures[0].exception() is error
    assert futures[2].result() == "two"


def test_a_rank_result_is_decoded_once():
    group, futures, _ = make(ranks=(0,))
    CountingLoads.loads = 0
    futures[0]._resolve(encoded(CountingLoads()))
    assert group.result() == ["decoded"]
    assert group.result() == ["decoded"]
    assert futures[0].result() == "decoded"
    assert CountingLoads.loads == 1


def test_a_result_that_cannot_be_unpickled_raises_serialization_error_for_that_rank():
    group, futures, _ = make(ranks=(0, 1))
    futures[0]._resolve(encoded("fine"))
    futures[1]._resolve(encoded(Unloadable()))
    with pytest.raises(SerializationError) as info:
        group.result()
    assert info.value.rank == 1
    assert info.value.stage == "unpickling the result"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert futures[0].result() == "fine"


def test_completion_after_the_first_outcome_is_ignored():
    group, futures, _ = make(ranks=(0,))
    futures[0]._resolve(encoded(1))
    futures[0]._fail(RuntimeError("late"))
    futures[0]._resolve(encoded(2))
    assert group.result() == [1]


def test_cancel_stops_waiting_and_discards_later_results():
    group, futures, _ = make()
    assert not group.cancelled()
    assert group.cancel() is True
    assert group.cancelled() and group.done()
    with pytest.raises(concurrent.futures.CancelledError):
        group.result(timeout=0)
    with pytest.raises(concurrent.futures.CancelledError):
        group.exception(timeout=0)
    futures[0]._resolve(encoded(0))  # a late answer must not resurrect the call
    assert group.cancelled()


def test_cancel_after_completion_returns_false():
    group, futures, _ = make(ranks=(0,))
    futures[0]._resolve(encoded(0))
    assert group.cancel() is False
    assert group.result() == [0]


def test_done_polls_without_blocking():
    group, _, dispatcher = make()
    assert group.done() is False
    assert dispatcher.polls >= 1


def test_a_group_future_can_be_awaited():
    group, futures, _ = make(ranks=(0, 1))
    futures[0]._resolve(encoded("a"))
    futures[1]._resolve(encoded("b"))

    async def main():
        return await group

    assert asyncio.run(main()) == ["a", "b"]


def test_awaiting_a_failed_group_future_raises_its_error():
    group, futures, _ = make(ranks=(0,))
    futures[0]._fail(KeyError("k"))

    async def main():
        return await group

    with pytest.raises(KeyError):
        asyncio.run(main())


def test_empty_selection_completes_with_an_empty_list():
    group, _, _ = make(ranks=())
    assert group.done()
    assert group.result(timeout=0) == []
    assert list(group) == []
