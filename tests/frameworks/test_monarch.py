"""framework="monarch": every node runs a Monarch worker loop; the function runs on node 0
and its ``allocator`` argument lists the loops' addresses to attach to."""

from __future__ import annotations

import pytest

import phalanx as px

pytest.importorskip("monarch.actor", reason="torchmonarch is not installed "
                                            "(pip install torchmonarch)")


def spawn_actors_on_every_node(allocator) -> dict:
    import os

    from monarch.actor import Actor, attach_to_workers, current_rank, endpoint

    class Where(Actor):
        @endpoint
        def where(self) -> int:
            return current_rank().rank

    hosts = attach_to_workers(workers=allocator, ca="trust_all_connections", name="hosts")
    hosts.initialized.get()
    procs = hosts.spawn_procs(per_host={"procs": 1})
    actors = procs.spawn("where", Where)
    ranks = sorted(value for _, value in actors.where.call().get())
    procs.stop().get()
    return {"allocator": allocator, "ranks": ranks, "rank": int(os.environ["RANK"])}


@pytest.mark.slow
def test_function_on_node_zero_spawns_actors_on_both_nodes():
    results = px.spmd(spawn_actors_on_every_node, nodes=2, framework="monarch",
                      echo_output=False, timeout=120)()
    assert len(results) == 1  # single controller: node 0 only
    (result,) = results
    assert result["rank"] == 0
    assert len(result["allocator"]) == 2
    assert all(a.startswith("tcp://127.0.0.1:") for a in result["allocator"])
    assert result["ranks"] == [0, 1]  # one actor per node
