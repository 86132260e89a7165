"""``px.weight_sync(trainers, generators, src_rank="all")``: weights moved by parts, from
every trainer rank's shard to the region each generator rank wants, point to point.

::

    sync = px.weight_sync(trainers, generators, src_rank="all")
    sync.stage("shards", want="wanted")      # bytes move; generators keep answering calls
    sync.apply("load")                       # the pause: each target's set() with its regions
    sync.push("shards", "load", "wanted")    # both; stats.per_target[(group, rank)] = bytes
    sync.versions()                          # {(group, rank): the version it applied}
    sync.catch_up("shards", "load", "wanted")  # only the targets behind receive anything

On every source rank ``get`` returns, per name, a whole tensor or a ``px.Shard`` (its block
of the full tensor); on every target rank ``want`` (optional) returns, per name, a
``px.Region`` of the full tensor, or None for the whole of it (names it leaves out are not
sent to it). The ranks' side is :mod:`phalanx.rank.shardsync` (built-in calls under
``@sync.shard.``); the controller never sees a tensor.

**Forming**, once per *generation*: every source reports its blocks (``@sync.shard.blocks``,
which calls ``get``), every target opens a listener (``listen``: on its node's address, not
the wildcard, answering only a peer that proves this generation's secret, 32 random bytes
made here and sent inside phalanx's authenticated calls) and says what it wants (``wants``),
and the plan is computed here (:func:`phalanx.world.syncplan.plan`, pure): which source sends
which box of which name to which target, every wanted element from one source directly,
once. A sync forms again, as a whole (the calls are answered in milliseconds: no weights
move), before a stage when a member's process changed (``recreate()``, ``restart()``: its
pid in ``health()``), a group's size changed, a target group was added, ``get`` or
``want`` is another method, or the last stage failed. The blocks are the sources' at
forming: a ``get`` that later returns other shapes fails its stage on the source (naming
the name and both shapes), and the next stage forms again.

**Staging** a version: every target is told what it receives (``expect``: its staging
tensors, the transfers to wait for; answered at once -- it receives on a thread of its own,
its main thread free for calls), then every source at once (``send``) snapshots its boxes
and sends them to their targets concurrently, each target acknowledging once its bytes
are in staging. A source reports, per target, the bytes acknowledged and any failure
(connection refused or reset, its ``timeout``) without raising: a target that died or
stalled fails alone, the others complete as if it were not there (nothing here waits for
it beyond the sources' own failure detection: a dead process resets its connections at
once, a stalled one is bounded by ``timeout``). A target is staged when every byte the plan
sends it was acknowledged.

**Applying**: every target staged at the current version calls its ``set`` with its
regions (name -> tensor of the region's shape), all targets at once: the pause. Each
target's applied version is recorded here with its process id, so :meth:`ShardSync.versions`
answers at once, even while an ``apply`` runs (None for a target in the middle of one, one
whose process is not the one that applied, or one that never applied), and
:meth:`ShardSync.catch_up` stages and applies the current version to the targets behind
(recreated, added) only: the plan filtered to them, no other target receives a byte.

**Failures**: targets that failed (their rank died, a source could not reach them, their
``want`` or ``set`` raised) are collected while the others complete; then the call raises
one :class:`~phalanx.errors.PhalanxError` naming each failed target ``(group, rank)`` and
why, with ``.stats`` (what was moved, :class:`~phalanx.controller.weightsync.PushStats`),
``.failed`` (``{(group, rank): reason}``) and ``.sources`` (``{rank: reason}``); its
``__cause__`` is the first rank error among them. A source that fails (its process died,
its ``get`` raised) fails the stage naming it, and nothing of that stage is applied.
Every wait is bounded: ``timeout`` seconds on the ranks for each transfer, and a tenth
more here for each step.

**Carried on** by the controller of detached groups that attached (see
:mod:`phalanx.controller.weightsync`): :meth:`ShardSync.resume` takes the generation and
each target's applied version from what the ranks said they hold; the first stage forms
a new generation above theirs (the plan of a controller that died may have been mid-step),
:meth:`ShardSync.versions` answers from the versions the targets applied, the next stage
is the version after the highest of them, and :meth:`ShardSync.catch_up` brings the
targets behind to the highest.

States: :class:`~phalanx.controller.weightsync.SyncState`, with the same moves as the
broadcast sync's (BROKEN: the next stage forms again).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.internals import internals
from phalanx.controller.syncrecords import (
    CLOSE_TIMEOUT,
    PushStats,
    SyncState,
    check_method,
    release,
    release_quietly,
)
from phalanx.errors import CallTimeout, GroupClosed, PhalanxError, WorkerDied, printable
from phalanx.rank import shardsync as rankside
from phalanx.world import syncplan

if TYPE_CHECKING:
    from phalanx.controller.futures import Call
    from phalanx.controller.group import WorkerGroup

logger = logging.getLogger(__name__)

TRANSPORT = "p2p"  # PushStats.transport of a sync by parts
_REASON_CHARS = 400  # of a peer's error text kept in a failure's message

Target = tuple[str, int]  # (group name, rank)


@dataclasses.dataclass(frozen=True)
class _Receiver:
    """A target of the current generation: where it listens, what it allocates."""

    group: WorkerGroup
    rank: int
    pid: int | None
    host: str
    port: int
    machine: Any  # its machine's id for shared memory blocks, or None


@dataclasses.dataclass
class _Formation:
    """One generation: the plan and who takes part in it."""

    generation: int
    secret: str  # hex
    get: str
    want: str | None
    identity: tuple[Any, ...]
    sources: list[int]
    receivers: dict[Target, _Receiver]
    failed: dict[Target, str]  # targets that could not take part in this generation
    plan: syncplan.Plan[int, Target]
    tids: dict[int, int]  # id(transfer) -> its index in plan.transfers
    seconds: float


@dataclasses.dataclass
class _Outcome:
    """What one step (stage or apply) did, and what failed in it."""

    per_target: dict[Target, int] = dataclasses.field(default_factory=dict)
    failed: dict[Target, str] = dataclasses.field(default_factory=dict)
    sources: dict[int, str] = dataclasses.field(default_factory=dict)
    causes: list[BaseException] = dataclasses.field(default_factory=list)
    transfers: int = 0
    tensors: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.sources


class ShardSync:
    """Moves weights by parts from the ranks ``src_ranks`` of ``source`` (all of them:
    None) to every rank of ``targets``: see the module docstring. Made by
    :class:`~phalanx.controller.weightsync.WeightSync`, which checks its arguments."""

    def __init__(self, source: WorkerGroup, targets: Sequence[WorkerGroup],
                 src_ranks: Sequence[int] | None, *, timeout: float, deadline: float,
                 sync_id: str | None = None) -> None:
        self._source = source
        self._targets = list(targets)
        self._src_ranks = None if src_ranks is None else list(src_ranks)
        self._timeout = timeout
        self._deadline = deadline  # what the controller waits for each step
        # names this sync on every rank (one of detached groups': the same in the next
        # controller, see phalanx.controller.weightsync)
        self._id = sync_id or uuid.uuid4().hex[:16]
        self._lock = threading.Lock()  # one stage, apply or close at a time
        self._state = SyncState.NEW
        self._generation = 0
        self._version = 0
        self._formation: _Formation | None = None
        self._staged: dict[Target, tuple[int, int]] = {}  # -> (generation, version)
        # What each target applied, as (its pid then, version); read by versions() from
        # any thread, while an apply runs too: under a lock of its own.
        self._record = threading.Lock()
        self._applied: dict[Target, tuple[int | None, int]] = {}
        self._applying: set[Target] = set()
        self._finalizer = weakref.finalize(self, release_quietly, self._id,
                                           [source, *self._targets], rankside.CLOSE)
        self._finalizer.atexit = False  # at exit the ranks end anyway

    # -- reading ------------------------------------------------------------------------

    @property
    def state(self) -> SyncState:
        return self._state

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def version(self) -> int:
        """How many versions were staged (the last one's number; 0: none yet)."""
        return self._version

    def versions(self) -> dict[Target, int | None]:
        """Each target rank's applied version, ``{(group name, rank): version}``: None for
        a target whose ``apply`` is running, whose process is not the one that applied
        (recreated, restarted) or that never applied. Answers from the record kept here,
        at once, even while a stage or apply runs."""
        pids = self._pids()
        with self._record:
            out: dict[Target, int | None] = {}
            for key, pid in pids.items():
                done = self._applied.get(key)
                out[key] = (None if key in self._applying or done is None or done[0] != pid
                            else done[1])
            return out

    @property
    def targets(self) -> list[WorkerGroup]:
        return list(self._targets)

    def resume(self, generation: int, applied: Mapping[Target, tuple[int, int]]) -> None:
        """Carry on a sync the ranks hold from an earlier controller: they were formed up
        to ``generation``, and each target of ``applied`` (pid, version) set that version;
        the next stage forms again first (a new generation) and stages the version after
        the highest applied. Before any step only."""
        with self._lock, self._record:
            if self._state is not SyncState.NEW:
                raise RuntimeError(f"weight sync {self._id} is in use: resume() comes first")
            self._generation = max(self._generation, generation)
            self._applied = dict(applied)
            self._version = max((v for _, v in applied.values()), default=0)

    # -- the steps ------------------------------------------------------------------------

    def stage(self, get: str, want: str | None = None, *, verify: bool = False) -> PushStats:
        """Stage a new version on every target (see the module docstring)."""
        self._check_stage(get, want, verify)
        with self._lock:
            self._check_open()
            began = time.monotonic()
            plan_s = self._form_if_needed(get, want)
            outcome = self._stage_locked(verify, None, new_version=True)
            stats = self._stats(outcome, None, plan_s, began)
            self._raise_failed("stage", outcome, None, stats)
            return stats

    def apply(self, set_: str) -> PushStats:
        """Have every target staged at the current version call ``set`` with its regions;
        returns once each did (see the module docstring)."""
        self._check_set(set_)
        with self._lock:
            self._check_open()
            began = time.monotonic()
            keys = [k for k, staged in self._staged.items()
                    if staged[1] == self._version]
            if not keys:
                raise PhalanxError(
                    f"weight sync {self._id}: no target holds a staged version to apply "
                    + ("(nothing was staged yet: call stage() first)" if not self._version
                       else f"(version {self._version} was applied, or staged on none)"))
            outcome = self._apply_locked(set_, keys)
            stats = self._stats(None, outcome, 0.0, began)
            self._raise_failed("apply", None, outcome, stats)
            return stats

    def push(self, get: str, set_: str, want: str | None = None, *,
             verify: bool = False) -> PushStats:
        """Stage a new version, then apply it on every target that staged it (the others
        are named by the PhalanxError raised after)."""
        self._check_stage(get, want, verify)
        self._check_set(set_)
        with self._lock:
            self._check_open()
            began = time.monotonic()
            plan_s = self._form_if_needed(get, want)
            staged = self._stage_locked(verify, None, new_version=True)
            return self._apply_staged(set_, staged, plan_s, began, "push")

    def catch_up(self, get: str, set_: str, want: str | None = None) -> PushStats:
        """Stage and apply the current version on the targets behind it only (recreated,
        restarted, added, or that failed it): the plan filtered to them, so no other
        target receives a byte. The sources' ``get`` is called again (what they hold now
        is sent). With nothing staged yet it is :meth:`push`."""
        self._check_stage(get, want, False)
        self._check_set(set_)
        with self._lock:
            self._check_open()
            began = time.monotonic()
            plan_s = self._form_if_needed(get, want)
            if not self._version:
                staged = self._stage_locked(False, None, new_version=True)
                return self._apply_staged(set_, staged, plan_s, began, "catch_up")
            current = self.versions()
            behind = {key for key, version in current.items() if version != self._version}
            staged = self._stage_locked(False, behind, new_version=False)
            return self._apply_staged(set_, staged, plan_s, began, "catch_up")

    def add(self, group: WorkerGroup) -> None:
        """A new target group: it receives the current version from :meth:`catch_up`
        (or the next version from :meth:`stage` / :meth:`push`)."""
        with self._lock:
            self._check_open()
            self._targets.append(group)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, release_quietly, self._id,
                                               [self._source, *self._targets],
                                               rankside.CLOSE)
            self._finalizer.atexit = False

    # -- forming ------------------------------------------------------------------------

    def _form_if_needed(self, get: str, want: str | None) -> float:
        """Form a new generation if the last one does not hold any more (see the module
        docstring); the seconds it took (0.0: none was needed)."""
        identity = self._identity_now()
        formation = self._formation
        if (self._state is SyncState.FORMED and formation is not None
                and formation.identity == identity
                and (formation.get, formation.want) == (get, want)):
            return 0.0
        return self._form(get, want, identity)

    def _form(self, get: str, want: str | None, identity: tuple[Any, ...]) -> float:
        began = time.monotonic()
        self._state = SyncState.BROKEN  # until it formed
        self._staged.clear()  # the ranks drop the staging of another generation
        self._generation += 1
        generation = self._generation
        secret = secrets.token_bytes(32).hex()
        sources = (list(range(self._source.world_size)) if self._src_ranks is None
                   else list(self._src_ranks))
        source_gi = internals(self._source)
        failed: dict[Target, str] = {}
        # sources' blocks and targets' listeners at once: neither needs the other
        blocks_calls: dict[int, Call | BaseException] = {
            rank: _send(source_gi, rankside.BLOCKS, rank, (self._id, get))
            for rank in sources}
        listen_calls: dict[Target, Call | BaseException] = {}
        nodes: dict[Target, tuple[WorkerGroup, int]] = {}
        for group in self._targets:
            gi = internals(group)
            for health in group.health():
                key = (group.name, health.rank)
                nodes[key] = (group, health.rank)
                listen_calls[key] = _send(gi, rankside.LISTEN, health.rank, (
                    self._id, generation, secret, gi.node_address(health.node)))
        answers, errors = _settle({**_tagged("s", blocks_calls), **_tagged("t", listen_calls)},
                                  self._deadline)
        source_errors = {rank: errors[("s", rank)] for rank in sources if ("s", rank) in errors}
        if source_errors:
            self._raise_sources("forming", source_errors)
        sources_blocks: dict[int, list[syncplan.Block]] = {}
        for rank in sources:
            sources_blocks[rank] = _blocks(answers[("s", rank)], self._source.name, rank)
        names_full: dict[str, tuple[tuple[int, ...], str]] = {}
        for blocks in sources_blocks.values():
            for block in blocks:
                names_full.setdefault(block.name, (block.full, block.dtype))
        receivers: dict[Target, tuple[str, int, Any]] = {}
        for key in listen_calls:
            if ("t", key) in errors:
                failed[key] = _reason(errors[("t", key)])
            else:
                receivers[key] = _address(answers[("t", key)], key)
        wants_calls = {key: _send(internals(nodes[key][0]), rankside.WANTS, nodes[key][1],
                                  (self._id, want, names_full)) for key in receivers}
        wanted, errors_w = _settle(wants_calls, self._deadline)
        targets: dict[Target, dict[str, syncplan.Region | None]] = {}
        for key in receivers:
            if key in errors_w:
                failed[key] = _reason(errors_w[key])
                continue
            try:
                targets[key] = _regions(wanted[key], key, want)
            except (TypeError, ValueError) as exc:
                failed[key] = str(exc)
        plan = syncplan.plan(sources_blocks, targets)  # ValueError naming what is wrong
        pids = self._pids()
        formation = _Formation(
            generation=generation, secret=secret, get=get, want=want, identity=identity,
            sources=sources,
            receivers={key: _Receiver(nodes[key][0], nodes[key][1], pids.get(key),
                                      *receivers[key]) for key in targets},
            failed=failed, plan=plan,
            tids={id(t): i for i, t in enumerate(plan.transfers)},
            seconds=time.monotonic() - began)
        self._formation = formation
        self._state = SyncState.FORMED
        logger.info("weight sync %s formed (generation %d): %d source ranks of %s, %d "
                    "target ranks of %s, %d transfers%s", self._id, generation,
                    len(sources), self._source.name, len(formation.receivers),
                    ", ".join(g.name for g in self._targets), len(plan.transfers),
                    f"; {len(failed)} targets failed" if failed else "")
        return formation.seconds

    def _identity_now(self) -> tuple[Any, ...]:
        """The members' processes (node, pid, alive) as health() shows them now, and so
        the groups' sizes and the target groups themselves."""
        chosen = None if self._src_ranks is None else set(self._src_ranks)
        who: list[Any] = [tuple((h.rank, h.node, h.pid, h.alive) for h in self._source.health()
                                if chosen is None or h.rank in chosen)]
        for group in self._targets:
            who.append((group.name, tuple((h.rank, h.node, h.pid, h.alive)
                                          for h in group.health())))
        return tuple(who)

    def _pids(self) -> dict[Target, int | None]:
        return {(group.name, h.rank): (h.pid if h.alive else None)
                for group in self._targets if not group.closed for h in group.health()}

    # -- staging ------------------------------------------------------------------------

    def _stage_locked(self, verify: bool, only: set[Target] | None,
                      new_version: bool) -> _Outcome:
        """Stage on the formation's targets (``only`` those, if given): a new version, or
        the current one again (catch_up)."""
        formation = self._formation
        assert formation is not None
        began = time.monotonic()
        if new_version:
            self._version += 1
            self._staged.clear()
        version = self._version
        outcome = _Outcome()
        plan = formation.plan
        wanted = (formation.receivers.keys() if only is None
                  else [k for k in formation.receivers if k in only])
        for key, reason in formation.failed.items():
            if only is None or key in only:
                outcome.failed[key] = reason
        # every target is told what it receives first: a source may connect at once
        expects: dict[Target, Call | BaseException] = {}
        for key in wanted:
            receiver = formation.receivers[key]
            layout = {name: (w.shape, w.dtype) for name, w in plan.wanted[key].items()}
            transfers = [(formation.tids[id(t)], t.name, t.dst_box.offset, t.dst_box.shape,
                          t.nbytes) for t in plan.for_target(key)]
            expects[key] = _send(internals(receiver.group), rankside.EXPECT, receiver.rank,
                                 (self._id, formation.generation, version, layout,
                                  transfers))
        _, errors = _settle(expects, self._deadline)
        ready = {key for key in expects if key not in errors}
        for key, exc in errors.items():
            outcome.failed[key] = _reason(exc)
            outcome.causes.append(exc)
        sends: dict[int, Call | BaseException] = {}
        expected: dict[Target, int] = {key: plan.per_target_bytes[key] for key in ready}
        names: set[str] = set()
        for rank in formation.sources:
            mine = []
            for t in plan.for_source(rank):
                if t.target not in ready:
                    continue
                receiver = formation.receivers[t.target]
                mine.append((formation.tids[id(t)], t.target, receiver.host, receiver.port,
                             receiver.machine, t.name, t.src_box.offset, t.src_box.shape,
                             t.nbytes))
                names.add(t.name)
            if mine:
                sends[rank] = _send(internals(self._source), rankside.SEND, rank, (
                    self._id, formation.generation, version, formation.get, mine, verify,
                    self._timeout, formation.secret))
        outcome.transfers = sum(len(plan.for_target(key)) for key in ready)
        outcome.tensors = len(names)
        answers, errors_s = _settle(sends, self._deadline)
        acked: dict[Target, int] = dict.fromkeys(ready, 0)
        for rank, exc in errors_s.items():
            outcome.sources[rank] = _reason(exc)
            outcome.causes.insert(0, exc)  # a source's failure is the root cause
        for rank, answer in answers.items():
            got, lost = _send_answer(answer, rank, self._source.name)
            for key, nbytes in got.items():
                if key in acked:
                    acked[key] += nbytes
            for key, text in lost.items():
                if key in acked and key not in outcome.failed:
                    outcome.failed[key] = f"source rank {rank} could not send to it: {text}"
        pids = self._pids()
        for key in ready:
            outcome.per_target[key] = acked[key]
            if key in outcome.failed:
                continue
            if acked[key] != expected[key]:
                culprits = sorted({t.source for t in plan.for_target(key)
                                   if t.source in outcome.sources})
                outcome.failed[key] = (
                    f"it received {acked[key]} of its {expected[key]} bytes" +
                    (f" (source rank{'s' if len(culprits) > 1 else ''} "
                     f"{', '.join(map(str, culprits))} failed)" if culprits else ""))
                continue
            self._staged[key] = (formation.generation, version)
        for key in list(outcome.failed):
            if pids.get(key) is None:  # say so: the reason a source gives is a symptom
                outcome.failed[key] += " (its process died)"
        if not outcome.ok:
            self._state = SyncState.BROKEN  # the next stage forms again
        outcome.seconds = time.monotonic() - began
        return outcome

    # -- applying -----------------------------------------------------------------------

    def _apply_staged(self, set_: str, staged: _Outcome, plan_s: float, began: float,
                      what: str) -> PushStats:
        """Apply what ``staged`` staged, unless a source failed (then nothing is); raise
        naming every failure of both steps, the stats attached."""
        keys = [key for key in staged.per_target
                if key in self._staged and key not in staged.failed]
        applied = _Outcome()
        if not staged.sources and keys:
            applied = self._apply_locked(set_, keys)
        stats = self._stats(staged, applied, plan_s, began)
        self._raise_failed(what, staged, applied, stats)
        return stats

    def _apply_locked(self, set_: str, keys: list[Target]) -> _Outcome:
        formation = self._formation
        assert formation is not None
        began = time.monotonic()
        outcome = _Outcome()
        pids = self._pids()
        calls: dict[Target, Call | BaseException] = {}
        for key in keys:
            generation, version = self._staged[key]
            receiver = formation.receivers[key]
            calls[key] = _send(internals(receiver.group), rankside.APPLY, receiver.rank,
                               (self._id, generation, version, set_))
        with self._record:
            self._applying.update(keys)
        answers: dict[Any, Any] = {}
        errors: dict[Any, BaseException] = {}
        try:
            answers, errors = _settle(calls, self._deadline)
        finally:
            with self._record:
                for key in answers:
                    self._applied[key] = (pids.get(key), self._staged[key][1])
                    outcome.per_target[key] = 0
                for key in keys:
                    if key not in answers:  # what it holds now is nobody's version
                        self._applied.pop(key, None)
                self._applying.difference_update(keys)
        for key in keys:
            self._staged.pop(key, None)
        for key, exc in errors.items():
            outcome.failed[key] = _reason(exc)
            outcome.causes.append(exc)
        if not outcome.ok:
            self._state = SyncState.BROKEN
        outcome.seconds = time.monotonic() - began
        return outcome

    # -- results ------------------------------------------------------------------------

    def _stats(self, staged: _Outcome | None, applied: _Outcome | None, plan_s: float,
               began: float) -> PushStats:
        per_target = dict(staged.per_target) if staged is not None else {}
        if applied is not None:  # those whose set() returned
            done = len(applied.per_target)
        else:  # those that staged every byte
            done = len([k for k in per_target if staged is not None and k not in staged.failed])
        return PushStats(
            transport=TRANSPORT,
            tensors=staged.tensors if staged is not None else 0,
            bytes=sum(per_target.values()),
            targets=done,
            buckets=staged.transfers if staged is not None else 0,
            seconds=time.monotonic() - began,
            formed=plan_s > 0,
            per_target=per_target,
            plan_s=plan_s,
            stage_s=staged.seconds if staged is not None else 0.0,
            apply_s=applied.seconds if applied is not None else 0.0,
            version=self._version,
        )

    def _raise_failed(self, what: str, staged: _Outcome | None, applied: _Outcome | None,
                      stats: PushStats) -> None:
        failed: dict[Target, str] = {}
        sources: dict[int, str] = {}
        causes: list[BaseException] = []
        for outcome, step in ((staged, "staging"), (applied, "applying")):
            if outcome is None:
                continue
            sources.update(outcome.sources)
            causes += outcome.causes
            for key, reason in outcome.failed.items():
                failed.setdefault(key, f"{step}: {reason}")
        if not failed and not sources:
            return
        parts = []
        if sources:
            parts.append("; ".join(f"source rank {rank} of group {self._source.name} "
                                   f"failed: {reason}" for rank, reason in sorted(
                                       sources.items())))
        if failed:
            parts.append("; ".join(f"rank {rank} of group {group} failed ({reason})"
                                   for (group, rank), reason in sorted(failed.items())))
        done = ("nothing was applied" if sources and what != "stage"
                else f"the other {stats.targets} target ranks completed it"
                if stats.targets else "")
        error = PhalanxError(f"weight sync {self._id}: {what} of version {self._version} "
                             f"failed: {'; '.join(parts)}" + (f"; {done}." if done else "."))
        error.stats = stats  # type: ignore[attr-defined]
        error.failed = failed  # type: ignore[attr-defined]
        error.sources = sources  # type: ignore[attr-defined]
        if causes:
            raise error from causes[0]
        raise error

    def _raise_sources(self, step: str, errors: Mapping[int, BaseException]) -> None:
        reasons = {rank: _reason(exc) for rank, exc in errors.items()}
        error = PhalanxError(f"weight sync {self._id}: {step} failed: " + "; ".join(
            f"source rank {rank} of group {self._source.name} failed: {reason}"
            for rank, reason in sorted(reasons.items())))
        error.stats = PushStats(TRANSPORT, 0, 0, 0, 0, 0.0, False,  # type: ignore[attr-defined]
                                version=self._version)
        error.failed = {}  # type: ignore[attr-defined]
        error.sources = reasons  # type: ignore[attr-defined]
        raise error from next(iter(errors.values()))

    # -- checks -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is SyncState.CLOSED:
            raise GroupClosed("this weight sync was closed")
        for role, group in [("source", self._source)] + [
                (f"target {i}", g) for i, g in enumerate(self._targets)]:
            if group.closed:
                raise GroupClosed(f"weight_sync(): the {role} group {group.name} was shut "
                                  "down")

    def _check_stage(self, get: Any, want: Any, verify: Any) -> None:
        if not isinstance(get, str):
            raise TypeError(f"the get method must be a name (str), got {get!r}")
        if want is not None and not isinstance(want, str):
            raise TypeError(f"the want method must be a name (str) or None, got {want!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be True or False, got {verify!r}")
        check_method(self._source, get)
        if want is not None:
            for group in self._targets:
                check_method(group, want)

    def _check_set(self, set_: Any) -> None:
        if not isinstance(set_, str):
            raise TypeError(f"the set method must be a name (str), got {set_!r}")
        for group in self._targets:
            check_method(group, set_)

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Have every member let go of the sync (listeners, staging); idempotent."""
        with self._lock:
            if self._state is SyncState.CLOSED:
                return
            self._state = SyncState.CLOSED
            self._finalizer.detach()
            if self._generation:
                release(self._id, [self._source, *self._targets], rankside.CLOSE,
                        wait=CLOSE_TIMEOUT)


# -- helpers ----------------------------------------------------------------------------


def _send(gi: Any, method: str, rank: int, args: tuple[Any, ...]) -> Call | BaseException:
    """``method`` on one rank, deferred (sent by :func:`_settle`); the error instead when
    it cannot be sent (the rank is dead, the group closed)."""
    try:
        call: Call = gi.send_builtin(method, [rank], [args], defer=True)
    except PhalanxError as exc:
        return exc
    return call


def _tagged(tag: str, calls: Mapping[Any, Call | BaseException]
            ) -> dict[Any, Call | BaseException]:
    return {(tag, key): call for key, call in calls.items()}


def _settle(calls: Mapping[Any, Call | BaseException], timeout: float
            ) -> tuple[dict[Any, Any], dict[Any, BaseException]]:
    """Every call's answer (each on one rank), or its error: all sent at once, waited for
    together within ``timeout`` s (CallTimeout for the late ones, cancelled). No call's
    failure ends the wait for the others."""
    answers: dict[Any, Any] = {}
    errors: dict[Any, BaseException] = {}
    bridges: dict[Any, concurrent.futures.Future[list[Any]]] = {}
    for key, call in calls.items():
        if isinstance(call, BaseException):
            errors[key] = call
        else:
            bridges[key] = call.as_concurrent()  # makes the send
    if bridges:
        concurrent.futures.wait(list(bridges.values()), timeout)
    for key, bridge in bridges.items():
        call = calls[key]
        assert not isinstance(call, BaseException)
        if not bridge.done():
            call.cancel()  # its rank finishes (or times out) on its own
            errors[key] = CallTimeout(call.method, timeout, call.late_ranks(),
                                      group=call.group_name)
            continue
        exc = bridge.exception()
        if exc is not None:
            errors[key] = exc
        else:
            answers[key] = bridge.result()[0]
    return answers, errors


def _reason(exc: BaseException) -> str:
    """A rank's failure in a few words (its first line: a rank's text, escaped)."""
    if isinstance(exc, WorkerDied):
        return "its process died"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return printable(text, _REASON_CHARS)


def _blocks(answer: Any, group: str, rank: int) -> list[syncplan.Block]:
    """A source's ``blocks`` answer as plan Blocks (TypeError / ValueError naming it)."""
    if not isinstance(answer, (list, tuple)):
        raise TypeError(f"rank {rank} of group {group} reported its blocks as "
                        f"{type(answer).__name__}, not a list")
    blocks = []
    for entry in answer:
        if not isinstance(entry, (list, tuple)) or len(entry) != 6:
            raise TypeError(f"rank {rank} of group {group} reported the block "
                            f"{printable(repr(entry), 200)}, not (name, offset, shape, full, "
                            "dtype, itemsize)")
        name, offset, shape, full, dtype, itemsize = entry
        blocks.append(syncplan.Block(name, offset, shape, full, dtype, itemsize))
    return blocks


def _address(answer: Any, key: Target) -> tuple[str, int, Any]:
    if (not isinstance(answer, (list, tuple)) or len(answer) != 3
            or not isinstance(answer[0], str) or isinstance(answer[1], bool)
            or not isinstance(answer[1], int)):
        raise TypeError(f"rank {key[1]} of group {key[0]} answered listen with "
                        f"{printable(repr(answer), 200)}, not (host, port, machine)")
    return answer[0], answer[1], answer[2]


def _regions(answer: Any, key: Target, want: str | None
             ) -> dict[str, syncplan.Region | None]:
    """A target's ``wants`` answer as plan Regions (TypeError / ValueError naming it)."""
    where = f"{want}() on rank {key[1]} of group {key[0]}" if want else f"rank {key[1]}"
    if not isinstance(answer, Mapping):
        raise TypeError(f"{where} returned {type(answer).__name__}; expected a dict of "
                        "name -> px.Region or None")
    regions: dict[str, syncplan.Region | None] = {}
    for name, box in answer.items():
        if not isinstance(name, str):
            raise TypeError(f"{where} returned the key {printable(repr(name), 100)}: names "
                            "are str")
        if box is None:
            regions[name] = None
            continue
        if not isinstance(box, (list, tuple)) or len(box) != 2:
            raise TypeError(f"{where} returned {printable(repr(box), 100)} for {name!r}: "
                            "a px.Region, or None for the whole tensor")
        regions[name] = syncplan.Region(box[0], box[1])
    return regions


def _send_answer(answer: Any, rank: int, group: str
                 ) -> tuple[dict[Target, int], dict[Target, str]]:
    """A source's ``send`` answer: the bytes each target acknowledged, and why each
    failed target failed (the text escaped)."""
    if not isinstance(answer, Mapping):
        raise TypeError(f"rank {rank} of group {group} answered send with "
                        f"{type(answer).__name__}, not a dict")
    acked = answer.get("acked", {})
    errors = answer.get("errors", {})
    got = {_key(k): int(v) for k, v in acked.items() if _key(k) is not None}
    lost = {_key(k): printable(str(v), _REASON_CHARS) for k, v in errors.items()
            if _key(k) is not None}
    return got, lost  # type: ignore[return-value]


def _key(key: Any) -> Target | None:
    if (isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], str)
            and isinstance(key[1], int)):
        return (key[0], key[1])
    return None
