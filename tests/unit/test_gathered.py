"""Many ranks' answers at once: a RESULTS message reads back exactly what was gathered (and
nothing malformed is read), a run of answers resolves a call's places at once and decodes to
exactly what each rank sent, and a call registered once on a cohort of entries is still owed,
taken and failed rank by rank (what a rank's death or a membership change relies on)."""

from __future__ import annotations

import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.backends.cluster import messages as agentwire
from phalanx.controller.dispatch import Dispatcher
from phalanx.controller.futures import Call
from phalanx.controller.ranks import Cohort, RankEntry
from phalanx.wire import framing, protocol


class Idle:
    """A dispatcher for futures whose answers are all in (nothing to wait for)."""

    group_name = None

    def wait(self, is_done, timeout, kickoff=None):
        if kickoff is not None:
            kickoff()
        return is_done()

    def poll_now(self):
        pass

    def watch_future(self, future, on):
        pass


def unframe(frame: list) -> list[bytes]:
    """The segments a reader gets of a frame that :func:`framing.frame` built."""
    data = b"".join(bytes(memoryview(s).cast("B")) for s in frame)
    count, _ = struct.unpack_from("<IQ", data)
    lengths = struct.unpack_from(f"<{count}Q", data, 12)
    pos, segments = 12 + 8 * count, []
    for length in lengths:
        segments.append(data[pos:pos + length])
        pos += length
    return segments


def gathered(ranks: list[int], payloads: list[list[bytes]]) -> protocol.Gathered:
    return agentwire.read_results(unframe(agentwire.results(7, ranks, payloads)))


answers = st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_results_message_reads_back_every_ranks_answer_exactly(data):
    ranks = sorted(data.draw(st.sets(st.integers(0, 5000), min_size=1, max_size=30)))
    if data.draw(st.booleans()):  # a run from its first rank
        ranks = list(range(ranks[0], ranks[0] + len(ranks)))
    payloads = [data.draw(answers) for _ in ranks]
    got = gathered(ranks, payloads)
    assert list(got.ranks) == ranks and len(got) == len(ranks)
    assert isinstance(got.ranks, range) == (ranks[-1] - ranks[0] == len(ranks) - 1)
    assert [got.payload(i) for i in range(len(ranks))] == payloads
    assert got.plain == all(len(p) == 1 for p in payloads)
    assert [got.pickle(i) for i in range(len(ranks))] == [p[0] for p in payloads]
    same = got.uniform()
    alike = all(p == payloads[0] and len(p) == 1 for p in payloads)
    assert same == (payloads[0][0] if alike else None)


def test_alike_bytes_in_pieces_of_other_sizes_are_not_taken_for_one_answer():
    # "ababab" cut 2, 1, 3: the bytes repeat with the first answer's length, the answers do not
    got = gathered([0, 1, 2], [[b"ab"], [b"a"], [b"bab"]])
    assert got.uniform() is None and got.pickles() == [b"ab", b"a", b"bab"]


@pytest.mark.parametrize(("change", "words"), [
    (lambda segs: [segs[0], segs[1][:-1]], "pickles of 4 bytes in all, in a segment of 3"),
    (lambda segs: [segs[0], segs[1], b"stray"], "1 buffers, and no rank's count of them"),
    (lambda segs: [protocol.header(agentwire.RESULTS, 7, 3, 2, struct.pack("<2I", 3, 3),
                                   struct.pack("<2Q", 2, 2), None), segs[1]],
     "ranks that are not increasing from 3"),
    (lambda segs: [protocol.header(agentwire.RESULTS, 7, 2**32 - 2, 2, None,
                                   struct.pack("<2Q", 2, 2), None), segs[1]],
     "results of ranks"),
    (lambda segs: [protocol.header(agentwire.REPLY, 7, 0, True, None)], "is no RESULTS"),
])
def test_a_malformed_results_message_is_refused_saying_why(change, words):
    segs = unframe(agentwire.results(7, [3, 4], [[b"ab"], [b"cd"]]))
    with pytest.raises(ValueError, match=words):
        agentwire.read_results(change(segs))


def test_the_usual_results_read_in_one_unpacking_agree_with_the_general_reading():
    segs = unframe(agentwire.results(9, [10, 11, 12], [[b"a"], [b"bc"], [b"def"]]))
    fast = agentwire.read_results(segs)
    head = protocol.header(agentwire.RESULTS, 9, 10, 3, None, struct.pack("<3Q", 1, 2, 3),
                           None)
    assert segs[0] == head
    general = agentwire.read_results([head + b"", segs[1]])
    assert fast.ranks == general.ranks == range(10, 13)
    assert fast.pickles() == general.pickles() == [b"a", b"bc", b"def"]
    with pytest.raises(ValueError, match="malformed header fields"):
        agentwire.read_results([segs[0][:-1] + b"X", segs[1]])  # not plain data: no RESULTS


# -- a call's places resolved by runs --------------------------------------------------------


def call_of(ranks: list[int], tolerant: bool = False) -> Call:
    return Call("m", ranks, Idle(), tolerant)  # type: ignore[arg-type]


values = st.one_of(st.none(), st.integers(), st.text(max_size=5),
                   st.lists(st.integers(), max_size=3), st.binary(max_size=5))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_runs_and_single_answers_resolve_a_call_to_every_ranks_own_value(data):
    count = data.draw(st.integers(1, 40))
    ranks = list(range(100, 100 + count))
    sent = [data.draw(values) for _ in ranks]
    if data.draw(st.booleans()):
        sent = [sent[0]] * count  # every rank alike: decoded once when immutable
    call = call_of(ranks)
    place = 0
    while place < count:
        size = data.draw(st.integers(1, count - place))
        pickles = [[pickle.dumps(v, protocol=5)] for v in sent[place:place + size]]
        if size == 1 and data.draw(st.booleans()):
            call.resolve_rank(ranks[place], pickles[0])
        else:
            assert call.resolve_span(place, gathered(ranks[place:place + size], pickles))
        place += size
    got = call.result(timeout=0)
    assert got == sent
    mutable = [i for i, v in enumerate(sent) if isinstance(v, list)]
    assert len({id(got[i]) for i in mutable}) == len(mutable)  # never shared between ranks
    assert call.result(timeout=0) == sent  # read again: the same


def test_a_run_resolves_only_places_still_waited_for_and_each_rank_reads_alone():
    call = call_of([0, 1, 2, 3])
    call.fail_rank(2, RuntimeError("rank 2 died"))
    run = gathered([1, 2, 3], [[pickle.dumps(v)] for v in ("a", "b", "c")])
    assert not call.resolve_span(1, run)  # place 2 failed already: nothing done
    assert call.waits_on(1) and not call.waits_on(2)
    call2 = call_of([0, 1, 2, 3])
    assert call2.resolve_span(1, run)
    assert [f.done() for f in call2.futures] == [False, True, True, True]
    assert call2.futures[3].result(timeout=0) == "c"
    call2.resolve_rank(0, [pickle.dumps("z")])
    assert call2.result(timeout=0) == ["z", "a", "b", "c"]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_answers_of_several_runs_resolve_each_run_its_own_values_and_leave_the_rest(data):
    """A subtree's late answers come apart (ranks with gaps): each run of them resolves its
    places at once, those outside the link's part are left for rank by rank."""
    count = data.draw(st.integers(2, 30))
    ranks = list(range(50, 50 + count))
    came = sorted(data.draw(st.sets(st.sampled_from(ranks), min_size=1)))
    carried = data.draw(st.integers(1, count))  # the link carries the first places only
    cohort = Cohort(ranks, entries(count), version=(0, 0))
    link = object()
    cohort.add_part(link, 0, carried)
    call = call_of(ranks)
    answers = gathered(came, [[pickle.dumps(("v", r), protocol=5)] for r in came])
    assert answers.sub(0, len(came)).pickles() == answers.pickles()
    left = set(Dispatcher._resolve_runs(cohort, call, link, answers) or ())
    assert {i for i, r in enumerate(came) if r - 50 >= carried} <= left  # not its part's
    if carried == count:
        assert not left  # all of the part's: every run resolved at once
    for i, r in enumerate(came):
        assert call.waits_on(r - 50) is (i in left)
        if i not in left:
            assert call.futures[r - 50].result(timeout=0) == ("v", r)
    assert all(call.waits_on(r - 50) for r in ranks if r not in came)


# -- a call registered once on a cohort -------------------------------------------------------


class _Channel:
    def sender(self):
        return lambda frame: None  # (nothing is sent here)


def entries(count: int) -> list[RankEntry]:
    return [RankEntry(r, r // 2, _Channel()) for r in range(count)]  # type: ignore[arg-type]


def test_a_cohorts_call_is_owed_taken_and_failed_rank_by_rank():
    called = entries(6)
    cohort = Cohort(list(range(6)), called, version=(0, 0))
    cohort.add_part("link-a", 0, 3)
    cohort.add_part("link-b", 3, 6)
    call = call_of(list(range(6)))
    call.fan_out(cohort, 11)
    cohort.calls[11] = call
    tolerant = call_of(list(range(6)), tolerant=True)  # made on workers="ready"
    tolerant.fan_out(cohort, 12)
    cohort.calls[12] = tolerant
    assert all(dict(e.pending) == {11: call, 12: tolerant} for e in called)
    assert called[4].cohort_call(11) is call and 11 in called[4].pending
    # answers of link-a's run resolve places 0-2 at once: those ranks owe call 11 no more
    assert cohort.span("link-a", range(0, 3)) == 0
    assert cohort.span("link-b", range(2, 4)) == -1  # not that link's
    assert cohort.span("link-b", (3, 5)) == -1  # not a run of places
    assert call.resolve_span(0, gathered([0, 1, 2], [[pickle.dumps(r)] for r in range(3)]))
    assert [11 in e.pending for e in called] == [False] * 3 + [True] * 3
    # a membership change takes the calls not made on "ready" from rank 4 alone
    assert called[4].take_pending(lambda f: not f.tolerant) == [call]
    assert dict(called[4].pending) == {12: tolerant}
    assert 11 in called[5].pending and called[4].cohort_call(11) is None
    call.fail_rank(4, RuntimeError("rank 4 left"))
    # its death takes what is left of it
    assert called[4].take_pending() == [tolerant]
    assert not called[4].pending and len(called[4].pending) == 0
    call.resolve_rank(3, [pickle.dumps(3)])
    call.resolve_rank(5, [pickle.dumps(5)])
    assert 11 not in cohort.calls  # every place done: off the cohort
    with pytest.raises(RuntimeError, match="rank 4 left"):
        call.result(timeout=0)
    # a retired cohort leaves its entries once its last call is done
    cohort.retire()
    assert all(e.cohorts for e in called)
    for r in (0, 1, 2, 3, 5):
        tolerant.resolve_rank(r, [pickle.dumps(None)])
    tolerant.fail_rank(4, RuntimeError("gone"))
    assert not cohort.calls and all(not e.cohorts for e in called)


def test_pending_calls_of_an_entry_read_and_change_as_a_mapping():
    entry = entries(1)[0]
    call = call_of([0])
    entry.pending[3] = call
    assert entry.calls == {3: call} and entry.pending == {3: call}
    del entry.pending[3]
    assert not entry.pending and entry.calls == {}
    with pytest.raises(KeyError):
        entry.pending[3]


def test_a_frame_to_packed_ranks_is_the_call_frame_to_those_ranks():
    payload = [pickle.dumps(((), {}), protocol=5)]
    for ranks in ([4], [4, 5, 9]):
        part = protocol.ranks_part(ranks)
        assert protocol.call_frame_to(8, part, "step", payload) == \
            protocol.call_frame(8, ranks, "step", payload)
        assert protocol.call_frame_to(8, part, "step", payload, protocol.BUILTIN) == \
            protocol.call_frame(8, ranks, "step", payload, flags=protocol.BUILTIN)
    big = [b"x" * (framing.SMALL_FRAME + 1)]
    assert unframe(protocol.call_frame_to(8, protocol.ranks_part([1, 2]), "m", big)) == \
        unframe(protocol.call_frame(8, [1, 2], "m", big))


def test_a_run_of_answers_is_a_sign_of_life_of_those_ranks_only():
    called = entries(6)
    cohort = Cohort(list(range(6)), called, version=(0, 0))
    cohort.add_part("link-a", 0, 3)
    cohort.add_part("link-b", 3, 6)
    assert [e.seen for e in called] == [None] * 6 and not called[0].heard
    cohort.answered("link-a", 0, 3, 5.0)  # all of link-a's part: stamped at once
    cohort.answered("link-b", 3, 2, 6.0)  # part of link-b's: those ranks alone
    assert [e.seen for e in called] == [5.0, 5.0, 5.0, 6.0, 6.0, None]
    called[1].seen = 7.0  # a message of its own, later
    called[0].seen = 1.0  # ... or earlier than its part's
    assert [e.seen for e in called] == [5.0, 7.0, 5.0, 6.0, 6.0, None]
    assert called[0].last_sign == 5.0 and called[5].last_sign == called[5].started
