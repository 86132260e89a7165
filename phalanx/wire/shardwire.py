"""The pair protocol of a sharded weight sync: one source rank handing boxes of tensors to
one target rank (:mod:`phalanx.rank.shardsync`), as bytes on a socket, with no tensor.

A target listens on its node's address; a source connects to it, proves the sync's secret
(32 random bytes the controller made and handed to every member inside calls) and is
proved to in turn, then sends *batches*: one ``send``'s boxes for that target, in one
batch or in several (each box as soon as the source has it: the last batch says it is the
last). The handshake is the joint worlds' store's (:mod:`phalanx.wire.kvproto`: the client proves
first, so a stranger learns nothing derived from the secret; then the server), under a
magic of its own, and so are the frames' tags (``<u32 length> body <tag>``, one key per
direction, counting the frames)::

    source -> target   BATCH frame: version, mode, where (shared mode), last, then per
                       transfer tid, nbytes, offset (in the block), digest (empty: none)
    source -> target   (TCP mode) each transfer's bytes, in order, raw
    ...                (more batches; the source need not wait for an ack to send one)
    target -> source   ACK frame per batch, in order: status OK or FAILED, bytes staged,
                       then (tid, reason) per transfer that failed

In TCP mode the bytes follow the frame untagged: a relay that forwarded the handshake
could alter them, which ``verify`` (a blake2b digest per transfer, carried in the tagged
frame) catches. In shared mode (source and target on one machine) no byte crosses the
socket: the frame names a memory block of the source (:class:`phalanx.wire.memfd.Block`),
which the target maps, copies from, and unmaps before it acks the *last* batch (it may keep
it mapped between the batches of one connection: the source writes a block again only once
no target maps it).

Every read and write has a deadline (:class:`Deadline`): a peer that stalls fails the
operation on time; nothing here waits without one.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from phalanx import config
from phalanx.errors import AuthenticationError
from phalanx.wire import kvproto, streams
from phalanx.wire.admission import Admission
from phalanx.wire.handshake import HandshakeIncomplete, read_exactly

logger = logging.getLogger(__name__)

MAGIC = b"PXSHARD1"
HELLO_SIZE = len(MAGIC) + kvproto.NONCE_SIZE
TCP, SHARED = 0, 1  # a batch's mode: its bytes follow on the socket, or sit in a block
BATCH = 1  # the code of a batch frame (an ack's code is kvproto.OK or kvproto.FAILED)
DIGEST_SIZE = 32  # blake2b's, of one transfer's bytes
_FIXED = 7  # a batch's fields before its transfers: version, mode, pid, fd, token,
# capacity, last
_PER_TRANSFER = 4  # tid, nbytes, offset, digest
# transfers of one batch: a frame holds at most kvproto.MAX_FIELDS fields
MAX_TRANSFERS = (kvproto.MAX_FIELDS - _FIXED) // _PER_TRANSFER
_CHUNK = 8 << 20  # bytes per send/recv call: the deadline is looked at between them
MAX_HANDSHAKES = 64  # connections in their handshake at once (kvstore's bounds)
MAX_HANDSHAKES_PER_PEER = 16  # of them from one address
_POLL = 0.5  # seconds the acceptor sleeps between looks at deadlines and at closing
_WILDCARDS = ("", "0.0.0.0", "::", "*")


class Deadline:
    """A point in time (``time.monotonic``) every socket operation of one exchange ends by;
    ``stall``: the point moves ``seconds`` past each chunk that moved (a receiver's bound:
    a peer silent that long fails, one that keeps sending never does)."""

    def __init__(self, seconds: float, stall: bool = False) -> None:
        self.seconds, self.stall = seconds, stall
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; TimeoutError once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the peer did not answer within {self.seconds:g} s")
        return left

    def moved(self) -> None:
        if self.stall:
            self.at = time.monotonic() + self.seconds


class Entry(NamedTuple):
    """One transfer of a batch."""

    tid: int
    nbytes: int
    offset: int  # where its bytes start in the block (shared mode; 0 in TCP mode)
    digest: bytes  # blake2b of its bytes, or empty


class Batch(NamedTuple):
    version: int
    mode: int  # TCP or SHARED
    where: tuple[int, int, str, int]  # the block: (pid, fd, token, capacity); shared mode
    entries: list[Entry]
    last: bool = True  # the source's last batch of this connection


def digest(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


# -- the handshake ------------------------------------------------------------------------


def connect(host: str, port: int, secret: bytes, deadline: Deadline
            ) -> tuple[socket.socket, kvproto.Sealer, kvproto.Opener]:
    """A connection to the target at ``host:port`` once each side proved ``secret``:
    AuthenticationError if the peer refuses this side's proof or gives a wrong one itself,
    OSError (TimeoutError among them) if it cannot be reached in time."""
    sock = socket.create_connection((host.strip("[]"), port), timeout=deadline.left())
    try:
        streams.tune_link(sock)
        nonce_c = secrets.token_bytes(kvproto.NONCE_SIZE)
        sock.settimeout(deadline.left())
        sock.sendall(MAGIC + nonce_c)
        nonce_s = read_exactly(sock, kvproto.NONCE_SIZE, deadline.at)
        proofs = kvproto.Proofs(secret, nonce_c, nonce_s, MAGIC)
        sock.settimeout(deadline.left())
        sock.sendall(proofs.client)
        if read_exactly(sock, 1, deadline.at) != kvproto.ACCEPTED:
            raise AuthenticationError(f"the target at {host}:{port} refused this source's "
                                      "proof: the secret it was given is not the sync's")
        if not kvproto.proved(proofs.server,
                              read_exactly(sock, kvproto.PROOF_SIZE, deadline.at)):
            raise AuthenticationError(f"the peer at {host}:{port} did not prove the sync's "
                                      "secret: it is not the target")
        return sock, kvproto.Sealer(proofs.to_server), kvproto.Opener(proofs.to_client)
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, secret: bytes, deadline: float
           ) -> tuple[kvproto.Sealer, kvproto.Opener] | None:
    """The frame keys of an accepted connection once its peer proved ``secret`` (and was
    given this side's proof); None when it is not a source of this sync (told so, if it
    got as far as a proof). HandshakeIncomplete when it stalls past ``deadline``."""
    hello = read_exactly(sock, HELLO_SIZE, deadline)
    if hello[:len(MAGIC)] != MAGIC:
        return None
    nonce_s = secrets.token_bytes(kvproto.NONCE_SIZE)
    _send_all(sock, nonce_s, deadline)
    proofs = kvproto.Proofs(secret, hello[len(MAGIC):], nonce_s, MAGIC)
    if not kvproto.proved(proofs.client, read_exactly(sock, kvproto.PROOF_SIZE, deadline)):
        try:
            _send_all(sock, kvproto.REFUSED, deadline)
        except (OSError, HandshakeIncomplete):
            pass
        return None
    _send_all(sock, kvproto.ACCEPTED + proofs.server, deadline)
    return kvproto.Sealer(proofs.to_client), kvproto.Opener(proofs.to_server)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeIncomplete("the peer did not complete the handshake in time")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except OSError as exc:
        raise HandshakeIncomplete(f"connection failed during the handshake: {exc}") from exc


# -- frames -------------------------------------------------------------------------------


def send_frame(sock: socket.socket, sealer: kvproto.Sealer, body: bytes,
               deadline: Deadline) -> None:
    sock.settimeout(deadline.left())
    sock.sendall(sealer.seal(body))


def read_frame(sock: socket.socket, opener: kvproto.Opener, deadline: Deadline
               ) -> bytes | None:
    """The next frame's body, its tag checked (ProtocolError if it fails); None at a clean
    end between frames."""
    header = bytearray(kvproto.HEADER_SIZE)
    if not recv_into(sock, memoryview(header), deadline, at_start=True):
        return None
    length = opener.length(bytes(header))
    rest = bytearray(length + kvproto.TAG_SIZE)
    recv_into(sock, memoryview(rest), deadline)
    return opener.open(bytes(rest[:length]), bytes(rest[length:]))


def send_bytes(sock: socket.socket, data: memoryview, deadline: Deadline) -> None:
    """All of ``data``, by the deadline."""
    data = data.cast("B")
    for start in range(0, data.nbytes, _CHUNK):
        sock.settimeout(deadline.left())
        sock.sendall(data[start:start + _CHUNK])
        deadline.moved()


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline,
              at_start: bool = False) -> bool:
    """Fill ``view`` from ``sock`` by the deadline; False when ``at_start`` and the peer
    ended the connection before the first byte (ConnectionError when it ends later)."""
    view = view.cast("B")
    got, size = 0, view.nbytes
    while got < size:
        sock.settimeout(deadline.left())
        n = sock.recv_into(view[got:got + _CHUNK])
        if not n:
            if at_start and not got:
                return False
            raise ConnectionError(f"the peer ended the connection {got} bytes into {size}")
        got += n
        deadline.moved()
    return True


def drain(sock: socket.socket, nbytes: int, deadline: Deadline) -> None:
    """Read and drop ``nbytes`` (a transfer this side cannot place): the stream stays in
    step, so the peer still gets its answer."""
    scratch = memoryview(bytearray(min(nbytes, _CHUNK)))
    while nbytes:
        step = min(nbytes, len(scratch))
        recv_into(sock, scratch[:step], deadline)
        nbytes -= step


# -- bodies -------------------------------------------------------------------------------


def encode_batch(batch: Batch) -> bytes:
    if len(batch.entries) > MAX_TRANSFERS:
        raise ValueError(f"a batch holds at most {MAX_TRANSFERS} transfers, not "
                         f"{len(batch.entries)}")
    pid, fd, token, capacity = batch.where
    fields = [kvproto.integer(batch.version), kvproto.integer(batch.mode),
              kvproto.integer(pid), kvproto.integer(fd), token.encode(),
              kvproto.integer(capacity), kvproto.integer(int(batch.last))]
    for entry in batch.entries:
        fields += [kvproto.integer(entry.tid), kvproto.integer(entry.nbytes),
                   kvproto.integer(entry.offset), entry.digest]
    return kvproto.encode(BATCH, fields)


def decode_batch(body: bytes) -> Batch:
    """The batch in ``body``, its fields checked (ProtocolError if it is not one)."""
    code, fields = kvproto.decode(body)
    if code != BATCH or len(fields) < _FIXED or (len(fields) - _FIXED) % _PER_TRANSFER:
        raise kvproto.ProtocolError("a frame that is not a batch")
    version, mode, pid, fd = (kvproto.to_int(f) for f in fields[:4])
    capacity, last = kvproto.to_int(fields[5]), kvproto.to_int(fields[6])
    if mode not in (TCP, SHARED) or min(pid, fd, capacity) < 0 or last not in (0, 1):
        raise kvproto.ProtocolError(f"a batch of mode {mode}, block ({pid}, {fd}, "
                                    f"{capacity})")
    try:
        token = fields[4].decode("ascii")
    except UnicodeDecodeError:
        raise kvproto.ProtocolError("a batch's block token is not text") from None
    entries = []
    for at in range(_FIXED, len(fields), _PER_TRANSFER):
        tid, nbytes, offset = (kvproto.to_int(f) for f in fields[at:at + 3])
        digest_ = fields[at + 3]
        if min(nbytes, offset) < 0 or len(digest_) not in (0, DIGEST_SIZE):
            raise kvproto.ProtocolError(f"transfer {tid}: {nbytes} bytes at {offset}, a "
                                        f"digest of {len(digest_)} bytes")
        entries.append(Entry(tid, nbytes, offset, digest_))
    return Batch(version, mode, (pid, fd, token, capacity), entries, bool(last))


def encode_ack(staged: int, failed: Sequence[tuple[int, str]]) -> bytes:
    fields = [kvproto.integer(staged)]
    for tid, reason in failed[:MAX_TRANSFERS]:
        fields += [kvproto.integer(tid), reason.encode(errors="replace")[:1024]]
    return kvproto.encode(kvproto.FAILED if failed else kvproto.OK, fields)


def decode_ack(body: bytes) -> tuple[int, list[tuple[int, str]]]:
    """Bytes the target staged, and each failed transfer's tid and reason."""
    code, fields = kvproto.decode(body)
    if code not in (kvproto.OK, kvproto.FAILED) or not fields or len(fields) % 2 != 1:
        raise kvproto.ProtocolError("a frame that is not an ack")
    failed = [(kvproto.to_int(fields[i]), fields[i + 1].decode(errors="replace"))
              for i in range(1, len(fields), 2)]
    return kvproto.to_int(fields[0]), failed


# -- the target's listener ----------------------------------------------------------------


Serve = Callable[[socket.socket, kvproto.Sealer, kvproto.Opener, str], None]


class Listener:
    """A target's port: on ``host`` (an address of this machine, never the wildcard), a
    port the system picks; each peer that proves ``secret`` is served by ``serve(sock,
    sealer, opener, peer)`` on a thread of its own (the socket is closed after it returns).
    Connections in their handshake are bounded as everywhere in phalanx
    (:class:`~phalanx.wire.admission.Admission`); a stranger gets a nonce and nothing
    else."""

    def __init__(self, host: str, secret: bytes, serve: Serve, *,
                 handshake_timeout: float = config.HANDSHAKE_TIMEOUT,
                 limit: int = MAX_HANDSHAKES,
                 per_peer: int = MAX_HANDSHAKES_PER_PEER) -> None:
        if host.strip("[]") in _WILDCARDS:
            raise ValueError(f"a sync's target listens on one address of this machine, not "
                             f"the wildcard {host!r}: every interface would let strangers in")
        self._secret = kvproto.check_secret(secret)
        self._serve = serve
        self._handshake_timeout = handshake_timeout
        self._admission = Admission(limit, per_peer, handshake_timeout)
        family, _, _, _, sockaddr = socket.getaddrinfo(host.strip("[]"), 0,
                                                       type=socket.SOCK_STREAM)[0]
        try:
            self._sock = socket.create_server(sockaddr[:2], family=family, backlog=128)
        except OSError as exc:
            raise OSError(exc.errno, f"a sync's target could not listen on {host}: "
                                     f"{exc.strerror or exc}") from exc
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.refusals = 0  # peers that did not prove the secret, so far
        self._lock = threading.Lock()
        self._peers: set[socket.socket] = set()  # every connection being served
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"phalanx-shardsync-{self.address[1]}")
        self._acceptor.start()

    def close(self) -> None:
        """Take no connection and end every one being served (idempotent)."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's poll
        except OSError:
            pass
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=5)
        self._sock.close()
        with self._lock:
            peers, self._peers = self._peers, set()
        for sock in peers:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its thread reads the end and closes it
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                ready = streams.wait_readable([self._sock.fileno()], _POLL)
            except (OSError, ValueError):  # closed
                return
            self._admission.expire()
            if not ready:
                continue
            try:
                sock, address = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                logger.warning("a sync's target at %s:%d cannot take a connection: %s",
                               *self.address, exc)
                self._closed.wait(_POLL)
                continue
            peer = str(address[0])
            streams.tune_link(sock)
            self._admission.admit(sock, peer)
            with self._lock:
                self._peers.add(sock)
            try:
                threading.Thread(target=self._connection, args=(sock, peer), daemon=True,
                                 name="phalanx-shardsync-peer").start()
            except RuntimeError as exc:  # "can't start new thread"
                self._drop(sock)
                logger.warning("a sync's target at %s:%d dropped a connection from %s: %s",
                               *self.address, peer, exc)

    def _connection(self, sock: socket.socket, peer: str) -> None:
        try:
            try:
                keys = accept(sock, self._secret,
                              time.monotonic() + self._handshake_timeout)
            finally:
                self._admission.release(sock)
            if keys is None:
                self.refusals += 1
                logger.debug("a connection from %s to a sync's target at %s:%d did not "
                             "prove the sync's secret: dropped", peer, *self.address)
                return
            if self._closed.is_set():
                return
            self._serve(sock, *keys, peer)
        except (OSError, HandshakeIncomplete, kvproto.ProtocolError) as exc:
            logger.debug("a connection from %s to a sync's target at %s:%d ended: %s", peer,
                         *self.address, exc)
        except Exception:
            logger.exception("serving a sync's source at %s failed", peer)
        finally:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._admission.release(sock)
        with self._lock:
            self._peers.discard(sock)
        sock.close()
