"""What a dashboard counts of every group's calls, and the Prometheus text it serves at
``/metrics`` (exposition format 0.0.4).

:class:`Metrics` watches every group while its dashboard is open (an observer:
:mod:`phalanx.controller.observe`): calls per group and method and how they ended, their
latency (made to last answer) as a histogram, the bytes sent and received, the deaths of
ranks; and it keeps each group's last calls for the dashboard's timeline. The rank states,
restarts and calls in flight are read from the groups when the page is scraped.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from phalanx.output.prometheus import Exposition, number

if TYPE_CHECKING:
    from phalanx.controller.observe import CallWatch
    from phalanx.controller.ranks import RankEntry
    from phalanx.controller.watch import RankHealth

# seconds: a no-op call is ~0.2 ms, a training step seconds to minutes
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0, 300.0)
RECENT_CALLS = 200  # per group, for the timeline
STATES = ("starting", "ready", "unresponsive", "dead")


class _Histogram:
    __slots__ = ("count", "counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last: above every bound
        self.total = 0.0
        self.count = 0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1  # le: bounds are inclusive
        self.total += seconds
        self.count += 1


class GroupCounts:
    """One group's counters (under :attr:`Metrics.lock`)."""

    def __init__(self) -> None:
        # (method, outcome) -> calls
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.latency: dict[str, _Histogram] = {}
        self.sent: collections.Counter[str] = collections.Counter()  # method -> bytes
        self.received: collections.Counter[str] = collections.Counter()
        self.deaths = 0
        self.recent: collections.deque[CallWatch] = collections.deque(maxlen=RECENT_CALLS)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def errors(self) -> int:
        return sum(n for (_, outcome), n in self.calls.items() if outcome == "error")


class Metrics:
    """The counts of every group a dashboard watches (an observer of their calls)."""

    spans = False  # the controller's view is enough: the ranks record nothing

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[str, GroupCounts] = {}

    def of(self, group: str) -> GroupCounts:
        counts = self.groups.get(group)
        if counts is None:
            counts = self.groups[group] = GroupCounts()
        return counts

    # -- Observer ---------------------------------------------------------------------

    def started(self, call: CallWatch) -> None:
        counts = self.groups.get(call.group)
        if counts is None:
            with self.lock:
                counts = self.of(call.group)
        counts.recent.append(call)  # a deque's append is atomic: no lock on every call

    def finished(self, call: CallWatch) -> None:
        # No lock: a group's calls finish on the thread pumping its events, one at a time,
        # and a scrape reading a count while it moves reads the one before or after.
        last = max(call.answered.values(), default=call.queued)
        counts = self.groups.get(call.group)
        if counts is None:
            with self.lock:
                counts = self.of(call.group)
        method = call.method
        counts.calls[(method, "error" if call.errors else "ok")] += 1
        histogram = counts.latency.get(method)
        if histogram is None:
            histogram = counts.latency[method] = _Histogram()
        histogram.add(max(0.0, last - call.queued))
        counts.sent[method] += call.bytes_in
        counts.received[method] += call.bytes_out

    def died(self, group: str, entry: RankEntry) -> None:
        with self.lock:
            self.of(group).deaths += 1

    # -- exposition -------------------------------------------------------------------

    def render(self, health: Iterable[tuple[str, Sequence[RankHealth]]]) -> str:
        """The Prometheus text of every count, with ``health``: each live group's name and
        its ranks' states now."""
        out = Exposition()
        with self.lock:
            groups = sorted(self.groups.items())
            out.family("phalanx_calls_total", "counter",
                       "Calls answered by every rank they went to, by how they ended.")
            for name, counts in groups:
                for (method, outcome), n in sorted(counts.calls.items()):
                    out.sample("phalanx_calls_total",
                               {"group": name, "method": method, "outcome": outcome}, n)
            out.family("phalanx_call_duration_seconds", "histogram",
                       "From a call being made to its last rank's answer.")
            for name, counts in groups:
                for method, h in sorted(counts.latency.items()):
                    labels = {"group": name, "method": method}
                    running = 0
                    for bound, n in zip((*BUCKETS, math.inf), h.counts, strict=True):
                        running += n
                        out.sample("phalanx_call_duration_seconds_bucket",
                                   {**labels, "le": number(bound)}, running)
                    out.sample("phalanx_call_duration_seconds_sum", labels, h.total)
                    out.sample("phalanx_call_duration_seconds_count", labels, h.count)
            for metric, attribute, text in (
                    ("phalanx_sent_bytes_total", "sent", "Bytes of arguments sent to ranks."),
                    ("phalanx_received_bytes_total", "received",
                     "Bytes of results (and streamed items) received from ranks.")):
                out.family(metric, "counter", text)
                for name, counts in groups:
                    for method, n in sorted(getattr(counts, attribute).items()):
                        out.sample(metric, {"group": name, "method": method}, n)
            out.family("phalanx_rank_deaths_total", "counter",
                       "Ranks whose process died while the dashboard was open.")
            for name, counts in groups:
                out.sample("phalanx_rank_deaths_total", {"group": name}, counts.deaths)
        states = list(health)
        out.family("phalanx_ranks", "gauge", "Ranks of each live group, by state.")
        for name, ranks in states:
            for state in STATES:
                out.sample("phalanx_ranks", {"group": name, "state": state},
                           sum(1 for r in ranks if r.state == state))
        out.family("phalanx_rank_restarts_total", "counter",
                   "Times the ranks of each live group were started again.")
        for name, ranks in states:
            out.sample("phalanx_rank_restarts_total", {"group": name},
                       sum(r.restarts for r in ranks))
        out.family("phalanx_calls_in_flight", "gauge", "Calls sent and not yet answered.")
        for name, ranks in states:
            out.sample("phalanx_calls_in_flight", {"group": name},
                       sum(r.calls_in_flight for r in ranks))
        return out.text()
