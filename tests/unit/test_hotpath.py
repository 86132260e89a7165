"""The controller's compiled twins (phalanx.controller._hotpath) against the Python they stand
for: a plain call's frames sent and registered rank by rank as ``Sender._deliver`` of
``protocol.small_call_frames`` does, and an answer routed by the dispatcher's pump with the
same outcome either way. Each test runs both, the compiled one skipped where the module was
not built."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.controller import dispatch
from phalanx.controller.calls import Sender
from phalanx.controller.dispatch import Dispatcher
from phalanx.wire import protocol
from phalanx.wire.protocol import CALL, HEARTBEAT, RESULT, header
from phalanx.wire.streams import ConnectionLost

try:
    from phalanx.controller import _hotpath
except ImportError:  # not built here
    _hotpath = None  # type: ignore[assignment]

IMPLEMENTATIONS = ["python", "compiled"]
_PREFIX = 28  # a two-segment frame's prefix and table, before its header


def _needs(kind: str) -> None:
    if kind == "compiled" and _hotpath is None:
        pytest.skip("phalanx.controller._hotpath was not built here (no C compiler at install)")


# -- a plain call's frames, rank by rank ---------------------------------------------------


class _Entry:
    """A rank's entry as the sender sees it: its calls, its send, whether it is alive; every
    step recorded in one log shared by all entries."""

    def __init__(self, rank: int, log: list[Any], alive: bool = True,
                 refuses: bool = False) -> None:
        self.rank = rank
        self.calls: dict[int, Any] = {}
        self.alive = alive
        self._log = log
        self._refuses = refuses

    def send(self, frame: list[Any]) -> None:
        self._log.append(("send", self.rank, frame, dict(self.calls)))
        if self._refuses:
            raise BrokenPipeError(f"rank {self.rank}'s pipe is gone")


def _sender_of(entries: list[Any], log: list[Any]) -> Sender:
    """A Sender with only what _deliver reads: the entries and the death check."""
    sender = Sender.__new__(Sender)
    sender._entries = entries
    sender._fail_if_dead = lambda entry, call_id, future: log.append(
        ("dead", entry.rank, call_id, future))
    return sender


def _fan_out(kind: str, entries: list[Any], log: list[Any], ranks: list[int], call_id: int,
             method: str, pickled: bytes) -> BaseException | None:
    """One call's frames to ``ranks``, sent either way; the error it raised, if any."""
    future = object()
    sender = _sender_of(entries, log)
    try:
        if kind == "python":
            sender._deliver(call_id, ranks, future,  # type: ignore[arg-type]
                            protocol.small_call_frames(call_id, ranks, method, pickled))
        else:
            _hotpath.send_small(entries, ranks, call_id, future,
                                *protocol.small_call_parts(method, pickled),
                                sender._fail_if_dead)
    except Exception as exc:  # (compared between the twins)
        return exc
    return None


def _run_fan_out(kind: str, ranks: list[int], alive: list[bool], refusing: int | None,
                 call_id: int, method: str, pickled: bytes) -> tuple[Any, ...]:
    log: list[Any] = []
    entries = [_Entry(r, log, alive[r], r == refusing) for r in range(len(alive))]
    error = _fan_out(kind, entries, log, ranks, call_id, method, pickled)
    futures = [{k: type(v).__name__ for k, v in e.calls.items()} for e in entries]
    steps = [(*step[:3], sorted(step[3]) if step[0] == "send" else None) for step in log]
    return steps, futures, None if error is None else (type(error), str(error))


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 6),
    data=st.data(),
    call_id=st.integers(1, 2**64 - 1),
    method=st.text(min_size=1, max_size=20),
    pickled=st.binary(max_size=300),
)
def test_a_calls_frames_registrations_and_death_checks_match_the_python(count, data, call_id,
                                                                       method, pickled):
    """The same frame bytes to the same ranks in the same order, each call registered on its
    rank's entry before that rank's send, a dead entry's call failed right after its send,
    and a send that raises stops the fan-out there with its error."""
    if _hotpath is None:
        pytest.skip("phalanx.controller._hotpath was not built here")
    ranks = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count,
                               unique=True))
    alive = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    refusing = data.draw(st.none() | st.sampled_from(ranks))
    python = _run_fan_out("python", ranks, alive, refusing, call_id, method, pickled)
    compiled = _run_fan_out("compiled", ranks, alive, refusing, call_id, method, pickled)
    assert compiled == python
    for step, rank, frame, registered in python[0]:  # each frame the call's, to its rank
        if step == "send":
            assert len(frame) == 1 and type(frame[0]) is bytes and call_id in registered
            assert protocol.unpack_head(frame[0], _PREFIX) == (CALL, call_id, rank)


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_missing_entry_fails_the_send_as_the_python_does(kind):
    _needs(kind)
    log: list[Any] = []
    entries: list[Any] = [_Entry(0, log), None]
    error = _fan_out(kind, entries, log, [0, 1], 7, "step", b"\x80\x05N.")
    assert isinstance(error, AttributeError) and "calls" in str(error)
    assert [step[:2] for step in log] == [("send", 0)]  # rank 0 was sent before it failed


# -- an answer routed --------------------------------------------------------------------


class _Call:
    """A call's completion side, recording what resolved it."""

    def __init__(self) -> None:
        self.resolved: list[tuple[int, Any]] = []

    def resolve_rank(self, rank: int, segments: Any) -> None:
        self.resolved.append((rank, segments))


class _Cohort:
    def __init__(self) -> None:
        self.calls: dict[int, _Call] = {}


class _RankEntry:
    """An entry as the dispatcher routes to it."""

    def __init__(self, rank: int, channel: Any) -> None:
        self.rank = rank
        self.channel = channel
        self.heard_at: float | None = None
        self.calls: dict[int, Any] = {}
        self.cohorts: list[tuple[_Cohort, int]] = []

    def cohort_call(self, call_id: int) -> Any:
        for cohort, _ in self.cohorts:
            call = cohort.calls.get(call_id)
            if call is not None:
                return call
        return None


class _Channel:
    """A channel on one pipe whose fast read returns what the test queued, one per event."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.fd, self._w = os.pipe()
        self.queued: list[Any] = []
        self.received: list[int] = []

    def push(self, got: Any) -> None:
        self.queued.append(got)
        os.write(self._w, b"x")

    def read_now(self) -> Any:
        os.read(self.fd, 1)
        got = self.queued.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got

    def receive(self, fd: int) -> list[Any]:
        self.received.append(fd)
        return []

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)


@pytest.fixture(params=IMPLEMENTATIONS)
def routed(request, monkeypatch):
    """A dispatcher watching one channel of rank 0, its pump routing in ``kind``'s way."""
    kind = request.param
    _needs(kind)
    monkeypatch.setattr(dispatch, "hotpath", _hotpath if kind == "compiled" else None)
    dispatcher = Dispatcher()
    channel = _Channel((0,))
    entry = _RankEntry(0, channel)
    dispatcher.add(entry)  # type: ignore[arg-type]
    dispatcher.watch(channel.fd, channel, channel.read_now)  # type: ignore[arg-type]
    yield dispatcher, channel, entry
    dispatcher.unwatch(channel.fd, channel)  # type: ignore[arg-type]
    dispatcher.release()
    channel.close()


def _answer(call_id: int, rank: int = 0, kind: int = RESULT) -> tuple[bytes, bytes]:
    return header(kind, call_id, rank), b"\x80\x05K\x07."


def test_the_router_is_what_the_pump_reads_where_the_module_is_built(routed):
    dispatcher, channel, _ = routed
    read = dispatcher._by_fd[channel.fd][1]
    expected = _hotpath.AnswerRouter if dispatch.hotpath is not None else type(channel.read_now)
    assert type(read) is expected


def test_an_answer_resolves_its_call_once_and_stamps_its_rank(routed):
    dispatcher, channel, entry = routed
    call = _Call()
    entry.calls[5] = call
    before = time.monotonic()
    channel.push(_answer(5))
    dispatcher.poll_now()
    assert call.resolved == [(0, b"\x80\x05K\x07.")]
    assert entry.calls == {}
    assert entry.heard_at is not None and before <= entry.heard_at <= time.monotonic()
    channel.push(_answer(5))  # again: its call was taken, nothing is resolved twice
    dispatcher.poll_now()
    assert call.resolved == [(0, b"\x80\x05K\x07.")]


def test_an_answer_to_a_cohorts_call_resolves_it(routed):
    dispatcher, channel, entry = routed
    cohort = _Cohort()
    call = cohort.calls[9] = _Call()
    entry.cohorts.append((cohort, 0))
    channel.push(_answer(9))
    dispatcher.poll_now()
    assert call.resolved == [(0, b"\x80\x05K\x07.")]


def test_anything_but_an_answer_of_the_channels_rank_goes_the_whole_way(routed):
    """A heartbeat stamps the rank and resolves nothing; an answer as a rank of an earlier
    incarnation (a channel that no longer carries it) is dropped; frames as a list are
    routed one by one; the stream's end goes to the channel's receive."""
    dispatcher, channel, entry = routed
    call = _Call()
    entry.calls[3] = call
    channel.push((header(HEARTBEAT, 0, 0), b""))
    dispatcher.poll_now()
    assert entry.heard_at is not None and call.resolved == []
    stale = _RankEntry(0, channel)
    stale.calls[3] = call
    dispatcher._by_rank[0] = _RankEntry(0, object())  # rank 0 now answers on another channel
    channel.push(_answer(3))
    dispatcher.poll_now()
    assert call.resolved == [] and dispatcher._by_rank[0].heard_at is None
    dispatcher._by_rank[0] = entry
    channel.push([list(_answer(3))])
    dispatcher.poll_now()
    assert call.resolved == [(0, b"\x80\x05K\x07.")]
    channel.push(ConnectionLost("end of stream"))
    dispatcher.poll_now()
    assert channel.received == [channel.fd]


def test_a_short_header_is_the_rank_breaking_the_protocol(routed):
    dispatcher, channel, entry = routed
    broke: list[str] = []
    dispatcher._broke = lambda ch, why: broke.append(why)  # type: ignore[method-assign]
    channel.push((b"\x02\x01", b"\x80\x05N."))
    dispatcher.poll_now()
    assert broke and "malformed message header" in broke[0]
    assert entry.heard_at is None


def test_a_resolve_that_raises_goes_up_through_the_pump(routed):
    dispatcher, channel, entry = routed

    class Broken(_Call):
        def resolve_rank(self, rank: int, segments: Any) -> None:
            raise RuntimeError("resolve failed")

    entry.calls[4] = Broken()
    channel.push(_answer(4))
    with pytest.raises(RuntimeError, match="resolve failed"):
        dispatcher.poll_now()


@pytest.fixture
def two_ranks(routed):
    """``routed``'s dispatcher with a second rank on a channel of its own."""
    dispatcher, channel, entry = routed
    other = _Channel((1,))
    other_entry = _RankEntry(1, other)
    dispatcher.add(other_entry)  # type: ignore[arg-type]
    dispatcher.watch(other.fd, other, other.read_now)  # type: ignore[arg-type]
    yield dispatcher, (channel, entry), (other, other_entry)
    dispatcher.unwatch(other.fd, other)  # type: ignore[arg-type]
    other.close()


def test_answers_and_other_frames_of_one_poll_are_all_taken(two_ranks):
    """One rank's answer routed as it is read, the other's frames (read in the same pass,
    not routed there) taken by the pump's Python in that same poll."""
    dispatcher, (channel, entry), (other, other_entry) = two_ranks
    call, late = _Call(), _Call()
    entry.calls[1] = call
    other_entry.calls[1] = late
    channel.push(_answer(1))
    other.push([list(_answer(1, rank=1)), [header(HEARTBEAT, 0, 1)]])
    dispatcher.poll_now()
    assert call.resolved == [(0, b"\x80\x05K\x07.")]
    assert late.resolved == [(1, b"\x80\x05K\x07.")]
    assert entry.heard_at is not None and other_entry.heard_at is not None


def test_an_error_in_one_answers_routing_loses_no_other_answer(two_ranks):
    """A resolve that raises goes up through the pump; whatever else that poll read is
    taken by the next one (its bytes left their pipe: no later poll would report it)."""
    dispatcher, (channel, entry), (other, other_entry) = two_ranks

    class Broken(_Call):
        def resolve_rank(self, rank: int, segments: Any) -> None:
            raise RuntimeError("resolve failed")

    entry.calls[2] = Broken()
    late = other_entry.calls[2] = _Call()
    channel.push(_answer(2))  # (a poll reports it first, as it was first written)
    other.push([list(_answer(2, rank=1))])
    with pytest.raises(RuntimeError, match="resolve failed"):
        dispatcher.poll_now()
    for _ in range(3):  # (the answer may have been left for the next poll, or read there)
        if late.resolved:
            break
        dispatcher.poll_now()
    assert late.resolved == [(1, b"\x80\x05K\x07.")]
    assert not other.queued


_EVENT = st.one_of(
    st.tuples(st.just("answer"), st.integers(0, 2), st.integers(1, 4)),  # (rank, call id)
    st.tuples(st.just("heartbeat"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("frames"), st.integers(0, 2), st.integers(1, 4)),  # an answer in a list
    st.tuples(st.just("nothing"), st.just(0), st.just(0)),  # a read that found nothing
)


def _play(kind: str, script: list[list[tuple[str, int, int]]]) -> list[Any]:
    """Two channels (of ranks 0 and 1, each once carrying all three) and an entry of rank 2
    on neither: each poll, what the script has each channel read; what every call was
    resolved with, and who was heard from."""
    original = dispatch.hotpath
    dispatch.hotpath = _hotpath if kind == "compiled" else None
    try:
        dispatcher = Dispatcher()
    finally:
        dispatch.hotpath = original
    channels = [_Channel((0, 1, 2)), _Channel((0, 1, 2))]  # (another's answer: dropped)
    entries = [_RankEntry(0, channels[0]), _RankEntry(1, channels[1]),
               _RankEntry(2, object())]
    calls = {(rank, call_id): _Call() for rank in range(3) for call_id in range(1, 5)}
    for entry in entries:
        dispatcher.add(entry)  # type: ignore[arg-type]
        entry.calls.update({c: calls[entry.rank, c] for c in range(1, 5)})
    try:
        for channel in channels:
            dispatcher.watch(channel.fd, channel, channel.read_now)  # type: ignore[arg-type]
        for poll in script:
            for i, (what, rank, call_id) in enumerate(poll[:2]):  # one read per channel
                if what == "answer":
                    channels[i].push(_answer(call_id, rank))
                elif what == "heartbeat":
                    channels[i].push((header(HEARTBEAT, 0, rank), b""))
                elif what == "frames":
                    channels[i].push([list(_answer(call_id, rank))])
                else:
                    channels[i].push([])
            dispatcher.poll_now()
        return [[(key, call.resolved) for key, call in calls.items()],
                [entry.heard_at is not None for entry in entries],
                [sorted(entry.calls) for entry in entries],
                [channel.queued for channel in channels]]
    finally:
        for channel in channels:
            dispatcher.unwatch(channel.fd, channel)  # type: ignore[arg-type]
            channel.close()
        dispatcher.release()


@settings(max_examples=40, deadline=None)
@given(script=st.lists(st.lists(_EVENT, min_size=1, max_size=2), max_size=6))
def test_any_mix_of_reads_is_routed_as_the_pump_routes_it(script):
    """Answers of the channel's own rank, of another rank (dropped: the channel does not
    carry it), answers again (nothing resolved twice), heartbeats, frames in a list, empty
    reads, on two channels polled together: the same calls resolved with the same answers,
    the same ranks heard from, either way."""
    if _hotpath is None:
        pytest.skip("phalanx.controller._hotpath was not built here")
    assert _play("compiled", script) == _play("python", script)
