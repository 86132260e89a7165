"""Several groups on one resource pool, on every backend with the same test code:
colocation (rank i of each group on the same node with the same GPUs), split pools,
slots freed by a shutdown, refusals before anything starts, per-rank constructor keywords.

GPUs: there is none here. Locally they are faked through CUDA_VISIBLE_DEVICES (how a
scheduler hands a job its GPUs); the Ray test cluster declares two per node (Ray sets
CUDA_VISIBLE_DEVICES with no device present); the test agents list none, so on them the
pools hold CPU slots only.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import psutil
import pytest

import phalanx as px
from phalanx import SerializationError, WorkerGroup


class Seat:
    """Reports where it runs."""

    def __init__(self, tag: str = "", seed: int = 0, extra=None) -> None:
        self.tag, self.seed, self.extra = tag, seed, extra

    def where(self) -> dict:
        node = None
        # A rank Ray hosts has ray imported already; importing it in any other rank would
        # only cost each of them a second or two of CPU.
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
        return {"tag": self.tag, "seed": self.seed, "extra": self.extra,
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "ray_node": node,
                "ancestors": [p.pid for p in psutil.Process().parents()]}


@pytest.fixture
def gpus(backend, monkeypatch):
    """GPUs per slot this backend can offer here (see the module docstring)."""
    if backend == "local":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        return 1
    return 1 if backend == "ray" else 0


@pytest.fixture
def node_of(backend, request):
    """Where a rank's ``where()`` says it runs, as a node."""
    if backend == "ray":
        return lambda seen: seen["ray_node"]
    if backend == "local":
        return lambda seen: "this machine"
    agents = {p.pid for p in request.getfixturevalue("agent_cluster").procs}
    return lambda seen: next(pid for pid in seen["ancestors"] if pid in agents)


def _group(pool, **kwargs) -> WorkerGroup:
    return WorkerGroup(Seat, pool=pool, echo_output=False, **kwargs)


def test_colocated_groups_share_each_slot_rank_by_rank(backend, gpus, node_of):
    with px.ResourcePool(nodes=2, procs_per_node=2, gpus_per_proc=gpus, colocate=2,
                         backend=backend) as pool:
        train = _group(pool, kwargs={"tag": "train"})
        gen = _group(pool, kwargs={"tag": "gen"})
        a, b = train.call("where"), gen.call("where")
        assert [s["tag"] for s in a + b] == ["train"] * 4 + ["gen"] * 4
        assert [node_of(s) for s in a] == [node_of(s) for s in b]
        assert [s["cuda"] for s in a] == [s["cuda"] for s in b]
        if gpus:  # and no two ranks of one group share a GPU
            assert len({s["cuda"] for s in a}) == 4 or backend == "ray"
            assert len({(node_of(s), s["cuda"]) for s in a}) == 4
        if backend != "local":  # two nodes really
            assert len({node_of(s) for s in a}) == 2
        train.shutdown()
        gen.shutdown()


def test_a_group_beyond_colocate_is_refused_before_any_process_starts(backend, gpus):
    with px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=gpus, colocate=1,
                         backend=backend) as pool:
        first = _group(pool, kwargs={"tag": "first"})
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(ValueError) as info:
            _group(pool)
        message = str(info.value)
        assert pool.name in message and "slots [0, 1]" in message
        assert f"group {first.name} (2 ranks)" in message and "colocate=1" in message
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
        first.shutdown()
        again = _group(pool)  # the slots are free once their group shut down
        assert len(again.call("where")) == 2
        again.shutdown()


def test_a_group_larger_than_its_pool_is_refused(backend, gpus):
    with px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=gpus,
                         backend=backend) as pool:
        with pytest.raises(ValueError, match=r"\[3\] ranks per node does not fit"):
            _group(pool, procs_per_node=3)
        with pytest.raises(ValueError, match="gpus_per_worker"):
            _group(pool, gpus_per_worker=gpus + 1)
        assert pool.placed() == {}


def test_split_pools_are_disjoint_and_in_slot_order(backend, gpus, node_of):
    with px.ResourcePool(nodes=2, procs_per_node=2, gpus_per_proc=gpus,
                         backend=backend) as pool:
        left, right = pool.split([2, 2])
        assert (left.slots, right.slots) == (2, 2)
        train, gen = _group(left), _group(right)
        a, b = train.call("where"), gen.call("where")
        if backend != "local":  # node 0's slots, then node 1's
            assert len({node_of(s) for s in a}) == 1 and len({node_of(s) for s in b}) == 1
            assert node_of(a[0]) != node_of(b[0])
        elif gpus:
            assert [s["cuda"] for s in a + b] == ["4", "5", "6", "7"]
        with pytest.raises(ValueError, match="no room"):
            _group(pool)  # the parent pool's slots are the sub-pools'
        with pytest.raises(ValueError, match="asks 5 slots; the pool has 4"):
            pool.split([4, 1])
    assert train.health()[0].alive is False  # closing the pool shut its groups down


def test_each_rank_gets_its_own_constructor_keywords(backend):
    with WorkerGroup(Seat, kwargs={"tag": "t", "seed": 1}, procs_per_node=3,
                     rank_kwargs={2: {"seed": 9, "extra": [2]}}, backend=backend,
                     echo_output=False) as group:
        seen = group.call("where")
        assert [(s["tag"], s["seed"], s["extra"]) for s in seen] == [
            ("t", 1, None), ("t", 1, None), ("t", 9, [2])]
    with WorkerGroup(Seat, procs_per_node=2, rank_kwargs=lambda r: {"seed": 10 + r},
                     backend=backend, echo_output=False) as group:
        assert [s["seed"] for s in group.call("where")] == [10, 11]


@pytest.mark.parametrize("rank_kwargs, error, words", [
    ({5: {"seed": 1}}, ValueError, "rank_kwargs names ranks [5] outside 0..1"),
    ({"1": {"seed": 1}}, TypeError, "rank_kwargs is keyed by rank numbers (ints); it has "
                                    "the keys ['1'] (str)"),
    ({0: ["seed"]}, TypeError, "rank_kwargs for rank 0 must be a dict"),
    ([{"seed": 1}], TypeError, "rank_kwargs must be a dict rank -> keywords"),
    (lambda r: 1 / 0, ValueError, "rank_kwargs(0) raised ZeroDivisionError"),
    ({1: {"extra": threading.Lock()}}, SerializationError, "could not pickle"),
])
def test_bad_rank_kwargs_are_refused_before_anything_starts(backend, rank_kwargs, error,
                                                            words):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error) as info:
        WorkerGroup(Seat, procs_per_node=2, rank_kwargs=rank_kwargs, backend=backend,
                    echo_output=False)
    assert words in str(info.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_bad_pools_are_refused(backend):
    with pytest.raises(ValueError, match="colocate"):
        px.ResourcePool(colocate=0, backend=backend)
    with pytest.raises(ValueError, match="gpus_per_proc"):
        px.ResourcePool(gpus_per_proc=-1, backend=backend)
    with pytest.raises(TypeError, match=r"pool must be a px\.ResourcePool"):
        WorkerGroup(Seat, pool="pool-1", echo_output=False)


def test_gpus_held_by_a_pool_or_a_group_are_not_handed_to_another(backend, monkeypatch):
    """One book of this machine's GPUs for every pool, split pool and plain group of the
    controller: a request for GPUs another holds is refused at once, naming the holder and
    what is free; closing the holder frees them."""
    if backend == "ray":  # Ray keeps the resources; phalanx names its own pools holding them
        with px.ResourcePool(nodes=3, procs_per_node=2, gpus_per_proc=1,
                             backend=backend) as every_gpu:
            began = time.monotonic()
            with pytest.raises(px.StartupError) as info:
                px.ResourcePool(nodes=1, procs_per_node=1, gpus_per_proc=1, backend=backend,
                                timeout=60)
            assert time.monotonic() - began < 20  # refused, not waited out
            message = str(info.value)
            assert "lacks 1 GPU" in message and f"held by {every_gpu.name}" in message
        return
    if backend != "local":
        pytest.skip("the session's agents list no GPUs (tests/backends/test_cluster_gpus.py "
                    "starts agents that do)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    first = px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=1, backend=backend)
    try:
        with pytest.raises(px.DevicesTaken) as info:
            px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=1, backend=backend)
        message = str(info.value)
        assert f"{first.name} holds 0, 1" in message and "(2)" in message, message
        with pytest.raises(px.DevicesTaken, match=f"{first.name} holds 0, 1"):
            WorkerGroup(Seat, procs_per_node=2, gpus_per_worker=1, backend=backend,
                        echo_output=False)
        # what is free is still handed out: one GPU, to a group of one rank
        with WorkerGroup(Seat, gpus_per_worker=1, backend=backend,
                         echo_output=False) as group:
            assert group.call("where")[0]["cuda"] == "2"
            with pytest.raises(px.DevicesTaken,
                               match=re.escape(f"group {group.name} (1 rank) holds 2")):
                px.ResourcePool(nodes=1, procs_per_node=1, gpus_per_proc=1,
                                backend=backend)
        # a split pool's slots are its parent's: its groups draw on what the pool holds
        left, right = first.split([1, 1])
        with _group(left) as a, _group(right) as b:
            assert [a.call("where")[0]["cuda"], b.call("where")[0]["cuda"]] == ["0", "1"]
    finally:
        first.close()
    with px.ResourcePool(nodes=1, procs_per_node=3, gpus_per_proc=1,
                         backend=backend) as whole:  # closing the holder freed them
        assert whole.slots == 3
