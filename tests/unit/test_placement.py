"""Deciding where workers go before any starts: visible GPUs, installed packages, layout
checks and fresh ports. No process is started."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from phalanx import placement
from phalanx.errors import FrameworkNotInstalled, PhalanxError
from phalanx.frameworks import FRAMEWORKS, Layout, get_framework, gpu_env, worker_env
from phalanx.placement import Placement, new_launch, place, require_package, visible_gpus

PACKAGED = [name for name, fw in FRAMEWORKS.items() if fw.package is not None]


@pytest.fixture(autouse=True)
def no_driver_gpus(monkeypatch, tmp_path):
    """The test machine has no GPU (and results must not depend on the one running them):
    point the driver's GPU directory at a path that does not exist."""
    monkeypatch.setattr(placement, "NVIDIA_GPUS_DIR", str(tmp_path / "no-nvidia-driver"))


def fake_driver_gpus(monkeypatch, tmp_path, count: int) -> None:
    # faked: there is no GPU (nor NVIDIA driver) on the test machine, so the directory the
    # driver fills with one entry per GPU is made up here
    gpus_dir = tmp_path / "nvidia-gpus"
    gpus_dir.mkdir()
    for i in range(count):
        (gpus_dir / f"0000:{i:02x}:00.0").mkdir()
    monkeypatch.setattr(placement, "NVIDIA_GPUS_DIR", str(gpus_dir))


def installed(monkeypatch, *packages: str) -> None:
    """Make ``packages`` importable as far as find_spec can tell, installed here or not."""
    for package in packages:
        module = types.ModuleType(package)
        module.__spec__ = importlib.machinery.ModuleSpec(package, None)
        monkeypatch.setitem(sys.modules, package, module)


def missing(monkeypatch, package: str) -> None:
    # a None entry in sys.modules makes importlib.util.find_spec return None: "not installed"
    monkeypatch.setitem(sys.modules, package, None)


# -- visible GPUs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("3,1", ("3", "1")), ("0, 2", ("0", "2")), ("", ()), ("GPU-ab12", ("GPU-ab12",))],
)
def test_cuda_visible_devices_wins_over_the_driver(monkeypatch, tmp_path, value, expected):
    fake_driver_gpus(monkeypatch, tmp_path, 8)
    # an empty CUDA_VISIBLE_DEVICES hides every GPU, as it does for CUDA itself
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == expected


def test_without_cuda_visible_devices_every_driver_gpu_is_visible(monkeypatch, tmp_path):
    fake_driver_gpus(monkeypatch, tmp_path, 3)
    assert visible_gpus({}) == ("0", "1", "2")
    assert visible_gpus({"OTHER": "x"}) == ("0", "1", "2")


def test_no_driver_means_no_gpus(monkeypatch, tmp_path):
    assert visible_gpus({}) == ()  # the directory does not exist
    unreadable = tmp_path / "not-a-directory"
    unreadable.write_text("")
    monkeypatch.setattr(placement, "NVIDIA_GPUS_DIR", str(unreadable))
    assert visible_gpus({}) == ()


def test_visible_gpus_reads_the_process_environment_by_default(monkeypatch, tmp_path):
    fake_driver_gpus(monkeypatch, tmp_path, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert visible_gpus() == ("5",)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ("0", "1")


# -- installed packages ---------------------------------------------------------------------


@pytest.mark.parametrize("name", PACKAGED)
def test_missing_package_is_a_clear_import_error(monkeypatch, name):
    framework = get_framework(name)
    missing(monkeypatch, framework.package)
    with pytest.raises(FrameworkNotInstalled) as info:
        require_package(framework)
    error = info.value
    assert isinstance(error, ImportError)  # `except ImportError` keeps working
    assert isinstance(error, PhalanxError)
    message = str(error)
    assert f"framework={name!r}" in message
    assert repr(framework.package) in message
    assert framework.install in message
    assert (error.framework, error.package, error.install) == (
        name,
        framework.package,
        framework.install,
    )


@pytest.mark.parametrize("name", PACKAGED)
def test_installed_package_is_accepted(monkeypatch, name):
    framework = get_framework(name)
    installed(monkeypatch, framework.package)
    require_package(framework)  # does not raise


@pytest.mark.parametrize("name", [None, "spmd"])
def test_plain_spmd_needs_no_package(monkeypatch, name):
    for package in ("torch", "jax"):
        missing(monkeypatch, package)
    require_package(get_framework(name))
    assert place(name, 2, 2, 0, environ={}).layout == Layout(2, 2)


def test_place_reports_a_missing_package_before_anything_starts(monkeypatch):
    missing(monkeypatch, "jax")
    with pytest.raises(FrameworkNotInstalled, match="jax"):
        place(framework="jax", nodes=1, procs_per_node=1, gpus_per_worker=0, environ={})


# -- place ----------------------------------------------------------------------------------


def test_auto_procs_per_node_is_one_torch_process_per_visible_gpu(monkeypatch):
    installed(monkeypatch, "torch")
    result = place("torch", 1, "auto", 1, environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert isinstance(result, Placement)
    assert result.framework is get_framework("torch")
    assert result.layout == Layout(nodes=1, procs_per_node=3)
    assert result.gpus == ("0", "1", "2")
    assert result.gpus_per_worker == 1


def test_auto_counts_gpus_per_worker(monkeypatch):
    installed(monkeypatch, "torch")
    result = place("torch", 1, "auto", 2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert result.layout.procs_per_node == 2  # two workers of two GPUs each


def test_simulated_nodes_split_the_machines_gpus(monkeypatch):
    installed(monkeypatch, "torch")
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    result = place("torch", 2, "auto", 1, environ=env)
    assert result.layout == Layout(nodes=2, procs_per_node=2)  # 2 GPUs per simulated node
    assert result.node_gpus == ((0, 1), (2, 3))
    launch = new_launch(result, "127.0.0.1")
    assert [gpu_env(i, launch, node) for node in (0, 1) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": d} for d in ("4", "5", "6", "7")
    ]
    with pytest.raises(ValueError, match="simulated nodes share this machine's 4"):
        place("torch", 2, 2, 2, environ=env)


def test_auto_procs_per_node_counts_driver_gpus(monkeypatch, tmp_path):
    installed(monkeypatch, "jax")
    fake_driver_gpus(monkeypatch, tmp_path, 4)
    assert place("jax", 1, "auto", 0, environ={}).layout.procs_per_node == 4


@pytest.mark.parametrize("name", ["torch", "jax", None, "ray"])
def test_auto_procs_per_node_is_one_without_gpus(monkeypatch, name):
    installed(monkeypatch, "torch", "jax", "ray")
    assert place(name, 1, "auto", 0, environ={}).layout.procs_per_node == 1


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
def test_one_per_node_frameworks_get_one_process_per_node_with_auto(monkeypatch, name):
    installed(monkeypatch, get_framework(name).package)
    result = place(name, 3, "auto", 0, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert result.layout == Layout(nodes=3, procs_per_node=1)


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
def test_one_per_node_frameworks_reject_two_processes_per_node(monkeypatch, name):
    installed(monkeypatch, get_framework(name).package)
    with pytest.raises(ValueError, match="procs_per_node"):
        place(name, 2, 2, 0, environ={})


def test_too_few_gpus_is_an_error_before_start(monkeypatch):
    installed(monkeypatch, "torch")
    with pytest.raises(ValueError, match="needs 4 GPUs") as info:
        place("torch", 1, 2, 2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert "3 are visible" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"framework": "nope"}, "unknown framework"),
        ({"nodes": 0}, "nodes"),
        ({"procs_per_node": 0}, "procs_per_node"),
        ({"procs_per_node": "all"}, "procs_per_node"),
        ({"gpus_per_worker": -1}, "gpus_per_worker"),
    ],
)
def test_place_rejects_bad_options(kwargs, match):
    options = {"framework": None, "nodes": 1, "procs_per_node": 1, "gpus_per_worker": 0}
    options.update(kwargs)
    with pytest.raises(ValueError, match=match):
        place(**options, environ={})


# -- new_launch ------------------------------------------------------------------------------


def placement_for(name: str | None, nodes: int, gpus_per_worker=0, gpus=()) -> Placement:
    return Placement(get_framework(name), Layout(nodes, 1), gpus_per_worker, gpus)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_new_launch_picks_distinct_ports_for_every_node(name):
    framework = get_framework(name)
    launch = new_launch(placement_for(name, 3), "127.0.0.1")
    assert launch.master_addr == "127.0.0.1"
    assert launch.node_addrs == ("127.0.0.1",) * 3  # one per node
    assert set(launch.ports) == set(framework.ports)
    for port_name in framework.ports:
        assert len(launch.ports[port_name]) == 3  # one port per node
    ports = [launch.master_port, *(p for per_node in launch.ports.values() for p in per_node)]
    assert len(set(ports)) == len(ports)  # no two services share a port
    assert all(0 < port < 65536 for port in ports)
    # only frameworks that run their own services have something to authenticate
    assert bool(launch.token) == bool(framework.ports)


def test_every_restart_gets_a_new_token():
    launches = [new_launch(placement_for("ray", 2), "127.0.0.1") for _ in range(2)]
    assert all(len(launch.token) >= 16 for launch in launches)
    assert launches[0].token != launches[1].token


def test_new_launch_carries_the_gpu_placement():
    launch = new_launch(placement_for("torch", 1, 2, ("4", "5", "6", "7")), "127.0.0.1")
    assert launch.gpus_per_worker == 2
    assert launch.visible_gpus == ("4", "5", "6", "7")


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_framework_environment_builds_from_a_fresh_launch(name):
    # the ports a framework's variables use are the ones new_launch picks for it
    nodes = 2
    chosen = placement_for(name, nodes)
    launch = new_launch(chosen, "127.0.0.1")
    for rank in range(nodes):
        env = worker_env(chosen.framework, chosen.layout, rank, launch)
        assert env["MASTER_PORT"] == str(launch.master_port)
        assert all(isinstance(value, str) for value in env.values())
