"""Telling who a collective waits for (:mod:`phalanx.world.stuck`): the ranks' reports go
in, each collective with its absent and odd members comes out. Plain values only.

The scenes are a group of ``world_size`` ranks that may be one part of a bigger torch world
(global rank = the group's rank + an offset), whose process group's members are any set of
global ranks, some of them inside one collective."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.world.stuck import Inside, gather, offset_of, ranges

SIGNATURES = ["", "(4, 2) torch.float32", "(4, 2) torch.bfloat16", "(8,) torch.int64",
              "2 x (3,) torch.float32"]


@dataclass
class Scene:
    world_size: int
    offset: int
    members: list[int]  # the process group's, global ranks (some maybe outside the group)
    inside: list[int]  # the group's ranks inside the collective

    @property
    def group_members(self) -> list[int]:
        """The members that are ranks of this group (the group's ranks, in order)."""
        return sorted(m - self.offset for m in self.members
                      if self.offset <= m < self.offset + self.world_size)

    def report(self, rank: int, group: str = "0", seq: int = 1, signature: str = "",
               entered: float = 100.0, op: str = "all_reduce") -> Inside:
        return Inside(rank, group, seq, op, tuple(self.members), signature, entered,
                      rank + self.offset)


@st.composite
def scenes(draw: st.DrawFn, min_inside: int = 1) -> Scene:
    world_size = draw(st.integers(min_inside, 16))
    offset = draw(st.integers(0, 24))
    # global ranks below, in and above the group's
    universe = range(0, offset + world_size + 8)
    group = range(offset, offset + world_size)
    # at least min_inside of the group's own ranks belong to the process group
    own = draw(st.lists(st.sampled_from(group), min_size=min_inside, unique=True))
    others = draw(st.lists(st.sampled_from(universe), unique=True, max_size=24))
    members = sorted(set(own) | set(others))
    inside_globals = draw(st.lists(st.sampled_from(sorted(own)), min_size=min_inside,
                                   unique=True))
    return Scene(world_size, offset, members, sorted(g - offset for g in inside_globals))


# -- Inside.parse --------------------------------------------------------------------------

VALID = ["0", 3, "all_reduce", [0, 1, 2], "(4, 2) torch.float32", 1700000000.5, 1]


def test_parse_reads_the_fields_a_rank_sends():
    report = Inside.parse(1, VALID)
    assert report == Inside(1, "0", 3, "all_reduce", (0, 1, 2), "(4, 2) torch.float32",
                            1700000000.5, 1)


def test_parse_takes_an_integer_clock_as_seconds():
    report = Inside.parse(0, ["0", 1, "barrier", [0], "", 17, 0])
    assert report.entered == 17.0 and isinstance(report.entered, float)


@given(count=st.integers(0, 12).filter(lambda n: n != 7))
def test_parse_refuses_another_number_of_fields(count):
    fields = (VALID * 2)[:count]
    with pytest.raises(ValueError, match=f"{count} fields, not 7"):
        Inside.parse(0, fields)


WRONG = [
    (0, 0), (0, None), (0, b"0"),  # group: not text
    (1, "3"), (1, 3.0), (1, None),  # seq: not an integer
    (2, None), (2, 1),  # op
    (3, "0,1"), (3, None), (3, [0, "1"]), (3, [0, 1.0]), (3, {0: 1}),  # members
    (4, None), (4, (4, 2)),  # signature
    (5, "now"), (5, None),  # entered
    (6, "1"), (6, 1.0), (6, None),  # me
    (1, True), (3, [0, False]), (5, True), (6, False),  # a bool is no rank, number or time
]


@pytest.mark.parametrize("fields", [None, 7, "0", {"group": "0"}])
def test_parse_refuses_what_is_not_a_list_of_fields(fields):
    with pytest.raises(ValueError, match="not a list of fields"):
        Inside.parse(0, fields)


@pytest.mark.parametrize(("index", "value"), WRONG)
def test_parse_refuses_a_field_of_the_wrong_type(index, value):
    fields = list(VALID)
    fields[index] = value
    with pytest.raises(ValueError, match="wrong type"):
        Inside.parse(0, fields)


# -- gather: who is absent -------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(scene=scenes(), data=st.data())
def test_absent_are_the_group_members_not_inside_in_order(scene, data):
    reports = [scene.report(r) for r in scene.inside]
    reports = data.draw(st.permutations(reports))
    [waiting] = gather(reports, scene.world_size)
    assert waiting.members == tuple(scene.group_members)
    assert waiting.absent == tuple(r for r in scene.group_members if r not in scene.inside)
    assert sorted(waiting.inside) == scene.inside
    # only the group's ranks are judged: a global rank of another part of the world is not
    assert all(0 <= m < scene.world_size for m in waiting.members)
    assert set(waiting.absent) <= set(waiting.members)
    assert waiting.complete == (not waiting.absent)  # one signature: nothing odd


@given(scene=scenes())
def test_the_offset_is_read_from_the_reports(scene):
    assert offset_of(scene.report(r) for r in scene.inside) == scene.offset
    assert offset_of([]) == 0


def test_members_of_the_rest_of_a_bigger_world_are_not_named():
    # ranks 4..7 of a 12-rank torch world are this group's 0..3; the collective is the world's
    members = tuple(range(12))
    reports = [Inside(r, "0", 5, "all_reduce", members, "", 1.0, r + 4) for r in (0, 2)]
    [waiting] = gather(reports, 4)
    assert waiting.members == (0, 1, 2, 3)
    assert waiting.absent == (1, 3)


@settings(max_examples=200, deadline=None)
@given(scene=scenes(min_inside=2), seqs=st.lists(st.integers(1, 10_000), min_size=2,
                                                 max_size=2, unique=True), data=st.data())
def test_two_collectives_of_one_process_group_are_told_apart(scene, seqs, data):
    # the ranks are split between the n-th and the m-th collective of the same group
    at = {r: data.draw(st.sampled_from(seqs)) for r in scene.inside}
    at[scene.inside[0]], at[scene.inside[1]] = seqs  # both have someone in them
    reports = data.draw(st.permutations([scene.report(r, seq=at[r]) for r in scene.inside]))
    waits = gather(reports, scene.world_size)
    assert [w.key for w in waits] == [("0", s) for s in sorted(seqs)]
    for waiting in waits:
        in_it = [r for r in scene.inside if at[r] == waiting.seq]
        assert sorted(waiting.inside) == in_it
        assert waiting.absent == tuple(r for r in scene.group_members if r not in in_it)
        assert not waiting.complete  # each waits for the ranks in the other


def test_collectives_of_two_process_groups_with_one_number_are_told_apart():
    reports = [Inside(0, "0", 1, "all_reduce", (0, 1), "", 1.0, 0),
               Inside(1, "1", 1, "broadcast", (1,), "", 2.0, 1)]
    waits = gather(reports, 2)
    assert [(w.key, w.op, w.absent, w.complete) for w in waits] == [
        (("0", 1), "all_reduce", (1,), False), (("1", 1), "broadcast", (), True)]


def test_nothing_reported_is_nothing_waiting():
    assert gather([], 8) == []


# -- gather: who is odd ------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(scene=scenes(min_inside=1), common=st.sampled_from(SIGNATURES), data=st.data())
def test_the_minority_with_other_signatures_is_odd(scene, common, data):
    # fewer than half of those inside have another signature: the rest share ``common``
    minority = data.draw(st.lists(st.sampled_from(scene.inside), unique=True,
                                  max_size=(len(scene.inside) - 1) // 2))
    theirs = {r: data.draw(st.sampled_from([s for s in SIGNATURES if s != common]))
              for r in minority}
    reports = [scene.report(r, signature=theirs.get(r, common)) for r in scene.inside]
    [waiting] = gather(data.draw(st.permutations(reports)), scene.world_size)
    # what is compared is the call: the operation and its signature
    assert waiting.common == f"all_reduce {common}".rstrip()
    assert waiting.odd == {r: f"all_reduce {s}".rstrip() for r, s in theirs.items()}
    assert waiting.complete == (not waiting.absent and not minority)


@given(data=st.data())
def test_another_operation_at_the_same_number_is_odd_whatever_its_shape(data):
    # rank 1 is in broadcast #1 where ranks 0 and 2 are in all_reduce #1, on one tensor shape
    reports = [Inside(r, "0", 1, "broadcast" if r == 1 else "all_reduce", (0, 1, 2),
                      "(4,) torch.float32", 1.0, r) for r in range(3)]
    [waiting] = gather(data.draw(st.permutations(reports)), 3)
    assert waiting.op == "all_reduce" and waiting.common == "all_reduce (4,) torch.float32"
    assert waiting.odd == {1: "broadcast (4,) torch.float32"}
    assert not waiting.complete


@settings(max_examples=200, deadline=None)
@given(scene=scenes(min_inside=1), data=st.data())
def test_the_judgement_does_not_depend_on_the_order_of_the_reports(scene, data):
    signature = {r: data.draw(st.sampled_from(SIGNATURES)) for r in scene.inside}
    seq = {r: data.draw(st.integers(1, 3)) for r in scene.inside}
    reports = [scene.report(r, seq=seq[r], signature=signature[r], entered=float(r))
               for r in scene.inside]
    shuffled = data.draw(st.permutations(reports))
    assert gather(shuffled, scene.world_size) == gather(reports, scene.world_size)


@given(data=st.data())
def test_a_tie_names_the_same_odd_ranks_whatever_the_order(data):
    # two ranks with one signature, two with another: every order gives the same verdict
    signatures = ["(4, 2) torch.float32", "(4, 2) torch.float32",
                  "(4, 2) torch.bfloat16", "(4, 2) torch.bfloat16"]
    reports = [Inside(r, "0", 1, "all_reduce", (0, 1, 2, 3), s, 1.0, r)
               for r, s in enumerate(signatures)]
    [waiting] = gather(data.draw(st.permutations(reports)), 4)
    assert waiting.common == "all_reduce (4, 2) torch.float32"  # the greater of the two
    assert waiting.odd == {2: "all_reduce (4, 2) torch.bfloat16",
                           3: "all_reduce (4, 2) torch.bfloat16"}


@settings(max_examples=300, deadline=None)
@given(scene=scenes(min_inside=1), data=st.data())
def test_complete_exactly_when_no_one_is_absent_or_odd(scene, data):
    signature = {r: data.draw(st.sampled_from(SIGNATURES[:2])) for r in scene.inside}
    [waiting] = gather([scene.report(r, signature=signature[r]) for r in scene.inside],
                       scene.world_size)
    everyone = set(scene.inside) >= set(scene.group_members)
    assert waiting.complete == (everyone and len(set(signature.values())) == 1)
    assert waiting.complete == (not waiting.absent and not waiting.odd)


# -- Waiting's properties ----------------------------------------------------------------------

@given(scene=scenes(min_inside=1), data=st.data())
def test_since_is_when_the_first_rank_entered_and_key_names_it(scene, data):
    entered = {r: data.draw(st.floats(0, 2e9)) for r in scene.inside}
    [waiting] = gather([scene.report(r, group="7", seq=42, entered=entered[r])
                        for r in scene.inside], scene.world_size)
    assert waiting.since == min(entered.values())
    assert waiting.key == ("7", 42)
    assert waiting.op == "all_reduce"


# -- ranges --------------------------------------------------------------------------------------

def _parse_ranges(text: str) -> list[int]:
    """The ranks a :func:`ranges` text names (its inverse)."""
    out: list[int] = []
    for part in filter(None, text.split(", ")):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


@pytest.mark.parametrize(("ranks", "text"), [
    ([], ""), ([5], "5"), ([0, 1, 3], "0, 1, 3"), (range(8), "0-7"), ([3, 0, 1, 2, 5], "0-3, 5"),
    ([0, 1, 4, 5, 6, 9], "0, 1, 4-6, 9"), ({2: "x", 1: "y", 0: "z"}, "0-2"),
])
def test_ranges_spells_runs_of_three_or_more_as_a_span(ranks, text):
    assert ranges(ranks) == text


@given(ranks=st.lists(st.integers(0, 5000), unique=True, max_size=60))
def test_ranges_round_trips_and_collapses_every_run_of_three(ranks):
    text = ranges(ranks)
    assert re.fullmatch(r"(\d+(-\d+)?(, \d+(-\d+)?)*)?", text)
    assert _parse_ranges(text) == sorted(ranks)
    parts = [(int(low), int(high or low), bool(high))
             for low, _, high in (p.partition("-") for p in filter(None, text.split(", ")))]
    assert all(high - low >= 2 for low, high, span in parts if span)
    # every span is a whole run: the part before it and the one after do not continue it
    for (_, end, span), (start, _, next_span) in itertools.pairwise(parts):
        assert not (span or next_span) or start > end + 1
    # and no three single numbers in a row are left that a span should have taken
    singles = [low for low, _, span in parts if not span]
    assert not any(singles[i] + 2 == singles[i + 1] + 1 == singles[i + 2]
                   for i in range(len(singles) - 2))

