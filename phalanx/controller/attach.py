"""A controller that can die and be replaced: detached groups, ``px.attach``.

``WorkerGroup(..., name="policy", detached=True, detach_timeout=600)`` starts as any group,
then tells its nodes to keep it past this controller: with the group's *description* (the
constructor's arguments, pickled: the target by reference, as every rank imports it) under
its name. When the controller goes -- killed, its machine lost, ``group.detach()`` -- the
nodes' agents keep the ranks running: their state, their kept results, the calls they run
(whose answers are held as *orphans*). Nobody attaching within ``detach_timeout`` seconds,
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
backend's agents do (a flat cluster: not yet across an agent tree). The local, Ray and
Slurm backends do not yet -- their ranks are this process's children, its Ray job's, or a
job that ends with the controller's backend -- and ``detached=True`` there is refused
before anything starts.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx.errors import RemoteFailure, WorkerError
from phalanx.options import check_seconds
from phalanx.wire import protocol

if TYPE_CHECKING:
    from phalanx.backends.base import Backend
    from phalanx.controller.group import WorkerGroup

_SPEC_VERSION = 1  # of the description's layout


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
    try:
        return pickle.dumps({"version": _SPEC_VERSION, "arguments": arguments}, protocol=5)
    except Exception as exc:  # noqa: BLE001 - anything a __reduce__ raises
        raise ValueError(
            f"detached=True: the group's arguments must pickle, since the controller that "
            f"attaches rebuilds the group from them ({type(exc).__name__}: {exc}); pass a "
            "module-level target and rank_kwargs as a dict, not a lambda") from None


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


def attach(name: str, backend: Backend, *, force: bool = False,
           start_timeout: float | None = None, echo_output: bool = True,
           log_dir: str | None = None) -> WorkerGroup:
    """The live group ``name`` that a controller started with ``detached=True``, taken
    over from the nodes of ``backend`` (not opened yet: a ``px.ClusterBackend`` with the
    agents' hosts and token): the same ranks (the same processes), mesh and options.
    Refused, naming it, while another live controller holds the group, unless
    ``force=True`` (its calls then fail). The output options are this controller's own."""
    from phalanx.controller.group import WorkerGroup

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
    description = pickle.loads(found["spec"])
    if description.get("version") != _SPEC_VERSION:
        raise RuntimeError(f"detached group {name} was described by another phalanx "
                           f"version (layout {description.get('version')!r})")
    arguments = dict(description["arguments"])
    detaching.attach_to(name, force)
    return WorkerGroup(**arguments, backend=backend, name=name, detached=True,
                       start_timeout=start_timeout, echo_output=echo_output,
                       log_dir=log_dir)


def attached(backend: Backend) -> list[dict[str, Any]]:
    """The detached groups the nodes of ``backend`` keep, which a controller may attach
    to: each with its ``name``, ``ranks``, ``hosts``, ``holder`` (the controller holding
    it, None while it waits), ``waiting_for`` (seconds), ``timeout``, ``orphans``."""
    detaching = backend.capabilities.detaching
    if detaching is None:
        return []
    return detaching.listing()
