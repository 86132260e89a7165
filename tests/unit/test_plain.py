"""Header fields as plain data: everything plain comes back equal, nothing else goes in,
and no byte string makes the reader do more than raise ValueError."""

from __future__ import annotations

import enum
import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.wire import plain

leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**70)
          | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20))
hashable = st.recursive(leaves, lambda inner: st.tuples(inner, inner), max_leaves=4)
values = st.recursive(
    leaves,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(hashable, inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(values)
def test_plain_values_round_trip_with_their_types(value):
    got = plain.loads(plain.dumps(value))
    assert got == value
    assert type(got) is type(value)


def test_subclasses_come_back_as_the_plain_type():
    class Colour(enum.IntEnum):
        RED = 1

    assert plain.loads(plain.dumps([Colour.RED])) == [1]
    assert type(plain.loads(plain.dumps(Colour.RED))) is int
    assert math.isnan(plain.loads(plain.dumps(float("nan"))))


@pytest.mark.parametrize("value", [object(), {1, 2}, ValueError("x"), [1, print]])
def test_anything_richer_is_refused_by_name(value):
    with pytest.raises(TypeError, match="plain data"):
        plain.dumps(value)


def test_a_pickle_is_not_read_as_fields():
    evil = pickle.dumps(("x",))
    with pytest.raises(ValueError, match="malformed"):
        plain.loads(evil)


def test_deep_nesting_is_refused_both_ways():
    deep: list = []
    for _ in range(plain.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        plain.dumps(deep)
    with pytest.raises(ValueError, match="deeper"):
        plain.loads(b"l\x01\x00\x00\x00" * (plain.MAX_DEPTH + 2) + b"N")


def test_a_huge_announced_count_fails_at_once():
    with pytest.raises(ValueError, match="past the end"):
        plain.loads(b"l\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="past the end"):
        plain.loads(b"s\xff\xff\xff\x7fabc")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_are_a_value_or_a_value_error(data):
    try:
        plain.loads(data)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_a_truncated_value_is_malformed(value, data):
    encoded = plain.dumps(value)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    with pytest.raises(ValueError):
        plain.loads(encoded[:cut])
