"""The controller's event pump: routes the events of every channel to futures, and turns a
rank's EXITED event into ``WorkerDied`` for every call pending on it.

Whichever thread waits on a future becomes the *leader* and polls every descriptor the
group's channels asked it to watch (leader/followers); other waiting threads sleep on a
condition until the leader completes their future or steps down. A result therefore
reaches the waiting thread with no thread hand-off. Only while futures with done-callbacks
(or awaited ones) are pending and no thread waits does the group's watchdog thread lead
(:meth:`Dispatcher.pump_in_background`), stepping down as soon as a thread comes to wait.
Events that a backend learns on a thread of its own (a death being finished, Ray's account
of one) are posted and wake the leader through a self-pipe. Where the controller's compiled
part was built (:mod:`phalanx.controller.compiled`), a channel's own read (``watch``'s
``read=``) is wrapped in a router that routes a lone answer as it reads it, and the leader's
loop over a poll's events runs compiled for those; everything else reaches the same Python.

Every event names its rank in its header (:mod:`phalanx.wire.protocol`); an event from a
channel that no longer carries that rank (an earlier incarnation) is dropped. A rank speaks
for itself alone: a frame that names a rank its channel does not carry, or whose header
cannot be read, or of a kind no rank sends, is the rank breaking the protocol -- it is
ended (SIGKILL) and its calls fail saying so (``rank 0 broke the protocol: it sent an
answer as rank 1 (ended by the controller)``), as an agent ends one of its ranks. Those
checks cost the hot path nothing: they run where a frame is dropped or not understood
anyway. (An answer to a call not pending on the rank is not one: a call failed meanwhile
-- a membership change -- is still answered later; and it reaches no other rank's call.)

The dispatcher routes to the rank table's entries (:mod:`phalanx.controller.ranks`) and
completes futures through their completion side
(:class:`~phalanx.controller.futures.Completion`). An answer finds its call on the rank's
entry, or once for many ranks on a cohort of entries; the gathered answers of a run of
ranks (an agent tree's RESULTS) resolve the run at once when the call was registered on a
cohort and the run is one the link that brought it carries (:meth:`Dispatcher.resolve_results`),
else rank by rank. It moves an entry only through the entry's
own transitions (READY, INIT_ERROR, EXITED); :meth:`Dispatcher.bury` is the one routine
for a dead rank, whoever learnt of the death.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import TYPE_CHECKING, Any

from phalanx.controller.compiled import hotpath
from phalanx.errors import (
    ObjectLost,
    ProcessFailure,
    RemoteFailure,
    WorkerError,
    chain_remote,
    death_error,
    rank_text,
)
from phalanx.wire import protocol, streams
from phalanx.wire.streams import ConnectionLost

if TYPE_CHECKING:
    from phalanx.backends.base import Channel, Receiver
    from phalanx.controller.futures import Call, Completion, GroupFuture
    from phalanx.controller.ranks import Cohort, RankEntry
    from phalanx.wire.protocol import Gathered

    # what a channel's read returns: its events, or one alone as its header and pickle
    Received = list[list[Any]] | tuple[bytes, bytes]

logger = logging.getLogger(__name__)

_ROUTE = protocol.unpack_head  # (kind, call id, rank) of an event's header
_monotonic = time.monotonic
_RESULT = protocol.RESULT
_YIELD = protocol.YIELD
_HEARTBEAT = protocol.HEARTBEAT

# The longest single sleep of a waiting thread, in seconds. A poll's timeout overflows past
# 2**31 ms (~25 days: "timeout is too large"), a lock's past threading.TIMEOUT_MAX, so a
# longer wait (any float timeout is allowed, inf included) sleeps in slices of this and
# checks its deadline after each: a wake-up an hour costs nothing.
_LONGEST_SLEEP = 3600.0
_yield = getattr(os, "sched_yield", lambda: None)


def _is_failure(value: Any) -> bool:
    """Whether ``value`` has the shape of a RemoteFailure's tuple (four texts, bytes or
    None)."""
    return (isinstance(value, (list, tuple)) and len(value) == 5
            and all(isinstance(v, str) for v in value[:4])
            and isinstance(value[4], (bytes, type(None))))


def _misshapen(kind: int, extra: tuple[Any, ...]) -> str | None:
    """What is wrong with the fields a rank sent with a READY, INIT_ERROR, ERROR, RELEASED or
    COLLECTIVE (None when nothing is): checked before they are used, so that a rank that
    lies about them is ended as one that broke the protocol rather than break the
    dispatcher."""
    if kind == protocol.ERROR or kind == protocol.INIT_ERROR:
        if len(extra) == 1 and _is_failure(extra[0]):
            return None
        return "it sent a malformed failure report"
    if kind == protocol.READY:
        if len(extra) == 4:
            pid, methods, timings, version = extra
            if (isinstance(pid, int) and isinstance(methods, dict)
                    and all(isinstance(k, str) and isinstance(v, list)
                            and all(isinstance(n, str) for n in v)
                            for k, v in methods.items())
                    and isinstance(timings, dict)
                    and all(isinstance(k, str) and isinstance(v, (int, float))
                            for k, v in timings.items())
                    and isinstance(version, (str, type(None)))):
                return None
        return "it sent a malformed READY"
    if kind == protocol.RELEASED:
        if len(extra) == 1 and isinstance(extra[0], int):
            return None
        return "it sent a malformed RELEASED"
    if kind == protocol.COLLECTIVE:
        if (len(extra) == 2 and isinstance(extra[0], list) and isinstance(extra[1], list)
                and all(isinstance(item, list) for item in extra[0] + extra[1])):
            return None
        return "it sent a malformed COLLECTIVE"
    return None


def _no_stacks(ranks: list[int]) -> dict[int, str]:
    return {}


class Dispatcher:
    """Receives for every rank of one group; driven by the threads that wait.

    ``on_death(entry)`` is told of every rank that died while routed here (after its calls
    failed); ``stacks_of(ranks)`` gives every thread's stack of those ranks, for errors
    that say where late ranks are (taking stacks is the backend's business);
    ``on_released(channel, ref_id)``: a rank let go of a freed shared object (RELEASED).
    ``deaths`` counts every death and removal: a cheap change counter, read-only outside.
    ``group_name`` is the name of the group (:mod:`.names`), read-only: the errors of its
    calls name it, and so do the parts that make errors from what is routed here.
    """

    def __init__(
        self,
        on_death: Callable[[RankEntry], None] | None = None,
        *,
        stacks_of: Callable[[list[int]], dict[int, str]] = _no_stacks,
        on_released: Callable[[Channel, int], None] | None = None,
        group_name: str | None = None,
    ) -> None:
        self.group_name = group_name
        # epoll: waiting costs the same however many workers the group has.
        self._poller = select.epoll() if hasattr(select, "epoll") else select.poll()
        self._fd_lock = threading.Lock()  # watch/unwatch: the map and the poller agree
        # each watched descriptor's channel, and its read (watch's read=) or None
        self._by_fd: dict[int, tuple[Receiver, Callable[[], Received] | None]] = {}
        self._by_rank: dict[int, RankEntry] = {}
        # the entries that reported collectives (the collective watch reads these, not
        # every rank, each tick: ten thousand ranks that report none cost it nothing)
        self.collective_reporters: set[RankEntry] = set()
        self._cond = threading.Condition(threading.Lock())
        self._lead = threading.Lock()  # held by the thread that pumps (the leader)
        self._followers = 0  # threads waiting for the leader to finish their future
        try:
            self._wakeup = streams.WakePipe()
        except BaseException:  # out of descriptors: the epoll is given back
            close = getattr(self._poller, "close", None)
            if close is not None:
                close()
            raise
        self._poller.register(self._wakeup.fd, select.POLLIN)
        self._wakeup_fd = self._wakeup.fd
        self._poll = self._poller.poll
        self._epoll = hasattr(select, "epoll")
        self._posted: list[tuple[Channel, list[list[Any]]]] = []
        self._tasks: list[Callable[[], None]] = []  # run by the pumping thread
        self._posted_lock = threading.Lock()
        self._on_death = on_death
        self._released = False
        self._background: set[GroupFuture] = set()  # pending futures with done-callbacks
        self._background_leads = False
        self.background_wanted = threading.Event()  # wakes the watchdog to lead
        self.stacks_of = stacks_of
        self.deaths = 0  # incremented on every death and removal: a cheap change counter
        self._on_released = on_released
        # each watched read's router, and their loop over a poll's events, compiled (see
        # watch), and the events an error left behind in it (see _carry)
        self._router = None if hotpath is None else hotpath.AnswerRouter
        self._route_events = None if hotpath is None else hotpath.route_events
        self._carried: list[tuple[int, int]] = []

    # -- the sink channels deliver to (any thread) ------------------------------------

    def watch(self, fd: int, channel: Receiver,
              read: Callable[[], Received] | None = None) -> None:
        if read is not None and self._router is not None:  # read, and _pump's routing of
            read = self._router(read, self._by_rank, channel)  # a lone answer, compiled
        with self._fd_lock:
            self._by_fd[fd] = (channel, read)
            try:
                self._poller.register(fd, select.POLLIN)
            except FileExistsError:  # the number of a descriptor closed without unwatch()
                self._poller.modify(fd, select.POLLIN)
        self._wakeup.wake()  # a leader blocked in poll() must pick up the new descriptor

    def unwatch(self, fd: int, channel: Receiver | None = None) -> None:
        """Stop watching ``fd`` -- only if ``channel`` (when given) still owns it: once a
        channel closed its descriptor, the number may already belong to a new channel's,
        which a late unwatch must not take away (a rank that would never be heard)."""
        with self._fd_lock:
            current = self._by_fd.get(fd)
            if current is None or (channel is not None and current[0] is not channel):
                return
            del self._by_fd[fd]
            if self._released:
                return
            try:
                self._poller.unregister(fd)
            except (KeyError, OSError, ValueError):
                pass

    def post(self, channel: Channel, events: list[list[Any]]) -> None:
        self.post_all([(channel, events)])

    def deliver(self, channel: Channel, events: list[list[Any]]) -> None:
        """From inside a channel's ``receive()`` (the pumping thread): handle events of
        another channel now (a node's link reads for each of its ranks' channels)."""
        self._on_events(channel, events)

    def resolve_results(self, call_id: int, gathered: Gathered, link: object,
                        channel_of: Callable[[int], Channel | None]) -> None:
        """From inside ``link``'s ``receive()``: one call's results of several ranks (an
        agent tree's gathered ones). A call registered on a cohort takes the whole run at
        once, when the run is one of its places that ``link`` carries and every one of them
        was waited for; otherwise each rank's answer goes to its call as a RESULT would
        (``channel_of(rank)``: the channel ``link`` carries for it)."""
        ranks = gathered.ranks
        entry = self._by_rank.get(ranks[0])
        if entry is not None and entry.cohorts:
            for cohort, _ in entry.cohorts:
                future = cohort.calls.get(call_id)
                if future is None:
                    continue
                if cohort.gone.get(call_id):
                    break
                lo = cohort.span(link, ranks)
                if lo >= 0:
                    if future.resolve_span(lo, gathered):
                        # each a sign of life, as a RESULT would be
                        cohort.answered(link, lo, len(ranks), time.monotonic())
                        return
                    break
                # answers of several runs (the late ones of a subtree came apart): each
                # run at once, what is left of them rank by rank
                left = self._resolve_runs(cohort, future, link, gathered)
                if left is None:
                    return
                if len(left) < len(ranks):
                    self._resolve_each(call_id, gathered, left, channel_of)
                    return
                break
        self._resolve_each(call_id, gathered, range(len(ranks)), channel_of)

    @staticmethod
    def _resolve_runs(cohort: Cohort, future: Call, link: object,
                      gathered: Gathered) -> list[int] | None:
        """Resolve each run of ``gathered``'s ranks that lies in ``link``'s part of
        ``cohort`` at once; the indices of those left (None: none)."""
        part = cohort.parts.get(link)
        if part is None:
            return list(range(len(gathered)))
        positions, ranks, places = cohort.positions, gathered.ranks, cohort.ranks
        lo_part, hi_part = part[0], part[1]
        left: list[int] = []
        now = time.monotonic()
        count = len(ranks)
        # where a run of consecutive rank numbers ends: a step other than 1 between two
        # (found in C: each step capped at 2 into bytes, then searched)
        steps = bytes(map(min, map(operator.sub, ranks[1:], ranks[:-1]), repeat(2)))
        start = 0
        while start < count:
            cut = steps.find(2, start)
            end = count if cut < 0 else cut + 1
            first = positions.get(ranks[start])
            size = end - start
            if (first is None or first < lo_part or first + size > hi_part
                    or places[first:first + size] != list(ranks[start:end])
                    or not future.resolve_span(first, gathered.sub(start, end))):
                left.extend(range(start, end))
            else:
                cohort.answered(link, first, size, now)
            start = end
        return left or None

    def _resolve_each(self, call_id: int, gathered: Gathered, indices: Iterable[int],
                      channel_of: Callable[[int], Channel | None]) -> None:
        """Each of ``gathered``'s answers at ``indices`` to its rank's call, as a RESULT's
        would go."""
        ranks = gathered.ranks
        by_rank = self._by_rank
        now = time.monotonic()
        for i in indices:
            rank = ranks[i]
            channel = channel_of(rank)
            entry = by_rank.get(rank)
            if channel is None or entry is None or entry.channel is not channel:
                continue  # an earlier incarnation's, or a rank not on that link
            entry.heard_at = now
            pending = entry.calls.pop(call_id, None)
            if pending is None and entry.cohorts:
                pending = entry.cohort_call(call_id)
            if pending is not None:
                pending.resolve_rank(rank, gathered.payload(i))

    def post_all(self, batches: list[tuple[Channel, list[list[Any]]]]) -> None:
        """Deliver the events of several channels with one wake-up (a node's link)."""
        with self._posted_lock:
            if self._released:
                return
            self._posted.extend(batches)
        self._wakeup.wake()
        if self._followers:  # no leader may be polling: let a follower take the lead
            with self._cond:
                self._cond.notify_all()

    def call_soon(self, task: Callable[[], None]) -> None:
        """Run ``task()`` on the pumping thread, before the events posted after it (what
        must touch futures from another thread: failing calls on a membership change)."""
        with self._posted_lock:
            if self._released:
                return
            self._tasks.append(task)
        self._wakeup.wake()
        if self._followers:
            with self._cond:
                self._cond.notify_all()

    # -- membership -------------------------------------------------------------------

    def add(self, entry: RankEntry) -> None:
        """Route the rank's events to ``entry`` (before its channel is attached)."""
        self._by_rank[entry.rank] = entry

    # -- waiting ----------------------------------------------------------------------

    def wait(
        self,
        is_done: Callable[[], bool],
        timeout: float | None,
        kickoff: Callable[[], None] | None = None,
    ) -> bool:
        """Wait until ``is_done()`` or ``timeout``; drive the pump while nobody else does.

        ``kickoff`` (the sends of a call made with ``defer``) runs once, right before this
        thread's first poll (or at once, where another thread leads).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._lead.acquire(False):
                return self._lead_until(is_done, deadline, kickoff)
            if kickoff is not None:
                kickoff()  # another thread leads: send now, then wait as a follower
                kickoff = None
            cond = self._cond
            with cond:
                self._followers += 1
                if self._background_leads:
                    self._wakeup.wake()  # the watchdog leads: have it step down
                try:
                    while True:
                        if is_done():
                            return True
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            return False
                        if self._lead.acquire(False):
                            self._lead.release()
                            break  # the leader stepped down: try to lead
                        cond.wait(None if remaining is None
                                  else min(remaining, _LONGEST_SLEEP))
                finally:
                    self._followers -= 1

    def _lead_until(
        self,
        is_done: Callable[[], bool],
        deadline: float | None,
        kickoff: Callable[[], None] | None,
    ) -> bool:
        """Pump as the leader (``self._lead`` held) until done or the deadline."""
        try:
            if kickoff is not None:
                kickoff()
            # Woken with part of what it waits for, the leader yields its CPU once before
            # it sleeps again: where ranks share CPUs with the controller (a fan-out to
            # more ranks than cores), the ranks still running answer meanwhile and one
            # look collects them, instead of a sleep and a wake-up per answer.
            if deadline is None:
                while not is_done():
                    if self._pump(None) and not is_done():
                        _yield()
                        self._pump(0)
                return True
            while not is_done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if self._pump(remaining) and not is_done():
                    _yield()
                    self._pump(0)
            return True
        finally:
            self._lead.release()
            if self._followers:  # one of them may lead now, or its future completed
                with self._cond:
                    self._cond.notify_all()

    # -- completing futures nobody waits on ----------------------------------------------

    def watch_future(self, future: GroupFuture, on: bool) -> None:
        """Keep delivering to ``future`` (it has done-callbacks) even if no thread waits."""
        if on:
            self._background.add(future)
            self.background_wanted.set()
        else:
            self._background.discard(future)

    def has_background_work(self) -> bool:
        return bool(self._background) and not self._released

    def pump_in_background(self, timeout: float, stop: Callable[[], bool]) -> bool:
        """Lead for up to ``timeout`` s while futures with callbacks are pending, if no
        thread leads now (else False); step down when a thread comes to wait (it leads
        then)."""
        if not self._lead.acquire(False):
            return False
        self._background_leads = True
        try:
            deadline = time.monotonic() + timeout
            while self._background and not self._followers and not stop():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._pump(remaining)
        finally:
            self._background_leads = False
            self._lead.release()
            if self._followers:
                with self._cond:
                    self._cond.notify_all()
        return True

    def poll_now(self) -> None:
        """Process what has already arrived, without blocking (no-op if another thread pumps)."""
        if not self._lead.acquire(False):
            return
        try:
            self._pump(0)
        finally:
            self._lead.release()
            if self._followers:
                with self._cond:
                    self._cond.notify_all()

    def _pump(self, timeout: float | None) -> bool:
        """Handle what arrives within ``timeout`` s (None: until something does); may
        return early, every caller loops on its own condition and deadline. True when
        a channel had something to read."""
        if timeout is not None and timeout > _LONGEST_SLEEP:
            timeout = _LONGEST_SLEEP
        if self._released:  # nothing left to read: a waiter is answered by another thread
            time.sleep(0.01 if timeout is None else min(timeout, 0.01))
            return False
        if self._posted or self._tasks:
            self._take_posted()
            timeout = 0
        if self._epoll:
            wait = -1 if timeout is None else timeout
        elif timeout is None:
            wait = None
        else:
            wait = int(timeout * 1000) + 1 if timeout > 0 else 0
        try:
            events = self._poll(wait)
        except InterruptedError:  # pragma: no cover
            return False
        read = False
        route_events = self._route_events
        now = _monotonic()
        try:
            if route_events is not None and events:  # the routers' lone answers (see watch)
                if self._carried:
                    events, self._carried = self._carried + events, []
                events, read = route_events(events, self._by_fd)
            for fd, _ in events:
                if fd == self._wakeup_fd:
                    self._wakeup.drain()
                    self._take_posted()
                    continue
                watched = self._by_fd.get(fd)
                if watched is None:
                    continue
                read = True
                channel, fast = watched
                received: Received
                if fast is None:
                    received = channel.receive(fd)
                else:
                    try:
                        received = fast()
                    except ConnectionLost:  # the stream's end: its channel's to handle
                        received = channel.receive(fd)
                if isinstance(received, tuple):  # one event alone, a header and a pickle
                    # an answer is routed here (_on_events' hot path, inlined: nearly every
                    # read of the pump's); anything else goes the whole way
                    head, payload = received
                    try:
                        kind, call_id, rank = _ROUTE(head)
                    except struct.error:
                        kind = rank = -1
                    entry = self._by_rank.get(rank)
                    if kind == _RESULT and entry is not None and entry.channel is channel:
                        entry.heard_at = now
                        future = entry.calls.pop(call_id, None)
                        if future is None and entry.cohorts:
                            future = entry.cohort_call(call_id)
                        if future is not None:
                            future.resolve_rank(rank, payload)
                        continue
                    received = [[head, payload]]
                if received:
                    self._on_events(channel, received)
        except BaseException:
            if route_events is not None:
                self._carry(events)
            raise
        if self._tasks:  # what reading just now asked for (a node lost: calls to fail)
            self._take_posted()
        if self._followers:
            with self._cond:
                self._cond.notify_all()
        return read

    def _carry(self, events: list[tuple[int, int]]) -> None:
        """An error went up through the pump before it took all the reads the routers made
        (:func:`~phalanx.controller._hotpath.route_events`): their events are kept for the
        next pump, woken now (those reads' bytes left their pipes: no poll reports them
        again)."""
        by_fd = self._by_fd
        held = [event for event in events if (watched := by_fd.get(event[0])) is not None
                and getattr(watched[1], "holds", False)]
        if held:
            self._carried = held + self._carried
            self._wakeup.wake()

    def _take_posted(self) -> None:
        with self._posted_lock:
            posted, self._posted = self._posted, []
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                task()
            except Exception:  # a bug: the pump must go on
                logger.exception("a task on the dispatcher failed")
        for channel, events in posted:
            self._on_events(channel, events)

    # -- events -----------------------------------------------------------------------

    def _on_events(self, channel: Receiver, events: list[list[Any]]) -> None:
        by_rank = self._by_rank
        now = _monotonic()
        for segs in events:
            first = segs[0]
            try:
                kind, call_id, rank = _ROUTE(first)
            except struct.error:
                self._broke(channel, f"it sent a malformed message header ({len(first)} "
                            "bytes)")
                return
            entry = by_rank.get(rank)
            if entry is None or entry.channel is not channel:
                if not self._stray(channel, segs, kind, rank):
                    return  # the channel's rank broke the protocol: nothing more of it
                continue
            entry.heard_at = now
            if kind == _RESULT:  # the hot path
                future = entry.calls.pop(call_id, None)
                if future is None and entry.cohorts:
                    future = entry.cohort_call(call_id)
                if future is not None:
                    # one pickle (nearly every answer): its bytes alone, in no container
                    # for the collector to track -- a future keeps its answer until its
                    # result is taken, and pipelined calls keep thousands of futures
                    future.resolve_rank(rank, segs[1] if len(segs) == 2 else segs[1:])
            elif kind == _YIELD:  # an item of a streamed call; RESULT ends the stream
                future = entry.calls.get(call_id)
                if future is not None:
                    future.yield_rank(rank, segs[1:])
            elif kind == _HEARTBEAT:
                pass
            else:
                try:
                    extra = protocol.parse(first)[3]
                except Exception as exc:  # noqa: BLE001 - a header that does not parse raises anything
                    self._broke(channel, f"it sent a malformed message header "
                                f"({type(exc).__name__})")
                    return
                problem = _misshapen(kind, extra)
                if problem is not None:
                    self._broke(channel, problem)
                    return
                self._on_control(entry, kind, call_id, extra)

    def _stray(self, channel: Receiver, segs: list[Any], kind: int, rank: int) -> bool:
        """A frame naming a rank that is not routed to ``channel``: an earlier
        incarnation's last words (dropped), a message for several ranks, or the channel's
        rank speaking as another; False when it broke the protocol so (it is ended)."""
        carried = getattr(channel, "ranks", None)  # a channel's (every one carries one)
        if rank != protocol.MANY:
            if carried is None or rank in carried:
                return True  # its rank was replaced or removed: its last words
            what = "an answer" if kind in (_RESULT, _YIELD, protocol.ERROR) else "a message"
            self._broke(channel, f"it sent {what} as rank {rank}")
            return False
        try:
            kind, call_id, ranks, extra = protocol.parse(segs[0])
        except Exception as exc:  # noqa: BLE001 - a header that does not parse raises anything
            self._broke(channel, f"it sent a malformed message header ({type(exc).__name__})")
            return False
        if carried is not None and not set(ranks) <= set(carried):
            self._broke(channel, f"it sent a message as ranks {sorted(ranks)[:8]}")
            return False
        for named in ranks:  # a message naming several ranks: handled once for each
            entry = self._by_rank.get(named)
            if entry is not None and entry.channel is channel:
                self._on_control(entry, kind, call_id, extra)
        return True

    def _broke(self, channel: Receiver, why: str) -> None:
        """The rank of ``channel`` broke the protocol (``why``): it is ended, and its calls
        fail saying so -- its death recorded first, as the watchdog records a silent
        rank's, so that the exit status that follows the kill only adds to it."""
        carried: tuple[int, ...] = getattr(channel, "ranks", ())
        entry = self._by_rank.get(carried[0]) if len(carried) == 1 else None
        if entry is None or entry.channel is not channel or not entry.alive:
            logger.warning("dropped what a retired rank's channel sent: %s", why)
            return  # a retired incarnation's: its process is being stopped already
        reason = f"rank {entry.rank} broke the protocol: {why} (ended by the controller)"
        logger.warning("ending rank %d of group %s: it broke the protocol: %s", entry.rank,
                       self.group_name, why)
        self._on_control(entry, protocol.EXITED, 0, (ProcessFailure(
            entry.rank, entry.node, entry.pid, None, reason=reason).as_dict(),))
        # from a thread: a signal may wait for an answer (Ray's goes through the warden)
        threading.Thread(target=entry.channel.signal, args=(entry.rank, signal.SIGKILL),
                         name="phalanx-end-rank", daemon=True).start()

    def _on_control(self, entry: RankEntry, kind: int, call_id: int,
                    extra: tuple[Any, ...]) -> None:
        if kind == protocol.ERROR:
            future = entry.calls.pop(call_id, None)
            if future is None and entry.cohorts:
                future = entry.cohort_call(call_id)
            if future is not None:
                remote = RemoteFailure(*extra[0])
                if remote.exc_type == "ObjectLost":  # a kept result it needed is gone
                    future.fail_rank(entry.rank, ObjectLost(
                        f"{remote.message} (for {future.method}() on "
                        f"{rank_text(entry.rank, self.group_name)})"))
                    return
                error = WorkerError(
                    remote, rank=entry.rank, node=entry.node, pid=entry.pid,
                    method=future.method, group=self.group_name,
                )
                future.fail_rank(entry.rank, chain_remote(error, remote))
        elif kind == protocol.READY:
            entry.became_ready(*extra)
        elif kind == protocol.INIT_ERROR:
            entry.failed_to_start(RemoteFailure(*extra[0]))
        elif kind == protocol.RELEASED:
            if self._on_released is not None:
                self._on_released(entry.channel, extra[0])
        elif kind == protocol.COLLECTIVE:  # judged by phalanx.controller.collectivewatch
            entry.collectives = (extra[0], extra[1])
            self.collective_reporters.add(entry)
        elif kind == protocol.EXITED:
            failure = ProcessFailure.from_dict(extra[0])
            if failure.pid is None and entry.pid is not None:
                failure = dataclasses.replace(failure, pid=entry.pid)
            if not entry.alive:  # a fuller account of a death already reported
                entry.add_account(failure)
                return
            self.bury(entry, failure)
            if self._on_death is not None:
                self._on_death(entry)
        else:
            self._broke(entry.channel, f"it sent a message of kind {kind}, which no rank sends")

    # -- death ------------------------------------------------------------------------

    def bury(self, entry: RankEntry, failure: ProcessFailure) -> None:
        """Record how an entry's process ended and fail every call pending on it: the one
        routine for a dead rank (an EXITED event, a node lost, a rank stopped)."""
        entry.exited(failure)  # .failure set first: senders that see it dead fail on their own
        self.deaths += 1
        for future in entry.take_pending():
            future.fail_rank(entry.rank, death_error(failure, future.method,
                                                    group=self.group_name))

    def fail_if_dead(self, entry: RankEntry, call_id: int, future: Completion) -> None:
        """Close the race between sending to an entry and its death being processed: a call
        sent to a rank known dead by then fails as sent too late."""
        if not entry.alive:
            entry.calls.pop(call_id, None)
            failure = entry.failure
            future.fail_rank(entry.rank, death_error(failure, future.method,  # type: ignore[arg-type]
                                                    before_sent=True, group=self.group_name))

    def fail_dead_in(self, cohort: Cohort, call_id: int, future: Call) -> None:
        """:meth:`fail_if_dead` for a call registered on ``cohort``, once a death was
        processed while it was sent: each rank of it known dead fails as sent too late."""
        for i, entry in enumerate(cohort.entries):
            if not entry.alive and cohort.owes(call_id, future, i):
                future.fail_rank(entry.rank, death_error(
                    entry.failure, future.method,  # type: ignore[arg-type]
                    before_sent=True, group=self.group_name))

    def remove(self, entry: RankEntry) -> None:
        """Stop routing the rank's events to ``entry`` (it is being replaced or stopped)."""
        self.deaths += 1
        if self._by_rank.get(entry.rank) is entry:
            del self._by_rank[entry.rank]
        self._wakeup.wake()

    def close(
        self, error_factory: Callable[[str, int], BaseException], entries: list[RankEntry]
    ) -> None:
        """Fail every pending call (e.g. with GroupClosed) and stop watching all entries."""
        for entry in entries:
            if self._by_rank.get(entry.rank) is entry:
                del self._by_rank[entry.rank]
            for future in entry.take_pending():
                future.fail_rank(entry.rank, error_factory(future.method, entry.rank))
        self._wakeup.wake()
        with self._cond:
            self._cond.notify_all()

    def wake_waiters(self) -> None:
        """Wake the threads waiting on futures: calls were failed from another thread."""
        self._wakeup.wake()
        with self._cond:
            self._cond.notify_all()

    def release(self) -> None:
        # Let a leader finish its last poll (close() woke it) before the fds go away.
        got = self._lead.acquire(timeout=5.0)
        with self._posted_lock:
            self._released = True
            self._posted = []
            self._tasks = []
        if got:
            self._lead.release()
        close = getattr(self._poller, "close", None)  # an epoll has one (a poll: none)
        if close is not None:
            close()
        self._wakeup.close()
