"""The cluster backend's agents in a tree (``ClusterBackend(tree_threshold=, fanout=)``).

Nine agents of this module's own on 127.0.0.11-19 (started once, stopped at the end;
one a test SIGKILLs is started again, on the same address, before the next test). With
``tree_threshold=2, fanout=2`` they form this tree (node i of a group is ``hosts[i]``)::

    controller -> 0 -> 1 -> 2            controller -> 5 -> 6 -> 7
                    -> 3 -> 4                            -> 8

Checked here: that shape (the controller's and each agent's TCP connections), results
identical to flat mode, a payload crossing each node once, a worker's error failing the
call at once across subtrees, and an inner agent SIGKILLed mid-call: MembershipChanged
naming its whole subtree, the survivors still served, no rank of the lost subtree left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

import phalanx as px
from tests import agentcluster, helpers
from tests.agentcluster import free_port, listening, terminate
from tests.workers import MeshProbe

ADDRESSES = tuple(f"127.0.0.{i}" for i in range(11, 20))
TREE = {"tree_threshold": 2, "fanout": 2}
# Who connects to whom (indexes into hosts): the controller, then each agent's children.
HEADS = {0, 5}
CHILDREN = {0: {1, 3}, 1: {2}, 2: set(), 3: {4}, 4: set(),
            5: {6, 8}, 6: {7}, 7: set(), 8: set()}
SUBTREE_OF_0 = [0, 1, 2, 3, 4]
MIB = 1 << 20

pytestmark = pytest.mark.timeout(60)


class NineAgents:
    """The module's agents: ``hosts[i]`` is served by ``procs[i]`` (HTTP on ``http[i]``)."""

    def __init__(self, token_file: str, store: str) -> None:
        self.token_file, self.store = token_file, store
        self.ports = [free_port(host) for host in ADDRESSES]
        self.http = [free_port(host) for host in ADDRESSES]
        self.hosts = [f"{h}:{p}" for h, p in zip(ADDRESSES, self.ports, strict=True)]
        self.procs: list[subprocess.Popen] = [None] * len(ADDRESSES)  # type: ignore[list-item]

    def start(self, i: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(helpers.REPO)}
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", ADDRESSES[i], "--port",
             str(self.ports[i]), "--http-port", str(self.http[i]), "--token-file",
             self.token_file, "--heartbeat-timeout", "10", "--store", self.store],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL)
        helpers.CLUSTER_ROOTS.add(self.procs[i].pid)

    def wait_listening(self, indexes) -> None:
        for i in indexes:
            up = helpers.wait_until(lambda i=i: self.procs[i].poll() is not None or
                                    listening(ADDRESSES[i], self.ports[i]), 30, interval=0.05)
            assert up and self.procs[i].poll() is None, f"the agent on {self.hosts[i]} did " \
                                                        f"not start"

    def revive(self) -> None:
        """Start again, on the same address, any agent a test killed."""
        dead = [i for i, proc in enumerate(self.procs) if proc.poll() is not None]
        for i in dead:
            helpers.CLUSTER_ROOTS.discard(self.procs[i].pid)
            self.start(i)
        self.wait_listening(dead)

    def backend(self, hosts=None, **kwargs) -> px.ClusterBackend:
        return px.ClusterBackend(self.hosts if hosts is None else hosts,
                                 token_file=self.token_file, **kwargs)

    def descendants(self, i: int) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.procs[i].pid).children(recursive=True)]
        except psutil.Error:
            return []

    def metrics(self, i: int) -> dict[str, float]:
        url = f"http://{ADDRESSES[i]}:{self.http[i]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("phalanx_agent_"):
                name, _, value = line.partition(" ")
                values[name.removeprefix("phalanx_agent_")] = float(value)
        return values

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                helpers.CLUSTER_ROOTS.discard(proc.pid)
        terminate([proc for proc in self.procs if proc is not None])


@pytest.fixture(scope="module")
def nine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tree")
    token_file = helpers.token_file(directory)
    agents = NineAgents(str(token_file), str(directory / "store"))
    try:
        for i in range(len(ADDRESSES)):
            agents.start(i)
        agents.wait_listening(range(len(ADDRESSES)))
        yield agents
    finally:
        agents.stop()


@pytest.fixture
def agents(nine):
    """The nine agents, all running; after the test, nothing may be left under them."""
    nine.revive()
    yield nine
    left = agentcluster.leftovers(agentcluster.Agents(
        [p for p in nine.procs if p.poll() is None], nine.hosts, "", nine.token_file))
    assert not left, f"left under the agents: {left}"


def group_on(backend, target=MeshProbe, **kwargs) -> px.WorkerGroup:
    kwargs.setdefault("echo_output", False)
    return px.WorkerGroup(target, backend=backend, **kwargs)


def connections(group: px.WorkerGroup) -> int:
    """The controller's agent connections for ``group`` (``connection_count()`` of the
    group's own backend: a group runs on a copy of the ``ClusterBackend`` it was given)."""
    return group._backend.connection_count()


def tcp_peers(pid: int, among: list[str]) -> set[int]:
    """Which of ``among`` (``host:port``) the process ``pid`` itself holds a connection to."""
    where = {address: i for i, address in enumerate(among)}
    return {where[f"{c.raddr.ip}:{c.raddr.port}"]
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.raddr
            and f"{c.raddr.ip}:{c.raddr.port}" in where}


# --------------------------------------------------------------------------- the shape


def test_the_controller_holds_fanout_connections_and_the_agents_form_the_tree(agents):
    with group_on(agents.backend(**TREE), nodes=9) as group:
        assert connections(group) == 2
        assert tcp_peers(psutil.Process().pid, agents.hosts) == HEADS
        for i, proc in enumerate(agents.procs):
            assert tcp_peers(proc.pid, agents.hosts) == CHILDREN[i], \
                f"{agents.hosts[i]} connects to the wrong agents"
        # Node i is hosts[i]: its rank runs under that agent.
        pids = group.call("pid")
        for i, pid in enumerate(pids):
            assert pid in agents.descendants(i), f"rank {i} does not run under {agents.hosts[i]}"
        assert [h.node for h in group.health()] == list(range(9))
        assert group.call("env", "MASTER_ADDR") == [{"MASTER_ADDR": ADDRESSES[0]}] * 9


def test_below_the_threshold_the_controller_connects_to_every_agent(agents):
    with group_on(agents.backend(tree_threshold=10, fanout=2), nodes=9) as group:
        assert group.call("rank") == list(range(9))
        assert connections(group) == 9
        assert tcp_peers(psutil.Process().pid, agents.hosts) == set(range(9))


# --------------------------------------------------------------------------- results


def run_calls(group) -> list:
    """A session of calls whose results the tree must give exactly as flat mode does."""
    results = [
        group.call("rank"),
        group.call("env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR"),
        group.call("echo", 1, "two", three=[3, {"four": 4}]),
        group.call("rank", workers=[8, 4, 2, 0]),
        group.call("rank", workers=[1, 5, 7]),
        group.call("identity", b"x" * MIB) == [b"x" * MIB] * 9,
        group.map("add", list(range(9)), b=[10 * i for i in range(9)]),
        group.map("identity", [f"item {i}" for i in range(9)]),
        group.call("add", 2, b=40),
    ]
    group.call("clear")
    futures = [group.call_async("record", i) for i in range(30)]
    results.append([f.result(timeout=30) for f in futures])
    results.append(group.call("history"))
    for kwargs in (
        {"in_sharded_axes": ["dp"], "replicate_on_axes": ["tp"]},
        {"in_sharded_axes": ["dp"], "replicate_on_axes": ["tp"], "output_is_replicated": ["tp"]},
        {"in_sharded_axes": ["dp"], "dummy_calls_to_free_axes": True},
    ):
        future = group.call_sharded("note", ["a", "b", "c"], item=["x", "y", "z"], **kwargs)
        results.append((future.called_ranks, future.result_ranks, future.result(timeout=30)))
    data = [[f"{i}{j}" for j in range(3)] for i in range(3)]
    future = group.call_sharded("note", data, in_sharded_axes=["tp", "dp"])
    results.append((future.called_ranks, future.result_ranks, future.result(timeout=30)))
    return results


def test_calls_maps_and_sharded_calls_give_the_same_results_as_flat_mode(agents):
    mesh = {"dp": 3, "tp": 3}
    with group_on(agents.backend(), nodes=9, mesh=mesh) as flat:
        expected = run_calls(flat)
    with group_on(agents.backend(**TREE), nodes=9, mesh=mesh) as tree:
        assert connections(tree) == 2
        got = run_calls(tree)
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"result {i} differs from flat mode"
    # and flat mode is right (so "the same" is not "the same mistake")
    assert expected[0] == list(range(9))
    assert expected[3] == [0, 2, 4, 8]
    assert expected[6] == [11 * i for i in range(9)]
    assert expected[10] == [list(range(30))] * 9
    assert expected[11] == (list(range(9)), list(range(9)),
                            [(r, ("abc"[r // 3],), {"item": "xyz"[r // 3]}) for r in range(9)])


def test_a_payload_for_every_rank_crosses_each_node_once(agents):
    payload = b"z" * (4 * MIB)
    with group_on(agents.backend(**TREE), nodes=9) as group:
        assert group.call("rank") == list(range(9))
        before = [agents.metrics(i) for i in range(9)]
        assert group.call("identity", payload) == [payload] * 9
        after = [agents.metrics(i) for i in range(9)]
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        received = a["received_bytes_total"] - b["received_bytes_total"]
        assert len(payload) <= received < 2 * len(payload), \
            f"{agents.hosts[i]} received {received} bytes for a {len(payload)}-byte call"
        assert a["calls_total"] - b["calls_total"] == 1, \
            f"{agents.hosts[i]} did not run the call on its one rank exactly once"


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("failing, sleeping", [(7, 1), (4, 8)])
def test_a_worker_error_in_one_subtree_fails_the_call_without_waiting_for_another(
        agents, failing, sleeping):
    with group_on(agents.backend(**TREE), nodes=9) as group:
        assert group.call("rank") == list(range(9))
        started = time.monotonic()
        future = group.call_async("fail_on_rank", failing, 30)
        with pytest.raises(px.WorkerError) as info:
            future.result(timeout=20)
        elapsed = time.monotonic() - started
        assert elapsed < 4, f"the error took {elapsed:.1f} s (rank {sleeping} sleeps 30 s)"
        assert info.value.rank == failing
        assert info.value.exc_type == "KeyError"
        assert f"rank {failing} failed on purpose" in str(info.value)
        group.shutdown(timeout=0.2)  # the others still sleep: do not wait for them


def test_an_inner_agent_sigkilled_mid_call_removes_its_subtree(agents):
    with group_on(agents.backend(**TREE), nodes=9, procs_per_node=2) as group:
        pids = group.call("pid")
        lost = [pid for i in SUBTREE_OF_0 for pid in agents.descendants(i)]
        assert set(pids[:10]) <= set(lost)
        future = group.call_async("sleep", 3, value="done")
        time.sleep(0.3)
        agents.procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(px.MembershipChanged) as info:
            future.result(timeout=20)
        elapsed = time.monotonic() - killed_at
        assert elapsed < 3, f"the call failed {elapsed:.1f} s after the agent was killed"
        assert isinstance(info.value, px.PhalanxError)
        assert info.value.added == []
        assert sorted(info.value.removed, key=lambda n: n.node) == [
            px.NodeInfo(i, agents.hosts[i], (2 * i, 2 * i + 1)) for i in SUBTREE_OF_0]
        # Every process of the lost subtree ends (no orphans), its agents 1-4 stay up.
        assert helpers.wait_dead(lost, 5), "ranks of the lost subtree outlived it"
        assert helpers.wait_until(
            lambda: not any(agents.descendants(i) for i in SUBTREE_OF_0[1:]), 5), \
            "the lost subtree's agents kept processes of its session"
        assert all(agents.procs[i].poll() is None for i in SUBTREE_OF_0[1:])
        # The rest of the group carries on.
        assert connections(group) == 1
        assert group.call("rank", workers="ready", timeout=10) == list(range(10, 18))
        assert group.call("pid", workers="ready", timeout=10) == pids[10:]
        assert [h.alive for h in group.health()] == [False] * 10 + [True] * 8
    # The subtree's surviving agents serve the next group.
    with group_on(agents.backend(agents.hosts[1:5], **TREE), nodes=4) as group:
        assert group.call("rank") == [0, 1, 2, 3]


def test_an_agent_that_does_not_answer_is_passed_over_or_named_by_the_quorum(agents):
    agents.procs[3].kill()  # an inner agent: its child (4) is adopted by the head (0)
    agents.procs[3].wait()
    started = time.monotonic()
    with pytest.raises(px.QuorumTimeout) as info:
        group_on(agents.backend(quorum_timeout=2, **TREE), nodes=9)
    assert time.monotonic() - started < 10
    assert list(info.value.missing) == [agents.hosts[3]]
    assert sorted(info.value.answered) == sorted(h for i, h in enumerate(agents.hosts) if i != 3)

    with group_on(agents.backend(quorum=8, **TREE), nodes=8) as group:
        assert group.call("rank") == list(range(8))
        # node i is the i-th agent that answered, in the order listed: 3 is skipped
        where = {h.rank: agents.hosts.index(next(
            agents.hosts[i] for i in range(9) if h.pid in agents.descendants(i)))
            for h in group.health()}
        assert where == {0: 0, 1: 1, 2: 2, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8}
        assert connections(group) == 2
