"""GroupFuture / RankFuture semantics with a scripted dispatcher (no processes).

The scripted dispatcher stands in for the group's event pump: each time a future waits, it
runs the next scripted completion, as frames arriving from workers would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from collections.abc import Callable

import pytest

from phalanx.controller.futures import Call, GroupFuture, RankFuture, StreamCall, StreamFuture
from phalanx.errors import CallTimeout, GroupClosed, SerializationError
from phalanx.wire import pickling


class ScriptedDispatcher:
    group_name = None  # a group of no name: messages name the ranks alone

    def __init__(self) -> None:
        self.events: list[Callable[[], None]] = []
        self.polls = 0
        self.watched: set[GroupFuture] = set()

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

    def watch_future(self, future: GroupFuture, on: bool) -> None:
        if on:
            self.watched.add(future)
        else:
            self.watched.discard(future)


class RankHandle:
    """A rank's future, plus the dispatcher-side calls that complete it."""

    def __init__(self, group_future: Call, future: RankFuture) -> None:
        self.future = future
        self._group_future = group_future

    def resolve(self, segments: list) -> None:
        self._group_future.resolve_rank(self.future.rank, segments)

    def fail(self, error: BaseException) -> None:
        self._group_future.fail_rank(self.future.rank, error)

    def __getattr__(self, name: str):
        return getattr(self.future, name)


def make(ranks=(0, 1, 2), method="step"):
    dispatcher = ScriptedDispatcher()
    group_future = Call(method, list(ranks), dispatcher)
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
    dispatcher.events = [lambda i=i: futures[i].resolve(encoded(i * 10)) for i in (2, 0, 1)]
    assert group.result(timeout=1) == [0, 10, 20]
    assert group.done()
    assert group.exception() is None
    assert group.ranks == [0, 1, 2] and len(group) == 3
    assert [f.rank for f in group.futures] == [0, 1, 2]


def test_first_failure_raises_at_once_without_waiting_for_other_ranks():
    group, futures, dispatcher = make()
    error = GroupClosed("rank 1 failed")
    dispatcher.events = [lambda: futures[1].fail(error)]  # ranks 0 and 2 never answer
    with pytest.raises(GroupClosed) as info:
        group.result(timeout=10)
    assert info.value is error
    assert group.done()
    assert group.exception() is error
    assert not futures[0].done()


def test_timeout_names_the_ranks_still_pending():
    group, futures, dispatcher = make()
    dispatcher.events = [lambda: futures[1].resolve(encoded("x"))]
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
        lambda: futures[2].resolve(encoded("two")),
        lambda: futures[0].fail(error),
        lambda: futures[1].resolve(encoded("one")),
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
    futures[0].resolve(encoded(CountingLoads()))
    assert group.result() == ["decoded"]
    assert group.result() == ["decoded"]
    assert futures[0].result() == "decoded"
    assert CountingLoads.loads == 1


# The forms an answer reaches a future in: the pickle alone as the frame's bytes (nearly
# every answer), the pickle alone as a view of a large frame's buffer, a pickle with its
# out-of-band buffers, and a pickle in a sequence of its own (an answer gathered by a node).
ANSWER_FORMS = {
    "bytes": lambda value: encoded(value)[0],
    "view": lambda value: memoryview(bytearray(encoded(value)[0])),
    "segments": lambda value: encoded(value),
    "one-tuple": lambda value: tuple(encoded(value)[:1]),
}


@pytest.mark.parametrize("form", sorted(ANSWER_FORMS))
def test_an_answer_in_any_form_it_arrives_in_decodes_to_the_ranks_value(form):
    values = [{"rank": 0, "blob": b"x" * 100}, None, "two"]
    if form == "segments":  # a value with a buffer out of band: an array
        np = pytest.importorskip("numpy")
        values[1] = np.arange(5)
    make_answer = ANSWER_FORMS[form]
    group, futures, _ = make()
    for handle, value in zip(futures, values, strict=True):
        handle.resolve(make_answer(value))
    decoded = group.result()
    assert decoded[0] == values[0] and decoded[2] == values[2]
    assert (decoded[1] == values[1]).all() if form == "segments" else decoded[1] is None
    one, (handle,), _ = make(ranks=(0,))  # a one-rank call (the pipelined call's path)
    handle.resolve(make_answer(values[0]))
    assert handle.result() == values[0] and one.result() == [values[0]]
    mixed, handles, _ = make()  # answers of the forms together: each decoded as its own
    forms = sorted(ANSWER_FORMS)
    for i, handle in enumerate(handles):
        handle.resolve(ANSWER_FORMS[forms[(forms.index(form) + i) % len(forms)]](i))
    assert mixed.result() == [0, 1, 2] and [h.result() for h in handles] == [0, 1, 2]


def test_a_result_that_cannot_be_unpickled_raises_serialization_error_for_that_rank():
    group, futures, _ = make(ranks=(0, 1))
    futures[0].resolve(encoded("fine"))
    futures[1].resolve(encoded(Unloadable()))
    with pytest.raises(SerializationError) as info:
        group.result()
    assert info.value.rank == 1
    assert info.value.stage == "unpickling the result"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert futures[0].result() == "fine"


def test_completion_after_the_first_outcome_is_ignored():
    group, futures, _ = make(ranks=(0,))
    futures[0].resolve(encoded(1))
    futures[0].fail(RuntimeError("late"))
    futures[0].resolve(encoded(2))
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
    futures[0].resolve(encoded(0))  # a late answer must not resurrect the call
    assert group.cancelled()


def test_cancel_after_completion_returns_false():
    group, futures, _ = make(ranks=(0,))
    futures[0].resolve(encoded(0))
    assert group.cancel() is False
    assert group.result() == [0]


def test_done_callbacks_run_once_each_in_order_when_the_call_completes():
    group, futures, dispatcher = make(ranks=(0, 1))
    seen: list[str] = []
    group.add_done_callback(lambda f: seen.append("first"))
    group.add_done_callback(lambda f: seen.append("second"))
    futures[0].resolve(encoded(0))
    assert seen == [] and dispatcher.watched == {group}
    futures[1].resolve(encoded(1))
    assert seen == ["first", "second"] and dispatcher.watched == set()
    group.add_done_callback(lambda f: seen.append("late"))  # done already: at once
    assert seen == ["first", "second", "late"]


def test_callbacks_added_while_another_thread_completes_the_calls_each_run_once():
    calls = [make(ranks=(0,)) for _ in range(4000)]
    runs = [0] * len(calls)
    errors: list[BaseException] = []
    # each thread says which call it reached, and both spin until the other reached it
    # too: both stay runnable, so the interpreter switches between them mid-call
    reached = [0, 0]
    deadline = time.monotonic() + 60

    def meet(me: int, n: int) -> None:
        reached[me] = n
        while reached[1 - me] < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other thread did not reach call {n}")

    def add() -> None:
        try:
            for n, (group, _, _) in enumerate(calls, 1):
                meet(0, n)
                for _ in range(n % 32):  # sweeps where the other thread's completion lands
                    pass
                for _ in range(2):
                    group.add_done_callback(lambda f, n=n: runs.__setitem__(n - 1, runs[n - 1] + 1))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
            reached[0] = len(calls)

    def complete() -> None:
        for n, (_, futures, _) in enumerate(calls, 1):
            meet(1, n)
            if n % 3:
                futures[0].resolve(encoded(n))
            else:
                futures[0].fail(KeyError(n))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=add), threading.Thread(target=complete)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert runs == [2] * len(calls)
    assert all(not dispatcher.watched for _, _, dispatcher in calls)


def test_done_polls_without_blocking():
    group, _, dispatcher = make()
    assert group.done() is False
    assert dispatcher.polls >= 1


def test_a_group_future_can_be_awaited():
    group, futures, _ = make(ranks=(0, 1))
    futures[0].resolve(encoded("a"))
    futures[1].resolve(encoded("b"))

    async def main():
        return await group

    assert asyncio.run(main()) == ["a", "b"]


def test_awaiting_a_failed_group_future_raises_its_error():
    group, futures, _ = make(ranks=(0,))
    futures[0].fail(KeyError("k"))

    async def main():
        return await group

    with pytest.raises(KeyError):
        asyncio.run(main())


def test_empty_selection_completes_with_an_empty_list():
    group, _, _ = make(ranks=())
    assert group.done()
    assert group.result(timeout=0) == []
    assert list(group) == []


# -- the completion side (what the dispatcher, the sender and the watchdog use) -------------


def test_late_ranks_are_those_that_have_not_answered():
    group, futures, _ = make(ranks=(0, 1, 2))
    assert group.late_ranks() == [0, 1, 2] and len(group) == 3
    futures[1].resolve(encoded("b"))
    futures[2].fail(KeyError("k"))
    assert group.late_ranks() == [0]


def test_deferred_sends_run_once_at_the_first_wait():
    group, futures, dispatcher = make(ranks=(0,))
    sent = []
    group.defer(lambda: sent.append(1))
    assert sent == []
    dispatcher.events = [lambda: futures[0].resolve(encoded("v"))]
    assert group.result() == ["v"] and sent == [1]
    assert group.done() and sent == [1]


class Owner:
    """What a call's arguments name is held by: records what it is told to let go of."""

    def __init__(self) -> None:
        self.released: list = []

    def unhold(self, objects):
        self.released.append(objects)


def test_held_objects_are_let_go_once_every_rank_is_done_even_after_a_failure():
    owner = Owner()
    group, futures, _ = make(ranks=(0, 1))
    group.hold(owner, ["obj"])  # type: ignore[arg-type]
    futures[0].fail(KeyError("k"))  # fails the call at once...
    assert owner.released == []  # ...but rank 1 may still read the object
    futures[1].resolve(encoded(1))
    assert owner.released == [["obj"]]


def test_cancelling_runs_the_callbacks_at_once_and_lets_go_of_held_objects_once_all_answer():
    owner = Owner()
    group, futures, dispatcher = make(ranks=(0, 1))
    group.hold(owner, ["obj"])  # type: ignore[arg-type]
    seen: list[bool] = []
    group.add_done_callback(lambda f: seen.append(f.cancelled()))
    futures[0].resolve(encoded(0))
    assert group.cancel() is True
    assert seen == [True] and dispatcher.watched == set()
    assert owner.released == []  # rank 1 is still running the call: it may read the object
    futures[1].resolve(encoded(1))
    assert owner.released == [["obj"]] and seen == [True]


def test_a_call_that_is_not_streamed_ignores_streamed_items():
    group, futures, _ = make(ranks=(0,))
    group.yield_rank(0, encoded("item"))
    futures[0].resolve(encoded("value"))
    assert group.result() == ["value"]


def test_tolerance_is_set_at_creation():
    assert Call("m", [0], ScriptedDispatcher()).tolerant is False
    assert Call("m", [0], ScriptedDispatcher(), tolerant=True).tolerant is True


def test_a_stream_yields_items_in_arrival_order_then_ends_with_every_rank():
    dispatcher = ScriptedDispatcher()
    stream = StreamCall("gen", [0, 1], dispatcher)
    dispatcher.events = [
        lambda: stream.yield_rank(1, encoded("b1")),
        lambda: stream.yield_rank(0, encoded("a1")),
        lambda: stream.resolve_rank(0, encoded(None)),
        lambda: stream.yield_rank(1, encoded("b2")),
        lambda: stream.resolve_rank(1, encoded(None)),
    ]
    assert list(stream) == [(1, "b1"), (0, "a1"), (1, "b2")]


def test_a_stream_times_out_naming_the_late_ranks():
    dispatcher = ScriptedDispatcher()
    stream = StreamCall("gen", [0, 1], dispatcher)
    stream.timeout = 0.01
    dispatcher.events = [lambda: stream.resolve_rank(0, encoded(None))]
    with pytest.raises(CallTimeout) as info:
        list(stream)
    assert info.value.pending_ranks == [1]


COMPLETION_SIDE = ("resolve_rank", "fail_rank", "yield_rank", "defer", "hold", "adopt_piece",
                   "late_ranks", "tolerant", "wait_for", "rank_at", "rank_done",
                   "rank_done_now", "rank_error", "rank_value")


def test_the_public_futures_show_only_the_user_side():
    """What completes a call is the controller's (Call, StreamCall), not the user's."""
    for public in (GroupFuture, StreamFuture, RankFuture):
        assert not [name for name in COMPLETION_SIDE if hasattr(public, name)], public
    call = Call("m", [0], ScriptedDispatcher())
    assert isinstance(call, GroupFuture) and not isinstance(call, StreamFuture)
    stream = StreamCall("m", [0], ScriptedDispatcher())
    assert isinstance(stream, StreamFuture) and isinstance(stream, Call)
