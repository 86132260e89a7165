"""Detached groups on the Ray backend: ranks kept by phalanx agents that are detached Ray
actors, on the suite's real Ray cluster (127.0.0.2-4).

A driver in a process of its own starts a detached group with ``px.RayBackend`` (a node
of it per Ray node), records state on its ranks, starts a long call and is SIGKILLed in the
middle of it. This process, another driver of the same cluster, finds the group by its name
and namespace (``px.attached``, ``px.attach``) and holds the very same ranks: their pids,
state, the answers of the call that was running, and new calls. Once it shuts the group
down, the agents' actors, their placement group and their keys in Ray's store are gone;
nobody attaching within ``detach_timeout`` ends it the same way. A detached resource pool on
Ray is the same: its agents' groups, placed by ``pool.split``, are attached each by its own
name after their driver is killed (listed by ``phalanx ps --ray``, each with its GPU), and
the last one shut down leaves nothing of the pool; nor does a pool its driver closes.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import phalanx as px
from phalanx.cli import ps
from tests import helpers, raycluster
from tests.workers import Probe

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")

NAMESPACE = "phalanx-detached-test"
# a loaded two-core machine starts a Ray actor, its agent and the ranks in seconds; these
# bound what should take one or two
START_BOUND = 120.0
END_BOUND = 45.0

DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    import phalanx as px
    from tests.workers import Probe

    address, host, repo, namespace, name, timeout = json.loads(sys.argv[1])
    # connected as the suite connects (tests/raycluster.py): loopback node addresses
    ray.init(address=address, _node_ip_address=host, log_to_driver=False)
    group = px.WorkerGroup(Probe, nodes=2, procs_per_node=1,
                           backend=px.RayBackend(namespace=namespace), name=name,
                           detached=True, detach_timeout=timeout, echo_output=False)
    group.call("record", "before")
    print(json.dumps({"pids": group.call("pid"), "nodes": group.call("ray_node")}),
          flush=True)
    running = group.call_async("sleep", 2.0, "slept")
    time.sleep(0.3)
    print("running", flush=True)
    time.sleep(120)  # killed here, inside the running call
""")


POOL_DRIVER = textwrap.dedent("""
    import json, sys, time
    import ray
    import phalanx as px
    from tests.workers import Probe

    address, host, repo, namespace, name, timeout = json.loads(sys.argv[1])
    ray.init(address=address, _node_ip_address=host, log_to_driver=False)
    pool = px.ResourcePool(nodes=2, procs_per_node=1, gpus_per_proc=1, name=name,
                           detached=True, detach_timeout=timeout,
                           backend=px.RayBackend(namespace=namespace))
    first, second = pool.split([1, 1])
    learner = px.WorkerGroup(Probe, pool=first, name="learner", echo_output=False)
    actor = px.WorkerGroup(Probe, pool=second, name="actor", echo_output=False)
    learner.call("record", "learning")
    actor.call("record", "acting")
    print(json.dumps({"learner": learner.call("pid"), "actor": actor.call("pid"),
                      "nodes": learner.call("ray_node") + actor.call("ray_node"),
                      "gpus": [learner.call("env", "CUDA_VISIBLE_DEVICES"),
                               actor.call("env", "CUDA_VISIBLE_DEVICES")]}), flush=True)
    print("running", flush=True)
    time.sleep(120)  # killed here
""")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    return ray_cluster


def _driver(cluster, name: str, timeout: float, script: str = DRIVER
            ) -> tuple[subprocess.Popen, dict]:
    """A driver process that started detached group ``name`` and runs a call in it (or
    what ``script`` does); what it printed."""
    args = json.dumps([cluster.address, raycluster.NODE_ADDRESSES[0], str(helpers.REPO),
                       NAMESPACE, name, timeout])
    proc = subprocess.Popen([sys.executable, "-c", script, args], cwd=helpers.REPO,
                            env=helpers.script_env(), stdout=subprocess.PIPE, text=True)
    said: queue.Queue[str] = queue.Queue()  # read aside: both lines may come in one read
    threading.Thread(target=_read, args=(proc, said), daemon=True).start()
    lines = []
    for _ in range(2):
        try:
            lines.append(said.get(timeout=START_BOUND))
        except queue.Empty:
            lines.append("")
    if not lines[0] or lines[1] != "running\n":
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail(f"the driver did not start its detached group: {lines!r}")
    return proc, json.loads(lines[0])


def _read(proc: subprocess.Popen, said: queue.Queue[str]) -> None:
    """Hand each line the driver prints on; its pipe is closed at its end (its kill)."""
    with proc.stdout:  # type: ignore[union-attr]
        for line in proc.stdout:  # type: ignore[union-attr]
            said.put(line)


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _agent_actors(name: str) -> list[str]:
    """The group's agent actors Ray still has alive."""
    alive = []
    for node in range(2):
        try:
            ray.get_actor(f"phalanx-agent-{name}-n{node}", namespace=NAMESPACE)
        except ValueError:
            continue
        alive.append(f"node {node}")
    return alive


def _left_on_ray(name: str) -> list[str]:
    """Whatever of group ``name``'s agents Ray still holds: actors, keys, placement group."""
    from ray.experimental import internal_kv

    from phalanx.backends.ray import detached

    keys = internal_kv._internal_kv_list(json.dumps([NAMESPACE, name])[:-1],
                                         namespace=detached.STORE)
    groups = [info["name"] for info in ray.util.placement_group_table().values()
              if info.get("state") != "REMOVED"
              and info.get("name") == f"phalanx-detached-{name}"]
    return _agent_actors(name) + [f"key {k!r}" for k in keys] + groups


def test_a_killed_drivers_group_is_attached_from_another_and_ends_with_nothing_left(cluster):
    proc, started = _driver(cluster, "policy", timeout=60.0)
    assert len(set(started["nodes"])) == 2  # a Ray node per node of the group
    _kill(proc)  # inside the 2 s call
    backend = px.RayBackend(namespace=NAMESPACE)
    assert _agent_actors("policy") == ["node 0", "node 1"]  # kept past their driver
    listed = px.attached(backend)
    assert [(g["name"], g["ranks"]) for g in listed] == [("policy", [0, 1])]
    with pytest.raises(ValueError, match="a detached group named 'policy' runs in Ray "
                                         "namespace"):
        px.WorkerGroup(Probe, backend=backend, name="policy", detached=True)
    group = px.attach("policy", backend=backend, echo_output=False)
    try:
        assert group.call("pid") == started["pids"]  # the same processes: 0 restarts
        assert group.call("history") == [["before"], ["before"]]  # their state
        assert helpers.wait_until(lambda: len(group.orphaned()) == 2, 10)
        assert [(o.rank, o.method, o.value, o.error) for o in group.orphaned()] == [
            (0, "sleep", "slept", None), (1, "sleep", "slept", None)]
        assert group.call("add", 1, 2) == [3, 3]
    finally:
        group.shutdown()
    assert helpers.wait_until(lambda: not helpers.alive(started["pids"]), END_BOUND)
    assert helpers.wait_until(lambda: not _left_on_ray("policy"), END_BOUND, interval=0.5), \
        _left_on_ray("policy")
    assert px.attached(backend) == []


def test_nobody_attaching_within_the_timeout_ends_the_ranks_and_their_agents(cluster):
    proc, started = _driver(cluster, "left-alone", timeout=5.0)
    _kill(proc)
    assert helpers.alive(started["pids"]) == started["pids"]  # kept a while
    assert helpers.wait_until(lambda: not helpers.alive(started["pids"]), END_BOUND)
    assert helpers.wait_until(lambda: not _left_on_ray("left-alone"), END_BOUND,
                              interval=0.5), _left_on_ray("left-alone")
    with pytest.raises(LookupError, match="no detached group named 'left-alone'"):
        px.attach("left-alone", backend=px.RayBackend(namespace=NAMESPACE))


def test_what_a_detached_group_on_ray_cannot_be_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="procs_per_node as a number"):
        px.WorkerGroup(Probe, procs_per_node="auto", backend=px.RayBackend(), name="auto",
                       detached=True)
    with pytest.raises(ValueError, match="Ray Client"):
        px.WorkerGroup(Probe, backend=px.RayBackend(transport="ray"), name="relayed",
                       detached=True)
    with pytest.raises(ValueError, match="Ray Client"):
        px.ResourcePool(backend=px.RayBackend(transport="ray"), name="relayed",
                        detached=True)


def test_a_detached_pools_groups_are_attached_each_by_its_name_and_leave_nothing(
        cluster, capsys):
    proc, started = _driver(cluster, "rl", timeout=60.0, script=POOL_DRIVER)
    assert len(set(started["nodes"])) == 2  # a Ray node per node of the pool
    _kill(proc)
    pids = started["learner"] + started["actor"]
    assert helpers.alive(pids) == pids  # the pool's agents keep its groups
    assert _agent_actors("rl") == ["node 0", "node 1"]
    backend = px.RayBackend(namespace=NAMESPACE)
    listed = {g["name"]: (g["ranks"], g["holder"]) for g in px.attached(backend)}
    assert listed == {"learner": ([0], None), "actor": ([0], None)}
    assert ps.main(argparse.Namespace(hosts=None, token_file=None, slurm_job=None,
                                      state_dir=None, ray=cluster.address,
                                      namespace=NAMESPACE)) == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]) \
        == ["actor", "learner"]  # phalanx ps --ray ADDRESS
    learner = px.attach("learner", backend=backend, echo_output=False)
    actor = None
    try:
        actor = px.attach("actor", backend=backend, echo_output=False)
        assert learner.call("pid") == started["learner"]  # the same processes
        assert actor.call("pid") == started["actor"]
        assert learner.call("history") == [["learning"]]  # their state
        assert actor.call("history") == [["acting"]]
        assert actor.call("ray_node") == started["nodes"][1:]  # on the pool's node 1
        # a GPU of the pool's bundle each (as Ray gave it to the node's agent), kept
        assert [learner.call("env", "CUDA_VISIBLE_DEVICES"),
                actor.call("env", "CUDA_VISIBLE_DEVICES")] == started["gpus"]
        assert all(len(g[0]["CUDA_VISIBLE_DEVICES"].split(",")) == 1
                   for g in started["gpus"])
        learner.shutdown()
        assert helpers.alive(started["actor"]) == started["actor"]  # the other group runs on
        assert actor.call("add", 1, 2) == [3]
    finally:
        for group in (learner, actor):
            if group is not None:
                group.shutdown()
    assert helpers.wait_until(lambda: not helpers.alive(pids), END_BOUND)
    assert helpers.wait_until(lambda: not _left_on_ray("rl"), END_BOUND, interval=0.5), \
        _left_on_ray("rl")
    assert px.attached(backend) == []
    with pytest.raises(LookupError, match="no detached group named 'learner'"):
        px.attach("learner", backend=backend)


def test_a_detached_pool_its_driver_closes_leaves_nothing_on_ray(cluster):
    backend = px.RayBackend(namespace=NAMESPACE)
    pool = px.ResourcePool(nodes=2, name="closed", detached=True, detach_timeout=30,
                           backend=backend)
    try:
        group = px.WorkerGroup(Probe, pool=pool.split([1, 1])[0], name="closing",
                               echo_output=False)
        pids = group.call("pid")
        assert [g["name"] for g in px.attached(backend)] == ["closing"]
        with pytest.raises(ValueError, match="a detached resource pool named 'closed' runs"):
            px.WorkerGroup(Probe, backend=backend, name="closed", detached=True)
    finally:
        pool.close()  # its group ends, and the node none ran on with it
    assert helpers.wait_until(lambda: not helpers.alive(pids), END_BOUND)
    assert helpers.wait_until(lambda: not _left_on_ray("closed"), END_BOUND, interval=0.5), \
        _left_on_ray("closed")
