"""Any bytes, in any chunking, on any stream end only that stream, with a reason.

TCP may split any write: a frame's 12-byte prefix can arrive as 5 bytes and then 7, its
segment table in pieces. Every reader of frames (:class:`~phalanx.wire.framing.FrameReader`
with a limit or without, a :class:`~phalanx.wire.framing.VerifyingReader`, a Ray rank's
output unsealer) must take valid frames in any chunking as if they came whole, and take
anything else -- flipped bytes, a cut stream, a garbage prefix, absurd counts -- as the end
of the stream: :class:`~phalanx.wire.framing.FrameTooLarge` (or, sealed, a
:class:`~phalanx.wire.seal.FrameRejected`), both :class:`ConnectionLost`, never a
``struct.error``, ``IndexError`` or ``ValueError``. Then the streams themselves: a split or
corrupt prefix on a tree's child link loses that child alone (its parent's session goes on,
a warning names the child), and on a Ray rank's control stream buries that rank alone (its
calls fail with ``WorkerDied`` naming it and why).
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.backends.base import RankStart
from phalanx.backends.cluster.agent import branch as branchmod
from phalanx.backends.ray import sealed
from phalanx.backends.ray.channel import Bundle, ChannelServices, RayChannel
from phalanx.errors import ProcessFailure, WorkerDied, death_error
from phalanx.wire import framing, protocol, seal, streams

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIMEOUT = 10.0


# --------------------------------------------------------------------------- helpers


class Chunked:
    """A byte source that hands ``data`` over in the given chunk sizes (cycled), one chunk
    (or what the reader asks for, if less) per read; between chunks, sometimes nothing yet
    (``BlockingIOError``, as a non-blocking socket says); at the end, nothing more
    (``eof``: end of stream, else nothing yet)."""

    def __init__(self, data: bytes, chunks: list[int], stalls: bool = True,
                 eof: bool = False) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.chunks = chunks or [len(data) or 1]
        self.turn = 0
        self.stalls = stalls
        self.stalled = False
        self.eof = eof

    @property
    def done(self) -> bool:
        return self.pos >= len(self.data)

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        if self.done:
            if self.eof:
                return 0
            raise BlockingIOError
        if self.stalls and not self.stalled and self.turn % 3 == 2:
            self.stalled = True
            raise BlockingIOError
        self.stalled = False
        size = self.chunks[self.turn % len(self.chunks)]
        self.turn += 1
        n = min(nbytes, size, len(self.data) - self.pos)
        with memoryview(buf) as whole, whole.cast("B") as flat:
            flat[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def as_bytes(framed: list[Any]) -> bytes:
    return b"".join(bytes(memoryview(seg).cast("B")) for seg in framed)


def plain(frame: list[Any]) -> list[bytes]:
    return [bytes(memoryview(seg).cast("B")) for seg in frame]


def drain(reader: Any, source: Chunked, received: list[list[bytes]] | None = None,
          budget: int = 100_000) -> list[list[bytes]]:
    """Read until the source is empty and nothing more comes (bounded: at least twice as
    many passes as the source has chunks to give, as a pass may end without reading)."""
    frames = [] if received is None else received
    budget = max(budget, 2 * len(source.data) // max(1, min(source.chunks)) + 1000)
    idle = 0
    for _ in range(budget):
        got = reader.recv_frames(block=False)
        frames += [plain(f) for f in got]
        if source.done and not got:
            idle += 1
            if idle > 2:
                return frames
        else:
            idle = 0
    raise AssertionError("the reader did not finish the bytes it was given")


# A frame's segments: a header-like first segment, then a payload of a few segments, now
# and then one large enough to be received in place (over _BIG_FRAME; over _WHOLE_FRAME:
# into growing anonymous memory).
_SEGMENT = st.one_of(
    st.binary(max_size=64),
    st.integers(min_value=0, max_value=5000).map(lambda n: bytes([n % 251]) * n),
)
_BIG = st.sampled_from([600 << 10, (1 << 20) + 7, 5 << 20]).map(lambda n: b"\x07" * n)
_FRAME = st.lists(_SEGMENT, min_size=1, max_size=5)
_FRAMES = st.lists(_FRAME, min_size=1, max_size=6)
_CHUNKS = st.lists(st.one_of(st.integers(1, 16), st.integers(1, 70_000)), min_size=1,
                   max_size=12)


def framed_stream(frames: list[list[bytes]]) -> bytes:
    return b"".join(as_bytes(framing.frame(list(f))) for f in frames)


def auth_pair() -> tuple[seal.FrameAuth, seal.FrameAuth]:
    """The two ends' frame keys of one connection (sender, receiver)."""
    secret, transcript = secrets.token_bytes(32), secrets.token_bytes(48)
    return seal.derive(secret, transcript, True), seal.derive(secret, transcript, False)


def sealed_stream(frames: list[list[bytes]], auth: seal.FrameAuth) -> bytes:
    return b"".join(as_bytes(framing.seal_frames(framing.frame(list(f)), auth))
                    for f in frames)


def new_reader(source: Chunked, limited: bool) -> framing.FrameReader:
    reader = framing.FrameReader(source)
    if limited:
        reader.limit, reader.max_segments = 64 << 20, 64
    return reader


# --------------------------------------------------------------------------- valid frames


@SETTINGS
@given(frames=_FRAMES, chunks=_CHUNKS, limited=st.booleans())
def test_valid_frames_in_any_chunking_parse_as_sent(frames, chunks, limited):
    source = Chunked(framed_stream(frames), chunks)
    assert drain(new_reader(source, limited), source) == frames


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(small=_FRAMES, big=_BIG, at=st.integers(0, 6), chunks=_CHUNKS)
def test_large_frames_among_small_ones_in_any_chunking_parse_as_sent(small, big, at, chunks):
    frames = [*small[:at], [b"head", big, b"tail"], *small[at:]]
    source = Chunked(framed_stream(frames), [c * 64 for c in chunks])
    assert drain(new_reader(source, False), source) == frames


@SETTINGS
@given(frames=_FRAMES, chunks=_CHUNKS)
def test_sealed_frames_in_any_chunking_pass_their_tags(frames, chunks):
    sender, receiver = auth_pair()
    source = Chunked(sealed_stream(frames, sender), chunks)
    reader = framing.VerifyingReader(framing.FrameReader(source), receiver)
    assert drain(reader, source) == frames


@pytest.mark.parametrize("split", [1, 5, 7, 11, 12, 13, 20])
def test_a_prefix_split_anywhere_waits_for_the_rest(split):
    data = framed_stream([[b"h" * 30, b"p" * 50]])
    source = Chunked(data, [split, len(data)], stalls=False)
    reader = framing.FrameReader(source)
    assert reader.recv_frames(block=False) == []  # a partial prefix (or table): nothing yet
    assert [plain(f) for f in reader.recv_frames(block=False)] == [[b"h" * 30, b"p" * 50]]


# --------------------------------------------------------------------------- corrupt bytes


def _flip(data: bytes, positions: list[int], values: list[int]) -> bytes:
    out = bytearray(data)
    for pos, value in zip(positions, values, strict=False):
        if out:
            out[pos % len(out)] ^= value or 1
    return bytes(out)


_CORRUPTION = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4),
              st.lists(st.integers(1, 255), min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("garbage-prefix"), st.binary(min_size=1, max_size=40)),
    st.tuples(st.just("prefix"), st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1)),
)


def corrupt(data: bytes, how: tuple) -> bytes:
    kind = how[0]
    if kind == "flip":
        return _flip(data, how[1], how[2])
    if kind == "truncate":
        return data[: how[1] % (len(data) + 1)]
    if kind == "garbage-prefix":
        return how[1] + data
    return struct.pack("<IQ", how[1], how[2]) + data  # an absurd (or plausible) prefix


def read_until_the_end(reader: Any, source: Chunked) -> BaseException | None:
    """Read everything; the stream-ended exception it raised (then again on the next
    call), or None if it all parsed (or waits for more)."""
    try:
        frames = drain(reader, source)
    except framing.ConnectionLost as exc:
        with pytest.raises(framing.ConnectionLost):
            reader.recv_frames(block=False)  # the stream stays ended
        return exc
    for frame in frames:  # whatever parsed is made of whole, non-empty frames
        assert frame and all(type(s) is bytes for s in frame)
    return None


@SETTINGS
@given(frames=_FRAMES, how=_CORRUPTION, chunks=_CHUNKS, limited=st.booleans(),
       eof=st.booleans())
def test_corrupt_bytes_in_any_chunking_end_the_stream_and_nothing_else(frames, how, chunks,
                                                                        limited, eof):
    source = Chunked(corrupt(framed_stream(frames), how), chunks, eof=eof)
    reader = new_reader(source, limited)
    ended = read_until_the_end(reader, source)
    assert ended is None or isinstance(ended, framing.ConnectionLost)
    if isinstance(ended, framing.FrameTooLarge):
        assert "frame" in str(ended)
    big = reader._big
    if big is not None:  # a large frame waits: its memory follows what was received
        assert big.filled <= source.pos
        if type(big.buf) is bytearray:
            assert len(big.buf) <= framing._WHOLE_FRAME


@SETTINGS
@given(frames=_FRAMES, how=_CORRUPTION, chunks=_CHUNKS)
def test_corrupt_sealed_bytes_in_any_chunking_end_the_stream(frames, how, chunks):
    sender, receiver = auth_pair()
    data = corrupt(sealed_stream(frames, sender), how)
    source = Chunked(data, chunks)
    reader = framing.VerifyingReader(framing.FrameReader(source), receiver)
    ended = read_until_the_end(reader, source)
    assert ended is None or isinstance(ended, (framing.FrameTooLarge, seal.FrameRejected))


@SETTINGS
@given(data=st.binary(max_size=400), chunks=_CHUNKS, limited=st.booleans())
def test_random_bytes_in_any_chunking_end_the_stream(data, chunks, limited):
    source = Chunked(data, chunks)
    ended = read_until_the_end(new_reader(source, limited), source)
    assert ended is None or isinstance(ended, framing.FrameTooLarge)


@SETTINGS
@given(frames=st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=1),
                       min_size=1, max_size=4),
       how=_CORRUPTION, chunks=_CHUNKS)
def test_a_ray_ranks_output_unsealer_takes_any_bytes(frames, how, chunks):
    sender, receiver = auth_pair()
    data = sealed_stream(frames, sender)
    unsealer = sealed.OutputUnsealer(receiver)
    out, pos, turn = [], 0, 0
    while pos < len(data):  # whole: every byte of output, in order
        size = chunks[turn % len(chunks)]
        out.append(unsealer(data[pos:pos + size]))
        pos, turn = pos + size, turn + 1
    assert b"".join(out) == b"".join(f[0] for f in frames)
    sender, receiver = auth_pair()
    bad = corrupt(sealed_stream(frames, sender), how)
    unsealer = sealed.OutputUnsealer(receiver)
    pos, turn = 0, 0
    try:  # corrupt: output, or the stream's end
        while pos < len(bad):
            size = chunks[turn % len(chunks)]
            unsealer(bad[pos:pos + size])
            pos, turn = pos + size, turn + 1
    except framing.ConnectionLost:
        pass


# Prefixes that are no frame's, as 12 bytes: the split the probe used, 5 + 7.
NO_FRAMES = {
    "no-segments": struct.pack("<IQ", 0, 0),
    "table-past-empty-body": struct.pack("<IQ", 1, 0),
    "table-past-body": struct.pack("<IQ", 3, 16),
    "all-ones": b"\xff" * 12,
    "huge-count": struct.pack("<IQ", (1 << 32) - 1, 1 << 40),
}


@pytest.mark.parametrize("limited", [False, True], ids=["no-limit", "limit"])
@pytest.mark.parametrize("prefix", list(NO_FRAMES.values()), ids=list(NO_FRAMES))
def test_a_prefix_that_is_no_frame_split_5_and_7_is_refused(prefix, limited):
    source = Chunked(prefix + bytes(64), [5, 7, 64], stalls=False)
    reader = new_reader(source, limited)
    assert reader.recv_frames(block=False) == []
    with pytest.raises(framing.FrameTooLarge, match="frame"):
        for _ in range(3):
            reader.recv_frames(block=False)
    with pytest.raises(framing.FrameTooLarge):
        reader.recv_frames(block=False)


def test_lengths_that_do_not_add_up_are_refused_without_a_limit():
    table = struct.pack("<2Q", 10, 40)  # 50 bytes said, 8 there
    data = struct.pack("<IQ", 2, 16 + 8) + table + bytes(8) + framed_stream([[b"next"]])
    source = Chunked(data, [len(data)], stalls=False)
    with pytest.raises(framing.FrameTooLarge, match="lengths add up to 50 bytes"):
        framing.FrameReader(source).recv_frames(block=False)


def test_an_announced_frame_commits_memory_as_its_bytes_arrive():
    """16 MiB announced (as a frame after the handshake may be, before its tag can be
    checked), 64 KiB sent: the reader holds about what it received, not the 16 MiB."""
    body = 16 << 20
    head = struct.pack("<IQ", 3, body) + struct.pack("<3Q", 16, body - 24 - 32, 16)
    source = Chunked(head + bytes(64 << 10), [16 << 10], stalls=False)
    reader = framing.FrameReader(source)
    tracemalloc.start()
    try:
        for _ in range(8):
            assert reader.recv_frames(block=False) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"the reader took {peak >> 20} MiB of heap for 64 KiB received"
    assert reader._big is not None and reader._big.filled == (64 << 10) + len(head) - 36


# --------------------------------------------------------------------------- a tree's child


def _socketpair_stream() -> tuple[streams.SocketStream, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return streams.SocketStream(ours), theirs


class FakeRelay:
    """What a :class:`Branch` needs of its session, recorded."""

    def __init__(self, writer: framing.BacklogWriter) -> None:
        self.queued: list[list[Any]] = []
        self.watched: dict[int, Any] = {}
        self.relay = branchmod.Relay(
            writer=writer, lock=threading.Lock(), wake=lambda: None, node_timeout=60.0,
            send=self.queued.append, queue=self.queued.append,
            watch=self.watched.__setitem__, unwatch=lambda fd: self.watched.pop(fd, None))


def _child(branch: branchmod.Branch, writer: framing.BacklogWriter, port: int,
           ids: list[int]) -> tuple[Any, socket.socket, seal.FrameAuth]:
    """A child link as adoption makes one (sealed both ways), its far end and its keys."""
    stream, theirs = _socketpair_stream()
    child_side, parent_side = auth_pair()
    conn = framing.Connection(stream, writer, auth=parent_side)
    child = branchmod._Child(SimpleNamespace(host="10.9.8.7", port=port), conn, ids)
    branch._adopted.append(child)
    branch.register_children()
    return child, theirs, child_side


def _send_and_read(branch: branchmod.Branch, child: Any, theirs: socket.socket,
                   pieces: list[bytes]) -> None:
    for piece in pieces:
        theirs.sendall(piece)
        ready, _, _ = select.select([child.conn.read_fd], [], [], TIMEOUT)
        assert ready
        branch.from_child(child)  # raises nothing, whatever came


@pytest.mark.parametrize("prefix", list(NO_FRAMES.values()), ids=list(NO_FRAMES))
def test_a_split_prefix_on_a_child_link_loses_that_child_alone(prefix, caplog):
    writer = framing.BacklogWriter()
    relay = FakeRelay(writer)
    branch = branchmod.Branch(relay.relay, secrets.token_bytes(32))
    bad, bad_far, _ = _child(branch, writer, 4001, [2, 3])
    good, good_far, good_keys = _child(branch, writer, 4002, [4])
    try:
        with caplog.at_level(logging.WARNING, logger=branchmod.__name__):
            _send_and_read(branch, bad, bad_far, [prefix[:5], prefix[5:] + bytes(16)])
        assert bad not in branch._children and good in branch._children
        (lost,) = [f for f in relay.queued if protocol.parse(
            framing.FrameReader(Chunked(as_bytes(f), [1 << 20])).recv_frames(False)[0][0]
        )[0] == branchmod.agentwire.LOST]
        assert b"10.9.8.7:4001" in as_bytes(lost)
        assert any("10.9.8.7:4001" in r.getMessage() and "frame" in r.getMessage()
                   for r in caplog.records), caplog.text
        # the sibling, and the session, go on: its result (prefix split 5 + 7) goes up
        relay.queued.clear()
        result = sealed_stream([[protocol.pack_head(protocol.RESULT, 9, 4), b"ok"]],
                               good_keys)
        _send_and_read(branch, good, good_far, [result[:5], result[5:12], result[12:]])
        assert len(relay.queued) == 1 and as_bytes(relay.queued[0]).endswith(b"ok")
    finally:
        for far in (bad_far, good_far):
            far.close()
        for child in (bad, good):
            child.conn.close()
        writer.stop()


def test_a_valid_frame_split_5_and_7_on_a_child_link_is_relayed():
    writer = framing.BacklogWriter()
    relay = FakeRelay(writer)
    branch = branchmod.Branch(relay.relay, secrets.token_bytes(32))
    child, far, keys = _child(branch, writer, 4003, [2])
    try:
        data = sealed_stream([[protocol.pack_head(protocol.RESULT, 1, 2), b"x" * 100]], keys)
        _send_and_read(branch, child, far, [data[:5], data[5:12], data[12:40], data[40:]])
        assert child in branch._children
        assert len(relay.queued) == 1 and as_bytes(relay.queued[0]).endswith(b"x" * 100)
    finally:
        far.close()
        child.conn.close()
        writer.stop()


# --------------------------------------------------------------------------- a Ray rank


class FakeSink:
    """The dispatcher, as a channel sees it: what it watches, and what is posted."""

    def __init__(self) -> None:
        self.watched: set[int] = set()
        self.posted: list[list[Any]] = []
        self.arrived = threading.Event()

    def watch(self, fd: int, channel: Any) -> None:
        self.watched.add(fd)

    def unwatch(self, fd: int, channel: Any = None) -> None:
        self.watched.discard(fd)

    def post(self, channel: Any, events: list[list[Any]]) -> None:
        self.posted += events
        self.arrived.set()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    return ours, theirs


@pytest.fixture
def ray_channel():
    writer = framing.BacklogWriter()
    services = ChannelServices(ray=SimpleNamespace(is_initialized=lambda: True),
                               writer=writer, logs=None)
    channel = RayChannel(services, RankStart(rank=3, node=0, local_rank=0, env={}),
                         Bundle(index=0))
    sink = FakeSink()
    channel.attach(sink)
    yield channel, sink
    channel.close()
    writer.stop()


@pytest.mark.parametrize("transport", ["tcp", "pipes"])
@pytest.mark.parametrize("prefix", [NO_FRAMES["table-past-empty-body"],
                                    NO_FRAMES["no-segments"], NO_FRAMES["all-ones"]],
                         ids=["table-past-empty-body", "no-segments", "all-ones"])
def test_a_split_prefix_on_a_ray_ranks_stream_buries_that_rank(ray_channel, transport,
                                                                prefix, caplog):
    channel, sink = ray_channel
    if transport == "tcp":
        ours, theirs = _tcp_pair()
        channel.connected(protocol_role_control(), ours)
        write, fd = theirs.sendall, ours.fileno()
    else:
        to_ctl_r, to_ctl_w = os.pipe()
        to_rank_r, to_rank_w = os.pipe()
        channel.connected_pipes(to_ctl_r, to_rank_w)
        write, fd = (lambda b: os.write(to_ctl_w, b)), to_ctl_r
    try:
        assert fd in sink.watched
        with caplog.at_level(logging.WARNING, logger="phalanx.backends.ray.channel"):
            for piece in (prefix[:5], prefix[5:] + bytes(16)):
                write(piece)
                ready, _, _ = select.select([fd], [], [], TIMEOUT)
                assert ready
                assert channel.receive(fd) == []  # nothing raised, nothing for the calls
        assert fd not in sink.watched, "the corrupt stream is still read"
        assert sink.arrived.wait(TIMEOUT), "the rank was not buried"
        (event,) = sink.posted
        kind, _, ranks, extra = protocol.parse(event[0])
        assert kind == protocol.EXITED and ranks == (3,)
        failure = ProcessFailure.from_dict(extra[0])
        assert "control stream was closed" in failure.reason and "frame" in failure.reason
        error = death_error(failure, "train")
        assert isinstance(error, WorkerDied) and "rank 3" in str(error), str(error)
        assert "control stream was closed" in str(error)
        assert any("rank 3" in r.getMessage() for r in caplog.records), caplog.text
        if transport == "tcp":  # cut: the rank sees its stream end
            theirs.settimeout(TIMEOUT)
            assert theirs.recv(16) == b""
    finally:
        if transport == "tcp":
            theirs.close()
        else:
            for end in (to_ctl_w, to_rank_r):
                os.close(end)


def test_a_header_too_short_on_a_ray_ranks_stream_buries_that_rank(ray_channel):
    channel, sink = ray_channel
    ours, theirs = _tcp_pair()
    channel.connected(protocol_role_control(), ours)
    try:
        theirs.sendall(framed_stream([[b"ab", b"cd"]]))
        deadline = time.monotonic() + TIMEOUT
        while ours.fileno() in sink.watched and time.monotonic() < deadline:
            select.select([ours], [], [], 0.5)
            assert channel.receive(ours.fileno()) == []
        assert sink.arrived.wait(TIMEOUT)
        failure = ProcessFailure.from_dict(protocol.parse(sink.posted[0][0])[3][0])
        assert "malformed message header (2 bytes)" in failure.reason
    finally:
        theirs.close()


def test_a_valid_frame_split_5_and_7_on_a_ray_ranks_stream_arrives(ray_channel):
    channel, sink = ray_channel
    ours, theirs = _tcp_pair()
    channel.connected(protocol_role_control(), ours)
    try:
        data = framed_stream([[protocol.pack_head(protocol.RESULT, 5, 3), b"fine"]])
        got: list[list[Any]] = []
        for piece in (data[:5], data[5:12], data[12:]):
            theirs.sendall(piece)
            select.select([ours], [], [], TIMEOUT)
            time.sleep(0.01)
            got += channel.receive(ours.fileno())
        assert [plain(f) for f in got] == [[protocol.pack_head(protocol.RESULT, 5, 3),
                                            b"fine"]]
        assert not sink.posted
    finally:
        theirs.close()


def protocol_role_control() -> int:
    from phalanx.wire import handshake

    return handshake.ROLE_CONTROL
