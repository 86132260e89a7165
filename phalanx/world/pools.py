"""A resource pool's slots, and which groups sit on them (pure).

A pool reserves ``nodes x procs_per_node`` slots once (uneven counts allowed); each slot
is one rank's place: a node, and on it the GPUs of one process. Groups placed on a pool
take its slots in order (rank i on slot i), and up to ``colocate`` groups may sit on the
same slot -- rank i of each then runs on the same node with the same GPUs. A pool splits
into disjoint sub-pools in slot order. This module keeps the books; the backends reserve
what the slots stand for (:mod:`phalanx.controller.pool`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from phalanx.world.layout import Layout, as_procs_per_node


@dataclasses.dataclass(frozen=True)
class PoolSlot:
    """One rank's place in a pool: its node (in the pool's order), its index on that
    node, and its index among all the pool's slots (on Ray, its bundle)."""

    index: int
    node: int
    local: int


def slots_of(counts: Sequence[int]) -> list[PoolSlot]:
    """Every slot of a layout, node by node."""
    slots: list[PoolSlot] = []
    for node, count in enumerate(counts):
        for local in range(count):
            slots.append(PoolSlot(len(slots), node, local))
    return slots


def split_counts(sizes: object, total: int) -> list[int]:
    """``pool.split(sizes)``: positive slot counts that add up to at most ``total``
    (ValueError / TypeError naming what is wrong)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple)) or not sizes:
        raise TypeError(f"split() takes a list of slot counts such as [4, 4], got {sizes!r}")
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"split(): slot counts must be positive ints, got {bad[0]!r} in "
                         f"{list(sizes)}")
    if sum(sizes) > total:
        raise ValueError(f"split({list(sizes)}) asks {sum(sizes)} slots; the pool has {total}")
    return list(sizes)


def by_node(slots: Sequence[PoolSlot]) -> list[list[PoolSlot]]:
    """``slots`` grouped by node, in order."""
    groups: list[list[PoolSlot]] = []
    for slot in slots:
        if not groups or groups[-1][0].node != slot.node:
            groups.append([])
        groups[-1].append(slot)
    return groups


def layout_on(slots: Sequence[PoolSlot], nodes: int | None,
              procs_per_node: int | Sequence[int] | None) -> list[int]:
    """Ranks per node of a group on ``slots``: the slots' own layout when neither is
    given; otherwise the first ``nodes`` nodes, ``procs_per_node`` slots of each (in slot
    order), which must fit (ValueError naming the pool's layout)."""
    have = [len(group) for group in by_node(slots)]
    if nodes is None and procs_per_node is None:
        return have
    if isinstance(procs_per_node, (list, tuple)):
        counts = list(procs_per_node)
        if nodes is not None and nodes != len(counts):
            raise ValueError(f"procs_per_node={list(counts)} gives {len(counts)} nodes but "
                             f"nodes={nodes}")
    elif procs_per_node is None:
        if nodes is not None and nodes > len(have):
            raise ValueError(f"nodes={nodes} does not fit the pool's slots, on {len(have)} "
                             f"node(s) ({have} per node)")
        counts = have[:nodes]
    else:
        counts = [procs_per_node] * (len(have) if nodes is None else nodes)
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 1]
    if bad or not counts:
        raise ValueError(f"procs_per_node must be a positive integer or a list of them, got "
                         f"{procs_per_node!r}")
    if len(counts) > len(have) or any(c > h for c, h in zip(counts, have, strict=False)):
        raise ValueError(f"a group of {counts} ranks per node does not fit the pool's "
                         f"slots ({have} per node)")
    return counts


def chosen_slots(slots: Sequence[PoolSlot], counts: Sequence[int]) -> list[PoolSlot]:
    """The slots a group of ``counts`` ranks per node takes: the first ``counts[n]`` of
    each of the pool's first nodes, in rank order."""
    groups = by_node(slots)
    return [slot for n, count in enumerate(counts) for slot in groups[n][:count]]


class SlotBook:
    """Which groups sit on each slot of a pool (shared by the pool and its sub-pools)."""

    def __init__(self, slots: int, colocate: int) -> None:
        self.colocate = colocate
        self._taken: list[list[str]] = [[] for _ in range(slots)]  # slot -> group names

    def full(self, slots: Sequence[PoolSlot]) -> list[PoolSlot]:
        """The slots among ``slots`` that hold ``colocate`` groups already."""
        return [s for s in slots if len(self._taken[s.index]) >= self.colocate]

    def placed(self, slots: Sequence[PoolSlot]) -> dict[int, list[str]]:
        return {s.index: list(self._taken[s.index]) for s in slots if self._taken[s.index]}

    def take(self, slots: Sequence[PoolSlot], name: str) -> None:
        for slot in slots:
            self._taken[slot.index].append(name)

    def give_back(self, slots: Sequence[PoolSlot], name: str) -> None:
        for slot in slots:
            if name in self._taken[slot.index]:
                self._taken[slot.index].remove(name)

    def groups(self) -> list[str]:
        return sorted({name for names in self._taken for name in names})


def pool_layout(nodes: int, procs_per_node: int | Sequence[int]) -> Layout:
    """The checked layout of a pool (the same rules as a group's)."""
    return Layout(nodes, as_procs_per_node(procs_per_node))
