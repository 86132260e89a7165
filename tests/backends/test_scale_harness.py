"""The scale harness (``bench.scale``, its simulated agents in ``bench.simagents``) drives
a real cluster group: each node a real agent with its own loopback address, handshake and
relay, its rank simulated in-process. The harness is how the controller's cost at 1,000
nodes is measured, so it must keep speaking the agents' protocol as that changes: a READY
with each method's parameters, the relay's record of the calls sent to a rank."""

from __future__ import annotations

import pytest

from bench import scale


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tree", [False, True], ids=["flat", "tree"])
def test_simulated_agents_answer_for_every_rank(tree, monkeypatch):
    # a fan-out of 2: in a tree, 4 of the 6 agents are adopted and answer through others
    monkeypatch.setattr(scale, "FANOUT", 2)
    monkeypatch.setattr(scale, "TOP", 2)
    cluster = scale.SimCluster(6)
    try:
        result = scale.measure(cluster, 6, tree, calls=3)  # checks every rank's answer
    finally:
        cluster.close()
    assert result["nodes"] == 6 and result["mode"] == ("tree" if tree else "flat")
    assert result["connections"] == (2 if tree else 6)
    assert result["noop_ms"] > 0 and result["controller_cpu_ms"] >= 0


@pytest.mark.timeout(180)
def test_a_tree_holds_the_controllers_few_connections_and_the_agents_adopt_the_rest():
    """The controller's share of a tree is its own (top_fanout, 4), smaller than what each
    agent adopts (fanout, 50): 20 agents answer through 4 connections, not 20."""
    cluster = scale.SimCluster(20)
    try:
        result = scale.measure(cluster, 20, True, calls=3)  # checks every rank's answer
    finally:
        cluster.close()
    assert result["connections"] == scale.TOP == 4
