"""group.trace() / px.trace(): every call of the traced groups, on every rank, as a Chrome
trace (one lane per rank with the rank's own span of each call, the controller's view of
each call, deaths), and nothing changed once the trace ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import phalanx as px
from phalanx import PhalanxError, WorkerDied, WorkerError
from phalanx.controller.internals import internals
from tests import helpers
from tests.workers import Probe

WORLD = 3
TOLERANCE_US = 1000.0  # 1 ms: the rank's span must sit inside the controller's view


class Traced(Probe):
    """Probe with a generator method (for call_stream)."""

    def count(self, n: int):
        yield from range(n)


@pytest.fixture(scope="module")
def group(backend):
    # one rank per node: on Ray and the agents each rank is on a node (and clock) of its own
    with helpers.long_lived_group(Traced, nodes=WORLD, procs_per_node=1, backend=backend,
                                  echo_output=False) as group:
        yield group


# -- reading a trace --------------------------------------------------------------------

def group_pid(doc: dict, name: str) -> int:
    pids = [e["pid"] for e in doc["traceEvents"] if e["ph"] == "M"
            and e["name"] == "process_name" and e["args"]["name"] == f"group {name}"]
    assert len(pids) == 1, f"expected one process for group {name}, got {pids}"
    return pids[0]


def process_names(doc: dict) -> set[str]:
    return {e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def thread_names(doc: dict, pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def rank_events(doc: dict, pid: int) -> list[dict]:
    """The complete ("X") events on the rank lanes of the group drawn as ``pid``."""
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def controller_slices(doc: dict, pid: int) -> dict[int, dict[str, list[dict]]]:
    """call id -> {"b": [...], "e": [...]} on the controller's lane of group ``pid``."""
    out: dict[int, dict[str, list[dict]]] = {}
    ident_to_call: dict[str, int] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "b" and e["pid"] == 0 and e["tid"] == pid:
            ident_to_call[e["id"]] = e["args"]["call"]
    for e in doc["traceEvents"]:
        if e["ph"] in "be" and e["pid"] == 0 and e["tid"] == pid:
            call = ident_to_call[e["id"]]
            out.setdefault(call, {"b": [], "e": []})[e["ph"]].append(e)
    return out


def answered_all(call) -> bool:
    return sorted(call.answered) == sorted(call.ranks)


def saved(trace: px.Trace, path: Path) -> dict:
    written = trace.save(path)
    assert written == str(path)
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list)
    return doc


# -- tests ------------------------------------------------------------------------------

def test_every_call_is_one_span_per_rank_inside_the_controllers_view(group, tmp_path):
    group.call("rank")  # made before the trace: not in it
    blob = b"x" * 20_000
    with group.trace() as trace:
        assert group.call("identity", blob) == [blob] * WORLD
        pipelined = [group.call_async("add", i, b=1) for i in range(3)]
        assert [f.result(timeout=30) for f in pipelined] == [[i + 1] * WORLD for i in range(3)]
        assert group.map("add", [0, 1, 2], b=[10, 10, 10]) == [10, 11, 12]
        assert group.call_one(1, "rank") == 1
        pairs = list(group.call_stream("count", 2))
        refs = group.call("rank", keep=True)
    assert sorted(pairs) == sorted((r, i) for r in range(WORLD) for i in range(2))
    assert [r.get() for r in refs] == [0, 1, 2]  # keep=True results still work

    calls = trace.calls
    assert [(c.method, list(c.ranks)) for c in calls] == [
        ("identity", [0, 1, 2]), ("add", [0, 1, 2]), ("add", [0, 1, 2]), ("add", [0, 1, 2]),
        ("add", [0, 1, 2]), ("rank", [1]), ("count", [0, 1, 2]), ("rank", [0, 1, 2])]
    assert all(answered_all(c) and not c.errors and c.group == group.name for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    assert calls[0].bytes_in >= WORLD * len(blob) and calls[0].bytes_out >= WORLD * len(blob)

    doc = saved(trace, tmp_path / "t.json")
    assert doc == json.loads(json.dumps(trace.events()))  # save writes what events() gives
    pid = group_pid(doc, group.name)
    assert pid != 0
    assert "controller" in process_names(doc)
    assert thread_names(doc, 0)[pid] == f"{group.name} calls"
    lanes = thread_names(doc, pid)
    assert sorted(lanes) == [0, 1, 2]
    assert all(lanes[r].startswith(f"rank {r}") for r in lanes)

    events = rank_events(doc, pid)
    slices = controller_slices(doc, pid)
    assert sorted(slices) == sorted(c.call_id for c in calls)  # nothing from outside
    for call in calls:
        mine = [e for e in events if e["args"]["call"] == call.call_id]
        assert sorted(e["tid"] for e in mine) == list(call.ranks), call  # one per rank
        pair = slices[call.call_id]
        assert len(pair["b"]) == 1 and len(pair["e"]) == 1, call
        begin, end = pair["b"][0], pair["e"][0]
        assert begin["name"] == end["name"] == call.method
        assert begin["args"]["ranks"] == ("1" if list(call.ranks) == [1] else "0-2")
        assert begin["args"]["bytes_in"] == call.bytes_in
        assert begin["args"]["bytes_out"] == call.bytes_out
        for e in mine:
            assert e["name"] == call.method  # the user's name: no trace or keep= prefix
            assert e["cat"] == "call" and "error" not in e["args"]
            assert e["args"]["source"] == "rank", e
            assert e["dur"] >= 0
            assert e["ts"] >= begin["ts"] - TOLERANCE_US, (e, begin)
            assert e["ts"] + e["dur"] <= end["ts"] + TOLERANCE_US, (e, end)
    assert len(events) == sum(len(c.ranks) for c in calls)
    assert not [e for e in doc["traceEvents"] if e["ph"] == "i"]  # nobody died


def test_a_rank_that_raises_is_drawn_as_an_error_the_others_as_calls(group):
    with group.trace() as trace:
        with pytest.raises(WorkerError):
            group.call("fail_on_rank", 1, 0.05)
    [call] = trace.calls
    assert list(call.errors) == [1] and "KeyError" in call.errors[1]
    doc = trace.events()
    pid = group_pid(doc, group.name)
    by_rank = {e["tid"]: e for e in rank_events(doc, pid)}
    assert sorted(by_rank) == [0, 1, 2]
    assert by_rank[1]["cat"] == "error"
    assert "KeyError" in by_rank[1]["args"]["error"]
    assert "rank 1 failed on purpose" in by_rank[1]["args"]["error"]
    assert by_rank[1]["args"]["source"] == "rank"
    for rank in (0, 2):
        assert by_rank[rank]["cat"] == "call" and "error" not in by_rank[rank]["args"]
        assert by_rank[rank]["args"]["source"] == "rank"
        assert by_rank[rank]["dur"] >= 40_000  # the others' sleep of 50 ms
    [begin] = controller_slices(doc, pid)[call.call_id]["b"]
    assert list(begin["args"]["errors"]) == ["1"]


def test_a_rank_killed_during_a_traced_call_is_a_death_mark_and_the_controllers_view(
        make_group, ranks, tmp_path):
    group = make_group(Traced, nodes=WORLD, procs_per_node=1)
    group.call("rank")
    with group.trace() as trace:
        future = group.call_async("sleep", 0.5, value="done")
        time.sleep(0.1)
        ranks.kill(group, 1)
        with pytest.raises(WorkerDied):
            future.result(timeout=10)
        assert group.call("rank", workers=[0, 2]) == [0, 2]
    doc = saved(trace, tmp_path / "t.json")
    pid = group_pid(doc, group.name)
    sleep_call = trace.calls[0]
    assert sleep_call.method == "sleep" and answered_all(sleep_call)
    assert "WorkerDied" in sleep_call.errors[1]

    spans = {e["tid"]: e for e in rank_events(doc, pid)
             if e["args"]["call"] == sleep_call.call_id}
    assert sorted(spans) == [0, 1, 2]
    killed = spans[1]
    assert killed["args"]["source"] == "controller"  # the dead rank gave no spans
    assert killed["cat"] == "error" and "WorkerDied" in killed["args"]["error"]
    for rank in (0, 2):
        assert spans[rank]["args"]["source"] == "rank" and spans[rank]["cat"] == "call"
    pair = controller_slices(doc, pid)[sleep_call.call_id]
    begin, end = pair["b"][0], pair["e"][0]
    assert killed["ts"] >= begin["ts"] - TOLERANCE_US
    assert killed["ts"] + killed["dur"] <= end["ts"] + TOLERANCE_US

    deaths = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert len(deaths) == 1, deaths
    [death] = deaths
    assert death["name"] == "rank 1 died"
    assert (death["pid"], death["tid"]) == (pid, 1)
    assert death["args"]["cause"]
    signal_name = ranks.killed_signal()
    if signal_name is not None:
        assert signal_name in death["args"]["cause"]
    assert begin["ts"] <= death["ts"] <= killed["ts"] + killed["dur"] + TOLERANCE_US
    assert 1 in thread_names(doc, pid)  # the dead rank keeps its lane


def test_px_trace_draws_each_group_and_only_the_calls_made_inside_it(group, make_group):
    other = make_group(Traced, procs_per_node=2)
    group.call("rank")
    other.call("rank")
    with px.trace(group, other) as first:
        group.call("add", 1)
        other.call("add", 2)
    group.call("rank")
    other.call("rank")
    assert [(c.group, c.method) for c in first.calls] == [(group.name, "add"),
                                                         (other.name, "add")]
    doc = first.events()
    assert process_names(doc) == {"controller", f"group {group.name}", f"group {other.name}"}
    mine, theirs = group_pid(doc, group.name), group_pid(doc, other.name)
    assert mine != theirs
    assert sorted(thread_names(doc, mine)) == [0, 1, 2]
    assert sorted(thread_names(doc, theirs)) == [0, 1]
    for pid, ranks in ((mine, [0, 1, 2]), (theirs, [0, 1])):
        events = rank_events(doc, pid)
        assert sorted(e["tid"] for e in events) == ranks
        assert {e["name"] for e in events} == {"add"}
        assert {e["args"]["source"] for e in events} == {"rank"}

    with px.trace(group, other) as second:
        other.call("echo")
    assert [(c.group, c.method) for c in second.calls] == [(other.name, "echo")]
    doc2 = second.events()
    assert rank_events(doc2, group_pid(doc2, group.name)) == []
    events = rank_events(doc2, group_pid(doc2, other.name))
    assert sorted(e["tid"] for e in events) == [0, 1]
    assert {e["name"] for e in events} == {"echo"}
    assert {e["args"]["source"] for e in events} == {"rank"}
    assert first.events() == doc  # an ended trace does not change


def test_a_rank_that_never_answers_does_not_hold_up_the_end_of_the_trace(make_group):
    group = make_group(Traced, nodes=WORLD, procs_per_node=1)
    group.call("rank")
    with group.trace(timeout=1) as trace:
        hung = group.call_async("hang", workers=[1])
        assert group.call("rank", workers=[0, 2]) == [0, 2]
        ending = time.monotonic()
    assert time.monotonic() - ending < 5, "the end of the trace waited for a hung rank"
    assert not hung.done()

    doc = trace.events()
    pid = group_pid(doc, group.name)
    hang_call, rank_call = trace.calls
    events = rank_events(doc, pid)
    assert sorted(e["tid"] for e in events if e["args"]["call"] == rank_call.call_id) == [0, 2]
    assert {e["args"]["source"] for e in events} == {"rank"}
    assert not [e for e in events if e["args"]["call"] == hang_call.call_id]  # unanswered
    pair = controller_slices(doc, pid)[hang_call.call_id]
    assert pair["b"][0]["args"]["unanswered"] == "1"
    assert pair["e"][0]["ts"] == pytest.approx((trace.ended - trace.began) * 1e6, abs=1)
    assert group._sender.observers == ()

    started = time.monotonic()
    group.shutdown(timeout=2)
    assert time.monotonic() - started < 15
    assert isinstance(hung.exception(timeout=5), PhalanxError)


def test_bad_arguments_are_refused_and_leave_nothing_watched(group, make_group):
    with pytest.raises(ValueError, match="at least one group"):
        px.trace()
    with pytest.raises(TypeError, match="str"):
        px.trace("x")
    with pytest.raises(TypeError):
        px.trace(group, object())
    with pytest.raises(ValueError, match="twice"):
        px.trace(group, group)
    with pytest.raises(ValueError):
        group.trace(timeout=0)
    with pytest.raises(ValueError):
        group.trace(timeout=-1)
    with pytest.raises(TypeError):
        group.trace(timeout="1")

    closed = make_group(Probe, procs_per_node=1)
    closed.shutdown(timeout=2)
    with pytest.raises(PhalanxError, match="shut down"):
        with closed.trace():
            pass
    with pytest.raises(PhalanxError, match="shut down"):
        px.trace(group, closed).start()
    assert group._sender.observers == ()  # the live group was not left watched

    trace = group.trace()
    with pytest.raises(RuntimeError, match="never started"):
        trace.events()
    trace.start()
    try:
        with pytest.raises(RuntimeError, match="started already"):
            trace.start()
    finally:
        trace.stop()
    assert trace.stop() is trace  # idempotent
    assert group._sender.observers == ()


def test_once_a_trace_ends_calls_are_sent_as_before(group):
    with pytest.raises(RuntimeError, match="boom"):
        with group.trace() as trace:
            group.call("rank")
            raise RuntimeError("boom")
    assert trace.ended is not None and len(trace.calls) == 1  # ended by the exception too
    assert group._sender.observers == ()
    assert group.call("add", 1, b=2) == [3] * WORLD
    assert group.call_one(2, "rank") == 2
    # the ranks recorded nothing for the untraced calls: they reached them unprefixed
    taken = internals(group).send_builtin("@trace", [0, 1, 2], [()] * WORLD).result(timeout=30)
    assert [(t["spans"], t["lost"]) for t in taken] == [([], 0)] * WORLD
    assert len(trace.calls) == 1  # the ended trace saw none of them


def test_two_traces_open_at_once_each_get_the_ranks_spans_of_their_calls(group):
    with group.trace() as outer:
        group.call("rank")
        with group.trace() as inner:
            group.call("add", 1, b=2)
        group.call("echo", "x")
    assert [c.method for c in outer.calls] == ["rank", "add", "echo"]
    assert [c.method for c in inner.calls] == ["add"]
    for trace in (outer, inner):
        doc = trace.events()
        events = rank_events(doc, group_pid(doc, group.name))
        # the rank's own span of every call, none stolen by the other trace's end, and
        # neither trace draws the other's end (its @trace call)
        assert sorted((e["name"], e["tid"]) for e in events) == sorted(
            (c.method, r) for c in trace.calls for r in c.ranks)
        assert all(e["args"]["source"] == "rank" for e in events), events


def test_the_end_of_a_trace_is_not_counted_as_a_call_by_a_dashboard(group):
    with px.dashboard() as board:
        with group.trace():
            group.call("rank")
        counted = board.metrics.groups[group.name].calls
    assert counted == {("rank", "ok"): 1}
