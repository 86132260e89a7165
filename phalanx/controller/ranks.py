"""The rank table: the controller's view of every rank, and each rank's state machine.

A :class:`RankEntry` is one *incarnation* of one rank: the process a launch started, the channel
its events come on, the calls pending on it, and where it is in its life, a
:class:`RankState`. ``recreate()`` and ``restart()`` make new entries; the old ones stay known
as dead until they are replaced. The :class:`RankTable` holds the group's current entry of
every rank and resolves ``workers=`` selections against them.

Who changes what: only an entry's own methods move it from state to state (the dispatcher
calls them as READY, INIT_ERROR and EXITED arrive, the watchdog when a rank falls silent,
the shutdown when it stops them all); only the table places and drops entries. Two fields are
left plain for the hot path's sake, each with one writer documented on it:
:attr:`RankEntry.heard_at` (stamped by the dispatcher on every message of the rank's own) and
:attr:`RankEntry.calls` (a call's sender adds to it, the dispatcher takes its answers out).

A call to many ranks at once is not registered on each of them: the sender registers it
once on a :class:`Cohort`, the entries it calls together (every rank of the group, say),
and the call's future says which of them still owe an answer. So a call to a thousand
ranks costs the controller no per-rank registration, and its answers, gathered by an agent
tree, resolve a whole run of ranks at once -- and are their sign of life at once: a run that
is every rank a link carries stamps that part of the cohort, which :attr:`RankEntry.seen`
reads with the rank's own stamp. :attr:`RankEntry.pending` shows both kinds
together -- the calls a rank owes an answer to -- for everything that looks at one rank
(its death, a membership change, health, the watchdog); taking a call from it there takes
it for that rank alone.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.errors import GroupClosed, ProcessFailure, RemoteFailure, death_error
from phalanx.world.selection import Workers, select_ranks

if TYPE_CHECKING:
    from phalanx.backends.base import Channel
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import Call, Completion

logger = logging.getLogger(__name__)


class RankState(enum.Enum):
    """Where one incarnation of a rank is in its life.

    ``STARTING``
        Launched; its READY has not arrived. (``health()``: ``"starting"``)
    ``READY``
        Its worker object is constructed: it takes calls. (``"ready"``)
    ``FAILED_START``
        Its constructor or set-up raised (INIT_ERROR); the start-up that launched it fails
        and stops it. (``"starting"``, until it is stopped)
    ``UNRESPONSIVE``
        Silent past ``heartbeat_timeout`` (see :mod:`phalanx.controller.watchdog`): its
        stack is being taken, then it is killed. (``"unresponsive"``)
    ``EXITED``
        Its process ended, or the group stopped it; :attr:`RankEntry.failure` says how, when
        known. Final. (``"dead"``)

    Legal transitions (any other is ignored: a late message cannot revive a rank)::

        STARTING      -> READY | FAILED_START | UNRESPONSIVE | EXITED
        READY         -> UNRESPONSIVE | EXITED
        FAILED_START  -> EXITED
        UNRESPONSIVE  -> EXITED
                       | READY or STARTING: back to the state it was in (it spoke
                         while its stack was being taken)
        EXITED        -> (none)
    """

    STARTING = "starting"
    READY = "ready"
    FAILED_START = "failed start"
    UNRESPONSIVE = "unresponsive"
    EXITED = "exited"

    @property
    def health(self) -> str:
        """The word :attr:`RankHealth.state <phalanx.controller.watch.RankHealth.state>`
        uses for this state."""
        return _HEALTH[self]


_HEALTH = {
    RankState.STARTING: "starting",
    RankState.READY: "ready",
    RankState.FAILED_START: "starting",
    RankState.UNRESPONSIVE: "unresponsive",
    RankState.EXITED: "dead",
}

_LEGAL = {
    RankState.STARTING: {RankState.READY, RankState.FAILED_START, RankState.UNRESPONSIVE,
                         RankState.EXITED},
    RankState.READY: {RankState.UNRESPONSIVE, RankState.EXITED},
    RankState.FAILED_START: {RankState.EXITED},
    RankState.UNRESPONSIVE: {RankState.READY, RankState.STARTING, RankState.EXITED},
    RankState.EXITED: set(),
}


class RankEntry:
    """The controller's view of one incarnation of one rank (see the module docstring).

    Read freely: ``rank``, ``node``, ``channel`` (and ``send``, its sender), ``state``,
    ``alive`` (``state`` is not ``EXITED``; kept as a plain attribute because every call
    reads it), ``ever_ready``, ``pid``, ``methods``, ``timings`` and ``code_version``
    (what READY told), ``init_failure`` (what INIT_ERROR told), ``failure`` (how its process ended),
    ``started``, ``restarts`` (how many incarnations of its rank came before it). Written
    only through the methods, except :attr:`seen`, :attr:`calls` and :attr:`restarts`
    (the rank table's, as it installs the entry); :attr:`pending` is every call it owes an
    answer to, its own and its cohorts' (see the module docstring).
    """

    def __init__(self, rank: int, node: int, channel: Channel) -> None:
        self.rank = rank
        self.node = node
        self.channel = channel
        self.send = channel.sender()  # a frame to it: the call path's every send
        self.state = RankState.STARTING
        self.alive = True
        self.ever_ready = False  # its READY arrived (whatever state followed)
        self.pid: int | None = None
        self.methods: dict[str, list[str]] = {}  # each with its parameters' names
        self.timings: dict[str, float] = {}  # its start-up, as READY tells it
        self.code_version: str | None = None  # of the shipped code it runs, as READY tells
        self.init_failure: RemoteFailure | None = None
        self.failure: ProcessFailure | None = None
        self.started = time.monotonic()  # when its launch began
        # When its last message of its own came (None: none yet): the dispatcher stamps it
        # on every message it routes here. seen adds what its cohorts heard of it.
        self.heard_at: float | None = None
        # Call id -> the completion side of its future, for the calls registered on it
        # alone: the sender adds a call as it sends it, the dispatcher pops it as the answer
        # comes; everything else uses pending and take_pending.
        self.calls: dict[int, Completion] = {}
        # (cohort, its position there): the cohorts whose calls it is called in
        self.cohorts: list[tuple[Cohort, int]] = []
        # The collectives it is inside and the last each of its process groups completed,
        # as it last reported them (phalanx.rank.collectives); None until it reports.
        self.collectives: tuple[list[Any], list[Any]] | None = None
        self._suspected_in = RankState.STARTING  # the state UNRESPONSIVE was entered from
        self.restarts = 0  # how many incarnations of its rank came before it (RankTable)

    # -- reading --------------------------------------------------------------------------

    @property
    def seen(self) -> float | None:
        """When it last gave a sign of life (any message, an answer among its cohort's);
        None until its first."""
        seen = self.heard_at
        for cohort, i in self.cohorts:
            stamp = cohort.heard(i)
            if stamp is not None and (seen is None or stamp > seen):
                seen = stamp
        return seen

    @seen.setter
    def seen(self, value: float | None) -> None:
        self.heard_at = value

    @property
    def pending(self) -> PendingCalls:
        """Every call it owes an answer to: those sent to it alone and its cohorts'."""
        return PendingCalls(self)

    def cohort_call(self, call_id: int) -> Call | None:
        """The call ``call_id`` of one of its cohorts, if it still owes its answer."""
        for cohort, i in self.cohorts:
            call = cohort.calls.get(call_id)
            if call is not None:
                return call if cohort.owes(call_id, call, i) else None
        return None

    @property
    def heard(self) -> bool:
        """Whether it has said anything yet (its silence counts from then on)."""
        return self.seen is not None

    @property
    def last_sign(self) -> float:
        """When it last gave a sign of life, or its launch if it has not yet."""
        return self.started if self.seen is None else self.seen

    def settled_start(self) -> bool:
        """Whether its start-up has an outcome: ready, failed, or dead."""
        return self.ever_ready or self.init_failure is not None or not self.alive

    # -- transitions ----------------------------------------------------------------------

    def _move(self, to: RankState) -> bool:
        if to not in _LEGAL[self.state]:
            logger.debug("rank %d: %s -> %s ignored", self.rank, self.state.name, to.name)
            return False
        self.state = to
        self.alive = to is not RankState.EXITED
        return True

    def became_ready(self, pid: int, methods: dict[str, list[str]], timings: dict[str, float],
                     code_version: str | None) -> None:
        """READY arrived: what it tells is recorded, and a starting rank is ready."""
        self.pid, self.methods, self.timings, self.code_version = (pid, methods, timings,
                                                                    code_version)
        self.timings["total"] = time.monotonic() - self.started
        self.ever_ready = True
        if self.state is RankState.UNRESPONSIVE:
            self._suspected_in = RankState.READY  # where it goes back to, if it does
        else:
            self._move(RankState.READY)

    def failed_to_start(self, failure: RemoteFailure) -> None:
        """INIT_ERROR arrived: its constructor or set-up raised ``failure``."""
        self.init_failure = failure
        self._move(RankState.FAILED_START)

    def suspect(self) -> bool:
        """The watchdog found it silent: UNRESPONSIVE (False if it is not running)."""
        state = self.state
        if state is not RankState.STARTING and state is not RankState.READY:
            return False
        self._suspected_in = state
        return self._move(RankState.UNRESPONSIVE)

    def clear_suspicion(self) -> None:
        """It spoke while its stack was taken: back to the state it was in."""
        if self.state is RankState.UNRESPONSIVE:
            self._move(self._suspected_in)

    def exited(self, failure: ProcessFailure | None) -> None:
        """Its process ended (``failure``: how) or is being stopped (None: as it is)."""
        if failure is not None:
            self.failure = failure
        self._move(RankState.EXITED)

    def add_account(self, failure: ProcessFailure) -> None:
        """A fuller account of a death already recorded (the exit status after a kill)."""
        self.failure = failure.merged(self.failure)

    def take_pending(
        self, which: Callable[[Completion], bool] | None = None
    ) -> list[Completion]:
        """Remove and return the calls pending on it (only those ``which`` selects); a
        cohort's call is taken for this entry alone (the caller completes it for it)."""
        if which is None:
            pending, self.calls = self.calls, {}
            taken = list(pending.values())
        else:
            chosen = [(call_id, c) for call_id, c in self.calls.items() if which(c)]
            for call_id, _ in chosen:
                del self.calls[call_id]
            taken = [c for _, c in chosen]
        for cohort, i in self.cohorts:
            taken += cohort.take(i, which)
        return taken

    def __repr__(self) -> str:
        return f"<RankEntry rank {self.rank} node {self.node} {self.state.name}>"


class PendingCalls(MutableMapping[int, "Completion"]):
    """The calls one entry owes an answer to (:attr:`RankEntry.pending`): a view of its
    own calls and of its cohorts' calls it has not answered. Removing one removes it for
    this entry alone."""

    __slots__ = ("_entry",)

    def __init__(self, entry: RankEntry) -> None:
        self._entry = entry

    def _items(self) -> list[tuple[int, Completion]]:
        entry = self._entry
        items: list[tuple[int, Completion]] = list(entry.calls.items())
        for cohort, i in entry.cohorts:
            items += cohort.owed(i)
        return items

    def __getitem__(self, call_id: int) -> Completion:
        entry = self._entry
        call = entry.calls.get(call_id)
        if call is None:
            call = entry.cohort_call(call_id)
        if call is None:
            raise KeyError(call_id)
        return call

    def __setitem__(self, call_id: int, call: Completion) -> None:
        self._entry.calls[call_id] = call

    def __delitem__(self, call_id: int) -> None:
        entry = self._entry
        if entry.calls.pop(call_id, None) is not None:
            return
        for cohort, i in entry.cohorts:
            call = cohort.calls.get(call_id)
            if call is not None and cohort.owes(call_id, call, i):
                cohort.let_go(call_id, i)
                return
        raise KeyError(call_id)

    def __iter__(self) -> Iterator[int]:
        return iter([call_id for call_id, _ in self._items()])

    def calls(self) -> list[Completion]:
        """Every call it owes, taken at once: what a thread other than the pumping one
        reads (``values()`` looks each id up again, and an answer that came meanwhile
        would make that lookup fail)."""
        return [call for _, call in self._items()]

    def __len__(self) -> int:
        return len(self._items())

    def __bool__(self) -> bool:
        entry = self._entry
        return bool(entry.calls) or any(cohort.owed(i) for cohort, i in entry.cohorts)

    def __repr__(self) -> str:
        return f"<pending calls of rank {self._entry.rank}: {dict(self._items())}>"


class Cohort:
    """Entries called together (every rank of a group, say), a call to all of them
    registered here once (see the module docstring).

    ``ranks`` and ``entries`` are in the calls' order (``positions``: a rank's place
    there); a registered call is owed by each entry whose place its future still waits on
    (:meth:`Call.waits_on <phalanx.controller.futures.Call.waits_on>`), unless it was taken
    from that entry (:meth:`take`). Its parts are the sender's (:meth:`add_part`): which
    places each connection carries (a run of them), for the answers that come back over it,
    with when the last answer of every one of them came (their sign of life).
    """

    __slots__ = ("_part_of", "_stamps", "calls", "entries", "gone", "parts", "positions",
                 "ranks", "retired", "sends", "version")

    def __init__(self, ranks: list[int], entries: list[RankEntry], version: Any) -> None:
        self.ranks = ranks  # never mutated (calls' futures share it)
        self.entries = entries
        self.version = version  # what it was made from (the sender's, to know it is current)
        self.positions = {rank: i for i, rank in enumerate(ranks)}
        self.calls: dict[int, Call] = {}  # call id -> its future, until every place is done
        self.gone: dict[int, set[int]] = {}  # call id -> places it was taken from
        self.parts: dict[Any, tuple[int, int, int]] = {}  # a link -> [lo, hi) and its number
        self._part_of: list[int] = [-1] * len(ranks)  # a place -> its part's number
        self._stamps: list[float | None] = []  # a part's number -> when all of it answered
        self.sends: list[tuple[Any, bytes]] = []  # each link, and its ranks' header field
        self.retired = False
        for i, entry in enumerate(entries):
            entry.cohorts.append((self, i))

    def owes(self, call_id: int, call: Call, i: int) -> bool:
        """Whether the entry at place ``i`` owes its answer to ``call``."""
        if not call.waits_on(i):
            return False
        gone = self.gone.get(call_id) if self.gone else None
        return gone is None or i not in gone

    def owed(self, i: int) -> list[tuple[int, Completion]]:
        """The calls the entry at place ``i`` owes its answer to."""
        # a copy first (made at once): the sender may register a call meanwhile
        return [(call_id, call) for call_id, call in list(self.calls.items())
                if self.owes(call_id, call, i)]

    def take(self, i: int, which: Callable[[Completion], bool] | None) -> list[Completion]:
        """Take the calls the entry at place ``i`` owes (those ``which`` selects) from it."""
        taken: list[Completion] = []
        for call_id, call in list(self.calls.items()):
            if self.owes(call_id, call, i) and (which is None or which(call)):
                self.let_go(call_id, i)
                taken.append(call)
        return taken

    def let_go(self, call_id: int, i: int) -> None:
        """The entry at place ``i`` no longer owes call ``call_id`` (taken from it)."""
        self.gone.setdefault(call_id, set()).add(i)

    def add_part(self, link: Any, lo: int, hi: int) -> None:
        """``link`` carries the places ``lo`` to ``hi`` (and no other)."""
        number = len(self._stamps)
        self._stamps.append(None)
        self.parts[link] = (lo, hi, number)
        self._part_of[lo:hi] = [number] * (hi - lo)

    def heard(self, i: int) -> float | None:
        """When the last answer of every place of the part of place ``i`` came."""
        number = self._part_of[i]
        return None if number < 0 else self._stamps[number]

    def answered(self, link: Any, lo: int, count: int, now: float) -> None:
        """The places ``lo`` to ``lo + count`` of ``link``'s part answered (at ``now``):
        the whole part stamped at once, else each of those entries."""
        part = self.parts.get(link)
        if part is not None and part[0] == lo and part[1] == lo + count:
            self._stamps[part[2]] = now
            return
        for entry in self.entries[lo:lo + count]:
            entry.heard_at = now

    def span(self, link: Any, ranks: Sequence[int]) -> int:
        """The place of ``ranks[0]`` when ``ranks`` (increasing) are a run of places all
        carried by ``link``; -1 when they are not."""
        part = self.parts.get(link)
        if part is None:
            return -1
        first = self.positions.get(ranks[0])
        if first is None:
            return -1
        end = first + len(ranks)
        if first < part[0] or end > part[1]:
            return -1
        if type(ranks) is range:  # increasing ints from ranks[0] to ranks[-1]: a run
            return first if self.ranks[end - 1] == ranks[-1] else -1
        return first if tuple(self.ranks[first:end]) == tuple(ranks) else -1

    def done(self, call_id: int) -> None:
        """Call ``call_id`` is complete: every place answered or failed."""
        self.calls.pop(call_id, None)
        if self.gone:
            self.gone.pop(call_id, None)
        if self.retired and not self.calls:
            self.detach()

    def retire(self) -> None:
        """No call will be registered here any more: leave the entries once the calls in
        flight are complete."""
        self.retired = True
        if not self.calls:
            self.detach()

    def detach(self) -> None:
        for i, entry in enumerate(self.entries):
            try:
                entry.cohorts.remove((self, i))
            except ValueError:
                pass

    def __repr__(self) -> str:
        return f"<Cohort of {len(self.ranks)} ranks, {len(self.calls)} calls in flight>"


def channels_of(entries: Sequence[RankEntry]) -> list[Channel]:
    """The distinct channels of ``entries`` (a node channel may carry several of them)."""
    return list({id(s.channel): s.channel for s in entries}.values())


class RankTable:
    """The group's current entry of every rank (None: never started), and selections.

    :attr:`entries` is read by the other parts (the sender holds it: it stays the same list
    object for the group's life); only :meth:`install` and :meth:`reset` change it.
    """

    def __init__(self, world_size: int, dispatcher: Dispatcher) -> None:
        self.entries: list[RankEntry | None] = [None] * world_size
        self._all = list(range(world_size))  # never mutated: futures may share it
        self._dispatcher = dispatcher
        self._deaths_seen = -1  # dispatcher.deaths when every rank was last seen alive
        self.version = 0  # moves on whenever an entry is placed (a cohort made before: stale)
        # the last list or tuple of ranks selected, its ranks, and the deaths and version
        # then: the same selection object again (a cached options record's) is taken as is
        # while no rank died and no entry changed (the pipelined loop's call)
        self._last: tuple[object, list[int], int, int] = (None, [], -1, -1)

    def __len__(self) -> int:
        return len(self.entries)

    def install(self, entries: Sequence[RankEntry]) -> None:
        """Fresh entries take their ranks' places (the old ones are retired already)."""
        for entry in entries:
            old = self.entries[entry.rank]
            if old is not None:
                entry.restarts = old.restarts + 1
            self.entries[entry.rank] = entry
        self.version += 1

    def reset(self, world_size: int) -> None:
        """A new layout: ``world_size`` ranks, none started yet."""
        self.entries[:] = [None] * world_size
        self._all = list(range(world_size))
        self._deaths_seen = -1
        self.version += 1

    # -- views --------------------------------------------------------------------------

    def known(self) -> list[RankEntry]:
        """Every rank's current entry, dead ones included."""
        return [s for s in self.entries if s is not None]

    def live(self) -> list[RankEntry]:
        """The entries whose process runs."""
        return [s for s in self.entries if s is not None and s.alive]

    def alive_flags(self) -> list[bool]:
        """Per rank: whether it runs (what :func:`select_ranks` takes)."""
        return [s is not None and s.alive for s in self.entries]

    def live_channels(self) -> list[Channel]:
        """The live ranks' channels, each once."""
        return channels_of(self.live())

    def checked(self, ranks: list[int]) -> list[int]:
        """Ranks the group chose itself (a plan's: valid, increasing), each checked to be
        alive as :meth:`select` does -- unless no rank died or was removed since every rank
        was last seen alive (a cheap test)."""
        if self._dispatcher.deaths == self._deaths_seen:
            return ranks
        return self.select(ranks)

    # -- selections ---------------------------------------------------------------------

    def select(self, workers: Workers) -> list[int]:
        """The ranks ``workers=`` names, each checked to be alive (WorkerDied otherwise);
        ``"ready"`` skips dead ones, ``"any"`` is the first live one."""
        deaths = self._dispatcher.deaths
        if workers == "all" and deaths == self._deaths_seen:
            return self._all  # no rank died since every rank was last known alive
        last, ranks, seen, version = self._last
        if workers is last and deaths == seen and version == self.version:
            return ranks  # (never mutated: futures share it)
        if (isinstance(workers, (list, tuple)) and workers
                and self._all_usable(workers)):
            ranks = list(workers)  # live, valid, increasing; a copy: the caller may change theirs
            if type(workers) is tuple:  # (a list may change in place: not remembered)
                self._last = (workers, ranks, deaths, self.version)
            return ranks
        if workers in ("ready", "any"):
            self._dispatcher.poll_now()  # learn of deaths that already happened
            # and skip those whose death is known but not yet told (Ray's, for a second)
            alive = [s is not None and s.alive and not s.channel.dying(s.rank)
                     for s in self.entries]
        else:
            alive = self.alive_flags()
        if all(alive):
            self._deaths_seen = self._dispatcher.deaths
        ranks = select_ranks(workers, alive)
        for r in ranks:
            entry = self.entries[r]
            if entry is None or not entry.alive:
                raise death_error(entry.failure if entry is not None else None,  # type: ignore[arg-type]
                                  group=self._dispatcher.group_name)
        if workers == "any" and not ranks:
            raise GroupClosed("workers='any': no rank of this group is alive")
        return ranks

    def _all_usable(self, ranks: Sequence[int]) -> bool:
        entries = self.entries
        previous = -1
        for rank in ranks:
            if type(rank) is not int or not previous < rank < len(entries):
                return False
            entry = entries[rank]
            if entry is None or not entry.alive:
                return False
            previous = rank
        return True

    def __repr__(self) -> str:
        states: dict[Any, int] = {}
        for entry in self.entries:
            key = "unstarted" if entry is None else entry.state.name
            states[key] = states.get(key, 0) + 1
        return f"<RankTable {len(self.entries)} ranks: {states}>"
