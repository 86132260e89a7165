"""A trace as the Chrome trace event format (:mod:`phalanx.output.timeline`), without
processes: the clock correction of the ranks' spans (every case hypothesis finds), and the
events drawn for a hand-made set of calls, spans, lanes and deaths."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.output.timeline import (
    CONTROLLER_PID,
    CallTimes,
    Death,
    Lane,
    Span,
    _ranks_text,
    chrome_trace,
    clock_offset,
)

EPS = 1e-9

# -- clock_offset -----------------------------------------------------------------------

delays = st.floats(0, 10, allow_nan=False)
round_trips = st.lists(st.tuples(st.floats(0, 1e4, allow_nan=False), delays, delays, delays),
                       min_size=1, max_size=20)
true_offsets = st.one_of(st.just(0.0), st.floats(-1e-3, 1e-3), st.floats(-1e3, 1e3))


def observed(offset: float, trips: list[tuple[float, float, float, float]]):
    """``(sent, began, answered, received)`` of calls whose rank's clock is ``offset``
    ahead: it began ``d1`` after the send, answered ``d2`` later, and the answer took
    ``d3`` to arrive."""
    pairs = []
    for sent, d1, d2, d3 in trips:
        began = sent + d1
        answered = began + d2
        pairs.append((sent, began + offset, answered + offset, answered + d3))
    return pairs


@settings(max_examples=300, deadline=None)
@given(true_offsets, round_trips)
def test_the_offset_keeps_every_call_inside_its_round_trip(offset, trips):
    pairs = observed(offset, trips)
    found = clock_offset(pairs)
    for sent, began, answered, received in pairs:
        assert began - found >= sent - EPS
        assert answered - found <= received + EPS
    # the least correction: never more than the true skew, never the other way
    assert abs(found) <= abs(offset) + EPS
    assert found * offset >= 0
    if all(began >= sent and answered <= received for sent, began, answered, received in pairs):
        assert found == 0.0  # 0 is consistent: the clocks are taken as equal
    elif found > 0:  # could not be any less: some answer arrived just as it was sent
        assert min(abs(a - r - found) for _, _, a, r in pairs) <= EPS
    else:  # could not be any more: some call began just as it was sent
        assert min(abs(b - s - found) for s, b, _, _ in pairs) <= EPS


@given(round_trips)
def test_equal_clocks_give_no_offset(trips):
    assert clock_offset(observed(0.0, trips)) == 0.0


def test_no_calls_give_no_offset():
    assert clock_offset([]) == 0.0


def test_bounds_that_cross_give_their_middle():
    # one call says the rank's clock is at most 0 ahead, another at least 1 ahead: a
    # clock that drifted during the trace
    pairs = [(10.0, 10.0, 10.5, 11.0), (20.0, 21.0, 23.0, 22.0)]
    assert clock_offset(pairs) == pytest.approx(0.5)


# -- _ranks_text ------------------------------------------------------------------------

def expand(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


@given(st.sets(st.integers(0, 300), min_size=1))
def test_ranks_text_is_the_ranks_as_maximal_runs(ranks):
    text = _ranks_text(list(ranks)[::-1])
    assert expand(text) == sorted(ranks)
    runs = [tuple(map(int, p.split("-"))) for p in text.split(",")]
    for run in runs:
        assert len(run) == 1 or run[0] < run[1]
    for before, after in itertools.pairwise(runs):
        assert after[0] > before[-1] + 1  # two runs that touch would be one


@pytest.mark.parametrize(("ranks", "text"), [
    ([5, 0, 1, 2, 3], "0-3,5"), ([1], "1"), ([0, 2, 4], "0,2,4"), ([7, 8], "7-8"), ([], "")])
def test_ranks_text_examples(ranks, text):
    assert _ranks_text(ranks) == text


# -- chrome_trace: a hand-made trace ----------------------------------------------------

ORIGIN = 1000.0
UNTIL = 1010.0


def us(t: float) -> float:
    return (t - ORIGIN) * 1e6


def hand_made() -> dict:
    calls = [
        # on ranks 0-3 and 5; rank 2 failed
        CallTimes("G", 1, "step", [5, 0, 1, 2, 3], 1001.0, 1001.001,
                  {0: 1001.010, 1: 1001.020, 2: 1001.030, 3: 1001.040, 5: 1001.050},
                  {2: "ValueError: bad"}, 500, 40),
        # rank 1 never answered
        CallTimes("G", 2, "load", [0, 1], 1002.0, 1002.0005, {0: 1002.1}, {}, 10, 5),
        # deferred and never sent
        CallTimes("G", 3, "later", [0], 1003.0, None, {}, {}, 0, 0),
        # another group, drawn without lanes or spans
        CallTimes("H", 1, "ping", [0], 1004.0, 1004.001, {0: 1004.003}, {}, 1, 1),
        # rank 3 of G again (its clock 5 s ahead)
        CallTimes("G", 4, "step", [3], 1005.0, 1005.001, {3: 1005.011}, {}, 7, 7),
        # sent, and no rank answered
        CallTimes("G", 6, "hang", [1], 1006.0, 1006.001, {}, {}, 1, 0),
    ]
    spans = {
        ("G", 0): [Span(1, 1001.002, 1001.008, False), Span(2, 1002.001, 1002.09, False),
                   Span(99, 1000.5, 1000.6, False)],  # 99: a call of no trace here
        ("G", 1): [Span(1, 1001.003, 1001.019, False)],
        ("G", 2): [Span(1, 1001.004, 1001.005, True)],
        # 5 s ahead: began 1001.002 and answered 1001.039 on the controller's clock
        ("G", 3): [Span(1, 1006.002, 1006.039, False), Span(4, 1010.003, 1010.009, False)],
    }
    lanes = [Lane("G", 0, 0, 100), Lane("G", 1, 0, 101), Lane("G", 2, 1, None),
             Lane("G", 3, 1, 103), Lane("G", 5, None, None)]
    deaths = [Death("G", 5, 1001.06, "killed by SIGKILL")]
    return chrome_trace(calls, spans, lanes, deaths, origin=ORIGIN, until=UNTIL,
                        metadata={"groups": ["G", "H"]})


def meta(doc: dict, kind: str) -> dict[tuple[int, int], object]:
    return {(e["pid"], e["tid"]): e["args"].get("name", e["args"].get("sort_index"))
            for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == kind}


def x_events(doc: dict, pid: int, call: int) -> dict[int, dict]:
    return {e["tid"]: e for e in doc["traceEvents"]
            if e["ph"] == "X" and e["pid"] == pid and e["args"]["call"] == call}


def controller(doc: dict, pid: int, call: int) -> tuple[dict, dict]:
    ident = f"{pid}.{call}"
    [b] = [e for e in doc["traceEvents"] if e["ph"] == "b" and e["id"] == ident]
    [e] = [e for e in doc["traceEvents"] if e["ph"] == "e" and e["id"] == ident]
    assert b["pid"] == e["pid"] == CONTROLLER_PID and b["tid"] == e["tid"] == pid
    return b, e


def test_processes_and_lanes_are_named():
    doc = hand_made()
    json.dumps(doc)  # JSON-ready
    assert doc["displayTimeUnit"] == "ms"
    assert meta(doc, "process_name") == {(0, 0): "controller", (1, 0): "group G",
                                         (2, 0): "group H"}
    assert meta(doc, "process_sort_index") == {(0, 0): -1, (1, 0): 1, (2, 0): 2}
    threads = meta(doc, "thread_name")
    assert threads[(0, 1)] == "G calls" and threads[(0, 2)] == "H calls"
    assert {k: v for k, v in threads.items() if k[0] == 1} == {
        (1, 0): "rank 0 (node 0, pid 100)", (1, 1): "rank 1 (node 0, pid 101)",
        (1, 2): "rank 2 (node 1)", (1, 3): "rank 3 (node 1, pid 103)", (1, 5): "rank 5"}
    assert meta(doc, "thread_sort_index")[(1, 5)] == 5


def test_the_controllers_slice_runs_from_made_to_last_answer():
    doc = hand_made()
    b, e = controller(doc, 1, 1)
    assert b["name"] == e["name"] == "step" and b["cat"] == "call"
    assert b["ts"] == pytest.approx(us(1001.0), abs=0.01)
    assert e["ts"] == pytest.approx(us(1001.050), abs=0.01)
    assert b["args"]["ranks"] == "0-3,5"
    assert (b["args"]["bytes_in"], b["args"]["bytes_out"]) == (500, 40)
    assert b["args"]["queued_ms"] == pytest.approx(1.0, abs=1e-3)
    assert b["args"]["errors"] == {"2": "ValueError: bad"}
    assert "unanswered" not in b["args"]


def test_an_unanswered_call_ends_at_the_end_of_the_trace():
    doc = hand_made()
    b, e = controller(doc, 1, 6)
    assert b["args"]["unanswered"] == "1"
    assert b["ts"] == pytest.approx(us(1006.0), abs=0.01)
    assert e["ts"] == pytest.approx(us(UNTIL), abs=0.01)
    assert x_events(doc, 1, 6) == {}  # no span, no answer: nothing on the rank's lane
    partly, _ = controller(doc, 1, 2)
    assert partly["args"]["unanswered"] == "1"
    assert sorted(x_events(doc, 1, 2)) == [0]  # only the rank that answered is drawn
    never_sent, end = controller(doc, 1, 3)
    assert "queued_ms" not in never_sent["args"] and never_sent["args"]["unanswered"] == "0"
    assert end["ts"] == pytest.approx(us(UNTIL), abs=0.01)
    assert x_events(doc, 1, 3) == {}


def test_ranks_spans_errors_and_the_controllers_view_of_a_rank_without_spans():
    doc = hand_made()
    events = x_events(doc, 1, 1)
    assert sorted(events) == [0, 1, 2, 3, 5]
    assert {e["name"] for e in events.values()} == {"step"}
    zero = events[0]
    assert zero["args"]["source"] == "rank" and zero["cat"] == "call"
    assert zero["ts"] == pytest.approx(us(1001.002), abs=0.01)
    assert zero["dur"] == pytest.approx(6000, abs=0.01)
    assert zero["args"]["send_ms"] == pytest.approx(1.0, abs=1e-3)
    assert zero["args"]["reply_ms"] == pytest.approx(2.0, abs=1e-3)
    failed = events[2]
    assert failed["cat"] == "error" and failed["args"]["error"] == "ValueError: bad"
    assert failed["args"]["source"] == "rank"
    assert "error" not in events[1]["args"] and events[1]["cat"] == "call"
    # rank 5 gave no spans (it died): from the send to its answer's arrival
    five = events[5]
    assert five["args"]["source"] == "controller"
    assert five["ts"] == pytest.approx(us(1001.001), abs=0.01)
    assert five["dur"] == pytest.approx(49000, abs=0.01)
    assert "send_ms" not in five["args"]
    assert not [e for e in doc["traceEvents"] if e.get("args", {}).get("call") == 99]
    # the other group: the controller's view, on its own process
    [ping] = x_events(doc, 2, 1).values()
    assert ping["args"]["source"] == "controller" and ping["tid"] == 0


def test_a_rank_whose_clock_is_ahead_is_moved_inside_its_round_trips():
    doc = hand_made()
    # the least offset consistent with both of rank 3's calls: 4.999 s (call 1's answer)
    assert doc["otherData"]["clock_offsets_us"] == {"G/3": pytest.approx(4_999_000, abs=0.01)}
    for call in (1, 4):
        b, e = controller(doc, 1, call)
        span = x_events(doc, 1, call)[3]
        assert span["args"]["source"] == "rank"
        assert span["ts"] >= b["ts"] and span["ts"] + span["dur"] <= e["ts"] + 0.01
    first = x_events(doc, 1, 1)[3]
    assert first["ts"] == pytest.approx(us(1001.003), abs=0.01)
    assert first["dur"] == pytest.approx(37000, abs=0.01)
    assert first["args"]["reply_ms"] == pytest.approx(0.0, abs=1e-3)


def test_a_death_is_an_instant_on_its_ranks_lane_and_metadata_is_kept():
    doc = hand_made()
    [death] = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert death["name"] == "rank 5 died" and death["cat"] == "death"
    assert (death["pid"], death["tid"], death["s"]) == (1, 5, "t")
    assert death["ts"] == pytest.approx(us(1001.06), abs=0.01)
    assert death["args"] == {"cause": "killed by SIGKILL"}
    assert doc["otherData"]["groups"] == ["G", "H"]


def test_equal_clocks_are_not_reported_as_offsets():
    calls = [CallTimes("G", 1, "m", [0], 1.0, 1.1, {0: 1.5}, {}, 0, 0)]
    doc = chrome_trace(calls, {("G", 0): [Span(1, 1.2, 1.3, False)]}, [Lane("G", 0, 0, 1)],
                       origin=1.0, until=2.0)
    assert doc["otherData"] == {"clock_offsets_us": {}}


# -- chrome_trace: any consistent trace -------------------------------------------------

@st.composite
def traces(draw):
    """Pipelined calls on up to 4 ranks, each rank's clock off by its own amount."""
    n_ranks = draw(st.integers(1, 4))
    skews = draw(st.lists(st.floats(-50, 50), min_size=n_ranks, max_size=n_ranks))
    delay = st.floats(0, 0.5)
    calls, spans = [], {}
    made = 100.0
    for call_id in range(1, draw(st.integers(1, 8)) + 1):
        made += draw(st.floats(0, 0.2))
        ranks = sorted(draw(st.sets(st.integers(0, n_ranks - 1), min_size=1)))
        sent = made + draw(st.floats(0, 0.01))
        answered = {}
        for rank in ranks:
            began = sent + draw(delay)
            done = began + draw(delay)
            answered[rank] = done + draw(delay)
            spans.setdefault(("G", rank), []).append(
                Span(call_id, began + skews[rank], done + skews[rank], False))
        calls.append(CallTimes("G", call_id, "m", ranks, made, sent, answered, {}, 0, 0))
    lanes = [Lane("G", r, 0, None) for r in range(n_ranks)]
    return calls, spans, lanes


@settings(max_examples=150, deadline=None)
@given(traces())
def test_every_ranks_span_is_drawn_inside_its_calls_slice(trace):
    calls, spans, lanes = trace
    doc = chrome_trace(calls, spans, lanes, origin=100.0, until=200.0)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(len(c.ranks) for c in calls)
    for e in xs:
        assert e["args"]["source"] == "rank"
        b, end = controller(doc, 1, e["args"]["call"])
        assert e["ts"] >= b["ts"] - 0.01
        assert e["ts"] + e["dur"] <= end["ts"] + 0.01
