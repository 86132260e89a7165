"""What a group needs to be detachable (see :mod:`phalanx.controller.attach`): its
description, the backend it runs on when detached, and its orphaned answers.

:func:`detach_spec` pickles the constructor's arguments as the ranks get them (a class of a
script's ``__main__`` by value); :func:`detached_backend` puts a detached group of the local
backend on this user's own agent (:mod:`phalanx.backends.cluster.localagent`), whose ranks
outlive the controller, and one of the Ray backend on agents that are detached Ray actors
(:mod:`phalanx.backends.ray.detached`), as are a detached resource pool's on Ray
(:func:`ray_pool_backend`); :func:`orphan_of` turns an agent's record of an
answer no controller asked for into an :class:`Orphaned`.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx.errors import RemoteFailure, WorkerError
from phalanx.options import check_seconds
from phalanx.wire import pickling, protocol

if TYPE_CHECKING:
    from phalanx.backends.base import Backend
    from phalanx.backends.ray.backend import RayBackend
    from phalanx.backends.ray.detached import Agents

SPEC_VERSION = 1  # of the description's layout


class Orphaned(NamedTuple):
    """An answer no controller asked for: a call that was running when its controller
    went. ``error`` is the :class:`WorkerError` it raised (then ``value`` is None)."""

    rank: int
    call_id: int
    method: str
    value: Any
    error: WorkerError | None


def detach_spec(name: str | None, timeout: float, arguments: dict[str, Any]) -> bytes:
    """The description of a detached group: its constructor's ``arguments``, pickled;
    ValueError before anything starts when it has no name or they do not pickle."""
    if not isinstance(name, str) or not name:
        raise ValueError("detached=True needs name=: another controller attaches to the "
                         "group by it (px.attach(name, backend=...))")
    seconds = check_seconds(timeout, "detach_timeout")
    if seconds is None or seconds <= 0:
        raise ValueError(f"detach_timeout must be a positive number of seconds, got "
                         f"{timeout!r}")
    try:  # as the ranks get the target: a class of a script's __main__ by value
        parts = pickling.dumps({"version": SPEC_VERSION, "arguments": arguments})
        return pickle.dumps([bytes(part) for part in parts], protocol=5)
    except Exception as exc:  # noqa: BLE001 - anything a __reduce__ raises
        raise ValueError(
            f"detached=True: the group's arguments must pickle, since the controller that "
            f"attaches rebuilds the group from them ({type(exc).__name__}: {exc}); a lock, "
            "an open file or a socket among them cannot be") from None


def is_local(backend: Backend | str) -> bool:
    from phalanx.backends.local import LocalBackend

    return backend == "local" or isinstance(backend, LocalBackend)


def detached_backend(backend: Backend | str, nodes: int | None, name: str | None = None,
                     procs_per_node: object = None,
                     gpus_per_worker: int | None = 0) -> Backend | str:
    """Where a detached group runs: ``backend``, or for the local backend this user's own
    agent on this machine (:mod:`phalanx.backends.cluster.localagent`), started if none
    runs: the controller's children die with it, an agent's ranks do not. For the Ray
    backend, agents that are detached Ray actors, one per node, started for group ``name``
    with its nodes' resources (:mod:`phalanx.backends.ray.detached`)."""
    if is_ray(backend):
        from phalanx.backends.ray import detached as ray_detached

        ray_backend = _ray_backend(backend)
        counts = ray_detached.node_counts(nodes, procs_per_node)
        agents = ray_detached.start_agents(ray_backend, str(name), counts,
                                           gpus_per_worker or 0)
        return _on_agents(agents)
    if not is_local(backend):
        return backend
    if nodes not in (None, 1):
        raise ValueError(f"detached=True on the local backend runs the group on this "
                         f"user's local agent, one node: nodes={nodes!r} cannot be had (use "
                         "procs_per_node, or agents of your own with px.ClusterBackend)")
    from phalanx.backends.cluster import localagent
    from phalanx.backends.cluster.backend import ClusterBackend

    host, token_file = localagent.ensure()
    return ClusterBackend([host], token_file=token_file, quorum_timeout=10.0)


def local_agent_backend() -> Backend:
    """The backend of this user's running local agent (LookupError when none runs)."""
    from phalanx.backends.cluster import localagent
    from phalanx.backends.cluster.backend import ClusterBackend

    found = localagent.running()
    if found is None:
        raise LookupError("no detached group on this machine: this user's local phalanx "
                          "agent, which holds them, does not run")
    host, token_file = found
    return ClusterBackend([host], token_file=token_file, quorum_timeout=10.0)


def is_ray(backend: Backend | str) -> bool:
    return backend == "ray" or getattr(backend, "name", None) == "ray"


def ray_agents_backend(backend: Backend | str, name: str) -> Backend:
    """The backend of the agents of the Ray backend's detached group ``name``, found in
    its cluster's key-value store: its own, else those of the namespace's detached pool
    whose agents keep it (LookupError when none keeps a group of that name)."""
    from phalanx.backends.ray import detached as ray_detached

    ray_backend = _ray_backend(backend)
    try:
        return _on_agents(ray_detached.find_agents(ray_backend, name))
    except LookupError as missing:
        for agents in ray_detached.groups(ray_backend).values():
            if agents.pool:
                on = _on_agents(agents)
                if any(g["name"] == name for g in _listing(on)):
                    return on
        raise missing from None


def ray_attached(backend: Backend | str) -> list[dict[str, Any]]:
    """The detached groups of the Ray backend's namespace (as ``px.attached``): each
    group's or pool's agents have a token of their own, so each is asked apart (a pool's
    for every group placed on it)."""
    from phalanx.backends.ray import detached as ray_detached

    found: list[dict[str, Any]] = []
    for name, agents in ray_detached.groups(_ray_backend(backend)).items():
        found.extend(g for g in _listing(_on_agents(agents))
                     if agents.pool or g["name"] == name)
    return found


def ray_pool_backend(backend: Backend | str, name: str, counts: Sequence[int], gpus: int,
                     resources: dict[str, float] | None, timeout: float) -> Backend:
    """The backend of the agents of a detached resource pool ``name`` on the Ray backend,
    started for it: a node per pool node, each holding ``counts[n]`` slots of one CPU
    (or ``resources``) and ``gpus`` GPUs (:mod:`phalanx.backends.ray.detached`)."""
    from phalanx.backends.ray import detached as ray_detached
    from phalanx.backends.ray.placement import bundle_for

    per_rank = {"CPU": 1.0, **{k: float(v) for k, v in (resources or {}).items()}}
    agents = ray_detached.start_agents(_ray_backend(backend), name, counts, gpus, timeout,
                                       per_rank=bundle_for(per_rank, gpus), pool=True)
    return _on_agents(agents)


def end_ray_pool(backend: Backend | str, name: str) -> None:
    """End the agents of the Ray backend's detached pool ``name`` now (its start failed)."""
    from phalanx.backends.ray import detached as ray_detached

    ray_detached.end_agents(_ray_backend(backend), name)


def _listing(backend: Backend) -> list[dict[str, Any]]:
    detaching = backend.capabilities.detaching
    return [] if detaching is None else detaching.listing()


def _ray_backend(backend: Backend | str) -> RayBackend:
    from phalanx.backends.ray.backend import RayBackend

    return backend if isinstance(backend, RayBackend) else RayBackend()  # (or "ray")


def _on_agents(agents: Agents) -> Backend:
    """A cluster backend over a Ray detached group's agents."""
    from phalanx.backends.cluster.backend import ClusterBackend

    return ClusterBackend(list(agents.hosts), token=agents.token, quorum_timeout=10.0)


def orphan_of(item: list[Any], group: str) -> Orphaned:
    """An agent's record of an orphaned answer ([rank, node, pid, call id, method, ok,
    segments])."""
    rank, node, pid, call_id, method, ok, segments = item
    if ok:
        value = pickle.loads(segments[1], buffers=segments[2:])
        return Orphaned(rank, call_id, method, value, None)
    failure = RemoteFailure(*protocol.parse(segments[0])[3][0])
    return Orphaned(rank, call_id, method, None,
                    WorkerError(failure, rank=rank, node=node, pid=pid, method=method,
                                group=group))
