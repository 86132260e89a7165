"""Proving a shared secret over a fresh connection, both ways, before any frame flows.

Used wherever a process connects to another over the network: a rank's Ray actor to its
controller, a controller to a node's agent, an agent to the agents below it in a tree.
Nothing is unpickled from a peer before it has proved the secret, and the peer learns it
talks to the side that holds the secret. The connecting side proves first, so a stranger
that connects learns nothing derived from the secret, nor this side's version::

    connector -> acceptor   MAGIC, nonce_c (32 B)
    acceptor  -> connector  nonce_a (32 B)
    connector -> acceptor   version (u8 length, UTF-8), role (u8), rank (u32),
                            incarnation (u32), HMAC(secret, "connector" | greeting)
    acceptor  -> connector  REFUSED (1 B), and it closes                  -- a wrong proof --
                            or ACCEPTED (1 B), version (u8 length, UTF-8),
                            HMAC(secret, "acceptor" | greeting | version)

``greeting`` is everything before the connector's proof: the magic, both nonces, the
connector's version and who it is. The proofs cover both versions, which are compared only
once both sides have proved the secret (``phalanx.__version__`` of each: pickles name
module paths, which move between releases, so two releases never exchange one; each side
raises :class:`~phalanx.errors.VersionMismatch` naming both versions and the side to
upgrade). A peer of an earlier release (magic ``PHALANX1`` or ``PHALANX2``) is refused as
older, and told nothing. A version is the peer's own text (a ``PHALANX2`` stranger's is
unproved): the error shows it through :func:`phalanx.errors.printable`, so that it cannot
start a line of its own in a log.

The handshake also gives each side the keys that authenticate every frame after it
(:mod:`phalanx.wire.seal`, derived from the secret and the whole transcript):
:func:`connect` returns them, :func:`accept` returns them in its :class:`Hello`, and the
caller hands them to the connection (:class:`phalanx.wire.framing.Connection`'s ``auth``).
Proving the secret once is not enough: a relay that forwarded these bytes could otherwise
write frames of its own after them.

What an eavesdropper (or an acceptor a controller was tricked into dialling) sees lets it
test guesses of the secret offline. The secrets phalanx makes itself are 256 random bits;
a token a person chose goes through :func:`stretch` first (scrypt, about 32 MiB and a
tenth of a second per guess, computed once per process), which is what the agents and
their controllers use.

Every read has a deadline; a peer that stalls or lies is dropped with
:class:`AuthenticationError`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import secrets
import socket
import struct
import time

from phalanx import version as release
from phalanx.errors import AuthenticationError, VersionMismatch
from phalanx.wire import seal

MAGIC = b"PHALANX3"
_OLDER = {b"PHALANX1": False, b"PHALANX2": True}  # earlier releases' magic: sends a version?
_HELLO = struct.Struct("<BII")  # role, rank, incarnation
_NONCE = 32
REFUSED, ACCEPTED = b"\x00", b"\x01"
# scrypt's cost for a token a person chose: 2**15 x 8 x 128 B = 32 MiB, ~0.1 s per guess
_SCRYPT = {"n": 1 << 15, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}
_SCRYPT_SALT = b"phalanx handshake key v3"
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


def read_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes by ``deadline`` (each read's timeout is what is left of it, so a peer
    that trickles ends on time too); :class:`HandshakeIncomplete` when the peer is late,
    closes or the connection fails."""
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
    (size,) = read_exactly(sock, 1, deadline)
    field = bytes([size]) + read_exactly(sock, size, deadline)
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


@functools.lru_cache(maxsize=8)
def stretch(token: bytes) -> bytes:
    """The handshake's secret for a token a person may have chosen: a memory-hard function
    of it (scrypt), so that each offline guess of the token costs what it costs here, once.
    Computed once per process and token."""
    return hashlib.scrypt(token, salt=_SCRYPT_SALT, **_SCRYPT)


def connect(sock: socket.socket, secret: bytes, hello: Hello, timeout: float,
            peer: str = "the controller", own: str = "this process",
            version: str | None = None) -> seal.FrameAuth:
    """The connecting side: prove the secret, check the acceptor's proof, compare versions;
    the keys of the frames that follow. ``peer`` and ``own`` name the two sides in errors;
    ``version``: this side's (default ``phalanx.__version__``)."""
    deadline = time.monotonic() + timeout
    version = release.__version__ if version is None else version
    nonce = secrets.token_bytes(_NONCE)
    sock.settimeout(timeout)
    sock.sendall(MAGIC + nonce)
    try:
        their_nonce = read_exactly(sock, _NONCE, deadline)
    except HandshakeIncomplete as exc:
        raise HandshakeIncomplete(
            f"{peer}: {exc}, before it answered (a peer of a phalanx older than this one, "
            f"{version}, or one that speaks another protocol, ends the handshake so)") from None
    greeting = (MAGIC + nonce + their_nonce + _version_field(version)
                + _HELLO.pack(hello.role, hello.rank, hello.incarnation))
    sock.sendall(greeting[len(MAGIC) + 2 * _NONCE:] + _mac(secret, b"connector", greeting))
    try:
        answer = read_exactly(sock, 1, deadline)
    except HandshakeIncomplete as exc:
        raise HandshakeIncomplete(f"{peer}: {exc}, after this side's proof") from None
    if answer != ACCEPTED:
        raise AuthenticationError(f"{peer} refused this side's proof of the shared secret "
                                  "(a wrong token or secret on one side)")
    their_field, theirs = _read_version(sock, deadline)
    proof = read_exactly(sock, _DIGEST, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"acceptor", greeting, their_field)):
        raise AuthenticationError(f"{peer} could not prove the shared secret (a wrong "
                                  "token or secret on one side)")
    if theirs != version:
        raise VersionMismatch(own, version, peer, theirs)
    sock.settimeout(None)
    return seal.derive(secret, greeting + their_field, connector=True)


def accept(sock: socket.socket, secret: bytes, timeout: float, peer: str = "the peer",
           own: str = "this process", version: str | None = None) -> Hello:
    """The accepting side: check the peer's proof, prove the secret, compare versions; who
    it is, with the keys of the frames that follow (``auth``). ``peer`` and ``own`` name the
    two sides in errors; ``version``: this side's (default ``phalanx.__version__``)."""
    deadline = time.monotonic() + timeout
    version = release.__version__ if version is None else version
    magic = read_exactly(sock, len(MAGIC), deadline)  # a stranger is told apart at once
    if magic in _OLDER:
        theirs = None
        if _OLDER[magic]:  # that release named its version next (nothing is sent back)
            theirs = _read_version(sock, deadline)[1]
        _refuse(sock, deadline)
        raise VersionMismatch(own, version, peer, theirs)
    if magic != MAGIC:
        raise AuthenticationError(f"the peer does not speak the phalanx protocol (it sent "
                                  f"{magic!r})")
    their_nonce = read_exactly(sock, _NONCE, deadline)
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(nonce)  # random: nothing derived from the secret goes to an unproved peer
    their_field, theirs = _read_version(sock, deadline)
    hello_part = read_exactly(sock, _HELLO.size, deadline)
    role, rank, incarnation = _HELLO.unpack(hello_part)
    greeting = magic + their_nonce + nonce + their_field + hello_part
    proof = read_exactly(sock, _DIGEST, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", greeting)):
        _send_quietly(sock, REFUSED)
        raise AuthenticationError(f"a peer claiming to be rank {rank} failed to prove the secret")
    own_field = _version_field(version)
    sock.sendall(ACCEPTED + own_field + _mac(secret, b"acceptor", greeting, own_field))
    if theirs != version:  # both proved the secret: each may learn the other's version
        _refuse(sock, deadline)
        raise VersionMismatch(own, version, peer, theirs)
    sock.settimeout(None)
    return Hello(role, rank, incarnation,
                 seal.derive(secret, greeting + own_field, connector=False))


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Tell a peer whose proof failed so (it may have gone already)."""
    try:
        sock.sendall(data)
    except OSError:
        pass


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
