"""A detached resource pool of GPUs on agents: its GPUs stay held past its controller
exactly as long as one of its groups runs on the node.

The agents here list GPUs 0, 1 and 2 (``CUDA_VISIBLE_DEVICES``, as in
tests/backends/test_cluster_gpus.py: this machine has none, the ranks only see the ids they
are given). A controller in a process of its own reserves a detached pool of 2 x 2 GPUs on
two agents, places a group on the first agent's two slots and is SIGKILLed. The first
agent's GPUs 0 and 1 stay held, in the dead controller's pool's name: another session's pool
is refused them, naming that holder (GPU 2 is still handed out); the second agent, where no
group ran, frees them. Another controller attaches the group (the same processes, the same
``CUDA_VISIBLE_DEVICES``), and once it shut the group down the GPUs are free for a new
pool. A group nobody attaches within the pool's ``detach_timeout`` frees them too. The
node's book itself: a share needs the pool's key, and the last share frees the GPUs.

A detached group that asked for GPUs itself (``gpus_per_worker``, no pool) keeps them the
same way: its waiting sessions hold them (another session is refused, naming the dead
controller's group), ``px.attach`` takes them over with the ranks -- a rank recreated after
it gets the GPU it had, not the node's first free one -- and shutting it down frees them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phalanx as px
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.agent.devices import NodeDevices
from tests import helpers
from tests.backends.test_cluster import agents, cluster, token_file  # noqa: F401 - fixtures
from tests.workers import Probe

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    hosts, token_file, timeout = json.loads(sys.argv[1])
    pool = px.ResourcePool(nodes=2, procs_per_node=2, gpus_per_proc=1, name="gpus",
                           detached=True, detach_timeout=timeout,
                           backend=px.ClusterBackend(hosts, token_file=token_file))
    first, _ = pool.split([2, 2])  # the first agent's slots; none on the second's
    group = px.WorkerGroup(Probe, pool=first, name="learner", echo_output=False)
    group.call("record", "learning")
    print(json.dumps({"pids": group.call("pid"),
                      "cuda": [e["CUDA_VISIBLE_DEVICES"]
                               for e in group.call("env", "CUDA_VISIBLE_DEVICES")]}),
          flush=True)
    time.sleep(120)  # SIGKILLed here
""")


GROUP_CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    hosts, token_file, timeout = json.loads(sys.argv[1])
    group = px.WorkerGroup(Probe, nodes=2, procs_per_node=2, gpus_per_worker=1,
                           name="learner", detached=True, detach_timeout=timeout,
                           backend=px.ClusterBackend(hosts, token_file=token_file),
                           echo_output=False)
    group.call("record", "learning")
    print(json.dumps({"pids": group.call("pid"),
                      "cuda": [e["CUDA_VISIBLE_DEVICES"]
                               for e in group.call("env", "CUDA_VISIBLE_DEVICES")]}),
          flush=True)
    time.sleep(120)  # SIGKILLed here
""")


@pytest.fixture
def gpu_agents(agents, monkeypatch, tmp_path):  # noqa: F811 - the fixture imported above
    """Two agents of this test's own, each listing GPUs 0, 1 and 2, logging (``-v``) to
    ``tmp_path/agent-N.log``."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    started = []
    for n, host in enumerate(("127.0.0.8", "127.0.0.9")):
        log = tmp_path / f"agent-{n}.log"
        agent = agents(host, "-v", log=str(log))
        agent.log = log
        started.append(agent)
    return started


def _controller(hosts: list[str], tokens: str, timeout: float, script: str = CONTROLLER
                ) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps([hosts, tokens, timeout])],
        stdout=subprocess.PIPE, text=True, cwd=helpers.REPO,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.kill()
        pytest.fail(f"the controller ended before starting its group (code {proc.wait(30)})")
    return proc, json.loads(line)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(30)
    proc.stdout.close()  # type: ignore[union-attr]


def _pool_takes(agent, tokens: str, gpus: int = 3) -> list[str] | None:
    """The GPUs a pool of ``gpus`` slots gets on ``agent`` (its group says), or None when
    they are held."""
    try:
        pool = px.ResourcePool(nodes=1, procs_per_node=gpus, gpus_per_proc=1,
                               backend=cluster([agent], tokens))
    except px.DevicesTaken:
        return None
    with pool, px.WorkerGroup(Probe, pool=pool, echo_output=False) as group:
        return [e["CUDA_VISIBLE_DEVICES"] for e in group.call("env", "CUDA_VISIBLE_DEVICES")]


def test_a_detached_pools_gpus_stay_held_while_its_group_runs_and_free_after(
        gpu_agents, token_file):  # noqa: F811
    first, second = gpu_agents
    proc, started = _controller([first.address, second.address], token_file, 60)
    pids = started["pids"]
    try:
        assert started["cuda"] == ["0", "1"]
        _kill(proc)
        # the pool's connection ended: the group's session holds the GPUs on for it
        assert helpers.wait_until(lambda: "stay held" in _log(first), 15), _log(first)
        with pytest.raises(px.DevicesTaken) as info:
            px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=1,
                            backend=cluster([first], token_file))
        message = str(info.value)
        assert f"agent at {first.address}" in message, message
        assert "gpus of the controller on" in message and f"(pid {proc.pid})" in message
        assert "holds 0, 1" in message, message
        with px.WorkerGroup(Probe, gpus_per_worker=1, backend=cluster([first], token_file),
                            echo_output=False) as other:  # what is free is handed out
            assert other.call("env", "CUDA_VISIBLE_DEVICES") == [
                {"CUDA_VISIBLE_DEVICES": "2"}]
        # the second agent ran no group of the pool: its GPUs went with the controller
        assert helpers.wait_until(lambda: _pool_takes(second, token_file) is not None, 15)

        group = px.attach("learner", backend=cluster([first, second], token_file),
                          echo_output=False)
        try:
            assert group.call("pid") == pids  # the same processes
            assert [e["CUDA_VISIBLE_DEVICES"] for e in group.call(
                "env", "CUDA_VISIBLE_DEVICES")] == ["0", "1"]
            assert group.call("history") == [["learning"], ["learning"]]
            assert _pool_takes(first, token_file, gpus=2) is None  # still its, attached
        finally:
            group.shutdown()
        assert helpers.wait_until(lambda: not helpers.alive(pids), 15)
        # shut down for good: the last share of the pool's hold is gone, the GPUs free
        taken: list[list[str] | None] = []
        assert helpers.wait_until(lambda: bool(taken.append(_pool_takes(first, token_file))
                                               or taken[-1]), 15)
        assert taken[-1] == ["0", "1", "2"]
    finally:
        if proc.poll() is None:
            _kill(proc)


def test_a_detached_pools_gpus_are_freed_when_nobody_attaches_in_time(
        gpu_agents, token_file):  # noqa: F811
    first, second = gpu_agents
    proc, started = _controller([first.address, second.address], token_file, 3)
    try:
        _kill(proc)
        assert helpers.alive(started["pids"]) == started["pids"]
        assert _pool_takes(first, token_file, gpus=1) == ["2"]  # 0 and 1 kept for the group
        # nobody attached within detach_timeout: the ranks end, and the GPUs are free
        assert helpers.wait_until(lambda: not helpers.alive(started["pids"]), 30)
        assert helpers.wait_until(lambda: _pool_takes(first, token_file) is not None, 15)
    finally:
        if proc.poll() is None:
            _kill(proc)


def _cuda(group: px.WorkerGroup) -> list[str]:
    return [e["CUDA_VISIBLE_DEVICES"] for e in group.call("env", "CUDA_VISIBLE_DEVICES")]


def test_a_detached_group_that_holds_gpus_itself_is_attached_on_the_same_gpus(
        gpu_agents, token_file):  # noqa: F811
    """Not through a pool: the group's own hold (``gpus_per_worker``) stays with its
    waiting sessions, and the controller that attaches takes it over -- the same GPUs for
    the ranks it recreates -- until the group is shut down."""
    first, second = gpu_agents
    # GPU 0 of the first node is busy while the group starts: it gets 1 and 2 there, not
    # the first ids the agent lists (what a rank recreated after the attach must get too)
    with px.WorkerGroup(Probe, gpus_per_worker=1, backend=cluster([first], token_file),
                        echo_output=False) as busy:
        assert _cuda(busy) == ["0"]
        proc, started = _controller([first.address, second.address], token_file, 60,
                                    GROUP_CONTROLLER)
    pids = started["pids"]
    try:
        assert started["cuda"] == ["1", "2", "0", "1"]
        _kill(proc)
        assert helpers.wait_until(lambda: "another may attach" in _log(first), 15), _log(first)
        # while the group waits its GPUs are its own: another session is refused them,
        # naming the dead controller's group, and gets only what is free
        with pytest.raises(px.DevicesTaken) as info:
            px.WorkerGroup(Probe, procs_per_node=2, gpus_per_worker=1,
                           backend=cluster([first], token_file), echo_output=False)
        message = str(info.value)
        assert f"agent at {first.address}" in message, message
        assert "group learner" in message and f"(pid {proc.pid}) holds 1, 2" in message, \
            message
        with px.WorkerGroup(Probe, gpus_per_worker=1, backend=cluster([first], token_file),
                            echo_output=False) as other:
            assert _cuda(other) == ["0"]

        group = px.attach("learner", backend=cluster([first, second], token_file),
                          echo_output=False)
        try:
            assert group.call("pid") == pids  # the same processes, on the same GPUs
            assert _cuda(group) == ["1", "2", "0", "1"]
            assert group.call("history") == [["learning"]] * 4
            assert _pool_takes(first, token_file, gpus=2) is None  # still its, attached
            assert _pool_takes(second, token_file, gpus=2) is None
            group.recreate(0)  # a fresh process gets the GPU its rank had
            fresh = group.call("pid")
            assert fresh[0] != pids[0] and fresh[1:] == pids[1:]
            assert _cuda(group) == ["1", "2", "0", "1"]
        finally:
            group.shutdown()
        assert helpers.wait_until(lambda: not helpers.alive([*pids, *fresh]), 15)
        # shut down for good: its sessions ended, and every GPU is free
        assert _once_free(first, token_file) == ["0", "1", "2"]
        assert _once_free(second, token_file) == ["0", "1", "2"]
    finally:
        if proc.poll() is None:
            _kill(proc)


def _once_free(agent, tokens: str) -> list[str] | None:
    """The GPUs a pool of all three gets on ``agent`` once they are free (within 15 s: the
    sessions of a group shut down end on their own), or None."""
    taken: list[list[str] | None] = [None]
    helpers.wait_until(lambda: bool(taken.append(_pool_takes(agent, tokens)) or taken[-1]), 15)
    return taken[-1]


def _log(agent) -> str:
    """What the agent logged so far."""
    path: Path = agent.log
    return path.read_text() if path.exists() else ""


def test_a_nodes_book_shares_a_pools_gpus_only_with_its_key_until_the_last_share_ends():
    node = NodeDevices(["0", "1", "2"])
    pool, group, colocated, stranger = object(), object(), object(), object()
    name, key = "pool-1 of the controller on h (pid 42)", b"k" * 32
    shared = [agentwire.DEVICES_SHARED, key]
    share = [agentwire.DEVICES_SHARE, key]
    assert node.take(pool, 2, name, shared) == {"gpus": ["0", "1"]}
    assert node.take(group, 0, name, share) == {"gpus": ["0", "1"]}
    assert node.take(colocated, 0, name, share) == {"gpus": ["0", "1"]}
    assert node.held(group) == ["0", "1"] and node.held(stranger) == []  # what DESCRIBE says
    refused = node.take(stranger, 0, name, [agentwire.DEVICES_SHARE, b"x" * 32])
    assert "another controller's session holds GPUs as" in refused["refused"], refused
    assert "refused" in node.take(stranger, 1, name)  # nor by asking under its name
    assert "refused" in node.take(stranger, 0, name, [b"steal", key])  # no such mode
    assert "shared with 2 other session" in node.take(pool, 3, name)["refused"]
    assert node.release(pool) == []  # the pool's connection ended: its groups hold on
    assert node.take(group, 0, name) == {"gpus": []}  # a group closed: lets go of its share
    assert node.holders() == {name: ["0", "1"]}
    assert node.release(colocated) == [name]  # the last share: free again
    assert node.holders() == {}
    assert "refused" in node.take(group, 0, name, share)  # nothing held to share now
    assert node.take(stranger, 3, "another") == {"gpus": ["0", "1", "2"]}
