"""The one lifecycle of every handle (put() and keep=True): RefState's legal moves, and a
record's free / use / unuse / loss, checked on every sequence hypothesis finds."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import phalanx as px
from phalanx.backends.held import HeldObject
from phalanx.controller.refs import _LEGAL, Record, RefState
from phalanx.controller.shared import PutRecord

S = RefState


def test_the_table_of_moves_is_the_documented_one():
    assert _LEGAL == {
        S.LIVE: {S.FREED, S.RELEASED, S.LOST},
        S.FREED: {S.RELEASED, S.LOST},
        S.RELEASED: set(),
        S.LOST: set(),
    }
    for state in S:  # the docstring lists every state's moves
        assert f"{state.name:<9} ->" in RefState.__doc__


@pytest.mark.parametrize("start", list(S))
@pytest.mark.parametrize("to", list(S))
def test_a_move_is_made_only_if_legal(start, to):
    record = Record()
    record.state = start
    assert record.move(to) == (to in _LEGAL[start])
    assert record.state is (to if to in _LEGAL[start] else start)


def test_freeing_an_unused_record_releases_it_at_once():
    record = Record()
    assert record.free() is True
    assert record.state is S.RELEASED
    assert record.free() is False  # idempotent: the holder is told once


def test_freeing_a_record_in_use_waits_for_its_last_call():
    record = Record()
    record.users = 2
    assert record.free() is False and record.state is S.FREED
    assert record.unuse() is False and record.state is S.FREED
    assert record.unuse() is True and record.state is S.RELEASED


def test_a_lost_record_is_never_released():
    record = Record()
    record.users = 1
    assert record.move(S.LOST)
    assert record.free() is False
    assert record.unuse() is False
    assert record.state is S.LOST


_OPS = st.lists(st.sampled_from(["use", "unuse", "free", "lose", "close"]), max_size=30)


@given(_OPS)
def test_the_holder_is_told_to_let_go_at_most_once_and_only_when_unused(ops):
    record = Record()
    released = 0
    for op in ops:
        if op == "use":
            if record.usable:  # a call may name only a live record
                record.users += 1
        elif op == "unuse":
            if record.users:
                released += record.unuse()
        elif op == "free":
            released += record.free()
        elif op == "lose":
            record.move(S.LOST)
        else:  # the group shut down
            record.move(S.RELEASED)
        assert record.users >= 0
        if record.state is S.FREED:
            assert record.users > 0  # FREED only while calls still use it
    assert released <= 1
    if released:
        assert record.state is S.RELEASED and record.users == 0


def test_both_kinds_of_handle_are_object_refs():
    assert issubclass(px.ResultRef, px.ObjectRef)
    assert px.RefState is RefState


def test_a_handle_shows_its_state_and_cannot_be_pickled_by_hand():
    class Owner:
        def free(self, record):
            record.free()

        def describe(self, record):
            return "put object 7 (list)"

    ref = px.ObjectRef(Owner(), PutRecord(HeldObject(7, "t", None, 2048, "list")))
    assert ref.state is S.LIVE and not ref.freed and ref.nbytes == 2048
    with pytest.raises(TypeError, match="WorkerGroup that put it"):
        pickle.dumps(ref)
    ref.free()
    assert ref.state is S.RELEASED and ref.freed
    assert repr(ref) == "<ObjectRef 7: list, 2.0 KiB, freed>"
