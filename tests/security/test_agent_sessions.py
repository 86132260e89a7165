"""An agent serves a bounded number of authenticated sessions (``phalanx agent
--max-sessions``): controllers that prove the token past the cap are each told why (the
agent's FAULT, raised by ``connect_agent`` and, on a ClusterBackend, named in its
QuorumTimeout), the agent's threads do not grow with them, and a place freed is taken
again.

The agent is a real ``phalanx agent`` on 127.0.0.16 (loopback only), spoken to with the real
token over the connection a controller makes
(:func:`phalanx.backends.cluster.tree.connect_agent`, as bench/trust.py does). Every wait
is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import phalanx as px
from phalanx import config
from phalanx.backends.cluster import tree as agenttree
from phalanx.wire import handshake
from tests import helpers
from tests.agentcluster import free_port, listening, terminate
from tests.workers import Probe

HOST = "127.0.0.16"
CAP = 3
REFUSED = 12  # controllers turned away in a row


@dataclass
class Agent:
    proc: subprocess.Popen
    port: int
    secret: bytes  # the token's handshake secret
    token_file: str
    log: Path

    def connect(self) -> agenttree.Joined:
        return agenttree.connect_agent(HOST, self.port, self.secret, None, 10,
                                       own="this controller")

    def threads(self) -> int:
        return psutil.Process(self.proc.pid).num_threads()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    token_file = helpers.token_file(tmp_path)
    port = free_port(HOST)
    log = tmp_path / "agent.log"
    env = {key: value for key, value in os.environ.items() if key != "PHALANX_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", HOST, "--port", str(port),
             "--token-file", token_file, "--no-http", "--heartbeat-timeout", "60",
             "--max-sessions", str(CAP), "--store", str(tmp_path / "store")],
            cwd=helpers.REPO, stdin=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(HOST, port),
                                  20, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode}): {log.read_text()}"
        secret = handshake.stretch(Path(token_file).read_bytes().strip())
        yield Agent(proc, port, secret, token_file, log)
    finally:
        terminate([proc])


def test_past_its_sessions_a_controller_is_told_the_limit_and_costs_no_thread(agent):
    sessions = [agent.connect() for _ in range(CAP)]
    try:
        serving = agent.threads()
        for _ in range(REFUSED):
            with pytest.raises(OSError) as info:
                agent.connect()
            text = str(info.value)
            assert text.startswith(f"the agent at {HOST}:{agent.port} turned this controller "
                                   f"away: it serves {CAP} sessions already, its limit"), text
            assert "--max-sessions" in text and "AGENT_MAX_SESSIONS" in text, text
        # each refused connection's thread ends with it (a moment after its FAULT is sent)
        assert helpers.wait_until(lambda: agent.threads() <= serving, 10), (
            agent.threads(), serving)
        assert "sessions already, its limit (--max-sessions)" in agent.log.read_text()
        # a place freed is taken again, once the agent has seen its controller go
        sessions.pop().close()
        joined: list[agenttree.Joined] = []

        def reconnected() -> bool:
            try:
                joined.append(agent.connect())
            except OSError:
                return False
            return True

        assert helpers.wait_until(reconnected, 10, interval=0.1)
        sessions += joined
    finally:
        for session in sessions:
            session.close()


def test_a_group_on_a_full_agent_fails_naming_the_agents_limit(agent):
    sessions = [agent.connect() for _ in range(CAP)]
    try:
        backend = px.ClusterBackend([f"{HOST}:{agent.port}"], token_file=agent.token_file,
                                    quorum_timeout=2)
        with pytest.raises(px.QuorumTimeout) as info:
            px.WorkerGroup(Probe, backend=backend, echo_output=False)
        assert f"it serves {CAP} sessions already, its limit (phalanx agent --max-sessions" \
               in str(info.value)
        assert f"AGENT_MAX_SESSIONS = {config.AGENT_MAX_SESSIONS}" in str(info.value)
    finally:
        for session in sessions:
            session.close()
