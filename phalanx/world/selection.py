"""Which ranks a call goes to: the ``workers=`` argument, resolved (pure logic)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

Workers = Union[str, int, Sequence[int]]  # noqa: UP007 - a runtime alias on 3.10
"""``"all"``, ``"any"`` (first live rank), ``"ready"`` (live ranks only), or ranks."""


def select_ranks(workers: Workers, alive: Sequence[bool]) -> list[int]:
    """Resolve a ``workers=`` selection to ranks (pure). Explicit dead ranks are kept: the
    caller reports them; ``"ready"`` and ``"any"`` skip them."""
    world = len(alive)
    if isinstance(workers, str):
        if workers == "all":
            return list(range(world))
        if workers == "ready":
            return [r for r in range(world) if alive[r]]
        if workers == "any":
            for r in range(world):
                if alive[r]:
                    return [r]
            return []
        raise ValueError(f"workers={workers!r}: expected 'all', 'any', 'ready' or a list of ranks")
    ranks = [workers] if isinstance(workers, int) else list(workers)
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"workers must hold integer ranks, got {r!r}")
        if not 0 <= r < world:
            raise ValueError(f"rank {r} is outside this group's ranks 0..{world - 1}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"workers={ranks} names a rank twice")
    return sorted(ranks)
