"""Detached groups on Ray: ranks that outlive the Ray driver that started them.

On Ray a rank is an actor its driver owns, so it ends with the controller. A detached group
(``WorkerGroup(..., backend=px.RayBackend(...), name="policy", detached=True)``) runs
instead on phalanx agents that Ray keeps for it: one :class:`AgentActor` per node of the
group, a *detached* actor (``lifetime="detached"``: no driver owns it) named
``phalanx-agent-<group>-n<i>`` in the backend's Ray namespace (``RayBackend(namespace=)``,
else ``"phalanx"``). The actors sit on the bundles of a detached placement group that holds
the group's resources as the Ray backend reserves them: one bundle per node with its ranks'
``resources_per_worker`` (one CPU by default) and ``gpus_per_worker`` GPUs together, the
nodes on distinct Ray nodes where the cluster has enough (else several on one, as the Ray
backend's virtual nodes); each actor takes its whole bundle, so Ray's GPUs of the bundle
are the agent's (``CUDA_VISIBLE_DEVICES``, inherited).

Each actor runs the ordinary ``phalanx agent`` as its child on its Ray node's address, with
a token made fresh for the group and shared by its agents, and leaves the agent's
``host:port`` and that token in Ray's internal key-value store under the namespace and the
group's name. The group itself then runs through a cluster backend over those agents
(composed in :mod:`phalanx.controller.detached`, which may import both backends): its ranks
are the agents' children, not Ray actors. The token is thereby exactly as protected as the
Ray cluster: whoever can use the cluster can read the store (and could run code on its
nodes anyway).

``px.attach(name, backend=px.RayBackend(...))`` finds the agents in the store
(:func:`find_agents`), ``px.attached`` the namespace's groups (:func:`groups`).

A detached resource pool (``px.ResourcePool(..., backend=px.RayBackend(...), name="rl",
detached=True)``) is started the same way under the pool's name: an agent actor per node of
the pool, in a detached placement group of the pool's slots (a bundle per node with its
slots' ``resources_per_proc``, one CPU by default, and ``gpus_per_proc`` GPUs each), their
records marked as a pool's. The groups placed on it run on those agents, each under a name
of its own, which the store does not hold: the controller finds one by asking the agents of
the namespace's pools which groups they keep (:func:`groups` lists the pools with their
live agents). A pool's agent ends with the last group of its node -- or, for a node none
was placed on, as the pool's own connection ends -- and the pool's last agent to end
removes the placement group, as a group's does; one whose agent ended before its pool's
others is not waited for (a pool's record lists its live agents only).

How it ends. Each agent runs with ``--once`` (it exits as the last of its sessions ends: the
group shut down by a controller, or given up after its ``detach_timeout`` with nobody
attaching) and ``--idle-timeout`` (no controller ever came). Its actor waits on it: once it
exited, the actor removes its key, and the last actor of the group to do so removes the
placement group, which ends every actor in it (the others end themselves with
``ray.kill``): nothing is left. An actor that dies first (``ray.kill``, its node lost) takes
its agent with it (``PR_SET_PDEATHSIG``: SIGTERM, on which an agent stops its ranks); a
lookup that finds its key without a live actor removes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx import config
from phalanx.backends.ray import session as ray_session
from phalanx.backends.ray.placement import (
    bundle_for,
    describe_ray_error,
    placement_problem,
    relays,
)
from phalanx.errors import StartupError

if TYPE_CHECKING:
    from phalanx.backends.ray.backend import RayBackend

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "phalanx"  # the Ray namespace of a backend that names none
STORE = "phalanx-detached"  # the namespace of Ray's internal key-value store for the agents
AGENT_START_TIMEOUT = 60.0  # seconds for an agent to listen once its actor runs
AGENT_IDLE_TIMEOUT = 60.0  # seconds an agent no controller reached waits before it exits
END_WAIT = 10.0  # seconds an actor whose agent ended waits for Ray to end it

# Runs the agent with PR_SET_PDEATHSIG = SIGTERM (kept across exec): should the actor's
# process die, the agent stops its ranks and exits. The parent check closes the window in
# which the actor died before the signal was armed.
_PDEATHSIG_EXEC = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class Agents(NamedTuple):
    """Where a detached group's agents listen (``host:port``, node by node) and their
    token; ``pool``: those of a detached resource pool (its live agents only), on which
    groups of other names run."""

    hosts: list[str]
    token: str
    pool: bool = False


def node_counts(nodes: int | None, procs_per_node: object) -> list[int]:
    """The ranks of each node of a group asked for with ``nodes`` and ``procs_per_node``
    (pure): what its agents' bundles hold. ValueError for ``"auto"``, which only the
    placed nodes could tell."""
    if isinstance(procs_per_node, str):
        raise ValueError(f"detached=True on Ray reserves each node's ranks before any "
                         f"starts: give procs_per_node as a number (or a list), not "
                         f"{procs_per_node!r}")
    if procs_per_node is None or isinstance(procs_per_node, int):
        count = 1 if procs_per_node is None else procs_per_node
        counts = [count] * (1 if nodes is None else nodes)
    elif isinstance(procs_per_node, Sequence):
        counts = list(procs_per_node)
        if nodes is not None and nodes != len(counts):
            raise ValueError(f"nodes={nodes} but procs_per_node lists {len(counts)} nodes")
    else:
        raise TypeError(f"procs_per_node must be a number or a list of numbers, got "
                        f"{procs_per_node!r}")
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                             for c in counts):
        raise ValueError(f"each node needs a positive number of ranks, got nodes={nodes!r}, "
                         f"procs_per_node={procs_per_node!r}")
    return counts


def namespace_of(backend: RayBackend) -> str:
    """The Ray namespace of a backend's detached groups."""
    return str(backend.namespace or DEFAULT_NAMESPACE)


def actor_name(group: str, node: int) -> str:
    """The name of the agent actor of ``group``'s node ``node``."""
    return f"phalanx-agent-{group}-n{node}"


def _key(namespace: str, group: str | None = None, node: int | None = None) -> str:
    """A key of the store, or the prefix of a namespace's (``group`` None) or a group's
    (``node`` None) keys: JSON, so that no name can pass for another's prefix."""
    parts: list[Any] = [namespace] + ([] if group is None else [group])
    if node is None:
        return json.dumps(parts)[:-1] + ", "
    return json.dumps([*parts, node])


# -- the controller's side ----------------------------------------------------------------


def start_agents(backend: RayBackend, name: str, counts: Sequence[int], gpus_per_worker: int,
                 timeout: float = config.DEFAULT_START_TIMEOUT, *,
                 per_rank: Mapping[str, float] | None = None, pool: bool = False) -> Agents:
    """Start the agents of detached group ``name`` on the Ray cluster of ``backend`` (a
    ``RayBackend``), one per node with ``counts[i]`` ranks' resources, and wait until each
    listens; where they are. ``pool``: those of a detached resource pool of that name, whose
    slots hold ``per_rank`` each (one CPU and ``gpus_per_worker`` GPUs by default; a group's
    hold its backend's ``resources_per_worker``). ValueError if the backend cannot keep a
    group past this process, or a group or pool of that name runs in its namespace;
    StartupError if Ray cannot place them within ``timeout`` s. On failure nothing is
    left."""
    _check_settings(backend)
    if per_rank is None:
        per_rank = bundle_for(backend.resources_per_worker, gpus_per_worker)
    lease = _connect(backend)
    try:
        return _start(backend, name, list(counts), dict(per_rank), timeout, pool)
    finally:
        lease.release()


def end_agents(backend: RayBackend, name: str) -> None:
    """End the agents of detached group or pool ``name`` at once, whatever they run: their
    actors, placement group and records (what a pool whose start failed after its agents
    started leaves)."""
    lease = _connect(backend)
    try:
        ray = _ray()
        namespace = namespace_of(backend)
        records = _records(ray, namespace, name)
        for record in records.values():
            with contextlib.suppress(Exception):  # gone meanwhile
                ray.kill(ray.get_actor(record["actor"], namespace=namespace),
                         no_restart=True)
        for pg_hex in {r.get("placement_group") for r in records.values()}:
            _remove_placement_group(ray, pg_hex)
        _drop(namespace, name)
    finally:
        lease.release()


def _check_settings(backend: RayBackend) -> None:
    if backend.placement_group is not None:
        raise ValueError("detached=True on Ray reserves a placement group of its own, which "
                         "outlives this process: RayBackend(placement_group=) cannot be used")
    if relays(backend.address, backend.transport):
        raise ValueError("detached=True on Ray runs the group on agents that the controller "
                         "connects to: a Ray Client (ray://) address or transport='ray' "
                         "cannot be used")


def _connect(backend: RayBackend) -> ray_session.Lease:
    """This process's connection to the backend's Ray cluster: never a local Ray started
    for it, which would end with this process (and keeps no detached group)."""
    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    if backend.address is None and not os.environ.get("RAY_ADDRESS") and not connected:
        raise ValueError("detached groups on Ray live on a Ray cluster that outlives this "
                         "process: give RayBackend(address='auto' or 'host:port'), set "
                         "RAY_ADDRESS, or ray.init() the cluster first")
    return ray_session.acquire(backend.address, namespace=backend.namespace,
                               runtime_env=backend.runtime_env, min_cpus=1)


def _start(backend: RayBackend, name: str, counts: list[int], per_rank: dict[str, float],
           timeout: float, pool: bool) -> Agents:
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    namespace = namespace_of(backend)
    what = "pool" if pool else "group"
    running = _records(ray, namespace, name)
    if running:
        other = ("detached resource pool" if next(iter(running.values())).get("pool")
                 else "detached group")
        raise ValueError(f"a {other} named {name!r} runs in Ray namespace {namespace!r} "
                         f"already: px.attach its group(s), or shut them down first (the "
                         f"agents of a {what} whose start failed go within "
                         f"{AGENT_IDLE_TIMEOUT:g} s)")
    bundles = [{k: v * n for k, v in per_rank.items()} for n in counts]
    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if len(bundles) == 1:
        strategy = "PACK"
    elif (backend.placement_strategy == "STRICT_SPREAD"
          or placement_problem(bundles, "STRICT_SPREAD", alive) is None):
        strategy = "STRICT_SPREAD"  # a node per Ray node, where the cluster has enough
    else:
        strategy = "SPREAD"  # virtual nodes: fewer Ray nodes than the group's
    asked = f"{len(bundles)} bundles {bundles[0]} (strategy {strategy})"
    problem = placement_problem(bundles, strategy, alive)
    if problem is not None:
        raise StartupError(f"Ray cannot place the agents of detached {what} {name}, {asked}: "
                           f"{problem} (cluster resources: {ray.cluster_resources()})")
    deadline = time.monotonic() + timeout
    pg = placement_group(bundles, strategy=strategy, name=f"phalanx-detached-{name}",
                         lifetime="detached")
    token = secrets.token_urlsafe(32)
    actors: list[Any] = []
    try:
        if not pg.wait(timeout_seconds=max(1, int(timeout))):
            raise StartupError(
                f"Ray did not place the agents of detached {what} {name}, {asked}, within "
                f"{timeout:g} s (available now: {ray.available_resources()}); free "
                "resources or raise start_timeout")
        made = ray_session.remote_class(AgentActor)
        for index, bundle in enumerate(bundles):
            resources = dict(bundle)
            options: dict[str, Any] = {
                "name": actor_name(name, index), "namespace": namespace,
                "lifetime": "detached", "max_restarts": 0,
                "num_cpus": resources.pop("CPU", 0.0), "num_gpus": resources.pop("GPU", 0.0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index),
            }
            memory = resources.pop("memory", None)
            if memory:
                options["memory"] = memory
            options["resources"] = resources or None
            if backend.runtime_env is not None:
                options["runtime_env"] = dict(backend.runtime_env)
            actors.append(made.options(**options).remote(
                token, namespace, name, index, len(bundles), pool))
        left = max(1.0, deadline - time.monotonic())
        hosts: list[str] = ray.get([a.address.remote() for a in actors], timeout=left)
    except BaseException as exc:  # interrupted too: nothing is left holding the cluster
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        _drop(namespace, name)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise StartupError(f"the agents of detached {what} {name} did not start within "
                               f"{timeout:g} s") from None
        if isinstance(exc, ray.exceptions.RayError):
            raise StartupError(f"the agents of detached {what} {name} could not start: "
                               f"{describe_ray_error(exc)}") from exc
        raise
    logger.info("detached %s %s: agents at %s (Ray namespace %s)", what, name,
                ", ".join(hosts), namespace)
    return Agents(hosts, token, pool)


def find_agents(backend: RayBackend, name: str) -> Agents:
    """The agents of detached group ``name`` in the backend's Ray namespace, as the store
    holds them; LookupError when none keeps it there (under its own name: a group placed on
    a detached pool is its pool's agents', see :func:`groups`), or some of its agents are
    gone."""
    lease = _connect(backend)
    try:
        import ray

        records = _records(ray, namespace_of(backend), name)
    finally:
        lease.release()
    if not records or any(r.get("pool") for r in records.values()):
        raise LookupError(f"no detached group named {name!r} in Ray namespace "
                          f"{namespace_of(backend)!r} (RayBackend(namespace=) names the one "
                          "it was started in)")
    return _agents_of(name, records)


def groups(backend: RayBackend) -> dict[str, Agents]:
    """Every detached group of the backend's Ray namespace whose agents all run -> them,
    and every detached pool with an agent running -> its live agents (``pool`` set)."""
    lease = _connect(backend)
    try:
        import ray

        records = _records(ray, namespace_of(backend), None)
    finally:
        lease.release()
    by_group: dict[str, dict[int, dict[str, Any]]] = {}
    for (group, node), record in records.items():
        by_group.setdefault(group, {})[node] = record
    found = {}
    for group, nodes in sorted(by_group.items()):
        try:
            found[group] = _agents_of(group, {(group, n): r for n, r in nodes.items()})
        except LookupError as exc:
            logger.warning("%s", exc)
    return found


def _agents_of(name: str, records: dict[tuple[str, int], dict[str, Any]]) -> Agents:
    nodes = {node: record for (_, node), record in records.items()}
    first = next(iter(nodes.values()))
    if first.get("pool"):  # its agents end node by node, with their groups
        return Agents([str(nodes[n]["host"]) for n in sorted(nodes)], str(first["token"]),
                      pool=True)
    count = int(first["nodes"])
    missing = [node for node in range(count) if node not in nodes]
    if missing:
        raise LookupError(f"detached group {name!r}: the agents of its node(s) {missing} are "
                          "gone (their Ray nodes lost, or their actors killed); the others "
                          "stop its ranks once its detach_timeout passes")
    return Agents([str(nodes[n]["host"]) for n in range(count)], str(nodes[0]["token"]))


def _records(ray: Any, namespace: str, name: str | None) -> dict[tuple[str, int], dict[str, Any]]:
    """The store's records of the namespace's agents (of group ``name`` alone, unless
    None) whose actors live, by (group, node); a record whose actor is gone is removed (and
    with the last of a group, its placement group)."""
    from ray.experimental import internal_kv

    found: dict[tuple[str, int], dict[str, Any]] = {}
    stale: list[dict[str, Any]] = []
    for key in internal_kv._internal_kv_list(_key(namespace, name), namespace=STORE):  # noqa: SLF001
        data = internal_kv._internal_kv_get(key, namespace=STORE)  # noqa: SLF001
        if data is None:
            continue  # removed meanwhile
        record = json.loads(data)
        try:
            ray.get_actor(record["actor"], namespace=namespace)
        except ValueError:  # no live actor of that name: it died without removing its key
            internal_kv._internal_kv_del(key, namespace=STORE)  # noqa: SLF001
            stale.append(record)
            continue
        found[(str(record["group"]), int(record["node"]))] = record
    for record in stale:
        if not any(group == record["group"] for group, _ in found):
            _remove_placement_group(ray, record.get("placement_group"))
    return found


def _remove_placement_group(ray: Any, pg_hex: str | None) -> None:
    if not pg_hex:
        return
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    with contextlib.suppress(Exception):  # removed already
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_hex)))


def _drop(namespace: str, name: str) -> None:
    """Remove every record of group ``name`` from the store."""
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):  # Ray going away: its store with it
        internal_kv._internal_kv_del(_key(namespace, name), del_by_prefix=True,  # noqa: SLF001
                                     namespace=STORE)


# -- the actor (in its Ray worker, on the group's node) ------------------------------------


class AgentActor:
    """One node's ``phalanx agent`` for a detached group, kept by Ray (a detached actor):
    the agent is this actor's child, and the actor ends once the agent has."""

    def __init__(self, token: str, namespace: str, group: str, node: int, nodes: int,
                 pool: bool = False) -> None:
        ray = _ray()
        from phalanx.node.machine import pick_free_ports

        self._host = str(ray.util.get_node_ip_address())
        self._port = pick_free_ports(self._host, 1)[0]
        self._namespace, self._group = namespace, group
        self._key = _key(namespace, group, node)
        self._registered = False
        self._proc: subprocess.Popen[bytes] | None = None
        spawned = threading.Event()
        # the agent is started by the thread that waits on it, for its whole life: the
        # kernel's parent-death signal fires as the thread that forked a child exits
        threading.Thread(target=self._run_agent, args=(token, spawned),
                         name="phalanx-detached-agent", daemon=True).start()
        spawned.wait()
        proc = self._proc
        if proc is None:
            raise StartupError(f"the phalanx agent of detached group {group} could not be "
                               f"started on {self._host}")
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        while not _listens(proc.pid, self._port):
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                raise StartupError(
                    f"the phalanx agent of detached group {group} on {self._host} did not "
                    f"listen within {AGENT_START_TIMEOUT:g} s (exit status {proc.poll()}; "
                    "its output is in this actor's Ray log)")
            time.sleep(0.05)
        pg = ray.util.get_current_placement_group()
        record = {"group": group, "node": node, "nodes": nodes, "host": self.address(),
                  "token": token, "actor": actor_name(group, node), "pool": pool,
                  "placement_group": None if pg is None else pg.id.hex()}
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key, json.dumps(record),  # noqa: SLF001
                                     namespace=STORE)
        self._registered = True

    def address(self) -> str:
        """Where the agent listens (``host:port``)."""
        return f"{self._host}:{self._port}"

    def _run_agent(self, token: str, spawned: threading.Event) -> None:
        env = {**os.environ, config.ENV_TOKEN: token}  # the agent hands it on off its env
        command = [sys.executable, "-m", "phalanx", "agent", "--host", self._host,
                   "--port", str(self._port), "--no-http", "--once",
                   "--idle-timeout", str(AGENT_IDLE_TIMEOUT)]
        try:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *command],
                stdin=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
        except OSError:
            logger.exception("the phalanx agent of detached group %s could not start",
                             self._group)
            return
        finally:
            spawned.set()
        code = proc.wait()
        logger.info("the phalanx agent of detached group %s ended (exit status %s)",
                    self._group, code)
        if self._registered:  # else its start failed: the controller removes what it made
            self._end()

    def _end(self) -> None:
        """The agent ended: remove its record, and end this actor -- the last of the group
        by removing the group's placement group, which ends every actor in it."""
        import ray
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_del(self._key, namespace=STORE)  # noqa: SLF001
            prefix = _key(self._namespace, self._group)
            last = not internal_kv._internal_kv_list(prefix, namespace=STORE)  # noqa: SLF001
            pg = ray.util.get_current_placement_group()
            if last and pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            else:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        except Exception:  # ending anyway, below
            logger.exception("the actor of a detached group's agent could not end cleanly")
        time.sleep(END_WAIT)  # Ray ends this process meanwhile
        os._exit(0)


def _ray() -> Any:
    """The ``ray`` module (imported where Ray is used: the module is imported without it)."""
    import ray

    return ray


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port`` (asked of the kernel: a connection
    to try it would be one more the agent logs as refused)."""
    import psutil  # type: ignore[import-untyped]  # no stubs: types-psutil is not a dependency

    try:
        process = psutil.Process(pid)
        connections = getattr(process, "net_connections", None) or process.connections
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in connections(kind="tcp"))
    except psutil.Error:
        return False
