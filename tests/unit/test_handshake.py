"""Proving the group's secret over a fresh connection, both ways, and refusing a peer of
another phalanx version before anything else (real sockets)."""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

import phalanx
from phalanx import AuthenticationError
from phalanx.errors import VersionMismatch
from phalanx.wire import framing, handshake, pickling, protocol, seal, streams

SECRET = b"s" * 32
HELLO = handshake.Hello(handshake.ROLE_CONTROL, rank=3, incarnation=2)


def run_pair(accept_secret: bytes, connect_secret: bytes, accept_version=None,
             connect_version=None):
    a, b = socket.socketpair()
    outcome: dict = {}

    def acceptor():
        try:
            outcome["hello"] = handshake.accept(a, accept_secret, timeout=5, peer="the rank",
                                                own="this controller", version=accept_version)
        except AuthenticationError as exc:
            outcome["accept_error"] = exc

    thread = threading.Thread(target=acceptor)
    thread.start()
    try:
        handshake.connect(b, connect_secret, HELLO, timeout=5, peer="the controller",
                          own="this rank", version=connect_version)
    except AuthenticationError as exc:
        outcome["connect_error"] = exc
        b.close()  # the connector drops the controller it does not trust
    thread.join(10)
    a.close()
    b.close()
    return outcome


def test_both_sides_holding_the_secret_agree_on_who_connected():
    outcome = run_pair(SECRET, SECRET)
    assert outcome == {"hello": HELLO}
    assert isinstance(outcome["hello"].auth, seal.FrameAuth)


def test_a_peer_with_the_wrong_secret_is_refused_on_both_sides():
    outcome = run_pair(SECRET, b"x" * 32)
    assert "refused this side's proof" in str(outcome["connect_error"])
    assert "failed to prove the secret" in str(outcome["accept_error"])
    assert "hello" not in outcome  # the acceptor never trusts it


def test_a_stranger_learns_nothing_derived_from_the_secret_nor_the_version():
    """The connector proves first: a stranger that connects is sent a random nonce, and
    after a wrong proof one byte saying so -- nothing to test guesses against offline, and
    no version (both would be the same whatever the secret and the version)."""
    heard = []
    for secret, version in ((SECRET, "0.2.0"), (b"y" * 32, "9.9.9")):
        a, b = socket.socketpair()
        errors: list = []
        thread = threading.Thread(target=_accept_into, args=(errors, a, secret, version))
        thread.start()
        b.sendall(handshake.MAGIC + bytes(32))
        nonce = b.recv(32)
        b.sendall(b"\x05" + b"0.2.0" + bytes(9) + bytes(32))  # a guessed proof
        thread.join(10)
        rest = b.recv(100)
        heard.append((len(nonce), rest, type(errors[0]).__name__))
        a.close()
        b.close()
    assert heard == [(32, handshake.REFUSED, "AuthenticationError")] * 2


def _accept_into(errors: list, sock, secret: bytes, version: str) -> None:
    try:
        handshake.accept(sock, secret, timeout=5, version=version)
    except AuthenticationError as exc:
        errors.append(exc)


def test_a_token_is_stretched_once_per_process_at_a_memory_hard_cost():
    handshake.stretch.cache_clear()
    started = time.perf_counter()
    key = handshake.stretch(b"sunshine-dragon-2024")
    first = time.perf_counter() - started
    started = time.perf_counter()
    assert handshake.stretch(b"sunshine-dragon-2024") == key  # cached: the same key, at once
    assert time.perf_counter() - started < first / 10
    assert len(key) == 32 and key != handshake.stretch(b"sunshine-dragon-2025")


def test_a_stranger_that_does_not_speak_the_protocol_is_dropped():
    a, b = socket.socketpair()
    b.sendall(b"GET / HTTP/1.1\r\n\r\n" + b" " * 64)
    with pytest.raises(AuthenticationError, match="does not speak the phalanx protocol"):
        handshake.accept(a, SECRET, timeout=2)
    a.close()
    b.close()


def test_a_silent_peer_is_dropped_at_the_deadline():
    a, b = socket.socketpair()
    with pytest.raises(AuthenticationError, match="in time"):
        handshake.accept(a, SECRET, timeout=0.2)
    a.close()
    b.close()


def test_each_side_says_phalanxs_own_version_by_default():
    outcome = run_pair(SECRET, SECRET, connect_version="0.0.1")
    assert outcome["accept_error"].own_version == phalanx.__version__
    assert outcome["connect_error"].peer_version == phalanx.__version__


@pytest.mark.parametrize(("controller", "rank", "upgrade"), [
    ("0.2.0", "0.1.9", "upgrade the rank to phalanx 0.2.0"),
    ("0.1.0", "0.10.0", "upgrade this controller to phalanx 0.10.0"),
    ("0.1.0", "0.1.0.dev3", "install the same phalanx version on both sides"),
])
def test_a_peer_of_another_version_is_refused_on_both_sides_naming_both(controller, rank,
                                                                         upgrade):
    outcome = run_pair(SECRET, SECRET, accept_version=controller, connect_version=rank)
    assert "hello" not in outcome
    refused_here, refused_there = outcome["accept_error"], outcome["connect_error"]
    for error in (refused_here, refused_there):
        assert isinstance(error, VersionMismatch)
        assert f"phalanx {controller}" in str(error) and f"phalanx {rank}" in str(error)
    assert upgrade in str(refused_here)
    assert (refused_here.own_version, refused_here.peer_version) == (controller, rank)
    assert (refused_there.own_version, refused_there.peer_version) == (rank, controller)
    assert "the rank runs phalanx" in str(refused_here)
    assert "the controller runs phalanx" in str(refused_there)


def test_versions_are_compared_only_after_both_proved_the_secret():
    outcome = run_pair(SECRET, b"x" * 32, accept_version="2.0", connect_version="1.0")
    assert not isinstance(outcome["connect_error"], VersionMismatch)
    assert "2.0" not in str(outcome["connect_error"])  # a stranger is not told the version
    assert not isinstance(outcome["accept_error"], VersionMismatch)


def test_a_peer_of_a_release_before_versions_is_refused_as_older():
    a, b = socket.socketpair()
    b.sendall(b"PHALANX1" + bytes(41))  # that release's greeting: magic, role, ranks, nonce
    with pytest.raises(VersionMismatch, match="runs an older phalanx") as info:
        handshake.accept(a, SECRET, timeout=2, peer="the controller", own="this agent",
                         version="0.2.0")
    assert "upgrade the controller to phalanx 0.2.0" in str(info.value)
    assert b.recv(100) == b""  # told nothing it could misread, then closed
    a.close()
    b.close()


def test_a_peer_of_the_release_before_this_handshake_is_refused_naming_its_version():
    a, b = socket.socketpair()
    b.sendall(b"PHALANX2" + b"\x050.1.0" + bytes(41))  # magic, version, role, ranks, nonce
    with pytest.raises(VersionMismatch) as info:
        handshake.accept(a, SECRET, timeout=2, peer="the controller", own="this agent",
                         version="0.2.0")
    assert info.value.peer_version == "0.1.0"
    assert b.recv(100) == b""  # not told this side's version: it proved nothing
    a.close()
    b.close()


def test_a_strangers_version_is_escaped_and_cut_short_in_the_error():
    a, b = socket.socketpair()
    claimed = "0.1.0\nphalanx: serving a controller from 10.6.6.6\x1b[2K" + "x" * 200
    field = claimed.encode()
    b.sendall(b"PHALANX2" + bytes([len(field)]) + field + bytes(41))
    with pytest.raises(VersionMismatch) as info:
        handshake.accept(a, SECRET, timeout=2, peer="the controller", own="this agent",
                         version="0.2.0")
    text = str(info.value)
    assert "\n" not in text and "\x1b" not in text
    assert "0.1.0\\nphalanx: serving a controller from 10.6.6.6\\x1b[2K" in text
    assert "more characters" in text and "x" * 100 not in text
    assert info.value.peer_version == claimed  # the attribute keeps what the peer sent
    a.close()
    b.close()


def test_a_proved_peers_version_is_escaped_in_both_sides_errors():
    # (each side's own version is its own text, shown as it is)
    outcome = run_pair(SECRET, SECRET, accept_version="0.2.0\n\x1b[31mred",
                       connect_version="0.1.0\r\nforged line")
    for error in (outcome["accept_error"], outcome["connect_error"]):
        assert isinstance(error, VersionMismatch)
    assert "0.1.0\\r\\nforged line" in str(outcome["accept_error"])
    assert "0.2.0\\n\\x1b[31mred" in str(outcome["connect_error"])


def test_an_acceptor_that_hangs_up_before_its_version_hints_at_an_older_release():
    a, b = socket.socketpair()

    def older_acceptor():  # reads a magic it does not know, and hangs up
        a.recv(8)
        a.close()

    thread = threading.Thread(target=older_acceptor)
    thread.start()
    with pytest.raises(handshake.HandshakeIncomplete, match="before it answered"):
        handshake.connect(b, SECRET, HELLO, timeout=2, version="0.2.0")
    thread.join(10)
    b.close()


def test_the_version_error_survives_pickling():
    import pickle

    error = VersionMismatch("this agent", "0.1.0", "the controller at h:1", "0.2.0")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is VersionMismatch and str(again) == str(error)
    assert again.peer_version == "0.2.0"


# -- the frames after it: keyed by the handshake, every one checked ----------------------


def handshaken_pair():
    """Two ends of a socketpair after a handshake: (connector's auth, acceptor's auth,
    connector's socket, acceptor's socket)."""
    a, b = socket.socketpair()
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(
        hello=handshake.accept(a, SECRET, timeout=5)))
    thread.start()
    auth = handshake.connect(b, SECRET, HELLO, timeout=5)
    thread.join(10)
    return auth, got["hello"].auth, b, a


def _auth_pair():
    up_auth, down_auth, up_sock, down_sock = handshaken_pair()
    up_sock.close()
    down_sock.close()
    return up_auth, down_auth


def connections(writer):
    up_auth, down_auth, up_sock, down_sock = handshaken_pair()
    return (framing.Connection(streams.SocketStream(up_sock), writer, auth=up_auth),
            framing.Connection(streams.SocketStream(down_sock), writer, auth=down_auth))


def receive(conn, count, timeout=5.0):
    frames = []
    deadline = time.monotonic() + timeout
    while len(frames) < count and time.monotonic() < deadline:
        if select.select([conn.read_fd], [], [], 0.1)[0]:
            frames += conn.reader.recv_frames(block=False)
    return frames


@pytest.fixture
def writer():
    writer = framing.BacklogWriter()
    yield writer
    writer.stop()


def test_the_two_ends_derive_the_same_keys_one_per_direction(writer):
    up, down = connections(writer)
    try:
        big = np.arange(300_000, dtype=np.float64)  # a frame received in place
        up.send(framing.frame([b"head", b"pickle", memoryview(big)]))
        down.send(framing.frame([b"answer", b"x" * 10]))
        (first,) = receive(down, 1)
        assert [bytes(s) for s in first[:2]] == [b"head", b"pickle"]
        assert bytes(first[2]) == big.tobytes()  # the tag is gone, the data whole
        assert receive(up, 1) == [[b"answer", b"x" * 10]]
    finally:
        up.close()
        down.close()


def test_several_frames_sent_as_one_write_are_each_sealed(writer):
    up, down = connections(writer)
    try:
        frames = [framing.frame([protocol.pack_head(protocol.RESULT, i, 0), b"v" * i])
                  for i in range(1, 6)]
        up.send([b"".join(s for f in frames for s in f)])  # an agent's outbox: one bytes
        up.send([s for f in frames for s in f])  # or a list of them
        empties = [framing.frame([b"h", b"", b"x" * 100, bytearray(b""), memoryview(b"y")])
                   for _ in range(2)]  # empty segments: buffers of their own, or none
        up.send([s for f in empties for s in f])
        got = receive(down, 12)
        assert [protocol.unpack_head(f[0])[1] for f in got[:10]] == [1, 2, 3, 4, 5] * 2
        assert [[bytes(s) for s in f] for f in got[10:]] == [[b"h", b"", b"x" * 100, b"",
                                                               b"y"]] * 2
    finally:
        up.close()
        down.close()


@pytest.mark.parametrize("tamper", ["flip", "unsealed", "replay", "other_keys"])
def test_a_frame_that_is_not_the_peers_next_one_ends_the_connection(writer, tamper, caplog):
    up_auth, down_auth, up_sock, down_sock = handshaken_pair()
    down = framing.Connection(streams.SocketStream(down_sock), writer, auth=down_auth)
    sealed = b"".join(framing.seal_frames(framing.frame([b"head", b"payload"]), up_auth))
    if tamper == "flip":
        sent = sealed[:-20] + bytes([sealed[-20] ^ 1]) + sealed[-19:]
    elif tamper == "unsealed":
        sent = b"".join(framing.frame([b"head", b"payload"]))
    elif tamper == "replay":
        sent = sealed + sealed
    else:
        other, *rest = handshaken_pair()
        for sock in rest[1:]:
            sock.close()
        sent = b"".join(framing.seal_frames(framing.frame([b"head", b"payload"]), other))
    up_sock.sendall(sent)
    with caplog.at_level("WARNING"), pytest.raises(seal.FrameRejected):
        receive(down, 2)
    assert "failed authentication" in caplog.text
    with pytest.raises(seal.FrameRejected):  # and it stays so
        down.reader.recv_frames(block=False)
    down.close()
    up_sock.close()


def test_keys_handed_to_another_process_go_on_where_the_handshake_left_them():
    up, down, a, b = handshaken_pair()
    a.close()
    b.close()
    again = seal.FrameAuth.taken_over(up.handover())  # the rank's copy of the actor's
    sealed = framing.seal_frames(framing.frame([b"head"]), again)
    assert down.check(_segments(sealed))
    with pytest.raises(ValueError, match="flowed already"):
        again.handover()
    with pytest.raises(ValueError):
        seal.FrameAuth.taken_over("not:keys")


def _segments(sealed):
    data = b"".join(bytes(s) for s in sealed)
    nseg = struct.unpack_from("<I", data)[0]
    lengths = struct.unpack_from(f"<{nseg}Q", data, 12)
    out, pos = [], 12 + 8 * nseg
    for length in lengths:
        out.append(data[pos:pos + length])
        pos += length
    return out


@pytest.mark.parametrize("chunk", [seal.CHUNK, 3000], ids=["one-piece", "pieces"])
def test_a_large_payload_sent_to_many_peers_checks_on_each(writer, monkeypatch, chunk):
    monkeypatch.setattr(seal, "CHUNK", chunk)  # a segment over CHUNK: GMAC'd in pieces
    pairs = [connections(writer) for _ in range(3)]
    big = np.arange(1 << 16, dtype=np.float64)
    payload = pickling.dumps(big)
    try:
        for up, _ in pairs:
            up.send(framing.frame([b"head", *payload, bytes(9000)]))
        for _, down in pairs:
            (got,) = receive(down, 1)
            assert np.array_equal(pickling.loads(got[1:-1]), big)
            assert got[-1] == bytes(9000)
    finally:
        for up, down in pairs:
            up.close()
            down.close()


@pytest.mark.parametrize("where", [0, 4000, -1], ids=["first", "middle", "last"])
def test_one_flipped_byte_of_a_large_segment_fails_its_tag(where):
    up_auth, down_auth = _auth_pair()
    large = bytearray(os.urandom(3 * seal.PREHASH))
    sealed = framing.seal_frames(framing.frame([b"head", bytes(large)]), up_auth)
    segments = _segments(sealed)
    altered = bytearray(segments[1])
    altered[where] ^= 1
    assert not down_auth.check([segments[0], bytes(altered), segments[2]])
    assert down_auth.check(segments)  # the untouched frame still checks, as frame 0
