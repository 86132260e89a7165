"""The ray backend on a real three-node Ray cluster (``ray.cluster_utils.Cluster`` on
127.0.0.2-4): placement, the truth of the rendezvous variables per node, real gloo
collectives across Ray nodes, deaths with Ray's account of them, and nothing left behind.
The contract suite (tests/contract) runs on this backend too; this file holds what only
Ray has."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time

import psutil
import pytest

import phalanx as px
from phalanx import StartupError, WorkerDied
from tests import helpers, raycluster
from tests.trees import Tracked
from tests.workers import Probe, Supervised

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def ranks():
    return helpers.RankControl(reports_signal=True)


def where(group) -> list[dict]:
    """Each rank's rendezvous variables and the Ray node it really runs on."""
    names = ("RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT")
    envs = group.call("env", *names)
    nodes = group.call("ray_node")
    return [{**env, "node_ip": node} for env, node in zip(envs, nodes, strict=True)]


def test_a_layout_puts_each_node_of_ranks_on_its_own_ray_node():
    with px.WorkerGroup(Probe, procs_per_node=[2, 1], backend="ray",
                        echo_output=False) as group:
        assert (group.nodes, group.procs_per_node, group.world_size) == (2, (2, 1), 3)
        ranks = where(group)
    assert [r["RANK"] for r in ranks] == ["0", "1", "2"]
    assert [r["NODE_RANK"] for r in ranks] == ["0", "0", "1"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0"]
    assert [r["LOCAL_WORLD_SIZE"] for r in ranks] == ["2", "2", "1"]
    assert ranks[0]["node_ip"] == ranks[1]["node_ip"] != ranks[2]["node_ip"]
    assert {r["MASTER_ADDR"] for r in ranks} == {ranks[0]["node_ip"]}  # rank 0's node
    assert all(r["node_ip"] in raycluster.NODE_ADDRESSES for r in ranks)
    assert len({r["MASTER_PORT"] for r in ranks}) == 1


@pytest.mark.parametrize(
    ("strategy", "distinct_nodes"),
    [("PACK", {1}), ("STRICT_PACK", {1}), ("SPREAD", {2, 3}), ("STRICT_SPREAD", {3})],
)
def test_placement_strategies_place_ranks_where_ray_puts_the_bundles(strategy, distinct_nodes):
    backend = px.RayBackend(placement_strategy=strategy)
    with px.WorkerGroup(Probe, procs_per_node=3, backend=backend,
                        echo_output=False) as group:
        ranks = where(group)
        assert group.nodes in distinct_nodes
    ips = [r["node_ip"] for r in ranks]
    assert len(set(ips)) in distinct_nodes
    # ranks are numbered node by node: a node's ranks are contiguous, NODE_RANK ascending
    node_ranks = [int(r["NODE_RANK"]) for r in ranks]
    assert node_ranks == sorted(node_ranks)
    for a, b in itertools.pairwise(ranks):
        assert (a["node_ip"] == b["node_ip"]) == (a["NODE_RANK"] == b["NODE_RANK"])
        assert {a["MASTER_ADDR"], b["MASTER_ADDR"]} == {ips[0]}


def all_reduce() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return {"rank": dist.get_rank(), "sum": value.item(), "node": os.environ["NODE_RANK"]}


@pytest.mark.slow
def test_gloo_all_reduce_across_ray_nodes():
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    results = px.spmd(all_reduce, nodes=2, procs_per_node=1, framework="torch",
                      backend="ray", echo_output=False)()
    assert results == [{"rank": 0, "sum": 3.0, "node": "0"}, {"rank": 1, "sum": 3.0, "node": "1"}]


def test_a_request_no_node_can_hold_fails_at_once_saying_what_was_asked():
    backend = px.RayBackend(resources_per_worker={"CPU": 100})
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        px.WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "'CPU': 100.0" in message and "no node can hold" in message
    assert "cluster resources" in message


def test_gpus_come_from_ray_and_more_than_a_node_has_is_told_at_once():
    too_many = raycluster.GPUS_PER_NODE + 1
    with pytest.raises(StartupError,
                       match=rf"no node can hold one bundle .*'GPU': {too_many}\.0"):
        px.WorkerGroup(Probe, procs_per_node=2, gpus_per_worker=too_many, backend="ray",
                       echo_output=False)
    with pytest.raises(ValueError, match="auto"):
        px.WorkerGroup(Probe, procs_per_node="auto", framework="torch", backend="ray",
                       echo_output=False)


def test_a_request_the_busy_cluster_cannot_hold_fails_within_start_timeout():
    hog = px.RayBackend(resources_per_worker={"CPU": raycluster.CPUS_PER_NODE},
                        placement_strategy="STRICT_SPREAD")
    with px.WorkerGroup(Probe, procs_per_node=3, backend=hog, echo_output=False):
        started = time.monotonic()
        with pytest.raises(StartupError) as info:
            px.WorkerGroup(Probe, procs_per_node=1, backend="ray", echo_output=False,
                           start_timeout=2)
        elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 8
    assert "within 2 s" in str(info.value) and "start_timeout" in str(info.value)


def test_recreate_starts_a_fresh_actor_in_the_same_bundle(ranks):
    with px.WorkerGroup(Probe, procs_per_node=[1, 1], backend="ray",
                        echo_output=False) as group:
        before = where(group)
        old_pid = group.call_one(1, "pid")
        ranks.kill(group, 1)
        with pytest.raises(WorkerDied):
            group.call_one(1, "pid")
        group.recreate(1)
        assert group.call_one(1, "pid") != old_pid
        assert where(group) == before  # same node, same variables
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
        assert [n.rsplit("-", 2)[-2:] for n in names] == [["r0", "i1"], ["r1", "i2"]]


def test_an_actor_killed_through_ray_fails_its_call_with_rays_account():
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as group:
        future = group.call_async("sleep", 30, workers=[1])
        time.sleep(0.3)
        name = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].endswith("-r1-i1"))
        started = time.monotonic()
        ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]))
        with pytest.raises(WorkerDied) as info:
            future.result(timeout=10)
        # promptly: not the call's 10 s (Ray's account takes a moment, more under load)
        assert time.monotonic() - started < 5
        assert info.value.rank == 1

        def cause() -> str:  # Ray's account may come a moment after the death itself
            with pytest.raises(WorkerDied) as again:
                group.call_one(1, "pid")
            return again.value.cause

        assert helpers.wait_until(lambda: "ray.kill" in cause(), 5), cause()
        assert group.health()[0].alive and not group.health()[1].alive


@pytest.mark.slow
def test_a_removed_node_fails_the_calls_of_its_ranks(cluster):
    extra = raycluster.add_node(cluster, "127.0.0.5")
    try:
        backend = px.RayBackend(resources_per_worker={"CPU": 1, "node:127.0.0.5": 0.001})
        with px.WorkerGroup(Probe, procs_per_node=1, backend=backend,
                            echo_output=False) as group:
            assert group.call("ray_node") == ["127.0.0.5"]
            future = group.call_async("sleep", 60)
            time.sleep(0.3)
            started = time.monotonic()
            cluster.remove_node(extra)
            extra = None
            with pytest.raises(WorkerDied) as info:
                future.result(timeout=30)
            assert time.monotonic() - started < 10
            assert info.value.rank == 0
    finally:
        if extra is not None:
            cluster.remove_node(extra)


def test_rank_output_is_shown_once_with_its_rank_prefix(capfd):
    with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", collapse_output=False) as g:
        g.call_one(1, "print_once", "a line from a ray rank")
    time.sleep(1.5)  # Ray's own log forwarding would have repeated it by now
    out = capfd.readouterr()
    text = out.out + out.err
    assert text.count("a line from a ray rank") == 1
    assert "[rank 1] a line from a ray rank" in text


def test_shutdown_leaves_no_actor_and_no_placement_group():
    group = px.WorkerGroup(Probe, procs_per_node=3, backend="ray", echo_output=False)
    assert len(ray.util.list_named_actors(all_namespaces=True)) == 3
    group.shutdown()
    assert raycluster.leftovers() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"placement_strategy": "CLUSTERED"}, "placement_strategy must be one of"),
        ({"resources_per_worker": {"CPU": -1}}, "non-negative"),
        ({"resources_per_worker": ["CPU"]}, "must be a dict"),
    ],
)
def test_bad_ray_options_are_refused_before_anything_starts(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        px.RayBackend(**kwargs)


@pytest.mark.slow
def test_without_a_running_ray_a_local_one_is_started_and_stopped(tmp_path):
    """A controller in a process of its own (this one is connected to the test cluster):
    backend='ray' with no Ray running starts one, and leaves nothing once shut down."""
    script = helpers.write_script(tmp_path, """
        import json, phalanx as px, ray
        from tests.workers import Probe
        with px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False) as g:
            out = {"ranks": g.call("rank"), "connected": ray.is_initialized()}
        out["after"] = ray.is_initialized()
        print(json.dumps(out))
    """)
    done = _run_controller(script, timeout=120)
    assert helpers.json_lines(done.stdout)[-1] == {"ranks": [0, 1], "connected": True,
                                                    "after": False}


def _run_controller(script, timeout: float):
    """Run ``script`` as a controller of its own, off the test cluster (no RAY_ADDRESS);
    it must exit 0."""
    import subprocess

    env = helpers.script_env()
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(script)], cwd=str(script.parent), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.slow
def test_a_users_ray_shutdown_ends_the_groups_on_it_quietly(tmp_path):
    """ray.shutdown() while a group runs: its calls fail naming Ray's shutdown, its own
    shutdown (and the interpreter's exit) makes no Ray call -- none starts a new Ray, no
    traceback is printed."""
    script = helpers.write_script(tmp_path, """
        import json, ray, phalanx as px
        from tests.workers import Probe
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        g = px.WorkerGroup(Probe, procs_per_node=2, backend="ray", echo_output=False)
        assert g.call("rank") == [0, 1]
        ray.shutdown()
        try:
            g.call("rank", timeout=60)
            out = {"error": None}
        except px.PhalanxError as exc:
            out = {"error": type(exc).__name__, "text": str(exc)}
        g.shutdown()
        out["ray"] = ray.is_initialized()
        print(json.dumps(out))
    """)
    done = _run_controller(script, timeout=180)
    out = helpers.json_lines(done.stdout)[-1]
    assert out["error"] in ("WorkerDied", "GroupClosed"), out
    assert "ray.shutdown()" in out["text"], out
    assert out["ray"] is False
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_more_nodes_than_ray_has_are_virtual_nodes_unless_strict_spread_is_asked():
    """NeMo-RL's single-node development set-up: a layout of 4 nodes on the 3-node test
    cluster runs, each node its own NODE_RANK (two of them on one Ray node); a pool of 2
    nodes lands so too. STRICT_SPREAD refuses at once instead."""
    with px.WorkerGroup(Probe, nodes=4, procs_per_node=1, backend="ray",
                        echo_output=False) as group:
        seen = group.call("env", "NODE_RANK", "MASTER_ADDR")
        assert [s["NODE_RANK"] for s in seen] == ["0", "1", "2", "3"]
        assert len({s["MASTER_ADDR"] for s in seen}) == 1
        assert len(set(group.call("ray_node"))) == 3  # four nodes on three Ray nodes
    with pytest.raises(px.StartupError, match="STRICT_SPREAD needs 4 distinct nodes"):
        px.WorkerGroup(Probe, nodes=4, procs_per_node=1, echo_output=False,
                       backend=px.RayBackend(placement_strategy="STRICT_SPREAD"))
    # a pool's PACKed bundles (one Ray node, most likely) are its nodes all the same
    with px.ResourcePool(nodes=2, procs_per_node=2, backend="ray") as pool, \
            px.WorkerGroup(Probe, pool=pool, echo_output=False) as group:
        seen = group.call("env", "NODE_RANK", "LOCAL_RANK")
        assert [(s["NODE_RANK"], s["LOCAL_RANK"]) for s in seen] == [
            ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]


def test_signals_reach_a_rank_on_another_node(ranks):
    with px.WorkerGroup(Probe, procs_per_node=[1, 1], backend="ray",
                        echo_output=False) as group:
        future = group.call_async("sleep", 30, workers=[1])
        time.sleep(0.3)
        ranks.signal(group, 1, signal.SIGINT)
        with pytest.raises(px.WorkerError) as info:
            future.result(timeout=10)
        assert info.value.exc_type == "KeyboardInterrupt"


@pytest.mark.slow
def test_jax_processes_rendezvous_across_ray_nodes():
    pytest.importorskip("jax", reason="jax is not installed (pip install 'phalanx[jax]')")
    from tests.frameworks.test_jax import allgather_process_ids

    results = px.spmd(allgather_process_ids, nodes=2, framework="jax", backend="ray",
                      echo_output=False)()
    assert [r["index"] for r in results] == [0, 1]
    assert all(r["gathered"] == [0, 10] for r in results)


@pytest.mark.slow
def test_tensorflow_workers_reduce_across_ray_nodes():
    pytest.importorskip("tensorflow", reason="tensorflow is not installed")
    from tests.frameworks.test_tensorflow import strategy_all_reduce

    results = px.spmd(strategy_all_reduce, nodes=2, framework="tensorflow", backend="ray",
                      echo_output=False, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)()
    assert [(r["task"], r["node"], r["sum"]) for r in results] == [(0, 0, 3.0), (1, 1, 3.0)]


def test_calls_relayed_through_ray_behave_as_direct_ones(capfd, ranks):
    """transport="ray" (what a Ray Client driver gets): the same results, errors, output
    and deaths, carried by Ray calls through each rank's actor."""
    backend = px.RayBackend(transport="ray")
    with px.WorkerGroup(Probe, procs_per_node=2, backend=backend, collapse_output=False) as g:
        assert g.call("rank") == [0, 1]
        assert g.map("add", [1, 2], b=[10, 20]) == [11, 22]
        assert [len(s) for s in g.call("make_array", 100_000)] == [100_000] * 2
        with pytest.raises(px.WorkerError) as info:
            g.call_one(1, "raise_value_error", "relayed")
        assert info.value.rank == 1 and "relayed" in info.value.traceback
        g.call_one(0, "print_once", "a relayed line")
        future = g.call_async("sleep", 30, workers=[1])
        time.sleep(0.3)
        ranks.kill(g, 1, wait=False)
        with pytest.raises(WorkerDied) as died:
            future.result(timeout=10)
        assert died.value.signal == "SIGKILL"
        g.recreate(1)
        assert g.call("rank") == [0, 1]
    out = capfd.readouterr()
    assert (out.out + out.err).count("[rank 0] a relayed line") == 1
    assert "go through Ray's own calls" in out.err
    assert raycluster.leftovers() == []


def test_a_ray_client_address_chooses_relayed_calls():
    from phalanx.backends.ray.placement import relays

    assert relays("ray://head:10001", "auto") and relays(None, "ray")
    assert not relays("auto", "auto") and not relays("ray://head:10001", "direct")
    with pytest.raises(ValueError, match="transport must be one of"):
        px.RayBackend(transport="grpc")


@pytest.mark.slow
def test_single_controller_frameworks_run_on_node_zero_of_the_ray_nodes():
    """framework="monarch": node 0's function attaches to a worker loop on each Ray node;
    framework="ray": a Ray of the group's own spans its Ray nodes (head on node 0)."""
    pytest.importorskip("monarch", reason="monarch is not installed (pip install torchmonarch)")
    from tests.frameworks.test_monarch import spawn_actors_on_every_node
    from tests.frameworks.test_ray import use_the_cluster

    (monarch,) = px.spmd(spawn_actors_on_every_node, nodes=2, framework="monarch",
                         backend="ray", echo_output=False, timeout=120)()
    assert monarch["rank"] == 0 and monarch["ranks"] == [0, 1]
    assert {a.split("//")[1].split(":")[0] for a in monarch["allocator"]} <= set(
        raycluster.NODE_ADDRESSES)
    (inner,) = px.spmd(use_the_cluster, nodes=2, framework="ray", backend="ray",
                       echo_output=False, timeout=120)()
    assert inner["squares"] == [0, 1, 4, 9] and inner["nodes"] == 2
    assert inner["address"].split(":")[0] in raycluster.NODE_ADDRESSES


# ------------------------------------------- nothing a Ray rank starts outlives it
#
# Each rank starts sleepers in every way a worker may (``Supervised.spawn_tree``: in its
# process group, in a new session, orphaned by a shell, double-forked into a session of
# its own). Whatever ends the rank -- shutdown(), its own death, its actor's death, the
# controller's death -- they must all be gone within two seconds, as on the local backend:
# the rank runs in its actor's worker process, a subreaper, with its warden beside it.

def track_rank(tracked: Tracked, pid: int, rank: int) -> None:
    """The rank's process -- its Ray actor's worker (checked to be so) -- and its warden."""
    assert "ray::" in " ".join(psutil.Process(pid).cmdline()), \
        f"rank {rank} does not run in a Ray worker: {psutil.Process(pid).cmdline()}"
    tracked.add(pid, f"rank {rank}'s actor")
    wardens = [c for c in psutil.Process(pid).children()
               if "phalanx.node.warden" in " ".join(c.cmdline())]
    assert len(wardens) == 1, [c.cmdline() for c in psutil.Process(pid).children()]
    tracked.add(wardens[0].pid, f"rank {rank}'s warden")


def start_tracked(tracked: Tracked, ranks: int = 2):
    """A Ray group of ``Supervised`` ranks, each with its sleepers, all tracked."""
    group = px.WorkerGroup(Supervised, procs_per_node=ranks, backend="ray", echo_output=False)
    try:
        tracked.add_trees(group.call("spawn_tree", timeout=30), list(range(ranks)))
        for rank, pid in enumerate(group.call("pid")):
            track_rank(tracked, pid, rank)
    except BaseException:
        group.shutdown(timeout=5)
        raise
    return group


def test_nothing_a_ray_rank_started_outlives_shutdown(tracked):
    group = start_tracked(tracked)
    started = time.monotonic()
    group.shutdown(timeout=5)
    tracked.assert_gone(started, "shutdown()")


def test_nothing_a_killed_ray_rank_started_outlives_it(tracked):
    group = start_tracked(tracked)
    try:
        started = time.monotonic()
        group.send_signal(signal.SIGKILL, workers=[0])
        tracked.assert_gone(started, "rank 0's SIGKILL", lambda label: label.startswith("rank 0"))
        # ... while the group lives on, rank 1 with its own subprocesses
        assert group.call("whoami", workers=[1], timeout=10) == [1]
        assert len(tracked.alive(lambda label: label.startswith("rank 1"))) == 6
    finally:
        group.shutdown(timeout=5)


def test_nothing_a_ray_rank_started_outlives_its_actor(tracked):
    group = start_tracked(tracked)
    try:
        started = time.monotonic()
        ray.kill(group._backend._bundles[1].actor)  # rank 1's
        tracked.assert_gone(started, "ray.kill of rank 1's actor",
                            lambda label: label.startswith("rank 1"))
        assert len(tracked.alive(lambda label: label.startswith("rank 0"))) == 6
        assert group.call("whoami", workers=[0], timeout=10) == [0]
    finally:
        group.shutdown(timeout=5)


def test_recreate_leaves_nothing_of_the_old_ray_rank(tracked):
    group = start_tracked(tracked)
    try:
        started = time.monotonic()
        group.recreate(1, timeout=60)
        took = time.monotonic() - started
        tracked.assert_gone(time.monotonic(), f"recreate(1) (which took {took:.1f} s)",
                            lambda label: label.startswith("rank 1"))
        assert group.call("whoami", timeout=10) == [0, 1]
        assert len(tracked.alive(lambda label: label.startswith("rank 0"))) == 6
    finally:
        group.shutdown(timeout=5)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_nothing_a_ray_rank_started_outlives_a_killed_controller(tmp_path, tracked, sig):
    script = helpers.write_script(tmp_path, """
        import json, time
        import phalanx as px
        from tests.workers import Supervised

        group = px.WorkerGroup(Supervised, procs_per_node=2, backend="ray", echo_output=False)
        trees = group.call("spawn_tree", timeout=30)
        print(json.dumps({"trees": trees, "ranks": group.call("pid")}), flush=True)
        time.sleep(120)
    """)
    import select

    with helpers.running_script(script) as controller:
        ready, _, _ = select.select([controller.stdout], [], [], 90)
        assert ready, "the controller script did not start its ranks within 90 s"
        line = controller.stdout.readline()
        assert line, f"the controller script failed:\n{controller.stderr.read()[-3000:]}"
        report = json.loads(line)
        tracked.add_trees(report["trees"], [0, 1])
        for rank, pid in enumerate(report["ranks"]):
            track_rank(tracked, pid, rank)
        os.kill(controller.pid, sig)
        killed = time.monotonic()
        controller.wait(10)
        tracked.assert_gone(killed, f"the controller's {sig.name}")
        # Ray ends the dead job's actors and placement group on its own
        assert helpers.wait_until(lambda: raycluster.leftovers() == [], 20), \
            raycluster.leftovers()
