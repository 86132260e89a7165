"""The compiled twins of framing's hottest steps (phalanx.wire._speedups) against their
pure-Python originals: the same frames, the same errors, the same order, from the same
bytes. Each test runs both, the compiled one skipped where the module was not built (any
split of a stream read both ways: tests/unit/test_wire.py)."""

from __future__ import annotations

import os
import select
import shutil
import struct
import sysconfig
import threading

import pytest

from phalanx import config
from phalanx.wire import framing, protocol, streams
from phalanx.wire.protocol import RESULT, header
from tests.unit.test_wire import Link, as_bytes, segments_of

try:
    from phalanx.wire import _speedups
except ImportError:  # not built here
    _speedups = None  # type: ignore[assignment]

IMPLEMENTATIONS = ["python", "compiled"]
_PIPE_BUF = select.PIPE_BUF


def _needs(kind: str) -> None:
    if kind == "compiled" and _speedups is None:
        pytest.skip("phalanx.wire._speedups was not built here (no C compiler at install)")


def pair_reader(link: Link, kind: str):
    """The pump's read of ``link``: the reader's own recv_pair, or its compiled twin."""
    _needs(kind)
    if kind == "python":
        return link.reader.recv_pair
    return _speedups.PairReader(link.reader, link.b, link.b.read_lock)


def as_frames(got) -> list[list[bytes]]:
    """What a pair read returned, as frames: a pair is one frame of two segments."""
    if isinstance(got, tuple):
        assert all(type(part) is bytes for part in got)
        return [list(got)]
    return [segments_of(f) for f in got]


def read_all(link: Link, read, count: int, timeout: float = 10.0) -> list[list[bytes]]:
    frames: list[list[bytes]] = []
    while len(frames) < count:
        ready, _, _ = select.select([link.b.read_fd], [], [], timeout)
        assert ready, f"only {len(frames)} of {count} frames arrived"
        frames += as_frames(read())
    return frames


@pytest.fixture
def pipe_link():
    link = Link("pipe")
    yield link
    link.close()


def test_the_module_is_built_wherever_a_compiler_is():
    """CI installs with a compiler: there, the compiled steps must be what runs (an install
    that quietly fell back to Python would leave them untested)."""
    if not (shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
            and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))):
        pytest.skip("no C compiler or Python headers here: the pure-Python steps run")
    if os.environ.get(config.ENV_PURE_PYTHON, "") not in ("", "0"):
        pytest.skip("PHALANX_PURE_PYTHON asks for the pure-Python steps")
    assert _speedups is not None, "phalanx.wire._speedups did not build: rerun scripts/setup-venv"
    assert framing.COMPILED
    from phalanx.controller import compiled

    assert compiled.hotpath is not None, ("phalanx.controller._hotpath did not build: rerun "
                                          "scripts/setup-venv")


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_one_answer_comes_as_its_pair_and_anything_else_as_frames(pipe_link, kind):
    read = pair_reader(pipe_link, kind)
    answer = [header(RESULT, 4, 1), b"\x80\x05N."]
    pipe_link.write(as_bytes(framing.frame(answer)))
    got = read()
    assert type(got) is tuple and list(got) == answer
    assert read() == []  # nothing there: no frames, no wait
    pipe_link.write(as_bytes(framing.frame(answer)) * 2 + as_bytes(framing.frame([b"hb"])))
    assert as_frames(read()) == [answer, answer, [b"hb"]]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize(("limit", "most", "words"), [
    (100, None, r"a frame of \d+ bytes in 2 segments \(the limit is 100 bytes\)"),
    (None, 1, r"a frame of 2 segments \(the limit is 1 segments\)"),
], ids=["over-the-byte-limit", "over-the-segment-limit"])
def test_a_pair_over_the_readers_limits_is_refused(pipe_link, kind, limit, most, words):
    read = pair_reader(pipe_link, kind)
    pipe_link.reader.limit, pipe_link.reader.max_segments = limit, most
    pipe_link.write(as_bytes(framing.frame([header(RESULT, 9, 2), bytes(200)])))
    with pytest.raises(framing.FrameTooLarge, match=words):
        read()
    with pytest.raises(framing.FrameTooLarge):  # and on every read after: it cannot go on
        read()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize(("lengths", "words"), [
    ((1, 9), r"its 2 segments' lengths add up to 10 bytes, its body holds 30"),
    ((40, 0), r"its 2 segments' lengths add up to 40 bytes, its body holds 30"),
    ((2**64 - 1, 31), r"lengths add up to"),  # wraps around in 64 bits
], ids=["short", "long", "wrapping"])
def test_a_pair_whose_table_lies_is_refused(pipe_link, kind, lengths, words):
    read = pair_reader(pipe_link, kind)
    pipe_link.write(struct.pack("<IQ2Q", 2, 46, *lengths) + bytes(30))
    with pytest.raises(framing.FrameTooLarge, match=words):
        read()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_the_end_of_the_stream_and_a_closed_stream_raise_connection_lost(kind):
    link = Link("pipe")
    try:
        read = pair_reader(link, kind)
        link.write(as_bytes(framing.frame([header(RESULT, 1, 0), b"x"])))
        link.a.close()
        assert as_frames(read()) == [[header(RESULT, 1, 0), b"x"]]
        with pytest.raises(framing.ConnectionLost, match="end of stream"):
            read()
        link.b.close()
        with pytest.raises(framing.ConnectionLost):  # its number retired: never read again
            read()
    finally:
        link.close()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_large_frame_arriving_in_parts_is_left_to_the_reader(pipe_link, kind):
    read = pair_reader(pipe_link, kind)
    big = [header(RESULT, 2, 0), bytes(range(256)) * 4096]  # 1 MiB: received in place
    thread = pipe_link.write_in_thread(as_bytes(framing.frame(big)) +
                                       as_bytes(framing.frame([header(RESULT, 3, 0), b"y"])))
    try:
        assert read_all(pipe_link, read, 2) == [big, [header(RESULT, 3, 0), b"y"]]
    finally:
        thread.join(10)


# -- sending ------------------------------------------------------------------------------


def frame_sender(conn: framing.Connection, kind: str):
    _needs(kind)
    if kind == "python":
        return conn.send
    sender = conn.sender()
    assert type(sender) is _speedups.FrameSender
    return sender


@pytest.fixture
def writer():
    writer = framing.BacklogWriter("test-speedups-writer")
    yield writer
    writer.stop()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_frames_of_every_shape_arrive_whole_and_in_order(pipe_link, writer, kind):
    send = frame_sender(framing.Connection(pipe_link.a, writer), kind)
    frames = [
        [header(RESULT, 1, 0), b"small"],
        [header(RESULT, 2, 0), bytes(_PIPE_BUF)],  # one bytes object, over PIPE_BUF
        [header(RESULT, 3, 0), b"a", b"b", b"c"],
        [header(RESULT, 4, 0), b"small again"],
    ]
    for segments in frames:
        send(framing.frame(segments))
    assert [segments_of(f) for f in pipe_link.receive(len(frames))] == frames


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_full_pipe_queues_the_rest_in_order_behind_the_backlog(pipe_link, writer, kind):
    conn = framing.Connection(pipe_link.a, writer)
    send = frame_sender(conn, kind)
    sent = []
    after = 0  # frames sent once the backlog began: queued behind it, never ahead
    while after < 40:
        i = len(sent)
        segments = [header(RESULT, i, 0), bytes([i % 256]) * (100 + i * 37 % 3000)]
        send(framing.frame(segments))
        sent.append(segments)
        after += conn.has_backlog()
        assert i < 100_000, "the pipe never filled"
    assert len(sent) > 200  # (a pipe of a mebibyte took a few hundred first)
    assert [segments_of(f) for f in pipe_link.receive(len(sent))] == sent


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_closed_connection_drops_a_quiet_frame_and_raises_otherwise(writer, kind):
    for quiet in (True, False):
        link = Link("pipe")
        try:
            conn = framing.Connection(link.a, writer, quiet=quiet)
            send = frame_sender(conn, kind)
            conn.close()
            frame = framing.frame([header(RESULT, 1, 0), b"late"])
            if quiet:
                assert send(frame) is None
            else:
                with pytest.raises(framing.ConnectionLost, match="closed"):
                    send(frame)
        finally:
            link.close()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_reader_gone_breaks_the_connection_as_the_python_send_does(writer, kind):
    link = Link("pipe")
    try:
        conn = framing.Connection(link.a, writer, quiet=True)
        send = frame_sender(conn, kind)
        os.close(link.b.read_fd)  # the rank's end of its pipe gone (EPIPE from now on)
        link.b.read_fd = -1
        send(framing.frame([header(RESULT, 1, 0), b"unread"]))
        assert isinstance(conn.broken, BrokenPipeError)
        send(framing.frame([header(RESULT, 2, 0), b"dropped"]))  # quiet: dropped, no raise
    finally:
        link.close()


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_threads_sending_at_once_never_interleave_a_frame(pipe_link, writer, kind):
    conn = framing.Connection(pipe_link.a, writer)
    send = frame_sender(conn, kind)
    per_thread = 300

    def sending(t: int) -> None:
        for i in range(per_thread):
            size = (i * 131 + t * 17) % (2 * _PIPE_BUF)  # either side of PIPE_BUF
            send(framing.frame([protocol.header(RESULT, i, t), bytes([t]) * size]))

    threads = [threading.Thread(target=sending, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    got = pipe_link.receive(4 * per_thread, timeout=30)
    for thread in threads:
        thread.join(10)
    seen: dict[int, list[int]] = {}
    for frame in got:
        _, call_id, (t,), _ = protocol.parse(frame[0])
        assert frame[1] == bytes([t]) * ((call_id * 131 + t * 17) % (2 * _PIPE_BUF))
        seen.setdefault(t, []).append(call_id)
    assert seen == {t: list(range(per_thread)) for t in range(4)}


def test_a_socket_or_a_sealed_connection_keeps_the_python_send(writer):
    link = Link("socket")
    try:
        conn = framing.Connection(link.a, writer)
        assert conn.sender() == conn.send  # no write end os.write may take: not compiled
        assert link.b.read_lock is None
    finally:
        link.close()


def test_pure_python_is_chosen_by_the_environment(tmp_path):
    """PHALANX_PURE_PYTHON=1 runs the twins in Python, in a process of its own."""
    import subprocess
    import sys

    code = ("from phalanx.wire import framing; import os; r, w = os.pipe(); "
            "from phalanx.wire import streams; "
            "s = streams.PipeStream(r, w, blocking_reads=False); "
            "c = framing.Connection(s, framing.BacklogWriter()); "
            "from phalanx.controller import compiled; "
            "print(framing.COMPILED, c.sender() == c.send, "
            "c.recv_ready == c.reader.recv_pair, compiled.hotpath is None)")
    env = {**os.environ, config.ENV_PURE_PYTHON: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["False", "True", "True", "True"]


def test_a_blocking_pipe_offers_no_lock_for_a_compiled_read():
    r, w = os.pipe()
    stream = streams.PipeStream(r, w, blocking_reads=True)
    try:
        assert stream.read_lock is None  # the rank's own loop: it reads blocking, alone
        with pytest.raises(ValueError, match="non-blocking read on a blocking pipe"):
            stream.read_chunk(bytearray(64))
    finally:
        stream.close()
