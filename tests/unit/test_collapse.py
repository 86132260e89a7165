"""Collapsing identical lines from several ranks: pure logic, driven with explicit times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.output.collapse import LineCollapser, format_ranks


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([3], "rank 3"),
        ([0, 1, 2, 3], "ranks 0-3"),
        ([2, 0], "ranks 0,2"),
        ([7, 0, 1, 2, 5, 6], "ranks 0-2,5-7"),
        ([4, 4, 5], "ranks 4-5"),
    ],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def shown(lines):
    return [(line.prefix, line.text, line.stderr) for line in lines]


def test_identical_lines_from_every_rank_come_out_once_at_once():
    c = LineCollapser(window=0.2, world=4)
    assert c.add(2, "epoch 1", False, now=0.0) == []
    assert c.add(0, "epoch 1", False, now=0.01) == []
    assert c.add(3, "epoch 1", False, now=0.02) == []
    out = c.add(1, "epoch 1", False, now=0.03)  # the last rank: no need to wait
    assert shown(out) == [("[ranks 0-3]", "epoch 1", False)]
    assert c.next_deadline() is None


def test_a_line_waits_out_its_window_then_shows_who_wrote_it():
    c = LineCollapser(window=0.2, world=4)
    c.add(1, "loss 0.5", False, now=0.0)
    c.add(3, "loss 0.5", False, now=0.1)
    assert c.next_deadline() == pytest.approx(0.2)
    assert c.due(0.19) == []
    assert shown(c.due(0.2)) == [("[ranks 1,3]", "loss 0.5", False)]
    c.add(2, "loss 0.5", False, now=0.5)  # too late to join: a line of its own
    assert shown(c.flush()) == [("[rank 2]", "loss 0.5", False)]


def test_stdout_and_stderr_lines_do_not_merge():
    c = LineCollapser(window=0.2, world=2)
    c.add(0, "same", False, now=0.0)
    c.add(1, "same", True, now=0.0)
    assert shown(c.flush()) == [("[rank 0]", "same", False), ("[rank 1]", "same", True)]


def test_lines_come_out_in_the_order_first_written():
    c = LineCollapser(window=0.2, world=3)
    c.add(0, "a", False, now=0.0)
    c.add(0, "b", False, now=0.01)
    out = c.add(1, "b", False, now=0.02) + c.add(2, "b", False, now=0.03)
    assert out == []  # "b" is complete but "a" is still held before it
    assert shown(c.due(0.2)) == [("[rank 0]", "a", False), ("[ranks 0-2]", "b", False)]


def test_a_rank_repeating_a_line_gets_two_lines():
    c = LineCollapser(window=0.2, world=2)
    out = c.add(0, "tick", False, now=0.0) + c.add(0, "tick", False, now=0.0)
    out += c.add(1, "tick", False, now=0.0) + c.add(1, "tick", False, now=0.0)
    assert shown(out) == [("[ranks 0-1]", "tick", False)] * 2


def test_window_zero_passes_every_line_through():
    c = LineCollapser(window=0.0, world=2)
    assert shown(c.add(0, "x", False, now=0.0)) == [("[rank 0]", "x", False)]
    assert shown(c.add(1, "x", False, now=0.0)) == [("[rank 1]", "x", False)]
    assert c.flush() == []


events = st.lists(
    st.tuples(
        st.integers(0, 3),  # rank
        st.sampled_from(["a", "b", "c"]),  # text
        st.booleans(),  # stderr
        st.floats(0, 0.3),  # time since the previous event
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events, st.sampled_from([0.0, 0.05, 0.2]))
def test_every_line_comes_out_once_and_each_rank_keeps_its_order(evts, window):
    c = LineCollapser(window=window, world=4)
    now = 0.0
    out = []
    for rank, text, stderr, gap in evts:
        now += gap
        out += c.due(now)
        out += c.add(rank, text, stderr, now)
    out += c.flush()
    assert c.next_deadline() is None
    # every written line is shown exactly once, attributed to its rank
    written = sorted((r, t, e) for r, t, e, _ in evts)
    shown_lines = sorted((r, line.text, line.stderr) for line in out for r in line.ranks)
    assert written == shown_lines
    for line in out:
        assert line.ranks == sorted(set(line.ranks))
    # each rank's lines appear in the order it wrote them (per stream)
    for rank in range(4):
        for stderr in (False, True):
            mine = [t for r, t, e, _ in evts if r == rank and e == stderr]
            seen = [line.text for line in out if rank in line.ranks and line.stderr == stderr]
            assert seen == mine
    if window == 0.0:
        assert all(len(line.ranks) == 1 for line in out)


def test_ranks_that_print_a_unique_line_first_still_collapse_the_shared_one():
    c = LineCollapser(window=0.2, world=3)
    out = []
    for rank in (0, 2, 1):  # each rank: its own line, then the shared one
        out += c.add(rank, f"hello from {rank}", False, now=0.0)
        out += c.add(rank, "same line", False, now=0.0)
    out += c.flush()
    assert shown(out) == [
        ("[rank 0]", "hello from 0", False),
        ("[rank 2]", "hello from 2", False),
        ("[rank 1]", "hello from 1", False),
        ("[ranks 0-2]", "same line", False),
    ]


def test_a_join_that_would_reorder_another_ranks_lines_starts_a_new_line():
    c = LineCollapser(window=0.2, world=2)
    c.add(0, "same", False, now=0.0)
    c.add(0, "after", False, now=0.0)  # rank 0 printed more after "same"
    c.add(1, "first", False, now=0.0)
    c.add(1, "same", False, now=0.0)  # joining would put "same" after rank 0's "after"
    assert shown(c.flush()) == [
        ("[rank 0]", "same", False),
        ("[rank 0]", "after", False),
        ("[rank 1]", "first", False),
        ("[rank 1]", "same", False),
    ]
