"""Every frame after a handshake authenticated: the keys it derives, and each frame's tag.

The handshake (:mod:`phalanx.wire.handshake`) proves who opened a connection; this module
ties every frame that follows to that proof, so that a relay that forwarded the handshake
cannot inject, alter, drop, replay or reorder a frame unnoticed. Both ends derive one key
per direction from the shared secret and the handshake's transcript (both versions, the
connector's hello and nonce, the acceptor's nonce)::

    key(direction) = HMAC-SHA256(secret, "phalanx frames " direction "|" transcript)

A frame sent on an authenticated connection carries one more segment, last: its tag::

    tag = BLAKE2b-128(key=key, <u64 seq> <u32 nseg> <u64 len_0> ... <u64 len_{n-1}>
                               seg_0 ... seg_{n-1})

where a segment of at least ``PREHASH`` bytes (8 KiB; both ends know which from the
lengths) enters as the GMAC of each of its ``CHUNK``-sized pieces instead of its bytes::

    GMAC = AES-256-GCM(key=SHA-256("phalanx segments|" key), nonce=<u64 seq><u32 piece>,
                       plaintext="", associated data=the piece)

``piece`` counts the large pieces of the frame from 1, so no nonce repeats under a key.
``seq`` counts the frames of that direction from 0 and never travels: a frame replayed,
dropped or moved fails its tag, and so does every frame after it. The receiver checks the
tag before anything in the frame is read, unpickled or acted on
(:class:`~phalanx.wire.framing.VerifyingReader`); a frame that fails ends the connection.
Segments are fed to the MACs as they are (memoryviews of large buffers, never joined).

Why two MACs, measured here: a pre-keyed BLAKE2b copied per frame costs ~0.4 µs for a
100-byte frame (a pre-keyed HMAC-SHA256 ~1.0 µs), and nearly every frame is that small, fed
in pieces without joining them; but on large buffers GMAC (OpenSSL's, through
``cryptography``, with AES and carry-less multiply in hardware) runs at ~25 GB/s against
SHA-256's ~2 GB/s and BLAKE2b's ~1.4 GB/s: a 64 MiB argument costs ~2.5 ms to seal where
SHA-256 took ~33 ms, so a broadcast's cost is the copy, not its authentication.

Connections between a process and its own children (pipes, socketpairs) carry no tags:
nothing else can write to them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from phalanx.wire.streams import ConnectionLost

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from typing import Any


TAG_SIZE = 16
PREHASH = 8 * 1024  # segments this large enter a tag as their GMAC (faster from here)
CHUNK = 1 << 30  # a large segment's pieces, each with a GMAC (AES-GCM takes < 2 GiB)
_NONCE = struct.Struct("<QI")  # frame seq, piece number: a GMAC's nonce
_SEGMENTS = b"phalanx segments|"
_SEQ_COUNT = struct.Struct("<QI")  # seq, number of segments before the tag
_TWO = struct.Struct("<QIQQ")  # the same, and the lengths, for two segments
_TABLES = [struct.Struct(f"<{n}Q") for n in range(17)]
_CONNECTOR_TO_ACCEPTOR = b"phalanx frames connector->acceptor|"
_ACCEPTOR_TO_CONNECTOR = b"phalanx frames acceptor->connector|"


class FrameAuth:
    """Both directions' keys and frame counters of one connection (one reader thread, and
    senders that hold the connection's send lock). Made by the handshake."""

    __slots__ = ("_keys", "_recv", "_recv_gmac", "_same", "_send", "_send_gmac", "received",
                 "sent")

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        # here, not at the top: a rank of the local backend (pipes, no keys) imports this
        # module with framing and never pays hashlib's ~2 ms; cryptography's import (~10 ms)
        # waits for the first large segment (_make_gmacs): a Ray rank on the controller's
        # machine, whose streams' keys go unused, never pays it
        import hashlib
        import hmac

        self._keys = (send_key, recv_key)
        self._send = hashlib.blake2b(key=send_key, digest_size=TAG_SIZE)
        self._recv = hashlib.blake2b(key=recv_key, digest_size=TAG_SIZE)
        self._send_gmac: Any = None
        self._recv_gmac: Any = None
        self._same = hmac.compare_digest
        self.sent = 0
        self.received = 0

    def handover(self) -> str:
        """The keys as text, for the process that takes this connection over before any
        frame flowed on it (a Ray actor's rank, given the actor's socket):
        :meth:`taken_over` reads it there."""
        if self.sent or self.received:
            raise ValueError("frames have flowed already: the counts would not match")
        return ":".join(key.hex() for key in self._keys)

    @classmethod
    def taken_over(cls, text: str) -> FrameAuth:
        """The keys :meth:`handover` gave (ValueError if that is not what ``text`` is)."""
        send, _, recv = text.partition(":")
        keys = bytes.fromhex(send), bytes.fromhex(recv)
        if not all(len(key) == 32 for key in keys):
            raise ValueError("not the frame keys of a connection")
        return cls(*keys)

    def __repr__(self) -> str:
        return f"<FrameAuth sent={self.sent} received={self.received}>"

    def _make_gmacs(self) -> None:
        """Both directions' GMAC of large segments (AES-GCM over no plaintext), made
        on the first one (made twice at once, they are the same)."""
        import hashlib

        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        send_key, recv_key = self._keys
        self._send_gmac = AESGCM(hashlib.sha256(_SEGMENTS + send_key).digest()).encrypt
        self._recv_gmac = AESGCM(hashlib.sha256(_SEGMENTS + recv_key).digest()).encrypt

    def sign(self, nseg: int, table: Any, segments: Iterable[Any]) -> bytes:
        """The tag of the next frame sent: ``nseg`` segments whose lengths are ``table``
        (their ``<u64>`` each, as framed) and whose bytes are ``segments`` (one buffer
        each; or, for a frame with none of ``PREHASH`` bytes, any pieces of them)."""
        mac = self._send.copy()
        mac.update(_SEQ_COUNT.pack(self.sent, nseg))
        mac.update(table)
        piece = 0
        for segment in segments:
            if memoryview(segment).nbytes >= PREHASH:
                if self._send_gmac is None:
                    self._make_gmacs()
                piece = _gmacs(self._send_gmac, self.sent, piece, segment, mac.update)
            else:
                mac.update(segment)
        self.sent += 1
        return mac.digest()

    def check(self, segments: list[Any]) -> bool:
        """Whether the last of ``segments`` (a received frame) is the tag of the others
        as the next frame received; the count moves on only when it is."""
        n = len(segments) - 1
        if n < 1 or len(segments[-1]) != TAG_SIZE:
            return False
        if n == 2 and len(segments[0]) < PREHASH > len(segments[1]):  # header, pickle: most
            head, body, tag = segments
            mac = self._recv.copy()
            mac.update(_TWO.pack(self.received, 2, len(head), len(body)))
            mac.update(head)
            mac.update(body)
            if not self._same(mac.digest(), tag):
                return False
            self.received += 1
            return True
        lengths = [len(s) for s in segments[:n]]
        table = _TABLES[n] if n < len(_TABLES) else struct.Struct(f"<{n}Q")
        mac = self._recv.copy()
        mac.update(_SEQ_COUNT.pack(self.received, n))
        mac.update(table.pack(*lengths))
        piece = 0
        for segment, length in zip(segments[:n], lengths, strict=True):
            if length < PREHASH:
                mac.update(segment)
            else:
                if self._recv_gmac is None:
                    self._make_gmacs()
                piece = _gmacs(self._recv_gmac, self.received, piece, segment, mac.update)
        if not self._same(mac.digest(), segments[n]):
            return False
        self.received += 1
        return True


def _gmacs(gmac: Any, seq: int, piece: int, segment: Any, update: Any) -> int:
    """Feed ``update`` the GMAC of each ``CHUNK`` of a large segment (any contiguous
    buffer: OpenSSL is handed its bytes), numbering them on from ``piece``; the last number
    used."""
    if type(segment) is not bytes:
        view = memoryview(segment)
        segment = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    size = len(segment)
    if size <= CHUNK:
        piece += 1
        update(gmac(_NONCE.pack(seq, piece), b"", segment))
        return piece
    with memoryview(segment) as flat:
        for start in range(0, size, CHUNK):
            piece += 1
            update(gmac(_NONCE.pack(seq, piece), b"", flat[start:start + CHUNK]))
    return piece


def derive(secret: bytes, transcript: bytes, connector: bool) -> FrameAuth:
    """The frame keys of one side of a handshake whose transcript is ``transcript``."""
    import hashlib  # see FrameAuth.__init__
    import hmac

    up = hmac.new(secret, _CONNECTOR_TO_ACCEPTOR + transcript, hashlib.sha256).digest()
    down = hmac.new(secret, _ACCEPTOR_TO_CONNECTOR + transcript, hashlib.sha256).digest()
    return FrameAuth(up, down) if connector else FrameAuth(down, up)


class FrameRejected(ConnectionLost):
    """A frame failed its tag (forged, altered, replayed or out of order): the stream
    cannot be trusted from there on, and nothing in that frame was read."""
