"""What a peer says reaches a log line or an error message escaped: a stranger's version
string with a newline and terminal escapes in it cannot forge a line of a real ``phalanx
agent``'s log (nor clear the screen of whoever reads it), and neither can a peer that proved
the token; an agent's reasons (a FAULT, a refused request) reach the controller's errors
escaped too.

The agent is a real ``phalanx agent`` on 127.0.0.15, its stderr in a file; the fake agent
of the controller-side tests is a listener of this process on 127.0.0.1. Loopback only,
every wait bounded.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.agent.daemon import LogLines
from phalanx.backends.cluster.link import AgentLink
from phalanx.cli.main import LOG_FORMAT
from phalanx.errors import PhalanxError, VersionMismatch, printable
from phalanx.wire import framing, handshake, seal
from tests import helpers
from tests.agentcluster import free_port, listening, terminate

HOST = "127.0.0.15"
FORGED = "phalanx: serving a controller from 10.6.6.6:4242"
# a newline, then a line as the agent writes it; ESC sequences that erase the line before
# it and move the cursor up, so that a terminal would show the forged line alone
EVIL = f"0.1.0\n{FORGED}\x1b[1A\x1b[2K\r\u2028\x07"


def _no_forged_line(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u2028" not in text, text
    for line in text.splitlines():
        assert not line.startswith(FORGED), f"a forged line in the log: {line!r}"


def test_printable_escapes_what_could_start_a_line_or_move_the_cursor_and_truncates():
    assert printable("0.12.1") == "0.12.1"
    assert printable("a\nb\r\x1b[2Jc\t\u2028\u202ed") == "a\\nb\\r\\x1b[2Jc\\t\\u2028\\u202ed"
    assert printable("x" * 30, 10) == "x" * 10 + "... (20 more characters)"
    shown = printable("\n" * 5000)
    assert "\n" not in shown and shown.endswith("(4000 more characters)")
    assert printable(printable(EVIL)) == printable(EVIL)  # escaping twice changes nothing


def _agent_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PHALANX_TOKEN"} | {
        "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[int, bytes, Callable[[], str]]]:
    """A ``phalanx agent`` on HOST: (its port, the token's handshake secret, its log so
    far); stopped when the test ends."""
    token_file = helpers.token_file(tmp_path)
    log = tmp_path / "agent.log"
    port = free_port(HOST)
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", HOST, "--port", str(port),
             "--token-file", token_file, "--no-http", "--store", str(tmp_path / "store")],
            cwd=helpers.REPO, stdin=subprocess.DEVNULL, stderr=stderr, env=_agent_env())
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(HOST, port),
                                  20, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode}): {log.read_text()}"
        yield port, handshake.stretch(Path(token_file).read_bytes().strip()), log.read_text
    finally:
        terminate([proc])


def _closed_by_agent(sock: socket.socket) -> None:
    """Read until the agent hangs up (bounded)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


def test_a_strangers_version_cannot_forge_a_line_of_the_agents_log(agent):
    port, secret, log = agent
    field = EVIL.encode()
    # a stranger of the release before this handshake: its magic and a version, unproved
    with socket.create_connection((HOST, port), timeout=5) as stranger:
        stranger.sendall(b"PHALANX2" + bytes([len(field)]) + field + bytes(41))
        _closed_by_agent(stranger)
    # and a peer that proves the token, claiming that version
    with socket.create_connection((HOST, port), timeout=5) as peer:
        with pytest.raises(VersionMismatch):
            handshake.connect(peer, secret, handshake.Hello(handshake.ROLE_CONTROL, 0, 0),
                              timeout=10, peer="the agent", version=EVIL)
    assert helpers.wait_until(lambda: log().count("10.6.6.6") >= 2, 10), log()
    text = log()
    _no_forged_line(text)
    named = [line for line in text.splitlines() if "10.6.6.6" in line]
    assert len(named) == 2, text
    for line in named:  # what the peer said, escaped, on the refusal's own line
        assert line.startswith("phalanx: refused "), line
        assert "runs phalanx 0.1.0\\n" + FORGED + "\\x1b[1A" in line, line


def test_the_agents_log_writes_each_message_on_one_line_whoever_logged_it():
    """``phalanx agent``'s formatter: a peer's text that some module logs as it came
    (a GPU holder's name, a child agent's reason) is escaped there too; a traceback after
    the message stays as Python wrote it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogLines(LOG_FORMAT))
    log = logging.getLogger("tests.peer_strings")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("the GPUs 0 of this node are held by %s", EVIL)
        try:
            raise ValueError("inner")
        except ValueError:
            log.exception("a session failed")
    finally:
        log.removeHandler(handler)
    first, second, *traceback = stream.getvalue().splitlines()
    _no_forged_line(first)
    assert first.startswith("phalanx: the GPUs 0 of this node are held by 0.1.0\\n" + FORGED)
    assert second == "phalanx: a session failed"
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: inner"


# -- the controller's side: what an agent that proved the token says ------------------------

SECRET = b"p" * 32  # the fake agent's and its controller's


@pytest.fixture
def fake_agent() -> Iterator[Callable[[Callable[[socket.socket, seal.FrameAuth], None]],
                                      tuple[str, int]]]:
    """``fake_agent(script)``: a listener on 127.0.0.1 whose first connection is proved
    with SECRET, then handed to ``script(sock, auth)``; its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    threads: list[threading.Thread] = []

    def serve(script: Callable[[socket.socket, seal.FrameAuth], None]) -> None:
        conn, _ = listener.accept()
        with conn:
            hello = handshake.accept(conn, SECRET, timeout=10)
            assert hello.auth is not None
            script(conn, hello.auth)

    def start(script: Callable[[socket.socket, seal.FrameAuth], None]) -> tuple[str, int]:
        thread = threading.Thread(target=serve, args=(script,), daemon=True)
        thread.start()
        threads.append(thread)
        return listener.getsockname()[:2]

    try:
        yield start
    finally:
        for thread in threads:
            thread.join(10)
        listener.close()



def _send(sock: socket.socket, auth: seal.FrameAuth, frame: list) -> None:
    sock.sendall(b"".join(framing.seal_frames(frame, auth)))


def test_an_agents_fault_reaches_the_controllers_error_escaped(fake_agent):
    def turn_away(sock: socket.socket, auth: seal.FrameAuth) -> None:
        _send(sock, auth, agentwire.fault(EVIL))

    host, port = fake_agent(turn_away)
    with pytest.raises(OSError, match="turned this controller away") as info:
        agenttree.connect_agent(host, port, SECRET, None, 10, own="this controller")
    _no_forged_line(str(info.value))
    assert "0.1.0\\n" + FORGED in str(info.value)


def test_an_agents_reasons_after_its_welcome_reach_the_controller_escaped(fake_agent):
    def serve_badly(sock: socket.socket, auth: seal.FrameAuth) -> None:
        _send(sock, auth, agentwire.request(agentwire.WELCOME, 0, {"host": "fake"}))
        sock.settimeout(10)
        sock.recv(1)  # the controller's request: refuse it, then end the session
        _send(sock, auth, agentwire.reply(1, False, EVIL))
        _send(sock, auth, agentwire.fault(EVIL))
        _closed_by_agent(sock)

    host, port = fake_agent(serve_badly)
    joined = agenttree.connect_agent(host, port, SECRET, None, 10, own="this controller")
    writer = framing.BacklogWriter()
    link = AgentLink(joined, writer, 1 << 20)
    try:
        with pytest.raises(PhalanxError) as info:
            link.request(agentwire.PING, timeout=10)
        _no_forged_line(str(info.value))
        assert helpers.wait_until(lambda: link.lost_reason is not None, 10)
        _no_forged_line(link.lost_reason or "")
        assert FORGED in (link.lost_reason or "")
    finally:
        link.close()
        writer.stop()
