"""``group.trace()`` and ``px.trace(*groups)``: every call of some groups, on every rank, as
a picture (the Chrome trace event format: :mod:`phalanx.output.timeline`).

While a trace is open it watches each group's calls (:mod:`phalanx.controller.observe`):
the controller stamps when each call was made, sent, and answered by each rank, with the
bytes each way and the errors; the ranks record when they began and answered each call
(:mod:`phalanx.rank.tracing`), and hand those spans over once, when the trace ends (one
built-in call per group, within ``timeout``). A rank that is dead by then, or too busy to
answer in time, is drawn as the controller saw it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from phalanx.controller.internals import internals
from phalanx.controller.observe import CallWatch, clock
from phalanx.errors import PhalanxError
from phalanx.options import check_seconds
from phalanx.output import timeline

if TYPE_CHECKING:
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.ranks import RankEntry

logger = logging.getLogger(__name__)

SPANS_TIMEOUT = 10.0  # s: how long the end of a trace waits for the ranks' spans

_open: weakref.WeakSet[Trace] = weakref.WeakSet()  # traces started and not yet stopped


class Trace:
    """The calls of some groups while it is open (see the module docstring).

    A context manager (``with group.trace() as t:``), or :meth:`start` and :meth:`stop`.
    After it ends: :meth:`save` writes the Chrome trace event format (open it in
    https://ui.perfetto.dev or ``chrome://tracing``), :meth:`events` gives it as a dict,
    :attr:`calls` the calls recorded.
    """

    spans = True  # its ranks record when they ran each call (Sender.observe)

    def __init__(self, *groups: WorkerGroup, timeout: float = SPANS_TIMEOUT) -> None:
        if not groups:
            raise ValueError("px.trace() needs at least one group to trace")
        for group in groups:
            try:
                internals(group)
            except TypeError:
                raise TypeError(f"px.trace() traces WorkerGroups, got "
                                f"{type(group).__name__}") from None
        if len({id(g) for g in groups}) != len(groups):
            raise ValueError("px.trace(): a group is named twice")
        self._timeout = check_seconds(timeout, "trace timeout", allow_zero=False)
        self._groups = list(groups)
        self._lock = threading.Lock()
        # Calls still out, by watch, and finished ones as plain tuples of numbers, text and
        # tuples of them (_packed): the garbage collector stops tracking those (not a
        # watch, a dict or a named tuple), and a trace holding a million calls would
        # otherwise slow every collection of the process down, every group's calls with it.
        self._out: dict[CallWatch, None] = {}
        self._done: list[tuple[Any, ...]] = []
        self._first: dict[str, int] = {}  # group -> the id of its first call traced
        self._deaths: list[timeline.Death] = []
        self._spans: dict[tuple[str, int], list[tuple[Any, ...]]] = {}  # Span fields
        self._lanes: list[timeline.Lane] = []
        self._lost: dict[str, int] = {}  # group/rank -> spans a rank could not keep or give
        self.began: float | None = None
        self.ended: float | None = None

    # -- recording ------------------------------------------------------------------

    def start(self) -> Trace:
        """Begin watching the groups' calls (once)."""
        if self.began is not None:
            raise RuntimeError("this trace was started already; make a new one")
        for group in self._groups:
            if group.closed:
                raise PhalanxError(f"group {group.name} is shut down: nothing to trace")
        self.began = clock()
        _open.add(self)
        for group in self._groups:
            internals(group).watch_calls(self)
        return self

    def stop(self) -> Trace:
        """Stop watching, and gather the ranks' spans (idempotent)."""
        if self.began is None or self.ended is not None:
            return self
        for group in self._groups:
            internals(group).watch_calls(self, on=False)
        _open.discard(self)
        self.ended = clock()
        for group in self._groups:
            self._gather(group)
        return self

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # what the groups tell it (Observer) ------------------------------------------------

    def started(self, call: CallWatch) -> None:
        self._out[call] = None
        if call.group not in self._first:
            self._first[call.group] = call.call_id

    def finished(self, call: CallWatch) -> None:
        if self._out.pop(call, False) is None:  # not one made before the trace began
            self._done.append(_packed(call))

    def died(self, group: str, entry: RankEntry) -> None:
        cause = entry.failure.cause if entry.failure is not None else "its process ended"
        with self._lock:
            self._deaths.append(timeline.Death(group, entry.rank, clock(), cause))

    def first_call(self, group: str) -> int | None:
        """The id of the first call of ``group`` this trace saw (None: none yet)."""
        return self._first.get(group)

    def _gather(self, group: WorkerGroup) -> None:
        """Every rank's spans of ``group`` and its lanes' labels; what cannot be had is
        logged and drawn as the controller saw it."""
        health = group.health() if not group.closed else []
        for h in health:
            self._lanes.append(timeline.Lane(group.name, h.rank, h.node, h.pid))
        traced = {r for c in self.calls if c.group == group.name for r in c.ranks}
        known = {h.rank for h in health}
        self._lanes.extend(timeline.Lane(group.name, r, None, None)
                           for r in sorted(traced - known))
        live = [h.rank for h in health if h.alive and h.rank in traced]
        if not live:
            return
        # the spans of this trace's calls; those of another trace still open stay there
        since = self._first.get(group.name, 0)
        others = [first for t in list(_open) if (first := t.first_call(group.name)) is not None]
        keep_from = min(others) if others else None
        try:
            future = internals(group).send_builtin("@trace", live, [(since, keep_from)] * len(live),
                                        watched=False)
        except PhalanxError as exc:
            logger.warning("trace: could not ask group %s for its ranks' spans: %s",
                           group.name, exc)
            return
        deadline = time.monotonic() + (self._timeout or SPANS_TIMEOUT)
        for rank, part in zip(live, future.futures, strict=True):
            try:
                got = part.result(timeout=max(0.0, deadline - time.monotonic()))
            except PhalanxError as exc:
                logger.warning("trace: rank %d of group %s gave no spans (%s); its calls "
                               "are drawn as the controller saw them", rank, group.name,
                               type(exc).__name__)
                continue
            self._spans[(group.name, rank)] = [tuple(s) for s in got["spans"]]  # see _out
            if got["lost"]:
                self._lost[f"{group.name}/{rank}"] = got["lost"]

    # -- the result -----------------------------------------------------------------

    @property
    def calls(self) -> list[timeline.CallTimes]:
        """The calls recorded, in the order they were made: when each was made, sent and
        answered by each rank, its errors and bytes."""
        calls = [_unpacked(c) for c in list(self._done)]
        calls += [_times(c) for c in list(self._out)]
        calls.sort(key=lambda c: c.queued)
        return calls

    def events(self) -> dict[str, Any]:
        """The trace in the Chrome trace event format, as a JSON-ready dict."""
        if self.began is None:
            raise RuntimeError("this trace was never started")
        until = clock() if self.ended is None else self.ended
        calls = self.calls
        with self._lock:
            deaths = list(self._deaths)
        meta: dict[str, Any] = {"groups": [g.name for g in self._groups],
                                "calls": len(calls), "began": self.began}
        if self._lost:
            meta["spans_lost"] = dict(self._lost)
        spans = {key: [timeline.Span._make(s) for s in of_rank]
                 for key, of_rank in self._spans.items()}
        return timeline.chrome_trace(calls, spans, self._lanes, deaths,
                                     origin=self.began, until=until, metadata=meta)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the trace as a Chrome trace JSON file (ends the trace first); returns the
        path. Open it in https://ui.perfetto.dev (Open trace file) or ``chrome://tracing``."""
        self.stop()
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.events(), out, separators=(",", ":"))
        return path

    def __repr__(self) -> str:
        state = ("not started" if self.began is None else
                 "recording" if self.ended is None else "ended")
        names = ", ".join(g.name for g in self._groups)
        return f"<Trace of {names}: {len(self._done) + len(self._out)} calls, {state}>"


def _times(call: CallWatch) -> timeline.CallTimes:
    return timeline.CallTimes(call.group, call.call_id, call.method, tuple(call.ranks),
                              call.queued, call.sent, dict(call.answered), dict(call.errors),
                              call.bytes_in, call.bytes_out)


def _packed(call: CallWatch) -> tuple[Any, ...]:
    return (call.group, call.call_id, call.method, tuple(call.ranks), call.queued, call.sent,
            tuple(call.answered.items()), tuple(call.errors.items()) if call.errors else (),
            call.bytes_in, call.bytes_out)


def _unpacked(fields: tuple[Any, ...]) -> timeline.CallTimes:
    group, call_id, method, ranks, queued, sent, answered, errors, sent_bytes, got = fields
    return timeline.CallTimes(group, call_id, method, ranks, queued, sent, dict(answered),
                              dict(errors), sent_bytes, got)


def trace(*groups: WorkerGroup, timeout: float = SPANS_TIMEOUT) -> Trace:
    """Record every call of ``groups`` on every rank while the block runs::

        with px.trace(trainer, generator) as t:
            step()
        t.save("step.json")   # open in https://ui.perfetto.dev

    ``timeout``: how long the end of the trace waits for the ranks' own spans.
    """
    return Trace(*groups, timeout=timeout)
