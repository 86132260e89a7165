"""Which environment each rank starts with, by framework: pure functions, no I/O.

Every rank gets the generic variables of :func:`phalanx.world.layout.rank_env`. A
:class:`Framework` adds what one distributed framework expects; all of them are described
in :data:`FRAMEWORKS`, the one place to extend. A :class:`WorldPart` is what a
single-controller framework starts beside the ranks (a Ray cluster, Monarch's workers).

The worker-side actions some frameworks need (start a Ray node, stop it at exit, tear down
a process group) are named here and implemented in :mod:`phalanx.rank.bootstrap`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.world.layout import Launch, Layout, as_procs_per_node, gpu_env, rank_env

ENV_FRAMEWORK = "PHALANX_FRAMEWORK"
ENV_NODE_ADDRS = "PHALANX_NODE_ADDRS"  # comma-separated, one per node (single-controller)
ENV_MONARCH_WORKERS = "PHALANX_MONARCH_WORKERS"  # the allocator argument, comma-separated
ENV_NODE_SERVICE = "PHALANX_NODE_SERVICE"  # JSON NodeService, read once by the worker


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
    over a cluster the other nodes join (one process per node); ``preload`` names the
    modules a node may import once and fork its ranks from (``WorkerGroup(preload=)``).
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
    # modules a node may import once and fork its ranks from (preload=): only those whose
    # import reads nothing a rank's environment sets and starts no thread
    preload: tuple[str, ...] = ()


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


def tf_config(layout: Layout, node: int, launch: Launch) -> dict[str, Any]:
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
        preload=("torch",),  # CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS: read later, not at import
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
    if isinstance(procs_per_node, str):
        if procs_per_node != "auto":
            raise ValueError(f"procs_per_node must be a positive integer or 'auto', "
                             f"got {procs_per_node!r}")
        if framework.one_per_node:
            return 1
        if gpus is None:
            raise ValueError(
                "procs_per_node='auto' needs each node's GPU count, which this backend learns "
                "only once the ranks are placed; give a number of processes per node"
            )
        per_worker = gpus_per_worker if isinstance(gpus_per_worker, int) else 1
        return framework.auto_procs(gpus // max(per_worker, 1))
    return as_procs_per_node(procs_per_node)


def worker_env(framework: Framework, layout: Layout, rank: int, launch: Launch) -> dict[str, str]:
    """Everything phalanx sets for one rank: generic, framework and device variables."""
    env = rank_env(layout, rank, launch.master_addr, launch.master_port)
    env[ENV_FRAMEWORK] = framework.name
    env.update(framework.env(layout, rank, launch))
    env.update(gpu_env(layout.local_rank_of(rank), launch, layout.node_of(rank)))
    if framework.service is not None and layout.local_rank_of(rank) == 0:
        env[ENV_NODE_SERVICE] = framework.service(layout.node_of(rank), launch).to_json()
    return env


