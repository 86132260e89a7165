"""Where each rank sits and which environment it starts with: pure functions, no I/O.

A :class:`Layout` is ``nodes`` x ``procs_per_node`` ranks, numbered node-major (rank 0..k-1
on node 0, and so on). Every rank gets the generic rendezvous variables of :func:`rank_env`
(exactly what ``torch.distributed.init_process_group(init_method="env://")`` reads, plus
``PHALANX_*`` equivalents). A :class:`Framework` adds what one distributed framework expects;
all of them are described in :data:`FRAMEWORKS`, the one place to extend.

The worker-side actions some frameworks need (start a Ray node, stop it at exit, tear down
a process group) are named here and implemented in :mod:`phalanx.rank.bootstrap`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

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
ENV_FRAMEWORK = "PHALANX_FRAMEWORK"
ENV_NODE_ADDRS = "PHALANX_NODE_ADDRS"  # comma-separated, one per node (single-controller)
ENV_MONARCH_WORKERS = "PHALANX_MONARCH_WORKERS"  # the allocator argument, comma-separated
ENV_NODE_SERVICE = "PHALANX_NODE_SERVICE"  # JSON NodeService, read once by the worker


@dataclasses.dataclass(frozen=True)
class Layout:
    """``nodes`` nodes; ``procs_per_node`` ranks on each (an int), or per node (a tuple, for
    uneven layouts such as ``(2, 1)``). A tuple of equal counts is stored as the int."""

    nodes: int
    procs_per_node: int | tuple[int, ...]

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
        return self._counts  # type: ignore[attr-defined]

    @property
    def uniform(self) -> bool:
        return isinstance(self.procs_per_node, int)

    @property
    def world_size(self) -> int:
        return self._starts[-1]  # type: ignore[attr-defined]

    def node_of(self, rank: int) -> int:
        if self.uniform:
            return rank // self.procs_per_node  # type: ignore[operator]
        return bisect.bisect_right(self._starts, rank) - 1  # type: ignore[attr-defined]

    def local_rank_of(self, rank: int) -> int:
        return rank - self._starts[self.node_of(rank)]  # type: ignore[attr-defined]

    def ranks_of(self, node: int) -> range:
        """The ranks on ``node``."""
        starts = self._starts  # type: ignore[attr-defined]
        return range(starts[node], starts[node + 1])

    def local_world_size(self, node: int) -> int:
        return self.counts[node]


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


@dataclasses.dataclass(frozen=True)
class WorldPart:
    """One node of a bigger world, run by a group of its own: what ``phalanx run`` does with
    one launcher per node. The group's ranks are node ``node``'s ranks of ``world``: they get
    the world's ``RANK``, ``WORLD_SIZE``, ``NODE_RANK`` and the job's rendezvous, and their
    output is shown under their world rank. Calls, health and errors keep the group's own
    numbering (0 .. its size - 1), which is the ranks' ``LOCAL_RANK``."""

    world: Layout
    node: int

    def __post_init__(self) -> None:
        if not isinstance(self.world, Layout):
            raise TypeError(f"world must be a Layout, got {self.world!r}")
        if not (isinstance(self.node, int) and 0 <= self.node < self.world.nodes):
            raise ValueError(f"node must be in 0..{self.world.nodes - 1}, got {self.node!r}")

    @property
    def first_rank(self) -> int:
        return self.world.ranks_of(self.node).start

    @property
    def size(self) -> int:
        return self.world.counts[self.node]

    def check(self, framework: Framework, layout: Layout) -> None:
        """Why a group of ``layout`` running ``framework`` cannot be this part, if it cannot."""
        if layout.counts != (self.size,):
            raise ValueError(f"a group running node {self.node} of {list(self.world.counts)} "
                             f"must have one node of {self.size} ranks, not {list(layout.counts)}")
        if framework.env is not _no_env or framework.ports or framework.service is not None \
                or framework.single_controller:
            raise ValueError(f"framework={framework.name!r} needs one controller for the whole "
                             "world; a group running one node of it can use the generic "
                             "variables (spmd) or torch")

    def rank_env(self, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
        """The world's generic variables for the group's rank ``rank``."""
        return rank_env(self.world, self.first_rank + rank, master_addr, master_port)


# -- framework descriptions ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeService:
    """A process a framework needs on each node (a Ray node, a Monarch allocator), started by
    that node's worker before user code and stopped when the worker exits."""

    command: tuple[str, ...]
    ready_line: str | None = None  # text in its output that says it is ready
    ready_port: tuple[str, int] | None = None  # ...or: it accepts connections here
    after: tuple[str, int] | None = None  # wait for this address to accept before starting
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    scratch: str | None = None  # a directory of its own, removed once it stopped

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NodeService:
        data = json.loads(text)
        for key in ("command", "ready_port", "after"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


EnvFn = Callable[[Layout, int, Launch], dict[str, str]]


def _no_env(layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    return {}


def _one_process(gpus: int) -> int:
    return 1


def _one_per_gpu(gpus: int) -> int:
    return max(gpus, 1)


@dataclasses.dataclass(frozen=True)
class Framework:
    """How to bootstrap one distributed framework on every rank.

    ``env`` adds variables to the generic ones; ``ports`` names the services phalanx picks a
    free port for on each node (``launch.ports[name][node]``); ``setup``/``cleanup`` name
    worker-side actions in :mod:`phalanx.rank.bootstrap`, run before the user object is built and
    when the worker exits; ``auto_procs`` turns the number of GPUs a node has into the
    ``procs_per_node="auto"`` count; ``service`` describes a process each node's worker
    runs beside it; a ``single_controller`` framework runs the user function on node 0 only,
    over a cluster the other nodes join (one process per node).
    """

    name: str
    package: str | None = None  # module that must be importable on the workers
    install: str | None = None  # how to get it
    env: EnvFn = _no_env
    ports: tuple[str, ...] = ()
    setup: str | None = None
    cleanup: str | None = None
    service: Callable[[int, Launch], NodeService] | None = None
    auto_procs: Callable[[int], int] = _one_process
    single_controller: bool = False
    one_per_node: bool = False


def jax_local_devices(layout: Layout, rank: int, launch: Launch) -> list[int] | None:
    """The devices (as jax numbers them in the process) one rank uses; None: leave jax be."""
    if launch.gpus_per_worker:  # its GPUs, renumbered from 0 by CUDA_VISIBLE_DEVICES
        return list(range(launch.gpus_per_worker))
    local_rank = layout.local_rank_of(rank)
    mine = launch.gpus_of(layout.node_of(rank))
    if launch.node_gpus:  # CUDA_VISIBLE_DEVICES holds the node's share: jax counts from 0
        mine = tuple(range(len(mine)))
    if not mine:  # CPU: one device per process, as jax does under its cluster managers
        return [local_rank]
    # an equal share of the node's GPUs
    share = len(mine) // layout.local_world_size(layout.node_of(rank))
    if share == 0:
        return None  # fewer GPUs than processes: nothing sensible to pin
    return list(mine[local_rank * share : (local_rank + 1) * share])


def _jax_env(layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    env = {
        "JAX_COORDINATOR_ADDRESS": f"{launch.master_addr}:{launch.port('jax')}",
        "JAX_PROCESS_ID": str(rank),
        "JAX_NUM_PROCESSES": str(layout.world_size),
    }
    devices = jax_local_devices(layout, rank, launch)
    if devices is not None:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(d) for d in devices)
    return env


def tf_config(layout: Layout, node: int, launch: Launch) -> dict:
    """``TF_CONFIG`` for the worker on ``node``: one worker task per node, in node order."""
    workers = [f"{addr}:{launch.port('tensorflow', n)}" for n, addr in enumerate(launch.node_addrs)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": node}}


def _tensorflow_env(layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    config = tf_config(layout, layout.node_of(rank), launch)
    return {"TF_CONFIG": json.dumps(config, separators=(",", ":"))}


def ray_address(launch: Launch) -> str:
    return f"{launch.master_addr}:{launch.port('ray')}"


def _ray_env(layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    env = {
        # the cluster phalanx starts accepts only peers holding this group's token
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": launch.token,
        ENV_NODE_ADDRS: ",".join(launch.node_addrs),
    }
    if layout.node_of(rank) == 0:
        env["RAY_ADDRESS"] = ray_address(launch)
    return env


def ray_start_command(node: int, launch: Launch) -> list[str]:
    """The ``ray start`` command the worker on ``node`` runs (in the foreground: stopping it
    stops that node's Ray processes). Node 0 is the head; the others join it."""
    address = launch.node_addrs[node]
    if node == 0:
        command = ["ray", "start", "--head", f"--port={launch.port('ray')}",
                   "--include-dashboard=false"]
    else:
        command = ["ray", "start", f"--address={ray_address(launch)}"]
    return [*command, f"--node-ip-address={address}",
            f"--temp-dir={ray_temp_dir(launch, node)}", "--disable-usage-stats", "--block"]


def ray_temp_dir(launch: Launch, node: int) -> str:
    """A Ray directory of the node's own: its sessions, logs and ``ray_current_cluster``
    stay out of ``/tmp/ray``, where a later plain ``ray.init()`` would find the stopped
    cluster. (Short: Ray's Unix sockets live below it.)"""
    return f"/tmp/phalanx-ray-{launch.token[:8]}-{node}"


def _ray_service(node: int, launch: Launch) -> NodeService:
    head = (launch.master_addr, launch.port("ray"))
    return NodeService(
        command=tuple(ray_start_command(node, launch)),
        ready_line="Ray runtime started",
        after=None if node == 0 else head,
        # stop at once on SIGTERM instead of draining the node for 30 s
        env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        scratch=ray_temp_dir(launch, node),
    )


def monarch_worker_address(launch: Launch, node: int) -> str:
    """Where node ``node``'s Monarch worker loop listens, as Monarch spells addresses."""
    return f"tcp://{launch.node_addrs[node]}:{launch.port('monarch', node)}"


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("localhost", "::1")


def _monarch_env(layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    env = {
        ENV_NODE_ADDRS: ",".join(launch.node_addrs),
        ENV_MONARCH_WORKERS: ",".join(
            monarch_worker_address(launch, n) for n in range(layout.nodes)
        ),
    }
    if not all(_is_loopback(a) for a in launch.node_addrs):
        # hosts reach each other's processes over TCP (one machine: Monarch's default, Unix)
        env["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] = "tcp"
    return env


def monarch_worker_command(node: int, launch: Launch) -> list[str]:
    """The Monarch worker loop started on ``node``: the controller on node 0 attaches to
    every node's loop and spawns its processes through it."""
    address = monarch_worker_address(launch, node)
    return [
        "python",
        "-c",
        "from monarch.actor import run_worker_loop_forever\n"
        f"run_worker_loop_forever(address={address!r}, ca='trust_all_connections')\n",
    ]


def _monarch_service(node: int, launch: Launch) -> NodeService:
    return NodeService(
        command=tuple(monarch_worker_command(node, launch)),
        ready_port=(launch.node_addrs[node], launch.port("monarch", node)),
    )


FRAMEWORKS: dict[str | None, Framework] = {
    None: Framework("spmd"),
    "spmd": Framework("spmd"),
    # the generic variables are exactly what init_process_group(init_method="env://") reads
    "torch": Framework(
        "torch",
        package="torch",
        install="pip install 'phalanx[torch]'",
        cleanup="torch_cleanup",
        auto_procs=_one_per_gpu,
    ),
    "jax": Framework(
        "jax",
        package="jax",
        install="pip install 'phalanx[jax]'",
        env=_jax_env,
        ports=("jax",),
        setup="jax_setup",
        auto_procs=_one_per_gpu,
    ),
    "tensorflow": Framework(
        "tensorflow",
        package="tensorflow",
        install="pip install 'phalanx[tensorflow]'",
        env=_tensorflow_env,
        ports=("tensorflow",),
        cleanup="tensorflow_cleanup",
        one_per_node=True,
    ),
    "ray": Framework(
        "ray",
        package="ray",
        install="pip install 'phalanx[ray]'",
        env=_ray_env,
        ports=("ray",),
        service=_ray_service,
        cleanup="ray_cleanup",
        single_controller=True,
        one_per_node=True,
    ),
    "monarch": Framework(
        "monarch",
        package="monarch",
        install="pip install torchmonarch",
        env=_monarch_env,
        ports=("monarch",),
        service=_monarch_service,
        single_controller=True,
        one_per_node=True,
    ),
}


def get_framework(name: str | None) -> Framework:
    """The description of ``name``; a clear error for an unknown one."""
    try:
        return FRAMEWORKS[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(f) for f in FRAMEWORKS)
        raise ValueError(f"unknown framework {name!r}; expected one of {known}") from None


def check_layout(framework: Framework, layout: Layout | int) -> None:
    procs_per_node = layout.procs_per_node if isinstance(layout, Layout) else layout
    if framework.one_per_node and procs_per_node != 1:
        what = (
            "runs the function on node 0 over a cluster with one process per node"
            if framework.single_controller
            else "runs one worker process per node (TF_CONFIG has one task per node)"
        )
        raise ValueError(
            f"framework={framework.name!r} {what}; got procs_per_node={procs_per_node} "
            "(use procs_per_node=1 or 'auto')"
        )


def resolve_procs_per_node(
    procs_per_node: int | str | Sequence[int],
    framework: Framework,
    gpus: int | None,
    gpus_per_worker: int = 0,
) -> int | tuple[int, ...]:
    """``"auto"`` becomes the framework's count for a node with ``gpus`` GPUs, each worker
    taking ``gpus_per_worker`` of them (or one); ``gpus=None``: the backend cannot tell
    before placing the ranks. A list (one count per node) becomes a tuple."""
    if procs_per_node == "auto":
        if framework.one_per_node:
            return 1
        if gpus is None:
            raise ValueError(
                "procs_per_node='auto' needs each node's GPU count, which this backend learns "
                "only once the ranks are placed; give a number of processes per node"
            )
        per_worker = gpus_per_worker if isinstance(gpus_per_worker, int) else 1
        return framework.auto_procs(gpus // max(per_worker, 1))
    if isinstance(procs_per_node, str):
        raise ValueError(f"procs_per_node must be a positive integer or 'auto', "
                         f"got {procs_per_node!r}")
    if isinstance(procs_per_node, (list, tuple)):
        return tuple(procs_per_node)
    return procs_per_node


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


def worker_env(framework: Framework, layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    """Everything phalanx sets for one rank: generic, framework and device variables."""
    env = rank_env(layout, rank, launch.master_addr, launch.master_port)
    env[ENV_FRAMEWORK] = framework.name
    env.update(framework.env(layout, rank, launch))
    env.update(gpu_env(layout.local_rank_of(rank), launch, layout.node_of(rank)))
    if framework.service is not None and layout.local_rank_of(rank) == 0:
        env[ENV_NODE_SERVICE] = framework.service(layout.node_of(rank), launch).to_json()
    return env


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
