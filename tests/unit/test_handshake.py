"""Proving the group's secret over a fresh connection, both ways (real sockets)."""

from __future__ import annotations

import socket
import threading

import pytest

from phalanx import AuthenticationError
from phalanx.wire import handshake

SECRET = b"s" * 32
HELLO = handshake.Hello(handshake.ROLE_CONTROL, rank=3, incarnation=2)


def run_pair(accept_secret: bytes, connect_secret: bytes):
    a, b = socket.socketpair()
    outcome: dict = {}

    def acceptor():
        try:
            outcome["hello"] = handshake.accept(a, accept_secret, timeout=5)
        except AuthenticationError as exc:
            outcome["accept_error"] = exc

    thread = threading.Thread(target=acceptor)
    thread.start()
    try:
        handshake.connect(b, connect_secret, HELLO, timeout=5)
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
