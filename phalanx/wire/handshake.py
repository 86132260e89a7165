"""Proving a shared secret over a fresh TCP connection, both ways, before any frame flows.

Used wherever a rank's process connects back to the controller over the network (Ray
actors; node agents later). Nothing is unpickled from a peer before it has proved the
secret, and the peer learns it talks to the controller that handed the secret out::

    connector -> acceptor   MAGIC, role (u8), rank (u32), incarnation (u32), nonce_c (32 B)
    acceptor  -> connector  nonce_a (32 B), HMAC(secret, "acceptor" | hello | nonce_a)
    connector -> acceptor   HMAC(secret, "connector" | hello | nonce_a)

Every read has a deadline; a peer that stalls or lies is dropped with
:class:`AuthenticationError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import socket
import struct
import time

from phalanx.errors import AuthenticationError

MAGIC = b"PHALANX1"
_HELLO = struct.Struct("<8sBII32s")
_DIGEST = hashlib.sha256().digest_size
ROLE_CONTROL = 0
ROLE_STDOUT = 1
ROLE_STDERR = 2


class HandshakeIncomplete(AuthenticationError):
    """The handshake did not finish (a timeout, a reset): nothing was proved either way, so
    a caller may try again, unlike after a wrong proof."""


@dataclasses.dataclass(frozen=True)
class Hello:
    """Who a connecting peer says it is (trusted only once :func:`accept` returns)."""

    role: int
    rank: int
    incarnation: int


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HandshakeIncomplete("the peer did not complete the handshake in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(data))
        except TimeoutError:
            continue
        except OSError as exc:
            raise HandshakeIncomplete(f"connection failed during the handshake: {exc}") from exc
        if not chunk:
            raise HandshakeIncomplete("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def connect(sock: socket.socket, secret: bytes, hello: Hello, timeout: float,
            peer: str = "the controller") -> None:
    """The connecting side: introduce itself, check the acceptor's proof (``peer`` names
    the acceptor in errors), prove its own."""
    deadline = time.monotonic() + timeout
    nonce = secrets.token_bytes(32)
    greeting = _HELLO.pack(MAGIC, hello.role, hello.rank, hello.incarnation, nonce)
    sock.settimeout(timeout)
    sock.sendall(greeting)
    reply = _read(sock, 32 + _DIGEST, deadline)
    their_nonce, proof = reply[:32], reply[32:]
    if not hmac.compare_digest(proof, _mac(secret, b"acceptor", greeting, their_nonce)):
        raise AuthenticationError(f"{peer} could not prove the shared secret (a wrong "
                                  "token or secret on one side)")
    sock.sendall(_mac(secret, b"connector", greeting, their_nonce))
    sock.settimeout(None)


def accept(sock: socket.socket, secret: bytes, timeout: float) -> Hello:
    """The accepting side: read the greeting, prove the secret, check the peer's proof."""
    deadline = time.monotonic() + timeout
    magic = _read(sock, len(MAGIC), deadline)  # a stranger is told apart at once
    if magic != MAGIC:
        raise AuthenticationError(f"the peer does not speak the phalanx protocol (it sent "
                                  f"{magic!r})")
    greeting = magic + _read(sock, _HELLO.size - len(MAGIC), deadline)
    _, role, rank, incarnation, _ = _HELLO.unpack(greeting)
    nonce = secrets.token_bytes(32)
    sock.sendall(nonce + _mac(secret, b"acceptor", greeting, nonce))
    proof = _read(sock, _DIGEST, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", greeting, nonce)):
        raise AuthenticationError(f"a peer claiming to be rank {rank} failed to prove the secret")
    sock.settimeout(None)
    return Hello(role, rank, incarnation)
