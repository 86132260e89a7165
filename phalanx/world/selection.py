"""Which ranks a call goes to: the ``workers=`` argument, resolved (pure logic)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

Workers = Union[str, int, Sequence[int]]  # noqa: UP007 - a runtime alias on 3.10
"""``"all"``, ``"any"`` (first live rank), ``"ready"`` (live ranks only), or ranks."""


def check_workers(workers: object) -> Workers:
    """A ``workers=`` value, checked for what it is (its ranks' range is the group's to
    check): a selection's name, a rank, or ranks (as a tuple). ValueError for an unknown
    name, TypeError for anything else that is no rank."""
    if type(workers) is list and all(type(rank) is int for rank in workers):
        return tuple(workers)  # the usual explicit selection, checked at once
    if isinstance(workers, str):
        if workers not in ("all", "any", "ready"):
            raise ValueError(
                f"workers={workers!r}: expected 'all', 'any', 'ready' or a list of ranks")
        return workers
    if isinstance(workers, int) and not isinstance(workers, bool):
        return workers
    if isinstance(workers, bool) or not isinstance(workers, Sequence):
        raise TypeError(f"workers must be 'all', 'any', 'ready' or a list of ranks, "
                        f"got {workers!r}")
    ranks = tuple(workers)
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"workers must hold integer ranks, got {rank!r}")
    return ranks


def select_ranks(workers: Workers, alive: Sequence[bool]) -> list[int]:
    """Resolve a ``workers=`` selection to ranks (pure; checked by
    :func:`check_workers`). Explicit dead ranks are kept: the caller reports them;
    ``"ready"`` and ``"any"`` skip them."""
    world = len(alive)
    workers = check_workers(workers)
    if isinstance(workers, str):
        if workers == "all":
            return list(range(world))
        if workers == "ready":
            return [r for r in range(world) if alive[r]]
        for r in range(world):  # "any"
            if alive[r]:
                return [r]
        return []
    ranks = [workers] if isinstance(workers, int) else list(workers)
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"rank {r} is outside this group's ranks 0..{world - 1}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"workers={ranks} names a rank twice")
    return sorted(ranks)
