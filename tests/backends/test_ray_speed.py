"""What a rank on Ray costs and how its end is told (the benchmark's W5 and W1 on Ray): a
rank killed from outside fails its call with its signal and its last words every time (the
controller reads the exit status from the kernel as the rank's stream ends, not waiting for
Ray to learn of the death, nor missing it when the raylet reaps the actor first); a rank
that never uses Ray's serializer does not pay for Ray's serialization context, which still
works when it does; its start leaves nothing in Ray's store; a rank that exits on its
own is told with its code, though its actor's ``serve`` returns nothing; and a put object
or a large argument reaches the ranks on the controller's machine from the controller's
own memory (one copy, as on the local backend), the others through Ray's store."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

import phalanx as px
from phalanx import WorkerDied
from tests import raycluster
from tests.workers import Probe

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    yield ray_cluster
    assert raycluster.leftovers() == []


class Costs(Probe):
    """What a rank has loaded, and Ray's serializer used from it."""

    def loaded(self, name: str) -> bool:
        return name in sys.modules

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def process_started(self) -> float:
        import psutil

        return psutil.Process().create_time()

    def put_and_get(self, value: object) -> dict:
        import ray

        ref = ray.put(value)
        return {"ref": ref, "value": ray.get(ref, timeout=30)}

    def get(self, refs: dict) -> object:
        import ray

        return ray.get(refs["ref"], timeout=30)

    def sources(self) -> list[object]:
        """Where each put object this rank was told of is: the pid of the process whose
        block holds it, or "ray" (Ray's object store)."""
        from phalanx.rank.shared import RANK_SHARES, RAY_LOCATION

        return sorted((str(w[0]) if w[0] == RAY_LOCATION else w[0])
                      for _, w in RANK_SHARES._where.values())

    def total(self, array) -> float:
        return float(array.sum())

    def scribble(self, array) -> float:
        """The array's sum before this rank writes into it (its own copy of the page)."""
        total = float(array.sum())
        array[:] = -1.0
        return total


def test_a_rank_killed_from_outside_fails_its_call_with_its_signal_every_time():
    """An external ``kill -9`` (what W5 does): the warden did not deliver it and Ray only
    says that the worker died, so the signal comes from the kernel's record alone; the
    raylet reaps the actor at once, so a look at a zombie would miss it now and then."""
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        for attempt in range(4):
            pid = group.call_one(1, "pid")
            future = group.call_async("sleep", 30, workers=[1])
            time.sleep(0.2)
            os.kill(pid, signal.SIGKILL)  # the test cluster's nodes are this machine
            with pytest.raises(WorkerDied) as died:
                future.result(timeout=10)
            assert (died.value.rank, died.value.pid) == (1, pid), attempt
            assert died.value.signal == "SIGKILL", (attempt, died.value.cause)
            group.recreate(1)
        assert group.call("rank") == [0, 1]


def test_a_rank_that_kills_itself_is_told_with_its_last_words():
    """Its stderr lines are still unread as it dies: the death told at once carries them."""
    lines = tuple(f"last words {i}" for i in range(3))
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        with pytest.raises(WorkerDied) as died:
            group.call_one(0, "kill_self", lines, timeout=30)
        assert died.value.signal == "SIGKILL"
        assert list(died.value.stderr_tail[-3:]) == list(lines)
        assert group.call_one(1, "rank") == 1


def test_a_rank_that_exits_on_its_own_is_told_with_its_code():
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        started = time.monotonic()
        with pytest.raises(WorkerDied) as died:
            group.call_one(1, "sys_exit", 3, timeout=30)
        assert (died.value.rank, died.value.exitcode) == (1, 3)
        # promptly: its warden's account, not Ray's (its actor lives on, serving nothing)
        assert time.monotonic() - started < 5
        assert not group.health()[1].alive and group.health()[1].exitcode == 3
        group.recreate(1)
        assert group.call("rank") == [0, 1]


def test_a_rank_that_does_not_use_rays_serializer_does_not_make_it():
    """Making Ray's serialization context imports pyarrow (~50 ms of CPU in every rank's
    actor as it starts, and memory): a rank whose calls never go through Ray's serializer
    never makes it; one that does gets it, and its refs keep their owner both ways. (Ray
    may give an actor a worker of its pool that ran tasks of this session's tests before,
    its context made by them: only the ranks in workers started for the group tell. On a
    node of another machine than the controller's, the first rank's actor is asked for
    the node's ports, whose answer is Ray's serializer's: that one may make it.)"""
    pytest.importorskip("pyarrow", reason="without pyarrow Ray's context costs little")
    before = time.time() - 0.1  # a process's start time is kept to the clock tick
    with px.WorkerGroup(Costs, procs_per_node=3, backend="ray", echo_output=False) as group:
        fresh = [s > before for s in group.call("process_started")]
        loaded = group.call("loaded", "pyarrow")
        nodes = group.call("node_address")
        asked = {nodes.index(a) for a in nodes if a != raycluster.NODE_ADDRESSES[0]}
        assert not any(f and made and rank not in asked
                       for rank, (f, made) in enumerate(zip(fresh, loaded, strict=True))), \
            (fresh, loaded, nodes)
        made = group.call_one(0, "put_and_get", [1, 2, 3])
        assert made["value"] == [1, 2, 3]
        assert ray.get(made["ref"], timeout=30) == [1, 2, 3]  # returned: its owner kept
        assert group.call_one(1, "get", {"ref": ray.put("from the driver")}) == \
            "from the driver"
        assert group.call("loaded", "pyarrow")[:2] == [True, True]


def test_a_ranks_start_is_not_left_in_rays_store():
    """The start (with the group's secret) is taken by the actor as it starts; a start no
    actor took is removed when the group ends."""
    from ray.experimental import internal_kv

    def starts() -> list[bytes]:
        return internal_kv._internal_kv_list(b"start/", namespace="phalanx")

    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        assert starts() == []
        group.recreate(1)
        assert starts() == []
    assert starts() == []


def test_ranks_start_in_a_ray_namespace_other_than_the_drivers():
    """An actor knows its driver's namespace, not the one it is named in: its start is
    found all the same."""
    backend = px.RayBackend(namespace="phalanx-test-elsewhere")
    with px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0, 1]
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "phalanx-test-elsewhere"]
        assert len(names) == 2


def test_a_start_whose_key_is_taken_goes_as_an_argument():
    """Two groups of one driver sharing a placement group and a name prefix (in two Ray
    namespaces) would leave their starts under one key: the second goes the way Ray's
    arguments do, and its rank starts all the same."""
    from ray.experimental import internal_kv
    from ray.util.placement_group import placement_group, remove_placement_group

    from phalanx.backends.ray.actor import START_STORE, start_key

    pg = placement_group([{"CPU": 1}])
    assert pg.wait(timeout_seconds=60)
    key = start_key(ray.get_runtime_context().namespace, pg.id.hex(), "taken-r0-i1")
    internal_kv._internal_kv_put(key, b"another group's", namespace=START_STORE)
    try:
        backend = px.RayBackend(placement_group=pg, name_prefix="taken")
        with px.WorkerGroup(Probe, procs_per_node=1, backend=backend,
                            echo_output=False) as group:
            assert group.call("rank") == [0]
        assert internal_kv._internal_kv_get(key, namespace=START_STORE) == b"another group's"
    finally:
        internal_kv._internal_kv_del(key, namespace=START_STORE)
        remove_placement_group(pg)


def test_objects_reach_ranks_on_the_controllers_machine_from_its_own_memory():
    """The test cluster's nodes are all this machine: their ranks map the controller's
    block (no copy in Ray's store, no store actor); ranks made to stand for another
    machine (``PHALANX_BLOCK_DOMAIN``) read Ray's store, through a node's store actor for
    writable arguments. Either way, an argument's pages are each rank's own to write."""
    import numpy as np

    from phalanx.config import AUTO_SHARE_BYTES

    with px.WorkerGroup(Costs, procs_per_node=2, backend="ray", echo_output=False) as near, \
            px.WorkerGroup(Costs, procs_per_node=2, backend="ray", echo_output=False,
                           env={"PHALANX_BLOCK_DOMAIN": "another-machine"}) as far:
        array = np.arange(1000, dtype=np.float64)
        big = np.ones(AUTO_SHARE_BYTES // 8 * 2)
        for group, source in ((near, os.getpid()), (far, "ray")):
            ref = group.put(array)
            assert group.call("total", ref) == [float(array.sum())] * 2
            assert group.call("sources") == [[source]] * 2
            ref.free()
            for _ in range(2):  # the second call's block is the first's, reused
                assert group.call("scribble", big) == [float(big.size)] * 2
            assert group.call("sources") == [[]] * 2
        assert float(big.sum()) == big.size
