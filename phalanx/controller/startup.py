"""Starting a group's ranks and stopping them: the :class:`Starter`, waiting for ranks to
become ready, and the errors when they do not.

The starter owns what a launch needs: the placement (framework, layout, GPUs per rank), the
nodes the backend reserved, the addresses and ports of the current launch, every rank's
start (its variables), and the boot message every rank gets (the pickled target and its
constructor arguments). :meth:`Starter.start` launches ranks one batch per node, makes
their entries, places them in the rank table once every one exists, and waits until each is
ready; a rank that fails makes the whole start fail, having stopped the ranks it started.
:meth:`Starter.retire` is how a group stops ranks it replaces: they stop being routed,
their processes are stopped, and the calls still pending on them fail.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends import Backend, Boot, RankStart
from phalanx.backends.base import plain_target
from phalanx.controller.names import holder
from phalanx.controller.ranks import RankEntry, channels_of
from phalanx.errors import SerializationError, StartupError, death_error, rank_text
from phalanx.options import check_count
from phalanx.output.console import Progress
from phalanx.version import __version__
from phalanx.wire import pickling
from phalanx.world.frameworks import WorldPart, check_layout, worker_env
from phalanx.world.layout import Layout, merge_env
from phalanx.world.placement import Placement, check_node_gpus, new_launch

if TYPE_CHECKING:
    from phalanx.backends import Node
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.methods import MethodNames
    from phalanx.controller.ranks import RankTable
    from phalanx.controller.shared import SharedObjects
    from phalanx.world.frameworks import Framework

logger = logging.getLogger(__name__)

READMIT_ENV = "PHALANX_READMIT"  # "1" in the environment of a rank started to be re-admitted


# -- what a group is asked to start: checked before anything is started ---------------------

def check_target(target: Any, args: Any, kwargs: Any) -> None:
    """TypeError unless ``target`` is a class, callable or module, ``args`` a sequence and
    ``kwargs`` a mapping (or None)."""
    if not (callable(target) or isinstance(target, types.ModuleType)):
        if hasattr(target, "remote") and hasattr(target, "bind"):  # Cls.options(...) of Ray's
            raise TypeError(f"target {target!r} is a @ray.remote class's .options(...): pass "
                            "the class itself, its resources as px.RayBackend("
                            "resources_per_worker=...)")
        raise TypeError(f"target must be a class, a callable or a module, got {target!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping, got {type(kwargs).__name__}")


def check_rendezvous(master_addr: Any, master_port: Any) -> None:
    """The user's ``master_addr`` / ``master_port``, if given: a host and a port number."""
    if master_port is not None and not 0 < check_count(master_port, "master_port") < 65536:
        raise ValueError(f"master_port must be a port number (1-65535), got {master_port}")
    if master_addr is not None and not (isinstance(master_addr, str) and master_addr):
        raise TypeError(f"master_addr must be a host name or address, got {master_addr!r}")


def check_part_of(part_of: Any, master_addr: str | None, master_port: int | None,
                  placement: Placement) -> None:
    """``part_of=``: a :class:`WorldPart` that fits the placement, with the world's
    rendezvous given."""
    if not isinstance(part_of, WorldPart):
        raise TypeError(f"part_of must be a WorldPart, got {part_of!r}")
    if master_addr is None or master_port is None:
        raise ValueError("a group running part of a bigger world (part_of=) needs the "
                         "world's master_addr and master_port")
    part_of.check(placement.framework, placement.layout)


def _check_ranks_named(what: str, table: Mapping[Any, Any], world_size: int) -> None:
    """The keys of ``what=`` (a dict rank -> ...) are ranks of the group: TypeError naming
    a key that is no integer (a string such as '1'), ValueError naming those outside."""
    wrong = [r for r in table if isinstance(r, bool) or not isinstance(r, int)]
    if wrong:
        raise TypeError(f"{what} is keyed by rank numbers (ints); it has the keys "
                        f"{wrong!r} ({', '.join(sorted({type(r).__name__ for r in wrong}))})")
    bad = [r for r in table if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"{what} names ranks {bad} outside 0..{world_size - 1}")


def check_rank_env(rank_env: Mapping[int, Any] | None, world_size: int) -> None:
    """``rank_env=`` names only ranks of the group."""
    if rank_env is not None:
        _check_ranks_named("rank_env", rank_env, world_size)


def check_rank_kwargs(rank_kwargs: Any, world_size: int) -> dict[int, dict[str, Any]]:
    """``rank_kwargs=``: a mapping rank -> keywords, or a callable rank -> keywords, as one
    table of the ranks that have any (TypeError / ValueError naming the rank otherwise)."""
    if rank_kwargs is None:
        return {}
    if callable(rank_kwargs) and not isinstance(rank_kwargs, Mapping):
        table = {}
        for rank in range(world_size):
            try:
                table[rank] = rank_kwargs(rank)
            except Exception as exc:
                raise ValueError(f"rank_kwargs({rank}) raised {type(exc).__name__}: "
                                 f"{exc}") from exc
    elif isinstance(rank_kwargs, Mapping):
        _check_ranks_named("rank_kwargs", rank_kwargs, world_size)
        table = dict(rank_kwargs)
    else:
        raise TypeError(f"rank_kwargs must be a dict rank -> keywords or a callable rank -> "
                        f"keywords, got {type(rank_kwargs).__name__}")
    checked = {}
    for rank, own in table.items():
        if own is None:
            continue
        if not isinstance(own, Mapping) or not all(isinstance(k, str) for k in own):
            raise TypeError(f"rank_kwargs for rank {rank} must be a dict of keyword "
                            f"arguments, got {own!r}")
        if own:
            checked[rank] = dict(own)
    return checked


def make_boot(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
              cwd: str | None, options: dict[str, Any], python: str | None = None,
              rank_kwargs: Mapping[int, Mapping[str, Any]] | None = None) -> Boot:
    """The INIT every rank gets: the target, its constructor arguments and each rank's own
    keywords (``rank_kwargs``) pickled once (SerializationError if they cannot be), the
    options with this phalanx's version; ``python``: the interpreter the ranks run (None:
    the node's default). A ``@ray.remote`` class travels as the class it wraps, its options
    beside it (``Boot.target_options``, for the backend)."""
    target, target_options, target_name = plain_target(target)
    try:
        payload = pickling.dumps((target, tuple(args), dict(kwargs or {}),
                                  dict(rank_kwargs or {})))
    except Exception as exc:
        raise SerializationError(
            f"could not pickle the target or its constructor arguments: "
            f"{type(exc).__name__}: {exc}",
            stage="pickling the constructor arguments",
        ) from exc
    # every rank compares it with its own before unpickling anything (rank.runtime)
    options = {**options, "version": __version__}
    return Boot(payload=payload, options=options, sys_path=tuple(sys.path), cwd=cwd,
                target_options=target_options, target_name=target_name, python=python)


class Starter:
    """Starts and stops one group's ranks (see the module docstring).

    Interface: :attr:`name`, :attr:`layout`, :attr:`framework`, :attr:`gpus_per_worker`,
    :attr:`start_timeout`, :attr:`holder`; :meth:`reserve` (nodes for a layout),
    :meth:`new_launch` (a new rendezvous), :meth:`mark_readmitted`, :meth:`rendezvous`;
    :meth:`start` and :meth:`retire`.
    """

    def __init__(
        self,
        backend: Backend,
        placement: Placement,
        boot: Boot,
        *,
        name: str,
        env: Mapping[str, str],
        rank_env: Mapping[int, Mapping[str, str]],
        part_of: WorldPart | None,
        rendezvous: tuple[str | None, int | None] | None,
        start_timeout: float,
        progress: bool | None,
        dispatcher: Dispatcher,
        table: RankTable,
        shared: SharedObjects,
        methods: MethodNames,
        preload: Sequence[str] = (),
    ) -> None:
        self.name = name  # the group's (phalanx.controller.names)
        self._preload = tuple(preload)  # phalanx.world.preload
        self._backend = backend
        self._placement = placement
        self._layout = placement.layout
        self._boot = boot
        self._user_env = dict(env)
        self._rank_env = {r: dict(e) for r, e in rank_env.items()}
        self._part_of = part_of
        self._rendezvous_given = rendezvous  # the user's MASTER_ADDR / MASTER_PORT
        self.start_timeout = start_timeout
        self._progress = progress
        self._dispatcher = dispatcher
        self._table = table
        self._shared = shared
        self._methods = methods
        self._nodes: list[Node] = []
        self._starts: list[RankStart] = []

    @property
    def layout(self) -> Layout:
        """The layout the ranks run in now."""
        return self._layout

    @property
    def framework(self) -> Framework:
        """The recipe of the framework whose environment the ranks get."""
        return self._placement.framework

    @property
    def gpus_per_worker(self) -> int:
        return self._placement.gpus_per_worker

    @property
    def holder(self) -> str:
        """The group as the books of devices name what it holds: ``group Policy-2 (4
        ranks)``."""
        return holder(self.name, self._layout.world_size)

    # -- nodes and launches -------------------------------------------------------------

    def reserve(self, layout: Layout | None = None) -> None:
        """Have the backend find the nodes for ``layout`` (default: the current one), then
        decide addresses and ports on them."""
        if layout is not None:
            self._layout = layout
        if not self._nodes and self._boot.target_name:  # a @ray.remote class: its options
            self._backend.adopt_target_options(self._boot.target_options,
                                               self._boot.target_name)
        nodes = self._backend.reserve(
            self._layout, gpus_per_worker=self._placement.gpus_per_worker,
            timeout=self.start_timeout, holder=self.holder,
        )
        layout = Layout.of([n.ranks for n in nodes])
        if layout != self._layout:  # the backend placed the ranks itself (Ray)
            check_layout(self._placement.framework, layout)
            self._layout = layout
        check_node_gpus(self._placement, nodes)
        self._nodes = nodes
        self.new_launch()

    def new_launch(self) -> None:
        """Fresh ports (picked on the nodes) and every rank's variables."""
        launch = new_launch(self._placement, self._nodes, self._backend.ports)
        if self._rendezvous_given:  # the user's MASTER_ADDR / MASTER_PORT, kept on restarts
            addr, port = self._rendezvous_given
            launch = dataclasses.replace(launch, master_addr=addr or launch.master_addr,
                                         master_port=port or launch.master_port)
        self._launch = launch
        self._starts = [self._rank_start(rank) for rank in range(self._layout.world_size)]

    def _rank_start(self, rank: int) -> RankStart:
        layout, launch = self._layout, self._launch
        generic = worker_env(self._placement.framework, layout, rank, launch)
        if self._part_of is not None:  # the world's RANK, WORLD_SIZE, NODE_RANK
            generic.update(self._part_of.rank_env(rank, launch.master_addr,
                                                  launch.master_port))
        generic[config.ENV_GROUP] = self.name  # which group, for px.breakpoint()
        if self._preload:  # for the node's supervisor (phalanx.node.keeper._Preload)
            generic[config.ENV_PRELOAD] = ",".join(self._preload)
            generic[config.ENV_PRELOAD_PATH] = os.pathsep.join(self._boot.sys_path)
        env = merge_env({}, generic, self._user_env, self._rank_env.get(rank))
        return RankStart(
            rank=rank,
            node=layout.node_of(rank),
            local_rank=layout.local_rank_of(rank),
            env=env,
        )

    def mark_readmitted(self, ranks: Sequence[int]) -> None:
        """The next start of ``ranks`` is to be re-admitted (``PHALANX_READMIT=1``)."""
        for rank in ranks:
            start = self._starts[rank]
            self._starts[rank] = dataclasses.replace(start, env={**start.env,
                                                                 READMIT_ENV: "1"})

    def free_port(self) -> tuple[str, int]:
        """Node 0's address and a port free there now (for a world beyond the group's)."""
        node = self._nodes[0]
        return node.address, self._backend.free_port(node)

    def node_address(self, node: int) -> str:
        """How the other nodes reach node ``node`` (its backend's ``Node.address``)."""
        return self._nodes[node].address

    def rendezvous(self) -> dict[str, str]:
        """The variables every rank got with the same value (``MASTER_ADDR``, ...)."""
        envs = [dict(start.env) for start in self._starts]
        shared = envs[0]
        for env in envs[1:]:
            shared = {k: v for k, v in shared.items() if env.get(k) == v}
        shared.pop(READMIT_ENV, None)
        return shared

    # -- starting and stopping ----------------------------------------------------------

    def start(self, ranks: list[int], timeout: float | None = None,
              limit: str | None = None,
              explain_late: Callable[[list[int]], str] | None = None) -> None:
        """Launch ``ranks`` (one batch per node) and wait until every one is ready (within
        ``timeout``, default ``start_timeout``; ``explain_late``: see :func:`await_ready`).
        A rank becomes visible to calls only once its INIT is on its way."""
        by_node: dict[int, list[RankStart]] = {}
        for rank in ranks:
            by_node.setdefault(self._layout.node_of(rank), []).append(self._starts[rank])
        entries: list[RankEntry] = []
        started: list[Any] = []
        try:
            for node, starts in by_node.items():
                channels = self._backend.launch(self._nodes[node], starts, self._boot)
                for channel in channels:
                    for rank in channel.ranks:
                        entry = RankEntry(rank, node, channel)
                        entries.append(entry)
                        self._dispatcher.add(entry)
                    channel.attach(self._dispatcher)
                    started.append(channel)
            self._table.install(entries)
            if len(self._shared):  # what was put before: their nodes hold it too
                self._shared.reach(started)
            await_ready(
                self._dispatcher,
                entries,
                timeout=self.start_timeout if timeout is None else timeout,
                progress=self._progress,
                target_name=self._methods.target_name,
                limit=limit,
                python=self._boot.python,
                group=self.name,
                explain_late=explain_late,
            )
        except BaseException:
            self.retire(entries, grace=0.0, force=True)  # they stay known as dead ranks
            raise
        if logger.isEnabledFor(logging.DEBUG):
            for entry in entries:
                logger.debug("rank %d start-up (s): %s", entry.rank, ", ".join(
                    f"{k} {v:.3f}" for k, v in entry.timings.items()))
        self._methods.learn(entries[0].methods)

    def retire(self, entries: list[RankEntry], *, grace: float, force: bool = False) -> None:
        """Stop ``entries``: no more routing to them, their processes stopped (``grace``
        seconds to exit, or at once with ``force``), their pending calls failed."""
        for entry in entries:
            self._dispatcher.remove(entry)
        self._backend.stop(channels_of(entries), grace=grace, force=force)
        for entry in entries:
            if entry.alive or entry.pending:
                self._dispatcher.bury(entry, entry.channel.exit_record(entry.rank))


def await_ready(
    dispatcher: Dispatcher,
    entries: list[RankEntry],
    *,
    timeout: float,
    progress: bool | None,
    target_name: str,
    limit: str | None = None,
    python: str | None = None,
    group: str | None = None,
    explain_late: Callable[[list[int]], str] | None = None,
) -> None:
    """Return once every entry is ready; raise :class:`StartupError` at the first failure
    (a constructor that raised, a worker that died) or when ``timeout`` passes (``limit``
    names the setting that gave it, for the message; ``python``, the interpreter the
    ranks run, when ``python=`` chose one; ``group``, the group's name;
    ``explain_late(late ranks)``, more to say about a timeout, asked while the late
    ranks still run, e.g. their stacks)."""
    bar = Progress(f"starting {len(entries)} workers", len(entries), enabled=progress)
    deadline = time.monotonic() + timeout

    def failed() -> list[RankEntry]:
        return [s for s in entries if s.init_failure is not None or not s.alive]

    try:
        while True:
            step = deadline - time.monotonic()
            if bar.enabled:
                step = min(0.1, step)
            all_ready = dispatcher.wait(
                lambda: all(s.settled_start() for s in entries) or bool(failed()),
                max(step, 0.0),
            )
            bar.update(sum(s.ever_ready for s in entries))
            if failed():
                raise startup_error(min(failed(), key=lambda s: s.rank), python, group)
            if all_ready:
                return
            if time.monotonic() >= deadline:
                late = [s.rank for s in entries if not s.ever_ready]
                limit = limit or f"start_timeout= (or {config.ENV_START_TIMEOUT})"
                of = "" if group is None else f" of group {group}"
                more = "" if explain_late is None else explain_late(late)
                raise StartupError(
                    f"ranks {late}{of} did not become ready within {timeout:g} s; raise "
                    f"{limit} if {target_name}() is slow to construct, or see what it "
                    f"waits for{more}",
                    rank=late[0], group=group,
                )
    finally:
        bar.close()


def startup_error(entry: RankEntry, python: str | None = None,
                  group: str | None = None) -> StartupError:
    """The error for an entry whose constructor raised or whose process died (``python``:
    the interpreter ``python=`` gave the ranks, named when the process ended before
    phalanx ran in it; ``group``: the group's name)."""
    failure = entry.init_failure
    if failure is not None:
        pid = "" if entry.pid is None else f", pid {entry.pid}"  # READY brings it
        error = StartupError(
            f"{rank_text(entry.rank, group)} (node {entry.node}{pid}) failed while "
            f"{failure.stage}: {failure.exc_type}: {failure.message}\n\n"
            f"Remote traceback:\n{failure.traceback.rstrip()}",
            rank=entry.rank,
            traceback=failure.traceback,
            group=group,
        )
        original = failure.rebuild()
        if original is not None:
            error.__cause__ = original
        return error
    if entry.failure is None:  # pragma: no cover - a dead entry always has its record
        raise RuntimeError(f"rank {entry.rank} failed without a failure record")
    died = death_error(entry.failure, group=group)
    text = (str(died) if entry.failure.never_started else
            f"rank {entry.rank} died during start-up: {died}")
    if python is not None and not entry.ever_ready:
        text += (f"\n\nThe ranks run python={python!r}, whose process ended before the "
                 f"rank was ready: is it a Python {sys.version_info[0]}."
                 f"{sys.version_info[1]} with phalanx {__version__} installed?")
    error = StartupError(text, rank=entry.rank, group=group)
    error.__cause__ = died
    return error
