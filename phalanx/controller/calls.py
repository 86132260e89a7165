"""The one place a call is encoded and sent: arguments to payloads, payloads to frames,
frames to the ranks' channels, and the future that gathers the answers.

A payload is the pickle of ``(args, kwargs)`` and its out-of-band buffers, made once per
distinct set of arguments (``call`` pickles once for every rank; ``map`` once per rank).
Encoding returns the handles the arguments name with their pickle
(:class:`~phalanx.controller.shared.Encoded`: a plain list when they name none); a call
whose arguments name handles, or carry large buffers, goes through
:meth:`SharedObjects.prepare <phalanx.controller.shared.SharedObjects.prepare>` first.
A call is registered on each entry's ``pending`` table before its frame goes out, so
that an answer (or the rank's death) always finds it.

A call's frames go out as it is made, a synchronous call's too (deferring those to the
first wait, for nothing to stand between the last send and sleeping, saved no time once
ranks ran as ``SCHED_BATCH`` and cost the controller a hop per call). A call made with
``defer`` (what composes several calls before any is sent: weight syncs, the internals'
builtin calls) is sent at its future's first wait (see
:meth:`Dispatcher.wait <phalanx.controller.dispatch.Dispatcher.wait>`). When several ranks
share one link (an agent's connection), the same payload crosses it once, addressed to all
of them.

A call of one payload to many ranks on shared links costs the controller per link, not per
rank: the ranks' entries, grouped by link with each link's rank field packed, are a
:class:`~phalanx.controller.ranks.Cohort` made once and kept while no rank dies and none is
placed anew (the rank table's ``version`` and the dispatcher's ``deaths``), and the call is
registered on the cohort once. A death processed while such a call is sent fails that
rank's part of it as sent too late, as for a call registered rank by rank. Calls that are
watched (traces, metrics), streamed or kept go rank by rank, as before.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import TYPE_CHECKING, Any

from phalanx.backends.held import NodeAddress
from phalanx.controller.compiled import hotpath
from phalanx.controller.futures import Call, StreamCall
from phalanx.controller.kept import KeptFuture, KeptResults
from phalanx.controller.observe import CallWatch, nbytes
from phalanx.controller.ranks import Cohort
from phalanx.controller.shared import Encoded, Payload, met
from phalanx.errors import ObjectFreed, ObjectLost, SerializationError
from phalanx.wire import pickling, protocol

_clock = time.monotonic
_POLL_EVERY = 0.001  # s: a death older than this is known before the next call goes out
_SMALL = protocol.SMALL_PAYLOAD  # a pickle framed with its header in one bytes object
_NO_ARGUMENTS = pickling.NO_ARGUMENTS
_send_small = None if hotpath is None else hotpath.send_small  # (see send_plain)
_COHORTS_KEPT = 8  # cohorts of rank selections other than the last one used

if TYPE_CHECKING:
    from collections.abc import Callable

    from phalanx.backends.base import Backend, Channel
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import Completion, GroupFuture
    from phalanx.controller.observe import Observer
    from phalanx.controller.ranks import RankTable
    from phalanx.controller.shared import SharedObjects
    from phalanx.world.selection import Workers


class Sender:
    """Encodes and sends one group's calls; owns the call ids.

    Interface: :meth:`encode` (arguments to a payload) and :meth:`send` (payloads to the
    ranks, returning the call's future).
    """

    def __init__(self, table: RankTable, dispatcher: Dispatcher, shared: SharedObjects,
                 backend: Backend) -> None:
        self._entries = table.entries  # the same list for the group's life
        self._table = table
        self._dispatcher = dispatcher
        self._fail_if_dead = dispatcher.fail_if_dead
        self._shared = shared
        parts = backend.capabilities
        self._copier = parts.kept_copies
        self._shared_links = parts.shared_links
        self._call_ids = itertools.count(1)
        self._kept: KeptResults | None = None  # the group's, once it made them (keeps_in)
        self._polled = 0.0  # when send() last polled for deaths already in
        # what watches every call (phalanx.controller.observe); traced: one of them asks
        # the ranks when they ran each call
        self.observers: tuple[Observer, ...] = ()
        self._traced = False
        self._cohort: Cohort | None = None  # the last one a call went to
        self._cohorts: dict[tuple[int, ...], Cohort] = {}  # by their ranks

    def number_calls_from(self, first: int) -> None:
        """Number this group's calls from ``first`` on: a controller attaching to a
        detached group takes numbers above any the ranks and nodes knew (kept results
        and unanswered calls are known by their call's number)."""
        self._call_ids = itertools.count(first)

    def observe(self, observer: Observer, on: bool = True) -> None:
        """Have ``observer`` watch every call sent from now on (``on=False``: no more)."""
        others = tuple(o for o in self.observers if o is not observer)
        self.observers = (*others, observer) if on else others
        self._traced = any(getattr(o, "spans", False) for o in self.observers)

    def keeps_in(self, kept: KeptResults) -> None:
        """``keep=True`` calls' results go to ``kept`` (the group's part)."""
        self._kept = kept

    def source_of(self, rank: int) -> NodeAddress | None:
        """Where other nodes fetch what ``rank`` keeps (None: they read it where it is)."""
        entry = self._entries[rank]
        if self._copier is None or entry is None or entry.channel is None:
            return None
        return self._copier.source_of(entry.channel)

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any],
               rank: int | None = None) -> Payload:
        """The payload of ``(args, kwargs)`` (``rank``: the one it is for, for messages)."""
        if not args and not kwargs:  # a method called without arguments: nothing to pickle
            return [_NO_ARGUMENTS]
        plain = pickling.dumps_plain((args, kwargs))
        if plain is not None:
            return plain
        try:
            return self._shared.encode((args, kwargs))
        except (ObjectFreed, ObjectLost):
            raise
        except Exception as exc:
            where = "" if rank is None else f" for rank {rank}"
            raise SerializationError(
                f"could not pickle the arguments{where}: {type(exc).__name__}: {exc}; "
                "nothing was sent",
                stage="pickling the arguments",
                rank=rank,
            ) from exc

    def send(
        self,
        method: str,
        ranks: list[int],
        payloads: list[Payload],
        *,
        defer: bool = False,
        stream: bool = False,
        workers: Workers = "all",
        keep: bool = False,
        timeout: float | None = None,
        watched: bool = True,
        builtin: bool = False,
    ) -> Any:
        """Register a call's futures and send it: one payload for every rank, or one per
        rank (``defer``: at the future's first wait; ``stream``: the workers stream items
        back, a :class:`StreamFuture` waiting up to ``timeout`` for each; ``workers``: the
        selection it was made with; ``keep``: the results stay on the ranks, handles come
        back; ``watched``: False keeps phalanx's own housekeeping out of traces and
        metrics; ``builtin``: a call the rank runtime serves itself). The future: a
        :class:`GroupFuture`, or its kind for ``stream`` / ``keep``."""
        # Learn of deaths that already happened: a rank found dead now fails this call as
        # "already dead when it was sent", not "died while running it". At most one poll
        # per _POLL_EVERY: one per call cost a quarter of W3's pipelined throughput.
        now = _clock()
        if now - self._polled > _POLL_EVERY:
            self._polled = now
            self._dispatcher.poll_now()
        call_id = next(self._call_ids)
        flags = protocol.BUILTIN if builtin else 0
        tolerant = type(workers) is str and workers in ("ready", "any")
        if stream:
            future: Call = StreamCall(method, ranks, self._dispatcher, tolerant,
                                               timeout, self._kept)
        elif keep:
            if self._kept is None:  # pragma: no cover - the group sets it at once
                raise RuntimeError("keep=True before the group's kept results were made")
            future = KeptFuture(method, ranks, self._dispatcher, tolerant, self._kept,
                                call_id)
            flags |= protocol.KEEP  # the rank keeps the result (phalanx.rank.kept)
        else:
            future = Call(method, ranks, self._dispatcher, tolerant, self._kept)
        if payloads and (len(payloads[0]) > 1 or type(payloads[0]) is Encoded or (
                len(payloads) > 1 and any(type(p) is Encoded for p in payloads))):
            segments = self._shared.prepare(future, payloads, met(payloads),
                                            lambda: self._channels(ranks))
        else:
            segments = payloads
        pending: Completion = future  # what the ranks' pending tables hold
        watch = None
        if self.observers and watched:
            watch = pending = CallWatch(
                future, self._dispatcher.group_name or "", call_id, ranks,
                nbytes(segments[0]) * len(ranks) if len(segments) == 1
                else sum(nbytes(p) for p in segments), self.observers, self._traced)
            if self._traced:
                flags |= protocol.TRACED  # the ranks record when they ran it
        # one frame per node connection (an agent's), whatever its number of ranks
        shared = len(segments) == 1 and len(ranks) > 1 and self._shared_links
        if not defer and watch is None:  # sent now, the usual async call: no partial
            if shared:
                self._deliver_shared(call_id, ranks, pending, method, segments[0], stream,
                                     flags)
            else:
                frames = protocol.call_frames(call_id, ranks, method, segments, stream, flags)
                self._deliver(call_id, ranks, pending, frames)
            return future
        deliver: Callable[[], None]
        if shared:
            deliver = functools.partial(self._deliver_shared, call_id, ranks, pending,
                                        method, segments[0], stream, flags)
        else:
            frames = protocol.call_frames(call_id, ranks, method, segments, stream, flags)
            deliver = functools.partial(self._deliver, call_id, ranks, pending, frames)
        if defer:
            future.defer(deliver if watch is None else watch.sending(deliver))
        else:
            if watch is not None:
                watch.sent = watch.queued  # sent now: no stamp of its own to take
            deliver()
        return future

    def send_plain(self, method: str, ranks: list[int], payload: Payload,
                   workers: Workers, keep: bool = False) -> GroupFuture:
        """:meth:`send` of one payload for every rank, not streamed, sent now. The path of
        ``call`` and ``call_async``: the usual call (its result returned, not kept; no
        observer; a small plain pickle) is told apart by one test, and its frames are made
        without the general path's steps (a tenth of the controller's CPU per call where
        calls are pipelined); any other goes through :meth:`send`."""
        if (keep or self.observers or type(payload) is not list or len(payload) != 1
                or type(payload[0]) is not bytes or len(payload[0]) >= _SMALL
                or (self._shared_links and len(ranks) > 1)):
            return self.send(method, ranks, [payload], workers=workers,  # type: ignore[no-any-return]
                             keep=keep)
        now = _clock()
        if now - self._polled > _POLL_EVERY:  # as send(): deaths already in, first
            self._polled = now
            self._dispatcher.poll_now()
        call_id = next(self._call_ids)
        future = Call(method, ranks, self._dispatcher,
                      type(workers) is str and workers in ("ready", "any"), self._kept)
        if _send_small is not None:  # _deliver of small_call_frames, compiled
            _send_small(self._entries, ranks, call_id, future,
                        *protocol.small_call_parts(method, payload[0]), self._fail_if_dead)
        else:
            self._deliver(call_id, ranks, future,
                          protocol.small_call_frames(call_id, ranks, method, payload[0]))
        return future

    def _channels(self, ranks: list[int]) -> list[Channel]:
        """The channels of those of ``ranks`` that have one (where a call's kept results
        must be readable)."""
        entries = self._entries
        return [s.channel for s in (entries[r] for r in ranks)
                if s is not None and s.channel is not None]

    def _deliver(
        self, call_id: int, ranks: list[int], future: Completion, frames: list[list[Any]]
    ) -> None:
        entries = self._entries
        for rank, frame in zip(ranks, frames, strict=False):  # (one frame per rank)
            entry = entries[rank]
            entry.calls[call_id] = future  # type: ignore[union-attr]
            entry.send(frame)  # type: ignore[union-attr]
            if not entry.alive:  # type: ignore[union-attr]
                self._fail_if_dead(entry, call_id, future)  # type: ignore[arg-type]

    def _deliver_shared(self, call_id: int, ranks: list[int], future: Completion,
                        method: str, payload: list[Any], stream: bool, flags: int) -> None:
        """The same payload to ``ranks``: once per link shared by several of them."""
        if not stream and type(future) is Call:
            cohort = self._cohort_for(ranks)
            if cohort is not None:
                self._deliver_cohort(cohort, call_id, future, method, payload, flags)
                return
        entries = self._entries
        by_link: dict[Any, list[int]] = {}
        for rank in ranks:
            by_link.setdefault(entries[rank].channel.link, []).append(rank)  # type: ignore[union-attr]
        for link, on_link in by_link.items():
            if link is None or len(on_link) == 1:
                frames = protocol.call_frames(call_id, on_link, method, [payload], stream,
                                              flags)
                self._deliver(call_id, on_link, future, frames)
                continue
            for rank in on_link:
                entries[rank].calls[call_id] = future  # type: ignore[union-attr]
            link.send(protocol.call_frame(call_id, on_link, method, payload, stream, flags))
            for rank in on_link:
                entry = entries[rank]
                if not entry.alive:  # type: ignore[union-attr]
                    self._fail_if_dead(entry, call_id, future)  # type: ignore[arg-type]

    def _deliver_cohort(self, cohort: Cohort, call_id: int, future: Call, method: str,
                        payload: list[Any], flags: int) -> None:
        """The same payload to every rank of ``cohort``: registered once, sent once per
        link, each frame's rank field packed already."""
        deaths = cohort.version[1]
        future.fan_out(cohort, call_id)
        cohort.calls[call_id] = future  # before its frames go: an answer must find it
        frame_to = protocol.call_frame_to
        for link, part in cohort.sends:
            link.send(frame_to(call_id, part, method, payload, flags))
        if self._dispatcher.deaths != deaths:  # a death processed meanwhile: sent too late?
            self._dispatcher.fail_dead_in(cohort, call_id, future)

    def _cohort_for(self, ranks: list[int]) -> Cohort | None:
        """The cohort of ``ranks``, current (made anew when a rank died or was placed since
        it was made); None when one of them is not running, or not on a link."""
        version = (self._table.version, self._dispatcher.deaths)
        cohort = self._cohort
        if cohort is not None and cohort.ranks is ranks and cohort.version == version:
            return cohort
        key = tuple(ranks)
        cohort = self._cohorts.get(key)
        if cohort is not None:
            del self._cohorts[key]
            if cohort.version == version:
                self._cohorts[key] = self._cohort = cohort  # the most recently used: last
                return cohort
            cohort.retire()
        entries = self._entries
        called = [entries[r] for r in ranks]
        links: list[Any] = []
        for entry in called:
            if entry is None or not entry.alive or entry.channel is None:
                return None
            link = getattr(entry.channel, "link", None)
            if link is None:
                return None
            links.append(link)
        cohort = Cohort(ranks, called, version)  # type: ignore[arg-type]
        runs: dict[Any, list[int]] = {}  # link -> its places
        for i, link in enumerate(links):
            runs.setdefault(link, []).append(i)
        sends: list[tuple[Any, bytes]] = []
        for link, places in runs.items():
            sends.append((link, protocol.ranks_part([ranks[i] for i in places])))
            if places[-1] - places[0] == len(places) - 1:  # a run: its answers come as one
                cohort.add_part(link, places[0], places[-1] + 1)
        cohort.sends = sends
        if len(self._cohorts) >= _COHORTS_KEPT:
            oldest = self._cohorts.pop(next(iter(self._cohorts)))
            oldest.retire()  # its calls in flight still find it; new ones will not
        self._cohorts[key] = self._cohort = cohort
        return cohort
