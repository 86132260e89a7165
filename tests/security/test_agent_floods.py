"""``phalanx agent`` under floods of connections that never authenticate, and when it runs
out of descriptors or threads: the cap on connections before authentication holds, the
accept loop never dies, ``/health`` says why while the control port cannot accept, and a
real controller starts a group soon once the flood is over: within 2 s, or three times
what a start took on the same agent before the flood where the machine is loaded.

Everything is on loopback. Real agents run on 127.0.0.5-7 (stopped when the test ends);
the flood comes from other loopback addresses (127.0.1.x), so that the controller's own
address (127.0.0.1) is not the flood's. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import phalanx as px
from phalanx.backends.cluster.agent.daemon import Admission, Agent, unauthenticated_limit
from phalanx.backends.cluster.agent.http import AgentMetrics
from phalanx.wire import handshake
from tests import helpers
from tests.agentcluster import free_port, terminate
from tests.workers import Probe

BURST = 200  # silent connections
NOFILE = 128  # the agent's descriptor limit: without a cap, the burst alone would exhaust it
RECOVERY = 2.0  # seconds for a group to start once the burst is over, on an idle machine
SLOWER = 3.0  # ... or this many times the same start before the flood, on a loaded one
FLOOD_SOURCES = [f"127.0.1.{i}" for i in range(1, 11)]  # 20 connections from each


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = helpers.token_file(tmp_path_factory.mktemp("floods"))
    # the controller stretches a token once per process (scrypt, ~0.1 s, more on a loaded
    # machine): paid here, so that the timed starts measure the agent, not that
    handshake.stretch(open(path, "rb").read().strip())
    return path


def _lowered_nofile() -> None:  # runs in the agent's process, before it execs
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture
def agent(token_file):
    """``agent(host, *flags)``: a ``phalanx agent`` with NOFILE descriptors at most and an
    HTTP port; (control port, http port) returned."""
    procs: list[subprocess.Popen] = []

    def start(host: str, *flags: str) -> tuple[int, int]:
        port, http_port = free_port(host), free_port(host)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
             "--http-port", str(http_port), "--token-file", token_file,
             "--heartbeat-timeout", "10", *flags],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL, preexec_fn=_lowered_nofile)
        procs.append(proc)
        assert helpers.wait_until(
            lambda: proc.poll() is not None or health(host, http_port)[0] == 200, 20,
            interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        return port, http_port

    try:
        yield start
    finally:
        terminate(procs)


def health(host: str, http_port: int) -> tuple[int | None, dict]:
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/health", timeout=2) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return None, {}


def metrics(host: str, http_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{host}:{http_port}/metrics", timeout=2) as reply:
        lines = reply.read().decode().splitlines()
    return {name.removeprefix("phalanx_agent_"): float(value)
            for name, _, value in (line.partition(" ") for line in lines)
            if name.startswith("phalanx_agent_")}


def burst(host: str, port: int, count: int = BURST) -> list[socket.socket]:
    """``count`` connections that say nothing, from the flood's addresses in turn."""
    socks = []
    for i in range(count):
        sock = socket.socket()
        sock.bind((FLOOD_SOURCES[i % len(FLOOD_SOURCES)], 0))
        sock.settimeout(5)
        sock.connect((host, port))
        socks.append(sock)
    return socks


def closed_by_peer(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """Those of ``socks`` the agent closed within ``within`` seconds (EOF or reset)."""
    closed: list[socket.socket] = []
    open_ = list(socks)
    deadline = time.monotonic() + within
    while open_ and (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(open_, [], [], remaining)
        for sock in ready:
            try:
                data = sock.recv(1024)
            except OSError:
                data = b""
            if not data:
                closed.append(sock)
                open_.remove(sock)
    return closed


def start_group_on(host: str, port: int, token_file: str) -> float:
    """Seconds for a real controller to start a group of two ranks there and call it."""
    started = time.monotonic()
    backend = px.ClusterBackend([f"{host}:{port}"], token_file=token_file, quorum_timeout=10)
    with px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0, 1]
        return time.monotonic() - started


def recovered(took: float, quiet: float) -> bool:
    """Whether a start after a flood took no longer than it should: RECOVERY, or SLOWER times
    the start on the same agent before the flood when the machine is loaded (other suites on
    a shared CI machine stretch both alike). What this guards against, an agent still held
    by the flood's connections, waits out their 30 s handshake deadline: far above either."""
    return took < max(RECOVERY, SLOWER * quiet)


def test_a_burst_of_silent_connections_is_capped_and_a_group_starts_after_it(
        agent, token_file):
    host = "127.0.0.5"
    port, http_port = agent(host, "--handshake-timeout", "30")
    quiet = start_group_on(host, port, token_file)
    cap = unauthenticated_limit(NOFILE)
    socks = burst(host, port)
    try:
        # Beyond the cap (and each address's share of it) the agent closes at once.
        refused = closed_by_peer(socks, within=2.0)
        assert len(refused) >= BURST - cap, (len(refused), cap)
        assert helpers.wait_until(
            lambda: metrics(host, http_port)["handshakes_evicted_total"] >= BURST - cap, 5)
        # It still answers its probes, and is not out of descriptors: it is healthy.
        assert health(host, http_port) == (200, {"status": "ok"})
    finally:
        for sock in socks:
            sock.close()
    ended = time.monotonic()
    took = start_group_on(host, port, token_file)
    print(f"\nafter a burst of {BURST} silent connections (cap {cap}), a group started and "
          f"answered in {took:.3f} s ({time.monotonic() - ended:.3f} s after the burst; "
          f"{quiet:.3f} s before it)")
    assert recovered(took, quiet), (took, quiet)


def test_silent_connections_are_closed_at_the_handshake_deadline(agent, token_file):
    host = "127.0.0.6"
    port, _ = agent(host, "--handshake-timeout", "1")
    quiet = start_group_on(host, port, token_file)
    socks = burst(host, port, count=8)
    try:
        started = time.monotonic()
        closed = closed_by_peer(socks, within=5.0)
        took = time.monotonic() - started
        assert len(closed) == len(socks) and took < 3.0, (len(closed), took)
    finally:
        for sock in socks:
            sock.close()
    assert recovered(start_group_on(host, port, token_file), quiet)


def test_one_address_cannot_take_the_whole_cap(agent, token_file):
    """A flood from one address fills only its share: a controller from another still gets
    through while the flood holds."""
    host = "127.0.0.7"
    port, _ = agent(host, "--handshake-timeout", "30")
    quiet = start_group_on(host, port, token_file)
    socks = []
    try:
        for _ in range(BURST // 2):
            sock = socket.socket()
            sock.bind(("127.0.1.200", 0))
            sock.settimeout(5)
            sock.connect((host, port))
            socks.append(sock)
        assert len(closed_by_peer(socks, within=2.0)) >= BURST // 2 - 16
        assert recovered(start_group_on(host, port, token_file), quiet)
    finally:
        for sock in socks:
            sock.close()


# --------------------------------------------------------------------------- accept errors


OUT_OF_DESCRIPTORS = """
import json, logging, os, sys, threading, time
from phalanx.backends.cluster.agent.daemon import Agent
from phalanx.backends.cluster.agent.http import health_response
logging.basicConfig(level=logging.WARNING, format="%(message)s")
host, token = sys.argv[1], sys.argv[2].encode()
agent = Agent(host, 0, token, handshake_timeout=10)
loop = threading.Thread(target=agent.serve_forever, daemon=True)
loop.start()
print(agent.address[1], flush=True)
sys.stdin.readline()                   # fill every descriptor
# The group the test started has ended, but the agent closes its sessions' sockets and the
# ranks' pipes on its own threads: wait for that, then fill again until a pause frees none,
# so no descriptor freed late lets the accept below succeed.
settle = time.monotonic() + 10
while agent.health()["controllers"] and time.monotonic() < settle:
    time.sleep(0.02)
held = []
def fill():
    before = len(held)
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    return len(held) - before
fill()
while time.monotonic() < settle:
    time.sleep(0.3)
    if not fill():
        break
print(len(held), flush=True)
sys.stdin.readline()                   # a client connected: the agent cannot take it
deadline = time.monotonic() + 10
while agent.health()["ok"] and time.monotonic() < deadline:
    time.sleep(0.02)
status, body = health_response(agent.health)
time.sleep(1.5)                        # retrying meanwhile, the loop must stay alive
alive = loop.is_alive()
for fd in held:
    os.close(fd)
started = time.monotonic()
while not agent.health()["ok"] and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"status": status, "body": body, "alive": alive, "after": agent.health(),
                  "recovered_in": time.monotonic() - started}), flush=True)
sys.stdin.readline()                   # until the test is done with it
agent.stop()
"""


def test_out_of_descriptors_the_accept_loop_backs_off_reports_503_and_recovers(token_file):
    host = "127.0.0.6"
    token = open(token_file).read().strip()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS, host, token],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=helpers.REPO,
                            preexec_fn=_lowered_nofile)
    client = None
    try:
        port = int(proc.stdout.readline())
        quiet = start_group_on(host, port, token_file)
        proc.stdin.write("fill\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) > 0
        # with no descriptor left, accept() fails at once (the accept already waiting when
        # the table filled may still take this one, with the descriptor it holds)
        client = socket.create_connection((host, port), timeout=5)
        proc.stdin.write("connected\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        assert report["status"] == 503, report
        assert report["body"]["status"] == "unhealthy"
        assert "cannot accept" in report["body"]["reason"], report
        assert "Too many open files" in report["body"]["reason"], report
        assert report["alive"], "the accept loop ended"
        assert report["after"]["ok"], report
        assert report["recovered_in"] < RECOVERY, report
        # Descriptors back, a real controller starts a group there.
        took = start_group_on(host, port, token_file)
        print(f"\nout of descriptors: accepting again {report['recovered_in']:.3f} s after "
              f"they were freed; a group then started in {took:.3f} s ({quiet:.3f} s before)")
        assert recovered(took, quiet), (took, quiet)
    finally:
        if client is not None:
            client.close()
        try:
            _, stderr = proc.communicate("done\n", timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    # said once for the whole spell, not once per retry
    assert stderr.count("cannot take a connection") == 1, stderr
    assert stderr.count("can take connections again") == 1, stderr


def test_a_thread_that_cannot_start_is_retried_and_the_loop_lives(token_file, monkeypatch):
    token = open(token_file).read().strip().encode()
    metrics = AgentMetrics()
    agent = Agent("127.0.0.7", 0, token, handshake_timeout=5, metrics=metrics)
    loop = threading.Thread(target=agent.serve_forever, daemon=True)
    loop.start()
    host, port = agent.address
    real_start = threading.Thread.start
    failing = threading.Event()
    failing.set()

    def start(self):
        if failing.is_set() and self.name == "phalanx-agent-conn":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    quiet = start_group_on(host, port, token_file)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        with socket.create_connection((host, port), timeout=5) as stranger:
            assert helpers.wait_until(lambda: not agent.health()["ok"], 5)
            report = agent.health()
            assert "no thread could start" in report["reason"], report
            assert closed_by_peer([stranger], within=2.0) == [stranger]
        time.sleep(0.3)
        assert loop.is_alive()
        failing.clear()
        assert metrics.value("accept_errors_total") >= 1
        took = start_group_on(host, port, token_file)
        assert recovered(took, quiet) and agent.health()["ok"], (took, quiet)
    finally:
        agent.stop()
        loop.join(5)


# --------------------------------------------------------------------------- the parts


def test_admission_takes_the_newest_and_shuts_the_oldest_of_the_heaviest_address():
    admission = Admission(limit=3, per_peer=2, timeout=30)
    pairs = [socket.socketpair() for _ in range(6)]
    ours = [a for a, _ in pairs]
    try:
        assert admission.admit(ours[0], "10.0.0.1") is None
        assert admission.admit(ours[1], "10.0.0.1") is None
        # the address at its share: its oldest makes room for its newest
        assert "from 10.0.0.1" in admission.admit(ours[2], "10.0.0.1")
        assert closed_by_peer([pairs[0][1]], within=1.0) == [pairs[0][1]]
        assert admission.admit(ours[3], "10.0.0.2") is None
        # full: the address holding the most gives up its oldest, the newcomer is taken
        assert "from 10.0.0.1" in admission.admit(ours[4], "10.0.0.3")
        assert closed_by_peer([pairs[1][1]], within=1.0) == [pairs[1][1]]
        assert [admission.held_by(p) for p in ("10.0.0.1", "10.0.0.2", "10.0.0.3")] == [1, 1, 1]
        admission.release(ours[0])  # evicted: no longer held, releasing it changes nothing
        admission.release(ours[3])
        admission.release(ours[3])  # twice is once
        assert len(admission) == 2 and admission.evicted == 2
        assert admission.admit(ours[5], "10.0.0.4") is None
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_strangers_holding_every_slot_do_not_lock_a_controller_out(agent, token_file):
    """Strangers from four addresses hold every slot of the agent's handshakes, opening a
    new connection as soon as one is shut; a real controller still starts its group about as
    fast as with no strangers about (within ``recovered``'s bound)."""
    host = "127.0.0.5"
    port, _ = agent(host, "--handshake-timeout", "30")
    quiet = min(start_group_on(host, port, token_file) for _ in range(2))
    cap = unauthenticated_limit(NOFILE)
    stop = threading.Event()
    sources = FLOOD_SOURCES[:4]

    def hold(source: str) -> None:  # as many as it may, re-opened once shut
        socks: list[socket.socket] = []
        try:
            while not stop.is_set():
                while len(socks) < cap // len(sources) + 4 and not stop.is_set():
                    sock = socket.socket()
                    sock.bind((source, 0))
                    sock.settimeout(2)
                    try:
                        sock.connect((host, port))
                    except OSError:
                        sock.close()
                        break
                    socks.append(sock)
                for sock in closed_by_peer(socks, within=0.05):
                    socks.remove(sock)
                    sock.close()
        finally:
            for sock in socks:
                sock.close()

    threads = [threading.Thread(target=hold, args=(s,), daemon=True) for s in sources]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # every slot held
        attacked = [start_group_on(host, port, token_file) for _ in range(2)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    print(f"\na group started in {quiet:.3f} s with no strangers, in "
          f"{', '.join(f'{t:.3f}' for t in attacked)} s while strangers held all {cap} slots")
    # Locked out, a controller would wait for the strangers' 30 s handshake deadline; the
    # attacked / quiet ratio itself (1.2-1.4 on an idle machine) is bench.trust's to measure:
    # on a loaded CI machine one start of two can take twice the quiet one.
    assert all(recovered(took, quiet) for took in attacked), (quiet, attacked)


def test_the_cap_follows_a_low_descriptor_limit():
    from phalanx import config

    assert unauthenticated_limit(resource.RLIM_INFINITY) == config.AGENT_MAX_UNAUTHENTICATED
    assert unauthenticated_limit(1 << 20) == config.AGENT_MAX_UNAUTHENTICATED
    assert unauthenticated_limit(128) == 32
    assert unauthenticated_limit(8) == 4
