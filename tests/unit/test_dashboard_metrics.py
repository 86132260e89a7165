"""What a dashboard counts of the calls it watches and serves at ``/metrics``
(:mod:`phalanx.monitor.metrics`), fed by real :class:`CallWatch` objects over a stub
future, on a clock the test sets; the text read back with Prometheus' own parser."""

from __future__ import annotations

import itertools
import math
import types

import pytest

from phalanx.controller import observe
from phalanx.controller.observe import CallWatch
from phalanx.controller.watch import RankHealth
from phalanx.monitor.metrics import BUCKETS, RECENT_CALLS, Metrics

parser = pytest.importorskip("prometheus_client.parser")


class StubFuture:
    """The completion side of a call's future (``futures.Completion``): records what the
    watch hands on."""

    tolerant = False

    def __init__(self, method: str, ranks: int) -> None:
        self.method = method
        self.ranks = ranks
        self.got: list[tuple] = []

    def resolve_rank(self, rank, segments):
        self.got.append(("resolve", rank, segments))

    def fail_rank(self, rank, error):
        self.got.append(("fail", rank, error))

    def yield_rank(self, rank, segments):
        self.got.append(("yield", rank, segments))

    def late_ranks(self):
        return ["late"]

    def cancelled(self):
        return "cancelled?"

    def __len__(self):
        return self.ranks


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(observe, "clock", clock)
    return clock


_ids = itertools.count(1)


def watch(metrics, method="step", group="G", ranks=(0, 1), bytes_in=100):
    return CallWatch(StubFuture(method, len(ranks)), group, next(_ids), list(ranks), bytes_in,
                     (metrics,), False)


def finish(metrics, clock, method="step", group="G", ranks=(0, 1), took=0.01, bytes_in=100,
           answer=(b"ab",), fail=None, items=()):
    """One call made at time 0 whose last answer arrives ``took`` seconds later."""
    clock.now = 0.0
    call = watch(metrics, method, group, ranks, bytes_in)
    for rank, item in items:
        call.yield_rank(rank, [item])
    for i, rank in enumerate(ranks):
        clock.now = took * (i + 1) / len(ranks)
        if rank == fail:
            call.fail_rank(rank, ValueError("no"))
        else:
            call.resolve_rank(rank, list(answer))
    assert call.done
    return call


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)], as Prometheus' parser reads ``text``."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by(rows, *keys):
    return {tuple(labels[k] for k in keys): value for labels, value in rows}


def test_calls_are_counted_by_group_method_and_outcome_once_every_rank_answered(clock):
    metrics = Metrics()
    for _ in range(3):
        finish(metrics, clock)
    finish(metrics, clock, fail=1)  # one rank failing makes the call an error, counted once
    finish(metrics, clock, method="load")
    finish(metrics, clock, group="H", ranks=(0,))
    finish(metrics, clock, group="H", ranks=(0,))
    pending = watch(metrics)  # answered by rank 0 only: not finished, not counted
    pending.resolve_rank(0, [b"x"])
    got = samples(metrics.render([]))
    assert by(got["phalanx_calls_total"], "group", "method", "outcome") == {
        ("G", "load", "ok"): 1, ("G", "step", "error"): 1, ("G", "step", "ok"): 3,
        ("H", "step", "ok"): 2}
    assert metrics.groups["G"].total_calls == 5 and metrics.groups["G"].errors == 1
    assert metrics.groups["G"].recent[-1] is pending  # the timeline shows it in flight


def test_latency_is_a_cumulative_histogram_whose_inf_bucket_is_the_count(clock):
    metrics = Metrics()
    took = [0.0003, 0.25, 0.25, 0.7, 3.0, 400.0]  # 0.25: on a bound, which counts it (le)
    for seconds in took:
        finish(metrics, clock, took=seconds)
    finish(metrics, clock, method="other", took=0.001)
    got = samples(metrics.render([]))
    buckets = [(labels, v) for labels, v in got["phalanx_call_duration_seconds_bucket"]
               if labels["method"] == "step"]
    bounds = [float(labels["le"]) for labels, _ in buckets]
    assert bounds == [*BUCKETS, math.inf]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative
    for bound, count in zip(bounds, counts, strict=True):
        assert count == sum(1 for s in took if s <= bound), bound
    assert dict(zip(bounds, counts, strict=True))[0.25] == 3
    assert counts[-1] == len(took)
    count = by(got["phalanx_call_duration_seconds_count"], "group", "method")
    total = by(got["phalanx_call_duration_seconds_sum"], "group", "method")
    assert count == {("G", "step"): len(took), ("G", "other"): 1}
    assert total[("G", "step")] == pytest.approx(sum(took))
    assert total[("G", "other")] == pytest.approx(0.001)


def test_bytes_sent_and_received_streamed_items_included(clock):
    metrics = Metrics()
    finish(metrics, clock, bytes_in=1000, answer=(b"12345", memoryview(bytearray(8))))
    finish(metrics, clock, bytes_in=24, answer=(b"",),
           items=[(0, b"x" * 10), (1, b"y" * 10), (0, memoryview(b"abc"))])
    finish(metrics, clock, method="load", ranks=(0,), bytes_in=7, answer=(b"zz",))
    got = samples(metrics.render([]))
    assert by(got["phalanx_sent_bytes_total"], "group", "method") == {
        ("G", "step"): 1024, ("G", "load"): 7}
    # two answers of 5 + 8 bytes; then 23 bytes of items and two empty answers
    assert by(got["phalanx_received_bytes_total"], "group", "method") == {
        ("G", "step"): 2 * 13 + 23, ("G", "load"): 2}


def test_deaths_rank_states_restarts_and_calls_in_flight(clock):
    metrics = Metrics()
    entry = types.SimpleNamespace(rank=1, failure=None)
    metrics.died("G", entry)
    metrics.died("G", entry)
    metrics.died("H", entry)

    def row(rank, state, restarts=0, in_flight=0):
        return RankHealth(rank=rank, node=0, pid=100 + rank, alive=state != "dead",
                          calls_in_flight=in_flight, exitcode=None, state=state,
                          restarts=restarts)

    health = [("G", [row(0, "ready", 0, 1), row(1, "ready", 2, 3), row(2, "dead", 1),
                     row(3, "starting")]),
              ("I", [row(0, "unresponsive")])]
    got = samples(metrics.render(health))
    assert by(got["phalanx_rank_deaths_total"], "group") == {("G",): 2, ("H",): 1}
    assert by(got["phalanx_ranks"], "group", "state") == {
        ("G", "starting"): 1, ("G", "ready"): 2, ("G", "unresponsive"): 0, ("G", "dead"): 1,
        ("I", "starting"): 0, ("I", "ready"): 0, ("I", "unresponsive"): 1, ("I", "dead"): 0}
    assert by(got["phalanx_rank_restarts_total"], "group") == {("G",): 3, ("I",): 0}
    assert by(got["phalanx_calls_in_flight"], "group") == {("G",): 4, ("I",): 0}
    assert "phalanx_calls_total" not in got  # no call finished yet


def test_label_values_are_escaped_and_read_back_intact(clock):
    group, method = 'we"ird\\gr\noup', 'm"e\\th\nod'
    metrics = Metrics()
    finish(metrics, clock, group=group, method=method, took=0.002)
    metrics.died(group, None)
    text = metrics.render([(group, [RankHealth(rank=0, node=0, pid=1, alive=True,
                                               calls_in_flight=2, exitcode=None)])])
    got = samples(text)
    for name in ("phalanx_calls_total", "phalanx_call_duration_seconds_bucket",
                 "phalanx_call_duration_seconds_count", "phalanx_sent_bytes_total",
                 "phalanx_received_bytes_total"):
        assert {labels["method"] for labels, _ in got[name]} == {method}, name
        assert {labels["group"] for labels, _ in got[name]} == {group}, name
    for name in ("phalanx_rank_deaths_total", "phalanx_ranks", "phalanx_calls_in_flight"):
        assert {labels["group"] for labels, _ in got[name]} == {group}, name
    assert by(got["phalanx_calls_in_flight"], "group") == {(group,): 2}
    # as the format writes them: a raw newline would end the sample's line
    assert 'group="we\\"ird\\\\gr\\noup"' in text
    assert len([ln for ln in text.splitlines() if ln.startswith("phalanx_calls_total")]) == 1


def test_nothing_watched_yet_is_valid_text_with_every_family():
    text = Metrics().render([])
    families = {f.name: f.type for f in parser.text_string_to_metric_families(text)}
    assert families == {
        "phalanx_calls": "counter", "phalanx_call_duration_seconds": "histogram",
        "phalanx_sent_bytes": "counter", "phalanx_received_bytes": "counter",
        "phalanx_rank_deaths": "counter", "phalanx_ranks": "gauge",
        "phalanx_rank_restarts": "counter", "phalanx_calls_in_flight": "gauge"}


def test_a_watch_hands_everything_on_to_the_future_and_finishes_once(clock):
    metrics = Metrics()
    clock.now = 5.0
    call = watch(metrics, ranks=(0, 1), bytes_in=64)
    future = call._future
    assert (call.queued, call.sent, call.method, len(call)) == (5.0, None, "step", 2)
    sent = []
    clock.now = 5.5
    call.sending(lambda: sent.append(clock.now))()
    assert sent == [5.5] and call.sent == 5.5
    item, answer, error = [b"i"], [b"answer"], ValueError("no")
    clock.now = 6.0
    call.yield_rank(0, item)
    call.resolve_rank(0, answer)
    clock.now = 7.0
    call.resolve_rank(0, answer)  # a second answer of rank 0: handed on, not counted
    assert not call.done
    assert call.late_ranks() == ["late"] and call.cancelled() == "cancelled?"  # the future's
    call.fail_rank(1, error)
    assert future.got == [("yield", 0, item), ("resolve", 0, answer), ("resolve", 0, answer),
                          ("fail", 1, error)]
    assert future.got[1][2] is answer and future.got[3][2] is error  # unchanged
    assert call.done and call.answered == {0: 6.0, 1: 7.0}
    assert call.errors == {1: "ValueError: no"}
    assert (call.items, call.bytes_out) == (1, 1 + 6)
    # done: the watch let go of the future (and its results), answering for itself
    assert call._future is not future
    assert call.late_ranks() == [] and call.cancelled() is False
    call.fail_rank(1, error)  # late news of a rank already counted
    assert len(future.got) == 4
    assert metrics.groups["G"].calls == {("step", "error"): 1}
    histogram = metrics.groups["G"].latency["step"]
    assert (histogram.count, histogram.total) == (1, pytest.approx(2.0))


def test_the_timeline_keeps_each_groups_last_calls(clock):
    metrics = Metrics()
    made = [watch(metrics, ranks=(0,)) for _ in range(RECENT_CALLS + 5)]
    other = watch(metrics, group="H", ranks=(0,))
    assert list(metrics.groups["G"].recent) == made[5:]
    assert list(metrics.groups["H"].recent) == [other]
