"""Which rows a handle names, alone (:mod:`phalanx.world.rowselect`): what users put
between brackets, normalised as Python's and numpy's own indexing read it; rows of rows
composed (a pick of a slice of a chunk ...); rows split into chunks. Checked on every case
hypothesis finds, against plain lists and numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.world.rowselect import Rows, canonical, count_rows, index_rows, narrow, split


def flat(parts) -> list[tuple[int, int]]:
    """Every row the parts name, as (source, row), in order."""
    return [(source, row) for source, rows in parts for row in rows]


def well_formed(rows: Rows) -> bool:
    """Picked rows that form a run are written as the run."""
    return (isinstance(rows, range) and rows.step == 1) or (
        isinstance(rows, tuple) and canonical(rows) == rows and len(rows) > 0)


# -- index_rows: what is between the brackets ----------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.none() | st.integers(-15, 15), st.none() | st.integers(-15, 15))
def test_a_slice_names_the_rows_a_lists_slice_does(count, start, stop):
    rows = index_rows(slice(start, stop), count, "v")
    assert isinstance(rows, range) and rows.step == 1
    assert list(rows) == list(range(count))[start:stop]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.lists(st.integers(-14, 14), max_size=10),
       st.sampled_from([list, np.array, range]))
def test_row_numbers_name_the_rows_python_and_numpy_index(count, numbers, form):
    if form is range:
        if len(numbers) < 2 or numbers[1] == numbers[0]:
            return
        index = range(numbers[0], numbers[1], 1 if numbers[1] > numbers[0] else -1)
        numbers = list(index)
    else:
        index = form(numbers) if form is list else np.array(numbers, dtype=np.int64)
    if all(-count <= i < count for i in numbers):
        rows = index_rows(index, count, "v")
        assert list(rows) == [list(range(count))[i] for i in numbers]
        assert list(rows) == np.arange(count)[np.array(numbers, dtype=np.intp)].tolist()
        assert well_formed(rows) or len(rows) == 0
    else:
        bad = next(i for i in numbers if not -count <= i < count)
        with pytest.raises(IndexError, match=f"row {bad} is out of range for its {count} rows"):
            index_rows(index, count, "v")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=12), st.booleans(), st.integers(-2, 2))
def test_a_mask_names_the_rows_numpy_does(mask, as_array, off):
    count = len(mask) + off
    index = np.array(mask, dtype=bool) if as_array else mask
    if off and (mask or as_array):  # (an empty list is no row numbers, not a mask)
        if count >= 0:
            with pytest.raises(IndexError, match=f"a mask of length {len(mask)} for a value "
                               f"of {count} rows"):
                index_rows(index, count, "v")
        return
    if off:
        return
    rows = index_rows(index, count, "v")
    assert list(rows) == np.arange(count)[np.array(mask, dtype=bool)].tolist()


def test_an_empty_list_is_no_rows_and_not_a_mask():
    assert index_rows([], 5, "v") == range(0)
    assert index_rows(np.array([], dtype=np.int64), 5, "v") == range(0)
    assert index_rows([], 0, "v") == range(0)


@pytest.mark.parametrize(("index", "error", "message"), [
    (2, TypeError, r"v\[2\]: a handle is indexed by rows.*ref\[\[2\]\]"),
    (True, TypeError, "indexed by rows"),
    (np.int32(1), TypeError, "indexed by rows"),
    (np.array(1), TypeError, "indexed by rows"),
    ((1, 2), TypeError, r"not a tuple.*ref\[\[1, 2\]\]"),
    ([1.0], TypeError, "not float"),
    (["1"], TypeError, "not str"),
    ([None], TypeError, "not NoneType"),
    ([True, 0], TypeError, "mixes bools and row numbers"),
    (np.array(["a"]), TypeError, "not of <U1"),
    (np.array([0.5]), TypeError, "not of float64"),
    (np.zeros((1, 3), bool), TypeError, "one-dimensional array, not one of 2 dimensions"),
    ("ab", TypeError, "indexed by rows"),
    ({1: 2}, TypeError, "indexed by rows"),
    (slice(0, 3, 2), ValueError, r"v\[0:3:2\]: rows are cut in one piece"),
    (slice(None, None, -1), ValueError, "step 1"),
])
def test_what_is_no_selection_of_rows_is_refused_saying_why(index, error, message):
    with pytest.raises(error, match=message):
        index_rows(index, 3, "v")


def test_object_arrays_of_numbers_or_bools_are_read_by_their_items():
    assert index_rows(np.array([2, 0], dtype=object), 3, "v") == (2, 0)
    assert index_rows(np.array([True, False, True], dtype=object), 3, "v") == (0, 2)


def test_a_long_selection_is_shown_shortened_in_its_error():
    with pytest.raises(IndexError) as caught:
        index_rows(list(range(100)), 50, "v")
    assert "v[[0, 1, 2, 3, 4, 5, ... 100 in all]]: row 50 is out of range" in str(caught.value)


# -- canonical -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=8))
def test_picked_rows_that_form_a_run_are_the_run(picked):
    rows = canonical(picked)
    assert list(rows) == picked
    is_run = picked == list(range(picked[0], picked[0] + len(picked))) if picked else True
    assert isinstance(rows, range) == is_run
    assert canonical(rows) == rows


# -- narrow: rows of parts ---------------------------------------------------------------------


def parts_strategy() -> st.SearchStrategy:
    """Parts as a handle holds them: each a source with a run of its rows or picked rows
    (in any order, repeating), or no rows (the one part of an empty handle, among others
    here too: narrow must take any)."""
    run = st.builds(lambda a, n: range(a, a + n), st.integers(0, 20), st.integers(0, 6))
    picked = st.lists(st.integers(0, 20), min_size=1, max_size=6).map(canonical)
    return st.lists(st.tuples(st.integers(0, 4), run | picked), max_size=5)


@st.composite
def rows_of(draw, count: int) -> Rows:
    """Rows of ``count`` rows, as index_rows gives them: a run or picked ones."""
    if draw(st.booleans()) or count == 0:
        a = draw(st.integers(0, count))
        return range(a, draw(st.integers(a, count)))
    return canonical(draw(st.lists(st.integers(0, count - 1), max_size=10)))


@settings(max_examples=500, deadline=None)
@given(parts_strategy(), st.data())
def test_narrow_names_exactly_the_rows_asked_for_in_order(parts, data):
    every = flat(parts)
    rows = data.draw(rows_of(len(every)))
    out = narrow(parts, rows)
    assert flat(out) == [every[i] for i in rows]
    assert count_rows(out) == len(rows)
    assert {source for source, _ in out} <= {source for source, _ in parts}
    if not parts:
        assert out == []
    elif len(rows) == 0:
        assert len(out) == 1  # an empty handle keeps one source, for its value's type
    else:
        assert all(len(r) and well_formed(r) for _, r in out)


@settings(max_examples=500, deadline=None)
@given(parts_strategy(), st.data())
def test_rows_of_rows_compose(parts, data):
    every = flat(parts)
    first = data.draw(rows_of(len(every)))
    second = data.draw(rows_of(len(first)))
    once = narrow(parts, first)
    assert flat(narrow(once, second)) == [every[first[i]] for i in second]
    # the same rows named at once, as the positions compose
    composed = canonical([first[i] for i in second])
    assert flat(narrow(parts, composed)) == flat(narrow(once, second))


def test_narrow_keeps_a_run_of_a_source_a_run():
    parts = [("a", range(10, 20)), ("b", (7, 3, 5))]
    assert narrow(parts, range(2, 12)) == [("a", range(12, 20)), ("b", (7, 3))]
    assert narrow(parts, (11, 0, 1, 2, 10, 12)) == [
        ("b", range(3, 4)), ("a", range(10, 13)), ("b", (7, 5))]  # one row: a run of one
    assert narrow([("b", (7, 8, 5))], range(0, 2)) == [("b", range(7, 9))]
    assert narrow(parts, range(13, 13)) == [("b", range(0))]
    assert narrow(parts, range(4, 4)) == [("a", range(14, 14))]


# -- split -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(1, 12), st.data())
def test_split_cuts_rows_in_order_into_sizes_differing_by_one(count, n, data):
    rows = data.draw(rows_of(count))
    pieces = split(rows, n)
    assert len(pieces) == n
    assert [i for piece in pieces for i in piece] == list(rows)
    sizes = [len(piece) for piece in pieces]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert all(well_formed(piece) or len(piece) == 0 for piece in pieces)
    if isinstance(rows, range):
        assert all(isinstance(piece, range) for piece in pieces)
