"""What a ``WorkerGroup(...)`` asks for, checked before anything starts: :func:`plan_group`.

Every argument of the constructor that decides what starts where -- the target and its
arguments, the layout, the framework, the resource pool, the interpreter, the per-rank
arguments and variables, the mesh, the output -- is checked here, in one pass, and turned
into a :class:`GroupPlan` the group builds its parts from. Nothing here starts a process or
opens a connection: a bad argument is an error before any resource is taken.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends import Backend, Boot, create_backend
from phalanx.controller.meshcalls import Mesh
from phalanx.controller.names import GROUP_NAMES, base_of, check_name, holder
from phalanx.controller.startup import (
    check_part_of,
    check_rank_env,
    check_rank_kwargs,
    check_rendezvous,
    check_target,
    make_boot,
)
from phalanx.node.machine import check_interpreter, require_package
from phalanx.options import check_count, check_seconds
from phalanx.output.logs import OutputOptions
from phalanx.world.layout import merge_env, rank_scheduling
from phalanx.world.placement import Placement, place
from phalanx.world.preload import check_preload, imported_packages, preload_modules

if TYPE_CHECKING:
    from phalanx.controller.pool import Lease, ResourcePool
    from phalanx.world.frameworks import WorldPart
    from phalanx.world.sharding import NamedSharding


# backends whose nodes start ranks through phalanx's supervisor (phalanx.node.supervisor),
# which can fork them from preloaded modules: Ray runs each rank in an actor of its own
_FORKING = ("local", "cluster", "slurm")


def installed_imports(target: Any) -> list[str]:
    """The installed packages (not the standard library's, not the user's own files) the
    module defining ``target`` imports at its top level, as this process loaded them."""
    import sys

    module = sys.modules.get(getattr(target, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return []
    found = []
    for name in imported_packages(source):
        where = getattr(sys.modules.get(name), "__file__", None) or ""
        if "site-packages" in where or "dist-packages" in where:
            found.append(name)
    return found


def heartbeat_interval(timeout: float | None,
                       collective_timeout: float | None = None) -> float | None:
    """How often ranks send a heartbeat (and, with ``collective_timeout``, the collectives
    they are in): a few times per timeout, at most every 5 s."""
    limits = [t for t in (timeout, collective_timeout) if t is not None]
    return None if not limits else min(5.0, max(0.01, min(limits) / 5))


@dataclasses.dataclass
class GroupPlan:
    """A checked request: what the group's parts are built from."""

    backend: Backend
    placement: Placement
    boot: Boot
    output: OutputOptions
    mesh: Mesh
    start_timeout: float
    heartbeat_timeout: float | None
    straggler_warning: float | None
    collective_timeout: float | None
    preload: tuple[str, ...]
    target_name: str
    name: str  # the group's, taken in GROUP_NAMES: given back when it shuts down
    progress: bool | None  # None: shown when stderr is a terminal
    lease: Lease | None  # the pool's slots the group takes, held until it shuts down


def plan_group(
    target: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    nodes: int | None,
    procs_per_node: int | str | Sequence[int] | None,
    env: Mapping[str, str] | None,
    rank_env: Mapping[int, Mapping[str, str]] | None,
    rank_kwargs: Mapping[int, Mapping[str, Any]] | Callable[[int], Mapping[str, Any]] | None,
    framework: str | None,
    gpus_per_worker: int | None,
    backend: str | Backend,
    pool: ResourcePool | None,
    python: str | os.PathLike[str] | None,
    concurrency: int,
    start_timeout: float | None,
    output: tuple[bool, bool, Sequence[int] | None, str | os.PathLike[str] | None],
    cwd: str | None,
    mesh: NamedSharding | Mapping[str, int] | None,
    dp_axis: str,
    tied_axes: Sequence[str] | None,
    dp_leaders: Sequence[int] | None,
    heartbeat_timeout: float | None,
    straggler_warning: float | None,
    collective_timeout: float | None,
    preload: bool | Sequence[str] | None,
    master_addr: str | None,
    master_port: int | None,
    part_of: WorldPart | None,
    name: str | None,
) -> GroupPlan:
    """Check every argument of ``WorkerGroup(...)`` (the errors its docstring promises)
    and decide what starts where. A name held by an open group is refused first; the name
    and the pool's slots are taken last, once all else is right but the output, checked
    once the name is known (its log files are named after the group); the name is given
    back if the output is refused or the slots cannot be had."""
    settings = config.Settings.from_env()
    if name is not None:
        check_name(name)
        GROUP_NAMES.check_free(name)
    check_target(target, args, kwargs)
    check_count(concurrency, "concurrency")
    check_rendezvous(master_addr, master_port)
    heartbeat_timeout = check_seconds(heartbeat_timeout, "heartbeat_timeout",
                                      allow_zero=False)
    straggler_warning = check_seconds(straggler_warning, "straggler_warning",
                                      allow_zero=False)
    collective_timeout = check_seconds(collective_timeout, "collective_timeout",
                                       allow_zero=False)
    python = check_interpreter(python)
    check_preload(preload)
    booking = None
    if pool is not None:
        from phalanx.controller.pool import booking_on

        booking = booking_on(pool, backend, nodes, procs_per_node, gpus_per_worker)
        backend_ = booking.backend
        nodes, procs_per_node = booking.nodes, booking.counts
        gpus_per_worker = booking.gpus_per_worker
    else:
        backend_ = create_backend(backend)  # checks the name; starts nothing
    if nodes is not None:
        check_count(nodes, "nodes")
    nodes = backend_.group_nodes(nodes)  # none named: 1, or all a Slurm job's
    placement = place(framework, nodes, 1 if procs_per_node is None else procs_per_node,
                      gpus_per_worker or 0, backend_.gpus_per_node(nodes))
    require_package(placement.framework)
    forks = python is None and backend_.name in _FORKING
    modules = preload_modules(
        preload, placement.framework.preload,
        installed_imports(target) if forks and preload in (None, True) else (),
        forks=forks)
    world_size = placement.layout.world_size
    if part_of is not None:
        check_part_of(part_of, master_addr, master_port, placement)
    echo_output, collapse_output, log_ranks, log_dir = output
    check_rank_env(rank_env, world_size)
    per_rank = check_rank_kwargs(rank_kwargs, world_size)
    group_mesh = Mesh(mesh, dp_axis, world_size, layout=placement.layout,
                      tied_axes=tied_axes, dp_leaders=dp_leaders)
    inherited = _own_scheduling()
    for rank in range(world_size):  # type errors in env now, before any resource
        rank_scheduling(merge_env(inherited, {}, env, (rank_env or {}).get(rank)))
    start_timeout = check_seconds(
        settings.start_timeout if start_timeout is None else start_timeout,
        "start_timeout", allow_zero=False)
    boot = make_boot(target, args, kwargs, cwd=cwd, python=python, rank_kwargs=per_rank,
                     options={"concurrency": concurrency, "framework": framework,
                              "heartbeat": heartbeat_interval(heartbeat_timeout,
                                                              collective_timeout),
                              "collectives": collective_timeout is not None})
    target_name = getattr(target, "__qualname__", getattr(target, "__name__", "target"))
    name = GROUP_NAMES.claim(name, base_of(target))
    try:
        options = OutputOptions.build(echo_output, collapse_output, log_ranks, log_dir,
                                      world_size, 0 if part_of is None else part_of.first_rank,
                                      group=name)
        lease = None if booking is None else booking.take(holder(name, world_size))
    except BaseException:
        GROUP_NAMES.release(name)
        raise
    return GroupPlan(
        backend=backend_, placement=placement, boot=boot, output=options, mesh=group_mesh,
        start_timeout=start_timeout, heartbeat_timeout=heartbeat_timeout,
        straggler_warning=straggler_warning, collective_timeout=collective_timeout,
        preload=modules, target_name=target_name, name=name,
        progress=settings.progress, lease=lease)


def _own_scheduling() -> dict[str, str]:
    """This process's ``PHALANX_RANK_SCHED``, which ranks started on its machine inherit
    (checked with the user's ``env`` before anything starts)."""
    value = os.environ.get(config.ENV_RANK_SCHED)
    return {} if value is None else {config.ENV_RANK_SCHED: value}
