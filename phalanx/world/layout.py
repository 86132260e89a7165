"""Where each rank sits: a group's layout, what one start decided, and each rank's variables.

A :class:`Layout` is ``nodes`` x ``procs_per_node`` ranks, numbered node-major (rank 0..k-1
on node 0, and so on). A :class:`Launch` is what the controller decided for one start
(addresses, ports, devices). Every rank gets the generic rendezvous variables of
:func:`rank_env` (exactly what ``torch.distributed.init_process_group(init_method="env://")``
reads, plus ``PHALANX_*`` equivalents), its devices from :func:`gpu_env`, and the user's
variables layered by :func:`merge_env`. Pure functions, no I/O; the frameworks' own
variables are in :mod:`phalanx.world.frameworks`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence

from phalanx import config

GENERIC_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

RESTART_VARS = ("PHALANX_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


@dataclasses.dataclass(frozen=True)
class Layout:
    """``nodes`` nodes; ``procs_per_node`` ranks on each (an int), or per node (a tuple, for
    uneven layouts such as ``(2, 1)``). A tuple of equal counts is stored as the int."""

    nodes: int
    procs_per_node: int | tuple[int, ...]
    # derived in __post_init__: ranks per node, and each node's first rank (then the world size)
    _counts: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _starts: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes, procs = self.nodes, self.procs_per_node
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
        counts = (procs,) * nodes if not isinstance(procs, (tuple, list)) else tuple(procs)
        for value in counts:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"procs_per_node must be a positive integer or a list of them, got {procs!r}"
                )
        if len(counts) != nodes:
            raise ValueError(
                f"procs_per_node={list(counts)} gives {len(counts)} nodes but nodes={nodes}"
            )
        uniform = all(c == counts[0] for c in counts)
        object.__setattr__(self, "procs_per_node", counts[0] if uniform else counts)
        object.__setattr__(self, "_counts", counts)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        object.__setattr__(self, "_starts", tuple(starts))

    @classmethod
    def of(cls, counts: Sequence[int]) -> Layout:
        """The layout with ``counts[n]`` ranks on node ``n``."""
        return cls(len(counts), tuple(counts))

    @property
    def counts(self) -> tuple[int, ...]:
        """Ranks per node, one entry per node."""
        return self._counts

    @property
    def uniform(self) -> bool:
        return isinstance(self.procs_per_node, int)

    @property
    def world_size(self) -> int:
        return self._starts[-1]

    def node_of(self, rank: int) -> int:
        procs = self.procs_per_node
        if isinstance(procs, int):  # uniform
            return rank // procs
        return bisect.bisect_right(self._starts, rank) - 1

    def local_rank_of(self, rank: int) -> int:
        return rank - self._starts[self.node_of(rank)]

    def ranks_of(self, node: int) -> range:
        """The ranks on ``node``."""
        starts = self._starts
        return range(starts[node], starts[node + 1])

    def local_world_size(self, node: int) -> int:
        return self.counts[node]


def as_procs_per_node(procs_per_node: int | Sequence[int]) -> int | tuple[int, ...]:
    """``procs_per_node`` as a :class:`Layout` takes it: an int as it is, a list of counts
    (one per node) as a tuple. Anything else goes through as well, for Layout to refuse."""
    if isinstance(procs_per_node, Sequence) and not isinstance(procs_per_node, str):
        return tuple(procs_per_node)
    return procs_per_node


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the controller decided for one start of a group: addresses, ports, devices."""

    master_addr: str
    master_port: int
    node_addrs: tuple[str, ...]  # one per node; node 0's is master_addr
    ports: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    token: str = ""  # shared secret for framework services that authenticate (Ray)
    gpus_per_worker: int = 0
    visible_gpus: tuple[str, ...] = ()  # device ids as the machine lists them
    # per node, the positions in visible_gpus of its devices; () = every node has them all
    # (nodes on separate machines); simulated nodes on one machine split its GPUs
    node_gpus: tuple[tuple[int, ...], ...] = ()

    def port(self, name: str, node: int = 0) -> int:
        return self.ports[name][node]

    def gpus_of(self, node: int) -> tuple[int, ...]:
        """Positions in ``visible_gpus`` of the devices node ``node``'s workers may use."""
        if self.node_gpus:
            return self.node_gpus[node]
        return tuple(range(len(self.visible_gpus)))


def rank_env(layout: Layout, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The generic rendezvous variables of one rank."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside 0..{layout.world_size - 1}")
    values = {
        "RANK": rank,
        "LOCAL_RANK": layout.local_rank_of(rank),
        "WORLD_SIZE": layout.world_size,
        "LOCAL_WORLD_SIZE": layout.local_world_size(layout.node_of(rank)),
        "NODE_RANK": layout.node_of(rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }
    env = {name: str(value) for name, value in values.items()}
    env.update({f"PHALANX_{name}": str(value) for name, value in values.items()})
    return env


def parse_visible_gpus(value: str | None) -> tuple[str, ...] | None:
    """Device ids listed in ``CUDA_VISIBLE_DEVICES``; None when the variable is unset."""
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def check_gpus(
    gpus_per_worker: int, procs_per_node: int, visible: Sequence[str], note: str = ""
) -> None:
    if not isinstance(gpus_per_worker, int) or isinstance(gpus_per_worker, bool) \
            or gpus_per_worker < 0:
        raise ValueError(f"gpus_per_worker must be a non-negative integer, "
                         f"got {gpus_per_worker!r}")
    needed = gpus_per_worker * procs_per_node
    if needed > len(visible):
        raise ValueError(
            f"gpus_per_worker={gpus_per_worker} x {procs_per_node} workers per node needs "
            f"{needed} GPUs per node, but {len(visible)} are visible"
            + (f" ({','.join(visible)})" if visible else "") + note
        )


def split_gpus(count: int, nodes: int) -> tuple[tuple[int, ...], ...]:
    """Simulated nodes on one machine: node ``n`` gets the ``n``-th equal block of its GPUs."""
    block = count // nodes
    return tuple(tuple(range(n * block, (n + 1) * block)) for n in range(nodes))


def gpu_env(local_rank: int, launch: Launch, node: int = 0) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES``: local rank ``i`` gets the ``i``-th block of
    ``gpus_per_worker`` devices of its node; without ``gpus_per_worker``, the ranks of a
    node simulated on a shared machine see that node's share of its GPUs."""
    mine = launch.gpus_of(node)
    if launch.gpus_per_worker:
        first = local_rank * launch.gpus_per_worker
        mine = mine[first : first + launch.gpus_per_worker]
    elif not launch.node_gpus:
        return {}  # nodes on separate machines: every rank sees its machine's GPUs
    return {"CUDA_VISIBLE_DEVICES": ",".join(launch.visible_gpus[i] for i in mine)}


RANK_SCHEDULING = ("batch", "normal")


def rank_scheduling(env: Mapping[str, str]) -> str:
    """How a rank started by a node supervisor is scheduled, from ``PHALANX_RANK_SCHED`` in
    its environment: ``"batch"`` (the default: Linux's ``SCHED_BATCH``, nice unchanged) or
    ``"normal"`` (the policy it would inherit, ``SCHED_OTHER`` as a rule). A batch task
    never preempts the one running where it wakes: the controller, sending a call to its
    ranks one after another, is not stopped after each send by the rank it just woke on
    its own CPU (on a 2-core machine a no-op call to 4 ranks went from ~1.15x to ~0.82x
    the time of a hand-written pipe pool, ``bench/`` W2). Ranks are compute-bound,
    non-interactive work, which the policy is meant for; what they start inherits it.
    ValueError for any other value, naming the variable."""
    value = env.get(config.ENV_RANK_SCHED, "batch")
    if value not in RANK_SCHEDULING:
        raise ValueError(f"{config.ENV_RANK_SCHED}={value!r}: expected one of "
                         f"{', '.join(map(repr, RANK_SCHEDULING))}")
    return value


def merge_env(
    base: Mapping[str, str],
    generic: Mapping[str, str],
    user: Mapping[str, str] | None,
    per_rank: Mapping[str, str] | None,
) -> dict[str, str]:
    """Layer the environments: inherited, then phalanx's, then the user's global, then per rank.

    Values must be strings (as ``os.environ`` requires); anything else is a clear error
    before any process starts. So is a user variable that would change one phalanx sets
    (``RANK``, ``MASTER_PORT``, ``CUDA_VISIBLE_DEVICES``...): the ranks would disagree
    with each other, or with the controller, about who they are and where to meet.
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
        clash = sorted(k for k, v in (source or {}).items() if k in generic and generic[k] != v)
        if clash:
            raise ValueError(
                f"{label} sets {', '.join(clash)}, which phalanx sets itself for each rank "
                f"(here {', '.join(f'{k}={generic[k]!r}' for k in clash)}); leave "
                f"{'it' if len(clash) == 1 else 'them'} out (GPUs: use gpus_per_worker=)"
            )
        env.update(source or {})
    return env
