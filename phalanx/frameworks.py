"""Where each rank sits and which environment it starts with: pure functions, no I/O.

A :class:`Layout` is ``nodes`` x ``procs_per_node`` ranks, numbered node-major (rank 0..k-1
on node 0, and so on). :func:`rank_env` gives the variables every worker gets, whatever the
framework: exactly what ``torch.distributed.init_process_group(init_method="env://")`` reads,
plus ``PHALANX_*`` equivalents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

GENERIC_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
FRAMEWORKS = (None, "spmd")


@dataclasses.dataclass(frozen=True)
class Layout:
    nodes: int
    procs_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.procs_per_node


def rank_env(layout: Layout, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The generic rendezvous variables of one rank."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside 0..{layout.world_size - 1}")
    values = {
        "RANK": rank,
        "LOCAL_RANK": layout.local_rank_of(rank),
        "WORLD_SIZE": layout.world_size,
        "LOCAL_WORLD_SIZE": layout.procs_per_node,
        "NODE_RANK": layout.node_of(rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }
    env = {name: str(value) for name, value in values.items()}
    env.update({f"PHALANX_{name}": str(value) for name, value in values.items()})
    return env


def check_framework(framework: str | None) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}; expected one of "
            + ", ".join(repr(f) for f in FRAMEWORKS)
        )


def merge_env(
    base: Mapping[str, str],
    generic: Mapping[str, str],
    user: Mapping[str, str] | None,
    per_rank: Mapping[str, str] | None,
) -> dict[str, str]:
    """Layer the environments: inherited, then phalanx's, then the user's global, then per rank.

    Values must be strings (as ``os.environ`` requires); anything else is a clear error
    before any process starts.
    """
    env = dict(base)
    env.setdefault("PYTHONUNBUFFERED", "1")  # so worker output streams line by line
    env.update(generic)
    for source, label in ((user, "env"), (per_rank, "rank_env")):
        for key, value in (source or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"{label} entries must be str -> str, got {key!r}: {value!r} "
                    f"({type(value).__name__})"
                )
            env[key] = value
    return env
