"""``px.weight_sync(source, targets, src_rank=0)``: a trainer's weights pushed to generator
ranks, the step every RL loop repeats.

::

    sync = px.weight_sync(trainers, generators)          # nothing formed yet
    sync.push("state_dict", "load_state_dict")           # source get() once, every target set()
    sync.close()                                         # or ``with px.weight_sync(...)``

One rank of the source group (``src_rank``) calls ``get`` -- a method returning a state
dict, name -> torch tensor -- and every rank of every target group calls ``set`` with a
dict of the same names, shapes, dtypes and values, its own to keep. The ranks' side is
:mod:`phalanx.rank.weightsync` (built-in calls); the controller never sees a tensor and
never imports torch.

Transports, chosen at each formation from where the members are (``transport="auto"``):

``shared`` -- every member on one machine (they map each other's memory blocks)
    The source writes the state dict once into a memory block of the sync's, kept from
    push to push; each target maps it and hands ``set`` views of it (copy-on-write).
``broadcast`` -- otherwise
    A gloo broadcast in a joint world of the source rank and every target rank, the
    source's rank 0 in it: a header, the metadata (names, dtypes, shapes) as JSON, then
    the bytes in uint8 buckets of at most ``bucket_mb`` MiB (two in flight; a tensor of
    2 MiB or more moves from and into its own memory, smaller ones are packed). It is a
    store and a ``ProcessGroupGloo`` of the sync's own, never ``init_process_group``: the
    groups' own torch worlds stay as they are. The store (:mod:`phalanx.wire.kvstore`)
    is served by one member on its node's address, not the wildcard, and answers only a
    peer that proves the formation's secret: 32 random bytes made here for each
    formation and sent to the members inside the call that forms it, over phalanx's
    authenticated links. (gloo's own listening ports are gloo's: see the README's
    security notes.)

By parts -- ``src_rank="all"``, or a push given ``want=`` or ``verify=``, and
``stage``/``apply``/``catch_up``/``versions``/``add`` -- every source rank sends the part
it holds (``px.Shard``) and every target rank receives the region it wants
(``px.Region``), point to point on a plan formed once: :mod:`phalanx.controller.shardsync`,
which this class hands those calls to. A ``src_rank=<int>`` push without them is the
transports above, unchanged.

Either way what ``set`` is given is its own: a target that keeps the tensors (rather than
copying them, as ``load_state_dict`` does) keeps them unchanged, and the next push goes
to new memory instead of the memory reused from push to push.

Measured (``python -m bench.handoff --only W12 --no-ray``: 1 GiB of float32 weights,
16 x 64 MiB, from one trainer rank to 2 generator ranks, each copying them into tensors
of its own but for the hand-written broadcast; a 2-core VM shared with other work,
median of 3 trials)::

    gloo broadcast written by hand (px.rendezvous, received in place)   1.15 s
    a keep=True handle                                                   2.79 s
    put() of the weights fetched to the controller                       3.75 s
    weight_sync, shared memory (what "auto" chose: one machine)          0.56 s
    weight_sync, transport="broadcast"                                   0.99 s

On one machine the shared block wins by the pages it does not make: after the first push
neither side faults a page in (writing a reused block is a plain copy, ~0.2 s/GiB there,
where new pages cost 0.6-2.6 s/GiB), and the targets read at once what was written once,
where a broadcast sends every byte once per target through loopback TCP. (A handle pays
for a new block per push: ``keep=True`` blocks are pooled for 2 s only.) Across machines
the broadcast sends each byte once per target with no copy at either end, where a kept
handle would be fetched by each node's agent, then mapped. ``bucket_mb`` defaults to
:data:`DEFAULT_BUCKET_MB`, the fastest measured (16 x 64 MiB, median of 4: 1 MiB 1.92 s,
4 MiB 1.35 s, 16 MiB 1.16 s, 64 MiB 1.23 s, 256 MiB 1.39 s; 12 x 64 MiB with 1024 x
256 KiB: 2.43, 1.95, 1.86, 2.11, 1.78 s); it also bounds a member's staging memory (two
buckets, for the small tensors packed together).

The joint world is formed on the first push, and formed again by itself -- a new port,
a new *generation* -- when a member's process changed (``recreate()``, ``restart()``:
its pid in ``health()``), a group's size changed, or the last push failed. Every wait
is bounded: ``timeout`` seconds (and a tenth more) for each step of a push at the
controller, and ``timeout`` for every gloo operation on the ranks, so a member that
failed on one side leaves no other waiting for ever.

**Detached groups.** A sync whose groups are all detached (``detached=True``, or attached
by ``px.attach``) outlives its controller with them: its id on the ranks is made from the
groups' names and ``src_rank`` rather than drawn at random, so the next controller's
``px.weight_sync(trainers, generators)`` -- the same source, ``src_rank`` and targets, in
the same order -- is the same sync. When it is made, it asks every rank what it holds of
it (:data:`phalanx.rank.weightsync.HELD`: a rank keeps the generation and the version of
the last push it sent or loaded, by parts each target's applied version) and carries on
there: :attr:`WeightSync.version` is the highest version a rank holds, the next push is
the one after it, and ``versions()`` / ``catch_up`` of a sync by parts know which targets
applied what. The weights are the ranks' own (nothing is moved to carry on); the joint
world or plan is formed again on the first push, a new generation above the ranks' (the
controller that died may have been in the middle of a push, leaving a gloo world out of
step). One process makes one such sync per source, ``src_rank`` and targets at a time
(ValueError naming it while the other is open); ``close()`` ends it on the ranks, and the
next one starts from version 0.

Every push has a *version*: 1 for the first, one more for each push after it (a push that
failed uses its number up), in :attr:`PushStats.version` and :attr:`WeightSync.version`.

States (:class:`SyncState`), and the moves between them::

    NEW     -> FORMED (the first push) | BROKEN (its forming failed) | CLOSED
    FORMED  -> BROKEN (a push failed, or forming again did) | FORMED (formed again: a
               member changed) | CLOSED
    BROKEN  -> FORMED (the next push) | BROKEN (its forming failed too) | CLOSED
    CLOSED  -> (none)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import hashlib
import json
import logging
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.internals import GroupInternals, internals
from phalanx.controller.syncrecords import (
    CLOSE_TIMEOUT,
    PushStats,
    SyncState,
    check_method,
    release,
    release_quietly,
)
from phalanx.errors import CallTimeout, GroupClosed, PhalanxError, WorkerDied
from phalanx.options import check_seconds
from phalanx.rank import weightsync as rankside

if TYPE_CHECKING:
    from phalanx.controller.futures import Call
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.shardsync import ShardSync

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_MB = 16  # see the module docstring: the fastest bucket measured
DEFAULT_TIMEOUT = 300.0  # seconds for a push, a formation, and each gloo operation
# How long past the ranks' own timeouts the controller waits (their errors say more than
# its CallTimeout would): a tenth of them, at least a second, at most this.
_MARGIN = 10.0
MiB = 1 << 20

# This process's open syncs between detached groups, by id: one each (their ranks' state
# is under that id).
_DETACHED_SYNCS: weakref.WeakValueDictionary[str, WeightSync] = weakref.WeakValueDictionary()


class Transport(enum.Enum):
    """How the weights travel (see the module docstring)."""

    AUTO = "auto"  # SHARED when every member is on one machine, else BROADCAST
    SHARED = "shared"
    BROADCAST = "broadcast"


@dataclasses.dataclass(frozen=True)
class _Part:
    """One group's part in the sync: its ranks that take part (increasing)."""

    group: WorkerGroup
    ranks: list[int]

    @property
    def group_internals(self) -> GroupInternals:
        return internals(self.group)


class WeightSync:
    """Pushes the state dict of rank ``src_rank`` of ``source`` to every rank of
    ``targets`` (a group, or a list of groups): see :func:`weight_sync`. With
    ``src_rank="all"`` (or ``want=``, ``stage``, ``apply``, ``catch_up``), weights move by
    parts: :mod:`phalanx.controller.shardsync`."""

    def __init__(self, source: WorkerGroup, targets: WorkerGroup | Sequence[WorkerGroup],
                 src_rank: int | str = 0, *, transport: str | Transport = "auto",
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        from phalanx.controller.group import WorkerGroup

        if not isinstance(source, WorkerGroup):
            raise TypeError(f"weight_sync(): the source must be a WorkerGroup, got {source!r}")
        listed = [targets] if isinstance(targets, WorkerGroup) else targets
        if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
            raise TypeError("weight_sync(): targets must be a WorkerGroup or a list of them, "
                            f"got {targets!r}")
        if not listed:
            raise ValueError("weight_sync(): no target group given")
        for i, group in enumerate(listed):
            if not isinstance(group, WorkerGroup):
                raise TypeError(f"weight_sync(): targets[{i}] is {group!r}, not a WorkerGroup")
            if group is source:
                raise ValueError(f"weight_sync(): the source group {source.name} is among the "
                                 f"targets (targets[{i}]); its ranks cannot receive from "
                                 "themselves")
        if len({id(g) for g in listed}) != len(listed):
            twice = next(g for g in listed if sum(h is g for h in listed) > 1)
            raise ValueError(f"weight_sync(): target group {twice.name} is given twice")
        self._all = src_rank == "all"  # every source rank sends its part
        if not self._all and (not isinstance(src_rank, int) or isinstance(src_rank, bool)):
            raise TypeError(f"weight_sync(): src_rank must be an integer or 'all', got "
                            f"{src_rank!r}")
        try:
            self._asked = Transport(transport)
        except ValueError:
            choices = ", ".join(repr(t.value) for t in Transport)
            raise ValueError(f"weight_sync(): transport={transport!r}; expected one of "
                             f"{choices}") from None
        if self._all and self._asked is not Transport.AUTO:
            raise ValueError(f"weight_sync(src_rank='all'): transport={transport!r}; a sync "
                             "by parts sends point to point (leave transport='auto')")
        if timeout is None:  # every wait of a push is bounded
            raise TypeError("weight_sync(): timeout must be a number of seconds, not None")
        self._timeout: float = check_seconds(timeout, "weight_sync() timeout",
                                             allow_zero=False)
        self._deadline = self._timeout + min(_MARGIN, max(1.0, self._timeout / 10))
        self._source = source
        self._targets = list(listed)
        self._src_rank = 0 if self._all else int(src_rank)
        self._check_groups()
        # names this sync on every rank: for detached groups, the same in the next
        # controller (see the module docstring)
        lasting = _lasting_id(source, self._targets, src_rank)
        self._id = lasting or uuid.uuid4().hex[:16]
        self._lock = threading.Lock()  # one push (or close) at a time
        self._state = SyncState.NEW
        self._generation = 0
        self._version = 0  # of the last push src_rank=<int> made (by parts: ShardSync's)
        # what the ranks hold by parts from an earlier controller (ShardSync.resume)
        self._held_parts: tuple[int, dict[tuple[str, int], tuple[int, int]]] | None = None
        self._transport: Transport | None = None  # the one chosen at the last formation
        self._parts: list[_Part] = []  # source part first
        self._identity: tuple[Any, ...] | None = None  # members' processes when formed
        self._members = [source, *self._targets]  # add() adds to it
        # collected without close(): the members let go, from a thread of their own
        self._finalizer = weakref.finalize(self, release_quietly, self._id, self._members,
                                           rankside.CLOSE)
        self._finalizer.atexit = False  # at exit the ranks end anyway
        self._parts_sync: ShardSync | None = None  # the sync by parts, made at first use
        if lasting is not None:
            other = _DETACHED_SYNCS.get(lasting)
            if other is not None and other.state is not SyncState.CLOSED:
                self._state = SyncState.CLOSED
                self._finalizer.detach()  # the ranks' state is the other's
                raise ValueError(f"weight_sync(): {other!r} is open in this process; one "
                                 "sync per source, src_rank and targets of detached groups "
                                 "at a time (close() it first)")
            _DETACHED_SYNCS[lasting] = self
            try:
                self._carry_on()
            except BaseException:
                self._state = SyncState.CLOSED
                self._finalizer.detach()  # what the ranks hold stays theirs
                raise
        if self._all:
            self._shards()

    # -- reading ------------------------------------------------------------------------

    @property
    def state(self) -> SyncState:
        if self._all:
            return self._shards().state
        return self._state

    @property
    def transport(self) -> str | None:
        """The transport of the last formation (``"shared"`` or ``"broadcast"``; None
        before the first push; ``"p2p"`` for a sync by parts once formed)."""
        if self._all:
            from phalanx.controller.shardsync import TRANSPORT

            return TRANSPORT if self._shards().generation else None
        return None if self._transport is None else self._transport.value

    @property
    def generation(self) -> int:
        """How many times the members formed (a new joint world each time)."""
        if self._all:
            return self._shards().generation
        return self._generation

    # -- by parts (phalanx.controller.shardsync) ----------------------------------------

    def _shards(self) -> ShardSync:
        """The sync by parts: from every source rank (``src_rank="all"``), else from
        ``src_rank`` alone; made at its first use."""
        if self._parts_sync is None:
            from phalanx.controller.shardsync import ShardSync

            self._parts_sync = ShardSync(
                self._source, self._targets, None if self._all else [self._src_rank],
                timeout=self._timeout, deadline=self._deadline, sync_id=self._id)
            if self._held_parts is not None:
                self._parts_sync.resume(*self._held_parts)
        return self._parts_sync

    def _carry_on(self) -> None:
        """Carry on where the ranks are (a sync of detached groups: see the module
        docstring): ask every live rank of every member what it holds of this sync,
        waiting for a call it runs as a push would; a rank that died holds nothing."""
        held = _held(self._id, [self._source, *self._targets], self._deadline)
        plain = [answer["plain"] for answer in held.values() if answer["plain"]]
        if plain:
            self._generation = max(generation for generation, _ in plain)
            self._version = max(version for _, version in plain)
        names = {g.name for g in self._targets}
        parts = {key: answer for key, answer in held.items() if answer["parts"]}
        if parts:
            applied = {key: (answer["pid"], answer["parts"][1])
                       for key, answer in parts.items()
                       if key[0] in names and answer["parts"][1] is not None}
            self._held_parts = (max(a["parts"][0] for a in parts.values()), applied)
        if plain or parts:
            logger.info("weight sync %s carried on from the ranks: version %d", self._id,
                        self.version)


    def stage(self, get: str, want: str | None = None, *, verify: bool = False) -> PushStats:
        """Stage a new version on every target rank while they keep answering calls:
        every source rank's ``get`` (a dict of name -> tensor or ``px.Shard``) snapshot
        and sent point to point, each target receiving the ``px.Region`` its ``want``
        asks for (None: every name, whole). :meth:`apply` makes it theirs. A failed
        target fails alone: PhalanxError naming it after the others staged (``.stats``
        attached). ``verify``: a digest per transfer, checked by the target."""
        self._check_open()
        return self._shards().stage(get, want, verify=verify)

    def apply(self, set: str) -> PushStats:
        """Every target rank that staged the current version calls ``set`` with its
        regions (dict name -> tensor of the region's shape): the pause."""
        self._check_open()
        return self._shards().apply(set)

    def catch_up(self, get: str, set: str,
                 want: str | None = None) -> PushStats:
        """Stage and apply the current version on the target ranks behind it only
        (recreated, restarted, added): no other target receives a byte."""
        self._check_open()
        return self._shards().catch_up(get, set, want)

    @property
    def version(self) -> int:
        """The last version pushed or staged (0: none yet); for a sync of detached groups
        that another controller pushed, the highest a rank holds (see the module
        docstring)."""
        if self._parts_sync is not None:
            return max(self._version, self._parts_sync.version)
        if self._held_parts is not None:
            return max([self._version] + [v for _, v in self._held_parts[1].values()])
        return self._version

    def versions(self) -> dict[tuple[str, int], int | None]:
        """Each target rank's applied version, ``{(group name, rank): version}``: None
        while its ``apply`` runs, when it never applied, or when its process is not the
        one that did (recreated)."""
        return self._shards().versions()

    def add(self, group: WorkerGroup) -> None:
        """A new target group: it receives the current version from :meth:`catch_up`, or
        the next one from :meth:`push` / :meth:`stage`."""
        from phalanx.controller.group import WorkerGroup

        if not isinstance(group, WorkerGroup):
            raise TypeError(f"add(): expected a WorkerGroup, got {group!r}")
        if group is self._source:
            raise ValueError(f"add(): group {group.name} is the source")
        if any(group is g for g in self._targets):
            raise ValueError(f"add(): group {group.name} is already a target")
        if group.closed:
            raise GroupClosed(f"add(): group {group.name} was shut down")
        with self._lock:
            self._check_open()
            self._targets.append(group)
            self._members.append(group)
        if self._parts_sync is not None:
            self._parts_sync.add(group)

    def _check_open(self) -> None:
        if self._state is SyncState.CLOSED:
            raise GroupClosed("this weight sync was closed")

    # -- pushing ------------------------------------------------------------------------

    def push(self, get: str, set: str, want: str | None = None,
             bucket_mb: float | None = None, *, verify: bool = False) -> PushStats:
        """Call ``get`` on the source rank and ``set`` with its state dict on every
        target rank; returns once every ``set`` returned (:class:`PushStats`).

        By parts (``src_rank="all"``, or ``want``/``verify`` given): :meth:`stage` then
        :meth:`apply`, each target receiving the regions its ``want`` asks for; a failed
        target fails alone (PhalanxError naming it once the others applied, ``.stats``
        attached). ``bucket_mb`` is the broadcast's, of a ``src_rank=<int>`` push.

        Bad arguments raise TypeError / ValueError / AttributeError (an unknown method) /
        GroupClosed before anything is sent. A rank that fails raises its error
        (``WorkerError`` or ``WorkerDied``, naming the group and rank; ``CallTimeout``
        past ``timeout``); the next push forms the world again.
        """
        if (bucket_mb is None and isinstance(want, (int, float))
                and not isinstance(want, bool)):
            want, bucket_mb = None, want  # push(get, set, bucket_mb), as it always was
        if self._all or want is not None or verify:
            if bucket_mb is not None:
                raise TypeError("push(): bucket_mb is the broadcast's; a sync by parts "
                                "(src_rank='all', want=, verify=) takes none")
            self._check_open()
            return self._shards().push(get, set, want, verify=verify)
        bucket = self._check_push(get, set, bucket_mb)
        with self._lock:
            if self._state is SyncState.CLOSED:
                raise GroupClosed("this weight sync was closed")
            self._check_groups()
            began = time.monotonic()
            formed = False
            if self._state is not SyncState.FORMED or self._identity != self._identity_now():
                self._form()
                formed = True
            self._version += 1  # used up by a push that fails too: no number twice
            try:
                if self._transport is Transport.SHARED:
                    tensors, nbytes, buckets = self._push_shared(get, set)
                else:
                    tensors, nbytes, buckets = self._push_broadcast(get, set, bucket)
            except BaseException:
                self._state = SyncState.BROKEN
                raise
            assert self._transport is not None
            return PushStats(self._transport.value, tensors, nbytes,
                             sum(len(p.ranks) for p in self._parts[1:]), buckets,
                             time.monotonic() - began, formed, version=self._version)

    def _push_broadcast(self, get: str, set_: str, bucket: int) -> tuple[int, int, int]:
        source, *targets = self._parts
        version = self._version
        sent = [source.group_internals.send_builtin(
            rankside.SEND, source.ranks,
            [(self._id, self._generation, get, bucket, version)], defer=True)]
        sent += [part.group_internals.send_builtin(
            rankside.RECEIVE, part.ranks,
            [(self._id, self._generation, set_, version)] * len(part.ranks), defer=True)
            for part in targets]
        stats = _gather(sent, self._deadline)[0][0]
        return stats["tensors"], stats["bytes"], stats["buckets"]

    def _push_shared(self, get: str, set_: str) -> tuple[int, int, int]:
        source, *targets = self._parts
        version = self._version
        staged = source.group_internals.send_builtin(
            rankside.STAGE, source.ranks, [(self._id, self._generation, get, version)])
        where, tensors, nbytes = _gather([staged], self._deadline)[0][0]
        loads = [part.group_internals.send_builtin(
            rankside.LOAD, part.ranks,
            [(self._id, self._generation, set_, where, version)] * len(part.ranks),
            defer=True)
            for part in targets]
        _gather(loads, self._deadline)
        return tensors, nbytes, 0

    # -- forming ------------------------------------------------------------------------

    def _form(self) -> None:
        """Form a new generation on every member: ask where they are, choose the
        transport, and (broadcast) make the joint world, all members at once."""
        parts = [_Part(self._source, [self._src_rank])]
        parts += [_Part(g, list(range(g.world_size))) for g in self._targets]
        identity = self._identity_now()
        self._state = SyncState.BROKEN  # until it formed
        self._generation += 1
        generation, deadline = self._generation, self._deadline
        hellos = _gather([p.group_internals.send_builtin(rankside.HELLO, p.ranks,
                                               [(self._id,)] * len(p.ranks), defer=True)
                          for p in parts], deadline)
        transport = self._choose(parts, [machine for answers in hellos
                                         for machine, _ in answers])
        specs: list[list[tuple[Any, ...] | None]] = [[None] * len(p.ranks) for p in parts]
        if transport is Transport.BROADCAST:
            specs = self._world_specs(parts)
        _gather([p.group_internals.send_builtin(
            rankside.FORM, p.ranks, [(self._id, generation, spec, self._timeout)
                                     for spec in specs[i]], defer=True)
            for i, p in enumerate(parts)], deadline)
        self._parts, self._transport, self._identity = parts, transport, identity
        self._state = SyncState.FORMED
        logger.info("weight sync %s formed (generation %d): %s from rank %d of group %s to "
                    "%d ranks of %s", self._id, generation, transport.value, self._src_rank,
                    self._source.name, sum(len(p.ranks) for p in parts[1:]),
                    ", ".join(p.group.name for p in parts[1:]))

    def _choose(self, parts: list[_Part], machines: list[str | None]) -> Transport:
        one_machine = None not in machines and len(set(machines)) == 1
        if self._asked is Transport.AUTO:
            return Transport.SHARED if one_machine else Transport.BROADCAST
        if self._asked is Transport.SHARED and not one_machine:
            members = [(p.group.name, r) for p in parts for r in p.ranks]
            apart = sorted({f"rank {r} of group {g}" for (g, r), m in
                            zip(members, machines, strict=True) if m != machines[0]})
            raise ValueError("weight_sync(transport='shared') needs every member on one "
                             f"machine; {', '.join(apart) or 'some ranks'} "
                             f"{'are' if len(apart) > 1 else 'is'} not on the source's "
                             "(use transport='auto' or 'broadcast')")
        return self._asked

    def _world_specs(self, parts: list[_Part]) -> list[list[tuple[Any, ...] | None]]:
        """Each member's ``(address, port, joint rank, size, serves the store, secret)``:
        the source is joint rank 0; the store is served by a member on the node whose
        address :meth:`WorkerGroup.free_port` gives (node 0 of its group) -- the source
        when it is on its group's node 0, else the first target group's rank there -- on
        that address alone; ``secret``, this formation's own, is what every member proves
        to it."""
        size = sum(len(p.ranks) for p in parts)
        source_node = _nodes(self._source)[self._src_rank]
        if source_node == 0:
            master = (0, self._src_rank)
        else:
            nodes = _nodes(parts[1].group)
            master = (1, min(r for r in parts[1].ranks if nodes[r] == 0))
        address, port = parts[master[0]].group.free_port()
        secret = secrets.token_bytes(32)
        specs: list[list[tuple[Any, ...] | None]] = []
        joint = 0
        for i, part in enumerate(parts):
            specs.append([])
            for rank in part.ranks:
                specs[-1].append((address, port, joint, size, (i, rank) == master, secret))
                joint += 1
        return specs

    def _identity_now(self) -> tuple[Any, ...]:
        """The members' processes as health() shows them now -- node, pid, alive -- and
        so the target groups' sizes. A change means a process was started since
        (recreate, restart, resize), which holds no part in the current generation, or
        one died: forming again then raises WorkerDied before anything is sent."""
        source = self._source.health()
        entry = next((h for h in source if h.rank == self._src_rank), None)
        who: list[Any] = [None if entry is None else (entry.node, entry.pid, entry.alive)]
        for group in self._targets:
            who.append(tuple((h.rank, h.node, h.pid, h.alive) for h in group.health()))
        return tuple(who)

    # -- checks -------------------------------------------------------------------------

    def _check_groups(self) -> None:
        for role, group in [("source", self._source)] + [
                (f"target {i}", g) for i, g in enumerate(self._targets)]:
            if group.closed:
                raise GroupClosed(f"weight_sync(): the {role} group {group.name} was shut "
                                  "down")
        if not self._all and not 0 <= self._src_rank < self._source.world_size:
            raise ValueError(f"weight_sync(): src_rank {self._src_rank} is outside group "
                             f"{self._source.name}'s ranks 0..{self._source.world_size - 1}")

    def _check_push(self, get: Any, set_: Any, bucket_mb: Any) -> int:
        """The bucket size in bytes, every argument checked (before anything is sent)."""
        for what, name in (("get", get), ("set", set_)):
            if not isinstance(name, str):
                raise TypeError(f"push(): the {what} method must be a name (str), got "
                                f"{name!r}")
        check_method(self._source, get)
        for group in self._targets:
            check_method(group, set_)
        if bucket_mb is None:
            return DEFAULT_BUCKET_MB * MiB
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise TypeError(f"push(): bucket_mb must be a number of MiB, got {bucket_mb!r}")
        if not bucket_mb > 0 or not 0 < bucket_mb * MiB <= rankside.MAX_BUCKET_BYTES:
            raise ValueError(f"push(): bucket_mb must be more than 0 and at most "
                             f"{rankside.MAX_BUCKET_BYTES // MiB}, got {bucket_mb!r}")
        return max(1, int(bucket_mb * MiB))

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Have every member let go of the sync (its joint world, its block); idempotent.
        Groups already shut down are skipped; a member that cannot be told is logged."""
        with self._lock:
            if self._state is SyncState.CLOSED:
                return
            self._state = SyncState.CLOSED
            self._finalizer.detach()
            if self._generation:
                release(self._id, [self._source, *self._targets], rankside.CLOSE,
                        wait=CLOSE_TIMEOUT)
        if self._parts_sync is not None:
            self._parts_sync.close()
        elif self._held_parts is not None:  # held from an earlier controller: ended too
            from phalanx.rank import shardsync as shardside

            release(self._id, [self._source, *self._targets], shardside.CLOSE,
                    wait=CLOSE_TIMEOUT)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        transport = "" if self.transport is None else f" {self.transport}"
        source = "all" if self._all else self._src_rank
        return (f"<WeightSync {self._source.name}[{source}] -> "
                f"{', '.join(g.name for g in self._targets)} {self.state.name}{transport}>")


def weight_sync(source: WorkerGroup, targets: WorkerGroup | Sequence[WorkerGroup],
                src_rank: int | str = 0, *, transport: str | Transport = "auto",
                timeout: float = DEFAULT_TIMEOUT) -> WeightSync:
    """A :class:`WeightSync` from rank ``src_rank`` of ``source`` (``"all"``: every rank,
    each sending the part it holds, see :mod:`phalanx.controller.shardsync`) to every rank
    of ``targets`` (a WorkerGroup or a list of them); nothing is formed until the first
    :meth:`~WeightSync.push`. ``transport``: ``"auto"`` (shared memory when every member
    is on one machine, else a gloo broadcast), ``"shared"`` or ``"broadcast"``;
    ``timeout``: seconds for a push and for each gloo operation. TypeError / ValueError
    / GroupClosed naming what is wrong::

        with px.weight_sync(trainers, generators) as sync:
            for step in range(steps):
                ...
                sync.push("state_dict", "load_weights")
    """
    return WeightSync(source, targets, src_rank, transport=transport, timeout=timeout)


# -- helpers ----------------------------------------------------------------------------


def _lasting_id(source: WorkerGroup, targets: Sequence[WorkerGroup],
                src_rank: int | str) -> str | None:
    """The id of a sync whose groups are all detached: made from their names and
    ``src_rank``, the same in the next controller (None: any other sync's is random)."""
    if not all(group.detachable for group in [source, *targets]):
        return None
    key = json.dumps([source.name, src_rank, [group.name for group in targets]])
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def _held(sync_id: str, groups: Sequence[WorkerGroup], timeout: float
          ) -> dict[tuple[str, int], dict[str, Any]]:
    """What each live rank of ``groups`` holds of sync ``sync_id`` (HELD's answer), by
    (group name, rank); a rank that died meanwhile holds nothing. CallTimeout naming the
    ranks that did not answer within ``timeout`` s (a call they run outlasted it)."""
    calls: dict[tuple[str, int], Call] = {}
    for group in groups:
        gi = internals(group)
        for health in group.health():
            if not health.alive:
                continue
            try:
                calls[(group.name, health.rank)] = gi.send_builtin(
                    rankside.HELD, [health.rank], [(sync_id,)], defer=True)
            except PhalanxError as exc:  # it died (or its group closed) meanwhile
                logger.debug("weight sync %s: %s", sync_id, exc)
    bridges = {key: call.as_concurrent() for key, call in calls.items()}  # sends them
    concurrent.futures.wait(list(bridges.values()), timeout)
    held: dict[tuple[str, int], dict[str, Any]] = {}
    for key, bridge in bridges.items():
        if not bridge.done():
            for call in calls.values():
                call.cancel()
            late = calls[key]
            raise CallTimeout(late.method, timeout, late.late_ranks(), group=late.group_name)
        failure = bridge.exception()
        if isinstance(failure, WorkerDied):
            continue
        if failure is not None:
            raise failure
        held[key] = bridge.result()[0]
    return held


def _nodes(group: WorkerGroup) -> dict[int, int]:
    return {h.rank: h.node for h in group.health()}


def _gather(futures: list[Call], timeout: float) -> list[list[Any]]:
    """Every future's results (their sends made now, all at once), within ``timeout``
    s; the first failure raises at once -- the first future's (the source's) when it is
    among them, the root cause; CallTimeout naming the late ranks past ``timeout``."""
    if len(futures) == 1:
        return [futures[0].result(timeout)]
    bridges = [f.as_concurrent() for f in futures]  # makes the sends
    done, _ = concurrent.futures.wait(bridges, timeout,
                                      return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = [i for i, b in enumerate(bridges) if b in done and b.exception() is not None]
    late = [i for i, b in enumerate(bridges) if b not in done]
    if failed or late:
        for i in late:
            futures[i].cancel()  # their ranks finish (or time out) on their own
        if failed:
            raise bridges[failed[0]].exception()  # type: ignore[misc]
        first = futures[late[0]]
        raise CallTimeout(first.method, timeout, first.late_ranks(), group=first.group_name)
    return [b.result() for b in bridges]
