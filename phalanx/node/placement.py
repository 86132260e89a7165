"""Deciding where a group's ranks go before any starts: process counts, GPUs, ports.

The rules are pure (:mod:`phalanx.world.frameworks`). :func:`place` checks a request before any
resource is taken; :func:`new_launch` turns the nodes a backend reserved, and the ports it
picked on them, into the addresses every rank is told. What needs *this* machine (visible
GPUs, free ports here) is used only by the node side of a backend that runs here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from phalanx.errors import FrameworkNotInstalled
from phalanx.world.frameworks import Framework, check_layout, get_framework, resolve_procs_per_node
from phalanx.world.layout import Launch, Layout, check_gpus, parse_visible_gpus

if TYPE_CHECKING:
    from phalanx.backends.base import Node

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
    """The checked request of a group: framework, ranks per node, GPUs per rank."""

    framework: Framework
    layout: Layout
    gpus_per_worker: int


def place(
    framework: str | None,
    nodes: int,
    procs_per_node: int | str | Sequence[int],
    gpus_per_worker: int,
    gpus_per_node: int | None,
) -> Placement:
    """Check the options and resolve ``"auto"``; every error before anything starts.

    ``gpus_per_node`` is what the backend can tell of each node's GPUs before placing
    ranks (None: nothing). A list of counts per node sets the number of nodes when
    ``nodes`` is left at 1.
    """
    fw = get_framework(framework)
    if isinstance(procs_per_node, (list, tuple)) and nodes == 1:
        nodes = len(procs_per_node)
    procs = resolve_procs_per_node(procs_per_node, fw, gpus_per_node, gpus_per_worker)
    layout = Layout(nodes, procs)
    check_layout(fw, layout)
    check_gpus(gpus_per_worker, 0, ())  # the type of gpus_per_worker; counts: once placed
    require_package(fw)
    return Placement(fw, layout, gpus_per_worker)


def check_node_gpus(placement: Placement, nodes: Sequence[Node]) -> None:
    """Enough GPUs on every node for ``gpus_per_worker`` (nodes whose backend assigns
    devices itself are its business). Nodes at one address are simulated on one machine
    and share its GPUs, which the message says."""
    shared = len({node.address for node in nodes}) < len(nodes)
    note = f"; the {len(nodes)} simulated nodes share this machine's GPUs" if shared else ""
    for node in nodes:
        if node.gpus is not None:
            check_gpus(placement.gpus_per_worker, node.ranks, node.gpus, note)


def new_launch(
    placement: Placement, nodes: Sequence[Node], ports: Callable[[Node, int], list[int]]
) -> Launch:
    """Addresses, ports (picked on each node) and devices for one start of the group; each
    restart gets new ports."""
    names = placement.framework.ports
    picked = [ports(node, (1 if node.index == 0 else 0) + len(names)) for node in nodes]
    master_port = picked[0][0]
    by_name = {
        name: tuple(picked[n][i + (1 if n == 0 else 0)] for n in range(len(nodes)))
        for i, name in enumerate(names)
    }
    if any(node.gpus is None for node in nodes):  # the backend assigns devices (Ray)
        visible: tuple[str, ...] = ()
        node_gpus: tuple[tuple[int, ...], ...] = ()
        gpus_per_worker = 0
    else:
        gpus_per_worker = placement.gpus_per_worker
        if all(node.gpus == nodes[0].gpus for node in nodes):  # each has them all
            visible, node_gpus = tuple(nodes[0].gpus), ()  # type: ignore[arg-type]
        else:  # nodes with shares of their own (simulated nodes split one machine's GPUs)
            visible = tuple(g for node in nodes for g in node.gpus)  # type: ignore[union-attr]
            positions, first = [], 0
            for node in nodes:
                positions.append(tuple(range(first, first + len(node.gpus))))  # type: ignore[arg-type]
                first += len(node.gpus)  # type: ignore[arg-type]
            node_gpus = tuple(positions)
    return Launch(
        master_addr=nodes[0].address,
        master_port=master_port,
        node_addrs=tuple(node.address for node in nodes),
        ports=by_name,
        token=secrets.token_hex(16) if names else "",
        gpus_per_worker=gpus_per_worker,
        visible_gpus=visible,
        node_gpus=node_gpus,
    )


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on this machine's ``host`` address now."""
    taken: list[int] = []
    while len(taken) < count:
        port = free_port(host)
        if port not in taken:
            taken.append(port)
    return taken
