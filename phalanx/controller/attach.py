"""A controller that can die and be replaced: detached groups, ``px.attach``.

``WorkerGroup(..., name="policy", detached=True, detach_timeout=600)`` starts as any group,
then tells its nodes to keep it past this controller: with the group's *description* (the
constructor's arguments, pickled as the ranks get them: a class of a script's ``__main__``
by value, an importable one by reference) under its name. When the controller goes --
killed, its machine lost, ``group.detach()`` -- the nodes' agents keep the ranks running:
their state, their kept results, the calls they run (whose answers are held as
*orphans*). Nobody attaching within ``detach_timeout`` seconds,
the agents stop the ranks as they would a closed group's: nothing is left behind.

``px.attach("policy", backend=px.ClusterBackend(hosts, token=...))``, in any process that
holds the agents' token, reads the description from an agent, and builds the group again
from it on that backend, which takes the running ranks over instead of launching new ones
(ATTACH in place of LAUNCH: each agent answers with its ranks' pids and sends their READY
again, so the start path is the one every group takes). The result is the live
:class:`~phalanx.controller.group.WorkerGroup`: the same processes, mesh and options.
``group.kept()`` gives handles of the results kept before; ``group.orphaned()`` the answers
of the calls that were running when the old controller went. A group another live controller
holds is refused, naming it, unless ``force=True`` (that controller is told and let go).

The new controller numbers its calls from the clock's microseconds, above any number the
ranks and agents knew from the old one (a kept result is known by its call's number).

Backends offer this through :class:`~phalanx.backends.parts.Detaching`: the cluster
backend's agents do, flat or in a tree (the top agents wait for the next controller and
keep their subtrees' orphans; the nodes below them run on). The local backend's
ranks are this process's children, so a detached group of the local backend runs on this
user's own agent on this machine instead (:mod:`phalanx.backends.cluster.localagent`,
started as needed; ``px.attach(name)`` finds it). The Slurm backend's agents are cluster
agents too: its job runs on while they keep the group, and ``px.attach(name,
backend=px.SlurmBackend(job=JOBID))`` finds the job's agents and token by its id
(:mod:`phalanx.backends.cluster.slurm`). The Ray backend's ranks are its Ray job's, so a
detached group of the Ray backend runs on agents that are detached Ray actors instead, one
per node, found through the cluster's key-value store by the group's name and the
backend's namespace (:mod:`phalanx.backends.ray.detached`); a group placed on a detached
resource pool there runs on the pool's agents, found by asking those of the namespace's
pools which groups they keep.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from phalanx.controller.detached import (
    SPEC_VERSION,
    Orphaned,
    is_local,
    is_ray,
    local_agent_backend,
    ray_agents_backend,
    ray_attached,
)
from phalanx.controller.group import WorkerGroup
from phalanx.wire import pickling

if TYPE_CHECKING:
    from phalanx.backends.base import Backend
    from phalanx.backends.parts import Detaching

__all__ = ["Orphaned", "attach", "attached"]


def attach(name: str, backend: Backend | str = "local", *, force: bool = False,
           start_timeout: float | None = None, echo_output: bool = True,
           log_dir: str | None = None) -> WorkerGroup:
    """The live group ``name`` that a controller started with ``detached=True``, taken
    over from the nodes of ``backend`` (not opened yet: a ``px.ClusterBackend`` with the
    agents' hosts and token; the default, ``"local"``, is this user's local agent, which
    holds the local backend's detached groups): the same ranks (the same processes), mesh
    and options.
    Refused, naming it, while another live controller holds the group, unless
    ``force=True`` (its calls then fail). The output options are this controller's own."""
    if is_local(backend):
        backend = local_agent_backend()
    elif is_ray(backend):  # the group's agents, found in the Ray cluster's key-value store
        backend = ray_agents_backend(backend, name)
    if isinstance(backend, str):
        raise ValueError(f"px.attach: backend={backend!r}: give the backend the group ran on "
                         "(px.ClusterBackend(hosts, token_file=...)), or 'local'")
    detaching = backend.capabilities.detaching
    if detaching is None:
        raise ValueError(f"px.attach: the {backend.name} backend keeps no detached groups; "
                         "attach on the backend the group ran on (px.ClusterBackend with "
                         "its agents' hosts and token)")
    if backend.opened:
        raise ValueError("px.attach needs a backend of its own, not one a group opened")
    found = detaching.describe(name)
    holder = found.get("holder")
    if holder and not force:
        raise RuntimeError(f"detached group {name} is held by the controller at {holder}; "
                           "px.attach(..., force=True) takes it over (that controller's "
                           "calls then fail)")
    description = pickling.loads(pickle.loads(found["spec"]))
    if description.get("version") != SPEC_VERSION:
        raise RuntimeError(f"detached group {name} was described by another phalanx "
                           f"version (layout {description.get('version')!r})")
    arguments = dict(description["arguments"])
    backend = _on_its_nodes(backend, detaching, name, arguments.get("nodes"))
    detaching = backend.capabilities.detaching
    assert detaching is not None  # (a copy of a backend that has it)
    detaching.attach_to(name, force)
    return WorkerGroup(**arguments, backend=backend, name=name, detached=True,
                       start_timeout=start_timeout, echo_output=echo_output,
                       log_dir=log_dir)


def _on_its_nodes(backend: Backend, detaching: Detaching, name: str,
                  nodes: int | None) -> Backend:
    """``backend`` on the agents that keep group ``name`` only, in the order it lists
    them, where it lists more than the group's nodes: a group that ran on some of them
    (the later slots of a resource pool) is attached there, not on the first ones."""
    hosts = getattr(backend, "hosts", None)
    settings = getattr(backend, "settings", None)
    if not hosts or settings is None or nodes is None or nodes >= len(hosts):
        return backend  # (one that finds its agents, by DNS: as it is)
    keeping = next((g["hosts"] for g in detaching.listing() if g["name"] == name), None)
    if not keeping or list(keeping) == list(hosts)[:len(keeping)]:
        return backend
    return type(backend)(**{**settings(), "hosts": list(keeping)})


def attached(backend: Backend | str = "local") -> list[dict[str, Any]]:
    """The detached groups the nodes of ``backend`` keep (default: this user's local
    agent's), which a controller may attach to: each with its ``name``, ``ranks``,
    ``hosts``, ``holder`` (the controller holding it, None while it waits),
    ``waiting_for`` (seconds), ``timeout``, ``orphans``."""
    if is_ray(backend):  # each group's agents, with a token of their own
        return ray_attached(backend)
    if is_local(backend):
        try:
            backend = local_agent_backend()
        except LookupError:
            return []
    if isinstance(backend, str):
        raise ValueError(f"px.attached: backend={backend!r}: give a configured backend, or "
                         "'local'")
    detaching = backend.capabilities.detaching
    if detaching is None:
        return []
    return detaching.listing()
