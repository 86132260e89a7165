"""A trace of calls as the Chrome trace event format, which Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open (pure: no I/O).

The picture: one process per group, with one lane (a "thread") per rank, and one event per
call per rank on it, from when the rank began the call to when it sent its answer; a
process "controller" with one lane per group, where each call is a slice from when it was
made to when its last answer arrived (an async slice: pipelined calls overlap). A rank's
death is a mark on its lane. Times are in microseconds from the trace's start.

The ranks' spans are on their own machines' clocks. Each rank's clock is taken as the
controller's, unless that would have the rank begin a call before it was sent or answer
after the answer arrived; then it is moved by the least offset that keeps every call of
that rank inside its round trip (:func:`clock_offset`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

CONTROLLER_PID = 0


class CallTimes(NamedTuple):
    """One call as the controller saw it (wall-clock seconds)."""

    group: str
    call_id: int
    method: str
    ranks: Sequence[int]
    queued: float  # when it was made
    sent: float | None  # when its frames went out (None: never)
    answered: Mapping[int, float]  # rank -> when its answer (or failure) arrived
    errors: Mapping[int, str]  # rank -> what it failed with
    bytes_in: int
    bytes_out: int


class Span(NamedTuple):
    """One call as a rank ran it (that rank's wall clock, seconds)."""

    call_id: int
    began: float
    answered: float
    failed: bool


class Death(NamedTuple):
    group: str
    rank: int
    at: float  # when the controller learnt of it
    cause: str


class Lane(NamedTuple):
    """A rank's lane: what its label says."""

    group: str
    rank: int
    node: int | None
    pid: int | None


def clock_offset(pairs: Iterable[tuple[float, float, float, float]]) -> float:
    """How far a rank's clock is ahead of the controller's, from ``(sent, began, answered,
    received)`` of its calls: 0 when that is consistent with every call (a rank begins a
    call after it was sent and answers before its answer arrives), else the offset
    closest to 0 that is (the middle of the bounds, should they cross)."""
    low, high = float("-inf"), float("inf")
    for sent, began, answered, received in pairs:
        high = min(high, began - sent)  # began >= sent + offset
        low = max(low, answered - received)  # answered <= received + offset
    if low > high:  # clocks that drifted during the trace: the middle
        return (low + high) / 2
    return min(max(0.0, low), high)


def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 3)


def chrome_trace(calls: Sequence[CallTimes], spans: Mapping[tuple[str, int], Sequence[Span]],
                 lanes: Sequence[Lane], deaths: Sequence[Death] = (), *, origin: float,
                 until: float, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``); ``origin`` and
    ``until`` are the wall-clock times of its start (time 0) and end (where a call still
    unanswered stops), ``lanes`` the ranks to draw (with or without spans: a rank whose
    spans are missing gets the controller's view of its calls)."""
    groups = list(dict.fromkeys([lane.group for lane in lanes] + [c.group for c in calls]))
    pid_of = {group: i + 1 for i, group in enumerate(groups)}
    events: list[dict[str, Any]] = [
        _meta("process_name", CONTROLLER_PID, 0, "controller"),
        _meta("process_sort_index", CONTROLLER_PID, 0, sort_index=-1),
    ]
    for group in groups:
        pid = pid_of[group]
        events.append(_meta("process_name", pid, 0, f"group {group}"))
        events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        events.append(_meta("thread_name", CONTROLLER_PID, pid, f"{group} calls"))
    for lane in lanes:
        where = ", ".join(p for p in (None if lane.node is None else f"node {lane.node}",
                                      None if lane.pid is None else f"pid {lane.pid}") if p)
        name = f"rank {lane.rank}" + (f" ({where})" if where else "")
        events.append(_meta("thread_name", pid_of[lane.group], lane.rank, name))
        events.append(_meta("thread_sort_index", pid_of[lane.group], lane.rank,
                            sort_index=lane.rank))

    by_call = {key: {s.call_id: s for s in ss} for key, ss in spans.items()}
    offsets = {}
    for key, of_rank in by_call.items():
        group, rank = key
        offsets[key] = clock_offset(
            (c.sent, of_rank[c.call_id].began, of_rank[c.call_id].answered, c.answered[rank])
            for c in calls if c.group == group and c.call_id in of_rank
            and c.sent is not None and rank in c.answered)

    for call in calls:
        pid = pid_of[call.group]
        end = (max(call.answered.values()) if len(call.answered) == len(call.ranks)
               else None)  # still out on some rank: it runs to the trace's end
        args: dict[str, Any] = {"call": call.call_id, "ranks": _ranks_text(call.ranks),
                                "bytes_in": call.bytes_in, "bytes_out": call.bytes_out}
        if call.sent is not None:
            args["queued_ms"] = round((call.sent - call.queued) * 1e3, 3)
        if call.errors:
            args["errors"] = {str(r): e for r, e in sorted(call.errors.items())}
        if len(call.answered) < len(call.ranks):
            args["unanswered"] = _ranks_text([r for r in call.ranks if r not in call.answered])
        # an async slice: the calls of one group overlap when pipelined, and a lane's
        # complete events must nest
        ident = f"{pid}.{call.call_id}"
        events.append({"name": call.method, "cat": "call", "ph": "b", "id": ident,
                       "pid": CONTROLLER_PID, "tid": pid, "ts": _us(call.queued, origin),
                       "args": args})
        events.append({"name": call.method, "cat": "call", "ph": "e", "id": ident,
                       "pid": CONTROLLER_PID, "tid": pid,
                       "ts": _us(until if end is None else end, origin)})
        for rank in call.ranks:
            key = (call.group, rank)
            span = by_call.get(key, {}).get(call.call_id)
            received = call.answered.get(rank)
            error = call.errors.get(rank)
            rank_args: dict[str, Any] = {"call": call.call_id}
            if span is not None:
                offset = offsets[key]
                began, answered = span.began - offset, span.answered - offset
                rank_args["source"] = "rank"
                if call.sent is not None:
                    rank_args["send_ms"] = round((began - call.sent) * 1e3, 3)
                if received is not None:
                    rank_args["reply_ms"] = round((received - answered) * 1e3, 3)
            elif call.sent is not None and received is not None:
                # no span from the rank (it died, or never answered the trace): the
                # controller's view of its part, from the send to the answer's arrival
                began, answered = call.sent, received
                rank_args["source"] = "controller"
            else:
                continue
            if error is not None:
                rank_args["error"] = error
            events.append({"name": call.method, "cat": "error" if error else "call", "ph": "X",
                           "pid": pid, "tid": rank, "ts": _us(began, origin),
                           "dur": _us(answered, began), "args": rank_args})
    for death in deaths:
        events.append({"name": f"rank {death.rank} died", "cat": "death", "ph": "i", "s": "t",
                       "pid": pid_of.get(death.group, 0), "tid": death.rank,
                       "ts": _us(death.at, origin), "args": {"cause": death.cause}})
    other: dict[str, Any] = {"clock_offsets_us": {
        f"{g}/{r}": round(o * 1e6, 3) for (g, r), o in sorted(offsets.items()) if o}}
    other.update(metadata or {})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _meta(kind: str, pid: int, tid: int, name: str | None = None, *,
          sort_index: int | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"name": name} if name is not None else {"sort_index": sort_index}
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _ranks_text(ranks: Sequence[int]) -> str:
    """``0-3,5``: ranks as runs."""
    runs: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
