"""A resource pool on agents: the agents' nodes, in the order of ``hosts``.

Nothing is held on the agents for a pool itself: its slots are the first
``len(counts)`` agents of ``hosts``, ``counts[n]`` ranks' places on the n-th. A group placed
on the pool is a :class:`~phalanx.backends.cluster.backend.ClusterBackend` on the agents of
its slots, its ranks given the GPUs of their slots (by position in the GPUs the agent
lists), so that colocated groups' rank i see the same ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.backends.cluster.backend import ClusterBackend
    from phalanx.world.pools import PoolSlot


class ClusterSlots:
    """A pool's nodes (agents) and each slot's GPUs per rank."""

    def __init__(self, template: ClusterBackend, counts: Sequence[int], gpus: int) -> None:
        self._template = template
        self.counts = list(counts)
        self.gpus_per_worker = gpus

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> ClusterBackend:
        nodes: dict[int, list[PoolSlot]] = {}
        for slot in slots:
            nodes.setdefault(slot.node, []).append(slot)
        settings = self._template.settings()
        settings["hosts"] = [self._template.hosts[n] for n in nodes]
        backend = type(self._template)(**settings)  # configured as the pool's
        g = self.gpus_per_worker
        if g:
            backend.gpu_windows = [(on[0].local * g, (on[-1].local + 1) * g)
                                   for on in nodes.values()]
        return backend

    def release(self) -> None:
        return None  # the agents hold nothing for the pool itself


def reserve_slots(template: ClusterBackend, counts: Sequence[int], gpus: int,
                  resources: Mapping[str, float]) -> ClusterSlots:
    """The pool's nodes: one agent of ``hosts`` each (ValueError when there are fewer)."""
    if resources:
        raise ValueError(f"resources_per_proc={dict(resources)} means Ray resources: agents "
                         "have none (give GPUs as gpus_per_proc=)")
    if template.dns is not None:
        raise ValueError("a resource pool on agents needs them listed, "
                         "ClusterBackend(hosts=[...]), not found by dns=")
    if len(counts) > len(template.hosts):
        raise ValueError(f"a pool of {len(counts)} nodes needs as many agents; hosts lists "
                         f"{len(template.hosts)} ({', '.join(template.hosts)})")
    return ClusterSlots(template, counts, gpus)
