"""``WorkerGroup``: start a group of ranks, call methods on them, watch them, stop them."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import sys
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends import Backend, Boot, RankStart, create_backend
from phalanx.controller.dispatch import Dispatcher, Slot
from phalanx.controller.futures import GroupFuture
from phalanx.controller.injection import FaultInjection
from phalanx.controller.lifecycle import Lifecycle
from phalanx.controller.membership import Membership
from phalanx.controller.meshcalls import MeshCalls, map_payloads
from phalanx.controller.methods import MethodProxy
from phalanx.controller.shared import CAPTURE, SharedData, SharedObjects
from phalanx.controller.startup import await_ready
from phalanx.controller.streaming import StreamCalls, StreamFuture
from phalanx.controller.watch import Watching
from phalanx.controller.watchdog import Watchdog
from phalanx.errors import (
    GroupClosed,
    ObjectFreed,
    SerializationError,
    death_error,
)
from phalanx.node.placement import check_node_gpus, new_launch, place
from phalanx.options import check_count, check_seconds
from phalanx.output.logs import OutputOptions
from phalanx.wire import pickling, protocol
from phalanx.world.frameworks import WorldPart, check_layout, worker_env
from phalanx.world.layout import Layout, merge_env
from phalanx.world.selection import Workers, select_ranks

if TYPE_CHECKING:
    from phalanx.world.sharding import NamedSharding

logger = logging.getLogger(__name__)

_live_groups: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def _heartbeat_interval(timeout: float | None) -> float | None:
    """How often ranks send a heartbeat: a few times per timeout, at most every 5 s."""
    return None if timeout is None else min(5.0, max(0.01, timeout / 5))


@atexit.register
def _shutdown_at_exit() -> None:
    for group in list(_live_groups):
        group.shutdown()


class WorkerGroup(MeshCalls, StreamCalls, Watching, Lifecycle, Membership, SharedData,
                  FaultInjection):
    """A group of worker processes, each holding one instance of ``target``.

    ``target`` is a class (or any picklable callable returning the worker object), or a
    module whose functions become the methods. It is constructed once per rank, after the
    rank's environment is set, with ``args``/``kwargs``. The constructor returns once every
    rank is ready, or raises :class:`StartupError` having stopped them all.

    ``framework`` sets up the environment of a distributed framework on every rank
    (``"torch"``, ``"jax"``, ``"tensorflow"``, ``"ray"``, ``"monarch"``; see
    :mod:`phalanx.world.frameworks`); ``procs_per_node="auto"`` follows it (one per GPU for torch
    and jax, otherwise one). ``gpus_per_worker`` gives each rank its own
    ``CUDA_VISIBLE_DEVICES`` block, by local rank.

    ``backend`` says where the ranks run: ``"local"`` (child processes of this one; ``nodes``
    simulates several nodes), ``"ray"`` or a configured ``px.RayBackend(...)`` (Ray actors
    in a placement group; see :mod:`phalanx.backends.ray.backend`). ``procs_per_node`` may be a list
    with one count per node (an uneven layout such as ``[2, 1]``).

    Worker output is echoed prefixed with its rank (``echo_output``); identical lines from
    several ranks within a moment are shown once as ``[ranks 0-3] ...`` (``collapse_output``);
    ``log_ranks`` shows only those ranks' lines; ``log_dir`` also writes every rank's
    output to ``rank-N.stdout.log`` / ``rank-N.stderr.log`` there.

    Supervision: every rank sends a heartbeat from a thread of its own; one silent for
    ``heartbeat_timeout`` seconds (stopped, or stuck in a C call holding the GIL) is
    declared unresponsive: its calls fail with :class:`WorkerUnresponsive` and it is killed
    (None: never). When some ranks answered a call ``straggler_warning`` seconds ago and
    others have not, the late ranks and where their code is are logged (None: never).

    ``master_addr`` / ``master_port`` fix the rendezvous the ranks get as ``MASTER_ADDR`` /
    ``MASTER_PORT`` (default: node 0's address and a port free there, new on each restart).
    ``part_of`` makes the group one node of a bigger world whose other nodes other groups
    run (see :class:`~phalanx.world.frameworks.WorldPart`); it needs both.
    """

    def __init__(
        self,
        target: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        nodes: int = 1,
        procs_per_node: int | str | Sequence[int] = 1,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
        framework: str | None = None,
        gpus_per_worker: int = 0,
        backend: str | Backend = "local",
        concurrency: int = 1,
        start_timeout: float | None = None,
        echo_output: bool = True,
        collapse_output: bool = True,
        log_ranks: Sequence[int] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        cwd: str | None = None,
        mesh: NamedSharding | Mapping[str, int] | None = None,
        dp_axis: str = "dp",
        heartbeat_timeout: float | None = config.DEFAULT_HEARTBEAT_TIMEOUT,
        straggler_warning: float | None = config.DEFAULT_STRAGGLER_WARNING,
        master_addr: str | None = None,
        master_port: int | None = None,
        part_of: WorldPart | None = None,
    ) -> None:
        settings = config.Settings.from_env()
        if not (callable(target) or isinstance(target, types.ModuleType)):
            raise TypeError(f"target must be a class, a callable or a module, got {target!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a mapping, got {type(kwargs).__name__}")
        check_count(concurrency, "concurrency")
        check_count(nodes, "nodes")
        if master_port is not None and not 0 < check_count(master_port, "master_port") < 65536:
            raise ValueError(f"master_port must be a port number (1-65535), got {master_port}")
        if master_addr is not None and not (isinstance(master_addr, str) and master_addr):
            raise TypeError(f"master_addr must be a host name or address, got {master_addr!r}")
        self._rendezvous_given = ((master_addr, master_port)
                                  if master_addr is not None or master_port is not None else None)
        self._heartbeat_timeout = check_seconds(heartbeat_timeout, "heartbeat_timeout",
                                                allow_zero=False)
        self._straggler_warning = check_seconds(straggler_warning, "straggler_warning",
                                                allow_zero=False)
        self._backend: Backend = create_backend(backend)  # checks the name; starts nothing
        self._placement = place(framework, nodes, procs_per_node, gpus_per_worker,
                                self._backend.gpus_per_node(nodes))
        self._layout = self._placement.layout
        self._part_of = part_of
        if part_of is not None:
            if not isinstance(part_of, WorldPart):
                raise TypeError(f"part_of must be a WorldPart, got {part_of!r}")
            if master_addr is None or master_port is None:
                raise ValueError("a group running part of a bigger world (part_of=) needs the "
                                 "world's master_addr and master_port")
            part_of.check(self._placement.framework, self._layout)
        output = OutputOptions.build(echo_output, collapse_output, log_ranks, log_dir,
                                     self.world_size,
                                     0 if part_of is None else part_of.first_rank)
        if rank_env is not None:
            bad = [r for r in rank_env if not (isinstance(r, int) and 0 <= r < self.world_size)]
            if bad:
                raise ValueError(f"rank_env names ranks {bad} outside 0..{self.world_size - 1}")
        self._sharding: NamedSharding | None = None
        self._dp_leaders = list(range(self.world_size))
        self._plans = {}
        if mesh is not None:
            from phalanx.world.sharding import dp_leaders, sharding_for

            self._sharding = sharding_for(mesh, self.world_size)
            self._dp_leaders = dp_leaders(self._sharding, dp_axis)
        for rank in range(self.world_size):  # type errors in env now, before any resource
            merge_env({}, {}, env, (rank_env or {}).get(rank))
        self._start_timeout = check_seconds(
            settings.start_timeout if start_timeout is None else start_timeout,
            "start_timeout", allow_zero=False)
        self._progress = settings.progress
        self._target_name = getattr(target, "__qualname__", getattr(target, "__name__", "target"))
        try:
            init_payload = pickling.dumps((target, tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise SerializationError(
                f"could not pickle the target or its constructor arguments: "
                f"{type(exc).__name__}: {exc}",
                stage="pickling the constructor arguments",
            ) from exc
        self._boot = Boot(
            payload=init_payload,
            options={"concurrency": concurrency, "framework": framework,
                     "heartbeat": _heartbeat_interval(self._heartbeat_timeout)},
            sys_path=tuple(sys.path),
            cwd=cwd,
        )
        self._user_env = dict(env or {})
        self._rank_env = {r: dict(e) for r, e in (rank_env or {}).items()}
        self._call_ids = itertools.count(1)
        self._closed = False
        self._methods: list[str] | None = None
        self._method_set: frozenset[str] = frozenset()
        self._all_ranks = list(range(self.world_size))
        self._deaths_seen = -1  # dispatcher.deaths when every rank was last seen alive
        self._slots: list[Slot | None] = [None] * self.world_size
        self._dispatcher = Dispatcher(on_death=self._on_death)
        self._dispatcher.stacks_of = self._stacks_of
        self._shared = SharedObjects(self._backend, self._dispatcher, lambda: self._slots)
        self._watchdog: Watchdog | None = None
        self._follow_membership()
        try:
            self._backend.open(output)
            # Exit handlers run last-registered first: ours must run before those of what
            # the backend may have started just now (Ray's disconnects from the cluster).
            atexit.unregister(_shutdown_at_exit)
            atexit.register(_shutdown_at_exit)
            self._reserve()
            self._watchdog = Watchdog(
                self._dispatcher, self._live_slots, self._take_stacks,
                heartbeat_timeout=self._heartbeat_timeout,
                straggler_warning=self._straggler_warning)
            self._start_ranks(list(range(self.world_size)))
        except BaseException:
            self._closed = True
            if self._watchdog is not None:
                self._watchdog.stop()
            self._dispatcher.release()
            self._backend.close()
            raise
        _live_groups.add(self)
        logger.info("started %d workers of %s", self.world_size, self._target_name)

    # -- layout -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._layout.world_size

    @property
    def nodes(self) -> int:
        return self._layout.nodes

    @property
    def procs_per_node(self) -> int | tuple[int, ...]:
        """Ranks per node: an int, or one count per node for an uneven layout."""
        return self._layout.procs_per_node

    @property
    def backend(self) -> str:
        """The name of the backend the ranks run on (``"local"``, ``"ray"``)."""
        return self._backend.name

    @property
    def framework(self) -> str | None:
        """The framework whose environment the ranks got (None: the generic variables)."""
        name = self._placement.framework.name
        return None if name == "spmd" else name

    @property
    def single_controller(self) -> bool:
        """True for frameworks whose program runs on node 0 only (``"ray"``, ``"monarch"``)."""
        return self._placement.framework.single_controller

    @property
    def methods(self) -> list[str]:
        """Public methods of the worker object (as reported by the workers at start-up)."""
        return list(self._methods or [])

    # -- start-up ---------------------------------------------------------------------

    def _reserve(self) -> None:
        """Have the backend find the nodes, then decide addresses and ports on them."""
        nodes = self._backend.reserve(
            self._layout, gpus_per_worker=self._placement.gpus_per_worker,
            timeout=self._start_timeout,
        )
        layout = Layout.of([n.ranks for n in nodes])
        if layout != self._layout:  # the backend placed the ranks itself (Ray)
            check_layout(self._placement.framework, layout)
            self._layout = layout
        check_node_gpus(self._placement, nodes)
        self._nodes = nodes
        self._new_launch()

    def _new_launch(self) -> None:
        """Fresh ports (picked on the nodes) and every rank's variables."""
        launch = new_launch(self._placement, self._nodes, self._backend.ports)
        if self._rendezvous_given:  # the user's MASTER_ADDR / MASTER_PORT, kept on restarts
            addr, port = self._rendezvous_given
            launch = dataclasses.replace(launch, master_addr=addr or launch.master_addr,
                                         master_port=port or launch.master_port)
        self._launch = launch
        self._starts = [self._rank_start(rank) for rank in range(self.world_size)]

    def _rank_start(self, rank: int) -> RankStart:
        generic = worker_env(self._placement.framework, self._layout, rank, self._launch)
        if self._part_of is not None:  # the world's RANK, WORLD_SIZE, NODE_RANK
            generic.update(self._part_of.rank_env(rank, self._launch.master_addr,
                                                  self._launch.master_port))
        env = merge_env({}, generic, self._user_env, self._rank_env.get(rank))
        return RankStart(
            rank=rank,
            node=self._layout.node_of(rank),
            local_rank=self._layout.local_rank_of(rank),
            env=env,
        )

    def _start_ranks(self, ranks: list[int], timeout: float | None = None,
                     limit: str | None = None) -> None:
        """Launch ``ranks`` (one batch per node) and wait until every one is ready (within
        ``timeout``, default ``start_timeout``). A rank becomes visible to calls only once
        its INIT is on its way."""
        by_node: dict[int, list[RankStart]] = {}
        for rank in ranks:
            by_node.setdefault(self._layout.node_of(rank), []).append(self._starts[rank])
        slots: list[Slot] = []
        started: list[Any] = []
        try:
            for node, starts in by_node.items():
                channels = self._backend.launch(self._nodes[node], starts, self._boot)
                for channel in channels:
                    for rank in channel.ranks:
                        slot = Slot(rank, node, channel)
                        slots.append(slot)
                        self._dispatcher.add(slot)
                    channel.attach(self._dispatcher)
                    started.append(channel)
            for slot in slots:
                self._slots[slot.rank] = slot
            if len(self._shared):  # what was put before: their nodes hold it too
                self._shared.reach(started)
            await_ready(
                self._dispatcher,
                slots,
                timeout=self._start_timeout if timeout is None else timeout,
                progress=self._progress,
                target_name=self._target_name,
                limit=limit,
            )
        except BaseException:
            self._retire(slots, grace=0.0, force=True)  # they stay known as dead ranks
            raise
        if logger.isEnabledFor(logging.DEBUG):
            for slot in slots:
                logger.debug("rank %d start-up (s): %s", slot.rank, ", ".join(
                    f"{k} {v:.3f}" for k, v in slot.timings.items()))
        if self._methods is None:
            self._methods = slots[0].methods
            self._method_set = frozenset(self._methods)

    # -- calls ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GroupClosed("this WorkerGroup has been shut down")

    def _check_method(self, method: str) -> None:
        if method in self._method_set:
            return
        if not isinstance(method, str):
            raise TypeError(f"method must be a name (str), got {method!r}")
        if self._methods is not None and not method.startswith("_"):
            raise AttributeError(
                f"{self._target_name} has no method {method!r}; "
                f"available: {', '.join(self._methods) or 'none'}"
            )

    def _live_ranks(self, workers: Workers) -> list[int]:
        self._check_open()
        if workers == "all" and self._dispatcher.deaths == self._deaths_seen:
            return self._all_ranks  # no rank died since every rank was last known alive
        if type(workers) is list and workers and self._all_usable(workers):
            return list(workers)  # live, valid, increasing; a copy: the caller may change theirs
        if workers in ("ready", "any"):
            self._dispatcher.poll_now()  # learn of deaths that already happened
        alive = [s is not None and s.alive for s in self._slots]
        if all(alive):
            self._deaths_seen = self._dispatcher.deaths
        ranks = select_ranks(workers, alive)
        for r in ranks:
            slot = self._slots[r]
            if slot is None or not slot.alive:
                raise death_error(slot.failure if slot is not None else None)  # type: ignore[arg-type]
        if workers == "any" and not ranks:
            raise GroupClosed("workers='any': no rank of this group is alive")
        return ranks

    def _all_usable(self, ranks: list[int]) -> bool:
        slots = self._slots
        previous = -1
        for rank in ranks:
            if type(rank) is not int or not previous < rank < len(slots):
                return False
            slot = slots[rank]
            if slot is None or not slot.alive:
                return False
            previous = rank
        return True

    def _encode(self, args: tuple, kwargs: dict, rank: int | None = None) -> list[Any]:
        try:
            return pickling.dumps_plain((args, kwargs)) or self._shared.encode((args, kwargs))
        except ObjectFreed:
            raise
        except Exception as exc:
            where = "" if rank is None else f" for rank {rank}"
            raise SerializationError(
                f"could not pickle the arguments{where}: {type(exc).__name__}: {exc}; "
                "nothing was sent",
                stage="pickling the arguments",
                rank=rank,
            ) from exc

    def _send(
        self,
        method: str,
        ranks: list[int],
        payloads: list[list[Any]],
        *,
        defer: bool = False,
        stream: bool = False,
        workers: Workers = "all",
    ) -> GroupFuture:
        """Register a call's futures and send it (``defer``: at the future's first wait;
        ``stream``: the workers stream items back, see :mod:`phalanx.controller.streaming`)."""
        call_id = next(self._call_ids)
        if stream:
            group_future: GroupFuture = StreamFuture(method, ranks, self._dispatcher)
        else:
            group_future = GroupFuture(method, ranks, self._dispatcher)
        group_future.tolerant = type(workers) is str and workers in ("ready", "any")
        if CAPTURE.refs or (payloads and len(payloads[0]) > 1):  # handles, or buffers
            payloads = self._shared.prepare(group_future, payloads)
        if len(payloads) == 1 and len(ranks) > 1 and self._backend.shared_links:
            # one frame per node connection (an agent's), whatever its number of ranks
            deliver = functools.partial(self._deliver_shared, call_id, ranks, group_future,
                                        method, payloads[0], stream)
        else:
            frames = protocol.call_frames(call_id, ranks, method, payloads, stream)
            deliver = functools.partial(self._deliver, call_id, ranks, group_future, frames)
        if defer:
            group_future._kickoff = deliver
        else:
            deliver()
        return group_future

    def _deliver(
        self, call_id: int, ranks: list[int], future: GroupFuture, frames: list[list[Any]]
    ) -> None:
        slots = self._slots
        for i, rank in enumerate(ranks):
            slot = slots[rank]
            slot.pending[call_id] = future  # type: ignore[union-attr]
            slot.channel.send(frames[i])  # type: ignore[union-attr]
            if not slot.alive:  # type: ignore[union-attr]
                self._dispatcher.fail_if_dead(slot, call_id, future)  # type: ignore[arg-type]

    def _deliver_shared(self, call_id: int, ranks: list[int], future: GroupFuture,
                        method: str, payload: list[Any], stream: bool) -> None:
        """The same payload to ``ranks``: once per link shared by several of them."""
        by_link: dict[Any, list[int]] = {}
        for rank in ranks:
            by_link.setdefault(self._slots[rank].channel.link, []).append(rank)  # type: ignore[union-attr]
        for link, on_link in by_link.items():
            if link is None or len(on_link) == 1:
                frames = protocol.call_frames(call_id, on_link, method, [payload], stream)
                self._deliver(call_id, on_link, future, frames)
                continue
            for rank in on_link:
                self._slots[rank].pending[call_id] = future  # type: ignore[union-attr]
            link.send(protocol.call_frame(call_id, on_link, method, payload, stream))
            for rank in on_link:
                slot = self._slots[rank]
                if not slot.alive:  # type: ignore[union-attr]
                    self._dispatcher.fail_if_dead(slot, call_id, future)  # type: ignore[arg-type]

    def call_async(
        self,
        method: str,
        *args: Any,
        workers: Workers = "all",
        rank0_only_axes: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> GroupFuture:
        """Send the same arguments (pickled once) to every selected rank."""
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], workers=workers)

    def _select(self, workers: Workers, rank0_only_axes: Sequence[str] | None) -> list[int]:
        ranks = self._live_ranks(workers)
        if rank0_only_axes:
            from phalanx.world.sharding import rank0_only

            ranks = rank0_only(self._require_mesh("rank0_only_axes"), ranks, rank0_only_axes)
        return ranks

    def call(
        self,
        method: str,
        *args: Any,
        workers: Workers = "all",
        timeout: float | None = None,
        rank0_only_axes: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on the selected ranks; results in rank order.

        ``rank0_only_axes`` (with a mesh) keeps only the ranks at coordinate 0 on those axes.
        """
        if timeout is not None:
            check_seconds(timeout)
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], defer=True, workers=workers).result(timeout)

    def call_one(
        self, rank: int, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` on one rank and return its value."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"rank must be an integer, got {rank!r}")
        return self.call(method, *args, workers=[rank], timeout=timeout, **kwargs)[0]

    def map_async(
        self,
        method: str,
        *arg_lists: Sequence[Any],
        workers: Workers = "all",
        rank0_only_axes: Sequence[str] | None = None,
        common_kwargs: Mapping[str, Any] | None = None,
        **kwarg_lists: Sequence[Any],
    ) -> GroupFuture:
        """Each positional/keyword argument is a list with one item per called rank
        (matched to them in rank order); ``common_kwargs`` go to every called rank."""
        ranks, payloads = self._map_payloads(
            method, arg_lists, workers, rank0_only_axes, common_kwargs, kwarg_lists
        )
        return self._send(method, ranks, payloads, workers=workers)

    def _map_payloads(
        self,
        method: str,
        arg_lists: tuple[Sequence[Any], ...],
        workers: Workers,
        rank0_only_axes: Sequence[str] | None,
        common_kwargs: Mapping[str, Any] | None,
        kwarg_lists: dict[str, Sequence[Any]],
    ) -> tuple[list[int], list[list[Any]]]:
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes)
        return ranks, map_payloads(self._encode, ranks, arg_lists, common_kwargs, kwarg_lists)

    def map(
        self,
        method: str,
        *arg_lists: Sequence[Any],
        workers: Workers = "all",
        timeout: float | None = None,
        rank0_only_axes: Sequence[str] | None = None,
        common_kwargs: Mapping[str, Any] | None = None,
        **kwarg_lists: Sequence[Any],
    ) -> list[Any]:
        """Call ``method`` with one item of each list per rank; results in rank order."""
        if timeout is not None:
            check_seconds(timeout)
        ranks, payloads = self._map_payloads(
            method, arg_lists, workers, rank0_only_axes, common_kwargs, kwarg_lists
        )
        return self._send(method, ranks, payloads, defer=True, workers=workers).result(timeout)

    def __getattr__(self, name: str) -> MethodProxy:
        methods = self.__dict__.get("_methods")
        if methods is not None and name in methods:
            return MethodProxy(self, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _unregister(self) -> None:
        _live_groups.discard(self)

    def _on_death(self, slot: Slot) -> None:
        if not self._closed and slot.ready and slot.failure is not None:
            logger.warning("rank %d (pid %s) died: %s", slot.rank, slot.pid, slot.failure.cause)

    def __repr__(self) -> str:
        layout = self.__dict__.get("_layout")
        if layout is None:
            return "<WorkerGroup (not started)>"
        state = "closed" if self.__dict__.get("_closed", True) else "running"
        return (
            f"<WorkerGroup {self.__dict__.get('_target_name', '?')} nodes={layout.nodes} "
            f"procs_per_node={layout.procs_per_node} {state}>"
        )

