"""A call to a thousand nodes through an agent tree gives exactly what a call to a few gives:
every rank's value in rank order, one rank's error with its rank, node and traceback (and
at once, not after the others), and a dead subtree named node by node.

The nodes are the scale harness's (``bench.scale.SimCluster``: real agents, each with its
own loopback address, handshake, relay and, in a tree, adoption and forwarding; their ranks
simulated in-process), 1,000 of them with 2 ranks each and a fan-out of 4, so that the
tree has five levels below the controller and most results travel up through four agents
that gather them: the path where the controller resolves a subtree's answers at once
(``phalanx.wire.protocol.Gathered``) and registers a call once for all its ranks
(``phalanx.controller.ranks.Cohort``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import phalanx as px
from bench import scale
from bench.simagents import NO_ANSWER
from phalanx.backends.cluster import tree as agenttree
from tests import helpers

NODES = 1000
PER_NODE = 2
RANKS = NODES * PER_NODE
FANOUT = 4


class Ranked:
    """A simulated rank that knows its rank (its rank_kwargs)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def value(self) -> tuple[int, str]:
        return self.rank, "x" * (self.rank % 7)

    def nothing(self) -> None:
        return None

    def empty(self) -> list[Any]:
        return []

    def array(self) -> Any:
        return np.arange(self.rank, self.rank + 3000, dtype=np.int64)  # out-of-band buffer

    def mixed(self) -> Any:
        return self.array() if self.rank % 3 == 0 else self.value()

    def fail_on(self, rank: int, others_answer: bool) -> Any:
        if self.rank == rank:
            raise ValueError(f"rank {rank} failed on purpose")
        return self.rank if others_answer else NO_ANSWER

    def hang(self) -> Any:
        return NO_ANSWER


def start(cluster: scale.SimCluster, nodes: int = NODES) -> px.WorkerGroup:
    backend = px.ClusterBackend(cluster.hosts[:nodes], token_file=cluster.token_file,
                                tree_threshold=1, fanout=FANOUT, heartbeat_timeout=120,
                                quorum_timeout=120, node_timeout=60)
    return px.WorkerGroup(Ranked, nodes=nodes, procs_per_node=PER_NODE, backend=backend,
                          rank_kwargs={r: {"rank": r} for r in range(nodes * PER_NODE)},
                          heartbeat_timeout=None, straggler_warning=None, echo_output=False,
                          start_timeout=120)


def subtrees(nodes: int, fanout: int) -> dict[int, list[int]]:
    """Each node's subtree (itself first), as ``phalanx.backends.cluster.tree.form``
    builds the tree when every agent answers."""
    below: dict[int, list[int]] = {}

    def adopt(chunk: list[int]) -> list[int]:
        head, rest = chunk[0], chunk[1:]
        below[head] = [head] + [n for part in agenttree.split(rest, fanout) for n in adopt(part)]
        return below[head]

    for chunk in agenttree.split(list(range(nodes)), fanout):
        adopt(chunk)
    return below


@pytest.fixture(scope="module")
def group():
    """One thousand-node group for the module's tests (its start is most of their time):
    the agents' processes are the cluster's while it runs, checked gone once it closes."""
    cluster = scale.SimCluster(NODES)
    roots = {proc.pid for proc in cluster.procs}
    helpers.CLUSTER_ROOTS.update(roots)
    try:
        with start(cluster) as group:
            yield group
    finally:
        cluster.close()
        helpers.CLUSTER_ROOTS.difference_update(roots)


@pytest.mark.timeout(180)
def test_every_ranks_value_comes_back_exact_and_in_rank_order(group):
    in_flight = sum(h.calls_in_flight for h in group.health())  # another test's unanswered
    expected = [(r, "x" * (r % 7)) for r in range(RANKS)]
    for _ in range(3):  # the cohort made once, then reused: the same answers
        assert group.call("value") == expected
    assert group.call("nothing") == [None] * RANKS
    # one bytes for every rank, decoded once for an immutable value but once per rank for a
    # mutable one: no two ranks share the list they returned
    empties = group.call("empty")
    assert empties == [[]] * RANKS and len({id(e) for e in empties}) == RANKS
    arrays = group.call("array")
    assert all(np.array_equal(a, np.arange(r, r + 3000)) for r, a in enumerate(arrays))
    mixed = group.call("mixed")
    for r, value in enumerate(mixed):
        if r % 3 == 0:
            assert np.array_equal(value, np.arange(r, r + 3000)), r
        else:
            assert value == expected[r]
    # each rank's future, a selection of ranks, calls in flight together
    future = group.call_async("value")
    some = [0, 1, 57, 133, 399]
    assert [future.futures[r].result(timeout=30) for r in some] == [
        (r, "x" * (r % 7)) for r in some]
    assert future.result(timeout=30) == [(r, "x" * (r % 7)) for r in range(RANKS)]
    chosen = [3, 4, 5, 90, 91, 250, 398]  # runs and gaps, across subtrees
    for _ in range(2):
        assert group.call("value", workers=chosen) == [(r, "x" * (r % 7)) for r in chosen]
    assert group.call("nothing", workers=list(range(100, 300))) == [None] * 200
    pipelined = [group.call_async("value") for _ in range(20)]
    assert all(f.result(timeout=60) == [(r, "x" * (r % 7)) for r in range(RANKS)]
               for f in pipelined)
    assert sum(h.calls_in_flight for h in group.health()) == in_flight


@pytest.mark.timeout(180)
def test_one_ranks_error_among_all_is_reported_exactly_and_at_once(group):
    for failing in (0, 137, RANKS - 1):
        # the others never answer: the error must not wait for them
        started = time.monotonic()
        with pytest.raises(px.WorkerError) as info:
            group.call("fail_on", failing, False, timeout=30)
        assert time.monotonic() - started < 10
        error = info.value
        assert (error.rank, error.node, error.exc_type) == (failing, failing // PER_NODE,
                                                            "ValueError")
        assert f"rank {failing} failed on purpose" in str(error)
        assert "in fail_on" in error.traceback
        # the others answering: the same error, and the group goes on exactly
        with pytest.raises(px.WorkerError) as info:
            group.call("fail_on", failing, True, timeout=30)
        assert info.value.rank == failing
        assert group.call("value") == [(r, "x" * (r % 7)) for r in range(RANKS)]


@pytest.mark.timeout(180)
def test_a_dead_subtree_is_named_node_by_node_and_the_rest_goes_on():
    nodes = 60
    below = subtrees(nodes, FANOUT)
    inner = next(n for n in range(1, nodes) if len(below.get(n, ())) > 2)  # not a head
    lost = below[inner]
    cluster = scale.SimCluster(nodes)
    try:
        with start(cluster, nodes) as group:
            ranks = nodes * PER_NODE
            assert group.call("value") == [(r, "x" * (r % 7)) for r in range(ranks)]
            future = group.call_async("hang")
            time.sleep(0.3)
            cluster.stop_agent(cluster.hosts[inner])
            with pytest.raises(px.MembershipChanged) as info:
                future.result(timeout=60)
            assert info.value.added == []
            assert sorted(info.value.removed, key=lambda n: n.node) == [
                px.NodeInfo(n, cluster.hosts[n], (PER_NODE * n, PER_NODE * n + 1))
                for n in sorted(lost)]
            for n in lost[:3]:
                assert f"node {n}" in str(info.value)
            alive = [r for r in range(ranks) if r // PER_NODE not in lost]
            assert group.call("value", workers="ready", timeout=60) == [
                (r, "x" * (r % 7)) for r in alive]
            assert [h.alive for h in group.health()] == [
                r // PER_NODE not in lost for r in range(ranks)]
            assert all(h.calls_in_flight == 0 for h in group.health()
                       if h.rank // PER_NODE not in lost)
            group.shutdown(timeout=1)  # the living ranks still hang in the first call
    finally:
        cluster.close()
