"""``WorkerGroup``: start a group of ranks, call methods on them, watch them, stop them.

The group is made of parts (drawn in :mod:`phalanx.controller`), each owning its state
behind a small interface, and holds them; its public methods check their arguments and
hand over to the part that does the work. Every call form goes through the
:class:`~phalanx.controller.callpath.CallPath` part, the one its slices use too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal as signals
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends import Backend
from phalanx.controller.callforms import CallForms, Scope
from phalanx.controller.callpath import CallPath
from phalanx.controller.calls import Sender
from phalanx.controller.collectivewatch import CollectiveWatch
from phalanx.controller.detached import Orphaned, detach_spec, detached_backend, orphan_of
from phalanx.controller.dispatch import Dispatcher
from phalanx.controller.injection import inject_fault
from phalanx.controller.internals import GroupInternals, register
from phalanx.controller.kept import KeptResults
from phalanx.controller.lifecycle import Lifecycle
from phalanx.controller.membership import Membership
from phalanx.controller.methods import MethodNames
from phalanx.controller.names import GROUP_NAMES
from phalanx.controller.observe import EVERY_GROUP
from phalanx.controller.pool import placing_on
from phalanx.controller.ranks import RankTable
from phalanx.controller.refs import ObjectRef
from phalanx.controller.request import GroupPlan, heartbeat_interval, plan_group
from phalanx.controller.shared import SharedObjects
from phalanx.controller.slices import GroupSlice
from phalanx.controller.startup import Starter
from phalanx.controller.state import Gate, GroupState
from phalanx.controller.trace import SPANS_TIMEOUT, Trace
from phalanx.controller.watch import RankHealth, StackReport, StartupReport, Watcher
from phalanx.controller.watchdog import Watchdog
from phalanx.errors import CallTimeout, MembershipEvent, PhalanxError
from phalanx.options import check_seconds
from phalanx.world.frameworks import WorldPart
from phalanx.world.selection import Workers

if TYPE_CHECKING:
    from phalanx.controller.pool import ResourcePool
    from phalanx.controller.ranks import RankEntry
    from phalanx.world.sharding import Coordinates, NamedSharding

logger = logging.getLogger(__name__)

_CLEANUP_SLICE = config.STACKS_ON_TIMEOUT / 2  # seconds of each wait for a rank's cleanup

_live_groups: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def live_groups() -> list[WorkerGroup]:
    """Every group of this process that is not shut down (what a dashboard shows)."""
    return list(_live_groups)


@atexit.register
def _shutdown_at_exit() -> None:
    for group in list(_live_groups):
        if group.detachable:  # it outlives this process: its nodes keep it
            group.detach()
        else:
            group.shutdown()


class WorkerGroup(CallForms):
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

    Worker output is echoed prefixed with its rank (``echo_output``), and with the group's
    name while another group of this process runs (``[Policy rank 1] ...``; a group alone
    keeps ``[rank 1] ...``); identical lines from several ranks of the group within a
    moment are shown once as ``[ranks 0-3] ...`` (``collapse_output``); ``log_ranks`` shows
    only those ranks' lines; ``log_dir`` also writes every rank's output to
    ``rank-N.stdout.log`` / ``rank-N.stderr.log`` there, or, when another running group of
    this process already writes those names in that directory, to
    ``<name>.rank-N.stdout.log`` / ``<name>.rank-N.stderr.log``: two groups given one
    ``log_dir`` never write to the same file.

    Supervision: every rank sends a heartbeat from a thread of its own; one silent for
    ``heartbeat_timeout`` seconds (stopped, or stuck in a C call holding the GIL) is
    declared unresponsive: its calls fail with :class:`WorkerUnresponsive` and it is killed
    (None: never). When some ranks answered a call ``straggler_warning`` seconds ago and
    others have not, the late ranks and where their code is are logged (None: never).
    When ranks of a call have waited ``collective_timeout`` seconds in a
    ``torch.distributed`` collective that other members never entered (or entered with
    other shapes), the call raises :class:`CollectiveStuck` naming them, once every rank
    was recreated to release the waiting ones (None: never; see
    :mod:`phalanx.controller.collectivewatch`).

    ``preload``: the modules a node imports once and forks its ranks from (None, the
    default: the rank runtime, the framework's and the installed packages the target's
    module imports; False: every rank a fresh interpreter; a list: those), see
    :mod:`phalanx.world.preload`.

    ``master_addr`` / ``master_port`` fix the rendezvous the ranks get as ``MASTER_ADDR`` /
    ``MASTER_PORT`` (default: node 0's address and a port free there, new on each restart).
    ``part_of`` makes the group one node of a bigger world whose other nodes other groups
    run (see :class:`~phalanx.world.frameworks.WorldPart`); it needs both.

    ``name`` is what errors, logs and reprs call the group (:attr:`name`): letters, digits
    and ``-_.``, not the name of another open group of this process (ValueError, before
    anything starts; free again once that group is shut down). By default, the target's
    name, numbered when repeated: ``Policy``, ``Policy-2``, ... (see
    :mod:`phalanx.controller.names`).

    Calls: ``call``, ``call_async``, ``map``, ``map_async``, ``call_one``, ``call_stream``
    and ``call_sharded`` (see :class:`~phalanx.controller.callforms.CallForms`) take the
    method's arguments; ``options(...)`` gives a view whose calls are made with
    phalanx's options (``timeout``, ``workers``, ``keep``, ...) apart from them.

    Threads: calls, ``health()``, ``stacks()`` and ``put()`` may be made from several
    threads at once. ``recreate``, ``restart``, ``reload``, ``resize`` and ``shutdown``
    may be too, and exclude each other: one waits for the other to end
    (:attr:`state` is ``REPLACING`` meanwhile; see :class:`~phalanx.controller.state.GroupState`).
    """

    def __init__(
        self,
        target: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        nodes: int | None = None,
        procs_per_node: int | str | Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
        rank_kwargs: (Mapping[int, Mapping[str, Any]]
                      | Callable[[int], Mapping[str, Any]] | None) = None,
        framework: str | None = None,
        gpus_per_worker: int | None = None,
        backend: str | Backend = "local",
        pool: ResourcePool | None = None,
        python: str | os.PathLike[str] | None = None,
        concurrency: int = 1,
        start_timeout: float | None = None,
        echo_output: bool = True,
        collapse_output: bool = True,
        log_ranks: Sequence[int] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        cwd: str | None = None,
        mesh: NamedSharding | Mapping[str, int] | None = None,
        dp_axis: str = "dp",
        tied_axes: Sequence[str] | None = None,
        dp_leaders: Sequence[int] | None = None,
        heartbeat_timeout: float | None = config.DEFAULT_HEARTBEAT_TIMEOUT,
        straggler_warning: float | None = config.DEFAULT_STRAGGLER_WARNING,
        collective_timeout: float | None = config.DEFAULT_COLLECTIVE_TIMEOUT,
        preload: bool | Sequence[str] | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        part_of: WorldPart | None = None,
        name: str | None = None,
        detached: bool = False,
        detach_timeout: float = config.DEFAULT_DETACH_TIMEOUT,
    ) -> None:
        if pool is not None:  # a detached pool's groups are detached, laid out as it says
            detached, detach_timeout, nodes, procs_per_node = placing_on(
                pool, name, detached, detach_timeout, nodes, procs_per_node)
        spec = None
        if detached:  # what another controller rebuilds the group from (px.attach)
            spec = detach_spec(name, detach_timeout, dict(
                target=target, args=args, kwargs=kwargs, nodes=nodes,
                procs_per_node=procs_per_node, env=env, rank_env=rank_env,
                rank_kwargs=rank_kwargs, framework=framework,
                gpus_per_worker=gpus_per_worker, python=python, concurrency=concurrency,
                cwd=cwd, mesh=mesh, dp_axis=dp_axis, tied_axes=tied_axes,
                dp_leaders=dp_leaders, heartbeat_timeout=heartbeat_timeout,
                straggler_warning=straggler_warning, collective_timeout=collective_timeout,
                preload=preload, detach_timeout=detach_timeout))
        self._detached: float | None = None  # detach_timeout, while detachable
        if spec is not None and pool is None:  # (a pool's is where its groups run)
            # local: this user's own agent; Ray: agents kept by Ray, sized for the group
            backend = detached_backend(backend, nodes, name, procs_per_node, gpus_per_worker)
        # handles of what ranks kept before this controller attached (None: not asked yet)
        self._kept_before: list[ObjectRef] | None = []
        # Acquire, register the release: a start that fails at any step gives back what
        # the steps before it took, in reverse order, and nothing else.
        with contextlib.ExitStack() as undo:
            plan = plan_group(
                target, args, kwargs, nodes=nodes, procs_per_node=procs_per_node, env=env,
                rank_env=rank_env, rank_kwargs=rank_kwargs, framework=framework,
                gpus_per_worker=gpus_per_worker, backend=backend, pool=pool, python=python,
                concurrency=concurrency, start_timeout=start_timeout,
                output=(echo_output, collapse_output, log_ranks, log_dir), cwd=cwd,
                mesh=mesh, dp_axis=dp_axis, tied_axes=tied_axes, dp_leaders=dp_leaders,
                heartbeat_timeout=heartbeat_timeout, straggler_warning=straggler_warning,
                collective_timeout=collective_timeout, preload=preload,
                master_addr=master_addr, master_port=master_port, part_of=part_of,
                name=name)
            self._name = name = plan.name
            undo.callback(GROUP_NAMES.release, name)  # taken by the plan
            self._lease = plan.lease
            if plan.lease is not None:
                undo.callback(plan.lease.release)
            self._backend: Backend = plan.backend
            self._mesh = plan.mesh
            detaching = plan.backend.capabilities.detaching
            if spec is not None and detaching is None:
                raise ValueError(
                    f"detached=True: the {plan.backend.name} backend cannot keep ranks past "
                    "this process yet; run the group on agents (px.ClusterBackend; on one "
                    "machine, a `phalanx agent` of your own)")
            attaching = detaching is not None and detaching.attaching() is not None
            if attaching:  # numbers above any the ranks know (their kept results')
                first_call_id = time.time_ns() // 1000
            self._build(plan, undo, env=env, rank_env=rank_env, part_of=part_of,
                        master_addr=master_addr, master_port=master_port,
                        first_call_id=first_call_id if attaching else 1)
            if spec is not None and detaching is not None:
                detaching.detach(name, detach_timeout, spec)
                self._detached = detach_timeout
            if attaching:
                self._kept_before = None  # asked for at the first kept(): a rank may be busy
            undo.pop_all()  # started: the group holds all of it until its shutdown
        self._gate.move(GroupState.RUNNING)
        _live_groups.add(self)
        if self._lease is not None:
            self._lease.adopt(self)
        logger.info("group %s started %d workers of %s", name, self.world_size,
                    plan.target_name)

    def _build(self, plan: GroupPlan, undo: contextlib.ExitStack, *,
               env: Mapping[str, str] | None,
               rank_env: Mapping[int, Mapping[str, str]] | None,
               part_of: WorldPart | None, master_addr: str | None,
               master_port: int | None, first_call_id: int = 1) -> None:
        """Make the parts (drawn in phalanx.controller's docstring), open the backend and
        start every rank, registering on ``undo`` how to give back each thing taken."""
        name, backend_ = plan.name, plan.backend
        self._gate = gate = Gate(name)
        undo.callback(self._abandon)
        self._dispatcher = dispatcher = Dispatcher(
            self._on_death, stacks_of=lambda ranks: self._watch.stacks_of(ranks),
            on_released=(None if backend_.capabilities.objects is None else
                         backend_.capabilities.objects.released),
            group_name=name)
        undo.callback(dispatcher.release)  # its epoll and wake pipe
        self._ranks = ranks = RankTable(plan.placement.layout.world_size, dispatcher)
        self._shared = shared = SharedObjects(backend_, dispatcher.poll_now,
                                              ranks.live_channels)
        undo.callback(shared.close)
        self._methods = methods = MethodNames(plan.target_name)
        self._sender = sender = Sender(ranks, dispatcher, shared, backend_)
        sender.number_calls_from(first_call_id)
        self._kept = KeptResults(f"group {name}", sender.send, sender.encode,
                                 sender.source_of)
        sender.keeps_in(self._kept)
        for observer in list(EVERY_GROUP):  # an open dashboard's
            sender.observe(observer)
        self._starter = starter = Starter(
            backend_, plan.placement, plan.boot, name=name, env=env or {},
            rank_env=rank_env or {}, part_of=part_of,
            rendezvous=((master_addr, master_port)
                        if master_addr is not None or master_port is not None else None),
            start_timeout=plan.start_timeout, progress=plan.progress,
            dispatcher=dispatcher, table=ranks, shared=shared, methods=methods,
            preload=plan.preload)
        self._watch = watch = Watcher(ranks, dispatcher, gate)
        collectives = CollectiveWatch(
            dispatcher, ranks, watch.take_stacks, timeout=plan.collective_timeout,
            straggler_warning=plan.straggler_warning,
            interval=heartbeat_interval(plan.heartbeat_timeout, plan.collective_timeout) or 5.0)
        watchdog = Watchdog(dispatcher, ranks.live, watch.take_stacks,
                            heartbeat_timeout=plan.heartbeat_timeout,
                            straggler_warning=plan.straggler_warning, collectives=collectives)
        self._membership = membership = Membership(  # listens before the backend opens
            backend=backend_, dispatcher=dispatcher, table=ranks, starter=starter,
            mesh=self._mesh, gate=gate)
        undo.callback(membership.stop)
        self._lifecycle = Lifecycle(
            gate=gate, backend=backend_, dispatcher=dispatcher, table=ranks, starter=starter,
            membership=membership, methods=methods, sender=sender, shared=shared,
            watchdog=watchdog)
        collectives.release = self._lifecycle.release
        self._init_forms(CallPath(gate, methods, ranks, sender, dispatcher), Scope(self._mesh))
        register(self, GroupInternals(gate, ranks, sender, starter.node_address))
        backend_.open(plan.output)
        undo.callback(backend_.close)  # what it opened, reserved and launched
        # Exit handlers run last-registered first: ours must run before those of what
        # the backend may have started just now (Ray's disconnects from the cluster).
        atexit.unregister(_shutdown_at_exit)
        atexit.register(_shutdown_at_exit)
        starter.reserve()
        watchdog.start()
        undo.callback(watchdog.stop)
        undo.callback(self._lifecycle.stop_ranks)  # any the start left running
        starter.start(list(range(starter.layout.world_size)))

    # -- a detached group (phalanx.controller.attach) -----------------------------------

    @property
    def detachable(self) -> bool:
        """Whether the group outlives this controller (``detached=True``, or attached
        with ``px.attach``) and is driven by it now."""
        return self._detached is not None and not self._gate.closed

    def detach(self) -> None:
        """Leave the group running without this controller (``detached=True`` only): its
        ranks, their state and kept results stay for ``px.attach(name)`` in another
        process, for ``detach_timeout`` seconds. Calls pending here fail with
        :class:`GroupClosed`; their answers wait in ``orphaned()`` for the next
        controller. The group is closed here afterwards (as after a shutdown)."""
        detaching = self._backend.capabilities.detaching
        if self._detached is None or detaching is None:
            raise RuntimeError(f"group {self._name} was not started with detached=True: "
                               "shutdown() ends it, detach() is for a detached group")
        with self._gate.closing(config.DEFAULT_TERM_GRACE) as first:
            if not first:
                return
            _live_groups.discard(self)
            try:
                self._kept.close()  # handles here say so; the results stay on the ranks
                self._lifecycle.leave(detaching)
            finally:
                if self._lease is not None:
                    self._lease.release()
                GROUP_NAMES.release(self._name)

    def _undetach(self) -> None:
        detaching = self._backend.capabilities.detaching
        self._detached = None
        if detaching is None:
            return
        try:
            detaching.detach(self._name, None, b"")
        except PhalanxError as exc:  # its nodes are gone: nothing to keep anyway
            logger.debug("group %s: %s", self._name, exc)

    def kept(self, timeout: float | None = None) -> list[ObjectRef]:
        """The handles of the results the ranks kept (``keep=True``) before this
        controller attached to the group (``px.attach``), each usable as the first
        controller's was (``.get()``, passed to calls); [] for a group this process
        started. The first call asks every rank, after the call it may be running
        (``timeout``: how long to wait for that); the group holds the handles until it
        shuts down."""
        if self._kept_before is None:
            self._gate.check()
            self._kept_before = self._adopt_kept(check_seconds(timeout, "timeout"))
        return list(self._kept_before)

    def _adopt_kept(self, timeout: float | None) -> list[ObjectRef]:
        ranks = self._ranks.select("all")
        payload = self._sender.encode((), {})
        listings = self._sender.send("@kept", ranks, [payload], builtin=True,
                                     watched=False).result(timeout)
        handles: list[ObjectRef] = []
        for rank, listing in zip(ranks, listings, strict=True):
            for call_id, method, answer in listing:
                handles.append(self._kept.adopt(rank, call_id, method, tuple(answer)))
        return handles

    def orphaned(self, take: bool = False) -> list[Orphaned]:
        """The answers of calls that were running when the group's previous controller
        went (``detached=True``), which no controller asked for since: each with its
        rank, call number, method and value, or the :class:`WorkerError` it raised.
        ``take=True`` also forgets them on the nodes. [] for a group never detached."""
        detaching = self._backend.capabilities.detaching
        if detaching is None or self._detached is None:
            return []
        found = detaching.orphans(take)
        entries = self._ranks.entries
        for item in found:  # kept by a tree's top agent for a rank below it: named here
            entry = entries[item[0]] if 0 <= item[0] < len(entries) else None
            if item[2] is None and entry is not None:
                item[1], item[2] = entry.node, entry.pid
        return [orphan_of(item, self._name) for item in found]

    def _abandon(self) -> None:
        """A failed start ends CLOSED (what a repr or a stray reference then says)."""
        with self._gate.closing(0.0):
            pass

    @property
    def name(self) -> str:
        """The group's name (``name=``, or the target's, numbered): what its errors, logs
        and reprs call it. Unique among this process's open groups."""
        return self._name

    # -- layout -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._starter.layout.world_size

    @property
    def nodes(self) -> int:
        return self._starter.layout.nodes

    @property
    def procs_per_node(self) -> int | tuple[int, ...]:
        """Ranks per node: an int, or one count per node for an uneven layout."""
        return self._starter.layout.procs_per_node

    @property
    def backend(self) -> str:
        """The name of the backend the ranks run on (``"local"``, ``"ray"``)."""
        return self._backend.name

    @property
    def framework(self) -> str | None:
        """The framework whose environment the ranks got (None: the generic variables)."""
        name = self._starter.framework.name
        return None if name == "spmd" else name

    @property
    def single_controller(self) -> bool:
        """True for frameworks whose program runs on node 0 only (``"ray"``, ``"monarch"``)."""
        return self._starter.framework.single_controller

    @property
    def methods(self) -> list[str]:
        """Public methods of the worker object (as reported by the workers at start-up)."""
        return self._methods.names()

    # -- the mesh ---------------------------------------------------------------------

    @property
    def sharding(self) -> NamedSharding | None:
        """The group's mesh (``mesh=`` at construction), or None."""
        return self._mesh.sharding

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (every rank is one without a mesh)."""
        return self._mesh.dp_size

    def dp_leader(self, shard: int) -> int:
        """The rank that leads data-parallel replica ``shard``."""
        return self._mesh.dp_leader(shard)

    def slice(self, **coords: Coordinates) -> GroupSlice:
        """The ranks at ``coords`` of the mesh (``dp=1``, ``tp=range(0, 2)``, ``pp=[0, 2]``)
        as a :class:`~phalanx.controller.slices.GroupSlice`: the group's calls, on those
        ranks only. An int removes its axis, a range or list keeps it, narrowed; unknown
        axes or coordinates out of range raise ValueError."""
        return GroupSlice(self, self._path, self._mesh.sliced(coords))

    @property
    def state(self) -> GroupState:
        """Where the group is in its life: ``RUNNING`` while it serves calls,
        ``REPLACING`` while ranks are replaced, ``CLOSING`` and ``CLOSED`` (see
        :class:`~phalanx.controller.state.GroupState` for every state and move)."""
        return self._gate.state

    @property
    def closed(self) -> bool:
        """Whether the group is shutting down or shut down (its calls raise GroupClosed)."""
        return self._gate.closed

    # -- watching ---------------------------------------------------------------------

    def health(self) -> list[RankHealth]:
        """Every rank's state now (deaths that already happened are taken into account)."""
        return self._watch.health()

    def stacks(self, ranks: Workers = "ready",
               timeout: float = config.STACKS_TIMEOUT) -> StackReport:
        """Every thread's Python stack of the selected ranks, taken now, even while their
        main thread is stuck in user code or in a C call (``str()`` of the result shows
        them with a header per rank). A rank that cannot dump (stopped with SIGSTOP, still
        starting) gets a line saying why."""
        return self._watch.stacks(ranks, timeout)

    def startup_report(self) -> StartupReport:
        """Where each rank's start-up time went (spawning, the interpreter, the framework,
        importing the user's code, the constructor); ``str()`` is a table."""
        return self._watch.startup_report()

    def send_signal(self, sig: int, workers: Workers = "all") -> None:
        """Send a signal (``signal.SIGINT``, ...) to the selected live ranks' processes and
        their process groups; ranks already dead are skipped. SIGINT raises
        ``KeyboardInterrupt`` in a running method, which fails that call with
        :class:`~phalanx.errors.WorkerError`."""
        self._watch.send_signal(sig, workers)

    def _on_death(self, entry: RankEntry) -> None:
        for observer in self._sender.observers:
            observer.died(self._name, entry)
        self._kept.lost(entry.rank, "its process died" if entry.failure is None
                               else f"its process died ({entry.failure.cause})")
        if not self._gate.closed and entry.ever_ready and entry.failure is not None:
            logger.warning("rank %d of group %s (pid %s) died: %s", entry.rank, self._name,
                           entry.pid, entry.failure.cause)

    # -- shared data, faults ----------------------------------------------------------

    def put(self, obj: Any) -> ObjectRef:
        """Store ``obj`` once per node of the group; returns a small handle to pass in any
        call's arguments instead of ``obj`` (each rank receives the object).

        On each node the object is held in shared memory: numpy arrays and torch CPU
        tensors in it reach every rank as read-only views of that memory, without a copy
        (a torch tensor written to gets its own copy of the pages written, never changing
        another rank's). Each rank unpickles the object once, the first time a call
        names it, and keeps it until it is freed: ``ref.free()``, dropping the last
        reference to ``ref``, or the group's shutdown. A call in flight keeps the objects
        it names until it ends.

        The handle also goes into the calls of any other group on the same backend: the
        first such call has that group's nodes hold a copy, freed with the handle.
        """
        self._gate.check()
        return self._shared.put(obj)

    def inject_fault(self, rank: int, method: str, kind: str, *,
                     signal: int = signals.SIGKILL, code: int = 1,
                     message: str | None = None) -> None:
        """Make the next call of ``method`` on ``rank`` fail instead of running, for
        testing recovery code against real failures (on every backend):

        - ``"signal"``: the rank's process gets ``signal`` (default SIGKILL);
        - ``"exit"``: it exits with ``code`` at once;
        - ``"hang"``: the call never returns (the process stays alive and answers
          heartbeats, like a deadlocked collective; use a call ``timeout``);
        - ``"raise"``: the method raises :class:`InjectedFault` (``message``).

        Only the next call of ``method`` on ``rank`` is affected (including streamed
        calls); injecting again before it replaces the fault.
        """
        self._gate.check()
        inject_fault(self._ranks, self._methods.check, rank, method, kind, signal=signal,
                     code=code, message=message)

    # -- membership -------------------------------------------------------------------

    def on_membership_change(self, callback: Callable[[MembershipEvent], Any]) -> None:
        """Call ``callback(event)`` for every change of the group's nodes from now on: a
        :class:`~phalanx.errors.MembershipEvent` naming the nodes ``added`` (admitted by
        :meth:`resize`) and ``removed`` (with the ranks they ran). Callbacks run in order
        on a thread of the group's, never on the caller's; one that raises is logged."""
        self._membership.on_change(callback)

    def resize(self, timeout: float | None = None) -> int:
        """Take in the nodes added since the group started (or last resized) and drop those
        removed, then start every rank again on them (each node keeps ``procs_per_node``
        ranks; pending calls fail). Returns the new world size; ranks must be ready within
        ``timeout`` (default: the group's ``start_timeout``). With nothing changed it does
        nothing. Backends whose nodes cannot change (local, Ray) never change it."""
        return self._membership.resize(timeout)

    # -- replacing and stopping ranks -------------------------------------------------

    def recreate(
        self,
        ranks: int | Sequence[int],
        *,
        timeout: float | None = None,
        readmit: str | None = None,
        restore_from: int | Mapping[int, int] | str | None = None,
        get: str | None = None,
        set: str | None = None,
    ) -> None:
        """Start a fresh process for each of ``ranks`` (stopping the old one if it still
        runs), with the same constructor arguments.

        The fresh ranks must be ready within ``timeout`` seconds (default: the group's
        ``start_timeout``), else :class:`StartupError` (and they are stopped): a rank whose
        constructor waits for peers that will not come fails then, not minutes later. A
        torch world (``framework="torch"``) takes no fresh rank back by itself: recreated
        without ``readmit``, a rank whose constructor joins it times out, and the error
        carries its stack and says to pass ``readmit``.

        ``restore_from`` gives each fresh rank the state of a healthy peer before anything
        else runs on it: a peer rank, a dict ``{fresh rank: peer rank}``, or ``"peers"``
        (for each fresh rank, a live rank not recreated that holds the same part: with a
        ``mesh``, the rank at its coordinates on every axis but ``dp_axis``, in another
        data-parallel replica; without, any live rank; one on the fresh rank's node first,
        then the lowest). ``get`` and ``set`` name the user's methods: ``get()`` returns
        the rank's state (anything picklable, e.g. ``{"model": model.state_dict(),
        "optim": optimizer.state_dict()}``); ``set(state)`` loads it. ``get()`` runs on
        each peer with its result kept there (as ``keep=True`` keeps it); the fresh rank's
        ``set()`` reads it straight from the peer (no checkpoint, the bytes never pass
        through the controller), then it is freed. Each step within ``timeout``; a failure
        stops the fresh ranks and raises :class:`StartupError` naming the fresh rank, the
        peer and the method. Every argument is checked before anything is stopped
        (TypeError, ValueError, AttributeError for an unknown method).

        ``readmit`` re-forms a collective group (torch.distributed, ...) around the fresh
        ranks. They start on a new rendezvous (fresh ``MASTER_PORT``), with
        ``PHALANX_READMIT=1`` in their environment: their constructor should not join a
        collective group then. Once they are up (and restored), the method named by
        ``readmit`` is called on every live rank at once, fresh ones included, with the new
        rendezvous (a dict of the variables every rank shares, e.g. ``MASTER_ADDR``,
        ``MASTER_PORT``, ``WORLD_SIZE``; and ``PHALANX_FRESH_RANKS``, the fresh ranks as
        ``"1"`` or ``"0,2"``, and ``PHALANX_RESTORED``, ``"1"`` if they were restored from
        peers, else ``"0"``), within ``timeout`` too; it should leave the old group and join
        the new one, e.g. ``dist.destroy_process_group(); os.environ.update(rendezvous);
        dist.init_process_group("gloo")``, then wrap the model in DDP again.

        Rank 0 hazard: DDP (and any code that broadcasts from rank 0) gives every rank
        rank 0's weights when it wraps the model. Restored, a fresh rank 0 holds its peer's
        exact state, so that broadcast changes nothing; not restored, it would overwrite
        every rank with rank 0's fresh state -- a re-admission with rank 0 fresh and no
        ``restore_from`` logs a warning saying so.
        """
        self._lifecycle.recreate(ranks, timeout=timeout, readmit=readmit,
                                 restore_from=restore_from, get=get, set=set,
                                 mesh=self._mesh)

    def rendezvous(self) -> dict[str, str]:
        """The variables every rank got with the same value (``MASTER_ADDR``,
        ``MASTER_PORT``, ``WORLD_SIZE``, ...): the group's current rendezvous."""
        return self._starter.rendezvous()

    def free_port(self) -> tuple[str, int]:
        """Node 0's address and a port free there now: where a world that the group's
        ranks share with others can meet (see :func:`px.rendezvous
        <phalanx.controller.joint.rendezvous>`)."""
        self._gate.check()
        return self._starter.free_port()

    def trace(self, timeout: float = SPANS_TIMEOUT) -> Trace:
        """Record every call of this group on every rank while the block runs::

            with group.trace() as t:
                group.call("step")
            t.save("step.json")   # open in https://ui.perfetto.dev

        ``px.trace(*groups)`` traces several groups at once; ``timeout``: how long the end of
        the trace waits for the ranks' own spans (see :mod:`phalanx.controller.trace`)."""
        return Trace(self, timeout=timeout)

    def reload(self) -> str | None:
        """Ship the code again and restart every rank in place (same nodes, same layout).

        With ``ClusterBackend(sync=...)`` only the files that changed cross to each node,
        and every rank then runs the new version (``health()`` shows it; returned here).
        On the other backends the ranks start again from the code as it is on disk now:
        locally a restart; on Ray the same placement group. Pending calls fail.
        """
        return self._lifecycle.reload()

    def restart(self) -> None:
        """Replace every worker process, keeping the layout and the nodes (pending calls
        fail). If the backend's nodes changed since (see ``resize()``), the group starts on
        the nodes there are now."""
        self._lifecycle.restart()

    def shutdown(
        self,
        cleanup: str | None = None,
        timeout: float | None = config.DEFAULT_SHUTDOWN_TIMEOUT,
        force: bool = False,
    ) -> None:
        """Stop every worker: optional ``cleanup`` method on all live ranks, a graceful exit
        within ``timeout`` (None: as long as they take), then SIGTERM and SIGKILL of each
        worker's process tree.

        Idle workers exit on their own (running their atexit handlers); workers still busy
        with a call are terminated at once, since its result could not be delivered.

        Idempotent. Pending calls end with :class:`GroupClosed`. On return no process the
        group started is alive.
        """
        if self._gate.closed:
            return
        timeout = check_seconds(timeout, "shutdown timeout")
        if self._detached is not None:  # ended on purpose: the nodes keep nothing after it
            self._undetach()
        deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        if cleanup is not None and not force:
            self._run_cleanup(cleanup, timeout, deadline)
        # An operation in progress in another thread (a recreate) ends first, or by the
        # deadline at most; the state is CLOSING meanwhile.
        wait = config.DEFAULT_TERM_GRACE if timeout is None else timeout
        with self._gate.closing(wait) as first:
            if not first:
                return
            _live_groups.discard(self)
            try:
                # first: its handles then say the group was shut down, not that ranks died
                self._kept.close()
                self._lifecycle.teardown(deadline, force)
            finally:
                if self._lease is not None:  # its pool's slots are free again
                    self._lease.release()
                GROUP_NAMES.release(self._name)  # and its name

    def _run_cleanup(self, cleanup: str, timeout: float | None, deadline: float) -> None:
        """Run ``cleanup`` on every ready rank and wait for each to end, by the deadline at
        most: one rank's failure is logged, and never cuts another rank's cleanup short."""
        try:
            futures = self.options(workers="ready").call_async(cleanup).futures
        except PhalanxError as exc:
            logger.warning("cleanup method %r failed: %s", cleanup, exc)
            return
        for rank_future in futures:
            # waits short of config.STACKS_ON_TIMEOUT: a late rank's stacks are not asked
            # for (the teardown ends it; the shutdown is not made later by asking)
            while not rank_future.done() and time.monotonic() < deadline:
                try:
                    rank_future.exception(timeout=max(0.0, min(_CLEANUP_SLICE,
                                                               deadline - time.monotonic())))
                except CallTimeout:
                    continue
        for rank_future in futures:
            error = rank_future.exception(timeout=0.0) if rank_future.done() else None
            if error is not None:
                logger.warning("cleanup method %r failed: %s", cleanup, error)
        late = [f.rank for f in futures if not f.done()]
        if late:
            logger.warning("cleanup method %r did not end within %s s on ranks %s of group %s; "
                           "the shutdown ends them", cleanup, timeout, late, self._name)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        starter = self.__dict__.get("_starter")
        if starter is None:
            return "<WorkerGroup (not started)>"
        layout = starter.layout
        state = self.__dict__["_gate"].state.value
        return (
            f"<WorkerGroup {self.__dict__['_name']} nodes={layout.nodes} "
            f"procs_per_node={layout.procs_per_node} {state}>"
        )

