"""The messages between the controller and its ranks: the one place frames are built and read.

:mod:`phalanx.wire.framing` moves frames (lists of byte segments); this module says what they mean.
Segment 0 of every frame is a header::

    <u8 kind><u64 call_id><u32 rank>[ <u8 flags> method name | extra fields ]

``rank`` is the destination of a message to the workers and the source of a message from
them, so one connection can carry several ranks (a node agent's, say). A message for
several ranks of one node is sent once, with ``rank = MANY`` followed by ``<u16 n>`` and the
``n`` destination ranks as ``<u32>``: it crosses the wire once and the node hands it to each.

Message kinds (payload = the segments after the header: a pickle and its buffers)::

    controller -> rank   INIT         (sys_path, options)   payload (target, args, kwargs)
                         CALL         flags, method         payload (args, kwargs)
                         CALL_STREAM  flags, method         payload (args, kwargs)
                         SHUTDOWN
                         INJECT       (method, kind, argument)  the rank's next call of
                                                            method fails so (inject_fault)
    node side -> rank    SHARE        (ref id, token, location)  a shared object is held
                                                            on the rank's node (phalanx.node.shm)
                         UNSHARE      (ref id,)             it was freed: forget it
                         UNMAP        (block name,)         a pooled block was closed
    rank -> node side    RELEASED     (ref id,)             no view of a freed object in a
                                                            pooled block is left here
    rank -> controller   READY        (pid, {method: parameter names}, start-up timings,
                                      code version)
                         INIT_ERROR   (RemoteFailure tuple)
                         RESULT                             payload value
                         YIELD                              payload item (RESULT ends the stream)
                         ERROR        (RemoteFailure tuple)
                         HEARTBEAT                          a sign of life, sent from a thread
                         COLLECTIVE   (inside, last)        the collectives it is in, and the
                                                            last each group completed
                                                            (phalanx.rank.collectives)
    node side -> ctrl    EXITED       (ProcessFailure fields)  the rank's process ended

A call's flags say how the rank treats it, apart from the method's name (which is the
user's, whatever characters it holds): :data:`KEEP` (the result stays on the rank,
:mod:`phalanx.rank.kept`), :data:`TRACED` (the rank records when it ran the call,
:mod:`phalanx.rank.tracing`), :data:`BUILTIN` (a call the rank runtime serves itself, not
a method of the user's object).

The extra fields are plain data (:mod:`phalanx.wire.plain`: numbers, text, lists, dicts),
never a pickle, so reading a header runs no code whoever sent it. On a connection across the
network every frame is authenticated before it gets here (:mod:`phalanx.wire.seal`), and
only then is its payload unpickled.

``EXITED`` is what the node side of a backend (the local backend's process watcher, a Ray
actor's watcher, an agent) reports when a rank's process is gone, with everything known
about how: exit code or signal, last stderr lines, a likely cause. The dispatcher treats it
like any other message.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

from phalanx.wire import framing, plain

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from typing import Any

INIT = 4
CALL = 1
CALL_STREAM = 8
SHUTDOWN = 7
READY = 5
INIT_ERROR = 6
RESULT = 2
YIELD = 9
ERROR = 3
EXITED = 10
HEARTBEAT = 11
SHARE = 12
UNSHARE = 13
INJECT = 14
UNMAP = 15
RELEASED = 16
COLLECTIVE = 17

MANY = 0xFFFFFFFF  # rank field of a message for several ranks (their list follows)

# A call's flags: the byte before its method name (see the module docstring).
KEEP = 1
TRACED = 2
BUILTIN = 4
_FLAG_BYTES = tuple(bytes([flags]) for flags in range(8))  # each one's byte, made once

_HEAD = struct.Struct("<BQI")  # kind, call id, rank: the one layout of a header
HEAD_SIZE = _HEAD.size
_COUNT = struct.Struct("<H")
unpack_head = _HEAD.unpack_from  # (kind, call_id, rank) of segment 0
pack_head = _HEAD.pack  # (kind, call_id, rank) -> a header with no extra fields
_NONE = b"\x80\x05N."  # pickle.dumps(None, protocol=5): pickle is not imported here
_ID = struct.Struct("<Q")
_CALL_BYTE = bytes([CALL])


def _ranks_part(rank: int | Sequence[int]) -> bytes:
    if isinstance(rank, int):
        return struct.pack("<I", rank)
    ranks = list(rank)
    if len(ranks) == 1:
        return struct.pack("<I", ranks[0])
    return struct.pack(f"<IH{len(ranks)}I", MANY, len(ranks), *ranks)


def header(kind: int, call_id: int, rank: int | Sequence[int], *extra: Any) -> bytes:
    """Segment 0 of a frame. CALL and CALL_STREAM carry the call's flags and the method
    name as text (``extra``: the method, and the flags if any); the other kinds carry
    their extra fields as plain data (RESULT and YIELD carry none)."""
    head = bytes([kind]) + struct.pack("<Q", call_id) + _ranks_part(rank)
    if kind == CALL or kind == CALL_STREAM:
        method, flags = extra if len(extra) == 2 else (extra[0], 0)
        name: bytes = method.encode()
        return head + _FLAG_BYTES[flags] + name
    if not extra:
        return head
    return head + plain.dumps(extra)


def parse(segment: Any) -> tuple[int, int, tuple[int, ...], tuple[Any, ...]]:
    """``(kind, call_id, ranks, extra)`` of a header (the inverse of :func:`header`);
    :class:`ValueError` if it is malformed."""
    kind, call_id, rank = _HEAD.unpack_from(segment)
    pos = HEAD_SIZE
    if rank == MANY:
        (count,) = _COUNT.unpack_from(segment, pos)
        pos += _COUNT.size
        ranks = struct.unpack_from(f"<{count}I", segment, pos)
        pos += 4 * count
    else:
        ranks = (rank,)
    rest = bytes(segment[pos:])
    if kind == CALL or kind == CALL_STREAM:
        if not rest:
            raise ValueError("a call's header without its flags")
        return kind, call_id, ranks, (rest[1:].decode(), rest[0])
    return kind, call_id, ranks, (plain.loads(rest) if rest else ())


def ranks_part(ranks: Sequence[int]) -> bytes:
    """The rank field of a header for ``ranks`` (one rank, or ``MANY`` and their list):
    made once by a sender that sends to the same ranks again and again
    (:func:`call_frame_to`)."""
    return _ranks_part(ranks)


def body_offset(segment: Any) -> int:
    """Where the flags and method name of a call (or the extra fields) of a header start."""
    if _HEAD.unpack_from(segment)[2] != MANY:
        return HEAD_SIZE
    count: int = _COUNT.unpack_from(segment, HEAD_SIZE)[0]
    return HEAD_SIZE + _COUNT.size + 4 * count


def retarget(segment: Any, ranks: Sequence[int]) -> bytes:
    """The same header for another set of destination ranks (a node of a tree handing a
    message for several subtrees to each, with that subtree's ranks)."""
    kind, call_id, _ = _HEAD.unpack_from(segment)
    return bytes([kind]) + struct.pack("<Q", call_id) + _ranks_part(ranks) + bytes(
        segment[body_offset(segment):])


# -- controller -> ranks ------------------------------------------------------------------


def init_frame(rank: int, sys_path: Sequence[str], options: dict[str, Any],
               payload: list[Any]) -> list[Any]:
    """Build the rank's object: ``payload`` is the pickled ``(target, args, kwargs)``.
    ``sys_path`` entries go first on the worker's ``sys.path`` (empty: leave it be)."""
    return framing.frame([header(INIT, 0, rank, list(sys_path), options), *payload])


def call_frame(
    call_id: int, rank: int | Sequence[int], method: str, payload: list[Any],
    stream: bool = False, flags: int = 0,
) -> list[Any]:
    """A call of ``method`` with the pickled ``(args, kwargs)``; ``stream``: the rank sends
    each item of the returned generator as it comes (YIELD), then RESULT; ``flags``: the
    call's (:data:`KEEP`, :data:`TRACED`, :data:`BUILTIN`)."""
    kind = CALL_STREAM if stream else CALL
    return framing.frame([header(kind, call_id, rank, method, flags), *payload])


def call_frame_to(call_id: int, part: bytes, method: str, payload: list[Any],
                  flags: int = 0) -> list[Any]:
    """:func:`call_frame` of a call that is not streamed, to the ranks whose rank field is
    ``part`` (:func:`ranks_part`, made once): the same bytes, with no packing of the ranks
    per call."""
    name = None if flags else _NAMES.get(method)
    if name is None:
        name = _FLAG_BYTES[flags] + method.encode()
        if not flags and len(_NAMES) < 4096:
            _NAMES[method] = name
    head = _CALL_BYTE + _ID.pack(call_id) + part + name
    if len(payload) == 1 and type(payload[0]) is bytes and len(payload[0]) < SMALL_PAYLOAD:
        pickled = payload[0]
        return [_PAIR.pack(2, 16 + len(head) + len(pickled), len(head), len(pickled)) + head
                + pickled]
    return framing.frame([head, *payload])


def call_frames(
    call_id: int, ranks: Sequence[int], method: str, payloads: list[list[Any]], stream: bool,
    flags: int = 0,
) -> list[list[Any]]:
    """One call frame per rank: ``payloads`` holds one payload for all, or one per rank
    (a payload object repeated in the list is the same bytes, framed for each rank)."""
    kind = CALL_STREAM if stream else CALL
    name = _FLAG_BYTES[flags] + method.encode()
    pack = _HEAD.pack
    frame = framing.frame
    if len(payloads) == 1:
        (payload,) = payloads
        prefix = framing.small_frame_prefix(HEAD_SIZE + len(name), payload)
        if prefix is not None:  # the usual call: frame it once, stamp each rank's header
            tail = name + payload[0]
            return [[prefix + pack(kind, call_id, rank) + tail] for rank in ranks]
        return [frame([pack(kind, call_id, rank) + name, *payload]) for rank in ranks]
    head = (kind, call_id)
    return [frame([pack(*head, rank) + name, *p]) for rank, p in zip(ranks, payloads, strict=True)]


SMALL_PAYLOAD = framing.SMALL_FRAME  # a pickle shorter than this frames as one bytes object
_NAMES: dict[str, bytes] = {}  # a method's name, encoded (the hot path's, flags 0)
_PAIR = struct.Struct("<IQQQ")  # a two-segment frame's prefix (see framing's layout)
_PAIR_HEAD = struct.Struct(_PAIR.format + _HEAD.format[1:])  # that prefix and a header


def _name_of(method: str) -> bytes:
    """A method's name as a plain call's header ends with it (flags 0), kept for the next."""
    name = _FLAG_BYTES[0] + method.encode()
    if len(_NAMES) < 4096:
        _NAMES[method] = name
    return name


def small_call_parts(method: str, pickled: bytes) -> tuple[bytes, bytes]:
    """What every rank's frame of a plain call (no flags, not streamed) with one pickle
    shorter than :data:`SMALL_PAYLOAD` shares: the frame's prefix, before the header of
    its rank, and what follows that header (the method's name and the pickle)."""
    name = _NAMES.get(method) or _name_of(method)
    head_size = HEAD_SIZE + len(name)
    size = len(pickled)
    return _PAIR.pack(2, 16 + head_size + size, head_size, size), name + pickled


def small_call_frames(call_id: int, ranks: Sequence[int], method: str,
                      pickled: bytes) -> list[list[Any]]:
    """:func:`call_frames` of a plain call (no flags, not streamed) with one pickle
    shorter than :data:`SMALL_PAYLOAD`: the same bytes, made with less work (each rank's
    frame is :func:`small_call_parts`' prefix, its rank's header, and their tail)."""
    if len(ranks) == 1:  # one pack, no comprehension: a tenth of the call's own time here
        name = _NAMES.get(method) or _name_of(method)
        head_size = HEAD_SIZE + len(name)
        size = len(pickled)
        return [[b"".join((_PAIR_HEAD.pack(2, 16 + head_size + size, head_size, size, CALL,
                                           call_id, ranks[0]), name, pickled))]]
    prefix, tail = small_call_parts(method, pickled)
    pack = _HEAD.pack
    return [[prefix + pack(CALL, call_id, rank) + tail] for rank in ranks]


def shutdown_frame(rank: int | Sequence[int]) -> list[Any]:
    """Ask an idle rank to exit on its own (atexit handlers and framework cleanup run)."""
    return framing.frame([header(SHUTDOWN, 0, rank)])


def inject_frame(rank: int, method: str, kind: str, argument: Any) -> list[Any]:
    """Make the rank's next call of ``method`` fail: ``kind`` is "signal", "exit", "hang"
    or "raise" (see ``WorkerGroup.inject_fault``)."""
    return framing.frame([header(INJECT, 0, rank, method, kind, argument)])


def share_frame(rank: int | Sequence[int], ref_id: int, token: str,
                location: tuple[Any, ...]) -> list[Any]:
    """Where the rank's node holds shared object ``ref_id``
    (:meth:`phalanx.node.shm.Block.location`)."""
    return framing.frame([header(SHARE, 0, rank, ref_id, token, location)])


def unshare_frame(rank: int | Sequence[int], ref_id: int) -> list[Any]:
    return framing.frame([header(UNSHARE, 0, rank, ref_id)])


def unmap_frame(rank: int | Sequence[int], name: str) -> list[Any]:
    return framing.frame([header(UNMAP, 0, rank, name)])


def released_frame(rank: int, ref_id: int) -> list[Any]:
    return framing.frame([header(RELEASED, 0, rank, ref_id)])


# -- ranks -> controller ------------------------------------------------------------------


def ready_frame(rank: int, pid: int, methods: dict[str, list[str]],
                timings: dict[str, float], code_version: str | None = None) -> list[Any]:
    """The rank is up: its pid, methods (each with its parameters' names), start-up
    timings, and the version of the shipped code it runs (``PHALANX_CODE_VERSION``; None
    without ``sync``)."""
    return framing.frame([header(READY, 0, rank, pid, methods, timings, code_version)])


def heartbeat_frame(rank: int) -> list[Any]:
    return framing.frame([_HEAD.pack(HEARTBEAT, 0, rank)])


def collective_frame(rank: int, inside: list[Any], last: list[Any]) -> list[Any]:
    return framing.frame([header(COLLECTIVE, 0, rank, inside, last)])


def init_error_frame(rank: int, failure: tuple[Any, ...]) -> list[Any]:
    return framing.frame([header(INIT_ERROR, 0, rank, failure)])


def result_frame(call_id: int, rank: int, payload: list[Any], item: bool = False) -> list[Any]:
    """A call's value (or, with ``item``, one item of a streamed call)."""
    return framing.frame([_HEAD.pack(YIELD if item else RESULT, call_id, rank), *payload])


def end_of_stream_frame(call_id: int, rank: int) -> list[Any]:
    return framing.frame([_HEAD.pack(RESULT, call_id, rank), _NONE])


class Gathered:
    """Several ranks' answers to one call, as one message brings them (an agent tree's
    RESULTS, :mod:`phalanx.backends.cluster.messages`): read in one pass, each rank's
    answer cut out only when its value is read.

    ``ranks`` are increasing (a ``range`` when they are contiguous). Each rank's pickle
    lies in ``blob``, back to back in rank order (``sizes``: their lengths); the
    out-of-band buffers of the answers that have any follow in ``buffers``, in rank order,
    ``counts`` of them for each rank (None: no answer has any).
    """

    __slots__ = ("_blob", "_buffers", "_cuts", "_sizes", "_starts", "ranks")

    def __init__(self, ranks: Sequence[int], blob: Any, sizes: Sequence[int],
                 buffers: Sequence[Any] = (), counts: Sequence[int] | None = None) -> None:
        self.ranks = ranks
        self._blob = blob
        self._sizes = sizes
        self._cuts: list[int] | None = None  # where each pickle starts: made when needed
        self._buffers = buffers
        self._starts = (None if counts is None
                        else list(itertools.accumulate(counts, initial=0)))

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def _offsets(self) -> list[int]:
        cuts = self._cuts
        if cuts is None:
            cuts = self._cuts = list(itertools.accumulate(self._sizes, initial=0))
        return cuts

    def pickle(self, i: int) -> Any:
        """The pickle of the answer of ``ranks[i]`` (its out-of-band buffers apart)."""
        offsets = self._offsets
        return self._blob[offsets[i]:offsets[i + 1]]

    @property
    def plain(self) -> bool:
        """Whether no answer has out-of-band buffers (each is its pickle alone)."""
        return self._starts is None

    def pickles(self) -> list[Any]:
        """Every rank's pickle, in rank order (out-of-band buffers apart)."""
        blob, offsets = self._blob, self._offsets
        return [blob[a:b] for a, b in itertools.pairwise(offsets)]

    def sub(self, i: int, j: int) -> Gathered:
        """The answers of ``ranks[i:j]`` alone (their pickles' bytes copied out)."""
        offsets, starts = self._offsets, self._starts
        blob = self._blob[offsets[i]:offsets[j]]
        if starts is None:
            return Gathered(self.ranks[i:j], blob, self._sizes[i:j])
        counts = [b - a for a, b in itertools.pairwise(starts[i:j + 1])]
        return Gathered(self.ranks[i:j], blob, self._sizes[i:j],
                        self._buffers[starts[i]:starts[j]], counts)

    def payload(self, i: int) -> list[Any]:
        """The answer of ``ranks[i]`` as a RESULT carries it: its pickle, then its buffers."""
        offsets, starts = self._offsets, self._starts
        pickled = self._blob[offsets[i]:offsets[i + 1]]
        if starts is None or starts[i] == starts[i + 1]:
            return [pickled]
        return [pickled, *self._buffers[starts[i]:starts[i + 1]]]

    def uniform(self) -> bytes | None:
        """The one pickle every rank answered with, byte for byte, with no out-of-band
        buffers (a call every rank answers alike: ``None``, a count); None when they
        differ. One comparison over the bytes, whatever the number of ranks."""
        blob = self._blob
        if self._starts is not None or type(blob) is not bytes:
            return None
        sizes = self._sizes
        count, size = len(sizes), sizes[0]
        if size == 0 or len(blob) != size * count or sizes.count(size) != count:
            return None
        first = blob[:size]
        # non-overlapping occurrences: count of them in count * size bytes tile it exactly
        return first if count == 1 or blob.count(first) == count else None


def error_frame(call_id: int, rank: int, failure: tuple[Any, ...]) -> list[Any]:
    return framing.frame([header(ERROR, call_id, rank, failure)])


def exited_message(rank: int, failure: dict[str, Any]) -> list[Any]:
    """The node side's report that a rank's process ended, as the segments of a received
    frame (``failure``: ProcessFailure fields, plain data that any node side can send)."""
    return [header(EXITED, 0, rank, failure)]
