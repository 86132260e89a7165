"""Framing and serialisation over every stream kind: frames survive any split of the byte
stream, and large buffers travel out of band."""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.wire import framing, pickling, protocol, streams
from phalanx.wire.protocol import CALL, RESULT, header, parse

STREAM_KINDS = ["socket", "pipe"]


class Link:
    """Both ends of one transport: bytes written at ``a`` are read at ``b``."""

    def __init__(self, kind: str) -> None:
        if kind == "socket":
            left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.a, self.b = streams.SocketStream(left), streams.SocketStream(right)
        else:
            r1, w1 = os.pipe()
            r2, w2 = os.pipe()
            self.a = streams.PipeStream(r2, w1, blocking_reads=False)
            self.b = streams.PipeStream(r1, w2, blocking_reads=False)
        self.reader = framing.FrameReader(self.b)
        self._closed = False

    def write(self, data: bytes) -> None:
        """Write every byte at ``a``, waiting for room as a blocking writer would."""
        view = memoryview(data)
        while view.nbytes:
            try:
                sent = self.a.write_nowait([view])
            except BlockingIOError:
                sent = 0
            view = view[sent:]
            if view.nbytes and not sent:
                select.select([], [self.a.write_fd], [], 5)

    def write_in_thread(self, data: bytes) -> threading.Thread:
        thread = threading.Thread(target=self.write, args=(data,), daemon=True)
        thread.start()
        return thread

    def receive(self, count: int, timeout: float = 10.0) -> list[list]:
        """Read at ``b`` until ``count`` frames are complete."""
        frames: list[list] = []
        while len(frames) < count:
            ready, _, _ = select.select([self.b.read_fd], [], [], timeout)
            assert ready, f"only {len(frames)} of {count} frames arrived"
            frames += self.reader.recv_frames(block=False)
        return frames

    def drain(self, read=None) -> list[list]:
        """Every frame complete so far, without blocking (``read``: instead of the reader's
        recv_frames, a read that may return one frame's header and pickle as a tuple)."""
        frames: list[list] = []
        idle = 0
        while idle < 2:
            got = self.reader.recv_frames(block=False) if read is None else read()
            got = [list(got)] if isinstance(got, tuple) else got
            frames += got
            idle = 0 if got else idle + 1
        return frames

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.a.close()
            self.b.close()


@pytest.fixture(params=STREAM_KINDS)
def link(request):
    link = Link(request.param)
    yield link
    link.close()


def as_bytes(framed: list) -> bytes:
    return b"".join(bytes(memoryview(seg).cast("B")) for seg in framed)


def segments_of(frame_segments: list) -> list[bytes]:
    return [bytes(memoryview(seg).cast("B")) for seg in frame_segments]


def test_small_frame_round_trip(link):
    segments = [header(CALL, 7, 3, "train"), b"payload", b""]
    link.write(as_bytes(framing.frame(segments)))
    (got,) = link.receive(1)
    assert segments_of(got) == segments
    assert parse(got[0]) == (CALL, 7, (3,), ("train", 0))


def test_many_small_frames_arrive_in_one_receive(link):
    frames = [framing.frame([header(RESULT, i, 0), pickle.dumps(i)]) for i in range(200)]
    link.write(b"".join(as_bytes(f) for f in frames))
    got = link.reader.recv_frames(block=False)
    assert len(got) == 200
    assert [pickle.loads(f[1]) for f in got] == list(range(200))


def test_partial_reads_complete_only_when_the_last_byte_arrives(link):
    data = as_bytes(framing.frame([b"head", b"x" * 1000, b"tail"]))
    for i in range(len(data) - 1):
        link.write(data[i : i + 1])
        assert link.reader.recv_frames(block=False) == []
    link.write(data[-1:])
    (got,) = link.reader.recv_frames(block=False)
    assert segments_of(got) == [b"head", b"x" * 1000, b"tail"]
    assert link.reader.recv_frames(block=False) == []


def test_large_numpy_frame_round_trip_out_of_band(link):
    array = np.random.default_rng(0).standard_normal(6 * 1024 * 1024 // 8)  # 6 MiB
    payload = pickling.dumps({"array": array, "tag": "big"})
    assert len(payload) >= 2, "the array's buffer must travel as its own segment"
    assert sum(memoryview(s).nbytes for s in payload[1:]) == array.nbytes
    assert len(payload[0]) < 4096, "the pickle stream must not embed the array's bytes"
    small = framing.frame([header(RESULT, 1, 0), b"after"])
    data = as_bytes(framing.frame([header(CALL, 1, 0, "m"), *payload])) + as_bytes(small)
    thread = link.write_in_thread(data)
    big, after = link.receive(2)
    thread.join(5)
    value = pickling.loads(big[1:])
    assert value["tag"] == "big"
    np.testing.assert_array_equal(value["array"], array)
    assert segments_of(after) == [header(RESULT, 1, 0), b"after"]


def test_connection_queues_what_a_slow_reader_cannot_take_yet(link):
    writer = framing.BacklogWriter("test-writer")
    try:
        conn = framing.Connection(link.a, writer)
        arrays = [np.full(300_000, i, dtype=np.float64) for i in range(4)]  # 2.4 MB each
        for i, array in enumerate(arrays):
            conn.send(protocol.result_frame(i, 2, pickling.dumps(array)))
        got = link.receive(4)
        for i, frame in enumerate(got):
            assert parse(frame[0]) == (RESULT, i, (2,), ())
            np.testing.assert_array_equal(pickling.loads(frame[1:]), arrays[i])
    finally:
        writer.stop()


def test_a_writer_starts_its_thread_at_the_first_backlog_and_stops_it(link):
    def running() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "test-lazy-writer"]

    writer = framing.BacklogWriter("test-lazy-writer")
    try:
        conn = framing.Connection(link.a, writer)
        conn.send(protocol.result_frame(0, 2, pickling.dumps("small")))
        assert running() == []  # the pipe took it at once: no thread to start or end
        big = np.arange(1_000_000, dtype=np.float64)  # 8 MB: more than a pipe holds
        sent = 0
        while not running() and sent < 16:  # (a socket's buffer may take a few)
            conn.send(protocol.result_frame(1, 2, pickling.dumps(big)))
            sent += 1
        assert len(running()) == 1
        small, *large = link.receive(1 + sent)
        assert pickling.loads(small[1:]) == "small"
        for frame in large:
            np.testing.assert_array_equal(pickling.loads(frame[1:]), big)
    finally:
        writer.stop()
    assert running() == []
    writer.stop()  # again: nothing to do


def test_end_of_stream_raises_connection_lost(link):
    link.write(as_bytes(framing.frame([b"last"])))
    link.a.close()
    assert segments_of(link.receive(1)[0]) == [b"last"]
    with pytest.raises(framing.ConnectionLost):
        for _ in range(3):
            select.select([link.b.read_fd], [], [], 5)
            link.reader.recv_frames(block=False)


def test_a_closed_pipe_stream_never_reads_the_pipe_that_took_its_number():
    """The controller's pump may read a rank's stream as another thread closes it; the
    number, free again, may belong to a new rank's pipe by then, with its first frame in."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    writer = framing.BacklogWriter("test-writer")
    old = framing.Connection(streams.PipeStream(r1, w2, blocking_reads=False), writer)
    number = old.read_fd
    old.close()
    read_end, write_end = os.pipe()  # the lowest free number: the one just closed
    try:
        assert read_end == number
        os.write(write_end, as_bytes(framing.frame([b"READY of the new rank"])))
        with pytest.raises(framing.ConnectionLost):
            old.reader.recv_frames(block=False)
        with pytest.raises(OSError):  # not into the pipe that holds the number now
            old.stream.write_nowait([b"a call for the old rank"])
        fresh = framing.FrameReader(streams.PipeStream(read_end, write_end,
                                                       blocking_reads=False))
        assert segments_of(fresh.recv_frames(block=False)[0]) == [b"READY of the new rank"]
    finally:
        os.close(read_end)
        os.close(write_end)
        os.close(w1)
        os.close(r2)
        writer.stop()


def test_plain_data_takes_the_fast_path_and_round_trips():
    for value in [((), {}), ((1, "a"), {"k": [1.5, None, b"x"]}), 42, "text", [1, (2, 3)]]:
        assert pickling.loads(pickling.dumps_fast(value)) == value


def test_closures_and_lambdas_pickle_by_value():
    offset = 10
    assert pickling.loads(pickling.dumps(lambda x: x + offset))(1) == 11


@pytest.mark.parametrize("value", [np.arange(3), np.zeros(0), np.array([1.0])], ids=str)
def test_dumps_fast_accepts_numpy_arrays(value):
    np.testing.assert_array_equal(pickling.loads(pickling.dumps_fast(value)), value)


segment = st.binary(max_size=2048)
frame_lists = st.lists(st.lists(segment, min_size=1, max_size=6), min_size=1, max_size=12)


def reading(link: Link, how: str):
    """How a test reads ``link``: the reader's recv_frames (None), its recv_pair (the
    controller's pump), or recv_pair's compiled twin (phalanx.wire._speedups, a pipe's)."""
    if how == "frames":
        return None
    if how == "pair":
        return link.reader.recv_pair
    if not framing.COMPILED:
        pytest.skip("phalanx.wire._speedups was not built here (no C compiler at install)")
    read = link.reader.pair_reader()
    assert read != link.reader.recv_pair
    return read


@pytest.mark.parametrize(("kind", "how"), [
    *[(kind, how) for kind in STREAM_KINDS for how in ("frames", "pair")],
    ("pipe", "compiled"),  # (a socket's reads take no lock: never compiled)
])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frame_lists, cuts=st.lists(st.integers(min_value=1, max_value=5000), max_size=30))
def test_any_split_of_the_stream_yields_the_same_frames(kind, how, frames, cuts):
    link = Link(kind)
    try:
        read = reading(link, how)
        data = b"".join(as_bytes(framing.frame(list(f))) for f in frames)
        received: list[list] = []
        pos = 0
        for cut in [*cuts, len(data)]:
            chunk = data[pos : pos + cut]
            pos += len(chunk)
            if chunk:
                link.write(chunk)
                received += link.drain(read)
        received += link.drain(read)
        assert [segments_of(f) for f in received] == frames
    finally:
        link.close()


@pytest.mark.parametrize("kind", STREAM_KINDS)
@settings(max_examples=10, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=2 * 1024 * 1024), min_size=1, max_size=4),
    cut=st.integers(min_value=4096, max_value=60_000),
)
def test_large_frames_survive_arbitrary_chunking(kind, sizes, cut):
    link = Link(kind)
    try:
        segments = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
        data = as_bytes(framing.frame(segments)) + as_bytes(framing.frame([b"next"]))
        received: list[list] = []
        for pos in range(0, len(data), cut):
            link.write(data[pos : pos + cut])
            received += link.drain()
        assert [segments_of(f) for f in received] == [segments, [b"next"]]
    finally:
        link.close()


# --------------------------------------------------------------------------- limits


def _prefix(nseg: int, body: int) -> bytes:
    """A frame's prefix: its number of segments, the bytes of its table and segments."""
    return struct.pack("<IQ", nseg, body)


def test_a_frame_over_the_segment_limit_is_refused_from_its_prefix(link):
    link.reader.limit, link.reader.max_segments = 1 << 30, 10
    link.write(_prefix(11, 8 * 11))
    with pytest.raises(framing.FrameTooLarge, match=r"a frame of 11 segments \(the limit is "
                                                    r"10 segments\)"):
        link.drain()


@pytest.mark.parametrize(("data", "words"), [
    (_prefix(0, 0), r"a malformed frame header \(0 segments in 0 bytes\)"),
    (_prefix(3, 16) + bytes(16), r"a malformed frame header \(3 segments in 16 bytes\)"),
    (_prefix(2, 20) + struct.pack("<2Q", 1, 9) + bytes(4),
     r"its 2 segments' lengths add up to 10 bytes, its body holds 4"),
    (_prefix(3, 1 << 20) + struct.pack("<3Q", 1, 2, 3) + bytes(64),
     r"its 3 segments' lengths add up to 6 bytes"),
], ids=["no-segments", "table-past-body", "pair", "large"])
def test_a_malformed_prefix_or_table_is_refused(link, data, words):
    link.reader.limit = 1 << 30
    link.write(data)
    with pytest.raises(framing.FrameTooLarge, match=words):
        link.drain()


@pytest.mark.parametrize(("limit", "most", "words"), [
    (None, None, None),
    (100, None, r"a frame of \d+ bytes in 2 segments \(the limit is 100 bytes\)"),
    (None, 1, r"a frame of 2 segments \(the limit is 1 segments\)"),
], ids=["within", "over-the-byte-limit", "over-the-segment-limit"])
def test_a_read_of_exactly_one_header_and_pickle_keeps_the_readers_limits(link, limit, most,
                                                                         words):
    """The usual answer comes in one read of one two-segment frame, which the reader cuts
    without its general parse: the limits hold there too."""
    link.reader.limit, link.reader.max_segments = limit, most
    segments = [header(RESULT, 9, 2), bytes(range(80))]
    link.write(as_bytes(framing.frame(segments)))
    if words is None:
        assert [segments_of(f) for f in link.receive(1)] == [segments]
        link.write(as_bytes(framing.frame(segments)))  # and again, from the same buffer
        assert [segments_of(f) for f in link.receive(1)] == [segments]
        return
    with pytest.raises(framing.FrameTooLarge, match=words):
        link.drain()


def test_an_announced_gigabyte_is_not_allocated_before_it_arrives():
    psutil = pytest.importorskip("psutil")
    link = Link("socket")
    try:
        link.reader.limit = 1 << 30
        body = (1 << 30) - 64
        rss = psutil.Process().memory_info().rss
        link.write(_prefix(2, body) + struct.pack("<2Q", 16, body - 32) + bytes(16 + (1 << 20)))
        assert link.drain() == []
        grown = psutil.Process().memory_info().rss - rss
        assert grown < 16 << 20, f"the reader took {grown >> 20} MiB for 1 MiB received"
    finally:
        link.close()


@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_a_frame_past_its_first_extent_grows_and_round_trips(kind):
    link = Link(kind)
    try:
        sizes = [100, 23 << 20, 5, 17 << 20]  # over _WHOLE_FRAME: received into growing memory
        segments = [bytes([i + 1]) * size for i, size in enumerate(sizes)]
        data = as_bytes(framing.frame(segments)) + as_bytes(framing.frame([b"next"]))
        thread = link.write_in_thread(data)
        got = link.receive(2)
        thread.join(10)
        assert [segments_of(f) for f in got] == [segments, [b"next"]]
    finally:
        link.close()


def test_a_partial_segment_table_is_read_in_linear_time():
    """A 64 MiB table arriving in 256 KiB reads: the partial table is kept, never copied
    again on each read (that took 5.6 s; this reader has no segment limit)."""
    link = Link("socket")
    try:
        nseg = 8 << 20
        thread = link.write_in_thread(_prefix(nseg, 9 * nseg) + bytes(8 * nseg - 8))
        started = time.monotonic()
        while thread.is_alive() or link.drain():
            select.select([link.b.read_fd], [], [], 0.05)
            assert link.reader.recv_frames(block=False) == []
        took = time.monotonic() - started
        assert took < 2.0, f"reading a 64 MiB partial table took {took:.1f} s"
    finally:
        link.close()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
def test_a_large_frames_buffer_is_reused_only_once_nothing_views_it(keep):
    """Two 18 MiB frames in a row: the second may reuse the first's buffer, never while
    the first's segments are still held."""
    link = Link("socket")
    try:
        frames = [[b"h", bytes([n]) * (18 << 20), bytes([n + 10]) * 3] for n in (1, 2, 3)]
        kept = []
        for segments in frames:
            thread = link.write_in_thread(as_bytes(framing.frame(segments)))
            (got,) = link.receive(1)
            thread.join(10)
            assert segments_of(got) == segments
            if keep:
                kept.append(got)
            del got
        for segments, got in zip(frames, kept, strict=False):
            assert segments_of(got) == segments, "a later frame overwrote a held one"
    finally:
        link.close()
