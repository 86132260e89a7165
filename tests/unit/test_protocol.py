"""The messages between the controller and its ranks: every builder's frame reads back as
what was built, through the wire framing; headers for one rank or several round-trip."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.errors import ProcessFailure, RemoteFailure, likely_cause
from phalanx.wire import framing, pickling, protocol, streams
from phalanx.wire import plain as wireplain
from phalanx.wire.protocol import (
    CALL,
    CALL_STREAM,
    ERROR,
    EXITED,
    HEAD_SIZE,
    INIT,
    INIT_ERROR,
    MANY,
    READY,
    RESULT,
    SHUTDOWN,
    YIELD,
    body_offset,
    header,
    parse,
)

KINDS = [INIT, CALL, CALL_STREAM, SHUTDOWN, READY, INIT_ERROR, RESULT, YIELD, ERROR, EXITED]
MAX_CALL_ID = 2**64 - 1
MAX_RANK = 2**32 - 2  # 2**32 - 1 is MANY


def as_bytes(framed: list) -> bytes:
    return b"".join(bytes(memoryview(seg).cast("B")) for seg in framed)


def segments_of(frame_segments: list) -> list[bytes]:
    return [bytes(memoryview(seg).cast("B")) for seg in frame_segments]


def transmit(*frames: list) -> list[list[bytes]]:
    """Send ``frames`` over a socket and read them back with a :class:`framing.FrameReader`."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream = streams.SocketStream(right)
    data = b"".join(as_bytes(f) for f in frames)
    writer = threading.Thread(target=left.sendall, args=(data,), daemon=True)
    writer.start()
    try:
        reader = framing.FrameReader(stream)
        got: list[list] = []
        while len(got) < len(frames):
            got += reader.recv_frames(block=True)
        writer.join(5)
        return [segments_of(f) for f in got]
    finally:
        left.close()
        stream.close()


def failure_tuple(message: str = "boom") -> tuple:
    return RemoteFailure("ValueError", message, "Traceback ...", "running the method",
                         None).as_tuple()


# -- header layout ------------------------------------------------------------------------


def test_header_is_kind_call_id_rank_then_flags_and_method():
    segment = header(CALL, 7, 3, "train")
    assert segment[:HEAD_SIZE] == struct.pack("<BQI", CALL, 7, 3)
    assert segment[HEAD_SIZE:] == b"\x00train"
    assert body_offset(segment) == HEAD_SIZE
    assert protocol.unpack_head(segment) == (CALL, 7, 3)
    assert parse(segment) == (CALL, 7, (3,), ("train", 0))


@given(flags=st.integers(min_value=0, max_value=7),
       method=st.sampled_from(["train", "~train", "%x", "@fetch", "é"]))
def test_a_calls_flags_travel_apart_from_its_method_name(flags, method):
    """A method's name is the user's, whatever it starts with: keep, traced and built-in
    are flags in the header, never characters of the name."""
    segment = header(CALL, 7, 3, method, flags)
    assert parse(segment) == (CALL, 7, (3,), (method, flags))
    payload = pickling.dumps_fast(((), {}))
    for frame in [*protocol.call_frames(7, [3, 4], method, [payload], False, flags),
                  protocol.call_frame(7, [3, 4], method, payload, True, flags)]:
        (got,) = transmit(frame)
        assert parse(got[0])[3] == (method, flags)


def test_result_header_carries_no_extra():
    assert header(RESULT, 5, 2) == struct.pack("<BQI", RESULT, 5, 2)
    assert parse(header(RESULT, 5, 2)) == (RESULT, 5, (2,), ())


@given(kind=st.sampled_from([RESULT, YIELD, EXITED]), call_id=st.integers(0, 2**64 - 1),
       rank=st.integers(0, MANY - 1))
def test_the_packed_head_is_the_header_and_unpacks_back(kind, call_id, rank):
    # the one definition of the header, used wherever one is stamped without protocol's
    # builders (a tree's gathered results re-split into each rank's RESULT)
    assert protocol.pack_head(kind, call_id, rank) == header(kind, call_id, rank)
    assert protocol.unpack_head(protocol.pack_head(kind, call_id, rank)) == (kind, call_id, rank)


def test_header_for_several_ranks_lists_them_after_many():
    segment = header(CALL, 9, [4, 5, 6], "step")
    assert segment[:HEAD_SIZE] == struct.pack("<BQI", CALL, 9, MANY)
    assert segment[HEAD_SIZE : HEAD_SIZE + 2] == struct.pack("<H", 3)
    assert segment[HEAD_SIZE + 2 : HEAD_SIZE + 14] == struct.pack("<3I", 4, 5, 6)
    assert body_offset(segment) == HEAD_SIZE + 2 + 3 * 4
    assert segment[body_offset(segment) :] == b"\x00step"
    assert parse(segment) == (CALL, 9, (4, 5, 6), ("step", 0))


def test_a_list_of_one_rank_is_that_rank():
    assert header(SHUTDOWN, 0, [8]) == header(SHUTDOWN, 0, 8)
    assert body_offset(header(SHUTDOWN, 0, [8])) == HEAD_SIZE


def test_parse_accepts_memoryviews_of_a_received_segment():
    segment = header(READY, 0, [1, 2], 123, ["f"])
    assert parse(memoryview(bytearray(segment))) == (READY, 0, (1, 2), (123, ["f"]))
    assert body_offset(memoryview(segment)) == body_offset(segment)


ranks = st.integers(min_value=0, max_value=MAX_RANK)
rank_lists = st.lists(ranks, min_size=2, max_size=40)
call_ids = st.integers(min_value=0, max_value=MAX_CALL_ID)
methods = st.text(min_size=1, max_size=40)
plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(KINDS), call_id=call_ids, rank=ranks | rank_lists, data=st.data())
def test_any_header_round_trips(kind, call_id, rank, data):
    if kind in (CALL, CALL_STREAM):
        extra: tuple = (data.draw(methods), data.draw(st.integers(min_value=0, max_value=7)))
    else:
        extra = tuple(data.draw(st.lists(plain, max_size=3)))
    segment = header(kind, call_id, rank, *extra)
    expected_ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    assert parse(segment) == (kind, call_id, expected_ranks, extra)
    assert protocol.unpack_head(segment)[:2] == (kind, call_id)
    offset = body_offset(segment)
    assert offset == HEAD_SIZE + (0 if isinstance(rank, int) else 2 + 4 * len(rank))
    if kind in (CALL, CALL_STREAM):
        assert segment[offset] == extra[1]
        assert bytes(segment[offset + 1:]).decode() == extra[0]
    elif extra:
        assert wireplain.loads(segment[offset:]) == extra
    else:
        assert offset == len(segment)


@settings(max_examples=50, deadline=None)
@given(call_id=call_ids, rank=ranks | rank_lists, method=methods, stream=st.booleans())
def test_call_frames_survive_the_wire(call_id, rank, method, stream):
    payload = pickling.dumps_fast(((1, "a"), {"k": b"v"}))
    (got,) = transmit(protocol.call_frame(call_id, rank, method, payload, stream=stream))
    expected_ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    kind = CALL_STREAM if stream else CALL
    assert parse(got[0]) == (kind, call_id, expected_ranks, (method, 0))
    assert pickling.loads(got[1:]) == ((1, "a"), {"k": b"v"})


# -- every builder through the wire ---------------------------------------------------------


def test_every_builder_round_trips_through_the_wire():
    failure = failure_tuple()
    frames = [
        protocol.init_frame(2, ["/src", "/lib"], {"debug": True}, pickling.dumps(("T", (1,), {}))),
        protocol.call_frame(11, 2, "train", pickling.dumps(((3,), {}))),
        protocol.call_frame(12, 2, "items", pickling.dumps(((), {})), stream=True),
        protocol.shutdown_frame(2),
        protocol.shutdown_frame([2, 3]),
        protocol.ready_frame(2, 4242, {"train": ["batch"], "items": []}, {"constructor": 0.5},
                             "c0de"),
        protocol.init_error_frame(2, failure),
        protocol.result_frame(11, 2, pickling.dumps({"loss": 0.5})),
        protocol.result_frame(12, 2, pickling.dumps("item"), item=True),
        protocol.end_of_stream_frame(12, 2),
        protocol.error_frame(13, 2, failure),
        protocol.heartbeat_frame(2),
    ]
    got = transmit(*frames)
    heads = [parse(f[0]) for f in got]
    assert heads == [
        (INIT, 0, (2,), (["/src", "/lib"], {"debug": True})),
        (CALL, 11, (2,), ("train", 0)),
        (CALL_STREAM, 12, (2,), ("items", 0)),
        (SHUTDOWN, 0, (2,), ()),
        (SHUTDOWN, 0, (2, 3), ()),
        (READY, 0, (2,), (4242, {"train": ["batch"], "items": []}, {"constructor": 0.5}, "c0de")),
        (INIT_ERROR, 0, (2,), (failure,)),
        (RESULT, 11, (2,), ()),
        (YIELD, 12, (2,), ()),
        (RESULT, 12, (2,), ()),
        (ERROR, 13, (2,), (failure,)),
        (protocol.HEARTBEAT, 0, (2,), ()),
    ]
    assert pickling.loads(got[0][1:]) == ("T", (1,), {})
    assert pickling.loads(got[1][1:]) == ((3,), {})
    assert pickling.loads(got[2][1:]) == ((), {})
    assert [len(got[i]) for i in (3, 4, 5, 6, 10, 11)] == [1] * 6  # no payload
    assert pickling.loads(got[7][1:]) == {"loss": 0.5}
    assert pickling.loads(got[8][1:]) == "item"
    assert pickling.loads(got[9][1:]) is None  # the end of a stream is a RESULT of None
    assert RemoteFailure(*heads[10][3][0]) == RemoteFailure(*failure)


def test_empty_sys_path_and_options_round_trip():
    (got,) = transmit(protocol.init_frame(0, [], {}, pickling.dumps(("T", (), {}))))
    assert parse(got[0]) == (INIT, 0, (0,), ([], {}))


@pytest.mark.parametrize("stream", [False, True])
def test_call_frames_give_one_frame_per_rank_with_a_shared_payload(stream):
    payload = pickling.dumps(((b"x" * 100,), {"n": 1}))
    built = protocol.call_frames(21, [4, 5, 6], "step", [payload], stream)
    assert len(built) == 3
    got = transmit(*built)
    kind = CALL_STREAM if stream else CALL
    for rank, frame in zip([4, 5, 6], got, strict=True):
        assert parse(frame[0]) == (kind, 21, (rank,), ("step", 0))
        assert frame[1:] == segments_of(payload)
        assert pickling.loads(frame[1:]) == ((b"x" * 100,), {"n": 1})


def test_call_frames_with_one_payload_per_rank():
    payloads = [pickling.dumps(((r,), {})) for r in (0, 1)]
    got = transmit(*protocol.call_frames(3, [0, 1], "m", payloads, False))
    assert [parse(f[0]) for f in got] == [(CALL, 3, (0,), ("m", 0)), (CALL, 3, (1,), ("m", 0))]
    assert [pickling.loads(f[1:]) for f in got] == [((0,), {}), ((1,), {})]


def test_call_frames_match_call_frame_for_each_rank():
    payload = pickling.dumps_fast(((), {}))
    built = protocol.call_frames(8, [1, 2], "f", [payload], True)
    single = [protocol.call_frame(8, r, "f", payload, stream=True) for r in (1, 2)]
    assert [as_bytes(f) for f in built] == [as_bytes(f) for f in single]


def test_call_frames_refuse_a_payload_count_that_is_not_one_or_per_rank():
    payloads = [pickling.dumps(1), pickling.dumps(2)]
    with pytest.raises(ValueError):
        protocol.call_frames(1, [0, 1, 2], "m", payloads, False)


# -- EXITED -----------------------------------------------------------------------------------


def test_exited_message_carries_the_process_failure():
    failure = ProcessFailure(rank=3, node=1, pid=999, exitcode=-9,
                             stderr_tail=("Killed", "bye"))
    message = protocol.exited_message(3, failure.as_dict())
    assert len(message) == 1  # the segments of a received frame, header only
    kind, call_id, ranks_, (data,) = parse(message[0])
    assert (kind, call_id, ranks_) == (EXITED, 0, (3,))
    rebuilt = ProcessFailure.from_dict(data)
    assert rebuilt == failure
    assert rebuilt.signal == "SIGKILL"
    assert rebuilt.cause == likely_cause(-9)


def test_exited_message_survives_framing():
    failure = ProcessFailure(rank=0, node=0, pid=None, exitcode=None, reason="the node died")
    (got,) = transmit(framing.frame(protocol.exited_message(0, failure.as_dict())))
    (data,) = parse(got[0])[3]
    assert ProcessFailure.from_dict(data) == failure


def test_reason_overrides_the_likely_cause():
    plain = ProcessFailure(rank=1, node=0, pid=5, exitcode=1)
    assert plain.reason is None
    assert plain.cause == likely_cause(1)
    known = ProcessFailure(rank=1, node=0, pid=5, exitcode=1, reason="the node died")
    assert known.cause == "the node died"


def test_from_dict_accepts_a_list_tail_and_a_missing_one():
    data = {"rank": 2, "node": 1, "pid": 7, "exitcode": 3, "stderr_tail": ["a", "b"]}
    assert ProcessFailure.from_dict(data).stderr_tail == ("a", "b")
    data.pop("stderr_tail")
    assert ProcessFailure.from_dict(data) == ProcessFailure(2, 1, 7, 3)


@settings(max_examples=100, deadline=None)
@given(
    rank=ranks,
    node=st.integers(min_value=0, max_value=1000),
    pid=st.none() | st.integers(min_value=1, max_value=2**22),
    exitcode=st.none() | st.integers(min_value=-64, max_value=255),
    tail=st.lists(st.text(max_size=30), max_size=5).map(tuple),
    reason=st.none() | st.text(min_size=1, max_size=30),
)
def test_any_process_failure_round_trips_in_exited(rank, node, pid, exitcode, tail, reason):
    failure = ProcessFailure(rank, node, pid, exitcode, tail, reason)
    kind, _, ranks_, (data,) = parse(protocol.exited_message(rank, failure.as_dict())[0])
    assert (kind, ranks_) == (EXITED, (rank,))
    rebuilt = ProcessFailure.from_dict(data)
    assert rebuilt == failure
    if not rebuilt.never_started:  # one that never ran has no exit code of its own
        assert rebuilt.cause == (reason or likely_cause(exitcode))


@settings(max_examples=60, deadline=None)
@given(call_id=call_ids, ranks=st.lists(ranks, min_size=1, max_size=5), method=methods,
       data=st.binary(max_size=300))
def test_the_plain_calls_frames_are_the_general_builders_bytes(call_id, ranks, method, data):
    # the pipelined loop's builder (small_call_frames) must frame exactly what
    # call_frames frames, rank by rank, or a rank would read another call
    payload = pickling.dumps_plain(((data,), {}))
    fast = protocol.small_call_frames(call_id, ranks, method, payload[0])
    assert [as_bytes(f) for f in fast] == [
        as_bytes(f) for f in protocol.call_frames(call_id, ranks, method, [payload], False)]
