"""Deciding where a group's workers go before any starts: process counts, GPUs, ports.

The rules are pure (:mod:`phalanx.frameworks`); this module adds what needs the machine:
whether a framework's package is installed, which GPUs are visible, which ports are free.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import socket
from collections.abc import Mapping

from phalanx.errors import FrameworkNotInstalled
from phalanx.frameworks import (
    Framework,
    Launch,
    Layout,
    check_gpus,
    check_layout,
    get_framework,
    parse_visible_gpus,
    resolve_procs_per_node,
    split_gpus,
)

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the driver knows


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """GPU ids this machine's workers may use: ``CUDA_VISIBLE_DEVICES`` when it is set
    (as a scheduler would set it), otherwise every GPU the NVIDIA driver lists."""
    env = os.environ if environ is None else environ
    listed = parse_visible_gpus(env.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        return listed
    try:
        count = len(os.listdir(NVIDIA_GPUS_DIR))
    except OSError:
        count = 0
    return tuple(str(i) for i in range(count))


def require_package(framework: Framework) -> None:
    """Raise :class:`FrameworkNotInstalled` now rather than deep inside a worker."""
    if framework.package is None:
        return
    try:
        found = importlib.util.find_spec(framework.package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise FrameworkNotInstalled(framework.name, framework.package, framework.install)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The checked layout of a group: framework, ranks per node, devices."""

    framework: Framework
    layout: Layout
    gpus_per_worker: int
    gpus: tuple[str, ...]
    node_gpus: tuple[tuple[int, ...], ...] = ()


def place(
    framework: str | None,
    nodes: int,
    procs_per_node: int | str,
    gpus_per_worker: int,
    environ: Mapping[str, str] | None = None,
    *,
    one_machine: bool = True,
) -> Placement:
    """Check the options and resolve ``"auto"``; every error before anything starts.

    ``one_machine``: the nodes are simulated on this machine (the local backend), so they
    split its GPUs between them rather than each having them all.
    """
    fw = get_framework(framework)
    gpus = visible_gpus(environ)
    node_gpus = split_gpus(len(gpus), nodes) if one_machine and nodes > 1 else ()
    first_node = node_gpus[0] if node_gpus else tuple(range(len(gpus)))
    procs = resolve_procs_per_node(procs_per_node, fw, len(first_node), gpus_per_worker)
    layout = Layout(nodes, procs)
    check_layout(fw, procs)
    note = f"; the {nodes} simulated nodes share this machine's {len(gpus)}" if node_gpus else ""
    check_gpus(gpus_per_worker, procs, [gpus[i] for i in first_node], note)
    require_package(fw)
    return Placement(fw, layout, gpus_per_worker, gpus, node_gpus)


def new_launch(placement: Placement, master_addr: str) -> Launch:
    """Fresh addresses and ports for one start of the group (each restart gets new ones)."""
    nodes = placement.layout.nodes
    node_addrs = (master_addr,) * nodes  # every simulated node of the local backend
    taken: set[int] = set()
    ports: dict[str, tuple[int, ...]] = {}

    def pick(host: str) -> int:
        while True:
            port = free_port(host)
            if port not in taken:
                taken.add(port)
                return port

    master_port = pick(master_addr)
    for name in placement.framework.ports:
        ports[name] = tuple(pick(node_addrs[n]) for n in range(nodes))
    return Launch(
        master_addr=master_addr,
        master_port=master_port,
        node_addrs=node_addrs,
        ports=ports,
        token=secrets.token_hex(16) if placement.framework.ports else "",
        gpus_per_worker=placement.gpus_per_worker,
        visible_gpus=placement.gpus,
        node_gpus=placement.node_gpus,
    )
