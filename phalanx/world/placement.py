"""Deciding where a group's ranks go before any starts: process counts, GPUs, ports (pure).

:func:`place` checks a request and resolves ``procs_per_node="auto"`` before any resource is
taken; :func:`check_node_gpus` checks it against the nodes a backend reserved; and
:func:`new_launch` turns those nodes, and the ports picked on them, into the addresses every
rank is told. The framework rules are :mod:`phalanx.world.frameworks`'.

Nothing here looks at a machine: the nodes' GPUs come from the backend, ports from a
callable the backend supplies (only a node knows which of its ports are free), and whether a
framework's package is installed is :func:`phalanx.node.machine.require_package`'s question.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from phalanx.world.frameworks import Framework, check_layout, get_framework, resolve_procs_per_node
from phalanx.world.layout import Launch, Layout, check_gpus


def _token() -> str:
    """A launch's shared secret; ``secrets`` (with ``hmac`` and ``random``, ~5 ms) is
    imported by the launches that have ports to name, not by every controller."""
    import secrets

    return secrets.token_hex(16)


class ReservedNode(Protocol):
    """What placement reads of a node a backend reserved
    (:class:`phalanx.backends.base.Node`)."""

    @property
    def index(self) -> int: ...

    @property
    def address(self) -> str: ...

    @property
    def ranks(self) -> int: ...

    @property
    def gpus(self) -> tuple[str, ...] | None: ...


NodeT = TypeVar("NodeT", bound=ReservedNode)


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
    return Placement(fw, layout, gpus_per_worker)


def check_node_gpus(placement: Placement, nodes: Sequence[ReservedNode]) -> None:
    """Enough GPUs on every node for ``gpus_per_worker`` (nodes whose backend assigns
    devices itself are its business). Nodes at one address are simulated on one machine
    and share its GPUs, which the message says."""
    shared = len({node.address for node in nodes}) < len(nodes)
    note = f"; the {len(nodes)} simulated nodes share this machine's GPUs" if shared else ""
    for node in nodes:
        if node.gpus is not None:
            check_gpus(placement.gpus_per_worker, node.ranks, node.gpus, note)


def new_launch(
    placement: Placement, nodes: Sequence[NodeT], ports: Callable[[NodeT, int], list[int]]
) -> Launch:
    """Addresses, ports (``ports(node, count)``: picked on each node) and devices for one
    start of the group; each restart gets new ports, and a new token for the framework
    services that authenticate."""
    names = placement.framework.ports
    picked = [ports(node, (1 if node.index == 0 else 0) + len(names)) for node in nodes]
    master_port = picked[0][0]
    by_name = {
        name: tuple(picked[n][i + (1 if n == 0 else 0)] for n in range(len(nodes)))
        for i, name in enumerate(names)
    }
    visible: tuple[str, ...] = ()
    node_gpus: tuple[tuple[int, ...], ...] = ()
    gpus_per_worker = 0
    shares = [node.gpus for node in nodes]
    if all(gpus is not None for gpus in shares):  # else the backend assigns devices (Ray)
        gpus_per_worker = placement.gpus_per_worker
        if all(gpus == shares[0] for gpus in shares):  # each has them all
            visible = tuple(shares[0] or ())
        else:  # nodes with shares of their own (simulated nodes split one machine's GPUs)
            visible = tuple(g for gpus in shares for g in gpus or ())
            positions, first = [], 0
            for gpus in shares:
                count = len(gpus or ())
                positions.append(tuple(range(first, first + count)))
                first += count
            node_gpus = tuple(positions)
    return Launch(
        master_addr=nodes[0].address,
        master_port=master_port,
        node_addrs=tuple(node.address for node in nodes),
        ports=by_name,
        token=_token() if names else "",
        gpus_per_worker=gpus_per_worker,
        visible_gpus=visible,
        node_gpus=node_gpus,
    )
