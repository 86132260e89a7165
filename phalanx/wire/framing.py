"""Frames and the byte stream between the controller and a worker.

A *frame* is a list of byte segments sent as one unit::

    <u32 nseg><u64 body_len> <u64 len_0> ... <u64 len_{n-1}> <seg_0> ... <seg_{n-1}>

Segment 0 is a message header (:mod:`phalanx.wire.protocol` owns those); the remaining segments
are an optional payload: one pickle stream followed by its protocol-5 out-of-band buffers
(made by :mod:`.pickling`).
Large numpy arrays and torch CPU tensors therefore travel as their own segments, handed to
``sendmsg`` as memoryviews and received in place into one buffer of the frame's own: the
bytes are copied by the kernel and nowhere else.

Sending never blocks the caller on a slow peer: what the socket does not take at once is
queued on the connection and written by a :class:`BacklogWriter` thread. That keeps both
sides reading while they write, so two peers sending to each other cannot deadlock.

The bytes travel over a :class:`Stream`: a pair of pipes between processes on one machine,
a socket between machines. This module knows nothing of workers or groups; it only moves
frames, and never looks inside segment 0.

A connection made over the network carries the keys of its handshake (``auth``,
:mod:`phalanx.wire.seal`): each frame is sealed as it is sent (its tag appended as one more
segment) and a :class:`VerifyingReader` checks each complete frame the reader returns
before anyone sees it, so no frame of a stranger is ever parsed. One that fails ends the
connection (:class:`~phalanx.wire.seal.FrameRejected`, a :class:`ConnectionLost`), logged
with the reason.
"""

from __future__ import annotations

import collections
import mmap
import os
import select
import struct
import threading

from phalanx.wire.compiled import speedups
from phalanx.wire.seal import PREHASH, TAG_SIZE, FrameAuth, FrameRejected
from phalanx.wire.streams import MAX_SEGMENTS as _MAX_SEGMENTS
from phalanx.wire.streams import ConnectionLost as ConnectionLost  # what its readers raise
from phalanx.wire.streams import Stream, WakePipe

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    class ByteSource(Protocol):
        """What a :class:`FrameReader` reads from: a :class:`Stream`, or anything that
        hands over bytes the same way (and may have a ``pending()`` of bytes decrypted
        already, as :class:`~phalanx.wire.streams.TLSStream` does)."""

        def read_into(self, buf: Any, nbytes: int, block: bool) -> int: ...

# whether Connection.send and FrameReader.recv_pair of a pipe run compiled in this process
COMPILED = speedups is not None

_write = os.write
_PREFIX = struct.Struct("<IQ")
_LEN = struct.Struct("<Q")
_RECV_CHUNK = 256 * 1024
# Frames at least this large are received in place into their own buffer instead of
# being accumulated in the stream buffer and sliced out of it.
_BIG_FRAME = 512 * 1024


class FrameTooLarge(ConnectionLost):
    """A peer announced a frame the reader refuses (over one of its limits, or a malformed
    prefix or segment table), or one this process has no memory for: the stream cannot go
    on. The one exception a :class:`FrameReader` raises for bytes that are not frames, in
    any chunking, with a limit or without; as a :class:`ConnectionLost`, every reader's
    caller already takes it for the end of that stream."""


# What every reader refuses, whatever its own limits (a reader without a ``limit`` trusts
# its peer with its memory, not with its arithmetic): a frame announcing more is no frame
# that was sent, but a corrupt or hostile stream. A terabyte, and 16 Mi segments (a 128 MiB
# table; a frame's segments are a header, a pickle and its out-of-band buffers).
HARD_BODY_LIMIT = 1 << 40
HARD_SEGMENT_LIMIT = 1 << 24


_SMALL_FRAME = 64 * 1024
SMALL_FRAME = _SMALL_FRAME  # a frame's pickle shorter than this is joined with its header
_PREFIX_1 = struct.Struct("<IQQ")
_PREFIX_2 = struct.Struct("<IQQQ")


def small_frame_prefix(head_size: int, payload: list[Any]) -> bytes | None:
    """The bytes :func:`frame` puts before ``head + payload[0]`` when that frame is small
    and made of ``bytes`` (a header of ``head_size`` bytes, one pickle); None otherwise.
    Lets a caller frame the same payload under many headers without re-framing it."""
    if len(payload) != 1 or type(payload[0]) is not bytes or len(payload[0]) >= _SMALL_FRAME:
        return None
    size = len(payload[0])
    return _PREFIX_2.pack(2, 16 + head_size + size, head_size, size)


def frame(segments: list[Any]) -> list[Any]:
    """Prefix ``segments`` with the frame header; the result goes to ``Connection.send``.

    Small frames made of ``bytes`` are joined into one ``bytes`` (one plain ``send``);
    larger ones stay a list of segments so that buffers are never copied.
    """
    n = len(segments)
    if n == 1 and type(segments[0]) is bytes:
        (a,) = segments
        return [_PREFIX_1.pack(1, 8 + len(a), len(a)) + a]
    if n == 2 and type(segments[0]) is bytes and type(segments[1]) is bytes:
        a, b = segments
        if len(b) < _SMALL_FRAME:
            return [_PREFIX_2.pack(2, 16 + len(a) + len(b), len(a), len(b)) + a + b]
    lengths = [memoryview(s).nbytes for s in segments]
    table = _table(n).pack(*lengths)
    prefix = _PREFIX.pack(n, len(table) + sum(lengths))
    return [prefix + table, *segments]


# --------------------------------------------------------------------------- receiving


_TABLES = [struct.Struct(f"<{n}Q") for n in range(17)]
_unpack_length = _TABLES[1].unpack_from
_unpack_pair = _TABLES[2].unpack_from
_unpack_prefix = _PREFIX.unpack_from
_PREFIX_SIZE = _PREFIX.size
_unpack_pair_frame = _PREFIX_2.unpack_from  # a two-segment frame's prefix and table
_PAIR_START = _PREFIX_2.size  # where such a frame's first segment starts
# A large frame (from _BIG_FRAME) is received in place, into a buffer of its own. Up to
# _WHOLE_FRAME that buffer is the frame's size at once, from the heap. A larger one goes
# into anonymous memory, whose pages exist only once bytes are written into them, mapped
# _FIRST_EXTENT at first and doubled (mremap: nothing is copied) each time it is full: what
# a frame costs follows the bytes received, never the size its prefix announced, so a peer
# that announces 16 MiB or a gigabyte (before any tag could be checked) and sends a few
# bytes costs those bytes (pages of 2 MiB where the kernel has transparent huge pages:
# fresh memory then fills at ~10 GiB/s, against ~1.8 in 4 KiB pages). A reader keeps the
# last such buffer, up to _SPARE_MAX, for its next large frame once nothing views it any
# more: its pages exist already, as reused heap memory's would.
_WHOLE_FRAME = 1 << 20
_FIRST_EXTENT = 4 << 20
_SPARE_MAX = 32 << 20


def _table(nseg: int) -> struct.Struct:
    return _TABLES[nseg] if nseg < len(_TABLES) else struct.Struct(f"<{nseg}Q")


_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _anonymous(size: int) -> mmap.mmap:
    """Anonymous memory of ``size`` bytes, its pages made as bytes are written to them:
    huge pages where the kernel has them (a fault per 2 MiB, not per 4 KiB: fresh memory
    then fills at ~10 GiB/s rather than ~1.8)."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if _HUGEPAGE is not None:
        try:
            buf.madvise(_HUGEPAGE)
        except OSError:  # no transparent huge pages here
            pass
    return buf


def _refused(nseg: int, body: int, limit: int, most: int) -> FrameTooLarge:
    """Why a prefix of ``nseg`` segments in ``body`` bytes is refused (it is)."""
    if body > limit:
        return FrameTooLarge(f"a frame of {body} bytes in {nseg} segments (the limit is "
                             f"{limit} bytes)")
    if nseg > most:
        return FrameTooLarge(f"a frame of {nseg} segments (the limit is {most} segments)")
    return FrameTooLarge(f"a malformed frame header ({nseg} segments in {body} bytes)")


def _check_lengths(lengths: tuple[int, ...], nseg: int, body: int) -> None:
    total = sum(lengths)
    if total != body - 8 * nseg:
        raise FrameTooLarge(f"a malformed frame header (its {nseg} segments' lengths add up "
                            f"to {total} bytes, its body holds {body - 8 * nseg})")


class _Arriving:
    """A large frame being received in place, into a buffer of its own whose segments are
    views of it: the bytes are copied by the kernel and nowhere else.

    Up to ``_WHOLE_FRAME`` the buffer is the frame's size at once; beyond, it is anonymous
    memory that grows (``mremap``: the pages move, the bytes are not copied) to twice its
    size each time it is full, so memory follows the bytes received.
    """

    __slots__ = ("buf", "filled", "lengths", "size")

    def __init__(self, size: int, lengths: tuple[int, ...], first: memoryview,
                 spare: mmap.mmap | None) -> None:
        self.size = size  # every segment's bytes, together
        self.lengths = lengths
        self.filled = first.nbytes
        if size <= _WHOLE_FRAME:
            self.buf: Any = bytearray(size)
        elif spare is not None and len(spare) >= self.filled:  # its pages exist: no faults
            # (it may be longer than the frame: the segments' views end where the frame does)
            self.buf = spare
        else:
            self.buf = _anonymous(max(_FIRST_EXTENT, self.filled))
        self.buf[: self.filled] = first

    def room(self) -> int:
        """How many more bytes the buffer takes now (it grows when it is full)."""
        buf = self.buf
        if self.filled == len(buf) < self.size:
            extent = min(self.size, 2 * len(buf))
            try:
                buf.resize(extent)
            except (OSError, SystemError):  # no mremap (not Linux): grow by a copy
                self.buf = _anonymous(extent)
                self.buf[: self.filled] = buf[: self.filled]
                buf.close()
        return min(len(self.buf), self.size) - self.filled

    def segments(self) -> list[Any]:
        mv = memoryview(self.buf)
        segs: list[Any] = []
        off = 0
        for length in self.lengths:
            segs.append(mv[off : off + length])
            off += length
        segs[0] = bytes(segs[0])
        return segs


class FrameReader:
    """Incremental frame parser over one stream (blocking or not).

    Every frame's prefix is checked before its bytes are taken, and its segment table
    before its segments are cut: at least one segment, a table that fits in the body,
    lengths that add up to it, a body of at most ``limit`` bytes and at most
    ``max_segments`` segments (the owner's limits, for a peer that must not be trusted with
    this process's memory; without them, :data:`HARD_BODY_LIMIT` and
    :data:`HARD_SEGMENT_LIMIT`). A frame that breaks them raises :class:`FrameTooLarge`
    saying which, and so does every later call: the stream cannot go on. The bytes may
    come in any chunking (a partial prefix or table waits for the rest). Memory grows with
    the bytes received, never with the bytes announced, and a frame arriving in many reads
    is copied once.
    """

    def __init__(self, stream: ByteSource) -> None:
        self._stream = stream
        self._buf = bytearray()  # bytes of an incomplete frame, carried to the next read
        self._chunk = bytearray(_RECV_CHUNK)
        self._big: _Arriving | None = None  # a large frame being received in place
        self._spare: mmap.mmap | None = None  # the last large frame's buffer, maybe reusable
        self._broken: FrameTooLarge | None = None  # why the stream cannot go on
        self._limit: int | None = None
        self._max_segments: int | None = None
        self._body_cap = HARD_BODY_LIMIT  # what is checked: the limits, or the hard ones
        self._segment_cap = HARD_SEGMENT_LIMIT
        self._pair_cap = HARD_BODY_LIMIT  # a two-segment frame's largest body (-1: none)
        self._chunk_view = memoryview(self._chunk)  # the chunk is never resized
        self._pending = getattr(stream, "pending", None)
        # a Stream's whole-chunk read (recv_pair's); None: another byte source
        self._read_chunk: Callable[[Any], int] | None = getattr(stream, "read_chunk", None)

    @property
    def limit(self) -> int | None:
        """The largest frame body accepted (None: any up to :data:`HARD_BODY_LIMIT`)."""
        return self._limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self._limit = value
        self._body_cap = HARD_BODY_LIMIT if value is None else min(value, HARD_BODY_LIMIT)
        self._cap_pairs()

    @property
    def max_segments(self) -> int | None:
        """The most segments in a frame (None: any up to :data:`HARD_SEGMENT_LIMIT`)."""
        return self._max_segments

    @max_segments.setter
    def max_segments(self, value: int | None) -> None:
        self._max_segments = value
        self._segment_cap = (HARD_SEGMENT_LIMIT if value is None
                             else min(value, HARD_SEGMENT_LIMIT))
        self._cap_pairs()

    def _cap_pairs(self) -> None:
        """What the whole-frame read of :meth:`recv_once` checks, from the two limits."""
        self._pair_cap = self._body_cap if self._segment_cap >= 2 else -1

    @property
    def holds_bytes(self) -> bool:
        """Whether its stream holds bytes of its own that no poll announces (TLS, once
        decrypted): then :meth:`recv_frames` reads on, and :meth:`recv_once` is not
        enough."""
        return self._pending is not None

    def recv_frames(self, block: bool = True) -> list[list[Any]]:
        """Receive once and return every frame now complete (possibly none).

        With ``block=False`` it returns ``[]`` instead of waiting for data.
        Raises :class:`ConnectionLost` at end of stream, :class:`FrameTooLarge` when a
        frame breaks the reader's limits or is malformed (then on every call: the stream
        cannot go on; the frames complete before it in the same read are not returned).
        """
        frames = self.recv_once(block)
        pending = self._pending
        while pending is not None and pending():  # TLS: decrypted bytes no poll() announces
            frames += self.recv_once(False)
        return frames

    def recv_once(self, block: bool = False) -> list[list[Any]]:
        """One read, and the frames it completed (possibly none); raises as
        :meth:`recv_frames`. Alone, for a stream that holds no bytes back (a pipe, a plain
        socket; not TLS): what a poll loop calls each time the stream is readable (the
        controller's every answer), in one call."""
        if self._broken is not None:
            raise self._broken
        big = self._big
        if big is not None:
            return self._fill_big(big, block)
        try:  # _read, inlined: once per event on the hot path
            n = self._stream.read_into(self._chunk, _RECV_CHUNK, block)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            raise ConnectionLost(str(exc)) from exc
        if n == 0:
            raise ConnectionLost("end of stream")
        if not self._buf:  # the usual case: parse straight out of the read buffer
            if n > _PAIR_START:  # one whole frame of a header and a pickle: nearly every read
                nseg, body, first, second = _unpack_pair_frame(self._chunk)
                if (nseg == 2 and n == _PREFIX_SIZE + body and first + second == body - 16
                        and body <= self._pair_cap):
                    view, mid = self._chunk_view, _PAIR_START + first
                    return [[view[_PAIR_START:mid].tobytes(), view[mid:n].tobytes()]]
            return self._parse(self._chunk, n, owned=False)
        self._buf += self._chunk_view[:n]  # amortised growth: a partial frame is not copied again
        return self._parse(self._buf, len(self._buf), owned=True)

    def recv_pair(self) -> list[list[Any]] | tuple[bytes, bytes]:
        """:meth:`recv_once` (not blocking), except that a read of exactly one frame of a
        header and one pickle is returned as that pair alone, a tuple in no list: nearly
        every answer the controller's pump reads. For a :class:`Stream` that holds no
        bytes back (a pipe, a plain socket)."""
        read_chunk = self._read_chunk
        if self._broken is not None or self._big is not None or self._buf or read_chunk is None:
            return self.recv_once()
        try:
            n = read_chunk(self._chunk)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            raise ConnectionLost(str(exc)) from exc
        if n > _PAIR_START:
            nseg, body, first, second = _unpack_pair_frame(self._chunk)
            if (nseg == 2 and n == _PREFIX_SIZE + body and first + second == body - 16
                    and body <= self._pair_cap):
                view, mid = self._chunk_view, _PAIR_START + first
                return view[_PAIR_START:mid].tobytes(), view[mid:n].tobytes()
        elif n == 0:
            raise ConnectionLost("end of stream")
        return self._parse(self._chunk, n, owned=False)

    def pair_reader(self) -> Callable[[], list[list[Any]] | tuple[bytes, bytes]]:
        """:meth:`recv_pair`, compiled where it can be: for a stream whose reads hold a
        lock (a pipe read without blocking), where ``phalanx.wire._speedups`` was built.
        The same results, the same errors (it leaves everything but the one pair to this
        reader's Python)."""
        lock = getattr(self._stream, "read_lock", None)
        if speedups is None or lock is None:
            return self.recv_pair
        return speedups.PairReader(self, self._stream, lock)  # type: ignore[no-any-return]

    def _read(self, buf: Any, nbytes: int, block: bool) -> int:
        """Bytes read into ``buf``; 0 when nothing is there yet (non-blocking)."""
        try:
            n = self._stream.read_into(buf, nbytes, block)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise ConnectionLost(str(exc)) from exc
        if n == 0:
            raise ConnectionLost("end of stream")
        return n

    def _break(self, exc: FrameTooLarge) -> FrameTooLarge:
        """The stream cannot go on: ``exc`` for this call and every later one."""
        self._broken = exc
        self._buf = bytearray()
        self._big = None
        return exc

    def _parse(self, buf: bytearray, size: int, owned: bool) -> list[list[Any]]:
        """Split ``buf[:size]`` into frames; keep an incomplete tail for the next read
        (``owned``: ``buf`` is that tail's own buffer, trimmed in place)."""
        frames = []
        pos = 0
        limit, most = self._body_cap, self._segment_cap
        mv = memoryview(buf)  # buf is never resized while this view lives
        try:
            while size - pos >= _PREFIX_SIZE:
                nseg, body = _unpack_prefix(buf, pos)
                if body > limit or nseg > most or not 0 < 8 * nseg <= body:
                    raise _refused(nseg, body, limit, most)
                start = pos + _PREFIX_SIZE
                off = start + 8 * nseg  # the table's end: the first segment's start
                end = start + body
                if end > size:
                    if body >= _BIG_FRAME and off <= size:
                        # Receive the rest of a large frame in place, into its own buffer.
                        lengths = _table(nseg).unpack_from(buf, start)
                        _check_lengths(lengths, nseg, body)
                        self._big = self._arriving(end - off, lengths, mv[off:size])
                        pos = size
                    break
                if nseg == 2:  # header + one pickle: nearly every frame
                    first, second = _unpack_pair(buf, start)
                    if first + second != body - 16:
                        _check_lengths((first, second), 2, body)
                    mid = off + first
                    frames.append([mv[off:mid].tobytes(), mv[mid:end].tobytes()])
                else:
                    lengths = _table(nseg).unpack_from(buf, start)
                    _check_lengths(lengths, nseg, body)
                    segs = []
                    for length in lengths:
                        segs.append(mv[off : off + length].tobytes())
                        off += length
                    frames.append(segs)
                pos = end
        except FrameTooLarge as exc:
            raise self._break(exc) from None
        if owned:
            mv.release()
            del buf[:pos]  # bytearray drops a prefix without moving the rest
            if not buf:
                self._buf = bytearray()
        elif pos < size:
            self._buf = bytearray(mv[pos:size])
        return frames

    def _arriving(self, size: int, lengths: tuple[int, ...], first: memoryview) -> _Arriving:
        try:
            return _Arriving(size, lengths, first,
                             self._take_spare() if size > _WHOLE_FRAME else None)
        except (MemoryError, OSError, ValueError, OverflowError) as exc:
            raise FrameTooLarge(f"a frame of {size} bytes in {len(lengths)} segments, which "
                                f"this process has no memory for ({exc})") from None
        finally:
            first.release()

    def _fill_big(self, big: _Arriving, block: bool) -> list[list[Any]]:
        try:
            room = big.room()
        except (MemoryError, OSError, ValueError, OverflowError) as exc:
            raise self._break(FrameTooLarge(
                f"a frame of {big.size} bytes in {len(big.lengths)} segments, which this "
                f"process has no memory for ({exc})")) from None
        with memoryview(big.buf) as whole, whole[big.filled:] as rest:
            n = self._read(rest, room, block)
        if not n:
            return []
        big.filled += n
        if big.filled < big.size:
            return []
        self._big = None
        if type(big.buf) is mmap.mmap and len(big.buf) <= _SPARE_MAX:
            self._spare = big.buf  # reused only once the frame's views are gone
        return [big.segments()]

    def _take_spare(self) -> mmap.mmap | None:
        """The last large frame's buffer, if nothing views it any more."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        try:
            spare.resize(len(spare))  # refused while a view of it exists
        except BufferError:
            return None  # still someone's: it goes with their last view
        except (OSError, SystemError):  # no mremap (not Linux)
            return None
        return spare


class VerifyingReader:
    """A :class:`FrameReader` whose every complete frame is checked against the
    connection's keys (:mod:`phalanx.wire.seal`) before it is returned, its tag removed
    (``auth.check``). The first frame that fails raises
    :class:`~phalanx.wire.seal.FrameRejected`, and so does every call after it."""

    def __init__(self, reader: FrameReader, auth: FrameAuth, where: str = "") -> None:
        self.reader = reader
        self._auth = auth
        self._where = where
        self._rejected: FrameRejected | None = None

    def recv_frames(self, block: bool = True) -> list[list[Any]]:
        if self._rejected is not None:
            raise self._rejected
        frames = self.reader.recv_frames(block)
        check = self._auth.check
        for segs in frames:
            if not check(segs):
                number = self._auth.received
                self._rejected = FrameRejected(
                    f"frame {number} from the peer failed authentication (altered, forged "
                    "or out of order: something between the two ends wrote to the stream)")
                import logging  # not at import: a rank's warden starts without it

                logging.getLogger(__name__).warning("closing a connection%s: %s",
                                                    self._where, self._rejected)
                raise self._rejected
            segs.pop()
        return frames

    # The reader's limits, as its owner sets them (a sealed frame has one more segment).
    @property
    def limit(self) -> int | None:
        return self.reader.limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self.reader.limit = value

    @property
    def max_segments(self) -> int | None:
        value = getattr(self.reader, "max_segments", None)
        return None if value is None else value - 1

    @max_segments.setter
    def max_segments(self, value: int | None) -> None:
        self.reader.max_segments = None if value is None else value + 1


# ------------------------------------------------------- sealing frames (seal.py)


_TAG_LENGTH = _LEN.pack(TAG_SIZE)


def seal_frames(segments: list[Any], auth: FrameAuth) -> list[Any]:
    """``segments`` (one frame or several, as :func:`frame` built them, maybe joined) with
    each frame's tag appended as one more segment. Each frame's prefix and table lie in one
    buffer, and each of its segments in one buffer (:func:`frame` makes them so)."""
    if len(segments) == 1 and type(segments[0]) is bytes:  # small frames: nearly all
        sealed = _seal_small(segments[0], auth)
        if sealed is not None:
            return sealed
    out: list[Any] = []
    small = True
    i, pos, count = 0, 0, len(segments)
    buf = segments[0]
    mv = _byte_view(buf)
    while i < count:
        nseg, body = _unpack_prefix(mv, pos)
        start = pos + _PREFIX_SIZE
        pos = start + 8 * nseg
        table = mv[start:pos]
        pieces: list[Any] = []
        for length in _table(nseg).unpack_from(mv, start):
            while pos == len(mv) and length:  # its own buffer (past any empty one)
                i += 1
                buf = segments[i]
                mv, pos = _byte_view(buf), 0
            if pos + length > len(mv):
                raise ValueError("a frame's segment runs over two buffers")
            pieces.append(buf if pos == 0 and length == len(mv) else mv[pos:pos + length])
            pos += length
        out.append(_PREFIX.pack(nseg + 1, body + 8 + TAG_SIZE) + table + _TAG_LENGTH)
        out += pieces
        out.append(auth.sign(nseg, table, pieces))
        small = small and body < _SMALL_FRAME
        while pos == len(mv):  # the next frame's buffer (past any empty one)
            i += 1
            if i == count:
                break
            buf = segments[i]
            mv, pos = _byte_view(buf), 0
    if small and len(out) > 1:  # one plain send, as frame() makes small frames
        return [b"".join(out)]
    return out


def _seal_small(whole: bytes, auth: FrameAuth) -> list[bytes] | None:
    """Whole frames back to back in one ``bytes`` (one frame, or an agent's outbox), none
    with a segment of ``PREHASH`` bytes, sealed into one ``bytes``: each frame's table and
    segments are contiguous, one update of its tag. None when that is not what it holds."""
    frames = []
    pos, size = 0, len(whole)
    while pos < size:  # first all of them, so that nothing is signed for a None
        nseg, body = _unpack_prefix(whole, pos)
        if body >= PREHASH or pos + _PREFIX_SIZE + body > size:
            return None
        frames.append((nseg, body, pos + _PREFIX_SIZE))
        pos += _PREFIX_SIZE + body
    out: list[Any] = []
    with memoryview(whole) as mv:
        for nseg, body, start in frames:
            table_end, end = start + 8 * nseg, start + body
            out += (_PREFIX.pack(nseg + 1, body + 8 + TAG_SIZE), mv[start:table_end],
                    _TAG_LENGTH, mv[table_end:end], auth.sign(nseg, mv[start:end], ()))
        return [b"".join(out)]


def _byte_view(buf: Any) -> memoryview:
    return memoryview(buf) if type(buf) is bytes else memoryview(buf).cast("B")


# --------------------------------------------------------------------------- sending


def _advance(segments: collections.deque[Any], sent: int) -> None:
    """Drop ``sent`` bytes from the front of a deque of byte segments."""
    while sent:
        head = segments[0]
        size = memoryview(head).nbytes
        if sent >= size:
            segments.popleft()
            sent -= size
        else:
            segments[0] = memoryview(head).cast("B")[sent:]
            sent = 0


class Connection:
    """One framed, full-duplex channel over a :class:`Stream`.

    ``send`` may be called from any thread and never blocks on the peer; receiving is done
    by one thread at a time (the worker's main loop, or the controller's dispatcher).
    With ``auth`` (a network connection: the keys its handshake gave) every frame is sealed
    as it is sent, in the order it is written, and ``reader`` verifies every frame.
    """

    def __init__(self, stream: Stream, writer: BacklogWriter,
                 reader: FrameReader | VerifyingReader | None = None,
                 auth: FrameAuth | None = None, quiet: bool = False) -> None:
        self.stream = stream
        self.read_fd = stream.read_fd
        self.write_fd = stream.write_fd
        reader = reader or FrameReader(stream)  # one that may hold bytes read already
        if auth is not None and not isinstance(reader, VerifyingReader):
            reader = VerifyingReader(reader, auth)
        self.reader: FrameReader | VerifyingReader = reader
        # the frames complete now, never blocking: recv_frames(block=False), in one call
        # where one read takes all that arrived (a poll loop's read: EventSink.watch), one
        # frame of a header and a pickle as that pair alone (FrameReader.recv_pair)
        self.recv_ready: Callable[[], list[list[Any]] | tuple[bytes, bytes]] = (
            reader.pair_reader() if type(reader) is FrameReader and not reader.holds_bytes
            else lambda: reader.recv_frames(False))
        self._auth = auth  # the handshake's keys: every frame sent is sealed with them
        self._write = stream.write_nowait
        # a frame in one bytes object goes to this descriptor by os.write (-1: _write);
        # it is closed only by close(), which a send under the lock has excluded
        self._fd = stream.direct_write_fd
        # a frame for a broken or closed connection is dropped, not raised: its owner
        # learns of the loss another way (a local rank's death comes as its exit status)
        self._quiet = quiet
        self._lock = threading.Lock()
        self._backlog: collections.deque[Any] = collections.deque()
        self._writer = writer
        self.broken: BaseException | None = None
        self.closed = False

    def send(self, segments: list[Any]) -> None:
        """Queue one frame, or several back to back (built by :func:`frame`); raises
        ConnectionLost if broken (unless ``quiet``: then the frame is dropped)."""
        with self._lock:
            if self.broken is not None or self.closed:
                if self._quiet:
                    return
                raise ConnectionLost(f"connection is closed ({self.broken or 'closed'})")
            if self._auth is not None:  # sealed in the order they will be written
                segments = seal_frames(segments, self._auth)
            if self._backlog:
                self._backlog.extend(segments)
                return
            try:
                if len(segments) == 1:  # one bytes object: see frame()
                    total = len(segments[0])
                    sent = (_write(self._fd, segments[0]) if self._fd >= 0
                            else self._write(segments))
                else:
                    total = sum(memoryview(s).nbytes for s in segments)
                    sent = self._write(segments)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.broken = exc
                if self._quiet:
                    return
                raise ConnectionLost(str(exc)) from exc
            if sent == total:
                return
            self._keep_rest(segments, sent)
        self._writer.schedule(self)

    def sender(self) -> Callable[[list[Any]], None]:
        """:meth:`send`, compiled where it can be: to a pipe's write end, without keys,
        where ``phalanx.wire._speedups`` was built. The same effect (it leaves everything
        but a small frame written whole to this connection's Python)."""
        if speedups is None or self._fd < 0 or self._auth is not None:
            return self.send
        return speedups.FrameSender(self, self._lock, self._fd)  # type: ignore[no-any-return]

    def _keep_rest(self, segments: list[Any], sent: int) -> None:
        """Queue what of ``segments`` the stream did not take (``sent`` bytes of them it
        did), under the lock; the caller schedules the writer once it let go."""
        self._backlog.extend(segments)
        _advance(self._backlog, sent)

    def flush_some(self) -> bool:
        """Write what the socket takes now; True when the backlog is empty. Its
        :class:`BacklogWriter` calls this once the stream is writable."""
        with self._lock:
            while self._backlog:
                chunk = list(self._backlog)[:_MAX_SEGMENTS]
                try:
                    sent = self.stream.write_nowait(chunk)
                except (BlockingIOError, InterruptedError):
                    return False
                except OSError as exc:
                    self.broken = exc
                    self._backlog.clear()
                    return True
                _advance(self._backlog, sent)
            return True

    @property
    def auth(self) -> FrameAuth | None:
        """The handshake's frame keys this connection seals and checks with (None: a
        local stream). A connection handed to another owner is rebuilt with them."""
        return self._auth

    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._backlog.clear()
        self.stream.close()


class BacklogWriter:
    """A thread that writes queued bytes to connections whose peer was not reading fast enough.

    The thread starts with the first send that could not complete at once (most processes
    never need it: a rank has one thread fewer to start and to end), and is idle (blocked in
    ``poll``) whenever no connection has a backlog.
    """

    def __init__(self, name: str = "phalanx-writer") -> None:
        self._pending: set[Connection] = set()
        self._lock = threading.Lock()
        self._wake = WakePipe()
        self._stopped = False
        self._name = name
        self._thread: threading.Thread | None = None

    def schedule(self, conn: Connection) -> None:
        with self._lock:
            if self._stopped:
                return
            self._pending.add(conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
        self._wake.wake()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._wake.wake()
            thread.join(timeout=5)
        self._wake.close()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake.fd, select.POLLIN)
        registered: dict[int, Connection] = {}
        while not self._stopped:
            with self._lock:
                wanted = {c.write_fd: c for c in self._pending if not c.closed}
                self._pending.clear()
            for fd, conn in wanted.items():
                if fd not in registered:
                    poller.register(fd, select.POLLOUT)
                registered[fd] = conn  # a closed connection's fd may have been reused
            for fd, conn in list(registered.items()):
                if conn.closed or conn.flush_some():
                    poller.unregister(fd)
                    del registered[fd]
            try:
                events = poller.poll()
            except InterruptedError:  # pragma: no cover
                continue
            if any(fd == self._wake.fd for fd, _ in events):
                self._wake.drain()
            # Writable connections are flushed at the top of the next iteration.
