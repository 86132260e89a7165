"""A joint torch world's key-value store that answers only its members.

torch's ``TCPStore`` listens on every interface and answers whoever connects: a stranger
could read the members' gloo addresses, or overwrite them and fail every formation. This
store is the one phalanx's joint worlds use instead (``px.weight_sync``'s, and
``px.joint_store`` for ``px.rendezvous``'s): one member serves it (:class:`StoreServer`, a
thread of that rank's process) on its node's address and the given port -- never the
wildcard address -- and every member talks to it (the server's own rank in process, the
others as :class:`StoreClient`) once it proved the world's secret, which the controller
made and sent to the members inside calls, over phalanx's authenticated links. The protocol
is :mod:`phalanx.wire.kvproto`.

A stranger that connects is sent a random nonce and nothing else; after a wrong proof it is
told so and dropped. Connections that have not proved the secret are bounded as everywhere
in phalanx (:mod:`phalanx.wire.admission`): :data:`MAX_HANDSHAKES` at once,
:data:`MAX_HANDSHAKES_PER_PEER` from one address, each for ``handshake_timeout`` seconds; one
more is taken and an older one shut down, so strangers holding every slot cannot keep a
member out (a member whose handshake was cut connects again, within its timeout). A
member's connection has a thread of its own on the server, so one that waits for a key
delays no other.

Every wait is bounded: a client connects (again and again, while nobody listens yet: the
serving member may start later) within its timeout, and each GET or WAIT carries its own.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence

from phalanx import config
from phalanx.errors import AuthenticationError
from phalanx.wire import kvproto, streams
from phalanx.wire.admission import Admission
from phalanx.wire.handshake import HandshakeIncomplete, read_exactly
from phalanx.wire.kvproto import Op

logger = logging.getLogger(__name__)

MAX_HANDSHAKES = 64  # connections in their handshake at once
MAX_HANDSHAKES_PER_PEER = 16  # of them from one address
REPLY_MARGIN = 10.0  # seconds a client waits for a GET's reply past the GET's own timeout
_CONNECT_BACKOFF, _CONNECT_BACKOFF_MAX = 0.01, 0.5  # between tries while nobody listens
_ACCEPT_BACKOFF_MAX = 1.0  # after accept() failed (no descriptor left)
_POLL = 0.5  # seconds the acceptor sleeps between looks at deadlines and at closing
_WILDCARDS = ("", "0.0.0.0", "::", "*")


class StoreTimeout(TimeoutError):
    """A GET or WAIT past its timeout, or no store answered within the client's."""


class StoreClosed(ConnectionError):
    """The store is closed, or the connection to it was lost (the world it served is
    over)."""


class KeyValueStore:
    """What a member does with the store, the same whether it serves it or not: keys are
    text, values bytes, timeouts seconds."""

    timeout: float  # of a call that does not wait for a key, and of connecting

    def set(self, key: str, value: bytes) -> None:
        self._call(Op.SET, [_key(key), value])

    def get(self, key: str, timeout: float) -> bytes:
        """The key's value, once it exists (StoreTimeout past ``timeout``)."""
        return self._call(Op.GET, [_millis(timeout), _key(key)], timeout)[0]

    def add(self, key: str, delta: int) -> int:
        return kvproto.to_int(self._call(Op.ADD, [_key(key), kvproto.integer(delta)])[0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(Op.COMPARE_SET, [_key(key), expected, desired])[0]

    def delete(self, key: str) -> bool:
        return self._call(Op.DELETE, [_key(key)])[0] == b"\x01"

    def num_keys(self) -> int:
        return kvproto.to_int(self._call(Op.NUM_KEYS, [])[0])

    def check(self, keys: Sequence[str]) -> bool:
        return self._call(Op.CHECK, [_key(k) for k in keys])[0] == b"\x01"

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Return once every key exists (StoreTimeout past ``timeout``)."""
        self._call(Op.WAIT, [_millis(timeout), *(_key(k) for k in keys)], timeout)

    def close(self) -> None:
        raise NotImplementedError

    def _call(self, op: Op, fields: list[bytes], waits: float | None = None) -> list[bytes]:
        raise NotImplementedError


def _key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"a store's keys are text, not {type(key).__name__}")
    return key.encode()


def _millis(timeout: float) -> bytes:
    return kvproto.integer(min(kvproto.MAX_TIMEOUT_MS, max(0, int(timeout * 1000))))


def _outcome(op: Op, fields: list[bytes], status: int, reply: list[bytes]) -> list[bytes]:
    """A reply's fields, or the error its status says."""
    if status == kvproto.OK:
        return reply
    if status == kvproto.TIMED_OUT:
        keys = [f.decode(errors="replace") for f in fields[1:]]
        waited = kvproto.to_int(fields[0]) / 1000
        raise StoreTimeout(f"the store had no key {', '.join(keys)} after {waited:g} s")
    why = reply[0].decode(errors="replace") if reply else "no reason given"
    raise ValueError(f"the store refused {op.name}: {why}")


# -- the server ---------------------------------------------------------------------------


class StoreServer(KeyValueStore):
    """The store, served on ``host`` (an address of this machine; not the wildcard) and
    ``port`` to every peer that proves ``secret``; this process's own calls go straight to
    the table."""

    def __init__(self, host: str, port: int, secret: bytes, *,
                 timeout: float = 300.0,
                 handshake_timeout: float = config.HANDSHAKE_TIMEOUT,
                 limit: int = MAX_HANDSHAKES,
                 per_peer: int = MAX_HANDSHAKES_PER_PEER) -> None:
        if host.strip("[]") in _WILDCARDS:
            raise ValueError(f"a store serves on one address of this machine, not the "
                             f"wildcard {host!r}: every interface would let strangers in")
        self._secret = kvproto.check_secret(secret)
        self.timeout = timeout
        self._handshake_timeout = handshake_timeout
        self._table = kvproto.Table()
        self._changed = threading.Condition()
        self._closed = False
        self._members: set[socket.socket] = set()  # connections that proved the secret
        self._admission = Admission(limit, per_peer, handshake_timeout)
        self._refusals = 0
        self._listener: socket.socket | None = _listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"phalanx-store-{self.address[1]}")
        self._acceptor.start()

    @property
    def refusals(self) -> int:
        """Connections dropped after a wrong proof, so far."""
        return self._refusals

    def stop_listening(self) -> None:
        """Take no new connection (the members' stay): once a world formed, nobody else
        needs to reach its store."""
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is None:
            return
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's poll
        except OSError:
            pass
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=5)
        listener.close()

    def close(self) -> None:
        """Stop listening, end every member's connection and every wait (idempotent)."""
        self.stop_listening()
        with self._changed:
            self._closed = True
            members, self._members = self._members, set()
            self._changed.notify_all()
        for sock in members:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its thread reads the end, and closes it
            except OSError:
                pass

    # -- the table, for this process and for the members' threads --------------------------

    def _call(self, op: Op, fields: list[bytes], waits: float | None = None) -> list[bytes]:
        status, reply = self._answer(op, fields)
        return _outcome(op, fields, status, reply)

    def _answer(self, op: Op, fields: list[bytes]) -> tuple[int, list[bytes]]:
        """What ``op`` on ``fields`` (checked by :func:`kvproto.request`) answers; a GET or a
        WAIT waits here, the lock released. StoreClosed once the store is."""
        table = self._table
        with self._changed:
            if self._closed:
                raise StoreClosed("the store is closed")
            if op in (Op.GET, Op.WAIT):
                keys = fields[1:]
                timeout = kvproto.to_int(fields[0]) / 1000
                self._changed.wait_for(lambda: self._closed or table.has(keys), timeout)
                if self._closed:
                    raise StoreClosed("the store closed while a member waited for a key")
                if not table.has(keys):
                    return kvproto.TIMED_OUT, []
                return kvproto.OK, ([table.get(keys[0]) or b""] if op is Op.GET else [])
            if op is Op.CHECK:
                return kvproto.OK, [b"\x01" if table.has(fields) else b"\x00"]
            if op is Op.NUM_KEYS:
                return kvproto.OK, [kvproto.integer(len(table))]
            if op is Op.SET:
                table.set(fields[0], fields[1])
                reply = []
            elif op is Op.ADD:
                try:
                    reply = [kvproto.integer(table.add(fields[0], kvproto.to_int(fields[1])))]
                except ValueError as exc:
                    return kvproto.FAILED, [str(exc).encode()]
            elif op is Op.COMPARE_SET:
                reply = [table.compare_set(fields[0], fields[1], fields[2])]
            else:  # DELETE
                reply = [b"\x01" if table.delete(fields[0]) else b"\x00"]
            self._changed.notify_all()
            return kvproto.OK, reply

    # -- the acceptor thread ------------------------------------------------------------

    def _accept_loop(self) -> None:
        backoff = _CONNECT_BACKOFF
        while not self._stopping.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                ready = streams.wait_readable([listener.fileno()], _POLL)
            except (OSError, ValueError):  # closed: we are stopping
                return
            self._admission.expire()
            if not ready:
                continue
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                logger.warning("the store at %s:%d cannot take a connection: %s; retrying",
                               *self.address, exc)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_MAX)
                continue
            backoff = _CONNECT_BACKOFF
            self._start(sock, str(address[0]))

    def _start(self, sock: socket.socket, peer: str) -> None:
        evicted = self._admission.admit(sock, peer)
        if evicted is not None:
            logger.debug("the store at %s:%d took a connection from %s: %s", *self.address,
                         peer, evicted)
        try:
            sock.setblocking(True)
            streams.tune_link(sock)
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name="phalanx-store-peer").start()
        except (RuntimeError, OSError) as exc:  # "can't start new thread"
            self._admission.release(sock)
            sock.close()
            logger.warning("the store at %s:%d dropped a connection from %s: %s",
                           *self.address, peer, exc)

    # -- one connection's thread --------------------------------------------------------

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            try:
                keys = self._handshake(sock, peer)
            finally:
                self._admission.release(sock)
            if keys is None:
                return
            with self._changed:
                if self._closed:
                    return
                self._members.add(sock)
            sock.settimeout(None)  # a member may stay quiet as long as its world lives
            sealer, opener = keys
            while True:
                body = _read_frame(sock, opener)
                if body is None:
                    return
                op, fields = kvproto.parse_request(body)
                status, reply = self._answer(op, fields)
                sock.sendall(sealer.seal(kvproto.encode(status, reply)))
        except (OSError, kvproto.ProtocolError, StoreClosed, HandshakeIncomplete) as exc:
            logger.debug("a connection from %s to the store at %s:%d ended: %s", peer,
                         *self.address, exc)
        finally:
            with self._changed:
                self._members.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket, peer: str
                   ) -> tuple[kvproto.Sealer, kvproto.Opener] | None:
        """The connection's frame keys once the peer proved the secret; None (after telling
        it so) when it did not."""
        deadline = time.monotonic() + self._handshake_timeout
        hello = read_exactly(sock, kvproto.HELLO_SIZE, deadline)
        if hello[:len(kvproto.MAGIC)] != kvproto.MAGIC:
            logger.debug("a connection from %s to the store at %s:%d is not a store's "
                         "client", peer, *self.address)
            return None
        nonce_s = secrets.token_bytes(kvproto.NONCE_SIZE)
        sock.sendall(nonce_s)
        proofs = kvproto.Proofs(self._secret, hello[len(kvproto.MAGIC):], nonce_s)
        if not kvproto.proved(proofs.client, read_exactly(sock, kvproto.PROOF_SIZE, deadline)):
            self._refusals += 1
            log = logger.warning if self._refusals == 1 else logger.debug
            log("a connection from %s to the store at %s:%d did not prove the world's "
                "secret: dropped (more such are logged at debug level)", peer, *self.address)
            _send_quietly(sock, kvproto.REFUSED)
            return None
        sock.sendall(kvproto.ACCEPTED + proofs.server)
        return kvproto.Sealer(proofs.to_client), kvproto.Opener(proofs.to_server)


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host`` (its first address) and ``port``."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host.strip("[]"), port,
                                                   type=socket.SOCK_STREAM)[0]
    try:
        return socket.create_server(sockaddr[:2], family=family, backlog=128)
    except OSError as exc:
        raise OSError(exc.errno, f"the store could not listen on {host}:{port}: "
                                 f"{exc.strerror or exc}") from exc


# -- the client ---------------------------------------------------------------------------


class StoreClient(KeyValueStore):
    """One member's connection to the store at ``host:port``, made within ``timeout``
    seconds (tried again while nobody listens there yet); AuthenticationError at once if
    the peer there refuses this member's proof, or does not prove the secret itself."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 300.0, *,
                 handshake_timeout: float = config.HANDSHAKE_TIMEOUT) -> None:
        self.timeout = timeout
        self.address = (host, port)
        self._lock = threading.Lock()  # one request and its reply at a time
        self._sock: socket.socket | None = None
        self._sock, self._sealer, self._opener = _connect(
            host, port, kvproto.check_secret(secret), timeout, handshake_timeout)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            streams.close_socket(sock)

    def _call(self, op: Op, fields: list[bytes], waits: float | None = None) -> list[bytes]:
        body = kvproto.encode(op, fields)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreClosed(f"the connection to the store at {_where(self.address)} is "
                                  "closed")
            try:
                sock.settimeout(self.timeout if waits is None else waits + REPLY_MARGIN)
                sock.sendall(self._sealer.seal(body))
                reply = _read_frame(sock, self._opener)
                if reply is None:
                    raise OSError("the store closed the connection")
                status, out = kvproto.decode(reply)
            except (OSError, kvproto.ProtocolError) as exc:
                self._sock = None  # out of step with the server: no later call may use it
                streams.close_socket(sock)
                raise StoreClosed(f"the store at {_where(self.address)} is gone: {exc}") from exc
        return _outcome(op, fields, status, out)


def _connect(host: str, port: int, secret: bytes, timeout: float, handshake_timeout: float
             ) -> tuple[socket.socket, kvproto.Sealer, kvproto.Opener]:
    deadline = time.monotonic() + timeout
    backoff, last = _CONNECT_BACKOFF, "nothing tried"
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            sock = socket.create_connection((host.strip("[]"), port),
                                            timeout=min(remaining, handshake_timeout))
        except OSError as exc:  # nobody listens yet, or the network is slow
            last = f"connecting: {exc.strerror or exc}"
        else:
            try:
                streams.tune_link(sock)
                sealer, opener = _client_handshake(
                    sock, secret, min(deadline, time.monotonic() + handshake_timeout),
                    _where((host, port)))
                return sock, sealer, opener
            except HandshakeIncomplete as exc:  # cut short (a server making room): try again
                streams.close_socket(sock)
                last = str(exc)
            except BaseException:
                streams.close_socket(sock)
                raise
        time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
        backoff = min(backoff * 2, _CONNECT_BACKOFF_MAX)
    raise StoreTimeout(f"no store answered at {_where((host, port))} within {timeout:g} s "
                       f"(last: {last})")


def _client_handshake(sock: socket.socket, secret: bytes, deadline: float, where: str
                      ) -> tuple[kvproto.Sealer, kvproto.Opener]:
    nonce_c = secrets.token_bytes(kvproto.NONCE_SIZE)
    try:
        sock.sendall(kvproto.MAGIC + nonce_c)
    except OSError as exc:
        raise HandshakeIncomplete(f"the handshake: {exc}") from exc
    nonce_s = read_exactly(sock, kvproto.NONCE_SIZE, deadline)
    proofs = kvproto.Proofs(secret, nonce_c, nonce_s)
    try:
        sock.sendall(proofs.client)
    except OSError as exc:
        raise HandshakeIncomplete(f"the handshake: {exc}") from exc
    if read_exactly(sock, 1, deadline) != kvproto.ACCEPTED:
        raise AuthenticationError(f"the store at {where} refused this member's proof: the "
                                  "secret it was given is not its world's")
    if not kvproto.proved(proofs.server, read_exactly(sock, kvproto.PROOF_SIZE, deadline)):
        raise AuthenticationError(f"the peer at {where} did not prove the world's secret: "
                                  "it is not the world's store")
    return kvproto.Sealer(proofs.to_server), kvproto.Opener(proofs.to_client)


# -- bytes off a socket -------------------------------------------------------------------


def _read_frame(sock: socket.socket, opener: kvproto.Opener) -> bytes | None:
    """The next frame's body, its tag checked; None at a clean end between frames."""
    header = _exactly(sock, kvproto.HEADER_SIZE, at_start=True)
    if header is None:
        return None
    length = opener.length(header)
    rest = _exactly(sock, length + kvproto.TAG_SIZE)
    assert rest is not None
    return opener.open(rest[:length], rest[length:])


def _exactly(sock: socket.socket, size: int, at_start: bool = False) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            if at_start and not got:
                return None
            raise OSError("the connection ended inside a frame")
        got += n
    return bytes(buf)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def _where(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

