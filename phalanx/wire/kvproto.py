"""The key-value store of a joint torch world, as bytes: who may talk to it, and what they say.

A joint world's members meet in a store (``torch.distributed``'s rendezvous: gloo's and
NCCL's addresses, NCCL's unique id, barriers' counters), served by one member
(:mod:`phalanx.wire.kvstore`). torch's own ``TCPStore`` answers anyone who connects, on every
interface; this one answers only a peer that proves the world's secret -- 32 random bytes
the controller made for that world and handed to its members inside calls, over phalanx's
authenticated links. This module is the protocol, with no socket: the proofs, the frames
and their tags, the requests and replies, and the table a server keeps (tested without a
connection).

The handshake (the client proves first, so a stranger learns nothing derived from the
secret; each side proves itself, so neither a stranger who connects nor one who took the
port first is believed)::

    client -> server   MAGIC (8 B), nonce_c (32 B)
    server -> client   nonce_s (32 B)
    client -> server   HMAC(secret, "client" | MAGIC | nonce_c | nonce_s)
    server -> client   REFUSED (1 B), and it closes                     -- a wrong proof --
                       or ACCEPTED (1 B), HMAC(secret, "server" | MAGIC | nonce_c | nonce_s)

Then frames, each way: ``<u32 length> body <tag>``, ``tag`` the first 16 bytes of
``HMAC(key, <u64 count> body)``, one key per direction derived from the secret and both
nonces, ``count`` the frames sent that way before (it never travels): a relay that forwarded
the handshake cannot write, alter, replay or reorder a frame unnoticed. Frames are not
encrypted (what they hold: the members' listening addresses, which their collectives'
traffic shows anyway).

A body is ``<u8 op or status>`` then fields, each ``<u32 length> bytes`` (an integer is 8
bytes, little-endian, signed). Requests (:class:`Op`) and their replies' fields::

    SET key value                 -> (none)
    GET timeout_ms key            -> value        (waits until the key exists)
    ADD key delta                 -> new value     (the value is a decimal integer)
    COMPARE_SET key expected new  -> value now    (torch's compare_set)
    DELETE key                    -> 1 or 0
    NUM_KEYS                      -> count
    CHECK key...                  -> 1 or 0       (every key exists)
    WAIT timeout_ms key...        -> (none)       (until every key exists)

A reply's status is :data:`OK`, :data:`TIMED_OUT` (a GET or WAIT past its timeout) or
:data:`FAILED` (its one field says why: ADD to a value that is not an integer).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence

MAGIC = b"PXSTORE1"
NONCE_SIZE = 32
PROOF_SIZE = 32  # HMAC-SHA256
SECRET_SIZE = 32  # what the controller makes; a shorter one is refused below MIN_SECRET
MIN_SECRET = 16
TAG_SIZE = 16
ACCEPTED, REFUSED = b"\x01", b"\x00"
HELLO_SIZE = len(MAGIC) + NONCE_SIZE  # what a client sends first

MAX_FRAME = 64 << 20  # bytes of one body (a member's frame; no stranger's is ever read)
MAX_FIELDS = 1 << 16  # fields of one body (keys of one CHECK or WAIT)
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000  # of one GET or WAIT

_LENGTH = struct.Struct("<I")
_COUNT = struct.Struct("<Q")
_INT = struct.Struct("<q")

OK, TIMED_OUT, FAILED = 0, 1, 2  # a reply's status


class Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    DELETE = 5
    NUM_KEYS = 6
    CHECK = 7
    WAIT = 8


class ProtocolError(ValueError):
    """A frame that is not what the protocol allows (a tag that fails, a body cut short, an
    unknown op): the connection it came on ends."""


# -- the handshake ----------------------------------------------------------------------


class Proofs:
    """What one handshake proves and derives, from the secret and both nonces (``magic``:
    the protocol's, which the proofs cover: one protocol's proof is none of another's)."""

    def __init__(self, secret: bytes, nonce_c: bytes, nonce_s: bytes,
                 magic: bytes = MAGIC) -> None:
        check_secret(secret)
        transcript = magic + nonce_c + nonce_s
        self.client = _mac(secret, b"client", transcript)
        self.server = _mac(secret, b"server", transcript)
        self.to_server = _mac(secret, b"frames client->server", transcript)
        self.to_client = _mac(secret, b"frames server->client", transcript)


def check_secret(secret: object) -> bytes:
    """``secret`` itself, or TypeError / ValueError saying what is wrong with it."""
    if not isinstance(secret, bytes):
        raise TypeError(f"a store's secret is bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET:
        raise ValueError(f"a store's secret has at least {MIN_SECRET} bytes, not "
                         f"{len(secret)}")
    return secret


def proved(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def _mac(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(key, label + b"|" + data, hashlib.sha256).digest()


# -- frames -------------------------------------------------------------------------------


class _Tags:
    """The tags of one direction of a connection: keyed, and counting its frames."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._count = 0

    def _next(self, body: bytes) -> bytes:
        mac = hmac.new(self._key, _COUNT.pack(self._count), hashlib.sha256)
        mac.update(body)
        self._count += 1
        return mac.digest()[:TAG_SIZE]


class Sealer(_Tags):
    """Frames one way of a connection, each tagged."""

    def seal(self, body: bytes) -> bytes:
        if len(body) > MAX_FRAME:
            raise ValueError(f"a store frame holds at most {MAX_FRAME} bytes, not {len(body)}")
        return _LENGTH.pack(len(body)) + body + self._next(body)


class Opener(_Tags):
    """The other end of a :class:`Sealer`: checks each frame's tag, in order."""

    @staticmethod
    def length(header: bytes) -> int:
        """The body's length from a frame's first :data:`HEADER_SIZE` bytes (ProtocolError
        past the limit): the body and its tag follow."""
        length: int = _LENGTH.unpack(header)[0]
        if length > MAX_FRAME:
            raise ProtocolError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        return length

    def open(self, body: bytes, tag: bytes) -> bytes:
        if not hmac.compare_digest(self._next(body), tag):
            raise ProtocolError("a frame's tag does not match: not from the peer that proved "
                                "the secret, or altered, replayed or out of order")
        return body


HEADER_SIZE = _LENGTH.size


# -- bodies -------------------------------------------------------------------------------


def encode(code: int, fields: Sequence[bytes] = ()) -> bytes:
    """A body: the op (or status) and its fields."""
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"a store message holds at most {MAX_FIELDS} fields, not "
                         f"{len(fields)}")
    parts = [bytes([code])]
    for field in fields:
        parts += [_LENGTH.pack(len(field)), field]
    return b"".join(parts)


def decode(body: bytes) -> tuple[int, list[bytes]]:
    """The op (or status) and the fields of a body (ProtocolError if it is not one)."""
    if not body:
        raise ProtocolError("an empty frame")
    fields: list[bytes] = []
    at = 1
    while at < len(body):
        if len(fields) >= MAX_FIELDS or at + _LENGTH.size > len(body):
            raise ProtocolError("a frame's fields are cut short or too many")
        (size,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if at + size > len(body):
            raise ProtocolError("a frame's field runs past its end")
        fields.append(body[at:at + size])
        at += size
    return body[0], fields


def integer(value: int) -> bytes:
    return _INT.pack(value)


def to_int(field: bytes) -> int:
    if len(field) != _INT.size:
        raise ProtocolError(f"an integer field of {len(field)} bytes, not {_INT.size}")
    value: int = _INT.unpack(field)[0]
    return value


def request(op: Op, fields: Sequence[bytes]) -> tuple[Op, list[bytes]]:
    """``op``'s fields, checked to be what it takes (ProtocolError otherwise)."""
    counts = {Op.SET: 2, Op.GET: 2, Op.ADD: 2, Op.COMPARE_SET: 3, Op.DELETE: 1,
              Op.NUM_KEYS: 0}
    want = counts.get(op)
    if want is not None and len(fields) != want:
        raise ProtocolError(f"{op.name} takes {want} fields, not {len(fields)}")
    if op is Op.WAIT and not fields:
        raise ProtocolError("WAIT takes a timeout")
    if op in (Op.GET, Op.WAIT) and not 0 <= to_int(fields[0]) <= MAX_TIMEOUT_MS:
        raise ProtocolError(f"{op.name}'s timeout is not 0..{MAX_TIMEOUT_MS} ms")
    if op is Op.ADD:
        to_int(fields[1])
    return op, list(fields)


def parse_request(body: bytes) -> tuple[Op, list[bytes]]:
    code, fields = decode(body)
    try:
        op = Op(code)
    except ValueError:
        raise ProtocolError(f"unknown op {code}") from None
    return request(op, fields)


# -- the table ----------------------------------------------------------------------------


class Table:
    """The store's keys and values, with torch's semantics (no locking, no waiting: the
    server holds a lock around every use and waits on it)."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}

    def has(self, keys: Sequence[bytes]) -> bool:
        return all(key in self._values for key in keys)

    def set(self, key: bytes, value: bytes) -> None:
        self._values[key] = value

    def get(self, key: bytes) -> bytes | None:
        return self._values.get(key)

    def add(self, key: bytes, delta: int) -> int:
        """The key's integer plus ``delta`` (0 when it is missing), stored as decimal text
        (ValueError for a value that is not an integer)."""
        old = self._values.get(key, b"0")
        try:
            value = int(old) + delta
        except ValueError:
            raise ValueError(f"add() to key {key!r}, whose value is not an integer") from None
        self._values[key] = str(value).encode()
        return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """Set ``desired`` if the value is ``expected`` (a missing key: if ``expected`` is
        empty); the value now -- or ``expected`` for a missing key left missing (torch's
        HashStore and TCPStore answer so)."""
        current = self._values.get(key)
        if current is None:
            if expected:
                return expected
            self._values[key] = desired
            return desired
        if current == expected:
            self._values[key] = desired
            return desired
        return current

    def delete(self, key: bytes) -> bool:
        return self._values.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._values)
