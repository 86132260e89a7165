"""``px.ResourcePool``: slots reserved once, on which several groups are placed.

A pool reserves ``nodes x procs_per_node`` slots (one rank's place each: a node and, on
it, ``gpus_per_proc`` GPUs and ``resources_per_proc``) on one backend, once: on this
machine, GPU ids from ``CUDA_VISIBLE_DEVICES`` or the devices present; on Ray, one
placement group with a bundle per slot; on agents, their nodes. ``WorkerGroup(...,
pool=pool)`` places rank i on slot i. Up to ``colocate`` groups share each slot: rank i
of each runs on the same node with the same ``CUDA_VISIBLE_DEVICES`` (on Ray each takes
``1/colocate`` of the slot's bundle). ``pool.split([4, 4])`` gives disjoint sub-pools in
slot order. A slot is free again when its group shuts down; the pool outlives its groups,
and ``close()`` frees what it reserved (shutting down any group still on it first).

**Detached** (``ResourcePool(..., name="rl", detached=True, detach_timeout=600)``): every
group placed on the pool is detached (see :mod:`phalanx.controller.attach`), with the
pool's ``detach_timeout``, and needs a name of its own (``WorkerGroup(Trainer, pool=pool,
name="trainer")``: ``px.attach`` finds it by it). Its description is the layout the pool
gave it, so ``px.attach("trainer", backend=...)`` in another controller rebuilds it on the
same nodes without the pool. The pool reserves on the nodes that keep detached groups: the
agents of a ``px.ClusterBackend``, or for the local backend this user's own agent (one
node), as a detached group does, or the agents of the job a ``px.SlurmBackend`` submits for
the pool, or on Ray agents started for the pool. Its slots are the nodes its groups run
on, and stay theirs while the groups run:
a controller that died leaves them to its groups. GPUs too (``gpus_per_proc``): each group
placed on the pool shares the pool's hold on its nodes' agents, so a node's GPUs stay held
-- another controller's pool or group is refused them, naming this pool -- while one of the
pool's detached groups runs there (for at most its ``detach_timeout`` with no controller),
and are free once the last of them ends. On Slurm the pool's job runs on while its agents
keep a detached group (the token is written back into the job's directory) and ends with
the last of them; each group is attached with ``px.attach(name,
backend=px.SlurmBackend(job=JOBID))``. On Ray (``backend=px.RayBackend(address=...)``) the
pool starts an agent per node as detached Ray actors, in a detached placement group of its
slots' resources (a bundle per node: ``resources_per_proc``, one CPU by default, and
``gpus_per_proc`` GPUs per slot), found through Ray's key-value store by the namespace and
the pool's name (:mod:`phalanx.backends.ray.detached`), and reserves on them as on agents;
a connection of its own keeps them while the pool is open. ``px.attach(name,
backend=px.RayBackend(...))`` finds each group on the pool's agents; an agent exits with
the last group of its node (a node no group ran on, with the pool), and the last one to
exit removes the placement group and the keys: nothing is left. The pool itself is this
controller's: the next
controller attaches each group by its name (``px.attached()`` lists them) and drives them
as any group, with no pool (make a new pool for new groups); ``pool.detach()`` leaves on
purpose (every group on it detached, the pool closed here), ``close()`` ends the groups as
for any pool.

The books are :mod:`phalanx.world.pools`' (pure); what a slot stands for is the backend's
(the backend's :class:`~phalanx.backends.parts.SlotReserving` part).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends import Backend, create_backend
from phalanx.backends.parts import lacking
from phalanx.controller.detached import (
    detached_backend,
    end_ray_pool,
    is_local,
    is_ray,
    ray_pool_backend,
)
from phalanx.controller.names import check_name
from phalanx.options import check_count, check_seconds
from phalanx.world import pools

if TYPE_CHECKING:
    from phalanx.backends.parts import SlotReservation
    from phalanx.controller.group import WorkerGroup

logger = logging.getLogger(__name__)

_names = itertools.count(1)
_live_pools: weakref.WeakSet[ResourcePool] = weakref.WeakSet()


def live_pools() -> list[ResourcePool]:
    """Every pool (sub-pools included) of this process not closed (what a dashboard
    shows)."""
    return [p for p in list(_live_pools) if not p.reserved.closed]


@dataclasses.dataclass
class _Reserved:
    """What a pool and all its sub-pools share: the reservation and the books."""

    backend: Backend  # the configured backend the pool was made on (never opened)
    reservation: SlotReservation | None
    book: pools.SlotBook
    gpus_per_proc: int
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    groups: weakref.WeakSet[Any] = dataclasses.field(default_factory=weakref.WeakSet)
    closed: bool = False
    detach_timeout: float | None = None  # a detached pool's (None: not detached)


class ResourcePool:
    """Slots reserved once for several groups (see the module docstring).

    ``procs_per_node`` may be a list (one count per node, uneven allowed);
    ``resources_per_proc`` are Ray resources beside the GPUs (``{"CPU": 2}``; Ray only);
    ``colocate`` is how many groups may share each slot. ``name``: what logs, errors and
    the nodes' books call it (default ``pool-N``); letters, digits and ``-_.``. A context
    manager.

    ``detached=True``: every group placed on it is detached, for ``detach_timeout``
    seconds, and needs ``name=``; after this controller is gone, another attaches each
    group by its name (``px.attach("trainer", backend=...)``: the same ranks, on the
    slots they had), not the pool. See the module docstring.
    """

    def __init__(
        self,
        nodes: int = 1,
        procs_per_node: int | Sequence[int] = 1,
        gpus_per_proc: int = 0,
        resources_per_proc: Mapping[str, float] | None = None,
        colocate: int = 1,
        backend: str | Backend = "local",
        *,
        timeout: float | None = None,
        name: str | None = None,
        detached: bool = False,
        detach_timeout: float = config.DEFAULT_DETACH_TIMEOUT,
    ) -> None:
        layout = pools.pool_layout(check_count(nodes, "nodes"), procs_per_node)
        if isinstance(gpus_per_proc, bool) or not isinstance(gpus_per_proc, int) \
                or gpus_per_proc < 0:
            raise ValueError(f"gpus_per_proc must be a non-negative integer, got "
                             f"{gpus_per_proc!r}")
        check_count(colocate, "colocate")
        if resources_per_proc is not None and not isinstance(resources_per_proc, Mapping):
            raise TypeError(f"resources_per_proc must be a dict such as {{'CPU': 2}}, got "
                            f"{type(resources_per_proc).__name__}")
        timeout = check_seconds(config.Settings.from_env().start_timeout
                                if timeout is None else timeout, "timeout", allow_zero=False)
        if name is None:
            name = f"pool-{next(_names)}"
        else:
            check_name(name)
            if any(p.name == name for p in live_pools()):
                raise ValueError(f"name={name!r}: another open pool of this process has it")
        held_for = None
        on_ray: Backend | str | None = None  # a detached pool's Ray backend (its agents')
        if detached:
            held_for = _detach_timeout(detach_timeout)
            if is_local(backend):  # this user's own agent, as for a detached group
                backend = detached_backend(backend, nodes)
            elif is_ray(backend):  # agents kept by Ray, started for the pool (its slots')
                on_ray, backend = backend, ray_pool_backend(
                    backend, name, layout.counts, gpus_per_proc,
                    dict(resources_per_proc or {}), timeout)
                resources_per_proc = None  # the agents' bundles hold them
            elif create_backend(backend).name not in ("cluster", "slurm"):  # (starts nothing)
                raise ValueError(
                    f"detached=True: a resource pool on the {create_backend(backend).name} "
                    "backend cannot keep its groups past this process; run it on agents "
                    "(px.ClusterBackend, px.SlurmBackend, px.RayBackend; on one machine, "
                    "backend='local'), or give each group detached=True of its own")
        template = create_backend(backend)
        reserving = template.capabilities.slots
        if reserving is None:
            raise lacking(template.name, "hold resource pools")
        slots = pools.slots_of(layout.counts)
        try:
            reservation = reserving.reserve_slots(
                layout.counts, gpus=gpus_per_proc, resources=dict(resources_per_proc or {}),
                timeout=timeout, holder=name)
            if on_ray is not None:
                reservation = _KeptAgents(reservation, template)
        except BaseException:
            if on_ray is not None:  # nothing of the pool's is left on the cluster
                end_ray_pool(on_ray, name)
            raise
        self._attach(_Reserved(template, reservation, pools.SlotBook(len(slots), colocate),
                               gpus_per_proc, detach_timeout=held_for), slots, name)
        logger.info("%s reserved %d slots on the %s backend", self.name, len(self._slots),
                    template.name)

    def _attach(self, shared: _Reserved, slots: list[pools.PoolSlot], name: str) -> None:
        self.name = name
        self._slots = slots
        self._shared = shared
        _live_pools.add(self)

    @classmethod
    def _sub(cls, parent: ResourcePool, slots: list[pools.PoolSlot], name: str) -> ResourcePool:
        pool = cls.__new__(cls)  # a sub-pool shares its parent's reservation: none made
        pool._attach(parent.reserved, slots, name)  # noqa: SLF001 - its own class's set-up
        return pool

    @property
    def reserved(self) -> _Reserved:
        """The reservation and the books this pool shares with its sub-pools."""
        return self._shared

    # -- what it holds ------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """How many slots (ranks' places) it has."""
        return len(self._slots)

    @property
    def counts(self) -> list[int]:
        """Its slots per node."""
        return [len(group) for group in pools.by_node(self._slots)]

    @property
    def colocate(self) -> int:
        return self._shared.book.colocate

    @property
    def gpus_per_proc(self) -> int:
        return self._shared.gpus_per_proc

    @property
    def backend(self) -> str:
        return self._shared.backend.name

    @property
    def detached(self) -> bool:
        """Whether its groups outlive this controller (``detached=True``)."""
        return self._shared.detach_timeout is not None

    @property
    def detach_timeout(self) -> float | None:
        """How long a detached pool's groups wait for another controller (None: not
        detached)."""
        return self._shared.detach_timeout

    def placing(self, name: str | None, detached: bool, detach_timeout: float,
                nodes: int | None, procs_per_node: int | str | Sequence[int] | None
                ) -> tuple[bool, float, int | None, int | str | Sequence[int] | None]:
        """What a group placed here is started with: on a detached pool, detached with
        the pool's ``detach_timeout`` and the layout the pool gives it (its description,
        from which ``px.attach`` rebuilds it, needs it); ValueError before anything
        starts when it has no name, or asks ``detached=True`` of a pool that is not."""
        timeout = self._shared.detach_timeout
        if timeout is None:
            if detached:
                raise ValueError(f"detached=True on {self.name}, which is not detached: make "
                                 "the pool detached (px.ResourcePool(..., detached=True)) and "
                                 "every group placed on it is")
            return detached, detach_timeout, nodes, procs_per_node
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.name} is detached: each group placed on it needs name= "
                             "(another controller attaches to it by it: px.attach(name))")
        if isinstance(procs_per_node, str):  # booking_for says why not
            return True, timeout, nodes, procs_per_node
        counts = pools.layout_on(self._slots, nodes, procs_per_node)
        return True, timeout, len(counts), counts

    def booking_for(self, backend: object, nodes: int | None,
                    procs_per_node: int | str | Sequence[int] | None,
                    gpus_per_worker: int | None) -> Booking:
        """Check that a group fits (its layout, its GPUs, free slots) and make the backend
        that places its ranks here; every error before anything starts."""
        shared = self._shared
        if shared.closed:
            raise ValueError(f"{self!r} is closed")
        if backend != "local" and backend is not shared.backend:
            raise ValueError(f"pool= places the group on the pool's backend "
                             f"({shared.backend.name}); leave backend= out")
        if isinstance(procs_per_node, str):
            raise ValueError(f"procs_per_node={procs_per_node!r} cannot be used with pool=: "
                             "the pool's slots say how many ranks each node runs")
        if gpus_per_worker not in (None, shared.gpus_per_proc):
            raise ValueError(f"gpus_per_worker={gpus_per_worker} but {self.name}'s slots "
                             f"hold {shared.gpus_per_proc} GPU(s) each; leave gpus_per_worker "
                             "out")
        counts = pools.layout_on(self._slots, nodes, procs_per_node)
        slots = pools.chosen_slots(self._slots, counts)
        with shared.lock:
            self._check_free(slots)
        if shared.reservation is None:  # pragma: no cover - a pool always holds one
            raise ValueError(f"{self!r} holds no reservation")
        placed = shared.reservation.backend_for(slots, 1.0 / shared.book.colocate)
        return Booking(self, placed, len(counts), counts, shared.reservation.gpus_per_worker,
                    slots)

    def book(self, slots: list[pools.PoolSlot], name: str) -> Lease:
        """Book ``slots`` for a group of ``name``; ValueError if another group took them
        meanwhile (checked again under the pool's lock)."""
        shared = self._shared
        with shared.lock:
            self._check_free(slots)
            shared.book.take(slots, name)
        return Lease(shared, slots, name)

    def _check_free(self, slots: Sequence[pools.PoolSlot]) -> None:
        shared = self._shared
        if shared.closed:
            raise ValueError(f"{self!r} is closed")
        full = shared.book.full(slots)
        if full:
            taken = shared.book.placed(full)
            held = "; ".join(f"slot {i}: {', '.join(names)}" for i, names in taken.items())
            raise ValueError(
                f"{self.name} ({len(self._slots)} slots, {self.counts} per node, colocate="
                f"{shared.book.colocate}) has no room on slots {[s.index for s in full]} "
                f"for another group: {held}")

    def placed(self) -> dict[int, list[str]]:
        """Slot index -> the groups sitting on it now (slots with none left out)."""
        with self._shared.lock:
            return self._shared.book.placed(self._slots)

    # -- sub-pools and the end -----------------------------------------------------------

    def split(self, sizes: Sequence[int]) -> list[ResourcePool]:
        """Disjoint sub-pools of ``sizes[k]`` slots each, in slot order (what is left over
        belongs to none). Each is used like a pool; they share this pool's reservation."""
        counts = pools.split_counts(sizes, len(self._slots))
        subs, first = [], 0
        for k, size in enumerate(counts):
            subs.append(ResourcePool._sub(self, self._slots[first:first + size],
                                          f"{self.name}.{k}"))
            first += size
        return subs

    def detach(self) -> None:
        """Leave every group on the pool running without this controller (a detached
        pool: ``detached=True``): each detached (``group.detach()``), for another
        controller to attach by its name; the pool is closed here. Idempotent; detaching
        a sub-pool detaches the whole pool."""
        shared = self._shared
        if shared.detach_timeout is None:
            raise RuntimeError(f"{self.name} was not made with detached=True: close() ends "
                               "its groups, detach() is for a detached pool")
        groups = self._close_once()
        if groups is None:
            return
        for group in groups:
            group.detach()
        if shared.reservation is not None:
            shared.reservation.release()
        logger.info("%s detached: %d group(s) left to the next controller", self.name,
                    len(groups))

    def _close_once(self) -> list[Any] | None:
        """Mark the whole pool closed: the groups still placed on it, or None when it was
        closed (or detached) already."""
        shared = self._shared
        with shared.lock:
            if shared.closed:
                return None
            shared.closed = True
            return list(shared.groups)

    def close(self) -> None:
        """Free what the pool reserved (its placement group on Ray). Groups still placed
        on it are shut down first (a detached pool's too: they end). Idempotent; closing
        a sub-pool closes the whole pool."""
        shared = self._shared
        groups = self._close_once()
        if groups is None:
            return
        for group in groups:
            # documented (close() ends what still sits on the pool): not a warning
            logger.info("closing %s: shutting down %r, which still sat on it", self.name, group)
            group.shutdown()
        if shared.reservation is not None:
            shared.reservation.release()
        logger.info("%s closed", self.name)

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._shared.closed else ""
        if self.detached:
            state = f", detached{state}"
        return (f"<ResourcePool {self.name}: {self.slots} slots {self.counts} per node on "
                f"{self.backend}, {self.gpus_per_proc} GPU(s) each, colocate="
                f"{self.colocate}{state}>")


@dataclasses.dataclass
class Lease:
    """The slots one group sits on, until it shuts down."""

    shared: _Reserved  # the pool's reservation and books
    slots: list[pools.PoolSlot]
    name: str
    released: bool = False
    group: Any = None

    def adopt(self, group: WorkerGroup) -> None:
        """The group now holds these slots (so closing the pool shuts it down)."""
        with self.shared.lock:
            if not self.released:
                self.group = weakref.ref(group)
                self.shared.groups.add(group)

    def release(self) -> None:
        shared = self.shared
        with shared.lock:
            if self.released:
                return
            self.released = True
            shared.book.give_back(self.slots, self.name)
            group = self.group() if self.group is not None else None
            if group is not None:
                shared.groups.discard(group)


class _KeptAgents:
    """The slots of a detached pool on Ray, on agents started for it: a connection of the
    pool's own to each keeps them while the pool is open (they end with their last
    connection, so that one whose node has no group yet outlasts the pool's other groups);
    closing it lets each end with the last group of its node."""

    def __init__(self, slots: SlotReservation, agents: Backend) -> None:
        from phalanx.output.logs import OutputOptions

        self._slots = slots
        # a cluster backend of its own on the same agents (no code shipped: it runs none)
        keeper = type(agents)(**{**agents.settings(), "quorum": None, "sync": None})
        self._keeper: Backend | None = keeper
        try:
            keeper.open(OutputOptions(echo=False))
        except BaseException:
            slots.release()
            raise

    @property
    def gpus_per_worker(self) -> int:
        return self._slots.gpus_per_worker

    def backend_for(self, slots: Sequence[pools.PoolSlot], share: float) -> Backend:
        return self._slots.backend_for(slots, share)

    def release(self) -> None:
        keeper, self._keeper = self._keeper, None
        try:
            self._slots.release()
        finally:
            if keeper is not None:
                keeper.close()


@dataclasses.dataclass
class Booking:
    """Where a group will sit on a pool: its backend, its layout, its slots."""

    pool: ResourcePool
    backend: Backend
    nodes: int
    counts: list[int]
    gpus_per_worker: int
    slots: list[pools.PoolSlot]

    def take(self, holder: str) -> Lease:
        """Book the slots for the group ``holder`` names (``group Policy-2 (4 ranks)``;
        ValueError if another group took them meanwhile: the check is repeated under the
        pool's lock)."""
        return self.pool.book(self.slots, holder)


def placing_on(pool: object, name: str | None, detached: bool, detach_timeout: float,
               nodes: int | None, procs_per_node: int | str | Sequence[int] | None
               ) -> tuple[bool, float, int | None, int | str | Sequence[int] | None]:
    """:meth:`ResourcePool.placing` (what is not a pool is left to :func:`booking_on`)."""
    if not isinstance(pool, ResourcePool):
        return detached, detach_timeout, nodes, procs_per_node
    return pool.placing(name, detached, detach_timeout, nodes, procs_per_node)


def _detach_timeout(timeout: float) -> float:
    seconds = check_seconds(timeout, "detach_timeout")
    if seconds is None or seconds <= 0:
        raise ValueError(f"detach_timeout must be a positive number of seconds, got "
                         f"{timeout!r}")
    return seconds


def booking_on(pool: object, backend: object, nodes: int | None,
               procs_per_node: int | str | Sequence[int] | None,
               gpus_per_worker: int | None) -> Booking:
    """:meth:`ResourcePool.booking_for`, once ``pool`` is checked to be one."""
    if not isinstance(pool, ResourcePool):
        raise TypeError(f"pool must be a px.ResourcePool, got {pool!r}")
    return pool.booking_for(backend, nodes, procs_per_node, gpus_per_worker)
