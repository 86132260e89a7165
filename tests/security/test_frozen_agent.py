"""A node's liveness is its agent's, apart from the ranks' hang detection: a frozen agent
(SIGSTOP: no EOF, only silence, while its ranks keep running) is a lost node -- a
``MembershipChanged`` -- within ``node_timeout`` (default ``config.DEFAULT_NODE_TIMEOUT``)
and two seconds, not at the ranks' ``heartbeat_timeout``; a rank that hangs on a live node
is judged by the group's ``heartbeat_timeout`` and never taken for a lost node; every
control connection has TCP keepalive; the agent's sign of life comes from a thread of its
own.

The agents frozen here are this module's own (on 127.0.0.11-12, stopped when each test
ends), so the session's shared agents stay healthy. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import phalanx as px
from phalanx import config
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.agent import ranks as agentranks
from phalanx.backends.cluster.agent.daemon import Agent
from phalanx.errors import WorkerUnresponsive
from phalanx.launcher import jobhost
from phalanx.wire import handshake, streams
from tests import helpers
from tests.agentcluster import free_port, listening, terminate
from tests.workers import Probe

FROZEN_HOST = "127.0.0.11"
SLACK = 2.0  # seconds past node_timeout a frozen agent may take to be a lost node


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    return helpers.token_file(tmp_path_factory.mktemp("frozen"))


@pytest.fixture
def own_agent(token_file):
    """``own_agent(host, *flags)``: a ``phalanx agent`` of this test's own, at its default
    settings but for ``flags``; its (address, process). Resumed (SIGCONT) and stopped when
    the test ends, with whatever it still runs."""
    procs: list[subprocess.Popen] = []

    def start(host: str, *flags: str) -> tuple[str, subprocess.Popen]:
        port = free_port(host)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(helpers.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
             "--token-file", token_file, "--no-http", *flags],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL)
        procs.append(proc)
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(host, port),
                                  20, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        return f"{host}:{port}", proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        terminate(procs)


# --------------------------------------------------------------------------- a frozen agent


def test_the_node_timeout_defaults_to_the_configured_one(token_file):
    backend = px.ClusterBackend(["127.0.0.1:1"], token_file=token_file)
    assert backend.node_timeout == config.DEFAULT_NODE_TIMEOUT
    assert backend.settings()["node_timeout"] == config.DEFAULT_NODE_TIMEOUT


@pytest.mark.timeout(60)
def test_a_frozen_agent_is_a_lost_node_within_the_node_timeout(own_agent, token_file):
    # the agent at its defaults; the controller's node_timeout explicit and short (what is
    # checked is the loss within node_timeout, not the default's value: that is above)
    address, proc = own_agent(FROZEN_HOST)
    node_timeout = 3.0
    backend = px.ClusterBackend([address], token_file=token_file, node_timeout=node_timeout)
    with px.WorkerGroup(Probe, backend=backend, procs_per_node=2, echo_output=False) as group:
        assert group.call("rank") == [0, 1]
        future = group.call_async("sleep", 120)
        os.kill(proc.pid, signal.SIGSTOP)  # no EOF, only silence; its ranks keep running
        try:
            started = time.monotonic()
            with pytest.raises(px.MembershipChanged, match=r"removed node 0 .*silent for "
                                                           r"\d+ s \(node_timeout=3 s"):
                future.result(timeout=node_timeout + 30)
            took = time.monotonic() - started
            print(f"a frozen agent was a lost node after {took:.1f} s "
                  f"(node_timeout={node_timeout:g} s)")
            assert node_timeout - 1.5 < took <= node_timeout + SLACK
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_a_frozen_agent_is_lost_at_a_short_node_timeout_too(own_agent, token_file):
    address, proc = own_agent(FROZEN_HOST)
    backend = px.ClusterBackend([address], token_file=token_file, node_timeout=2)
    with px.WorkerGroup(Probe, backend=backend, echo_output=False) as group:
        future = group.call_async("sleep", 60)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(px.MembershipChanged, match=r"node_timeout=2 s"):
                future.result(timeout=20)
            assert time.monotonic() - started <= 2 + SLACK
        finally:
            os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_frozen_agent_inside_a_tree_is_lost_by_its_parent_within_its_node_timeout(
        own_agent, token_file):
    # tree_threshold=2, fanout=2: the controller reaches node 0 and node 2; node 0 holds
    # node 1's connection, and judges its silence by its own --node-timeout
    started_agents = [own_agent(f"127.0.0.{i}", "--node-timeout", "2") for i in (11, 12, 13)]
    backend = px.ClusterBackend([a for a, _ in started_agents], token_file=token_file,
                                tree_threshold=2, fanout=2)
    with px.WorkerGroup(Probe, backend=backend, nodes=3, echo_output=False) as group:
        assert group._backend.connection_count() == 2
        future = group.call_async("sleep", 6)  # then nodes 0 and 2 take the next call
        child = started_agents[1][1]
        os.kill(child.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(px.MembershipChanged, match=r"removed node 1 .*silent for "
                                                           r"\d+ s \(node_timeout=2 s"):
                future.result(timeout=20)
            assert time.monotonic() - started <= 2 + SLACK
            assert group.call("rank", workers=[0, 2], timeout=20) == [0, 2]
        finally:
            os.kill(child.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_a_controller_that_falls_behind_does_not_take_its_agents_for_silent_ones(
        own_agent, token_file):
    address, _ = own_agent("127.0.0.12")
    backend = px.ClusterBackend([address], token_file=token_file, node_timeout=2)
    changes: list = []
    with px.WorkerGroup(Probe, backend=backend, echo_output=False) as group:
        group.on_membership_change(changes.append)
        blocked = threading.Event()

        def block(future) -> None:  # on the thread that pumps: nothing is read meanwhile
            blocked.set()
            time.sleep(4)  # twice node_timeout

        group.call_async("rank").add_done_callback(block)
        assert blocked.wait(10)
        time.sleep(4.5)  # the agent's signs of life waited unread, past node_timeout
        assert group.call("rank", timeout=10) == [0]
        assert changes == [], changes


# --------------------------------------------------------------------------- a hung rank


@pytest.mark.timeout(60)
def test_a_hung_rank_on_a_live_node_is_judged_by_heartbeat_timeout_not_as_a_lost_node(
        own_agent, token_file):
    address, _ = own_agent("127.0.0.12")
    heartbeat = 5.0  # the ranks' limit; the node's is shorter, and must not trip
    backend = px.ClusterBackend([address], token_file=token_file, node_timeout=2)
    changes: list = []
    with px.WorkerGroup(Probe, backend=backend, procs_per_node=2, echo_output=False,
                        heartbeat_timeout=heartbeat) as group:
        group.on_membership_change(changes.append)
        group.send_signal(signal.SIGSTOP, workers=[1])  # hung: not even its heartbeats
        started = time.monotonic()
        with pytest.raises(WorkerUnresponsive) as info:
            group.call("rank")
        took = time.monotonic() - started
        assert not isinstance(info.value, px.MembershipChanged)
        assert info.value.rank == 1
        assert heartbeat - 1.0 < took < heartbeat + 10, took
        assert changes == [], changes
        # the node is still the group's: its other rank answers
        assert group.call("rank", workers=[0]) == [0]


# --------------------------------------------------------------------------- keepalive


def test_every_control_connection_has_tcp_keepalive(tmp_path):
    token = b"k" * 32
    agent = Agent("127.0.0.1", 0, token, store=str(tmp_path / "store"))
    serving = threading.Thread(target=agent.serve_forever, daemon=True)
    serving.start()
    joined = None
    try:
        host, port = agent.address
        # the controller's side (and a branch agent's to its children: the same dialer)
        joined = agenttree.connect_agent(host, port, handshake.stretch(token), None, 5.0)
        # the agent's side of it
        assert helpers.wait_until(lambda: len(agent._sessions) == 1, 5)
        (session,) = agent._sessions
        accepted = session._conn.stream.sock
        for sock in (joined.sock, accepted):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15000
    finally:
        if joined is not None:
            joined.close()
        agent.stop()
        serving.join(5)


def test_the_launchers_keepalive_is_the_same_helper():
    assert jobhost.tune_link is streams.tune_link


# --------------------------------------------------------------------------- the pulse


class _Busy:
    """A session whose relay never runs: only the pulse can speak for it."""

    def __init__(self, interval: float) -> None:
        self.ping_interval = interval
        self.pings: list[float] = []

    def ping(self) -> None:
        self.pings.append(time.monotonic())


def test_the_sign_of_life_comes_from_a_thread_of_its_own():
    pulse = agentranks.Pulse()
    sessions = [_Busy(0.1), _Busy(0.25)]
    for session in sessions:
        pulse.add(session)  # type: ignore[arg-type]
    time.sleep(1.0)
    for session in sessions:
        pulse.remove(session)  # type: ignore[arg-type]
    fast, slow = (len(s.pings) for s in sessions)
    assert 6 <= fast <= 12 and 3 <= slow <= 6, (fast, slow)
    gaps = [b - a for a, b in zip(sessions[0].pings, sessions[0].pings[1:], strict=False)]
    assert max(gaps) < 0.3, gaps
    assert helpers.wait_until(lambda: pulse._thread is None, 3), "the pulse outlived its sessions"


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("value", [1, 1.9, 0, -5, True, "15", float("inf"), float("nan")])
def test_node_timeout_is_checked_like_heartbeat_timeout(token_file, value):
    with pytest.raises(ValueError, match="node_timeout must be at least 2 seconds"):
        px.ClusterBackend(["127.0.0.1:1"], token_file=token_file, node_timeout=value)


def test_a_copy_of_the_backend_keeps_its_node_timeout(token_file):
    backend = px.ClusterBackend(["127.0.0.1:1"], token_file=token_file, node_timeout=7.5)
    assert backend.settings()["node_timeout"] == 7.5
    assert type(backend)(**backend.settings()).node_timeout == 7.5
