"""Proving a shared secret over a fresh connection, both ways, before any frame flows.

Used wherever a process connects to another over the network: a rank's Ray actor to its
controller, a controller to a node's agent, an agent to the agents below it in a tree.
Nothing is unpickled from a peer before it has proved the secret, and the peer learns it
talks to the side that holds the secret::

    connector -> acceptor   MAGIC, version (u8 length, UTF-8),
                            role (u8), rank (u32), incarnation (u32), nonce_c (32 B)
    acceptor  -> connector  version (u8 length, UTF-8)
                            -- the two versions differ: both refuse, the acceptor closes --
    acceptor  -> connector  nonce_a (32 B), HMAC(secret, "acceptor" | greeting | nonce_a)
    connector -> acceptor   HMAC(secret, "connector" | greeting | nonce_a)

``greeting`` is everything the connector sent and the acceptor's version, so the proofs
cover both versions. The handshake also gives each side the keys that authenticate every
frame after it (:mod:`phalanx.wire.seal`, derived from the secret, ``greeting`` and
``nonce_a``): :func:`connect` returns them, :func:`accept` returns them in its
:class:`Hello`, and the caller hands them to the connection
(:class:`phalanx.wire.framing.Connection`'s ``auth``). Proving the secret once is not
enough: a relay that forwarded these bytes could otherwise write frames of its own after
them. The versions are ``phalanx.__version__`` of each side, compared first
because pickles name module paths, which move between releases: two releases never get as
far as exchanging one, and each side raises :class:`~phalanx.errors.VersionMismatch` naming
both versions and the side to upgrade. The magic and the version come first in every
release from this one on, so any two tell each other apart; a peer of an older release
(magic ``PHALANX1``, no version) is refused as such.

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

from phalanx import version as release
from phalanx.errors import AuthenticationError, VersionMismatch
from phalanx.wire import seal

MAGIC = b"PHALANX2"
_BEFORE_VERSIONS = b"PHALANX1"  # the magic of the releases whose handshake had no version
_HELLO = struct.Struct("<BII32s")  # role, rank, incarnation, nonce
_DIGEST = hashlib.sha256().digest_size
_MAX_VERSION = 255  # bytes: a version's length travels as a u8
_REFUSAL_DRAIN = 1.0  # seconds to read what a refused peer still sends, so it gets our answer
ROLE_CONTROL = 0
ROLE_STDOUT = 1
ROLE_STDERR = 2
ROLE_SIDE = 3  # a Ray rank's side stream: signals, stacks, stops (phalanx.node.warden)


class HandshakeIncomplete(AuthenticationError):
    """The handshake did not finish (a timeout, a reset): nothing was proved either way, so
    a caller may try again, unlike after a wrong proof."""


@dataclasses.dataclass(frozen=True)
class Hello:
    """Who a connecting peer says it is (trusted only once :func:`accept` returns)."""

    role: int
    rank: int
    incarnation: int
    # the connection's frame keys (set by accept; a Hello built to connect has none)
    auth: seal.FrameAuth | None = dataclasses.field(default=None, compare=False, repr=False)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def _version_field(version: str) -> bytes:
    data = version.encode("utf-8")[:_MAX_VERSION]
    return bytes([len(data)]) + data


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


def _read_version(sock: socket.socket, deadline: float) -> tuple[bytes, str]:
    """The peer's version field (as received) and the version it names."""
    (size,) = _read(sock, 1, deadline)
    field = bytes([size]) + _read(sock, size, deadline)
    return field, field[1:].decode("utf-8", "replace")


def _refuse(sock: socket.socket, deadline: float) -> None:
    """End our side and read what the peer still sends until it closes (briefly), so that
    what we sent reaches it instead of being cut short by a reset."""
    try:
        sock.shutdown(socket.SHUT_WR)
        stop = min(deadline, time.monotonic() + _REFUSAL_DRAIN)
        while (remaining := stop - time.monotonic()) > 0:
            sock.settimeout(remaining)
            if not sock.recv(4096):
                return
    except OSError:  # it went first, or the time is up
        return


def connect(sock: socket.socket, secret: bytes, hello: Hello, timeout: float,
            peer: str = "the controller", own: str = "this process",
            version: str | None = None) -> seal.FrameAuth:
    """The connecting side: introduce itself, compare versions, check the acceptor's proof,
    prove its own; the keys of the frames that follow. ``peer`` and ``own`` name the two
    sides in errors; ``version``: this side's (default ``phalanx.__version__``)."""
    deadline = time.monotonic() + timeout
    version = release.__version__ if version is None else version
    nonce = secrets.token_bytes(32)
    greeting = (MAGIC + _version_field(version)
                + _HELLO.pack(hello.role, hello.rank, hello.incarnation, nonce))
    sock.settimeout(timeout)
    sock.sendall(greeting)
    try:
        their_field, theirs = _read_version(sock, deadline)
    except HandshakeIncomplete as exc:
        raise HandshakeIncomplete(
            f"{peer}: {exc}, before saying its phalanx version (a peer of a phalanx older "
            f"than this one, {version}, ends the handshake so)") from None
    if theirs != version:
        raise VersionMismatch(own, version, peer, theirs)
    greeting += their_field
    reply = _read(sock, 32 + _DIGEST, deadline)
    their_nonce, proof = reply[:32], reply[32:]
    if not hmac.compare_digest(proof, _mac(secret, b"acceptor", greeting, their_nonce)):
        raise AuthenticationError(f"{peer} could not prove the shared secret (a wrong "
                                  "token or secret on one side)")
    sock.sendall(_mac(secret, b"connector", greeting, their_nonce))
    sock.settimeout(None)
    return seal.derive(secret, greeting + their_nonce, connector=True)


def accept(sock: socket.socket, secret: bytes, timeout: float, peer: str = "the peer",
           own: str = "this process", version: str | None = None) -> Hello:
    """The accepting side: read the greeting, compare versions, prove the secret, check the
    peer's proof; who it is, with the keys of the frames that follow (``auth``). ``peer``
    and ``own`` name the two sides in errors; ``version``: this side's (default
    ``phalanx.__version__``)."""
    deadline = time.monotonic() + timeout
    version = release.__version__ if version is None else version
    magic = _read(sock, len(MAGIC), deadline)  # a stranger is told apart at once
    if magic == _BEFORE_VERSIONS:
        _refuse(sock, deadline)
        raise VersionMismatch(own, version, peer, None)
    if magic != MAGIC:
        raise AuthenticationError(f"the peer does not speak the phalanx protocol (it sent "
                                  f"{magic!r})")
    their_field, theirs = _read_version(sock, deadline)
    own_field = _version_field(version)
    sock.sendall(own_field)  # first, so that a peer of another version learns it at once
    if theirs != version:
        _refuse(sock, deadline)
        raise VersionMismatch(own, version, peer, theirs)
    hello_part = _read(sock, _HELLO.size, deadline)
    role, rank, incarnation, _ = _HELLO.unpack(hello_part)
    greeting = magic + their_field + hello_part + own_field
    nonce = secrets.token_bytes(32)
    sock.sendall(nonce + _mac(secret, b"acceptor", greeting, nonce))
    proof = _read(sock, _DIGEST, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", greeting, nonce)):
        raise AuthenticationError(f"a peer claiming to be rank {rank} failed to prove the secret")
    sock.settimeout(None)
    return Hello(role, rank, incarnation, seal.derive(secret, greeting + nonce, connector=False))


def connection_cap(cap: int, nofile: int | None = None) -> int:
    """How many connections a listener lets be in their handshake at once: ``cap``, or a
    quarter of this process's descriptor limit (``nofile``; by default the current soft
    limit) if that is less, and at least 4 -- so strangers cannot take every descriptor."""
    import resource  # only a listener asks

    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY or nofile <= 0:
        return cap
    return max(4, min(cap, nofile // 4))
