"""Kept results between the nodes of the cluster backend: a consumer on another machine than
the producer reads the result from a copy its node's agent fetched straight from the
producer's agent (COPY, then READ between the two agents, the token proved both ways),
once per node, dropped when the handle is freed; a producer gone is an ObjectLost naming it.

The session's agents (127.0.0.2-4) each have a memory domain of their own
(``PHALANX_BLOCK_DOMAIN``, see ``tests/agentcluster.py``): their ranks cannot map each
other's blocks, as on separate machines, so every crossing here goes through the agents.
"""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest

import phalanx as px
from tests import helpers
from tests.helpers import wait_until

MIB = 1 << 20


class Producer:
    def make(self, n: int) -> np.ndarray:
        return np.full(n, float(os.environ["RANK"]) + 1)

    def pid(self) -> int:
        return os.getpid()


class Consumer:
    def total(self, array) -> float:
        return float(np.asarray(array).sum())

    def copies(self) -> list[tuple[int, int]]:
        """Where this rank's node holds copies for it: (holder pid, descriptor) each."""
        from phalanx.rank.shared import RANK_SHARES

        return sorted(tuple(where[1][:2]) for where in RANK_SHARES._where.values())


@pytest.fixture(scope="module")
def cluster(agent_cluster):
    with helpers.long_lived_group(Producer, nodes=2, backend=agent_cluster.backend(),
                                  echo_output=False) as producers, \
            helpers.long_lived_group(Consumer, nodes=2, procs_per_node=2,
                                     backend=agent_cluster.backend(),
                                     echo_output=False) as consumers:
        yield agent_cluster, producers, consumers


def test_each_node_fetches_another_nodes_result_once_from_its_agent(cluster):
    agents, producers, consumers = cluster
    refs = producers.call("make", MIB, keep=True)  # rank 0 on node 0, rank 1 on node 1
    # consumers 0-1 sit on node 0 and read node 1's result; 2-3 read node 0's
    assert consumers.map("total", [refs[1], refs[1], refs[0], refs[0]]) == [
        2.0 * MIB, 2.0 * MIB, 1.0 * MIB, 1.0 * MIB]
    copies = consumers.call("copies")
    assert copies[0] == copies[1] and copies[2] == copies[3], copies  # one copy per node
    holders = [agents.procs[0].pid, agents.procs[1].pid]
    assert [c[0][0] for c in copies] == [holders[0]] * 2 + [holders[1]] * 2, (copies, holders)
    # a second call naming the same handles uses the copies already there
    assert consumers.call("total", refs[1]) == [2.0 * MIB] * 4
    assert consumers.call("copies")[:2] == copies[:2]
    assert float(refs[1].get().sum()) == 2.0 * MIB  # fetched to the controller from rank 1
    del refs
    gc.collect()
    assert wait_until(lambda: consumers.call("copies") == [[], [], [], []], 10)


def test_a_handle_to_every_rank_of_a_node_is_one_copy_there(cluster):
    _, producers, consumers = cluster
    ref = producers.call_one(1, "make", 1000, keep=True)
    assert consumers.call("total", {"nested": [ref]}["nested"][0]) == [2000.0] * 4
    copies = consumers.call("copies")
    assert copies[0] == copies[1] and len(copies[0]) == 1  # node 0: a copy
    assert copies[2] == copies[3] == []  # node 1 is the producer's: it maps the block
    ref.free()
    assert wait_until(lambda: consumers.call("copies") == [[], [], [], []], 10)


def test_a_producer_gone_before_its_copy_is_made_is_object_lost(agent_cluster):
    with px.WorkerGroup(Producer, nodes=2, backend=agent_cluster.backend(),
                        echo_output=False) as p, \
            px.WorkerGroup(Consumer, nodes=1, backend=agent_cluster.backend(),
                           echo_output=False) as c:
        refs = p.call("make", 100, keep=True)
        pid = p.call_one(1, "pid")
        os.kill(pid, signal.SIGKILL)  # node 1: the consumer is on node 0
        # a kill takes effect a moment later
        assert wait_until(lambda: not helpers.pid_alive(pid), 10)
        with pytest.raises(px.ObjectLost) as info:
            c.call("total", refs[1])
        assert f"make() on rank 1 of group {p.name}" in str(info.value), info.value
        assert c.call("total", refs[0]) == [100.0]  # same node: the block is mapped
        assert c.call("copies") == [[]]
