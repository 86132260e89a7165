"""The ray backend's pure rules: bundles, what can never be placed, rank order, the bundles
of a user's placement group, a @ray.remote class's options, and how Ray's account of a
death is put in one line. No Ray needed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.backends.base import plain_target
from phalanx.backends.ray.placement import (
    bundle_for,
    bundle_shortfall,
    bundles_of_ranks,
    check_bundle_indices,
    check_resources,
    class_settings,
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


def test_fractions_are_resources_as_ray_spells_them():
    assert check_resources({"GPU": 0.5, "CPU": 1}) == {"GPU": 0.5, "CPU": 1}
    assert bundle_for({"GPU": 0.5, "CPU": 1}, 0) == {"GPU": 0.5, "CPU": 1.0}
    with pytest.raises(ValueError, match="finer than Ray counts"):
        check_resources({"GPU": 0.00001})
    with pytest.raises(ValueError, match="non-negative"):
        check_resources({"GPU": -0.5})


def test_bundle_indices_are_distinct_indices_of_the_group():
    assert check_bundle_indices(None, 3) is None
    assert check_bundle_indices((2, 0), 3) == [2, 0]
    assert check_bundle_indices([5], None) == [5]  # the count is not known yet
    for bad, error, words in [([], TypeError, "non-empty list"), ("01", TypeError, "list"),
                              ([0, True], ValueError, "True"), ([1, -1], ValueError, "-1"),
                              ([1, 1, 0], ValueError, r"distinct: \[1\]"),
                              ([0, 3], ValueError, "has 3 bundles")]:
        with pytest.raises(error, match=words):
            check_bundle_indices(bad, 3)


def test_rank_i_takes_bundle_i_or_the_ith_index_and_too_many_ranks_name_both():
    assert bundles_of_ranks(2, 4, None) == [0, 1]
    assert bundles_of_ranks(2, 4, [3, 1, 0]) == [3, 1]
    with pytest.raises(ValueError, match=r"a group of 5 ranks needs 5 bundles .* has 3 bundles"):
        bundles_of_ranks(5, 3, None)
    with pytest.raises(ValueError, match=r"3 ranks .* bundle_indices names 2 of its 4 bundles"):
        bundles_of_ranks(3, 4, [0, 1])


def test_a_rank_asking_more_than_its_bundle_names_both():
    specs = {0: {"CPU": 2.0, "GPU": 1.0}, 1: {"CPU": 1.0}}
    half = {"CPU": 1.0, "GPU": 0.5}
    assert bundle_shortfall([half], [0], specs) is None
    assert bundle_shortfall([specs[0], specs[1]], [0, 1], specs) is None
    problem = bundle_shortfall([half, half], [0, 1], specs)
    assert problem == ("each rank asks {'CPU': 1.0, 'GPU': 0.5}, but bundle 1 of the placement "
                       "group has {'CPU': 1.0} (short of ['GPU'])")
    # thirds add up to a whole within Ray's precision
    assert bundle_shortfall([{"GPU": 1 / 3 * 3}], [0], specs) is None


def test_a_ray_class_gives_its_resources_and_runtime_env():
    env = {"env_vars": {"A": "1"}}
    assert class_settings({}, "C", None, None) == (None, None)
    assert class_settings({"num_cpus": 1}, "C", None, None) == ({"CPU": 1}, None)
    assert class_settings({"num_gpus": 0.5, "resources": {"x": 1}, "runtime_env": env}, "C",
                          None, None) == ({"x": 1, "GPU": 0.5}, env)
    # the backend's, when the class says nothing or the same
    assert class_settings({}, "C", {"CPU": 2}, env) == ({"CPU": 2}, env)
    assert class_settings({"num_cpus": 2}, "C", {"CPU": 2.0}, None) == ({"CPU": 2.0}, None)
    with pytest.raises(ValueError, match=r"C asks @ray.remote\(num_gpus=1\) per rank, but "
                                         r"RayBackend\(resources_per_worker=\{'GPU': 0.5\}\)"):
        class_settings({"num_gpus": 1}, "C", {"GPU": 0.5}, None)
    with pytest.raises(ValueError, match=r"runtime_env=.*RayBackend\(runtime_env="):
        class_settings({"runtime_env": env}, "C", None, {"pip": ["x"]})


@pytest.mark.parametrize(("option", "instead"), [
    ("max_restarts", "group.recreate"), ("max_concurrency", "WorkerGroup(concurrency=N)"),
    ("concurrency_groups", "WorkerGroup(concurrency=N)"), ("lifetime", "as long as the group"),
    ("scheduling_strategy", "placement_group="), ("label_selector", "remove it"),
])
def test_other_ray_class_options_are_refused_saying_what_to_write_instead(option, instead):
    with pytest.raises(ValueError) as info:
        class_settings({"num_cpus": 1, option: 3}, "Trainer", None, None)
    message = str(info.value)
    assert f"@ray.remote({option}=...) of Trainer" in message and instead in message


def test_a_plain_target_is_itself_and_a_ray_class_its_class_underneath():
    class Plain:
        pass

    assert plain_target(Plain) == (Plain, {}, "")
    assert plain_target(len) == (len, {}, "")
    ray = pytest.importorskip("ray")
    wrapped = ray.remote(num_cpus=1, max_restarts=2)(Plain)
    assert plain_target(wrapped) == (Plain, {"num_cpus": 1, "max_restarts": 2},
                                     Plain.__qualname__)
    assert plain_target(ray.remote(Plain))[:2] == (Plain, {})


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
