"""One book of GPUs per agent's node, across controllers: a pool or a group that asks for
GPUs takes them from its nodes' books before any rank starts; a request for GPUs another
holder has (a pool or group of this controller or of another) is refused at once, naming the
node, the holder and what is free; closing the holder, or its controller dying, frees them.

The agents here are started with ``CUDA_VISIBLE_DEVICES=0,1,2``, so each lists three GPUs
(this machine has none: the ranks only see the ids they are given).
"""

from __future__ import annotations

import os
import select
import signal
import time

import pytest

import phalanx as px
from tests import helpers
from tests.backends.test_cluster import agents, cluster, token_file  # noqa: F401 - fixtures


class Where:
    def cuda(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def gpu_agents(agents, monkeypatch):  # noqa: F811 - the fixture imported above
    """``gpu_agents(n)``: n agents of this test's own, each listing GPUs 0, 1 and 2."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    hosts = ("127.0.0.8", "127.0.0.9")
    return lambda n: [agents(host) for host in hosts[:n]]


def test_gpus_held_on_an_agent_are_not_handed_to_another_holder(gpu_agents, token_file):  # noqa: F811
    (agent,) = gpu_agents(1)
    backend = cluster([agent], token_file)
    first = px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=1, backend=backend)
    try:
        with pytest.raises(px.DevicesTaken) as info:
            px.ResourcePool(nodes=1, procs_per_node=2, gpus_per_proc=1, backend=backend)
        message = str(info.value)
        assert f"agent at {agent.address}" in message, message
        assert f"{first.name} of the controller" in message and "holds 0, 1" in message
        assert "only 1 is free (2)" in message, message
        with pytest.raises(px.DevicesTaken, match="holds 0, 1"):
            px.WorkerGroup(Where, procs_per_node=2, gpus_per_worker=1, backend=backend,
                           echo_output=False)
        with px.WorkerGroup(Where, gpus_per_worker=1, backend=backend,
                            echo_output=False) as group:  # what is free is handed out
            assert group.call("cuda") == ["2"]
            with pytest.raises(px.DevicesTaken, match="holds 2"):
                px.ResourcePool(nodes=1, procs_per_node=1, gpus_per_proc=1, backend=backend)
        with px.WorkerGroup(Where, pool=first, echo_output=False) as placed:
            assert placed.call("cuda") == ["0", "1"]  # the pool's own GPUs
    finally:
        first.close()
    with px.ResourcePool(nodes=1, procs_per_node=3, gpus_per_proc=1,
                         backend=backend) as whole:  # closing the holder freed them
        with px.WorkerGroup(Where, pool=whole, echo_output=False) as group:
            assert group.call("cuda") == ["0", "1", "2"]


def test_another_controller_is_refused_the_gpus_one_holds_until_it_dies(
        gpu_agents, token_file, tmp_path):  # noqa: F811
    first, second = gpu_agents(2)
    script = helpers.write_script(tmp_path, f"""
        import time
        import phalanx as px

        backend = px.ClusterBackend([{first.address!r}, {second.address!r}],
                                    token_file={token_file!r})
        pool = px.ResourcePool(nodes=2, procs_per_node=2, gpus_per_proc=1, backend=backend)
        print("held", flush=True)
        time.sleep(60)
    """)
    with helpers.running_script(script) as controller:
        ready, _, _ = select.select([controller.stdout], [], [], 30)
        assert ready and controller.stdout.readline().strip() == "held"
        backend = cluster([first, second], token_file)
        with pytest.raises(px.DevicesTaken) as info:  # refused, not waited out
            px.ResourcePool(nodes=2, procs_per_node=2, gpus_per_proc=1, backend=backend)
        message = str(info.value)
        assert f"pid {controller.pid})" in message and "holds 0, 1" in message, message
        with px.WorkerGroup(Where, nodes=2, gpus_per_worker=1, backend=backend,
                            echo_output=False) as group:  # one free GPU on each node
            assert group.call("cuda") == ["2", "2"]
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(10)
    # the agents free what a controller that went away held, as soon as they see it go
    assert helpers.wait_until(lambda: _pool_fits(first, second, token_file), 10)


def _pool_fits(first, second, tokens: str) -> bool:
    try:
        pool = px.ResourcePool(nodes=2, procs_per_node=3, gpus_per_proc=1,
                               backend=cluster([first, second], tokens))
    except px.DevicesTaken:
        return False
    pool.close()
    return True


def test_a_pool_asking_more_gpus_than_an_agent_lists_names_the_node(gpu_agents, token_file):  # noqa: F811
    (agent,) = gpu_agents(1)
    with pytest.raises(ValueError, match=f"agent at {agent.address}.*lists 3 \\(0, 1, 2\\)"):
        px.ResourcePool(nodes=1, procs_per_node=4, gpus_per_proc=1,
                        backend=cluster([agent], token_file))
    with px.ResourcePool(nodes=1, procs_per_node=3, gpus_per_proc=1,
                         backend=cluster([agent], token_file)):
        pass  # the refused pool held nothing


def test_a_group_holding_gpus_shuts_down_as_promptly_as_one_without(gpu_agents, token_file):  # noqa: F811
    """Its GPUs are given back as it closes, and the agent's answer read at once: the
    shutdown of a group that holds GPUs took the give-back's whole 5 s wait, for an
    answer nobody read any more."""
    from phalanx.backends.cluster.gpus import GIVE_BACK_TIMEOUT

    (agent,) = gpu_agents(1)
    backend = cluster([agent], token_file)

    def shutdown_seconds(gpus: int) -> float:
        group = px.WorkerGroup(Where, gpus_per_worker=gpus, backend=backend,
                               echo_output=False)
        group.call("cuda")
        started = time.monotonic()
        group.shutdown()
        return time.monotonic() - started

    without = shutdown_seconds(0)
    holding = shutdown_seconds(1)
    # relative to the same shutdown without GPUs, with half the wait's margin for a load
    assert holding < without + GIVE_BACK_TIMEOUT / 2, (holding, without)
    with px.WorkerGroup(Where, procs_per_node=3, gpus_per_worker=1, backend=backend,
                        echo_output=False) as whole:  # free again, all of them, at once
        assert whole.call("cuda") == ["0", "1", "2"]
