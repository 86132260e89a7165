"""``ClusterBackend(dns=NAME, port=P)``: the agents behind one DNS name, as a Kubernetes
headless Service lists its pods. A real DNS server (dnslib) on a loopback port answers the
name with the A records the test sets; agents run on 127.0.0.5-7, all on one port."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

import phalanx as px
from tests import helpers
from tests.agentcluster import listening, start_agent, terminate
from tests.workers import Probe

dnslib = pytest.importorskip("dnslib", reason="the DNS tests need dnslib (pip install "
                                              "'phalanx[test]')")
from dnslib.server import DNSServer  # noqa: E402

NAME = "agents.ml.svc.cluster.local"
RUN = [sys.executable, "-m", "phalanx", "run"]
HOSTS = ("127.0.0.5", "127.0.0.6", "127.0.0.7")


class Records:
    """A DNS resolver for dnslib's server: ``addresses[name]`` are the name's A records."""

    def __init__(self) -> None:
        self.addresses: dict[str, list[str]] = {}

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        if name not in self.addresses:
            reply.header.rcode = dnslib.RCODE.NXDOMAIN
            return reply
        if request.q.qtype == dnslib.QTYPE.A:
            for address in self.addresses[name]:
                reply.add_answer(dnslib.RR(name, dnslib.QTYPE.A, rdata=dnslib.A(address),
                                           ttl=1))
        return reply


@pytest.fixture
def dns():
    """A DNS server on 127.0.0.1: ``(records, "127.0.0.1:port")``."""
    records = Records()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = DNSServer(records, port=port, address="127.0.0.1")
    server.start_thread()
    try:
        yield records, f"127.0.0.1:{port}"
    finally:
        server.stop()


def common_port() -> int:
    """A port free on every test host (agents behind one name share their port)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((HOSTS[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in HOSTS[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every test host")


@pytest.fixture
def agents(tmp_path):
    """Agents on ``hosts`` at one port: ``start(*hosts) -> port``; stopped at the end."""
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32)
    token_file.chmod(0o600)
    procs: list[subprocess.Popen] = []
    port = common_port()

    def start(*hosts: str) -> int:
        for host in hosts:
            procs.append(start_agent(host, port, str(token_file),
                                     store=str(tmp_path / "store")))
        for host in hosts:
            assert helpers.wait_until(lambda host=host: listening(host, port), 20, 0.05)
        return port

    start.token_file = str(token_file)  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        terminate(procs)


def test_the_agents_behind_a_name_form_the_group(dns, agents):
    records, server = dns
    port = agents(*HOSTS[:2])
    records.addresses[NAME] = list(HOSTS[:2])
    backend = px.ClusterBackend(dns=NAME, port=port, nameserver=server,
                                token_file=agents.token_file)
    with px.WorkerGroup(Probe, nodes=2, procs_per_node=2, backend=backend,
                        echo_output=False) as group:
        assert group.call("rank") == [0, 1, 2, 3]
        envs = group.call("env", "NODE_RANK", "MASTER_ADDR")
        assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1"]
        assert {e["MASTER_ADDR"] for e in envs} == {HOSTS[0]}


def test_quorum_counts_the_agents_that_resolve_and_answer(dns, agents):
    records, server = dns
    port = agents(*HOSTS[:2])  # the third name's address has no agent
    records.addresses[NAME] = list(HOSTS)
    backend = px.ClusterBackend(dns=NAME, port=port, nameserver=server, quorum=2,
                                token_file=agents.token_file, quorum_timeout=20)
    with px.WorkerGroup(Probe, nodes=2, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0, 1]


@pytest.mark.parametrize("listed", [[], ["127.0.0.5"]], ids=["no-record", "one-record"])
def test_too_few_addresses_time_the_quorum_out_naming_the_name(dns, agents, listed):
    records, server = dns
    port = agents(HOSTS[0])
    if listed:
        records.addresses[NAME] = listed
    backend = px.ClusterBackend(dns=NAME, port=port, nameserver=server, quorum=2,
                                token_file=agents.token_file, quorum_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(px.QuorumTimeout) as info:
        px.WorkerGroup(Probe, backend=backend, echo_output=False)
    assert time.monotonic() - started < 5
    assert f"{NAME} (DNS)" in str(info.value)
    assert f"{len(listed)} address(es)" in str(info.value)


def test_an_agent_appearing_in_dns_during_the_wait_is_taken(dns, agents):
    records, server = dns
    port = agents(*HOSTS[:2])
    records.addresses[NAME] = [HOSTS[0]]
    backend = px.ClusterBackend(dns=NAME, port=port, nameserver=server, quorum=2,
                                token_file=agents.token_file, quorum_timeout=20)

    def publish_later() -> None:
        time.sleep(1.0)
        records.addresses[NAME] = list(HOSTS[:2])

    threading.Thread(target=publish_later, daemon=True).start()
    with px.WorkerGroup(Probe, nodes=2, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0, 1]


def test_dns_or_hosts_but_not_both():
    with pytest.raises(ValueError, match=r"hosts=.* or dns="):
        px.ClusterBackend(["127.0.0.5:1"], dns=NAME, token="t" * 32)
    with pytest.raises(ValueError, match=r"hosts=.* or dns="):
        px.ClusterBackend(token="t" * 32)
    with pytest.raises(ValueError, match="not a DNS name"):
        px.ClusterBackend(dns="", token="t" * 32)


def test_phalanx_run_finds_its_agents_by_dns(dns, agents, tmp_path):
    records, server = dns
    port = agents(*HOSTS[:2])
    records.addresses[NAME] = list(HOSTS[:2])
    (tmp_path / "show.py").write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    done = subprocess.run(
        [*RUN, "--dns", NAME, "--agent-port", str(port), "--nameserver", server,
         "--token-file", agents.token_file, "--no-collapse", "-n", "2", "show.py"],
        cwd=tmp_path, env=helpers.script_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines() if " of 4" in line) == [
        f"[rank {r}] rank {r} of 4" for r in range(4)]


def test_phalanx_run_refuses_hosts_and_dns_together(tmp_path):
    (tmp_path / "show.py").write_text("pass\n")
    done = subprocess.run([*RUN, "--hosts", "127.0.0.5:1", "--dns", NAME, "show.py"],
                          cwd=tmp_path, env={**helpers.script_env(), "PHALANX_TOKEN": "t" * 32},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--hosts and --dns both name the agents: give one" in done.stderr
