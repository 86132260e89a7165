"""A group inside a placement group of the user's, resources per rank as Ray spells them
(fractions included: two groups sharing the bundles of one placement group), and
``@ray.remote`` classes as a group's target -- on the real three-node Ray test cluster
(tests/raycluster.py: 8 CPUs and 2 GPUs per node, as Ray counts them).

phalanx neither creates nor removes a user's placement group: each test removes its own."""

from __future__ import annotations

import time

import pytest

import phalanx as px
from phalanx import StartupError, WorkerDied
from tests import helpers, raycluster
from tests.workers import Probe

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def user_pg():
    """Make placement groups as a user does (ready, unless ``wait=False``); each is removed
    when the test ends, whatever phalanx did."""
    from ray.util.placement_group import placement_group, remove_placement_group

    made = []

    def make(bundles, strategy="PACK", wait=True):
        pg = placement_group(bundles, strategy=strategy)
        made.append(pg)
        if wait:
            assert pg.wait(timeout_seconds=30)
        return pg

    yield make
    for pg in made:
        remove_placement_group(pg)


def state(pg) -> str:
    return ray.util.placement_group_table(pg)["state"]


def bundle_ips(pg) -> list[str]:
    """The address of the Ray node of each bundle, by bundle index."""
    table = ray.util.placement_group_table(pg)
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [address[table["bundles_to_node_id"][i]] for i in range(len(table["bundles"]))]


def seats(group) -> list[int]:
    """The bundle each rank's actor was placed in (the group's backend's record)."""
    return [b.index for b in group._backend._bundles]


def assert_only_left(pg) -> None:
    """Within 2 s (Ray records a kill asynchronously), what is left on the cluster is the
    user's placement group and nothing else: no actor, no placement group of phalanx's."""
    expected = [f"placement group {pg.id.hex()} (CREATED)"]
    assert helpers.wait_until(lambda: raycluster.leftovers(wait=0) == expected, 2,
                              interval=0.1), raycluster.leftovers(wait=0)


def env(group, *names):
    return [[e[n] for n in names] for e in group.call("env", *names)]


def test_rank_i_runs_on_bundle_i_of_the_users_placement_group(user_pg):
    pg = user_pg([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    backend = px.RayBackend(placement_group=pg)
    with px.WorkerGroup(Probe, procs_per_node=3, backend=backend, echo_output=False) as group:
        assert seats(group) == [0, 1, 2]
        assert group.call("ray_node") == bundle_ips(pg)
        assert env(group, "NODE_RANK", "LOCAL_RANK") == [["0", "0"], ["1", "0"], ["2", "0"]]
        assert group.nodes == 3
    assert state(pg) == "CREATED"  # left as it was
    assert_only_left(pg)


def test_bundle_indices_choose_the_bundles_and_ranks_stay_in_node_order(user_pg):
    spread = user_pg([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    ips = bundle_ips(spread)
    backend = px.RayBackend(placement_group=spread, bundle_indices=[2, 0])
    with px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False) as group:
        assert seats(group) == [2, 0]
        assert group.call("ray_node") == [ips[2], ips[0]]
        assert env(group, "NODE_RANK") == [["0"], ["1"]]
    # bundles on two nodes, asked for interleaved: ranks go node by node, the given order
    # kept within each node
    packed = user_pg([{"CPU": 3}] * 4, strategy="PACK")  # two nodes, two bundles each
    ips = bundle_ips(packed)
    order = [3, 1, 2, 0]
    backend = px.RayBackend(placement_group=packed, bundle_indices=order,
                            resources_per_worker={"CPU": 1})
    with px.WorkerGroup(Probe, procs_per_node=4, backend=backend, echo_output=False) as group:
        placed = seats(group)
        assert len(set(ips)) == 2  # two bundles on each of two nodes
        by_node: dict[str, list[int]] = {}
        for index in order:
            by_node.setdefault(ips[index], []).append(index)
        assert placed == [i for indices in by_node.values() for i in indices]
        node_ranks = [int(e[0]) for e in env(group, "NODE_RANK")]
        assert node_ranks == sorted(node_ranks)
        assert group.call("ray_node") == [ips[i] for i in placed]


def test_more_ranks_than_bundles_fail_before_anything_starts_naming_both(user_pg):
    pg = user_pg([{"CPU": 1}] * 2)
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        px.WorkerGroup(Probe, procs_per_node=3, backend=px.RayBackend(placement_group=pg),
                       echo_output=False)
    assert time.monotonic() - started < 10
    assert "a group of 3 ranks needs 3 bundles" in str(info.value)
    assert "it has 2 bundles" in str(info.value)
    with pytest.raises(StartupError, match="bundle_indices names 1 of its 2 bundles"):
        px.WorkerGroup(Probe, procs_per_node=2, echo_output=False,
                       backend=px.RayBackend(placement_group=pg, bundle_indices=[1]))
    with pytest.raises(StartupError) as info:
        px.WorkerGroup(Probe, procs_per_node=2, echo_output=False,
                       backend=px.RayBackend(placement_group=pg,
                                             resources_per_worker={"CPU": 2}))
    assert "each rank asks {'CPU': 2.0}" in str(info.value)
    assert "bundle 0 of the placement group has {'CPU': 1.0}" in str(info.value)
    assert state(pg) == "CREATED"
    assert_only_left(pg)


def test_bad_placement_group_arguments_are_refused_at_once(user_pg):
    with pytest.raises(TypeError, match="placement_group must be a Ray placement group"):
        px.RayBackend(placement_group="my-pg")
    with pytest.raises(ValueError, match="give it as placement_group="):
        px.RayBackend(bundle_indices=[0])
    pg = user_pg([{"CPU": 1}] * 2)
    with pytest.raises(ValueError, match="distinct"):
        px.RayBackend(placement_group=pg, bundle_indices=[1, 1])
    with pytest.raises(ValueError, match="has 2 bundles"):
        px.RayBackend(placement_group=pg, bundle_indices=[0, 2])
    with pytest.raises(TypeError, match="list"):
        px.RayBackend(placement_group=pg, bundle_indices=1)


def test_a_placement_group_not_ready_in_time_fails_within_start_timeout_and_stays(user_pg):
    pending = user_pg([{"CPU": 1, "GPU": raycluster.GPUS_PER_NODE + 1}], wait=False)
    backend = px.RayBackend(placement_group=pending, resources_per_worker={"CPU": 1})
    started = time.monotonic()
    with pytest.raises(StartupError, match="was not ready within 2 s"):
        px.WorkerGroup(Probe, procs_per_node=1, backend=backend, echo_output=False,
                       start_timeout=2)
    assert time.monotonic() - started < 8
    assert state(pending) == "PENDING"  # not phalanx's to remove


def test_the_users_placement_group_outlives_recreate_and_shutdown(user_pg):
    pg = user_pg([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    backend = px.RayBackend(placement_group=pg)
    group = px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False)
    try:
        before = group.call("ray_node")
        helpers.RankControl(reports_signal=True).kill(group, 1)
        with pytest.raises(WorkerDied):
            group.call_one(1, "pid")
        group.recreate(1)
        assert group.call("ray_node") == before == bundle_ips(pg)
        group.restart()
        assert group.call("ray_node") == before
    finally:
        group.shutdown()
    assert state(pg) == "CREATED"
    # and another group can use it again
    with px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False) as again:
        assert again.call("ray_node") == before
    assert_only_left(pg)


def test_two_groups_share_the_bundles_of_one_placement_group_by_halves(user_pg):
    pg = user_pg([{"GPU": 1, "CPU": 2}] * 2, strategy="STRICT_SPREAD")
    half = {"GPU": 0.5, "CPU": 1}
    first = px.WorkerGroup(Probe, procs_per_node=2, echo_output=False,
                           backend=px.RayBackend(placement_group=pg, resources_per_worker=half))
    try:
        second = px.WorkerGroup(Probe, procs_per_node=2, echo_output=False,
                                backend=px.RayBackend(placement_group=pg,
                                                      resources_per_worker=half))
        try:
            assert first.call("ray_node") == second.call("ray_node") == bundle_ips(pg)
            assert seats(first) == seats(second) == [0, 1]
            # Ray hands each bundle's one GPU to both halves
            devices = [env(g, "CUDA_VISIBLE_DEVICES") for g in (first, second)]
            assert devices[0] == devices[1] and all(d[0] for d in devices[0])
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    assert state(pg) == "CREATED"


def test_a_group_whose_bundles_are_taken_is_refused_at_once_naming_them(user_pg):
    pg = user_pg([{"CPU": 1}] * 2)
    with px.WorkerGroup(Probe, procs_per_node=2, echo_output=False,
                        backend=px.RayBackend(placement_group=pg)):
        began = time.monotonic()
        with pytest.raises(StartupError) as info:  # not "slow to construct" at the timeout
            px.WorkerGroup(Probe, procs_per_node=2, echo_output=False, start_timeout=60,
                           backend=px.RayBackend(placement_group=pg))
        assert time.monotonic() - began < 20
        message = str(info.value)
        assert "the bundles [0, 1] of the placement group" in message, message
        assert "bundle 0 has 0 of 1 CPU free" in message, message
    assert state(pg) == "CREATED"


def test_fractions_of_gpus_place_ranks_without_a_placement_group_of_the_users():
    backend = px.RayBackend(resources_per_worker={"GPU": 0.25, "CPU": 0.5})
    with px.WorkerGroup(Probe, procs_per_node=4, backend=backend, echo_output=False) as group:
        assert all(d[0] for d in env(group, "CUDA_VISIBLE_DEVICES"))
        assert group._backend._seat_resources[0] == {"GPU": 0.25, "CPU": 0.5}


# -- @ray.remote classes -------------------------------------------------------------------

class Counter:
    def __init__(self, start=0):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value

    def env(self, name):
        import os

        return os.environ.get(name)


@ray.remote(num_cpus=1)
class RemoteCounter(Counter):  # the module's name is Ray's ActorClass: pickled by value
    pass


def test_a_ray_remote_class_runs_as_a_group_with_its_resources_per_rank():
    with px.WorkerGroup(RemoteCounter, args=(10,), procs_per_node=2, backend="ray",
                        echo_output=False) as group:
        assert group.call("add", 1) == [11, 11]
        assert group._backend._seat_resources[0] == {"CPU": 1.0}


def test_a_ray_remote_classs_gpus_and_runtime_env_reach_its_ranks(user_pg):
    remote = ray.remote(num_gpus=0.5, num_cpus=1,
                        runtime_env={"env_vars": {"FROM_THE_CLASS": "yes"}})(Counter)
    pg = user_pg([{"GPU": 1, "CPU": 2}])
    with px.WorkerGroup(remote, procs_per_node=1, echo_output=False,
                        backend=px.RayBackend(placement_group=pg)) as group:
        assert group._backend._seat_resources == {0: {"GPU": 0.5, "CPU": 1.0}}  # not all of it
        assert group.call("env", "FROM_THE_CLASS") == ["yes"]
        assert group.call("env", "CUDA_VISIBLE_DEVICES")[0]
    assert state(pg) == "CREATED"


def test_a_ray_remote_classs_options_that_cannot_apply_are_refused_naming_them():
    refused = ray.remote(max_restarts=3)(Counter)
    with pytest.raises(ValueError) as info:
        px.WorkerGroup(refused, backend="ray", echo_output=False)
    assert "@ray.remote(max_restarts=...) of Counter" in str(info.value)
    assert "group.recreate" in str(info.value)
    with pytest.raises(ValueError) as info:
        px.WorkerGroup(RemoteCounter, echo_output=False,
                       backend=px.RayBackend(resources_per_worker={"CPU": 2}))
    assert "@ray.remote(num_cpus=1)" in str(info.value)
    assert "resources_per_worker={'CPU': 2}" in str(info.value)
    with pytest.raises(TypeError, match=r"\.options\(\.\.\.\): pass the class itself"):
        px.WorkerGroup(RemoteCounter.options(num_cpus=2), backend="ray", echo_output=False)


def test_other_backends_run_the_class_a_plain_ray_remote_wraps_and_refuse_options():
    with px.WorkerGroup(ray.remote(Counter), args=(1,), procs_per_node=2, backend="local",
                        echo_output=False) as group:
        assert group.call("add", 2) == [3, 3]
    with pytest.raises(ValueError, match=r"Counter is a @ray.remote\(num_cpus=1\) class: the "
                                         "local backend"):
        px.WorkerGroup(RemoteCounter, backend="local", echo_output=False)
