"""The ray backend's pure rules: bundles, what can never be placed, rank order, and how
Ray's account of a death is put in one line. No Ray needed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from phalanx.backends.ray.placement import (
    bundle_for,
    describe_ray_error,
    order_bundles,
    placement_problem,
)

NODE = {"CPU": 4.0, "memory": 1e9}


def test_a_bundle_defaults_to_one_cpu_and_adds_gpus_per_worker():
    assert bundle_for(None, 0) == {"CPU": 1.0}
    assert bundle_for(None, 2) == {"CPU": 1.0, "GPU": 2.0}
    assert bundle_for({"GPU": 1}, 4) == {"GPU": 1.0}  # asked explicitly: kept as asked
    assert bundle_for({"CPU": 2, "TPU": 0}, 0) == {"CPU": 2.0}  # zero entries dropped


def test_what_no_node_can_hold_is_named():
    problem = placement_problem([{"CPU": 8.0}], "PACK", [NODE, NODE])
    assert problem is not None and "no node can hold one bundle {'CPU': 8.0}" in problem
    assert "GPU" in placement_problem([{"GPU": 1.0}], "SPREAD", [NODE])


def test_strict_strategies_need_one_big_node_or_enough_distinct_ones():
    three = [{"CPU": 2.0}] * 3
    assert placement_problem(three, "PACK", [NODE, NODE]) is None
    assert "STRICT_PACK" in placement_problem(three, "STRICT_PACK", [NODE, NODE])
    assert placement_problem(three, "STRICT_PACK", [{"CPU": 6.0}]) is None
    assert "3 distinct nodes" in placement_problem(three, "STRICT_SPREAD", [NODE, NODE])
    assert placement_problem(three, "STRICT_SPREAD", [NODE] * 3) is None


def test_more_than_the_whole_cluster_is_named():
    problem = placement_problem([{"CPU": 3.0}] * 3, "SPREAD", [NODE, NODE])
    assert problem is not None and "whole cluster" in problem
    assert placement_problem([{"CPU": 1.0}], "PACK", []) == "the cluster has no alive nodes"


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=20))
def test_ranks_go_node_by_node_then_bundle_by_bundle(bundle_nodes):
    groups = order_bundles(bundle_nodes)
    flat = [i for group in groups for i in group]
    assert sorted(flat) == list(range(len(bundle_nodes)))  # every bundle exactly once
    for group in groups:
        assert group == sorted(group)
        assert len({bundle_nodes[i] for i in group}) == 1
    firsts = [group[0] for group in groups]
    assert firsts == sorted(firsts)  # nodes in the order of their first bundle
    assert len(groups) == len(set(bundle_nodes))


class ActorDiedError(Exception):
    pass


class OutOfMemoryError(Exception):
    pass


def test_rays_accounts_become_one_line():
    killed = ActorDiedError("The actor died unexpectedly before finishing this task.\n"
                            "\tclass_name: RankActor\nThe actor is dead because it was killed "
                            "by `ray.kill`.")
    assert describe_ray_error(killed) == "Ray: the actor was killed with ray.kill()"
    node = ActorDiedError("The actor died because its node has died. Node Id: 3f")
    assert describe_ray_error(node) == "Ray: the actor's node died"
    assert "out of memory" in describe_ray_error(OutOfMemoryError("Task was killed"))
    worker = ActorDiedError(
        "The actor died unexpectedly before finishing this task. The actor is dead because its "
        "worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
        "unexpectedly exits with a connection error code 2. End of file. (1) the process was "
        "killed by the OOM killer due to high memory usage"
    )
    text = describe_ray_error(worker)
    assert text.startswith("Ray: the actor is dead because its worker process has died")
    assert "SYSTEM_ERROR" in text and "memory" not in text.split("(", 1)[0]


class RayTaskError(Exception):
    pass


def test_a_rank_that_cannot_reach_the_controller_is_told_how_to_go_on():
    error = RayTaskError(
        "ray::RankActor.serve() (pid=7, ip=10.0.0.2)\n  File \"x.py\", line 1\n"
        "ConnectionError: could not connect back to the controller at 10.0.0.9:4444 "
        "([Errno 111] Connection refused); a controller the cluster cannot reach needs "
        "RayBackend(transport='ray')"
    )
    assert describe_ray_error(error) == (
        "the rank could not connect back to the controller at 10.0.0.9:4444 ([Errno 111] "
        "Connection refused); a controller the cluster cannot reach needs "
        "RayBackend(transport='ray')"
    )
