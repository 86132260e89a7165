"""Deciding where workers go before any starts: the pure rules (:mod:`phalanx.world.placement`:
layout checks, each node's GPUs, the ports picked on the nodes) and what this machine tells
(:mod:`phalanx.node.machine`: visible GPUs, installed packages). No process is started."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from phalanx.backends.base import Node
from phalanx.errors import FrameworkNotInstalled, PhalanxError
from phalanx.node import machine
from phalanx.node.machine import pick_free_ports, require_package, visible_gpus
from phalanx.world.frameworks import FRAMEWORKS, get_framework, worker_env
from phalanx.world.layout import Layout, gpu_env
from phalanx.world.placement import Placement, check_node_gpus, new_launch, place

PACKAGED = [name for name, fw in FRAMEWORKS.items() if fw.package is not None]


@pytest.fixture(autouse=True)
def no_driver_gpus(monkeypatch, tmp_path):
    """The test machine has no GPU (and results must not depend on the one running them):
    point the driver's GPU directory at a path that does not exist."""
    monkeypatch.setattr(machine, "NVIDIA_GPUS_DIR", str(tmp_path / "no-nvidia-driver"))


def fake_driver_gpus(monkeypatch, tmp_path, count: int) -> None:
    # faked: there is no GPU (nor NVIDIA driver) on the test machine, so the directory the
    # driver fills with one entry per GPU is made up here
    gpus_dir = tmp_path / "nvidia-gpus"
    gpus_dir.mkdir()
    for i in range(count):
        (gpus_dir / f"0000:{i:02x}:00.0").mkdir()
    monkeypatch.setattr(machine, "NVIDIA_GPUS_DIR", str(gpus_dir))


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
    monkeypatch.setattr(machine, "NVIDIA_GPUS_DIR", str(unreadable))
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
    assert place(name, 2, 2, 0, None).layout == Layout(2, 2)


def test_place_is_pure_and_leaves_the_package_to_the_machine(monkeypatch):
    missing(monkeypatch, "jax")
    chosen = place(framework="jax", nodes=1, procs_per_node=1, gpus_per_worker=0,
                   gpus_per_node=None)
    assert chosen.layout == Layout(1, 1)
    with pytest.raises(FrameworkNotInstalled, match="jax"):
        require_package(chosen.framework)  # what the group asks before anything starts


# -- place ----------------------------------------------------------------------------------


def test_auto_procs_per_node_is_one_torch_process_per_visible_gpu(monkeypatch):
    installed(monkeypatch, "torch")
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"})
    result = place("torch", 1, "auto", 1, len(gpus))
    assert isinstance(result, Placement)
    assert result.framework is get_framework("torch")
    assert result.layout == Layout(nodes=1, procs_per_node=3)
    assert result.gpus_per_worker == 1
    # the GPUs themselves are the node's, as its backend reserved it
    launch = new_launch(result, [Node(0, "127.0.0.1", 3, gpus)], CountingPorts())
    assert launch.visible_gpus == ("0", "1", "2")
    assert launch.gpus_per_worker == 1


def test_auto_counts_gpus_per_worker(monkeypatch):
    installed(monkeypatch, "torch")
    result = place("torch", 1, "auto", 2, 4)
    assert result.layout.procs_per_node == 2  # two workers of two GPUs each


def test_auto_needs_the_gpu_count_of_a_node(monkeypatch):
    installed(monkeypatch, "torch")
    with pytest.raises(ValueError, match="procs_per_node='auto'"):
        place("torch", 1, "auto", 1, None)  # the backend cannot tell before placing


def test_simulated_nodes_split_the_machines_gpus(monkeypatch):
    installed(monkeypatch, "torch")
    machine = visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    result = place("torch", 2, "auto", 1, len(machine) // 2)  # each simulated node gets half
    assert result.layout == Layout(nodes=2, procs_per_node=2)  # 2 GPUs per simulated node
    nodes = [
        Node(0, "127.0.0.1", 2, machine[:2]),
        Node(1, "127.0.0.1", 2, machine[2:]),
    ]
    check_node_gpus(result, nodes)  # enough: one GPU per worker
    launch = new_launch(result, nodes, CountingPorts())
    assert launch.visible_gpus == ("4", "5", "6", "7")
    assert launch.node_gpus == ((0, 1), (2, 3))
    assert [gpu_env(i, launch, node) for node in (0, 1) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": d} for d in ("4", "5", "6", "7")
    ]
    greedy = place("torch", 2, 2, 2, 2)
    with pytest.raises(ValueError, match="2 simulated nodes share this machine's GPUs") as info:
        check_node_gpus(greedy, nodes)
    assert "needs 4 GPUs" in str(info.value)
    assert "2 are visible" in str(info.value)


def test_auto_procs_per_node_counts_driver_gpus(monkeypatch, tmp_path):
    installed(monkeypatch, "jax")
    fake_driver_gpus(monkeypatch, tmp_path, 4)
    assert place("jax", 1, "auto", 0, len(visible_gpus({}))).layout.procs_per_node == 4


@pytest.mark.parametrize("name", ["torch", "jax", None, "ray"])
def test_auto_procs_per_node_is_one_without_gpus(monkeypatch, name):
    installed(monkeypatch, "torch", "jax", "ray")
    assert place(name, 1, "auto", 0, len(visible_gpus({}))).layout.procs_per_node == 1


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
@pytest.mark.parametrize("gpus_per_node", [4, None])
def test_one_per_node_frameworks_get_one_process_per_node_with_auto(
    monkeypatch, name, gpus_per_node
):
    installed(monkeypatch, get_framework(name).package)
    result = place(name, 3, "auto", 0, gpus_per_node)
    assert result.layout == Layout(nodes=3, procs_per_node=1)


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
@pytest.mark.parametrize("procs_per_node", [2, [1, 2]])
def test_one_per_node_frameworks_reject_two_processes_per_node(monkeypatch, name, procs_per_node):
    installed(monkeypatch, get_framework(name).package)
    with pytest.raises(ValueError, match="procs_per_node"):
        place(name, 2, procs_per_node, 0, None)


def test_too_few_gpus_is_an_error_before_start(monkeypatch):
    installed(monkeypatch, "torch")
    result = place("torch", 1, 2, 2, 3)  # counts are checked once the nodes are known
    node = Node(0, "127.0.0.1", 2, ("0", "1", "2"))
    with pytest.raises(ValueError, match="needs 4 GPUs") as info:
        check_node_gpus(result, [node])
    assert "3 are visible" in str(info.value)
    assert "simulated" not in str(info.value)


def test_check_node_gpus_counts_each_nodes_own_ranks_and_skips_backend_assigned_devices():
    chosen = place(None, 1, [2, 1], 1, None)
    check_node_gpus(chosen, [Node(0, "a", 2, ("0", "1")), Node(1, "b", 1, ("0",))])
    check_node_gpus(chosen, [Node(0, "a", 2, None), Node(1, "b", 1, None)])
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        check_node_gpus(chosen, [Node(0, "a", 2, ("0",)), Node(1, "b", 1, ("0",))])


def test_a_list_of_counts_sets_the_number_of_nodes():
    assert place(None, 1, [2, 1, 3], 0, None).layout == Layout.of([2, 1, 3])
    assert place(None, 2, [2, 1], 0, None).layout == Layout(2, (2, 1))
    assert place(None, 1, [2, 2], 0, None).layout == Layout(2, 2)  # even: the int


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"framework": "nope"}, "unknown framework"),
        ({"nodes": 0}, "nodes"),
        ({"procs_per_node": 0}, "procs_per_node"),
        ({"procs_per_node": "all"}, "procs_per_node"),
        ({"procs_per_node": [2, 0]}, "procs_per_node"),
        ({"procs_per_node": [2, "auto"]}, "procs_per_node"),
        ({"nodes": 3, "procs_per_node": [1, 2]}, "nodes"),
        ({"gpus_per_worker": -1}, "gpus_per_worker"),
    ],
)
def test_place_rejects_bad_options(kwargs, match):
    options = {"framework": None, "nodes": 1, "procs_per_node": 1, "gpus_per_worker": 0}
    options.update(kwargs)
    with pytest.raises(ValueError, match=match):
        place(**options, gpus_per_node=None)


# -- new_launch ------------------------------------------------------------------------------


def placement_for(name: str | None, nodes: int, gpus_per_worker=0) -> Placement:
    return Placement(get_framework(name), Layout(nodes, 1), gpus_per_worker)


def nodes_on(*addresses: str, gpus=(), ranks=1) -> list[Node]:
    return [Node(i, address, ranks, gpus) for i, address in enumerate(addresses)]


class CountingPorts:
    """A backend's ``ports``: hands out 20000, 20001, ... and records what was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.next = 20000

    def __call__(self, node: Node, count: int) -> list[int]:
        self.calls.append((node.index, count))
        picked = list(range(self.next, self.next + count))
        self.next += count
        return picked


def local_ports(node: Node, count: int) -> list[int]:
    return pick_free_ports(node.address, count)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_new_launch_picks_distinct_ports_for_every_node(name):
    framework = get_framework(name)
    launch = new_launch(placement_for(name, 3), nodes_on("127.0.0.1", "127.0.0.1", "127.0.0.1"),
                        CountingPorts())
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


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_ports_are_picked_on_each_node_master_port_first(name):
    names = get_framework(name).ports
    ports = CountingPorts()
    launch = new_launch(placement_for(name, 3), nodes_on("10.0.0.1", "10.0.0.2", "10.0.0.3"),
                        ports)
    # node 0 is asked for the master port and one per service; the others one per service
    assert ports.calls == [(0, 1 + len(names)), (1, len(names)), (2, len(names))]
    assert launch.master_port == 20000
    node_firsts = [20001, 20001 + len(names), 20001 + 2 * len(names)]
    for i, port_name in enumerate(names):
        assert launch.ports[port_name] == tuple(first + i for first in node_firsts)
        assert [launch.port(port_name, n) for n in range(3)] == list(launch.ports[port_name])


def test_pick_free_ports_gives_distinct_ports_of_this_machine():
    ports = pick_free_ports("127.0.0.1", 5)
    assert len(ports) == 5
    assert len(set(ports)) == 5
    assert all(0 < port < 65536 for port in ports)
    launch = new_launch(placement_for("jax", 1), nodes_on("127.0.0.1"), local_ports)
    assert launch.master_port != launch.port("jax", 0)


def test_master_addr_is_node_zeros_address():
    chosen = placement_for("torch", 2)
    launch = new_launch(chosen, nodes_on("10.0.0.7", "10.0.0.8"), CountingPorts())
    assert launch.master_addr == "10.0.0.7"
    assert launch.node_addrs == ("10.0.0.7", "10.0.0.8")
    for rank in range(2):
        env = worker_env(chosen.framework, chosen.layout, rank, launch)
        assert env["MASTER_ADDR"] == "10.0.0.7"


def test_every_restart_gets_a_new_token():
    launches = [
        new_launch(placement_for("ray", 2), nodes_on("127.0.0.1", "127.0.0.1"), CountingPorts())
        for _ in range(2)
    ]
    assert all(len(launch.token) >= 16 for launch in launches)
    assert launches[0].token != launches[1].token


def test_new_launch_carries_the_gpu_placement():
    launch = new_launch(
        placement_for("torch", 1, 2), nodes_on("127.0.0.1", gpus=("4", "5", "6", "7")),
        CountingPorts(),
    )
    assert launch.gpus_per_worker == 2
    assert launch.visible_gpus == ("4", "5", "6", "7")
    assert launch.node_gpus == ()  # every node has them all


def test_nodes_on_separate_machines_each_see_their_own_gpus():
    launch = new_launch(
        placement_for("torch", 2), nodes_on("10.0.0.1", "10.0.0.2", gpus=("0", "1")),
        CountingPorts(),
    )
    assert launch.visible_gpus == ("0", "1")
    assert launch.node_gpus == ()
    assert launch.gpus_of(0) == launch.gpus_of(1) == (0, 1)
    assert gpu_env(0, launch, 1) == {}  # without gpus_per_worker: the machine's GPUs


def test_simulated_nodes_with_shares_of_one_machines_gpus():
    nodes = [Node(0, "127.0.0.1", 1, ("0", "1")), Node(1, "127.0.0.1", 1, ("2", "3"))]
    launch = new_launch(placement_for("torch", 2), nodes, CountingPorts())
    assert launch.visible_gpus == ("0", "1", "2", "3")
    assert launch.node_gpus == ((0, 1), (2, 3))
    assert gpu_env(0, launch, 0) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_env(0, launch, 1) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_backend_assigned_devices_leave_gpus_to_the_backend():
    nodes = nodes_on("10.0.0.1", "10.0.0.2", gpus=None)
    launch = new_launch(placement_for("torch", 2, gpus_per_worker=1), nodes, CountingPorts())
    assert launch.visible_gpus == ()
    assert launch.node_gpus == ()
    assert launch.gpus_per_worker == 0
    assert gpu_env(0, launch, 1) == {}


def test_uneven_layout_gets_each_nodes_local_world_and_gpus(monkeypatch):
    installed(monkeypatch, "torch")
    chosen = place("torch", 1, [2, 1], 1, None)
    nodes = [Node(0, "10.0.0.1", 2, ("0", "1")), Node(1, "10.0.0.2", 1, ("0", "1"))]
    check_node_gpus(chosen, nodes)
    launch = new_launch(chosen, nodes, CountingPorts())
    envs = [worker_env(chosen.framework, chosen.layout, rank, launch) for rank in range(3)]
    assert [env["NODE_RANK"] for env in envs] == ["0", "0", "1"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1", "0"]
    assert [env["LOCAL_WORLD_SIZE"] for env in envs] == ["2", "2", "1"]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "0"]


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_framework_environment_builds_from_a_fresh_launch(name):
    # the ports a framework's variables use are the ones new_launch picks for it
    nodes = 2
    chosen = placement_for(name, nodes)
    launch = new_launch(chosen, nodes_on("127.0.0.1", "127.0.0.1"), local_ports)
    for rank in range(nodes):
        env = worker_env(chosen.framework, chosen.layout, rank, launch)
        assert env["MASTER_PORT"] == str(launch.master_port)
        assert all(isinstance(value, str) for value in env.values())
