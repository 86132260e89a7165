"""Membership changes of ``ClusterBackend(dns=NAME, dns_interval=...)``: while a group lives
the name is resolved again and again; a node gone from DNS, an agent that stops answering
(SIGKILLed) or a new address with an agent answering there is a change. Running calls on
``"all"`` fail with ``px.MembershipChanged`` (``.added``/``.removed``: ``px.NodeInfo``);
``"ready"``/``"any"`` calls carry on; subscribers hear of each change;
``group.resize()`` (or ``group.restart()``) takes the new node set.

A real DNS server (dnslib, the ``dns`` fixture of test_cluster_dns) on a loopback port
answers the name with the A records each test sets; the agents are processes of this test
on 127.0.0.5-7, all on one port."""
# ruff: noqa: F811 - the tests take the imported ``dns`` fixture by name

from __future__ import annotations

import subprocess
import threading
import time

import psutil
import pytest

import phalanx as px
from tests import helpers
from tests.agentcluster import listening, start_agent, terminate
from tests.backends.test_cluster_dns import (  # noqa: F401 - dns: a fixture
    HOSTS,
    NAME,
    common_port,
    dns,
)
from tests.workers import Probe

INTERVAL = 0.5  # dns_interval of every backend here
PROMPT = 8 * INTERVAL  # "within a few dns_interval": how soon a change must fail a call
EVENT_WAIT = 10.0  # the longest a subscriber may wait to hear of a change


class Agents:
    """This test's agents, one per loopback address, all on ``port``."""

    def __init__(self, port: int, token_file: str, store: str) -> None:
        self.port, self.token_file, self.store = port, token_file, store
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, *hosts: str) -> None:
        for host in hosts:
            self.procs[host] = start_agent(host, self.port, self.token_file, store=self.store)
        for host in hosts:
            assert helpers.wait_until(lambda host=host: listening(host, self.port), 20, 0.05), \
                f"the agent on {host}:{self.port} did not start"

    def address(self, host: str) -> str:
        return f"{host}:{self.port}"

    def descendants(self, host: str) -> list[int]:
        """What the agent on ``host`` runs now (its ranks and what they started)."""
        try:
            return [p.pid for p in psutil.Process(self.procs[host].pid).children(recursive=True)]
        except psutil.Error:
            return []

    def host_of(self, pid: int) -> str:
        """The address of the agent ``pid`` runs under."""
        for host in self.procs:
            if pid in self.descendants(host):
                return host
        raise AssertionError(f"pid {pid} runs under none of the agents {list(self.procs)}")

    def placement(self, group: px.WorkerGroup) -> dict[str, tuple[int, tuple[int, ...]]]:
        """``{host: (node index, ranks)}`` of the group's live ranks, seen from the agents'
        process trees (not from what the group says)."""
        found: dict[str, tuple[int, list[int]]] = {}
        for health in group.health():
            if not health.alive or health.pid is None:
                continue
            host = self.host_of(health.pid)
            node, ranks = found.setdefault(host, (health.node, []))
            assert node == health.node, f"{host} holds ranks of nodes {node} and {health.node}"
            ranks.append(health.rank)
        return {host: (node, tuple(sorted(ranks))) for host, (node, ranks) in found.items()}

    def backend(self, nameserver: str, **kwargs) -> px.ClusterBackend:
        kwargs.setdefault("quorum", 2)
        return px.ClusterBackend(dns=NAME, port=self.port, nameserver=nameserver,
                                 token_file=self.token_file, quorum_timeout=20,
                                 dns_interval=INTERVAL, **kwargs)


@pytest.fixture
def cluster(tmp_path):
    """Start agents with ``cluster.start(*hosts)``; every one is stopped when the test ends
    (SIGTERM, then SIGKILL), with whatever it still runs."""
    token_file = tmp_path / "token"
    token_file.write_text("m" * 32)
    token_file.chmod(0o600)
    agents = Agents(common_port(), str(token_file), str(tmp_path / "store"))
    try:
        yield agents
    finally:
        terminate(list(agents.procs.values()))


class Events:
    """A ``group.on_membership_change`` subscriber: the events, and the threads they came on."""

    def __init__(self) -> None:
        self.events: list = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __call__(self, event) -> None:
        with self._lock:
            self.events.append(event)
            self.threads.append(threading.current_thread())

    def added(self) -> list[px.NodeInfo]:
        with self._lock:
            return [info for event in self.events for info in event.added]

    def removed(self) -> list[px.NodeInfo]:
        with self._lock:
            return [info for event in self.events for info in event.removed]

    def wait_added(self, host: str, timeout: float = EVENT_WAIT) -> bool:
        return helpers.wait_until(lambda: any(i.host == host for i in self.added()), timeout)

    def wait_removed(self, host: str, timeout: float = EVENT_WAIT) -> bool:
        return helpers.wait_until(lambda: any(i.host == host for i in self.removed()), timeout)


def group_on(backend: px.ClusterBackend, **kwargs) -> px.WorkerGroup:
    kwargs.setdefault("nodes", 2)
    return px.WorkerGroup(Probe, backend=backend, echo_output=False, **kwargs)


# --------------------------------------------------------------------------- removal


def test_a_node_gone_from_dns_fails_the_running_call_naming_it(dns, cluster):
    records, server = dns
    cluster.start(*HOSTS[:2])
    records.addresses[NAME] = list(HOSTS[:2])
    with group_on(cluster.backend(server), procs_per_node=2) as group:
        assert group.call("rank") == [0, 1, 2, 3]
        where = cluster.placement(group)
        assert sorted(where.values()) == [(0, (0, 1)), (1, (2, 3))]
        gone = next(host for host, (node, _) in where.items() if node == 1)
        kept = next(host for host in HOSTS[:2] if host != gone)
        future = group.call_async("sleep", 2.5, value="never")  # the kept ranks finish it
        time.sleep(0.3)
        records.addresses[NAME] = [kept]
        dropped = time.monotonic()
        with pytest.raises(px.MembershipChanged) as info:
            future.result(timeout=PROMPT + 5)
        assert time.monotonic() - dropped < PROMPT, "the removal was noticed late"
        assert isinstance(info.value, px.PhalanxError)
        assert info.value.added == []
        assert info.value.removed == [px.NodeInfo(1, cluster.address(gone), (2, 3))]
        # the removed node's ranks are stopped, and never called again
        assert helpers.wait_until(lambda: not cluster.descendants(gone), 10, 0.05), \
            f"the removed agent still runs {cluster.descendants(gone)}"
        assert group.call("rank", workers="ready", timeout=10) == [0, 1]
        assert {cluster.host_of(pid) for pid in group.call("pid", workers="ready",
                                                           timeout=10)} == {kept}


def test_an_agent_sigkilled_is_a_removal_naming_it(dns, cluster):
    records, server = dns
    cluster.start(*HOSTS[:2])
    records.addresses[NAME] = list(HOSTS[:2])  # it stays listed: only its agent is gone
    with group_on(cluster.backend(server)) as group:
        where = cluster.placement(group)
        killed = next(host for host, (node, _) in where.items() if node == 1)
        lost = cluster.descendants(killed)
        future = group.call_async("sleep", 2.5, value="never")  # the kept ranks finish it
        time.sleep(0.3)
        cluster.procs[killed].kill()
        killed_at = time.monotonic()
        with pytest.raises(px.MembershipChanged) as info:
            future.result(timeout=PROMPT + 5)
        assert time.monotonic() - killed_at < PROMPT
        assert info.value.removed == [px.NodeInfo(1, cluster.address(killed), (1,))]
        assert info.value.added == []
        assert helpers.wait_dead(lost, 5), "ranks outlived their SIGKILLed agent"
        assert group.call("rank", workers="ready", timeout=10) == [0]


# --------------------------------------------------------------------------- addition


def test_an_added_node_is_told_to_subscribers_and_spares_ready_calls(dns, cluster):
    records, server = dns
    cluster.start(*HOSTS)
    records.addresses[NAME] = list(HOSTS[:2])
    with group_on(cluster.backend(server), concurrency=2) as group:
        events = Events()
        group.on_membership_change(events)
        ready = group.call_async("sleep", 4, value="slept", workers="ready")
        everyone = group.call_async("sleep", 4, value="slept")
        time.sleep(0.3)
        records.addresses[NAME] = list(HOSTS)
        added = time.monotonic()
        new = cluster.address(HOSTS[2])
        assert events.wait_added(new), f"no subscriber heard of {new}: {events.events}"
        assert time.monotonic() - added < PROMPT, "the addition was noticed late"
        assert not ready.done(), "the change came after the call; the test proves nothing"
        with pytest.raises(px.MembershipChanged) as info:
            everyone.result(timeout=10)
        assert info.value.added == [px.NodeInfo(None, new, ())]
        assert info.value.removed == []
        assert ready.result(timeout=10) == ["slept", "slept"]
        assert events.added() == [px.NodeInfo(None, new, ())]
        assert events.removed() == []
        assert all(t is not threading.main_thread() for t in events.threads)
        assert group.world_size == 2  # not admitted until resize()
        assert not cluster.descendants(HOSTS[2])


# --------------------------------------------------------------------------- resize


def test_resize_admits_an_added_node_and_drops_a_removed_one(dns, cluster):
    records, server = dns
    cluster.start(*HOSTS)
    records.addresses[NAME] = list(HOSTS[:2])
    with group_on(cluster.backend(server)) as group:
        events = Events()
        group.on_membership_change(events)
        assert group.call("rank") == [0, 1]
        records.addresses[NAME] = list(HOSTS)
        assert events.wait_added(cluster.address(HOSTS[2])), events.events

        assert group.resize(timeout=30) == 3
        assert (group.world_size, group.nodes) == (3, 3)
        assert group.call("rank", timeout=10) == [0, 1, 2]
        envs = group.call("env", "WORLD_SIZE", "NODE_RANK", timeout=10)
        assert [e["WORLD_SIZE"] for e in envs] == ["3", "3", "3"]
        assert sorted(e["NODE_RANK"] for e in envs) == ["0", "1", "2"]
        where = cluster.placement(group)
        assert set(where) == set(HOSTS), "a rank runs on the new node"
        assert sorted(where.values()) == [(0, (0,)), (1, (1,)), (2, (2,))]

        gone = HOSTS[1]
        records.addresses[NAME] = [HOSTS[0], HOSTS[2]]
        assert events.wait_removed(cluster.address(gone)), events.events
        assert [i.host for i in events.removed()] == [cluster.address(gone)]
        assert events.removed()[0].node == where[gone][0]
        assert events.removed()[0].ranks == where[gone][1]

        assert group.resize(timeout=30) == 2
        assert (group.world_size, group.nodes) == (2, 2)
        assert group.call("rank", timeout=10) == [0, 1]
        assert set(cluster.placement(group)) == {HOSTS[0], HOSTS[2]}
        assert helpers.wait_until(lambda: not cluster.descendants(gone), 10, 0.05)


def test_restart_after_a_removal_runs_on_the_nodes_left(dns, cluster):
    records, server = dns
    cluster.start(*HOSTS[:2])
    records.addresses[NAME] = list(HOSTS[:2])
    with group_on(cluster.backend(server)) as group:
        where = cluster.placement(group)
        gone = next(host for host, (node, _) in where.items() if node == 1)
        kept = next(host for host in HOSTS[:2] if host != gone)
        records.addresses[NAME] = [kept]
        # the removal was acted on once the removed node's ranks are stopped
        assert helpers.wait_until(lambda: not cluster.descendants(gone), PROMPT + 5, 0.05)
        group.restart()
        assert (group.world_size, group.nodes) == (1, 1)
        assert group.call("rank", timeout=10) == [0]
        assert set(cluster.placement(group)) == {kept}


def test_a_node_admitted_by_resize_runs_the_same_code_as_the_others(dns, cluster, tmp_path):
    records, server = dns
    code = tmp_path / "code"
    code.mkdir()
    (code / "shipped_here.py").write_text("WHERE = 'at the start'\n")
    cluster.start(*HOSTS[:2])
    late = start_agent(HOSTS[2], cluster.port, cluster.token_file,  # a store of its own
                       store=str(tmp_path / "late-store"))
    cluster.procs[HOSTS[2]] = late
    assert helpers.wait_until(lambda: listening(HOSTS[2], cluster.port), 20, 0.05)
    records.addresses[NAME] = list(HOSTS[:2])
    with group_on(cluster.backend(server, sync=str(code))) as group:
        first = {h.code_version for h in group.health()}
        events = Events()
        group.on_membership_change(events)
        records.addresses[NAME] = list(HOSTS)
        assert events.wait_added(cluster.address(HOSTS[2])), events.events
        (code / "shipped_here.py").write_text("WHERE = 'changed since'\n")
        assert group.resize(timeout=30) == 3
        # every rank restarted: all run the code as it is now, the new node included
        versions = {h.code_version for h in group.health()}
        assert len(versions) == 1 and None not in versions and versions != first
        cwds = group.call("cwd", timeout=10)
        assert len(set(cwds)) == 2  # one store for the first two agents, one for the new
        for cwd in cwds:
            with open(f"{cwd}/shipped_here.py") as f:
                assert f.read() == "WHERE = 'changed since'\n"
