"""Proving the group's secret over a fresh connection, both ways, and refusing a peer of
another phalanx version before anything else (real sockets)."""

from __future__ import annotations

import socket
import threading

import pytest

import phalanx
from phalanx import AuthenticationError
from phalanx.errors import VersionMismatch
from phalanx.wire import handshake

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
    assert run_pair(SECRET, SECRET) == {"hello": HELLO}


def test_a_peer_with_the_wrong_secret_is_refused_on_both_sides():
    outcome = run_pair(SECRET, b"x" * 32)
    assert "could not prove" in str(outcome["connect_error"])
    assert "hello" not in outcome  # the acceptor never trusts it


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


def test_versions_are_compared_before_the_secret():
    outcome = run_pair(SECRET, b"x" * 32, accept_version="2.0", connect_version="1.0")
    assert isinstance(outcome["connect_error"], VersionMismatch)
    assert isinstance(outcome["accept_error"], VersionMismatch)


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


def test_an_acceptor_that_hangs_up_before_its_version_hints_at_an_older_release():
    a, b = socket.socketpair()

    def older_acceptor():  # reads a magic it does not know, and hangs up
        a.recv(8)
        a.close()

    thread = threading.Thread(target=older_acceptor)
    thread.start()
    with pytest.raises(handshake.HandshakeIncomplete, match="before saying its phalanx version"):
        handshake.connect(b, SECRET, HELLO, timeout=2, version="0.2.0")
    thread.join(10)
    b.close()


def test_the_version_error_survives_pickling():
    import pickle

    error = VersionMismatch("this agent", "0.1.0", "the controller at h:1", "0.2.0")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is VersionMismatch and str(again) == str(error)
    assert again.peer_version == "0.2.0"
