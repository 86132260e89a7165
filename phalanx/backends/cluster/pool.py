"""A resource pool on agents: the agents' nodes, in the order of ``hosts``.

A pool's slots are the first ``len(counts)`` agents of ``hosts``, ``counts[n]`` ranks'
places on the n-th. A pool of GPUs holds them: a connection of its own to each of its agents
takes ``counts[n] * gpus_per_proc`` GPUs from the node's book
(:mod:`phalanx.backends.cluster.gpus`) for as long as the pool is open, so no other pool or
group, of this controller or another, is given them. A group placed on the pool is a
:class:`~phalanx.backends.cluster.backend.ClusterBackend` on the agents of its slots, its
ranks given the GPUs of their slots, so that colocated groups' rank i see the same
``CUDA_VISIBLE_DEVICES``; its connections share the pool's hold (the pool's key,
:class:`~phalanx.backends.cluster.gpus.PoolHold`) until the group closes. So the GPUs of a
detached pool stay held on a node while one of its detached groups runs there, past the
controller, the pool and its connections (the agent's book: ``agent.devices``). A pool
without GPUs holds nothing on the agents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from phalanx.backends.cluster import gpus as agentgpus
from phalanx.output.logs import OutputOptions

if TYPE_CHECKING:
    from phalanx.backends.cluster.backend import ClusterBackend
    from phalanx.world.pools import PoolSlot


class ClusterSlots:
    """A pool's nodes (agents), each slot's GPUs, and the connection that holds them."""

    def __init__(self, template: ClusterBackend, counts: Sequence[int], gpus: int,
                 held: list[tuple[str, ...]] | None = None,
                 keeper: ClusterBackend | None = None,
                 hold: agentgpus.PoolHold | None = None) -> None:
        self._template = template
        self.counts = list(counts)
        self.gpus_per_worker = gpus
        self._held = held  # node -> the GPU ids the pool holds there, slot by slot
        self._keeper = keeper
        self._hold = hold  # what the keeper holds them as, shared by the pool's groups

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> ClusterBackend:
        nodes: dict[int, list[PoolSlot]] = {}
        for slot in slots:
            nodes.setdefault(slot.node, []).append(slot)
        settings = self._template.settings()
        settings["hosts"] = [self._template.hosts[n] for n in nodes]
        backend = type(self._template)(**settings)  # configured as the pool's
        g, held = self.gpus_per_worker, self._held
        if g and held is not None:
            backend.placed_gpus = [
                tuple(gpu for slot in on for gpu in held[n][slot.local * g:(slot.local + 1) * g])
                for n, on in nodes.items()]
            backend.placed_hold = self._hold  # its connections hold them too
        return backend

    def release(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            if self._hold is not None:  # free at once unless a group placed here holds them
                agentgpus.give_back(keeper.members.nodes, self._hold.name)
            keeper.close()  # then ends its connections


def reserve_slots(template: ClusterBackend, counts: Sequence[int], gpus: int,
                  resources: Mapping[str, float], holder: str,
                  timeout: float) -> ClusterSlots:
    """The pool's nodes: one agent of ``hosts`` each (ValueError when there are fewer), with
    ``gpus`` GPUs per slot held on each (ValueError when a node lists fewer, DevicesTaken
    when other holders have them)."""
    if resources:
        raise ValueError(f"resources_per_proc={dict(resources)} means Ray resources: agents "
                         "have none (give GPUs as gpus_per_proc=)")
    if template.dns is not None:
        raise ValueError("a resource pool on agents needs them listed, "
                         "ClusterBackend(hosts=[...]), not found by dns=")
    if len(counts) > len(template.hosts):
        raise ValueError(f"a pool of {len(counts)} nodes needs as many agents; hosts lists "
                         f"{len(template.hosts)} ({', '.join(template.hosts)})")
    if not gpus:
        return ClusterSlots(template, counts, gpus)
    settings = {**template.settings(), "hosts": template.hosts[:len(counts)], "quorum": None,
                "sync": None, "quorum_timeout": max(1.0, min(template.quorum_timeout,
                                                             timeout))}
    keeper = type(template)(**settings)
    keeper.open(OutputOptions(echo=False))
    try:
        agents = keeper.members.nodes
        for agent, count in zip(agents, counts, strict=True):
            have = list(agent.welcome.get("gpus") or ())
            if count * gpus > len(have):
                raise ValueError(
                    f"a pool of {count} slots x {gpus} GPU(s) on {agent.where} needs "
                    f"{count * gpus} GPUs; its agent lists {len(have)} "
                    f"({', '.join(have) or 'none'})")
        hold = agentgpus.PoolHold.new(holder)
        held = agentgpus.hold(agents, [c * gpus for c in counts], hold.name, hold)
    except BaseException:
        keeper.close()
        raise
    return ClusterSlots(template, counts, gpus, held, keeper, hold)
