"""``px.breakpoint()`` while other local users churn connections on its loopback port.

A probe that opened and dropped connections by the hundred (sending a few bytes first) had
``KeyError`` raised out of ``px.breakpoint()`` into user code in 3 of 6 tries: a connection
dropped to make room (past ``config.DEBUG_MAX_PENDING``) whose bytes were still to be read
in the same turn. Here, whatever strangers send or do -- nothing, garbage, over-long lines,
wrong tokens, connecting and hanging up at once, resets, more connections than are held --

- the owner's ``phalanx debug`` still attaches and the session works;
- a breakpoint with a timeout waits all of it (strangers do not end it early) and returns
  False, nothing raised;
- the wait itself (``debugger._accept``, in this process) neither raises nor returns
  anything but the owner's connection, also with a small ``DEBUG_MAX_PENDING`` that makes
  the drop-to-make-room path run all the time.

Ranks come from a real group, driven as in ``tests/cli/test_debug.py``. Every test is
bounded: churn runs for a few seconds at most, and ranks wait with a timeout.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time

import pytest

import phalanx as px
from phalanx import config
from phalanx.cli import debug
from phalanx.rank import debugger
from tests.cli.test_debug import WAIT_TIMEOUT, describe, phalanx_debug, wait_for_record

CHURN_THREADS = 4
HELD_AT_MOST = 200  # connections each churn thread keeps open (more than DEBUG_MAX_PENDING)


class Stopper:
    """Rank 1 stops in the debugger; whatever ``px.breakpoint`` raises is the call's error."""

    def compute(self, x: int, patience: float) -> tuple[int, bool, float]:
        rank = int(os.environ["RANK"])
        if rank != 1:
            return x, False, 0.0
        secret_value = x * 1000 + 7
        started = time.monotonic()
        attached = px.breakpoint(timeout=patience)
        return secret_value + 1, attached, time.monotonic() - started


class Churn:
    """Threads that connect to ``port`` over and over, each connection doing one of the
    things a stranger might, until stopped (or ``limit`` seconds passed)."""

    def __init__(self, port: int, limit: float = 8.0) -> None:
        self.port = port
        self.limit = limit
        self.stopped = threading.Event()
        self.connections = 0
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in range(CHURN_THREADS)]

    def __enter__(self) -> Churn:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self._threads:
            thread.join(5)

    def _run(self, n: int) -> None:
        end = time.monotonic() + self.limit
        held: list[socket.socket] = []
        step = n
        try:
            while not self.stopped.is_set() and time.monotonic() < end:
                try:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
                except OSError:
                    time.sleep(0.01)  # the backlog is full: the rank is catching up
                    continue
                self.connections += 1
                step += 1
                try:
                    self._misbehave(sock, step, held)
                except OSError:
                    sock.close()  # the rank hung up first: fine
                while len(held) > HELD_AT_MOST:
                    held.pop(0).close()
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            for sock in held:
                sock.close()

    @staticmethod
    def _misbehave(sock: socket.socket, step: int, held: list[socket.socket]) -> None:
        kind = step % 7
        if kind == 0:  # connect and hang up at once
            sock.close()
        elif kind == 1:  # a few bytes, no newline, then hang up
            sock.sendall(b"x" * 10)
            sock.close()
        elif kind == 2:  # random bytes, more than a token line holds
            sock.sendall(os.urandom(400))
            sock.close()
        elif kind == 3:  # a wrong token, not waiting for the answer
            sock.sendall(secrets.token_hex(32).encode() + b"\n")
            sock.close()
        elif kind == 4:  # reset instead of a clean close, with bytes unread
            sock.sendall(b"\xff\xfe\0garbage")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        elif kind == 5:  # half a line, then kept open (silent)
            sock.sendall(b"ab")
            held.append(sock)
        else:  # nothing at all, kept open
            held.append(sock)


@pytest.fixture
def debug_dir(tmp_path):
    return tmp_path / "debug"


@pytest.fixture
def group(debug_dir):
    with px.WorkerGroup(Stopper, procs_per_node=2, echo_output=False,
                        env={debugger.ENV_DEBUG_DIR: str(debug_dir)}) as group:
        yield group


def test_the_owner_attaches_and_debugs_while_strangers_churn(group, debug_dir):
    future = group.call_async("compute", 6, 20.0)
    record = wait_for_record(debug_dir)
    with Churn(record.port) as churn:
        time.sleep(1.0)  # well into the churn: drops to make room happen all the time
        session = phalanx_debug(debug_dir, "1", stdin="p secret_value\nc\n")
    assert not churn.errors, churn.errors
    print(f"\n{churn.connections} strangers' connections")
    assert churn.connections > config.DEBUG_MAX_PENDING
    assert session.returncode == 0, describe(session)
    assert "6007" in session.stdout
    (_, (value, attached, _)) = future.result(timeout=WAIT_TIMEOUT)
    assert (value, attached) == (6008, True)  # nothing raised into compute


def test_churn_neither_raises_into_user_code_nor_ends_the_breakpoint(group, debug_dir):
    patience = 3.0
    future = group.call_async("compute", 2, patience)
    record = wait_for_record(debug_dir)
    with Churn(record.port, limit=patience + 1) as churn:
        result = future.result(timeout=WAIT_TIMEOUT)  # it raised if the rank did
    assert not churn.errors, churn.errors
    (_, (value, attached, waited)) = result
    assert (value, attached) == (2008, False)
    assert waited >= patience - 0.1, f"the breakpoint ended after {waited:.2f} s"
    assert not debug.waiting_ranks(debug_dir)  # its record is gone with it
    # and the rank serves on: a breakpoint after the churn still attaches
    future = group.call_async("compute", 3, 20.0)
    wait_for_record(debug_dir)
    session = phalanx_debug(debug_dir, "1", stdin="c\n")
    assert session.returncode == 0, describe(session)
    assert future.result(timeout=WAIT_TIMEOUT)[1][:2] == (3008, True)


@pytest.mark.parametrize("max_pending", [2, config.DEBUG_MAX_PENDING])
def test_the_wait_returns_only_the_owners_connection_whatever_strangers_do(monkeypatch,
                                                                         max_pending):
    """``_accept`` itself, in this process: with 2 held at most, nearly every stranger
    makes room by dropping another, whose bytes may be waiting in the same turn."""
    monkeypatch.setattr(config, "DEBUG_MAX_PENDING", max_pending)
    token = secrets.token_hex(32).encode()
    outcome: dict[str, object] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(config.DEBUG_BACKLOG)
        port = listener.getsockname()[1]

        def wait() -> None:
            try:
                outcome["conn"] = debugger._accept(listener, token, time.monotonic() + 8)
            except BaseException as exc:  # what the test is about
                outcome["raised"] = exc

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        with Churn(port, limit=6.0) as churn:
            time.sleep(2.0)
            assert waiter.is_alive(), outcome  # churn alone neither raised nor ended it
            owner = None
            for _ in range(20):  # at 2 held, a flood can push the owner out: it retries
                owner = socket.create_connection(("127.0.0.1", port), timeout=5)
                try:
                    owner.sendall(token + b"\n")
                    line, _ = debugger.read_line(owner)
                except OSError:  # reset: dropped to make room
                    line = b""
                if line == b"ok":
                    break
                owner.close()
                owner = None
            waiter.join(5)
        try:
            assert not churn.errors, churn.errors
            assert "raised" not in outcome, outcome
            assert owner is not None, "the owner never got through"
            conn = outcome["conn"]
            assert isinstance(conn, socket.socket)
            conn.sendall(b"hello\n")  # it is the owner's connection, not a stranger's
            assert owner.recv(100) == b"hello\n"
            conn.close()
        finally:
            if owner is not None:
                owner.close()
