"""Kept results on Ray: a rank keeps its results in a memory block of its own, as on the local
backend, and names its Ray node with them. A rank of the same machine maps the block; a rank
of another machine (here: another block domain, ``PHALANX_BLOCK_DOMAIN``, as the agent tests
make machines of one) has a Ray task on the producer's node read it, Ray bringing the value
over; a result gone from its producer is ObjectLost naming it, read either way."""

from __future__ import annotations

import numpy as np
import pytest

import phalanx as px
from tests import raycluster

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")

ELSEWHERE = {"PHALANX_BLOCK_DOMAIN": "another-machine"}  # a consumer that cannot map blocks


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    yield ray_cluster
    assert raycluster.leftovers() == []


class Producer:
    def make(self, n: int, base: float) -> np.ndarray:
        import os

        return np.full(n, base + float(os.environ["RANK"]))

    def where(self) -> tuple[str, list[str]]:
        """This rank's Ray node, and the tokens of the blocks its results are kept in."""
        from phalanx.rank.kept import KEPT

        return (ray.get_runtime_context().get_node_id(),
                sorted(held[0].token for held in KEPT._held.values()))

    def forget(self) -> None:
        """Drop every kept result and close its block, behind the controller's back."""
        from phalanx.rank.kept import KEPT

        KEPT.drop(list(KEPT._held))
        pooled, KEPT._pool = KEPT._pool, []
        for _, block in pooled:
            block.close()


class Consumer:
    def total(self, array: np.ndarray) -> tuple[float, bool]:
        return float(array.sum()), bool(array.flags.writeable)

    def machine(self) -> str:
        from phalanx.rank.kept import machine

        return machine()


def test_kept_results_are_blocks_read_in_place_or_through_a_task_on_their_node():
    with px.WorkerGroup(Producer, procs_per_node=2, backend="ray", echo_output=False) as p, \
            px.WorkerGroup(Consumer, procs_per_node=2, backend="ray",
                           echo_output=False) as near, \
            px.WorkerGroup(Consumer, procs_per_node=2, backend="ray", env=ELSEWHERE,
                           echo_output=False) as far:
        assert far.call("machine") == ["another-machine"] * 2
        refs = p.call("make", 1000, 1.0, keep=True, timeout=60)
        nodes_blocks = p.call("where")
        assert all(len(blocks) == 1 for _, blocks in nodes_blocks)  # a block, not Ray's store
        assert [r.record.location.ray_node for r in refs] == [n for n, _ in nodes_blocks]
        want = [(2000.0, False), (1000.0, False)]  # read-only either way
        assert near.map("total", refs[::-1], timeout=60) == want
        assert far.map("total", refs[::-1], timeout=60) == want
        assert [float(r.get().sum()) for r in refs] == [1000.0, 2000.0]
        p.call("forget")
        with pytest.raises(px.ObjectLost, match=f"rank 0 of group {p.name}"):
            far.call_one(0, "total", refs[0], timeout=60)
        with pytest.raises(px.ObjectLost, match=f"rank 1 of group {p.name}"):
            near.call_one(0, "total", refs[1], timeout=60)
        assert far.call("machine", timeout=60) == ["another-machine"] * 2  # still usable
