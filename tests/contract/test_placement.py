"""GPU placement, "auto" process counts and framework checks on a real group.

There is no GPU on the test machine: the device list is faked through
CUDA_VISIBLE_DEVICES, which is also how a scheduler hands a job its GPUs."""

from __future__ import annotations

import sys

import pytest

from phalanx import FrameworkNotInstalled
from tests import helpers
from tests.workers import Probe


@pytest.fixture
def machine_gpus(backend):
    """Tests of GPUs phalanx hands out from the controller machine's device list. On Ray,
    Ray assigns devices itself (CUDA_VISIBLE_DEVICES as Ray sets it; see
    tests/backends/test_ray_backend.py), and "auto" needs a count Ray only knows once the
    ranks are placed."""
    if backend != "local":
        pytest.skip(f"the {backend} backend assigns GPUs itself")


def test_gpus_per_worker_gives_each_local_rank_its_own_devices(
    make_group, monkeypatch, machine_gpus
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    group = make_group(Probe, procs_per_node=2, gpus_per_worker=2)
    seen = [env["CUDA_VISIBLE_DEVICES"] for env in group.call("env", "CUDA_VISIBLE_DEVICES")]
    assert seen == ["4,5", "6,7"]  # by local rank


def test_simulated_nodes_split_the_machines_gpus(make_group, monkeypatch, machine_gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    group = make_group(Probe, nodes=2, procs_per_node=2, gpus_per_worker=2)
    seen = [env["CUDA_VISIBLE_DEVICES"] for env in group.call("env", "CUDA_VISIBLE_DEVICES")]
    assert seen == ["0,1", "2,3", "4,5", "6,7"]  # no device is given to two ranks


@helpers.needs("torch")
def test_auto_procs_per_node_is_one_torch_rank_per_gpu(make_group, monkeypatch, machine_gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    group = make_group(Probe, procs_per_node="auto", framework="torch", gpus_per_worker=1)
    assert group.world_size == 3
    assert [e["CUDA_VISIBLE_DEVICES"] for e in group.call("env", "CUDA_VISIBLE_DEVICES")] == [
        "0", "1", "2"
    ]


@helpers.needs("torch")
def test_auto_procs_per_node_without_gpus_is_one(make_group, monkeypatch, machine_gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert make_group(Probe, procs_per_node="auto", framework="torch").world_size == 1


def test_too_few_gpus_is_refused_before_anything_starts(make_group, monkeypatch, machine_gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match="needs 4 GPUs per node, but 2 are visible"):
        make_group(Probe, procs_per_node=2, gpus_per_worker=2)
    assert not helpers.stray_children()


def test_a_missing_framework_package_fails_at_group_start(make_group, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # as if jax were not installed
    with pytest.raises(FrameworkNotInstalled) as info:
        make_group(Probe, procs_per_node=2, framework="jax")
    assert isinstance(info.value, ImportError)
    assert "'jax'" in str(info.value) and "pip install" in str(info.value)
    assert not helpers.stray_children()


def test_framework_variables_are_set_before_user_code_is_imported(make_group):
    pytest.importorskip("jax", reason="jax is not installed")
    group = make_group(Probe, nodes=2, framework="jax")
    envs = group.call("env", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "PHALANX_FRAMEWORK")
    assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert all(e["JAX_NUM_PROCESSES"] == "2" and e["PHALANX_FRAMEWORK"] == "jax" for e in envs)
    assert group.framework == "jax" and not group.single_controller


def test_simulated_nodes_see_only_their_share_of_the_gpus(make_group, monkeypatch, machine_gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    group = make_group(Probe, nodes=2, procs_per_node=2)  # no gpus_per_worker
    seen = [env["CUDA_VISIBLE_DEVICES"] for env in group.call("env", "CUDA_VISIBLE_DEVICES")]
    assert seen == ["0,1", "0,1", "2,3", "2,3"]  # LOCAL_RANK picks within the node's share
