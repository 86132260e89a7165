"""The messages between a controller and a node agent, besides the ranks' own.

One authenticated connection per node (:mod:`phalanx.wire.handshake`) carries, as
:mod:`phalanx.wire.framing` frames with :mod:`phalanx.wire.protocol` headers:

- the ranks' messages, unchanged: INIT, CALL (once per node with ``rank = MANY`` when the
  same payload goes to several of its ranks), SHUTDOWN one way; READY, RESULT, ERROR,
  HEARTBEAT... and EXITED the other;
- the node's own, below, whose ``call_id`` is a request id the reply carries back::

    controller -> agent  LAUNCH    (starts, sys_path, options, cwd)  payload (target, ...)
                         STOP      (ranks, grace, force)
                         SIGNAL    (rank, signal)                    no reply
                         STACKS    (rank, timeout)
                         PORTS     (count,)
                         WAIT      (ranks, timeout)
                         PING                                        no reply
                         SYNC      (version, listing)                which files it lacks
                         BLOBS     (hashes,)                         payload: their contents
                         TREE      (version, listing)                the code's path there
                         ADOPT     (id, entries, fanout, timeout)    be tree node id; adopt
                                                                     these agents (see
                                                                     phalanx.backends.cluster.tree)
                         HOLD      (id, token, writable)             payload: a put object's
                                                                     pickle and buffers, to
                                                                     hold for the node's ranks
                                                                     (phalanx.backends.cluster.agent.share)
                         DROP      (id,)                             it was freed; no reply
                         COPY      (id, token, block, host, port,    fetch a kept result from
                                    timeout)                         the agent at host:port
                                                                     (READ) and hold it as
                                                                     HOLD does
                         DEVICES   (count, holder)                   hold count of the node's
                                                                     GPUs for holder (0: give
                                                                     back what it holds);
                                                                     payload: none, or a
                                                                     pool's (SHARED, key) /
                                                                     its group's (SHARE,
                                                                     key);
                                                                     {"gpus": ids} or
                                                                     {"refused": why} (see
                                                                     phalanx.backends.cluster.agent.devices)
                         DETACH    (name, timeout)                   the group outlives this
                                                                     controller for timeout s
                                                                     (None: no more); payload:
                                                                     its description (see
                                                                     phalanx.backends.cluster.agent.detached)
                         ATTACH    (name, starts, force)             drive detached group name
                                                                     (a new connection's first
                                                                     request): the ranks' pids,
                                                                     then each one's READY
                         DESCRIBE  (name,)                           detached group name ("":
                                                                     every one) as a dict
                         ORPHANS   (take,)                           answers of calls whose
                                                                     controller left
    agent -> agent       READ      (block,)                          a rank's kept result:
                                                                     the reply's payload is
                                                                     its pickle and buffers
    agent -> controller  WELCOME   (node facts: host, gpus, machine, pid, version)
                         REPLY     (ok, value)                       to a request id
                         OUTPUT    (stream,)                         payload: bytes, rank
                                                                     (its launch: call_id)
                         OUTPUT_END (stream,)                        the rank's stream ended
                         FAULT     (reason,)                         why it drops the
                                                                     connection (last); with
                                                                     a request id: why it
                                                                     refused that request
                                                                     (a count over its
                                                                     limit), the session
                                                                     goes on
                         LOST      (ids, reason)                     nodes of its subtree
                                                                     it lost (a tree)
                         RESULTS   (count, ranks, sizes, buffers)    a call's results of
                                                                     several ranks, in rank
                                                                     order (see results())
                         PING                                        no reply

A node's own message names, in the header's rank field, the tree node it is for (0: the
agent the connection reaches): an agent of a tree hands it to the child whose subtree
holds that node, and the answer comes back up unchanged.

Every field of a controller's message is checked by :func:`check_request` before the agent
does anything with it: a count or size over its limit in :mod:`phalanx.config` is refused
(:class:`OverLimit`, naming the field, the value and the limit), and a message of an unknown
kind or with fields of the wrong number or type is :class:`Malformed`.

A RESULTS message carries the results of one call of ``count`` ranks of a subtree, gathered
by an agent of a tree (:mod:`phalanx.backends.cluster.agent.branch`), laid out so that the
controller reads it in one pass whatever the number of ranks: the header's rank field names
the first rank, ``ranks`` is None when the ranks run on from it (else their ``<u32>`` list),
``sizes`` the ``<u64>`` length of each rank's pickle, all of which lie back to back in the one
segment after the header, and ``buffers`` (None when no rank has any) the ``<u32>`` count of
each rank's out-of-band buffers, which follow as segments of their own, in rank order
(:func:`results`, read back by :func:`read_results` as a
:class:`~phalanx.wire.protocol.Gathered`).

An EXITED, OUTPUT or OUTPUT_END from an agent carries the rank's launch (its incarnation)
as ``call_id``, so a death or output reported late is never taken for that of the rank
started after it (an earlier launch's OUTPUT_END would end the new one's stream).
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from phalanx import config
from phalanx.wire import framing, protocol

LAUNCH = 64
STOP = 65
SIGNAL = 66
STACKS = 67
PORTS = 68
WAIT = 69
PING = 70
SYNC = 71
BLOBS = 72
TREE = 73
ADOPT = 74
HOLD = 75
DROP = 76
COPY = 77
READ = 78
DEVICES = 79
WELCOME = 80
REPLY = 81
OUTPUT = 82
OUTPUT_END = 83
FAULT = 84
LOST = 85
RESULTS = 86
DETACH = 87
ATTACH = 88
DESCRIBE = 89
ORPHANS = 90

STDOUT, STDERR = 1, 2

# A DEVICES request's payload, when it has one: (mode, key) (agent.devices says more)
DEVICES_SHARED = b"shared"  # take the GPUs; the sessions that show the key may share them
DEVICES_SHARE = b"share"  # share the GPUs the holder took with this key (count unused)


def request(kind: int, request_id: int, *fields: Any, payload: Sequence[Any] = (),
            node: int = 0) -> list[Any]:
    """A request to the agent (or a message with plain fields, ``request_id`` 0); ``node``:
    the tree node it is for (0: the agent the connection reaches)."""
    return framing.frame([protocol.header(kind, request_id, node, *fields), *payload])


class WithPayload(NamedTuple):
    """A request's answer with segments after its header (READ: a block's parts)."""

    value: Any
    payload: list[Any]


def reply(request_id: int, ok: bool, value: Any) -> list[Any]:
    """The agent's answer to request ``request_id``: a value (or a :class:`WithPayload`),
    or (not ok) an error text."""
    if isinstance(value, WithPayload):
        return framing.frame([protocol.header(REPLY, request_id, 0, ok, value.value),
                              *value.payload])
    return framing.frame([protocol.header(REPLY, request_id, 0, ok, value)])


def output(rank: int, incarnation: int, stream: int, data: bytes) -> list[Any]:
    """Bytes a rank's launch ``incarnation`` wrote to ``stream``."""
    return framing.frame([protocol.header(OUTPUT, incarnation, rank, stream), data])


def output_end(rank: int, incarnation: int, stream: int) -> list[Any]:
    """The end of ``stream`` of a rank's launch ``incarnation``."""
    return framing.frame([protocol.header(OUTPUT_END, incarnation, rank, stream)])


def fault(reason: str, request_id: int = 0) -> list[Any]:
    """The agent's FAULT: why it ends the session, or (``request_id``) why it refused that
    request and goes on."""
    return framing.frame([protocol.header(FAULT, request_id, 0, reason)])


def ping() -> list[Any]:
    return framing.frame([protocol.header(PING, 0, 0)])


def exited(rank: int, incarnation: int, failure: dict[str, Any]) -> list[Any]:
    """The agent's report that a rank's process ended (an EXITED naming its launch)."""
    return framing.frame([protocol.header(protocol.EXITED, incarnation, rank, failure)])


def lost(ids: Sequence[int], reason: str) -> list[Any]:
    """An agent's report that the nodes ``ids`` of its subtree are unreachable."""
    return framing.frame([protocol.header(LOST, 0, 0, list(ids), reason)])


def results(call_id: int, ranks: Sequence[int], payloads: Sequence[Sequence[Any]]) -> list[Any]:
    """A RESULTS message (see the module docstring): the answers to call ``call_id`` of
    ``ranks`` (increasing), ``payloads[i]`` that of ``ranks[i]`` as its RESULT carried it
    (a pickle, then its out-of-band buffers)."""
    count = len(ranks)
    first = ranks[0]
    listed = None if ranks[-1] - first == count - 1 else struct.pack(f"<{count}I", *ranks)
    sizes = struct.pack(f"<{count}Q", *[memoryview(p[0]).nbytes for p in payloads])
    extra = [len(p) - 1 for p in payloads]
    buffers = [s for p in payloads for s in p[1:]] if any(extra) else []
    counts = struct.pack(f"<{count}I", *extra) if buffers else None
    blob = b"".join([p[0] for p in payloads])
    return framing.frame([protocol.header(RESULTS, call_id, first, count, listed, sizes, counts),
                          blob, *buffers])


# The header of the usual RESULTS (contiguous ranks, no buffers) as plain.dumps lays it out:
# kind, call id, first rank; (count, None, sizes, None) as t 4 | q count | N | b 8*count...
_USUAL = struct.Struct("<BQIcIcqccI")
_USUAL_TAGS = (b"t", 4, b"q", b"N", b"b")
_SIZES: dict[int, struct.Struct] = {}  # a number of ranks -> the layout of their sizes


def read_results(segs: Sequence[Any]) -> protocol.Gathered:
    """A RESULTS message read back (:func:`results`), checked whole before anything of it
    is used: ValueError saying what is wrong (a header that does not parse raises what
    :func:`phalanx.wire.protocol.parse` raises)."""
    head = segs[0]
    if len(head) > _USUAL.size and len(segs) == 2 and head[-1:] == b"N":
        # the usual one, read in one unpacking: exactly the bytes the general reading
        # below accepts for it, or that reading decides
        kind, _, first, t, four, q, count, none, b, nbytes = _USUAL.unpack_from(head)
        if (kind == RESULTS and (t, four, q, none, b) == _USUAL_TAGS and count > 0
                and nbytes == 8 * count and len(head) == _USUAL.size + nbytes + 1
                and first + count <= protocol.MANY):
            table = _SIZES.get(count)
            if table is None:
                table = struct.Struct(f"<{count}Q")
                if len(_SIZES) < 4096:
                    _SIZES[count] = table
            lengths = table.unpack_from(head, _USUAL.size)
            blob = segs[1]
            carried = len(blob) if type(blob) is bytes else memoryview(blob).nbytes
            if sum(lengths) != carried:
                raise ValueError(f"pickles of {sum(lengths)} bytes in all, in a segment of "
                                 f"{carried}")
            return protocol.Gathered(range(first, first + count), segs[1], lengths)
    kind, _, named, extra = protocol.parse(head)
    if kind != RESULTS or len(extra) != 4 or len(named) != 1:
        raise ValueError(f"a message of kind {kind} with {len(extra)} fields for "
                         f"{len(named)} ranks is no RESULTS")
    count, listed, sizes, counts = extra
    if type(count) is not int or count < 1:  # its lists' lengths bound it below
        raise ValueError(f"results of {count!r:.40} ranks")
    first = named[0]
    ranks: Sequence[int]
    if listed is None:
        if first + count > protocol.MANY:
            raise ValueError(f"results of ranks {first} to {first + count - 1}")
        ranks = range(first, first + count)
    else:
        if type(listed) is not bytes or len(listed) != 4 * count:
            raise ValueError(f"a list of ranks of {_size(listed)} for {count} ranks")
        ranks = struct.unpack(f"<{count}I", listed)
        if ranks[0] != first or any(map(operator.ge, ranks, ranks[1:])):
            raise ValueError(f"ranks that are not increasing from {first}: {list(ranks)!r:.80}")
    if type(sizes) is not bytes or len(sizes) != 8 * count:
        raise ValueError(f"sizes of {_size(sizes)} for {count} ranks")
    lengths = struct.unpack(f"<{count}Q", sizes)
    if len(segs) < 2:
        raise ValueError("no segment of pickles")
    blob = segs[1]
    carried = memoryview(blob).nbytes
    if sum(lengths) != carried:
        raise ValueError(f"pickles of {sum(lengths)} bytes in all, in a segment of {carried}")
    if counts is None:
        if len(segs) != 2:
            raise ValueError(f"{len(segs) - 2} buffers, and no rank's count of them")
        return protocol.Gathered(ranks, blob, lengths)
    if type(counts) is not bytes or len(counts) != 4 * count:
        raise ValueError(f"counts of buffers of {_size(counts)} for {count} ranks")
    numbers = struct.unpack(f"<{count}I", counts)
    if sum(numbers) != len(segs) - 2:
        raise ValueError(f"counts of buffers adding up to {sum(numbers)} for "
                         f"{len(segs) - 2} buffers")
    return protocol.Gathered(ranks, blob, lengths, list(segs[2:]), numbers)


def _size(value: Any) -> str:
    return (f"{len(value)} bytes" if type(value) is bytes
            else f"a {type(value).__name__} {value!r:.40}")


def is_node_message(kind: int) -> bool:
    """Whether a message kind is the node's own (not a rank's)."""
    return kind >= LAUNCH


# --------------------------------------------------------------------------- checking


class Malformed(ValueError):
    """A controller's message the agent cannot read: an unknown kind, fields of the wrong
    number or type (the session ends, after a FAULT naming what was wrong)."""


class OverLimit(ValueError):
    """A well-formed request with a count or size over the agent's limit (refused with a
    FAULT naming the field, the value and the limit; the session goes on)."""


_Check = Callable[[str, str, Any], None]


def _limit(name: str) -> int:
    limit: int = getattr(config, name)  # one of config's int limits, by name
    return limit


def _over(what: str, value: int, name: str) -> None:
    if value > _limit(name):
        raise OverLimit(f"{what} is {value}, over the agent's limit of {_limit(name)} "
                        f"(phalanx.config.{name})")


def _integer(low: int = 0, limit: str | None = None) -> _Check:
    def check(kind: str, field: str, value: Any) -> None:
        if type(value) is not int:
            raise Malformed(f"{kind} {field} is a {type(value).__name__}, not an integer")
        if value < low:
            raise Malformed(f"{kind} {field} is {value}, under {low}")
        if limit is not None:
            _over(f"{kind} {field}", value, limit)
    return check


def _seconds(kind: str, field: str, value: Any) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise Malformed(f"{kind} {field} is {value!r}, not a number of seconds")


def _of_type(*types: type) -> _Check:
    def check(kind: str, field: str, value: Any) -> None:
        if type(value) not in types:
            raise Malformed(f"{kind} {field} is a {type(value).__name__}, not a "
                            f"{' or '.join(t.__name__ for t in types)}")
    return check


def _items(limit: str, each: _Check | None = None) -> _Check:
    """A list (or tuple) of at most ``config.<limit>`` items, each passing ``each``."""
    def check(kind: str, field: str, value: Any) -> None:
        if type(value) not in (list, tuple):
            raise Malformed(f"{kind} {field} is a {type(value).__name__}, not a list")
        _over(f"{kind} {field}: its length", len(value), limit)
        if each is not None:
            for item in value:
                each(kind, field, item)
    return check


def _start(kind: str, field: str, value: Any) -> None:
    """One rank's start in a LAUNCH: (rank, node, incarnation, env)."""
    if type(value) not in (list, tuple) or len(value) != 4:
        raise Malformed(f"{kind} {field} holds {type(value).__name__} {value!r:.80}, not "
                        "(rank, node, incarnation, environment)")
    for name, number in zip(("rank", "node", "incarnation"), value[:3], strict=False):
        _integer()(kind, f"{field}: a {name}", number)
    env = value[3]
    if type(env) is not dict:
        raise Malformed(f"{kind} {field}: an environment is a {type(env).__name__}, not a dict")
    _over(f"{kind} {field}: the variables of one", len(env), "AGENT_MAX_ENV")
    if not all(type(k) is str and type(v) is str for k, v in env.items()):
        raise Malformed(f"{kind} {field}: an environment holds something else than text")


_TEXT = _of_type(str)
_MAX_HOLDER = 512  # characters of a DEVICES holder's name


def _text(most: int) -> _Check:
    """Text of at most ``most`` characters."""
    def check(kind: str, field: str, value: Any) -> None:
        _TEXT(kind, field, value)
        if len(value) > most:
            raise OverLimit(f"{kind} {field} is {len(value)} characters long, over {most}")
    return check

_FLAG = _of_type(bool)
_MAX_PYTHON = 4096  # PATH_MAX: the longest interpreter path a LAUNCH may name


def _launch_options(kind: str, field: str, value: Any) -> None:
    """A LAUNCH's options: a dict; its ``python`` (the interpreter the ranks run, ``python=``),
    if any, an absolute path of at most ``_MAX_PYTHON`` characters."""
    _of_type(dict)(kind, field, value)
    python = value.get("python")
    if python is None:
        return
    if type(python) is not str:
        raise Malformed(f"{kind} {field}: python is a {type(python).__name__}, not a path")
    if len(python) > _MAX_PYTHON:
        raise OverLimit(f"{kind} {field}: python is {len(python)} characters long, over "
                        f"{_MAX_PYTHON}")
    if not python.startswith("/") or "\0" in python:
        raise Malformed(f"{kind} {field}: python={python!r:.200} is not an absolute path")

_RANKS = _items("AGENT_MAX_RANKS", _integer())
_MAX_NAME = 256  # characters of a detached group's name


def _seconds_or_none(kind: str, field: str, value: Any) -> None:
    if value is not None:
        _seconds(kind, field, value)


def _block(kind: str, field: str, value: Any) -> None:
    """Where a rank keeps a result: (pid, fd, name, extents, capacity[, tensors]), as
    :mod:`phalanx.rank.kept` says it (the extents: [offset, length] pairs; tensors: its
    readers map it copy-on-write)."""
    if type(value) not in (list, tuple) or len(value) not in (5, 6):
        raise Malformed(f"{kind} {field} is {type(value).__name__} {value!r:.80}, not "
                        "(pid, fd, name, extents, capacity[, tensors])")
    pid, fd, name, extents, capacity = value[:5]
    if len(value) == 6:
        _FLAG(kind, f"{field}: its tensors flag", value[5])
    _integer(1)(kind, f"{field}: its pid", pid)
    _integer()(kind, f"{field}: its descriptor", fd)
    _TEXT(kind, f"{field}: its name", name)
    _integer(1)(kind, f"{field}: its capacity", capacity)
    _items("AGENT_MAX_FRAME_SEGMENTS")(kind, f"{field}: its extents", extents)
    for extent in extents:
        if (type(extent) not in (list, tuple) or len(extent) != 2
                or not all(type(n) is int and 0 <= n for n in extent)
                or extent[0] + extent[1] > capacity):
            raise Malformed(f"{kind} {field}: an extent is {extent!r:.80}, not (offset, "
                            f"length) within its {capacity} bytes")

# Each request's name and fields, in order, with their checks.
_REQUESTS: dict[int, tuple[str, tuple[tuple[str, _Check], ...]]] = {
    LAUNCH: ("LAUNCH", (("starts", _items("AGENT_MAX_RANKS", _start)),
                        ("sys_path", _items("AGENT_MAX_ENV", _TEXT)),
                        ("options", _launch_options), ("cwd", _of_type(str, type(None))))),
    STOP: ("STOP", (("ranks", _RANKS), ("grace", _seconds), ("force", _FLAG))),
    SIGNAL: ("SIGNAL", (("rank", _integer()), ("signal", _integer(1)))),
    STACKS: ("STACKS", (("rank", _integer()), ("timeout", _seconds))),
    PORTS: ("PORTS", (("count", _integer(0, "AGENT_MAX_PORTS")),)),
    WAIT: ("WAIT", (("ranks", _RANKS), ("timeout", _seconds))),
    PING: ("PING", ()),
    SYNC: ("SYNC", (("version", _TEXT), ("listing", _items("AGENT_MAX_FILES")))),
    BLOBS: ("BLOBS", (("hashes", _items("AGENT_MAX_FILES", _TEXT)),)),
    TREE: ("TREE", (("version", _TEXT), ("listing", _items("AGENT_MAX_FILES")))),
    ADOPT: ("ADOPT", (("id", _integer()), ("entries", _items("AGENT_MAX_TREE")),
                      ("fanout", _integer(2, "AGENT_MAX_TREE")), ("timeout", _seconds))),
    HOLD: ("HOLD", (("id", _integer()), ("token", _TEXT), ("writable", _FLAG))),
    DROP: ("DROP", (("id", _integer()),)),
    COPY: ("COPY", (("id", _integer()), ("token", _TEXT), ("block", _block), ("host", _TEXT),
                    ("port", _integer(1)), ("timeout", _seconds))),
    READ: ("READ", (("block", _block),)),
    DEVICES: ("DEVICES", (("count", _integer(0, "AGENT_MAX_RANKS")),
                          ("holder", _text(_MAX_HOLDER)))),
    DETACH: ("DETACH", (("name", _text(_MAX_NAME)), ("timeout", _seconds_or_none))),
    ATTACH: ("ATTACH", (("name", _text(_MAX_NAME)), ("starts", _items("AGENT_MAX_RANKS", _start)),
                        ("force", _FLAG))),
    DESCRIBE: ("DESCRIBE", (("name", _text(_MAX_NAME)),)),
    ORPHANS: ("ORPHANS", (("take", _FLAG),)),
}

# The ranks' messages a controller sends through an agent.
RANK_KINDS = frozenset((protocol.INIT, protocol.CALL, protocol.CALL_STREAM, protocol.SHUTDOWN,
                        protocol.INJECT))


def check_request(kind: int, fields: Any, payload: Sequence[Any]) -> None:
    """Check a controller's message to a node before anything is done with it: Malformed
    or OverLimit naming what is wrong (a rank's message: only its kind)."""
    if kind in RANK_KINDS:
        return
    spec = _REQUESTS.get(kind)
    if spec is None:
        raise Malformed(f"a message of unknown kind {kind}")
    name, params = spec
    if type(fields) is not tuple or len(fields) != len(params):
        count = len(fields) if type(fields) is tuple else type(fields).__name__
        raise Malformed(f"{name} with {count} fields (it has {len(params)}"
                        f"{': ' if params else ''}{', '.join(p for p, _ in params)})")
    for (field, check), value in zip(params, fields, strict=True):
        check(name, field, value)
    if kind == DETACH and len(payload) > 1:
        raise Malformed(f"DETACH with {len(payload)} segments (its description is one)")
    if kind == BLOBS and len(payload) != len(fields[0]):
        raise Malformed(f"BLOBS with {len(fields[0])} hashes for {len(payload)} files")
