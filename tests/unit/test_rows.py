"""Rows of kept results, without a rank: how a value's rows are counted, cut and joined
(:mod:`phalanx.rank.rows`: runs as views, picked rows gathered), how handles are sliced
and picked from (``ref[a:b]``, ``ref[[0, 2]]``, ``ref[mask]``, again on a ``SliceRef``) and
re-cut across several (:func:`px.chunk`, its chunks' ``indices``), checked on every case
hypothesis finds; and rows read in this process from real kept blocks (``read_rows``).
The index logic itself, alone, is tests/unit/test_rowselect.py's."""

from __future__ import annotations

import collections
import gc
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phalanx as px
from phalanx.backends.held import HeldObject
from phalanx.controller.chunks import chunk
from phalanx.controller.kept import KeptRecord
from phalanx.controller.refs import ResultRef, SliceRef
from phalanx.controller.shared import PutRecord
from phalanx.rank import kept as rankkept
from phalanx.rank import rows
from phalanx.rank.rows import Shape

# -- phalanx.rank.rows: layout and rows_of ---------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (np.arange(7), (Shape.ARRAY, 7)),
    (np.zeros((3, 4, 5)), (Shape.ARRAY, 3)),
    (np.zeros((0, 4)), (Shape.ARRAY, 0)),
    ({"tokens": np.zeros((5, 8)), "lengths": np.zeros(5)}, (Shape.FIELDS, 5)),
    ((np.zeros(4), np.zeros((4, 2))), (Shape.FIELDS, 4)),
    # a list's items are its rows, whatever their lengths: never fields
    ([np.zeros(6), np.zeros((6, 3))], (Shape.ITEMS, 2)),
    ([np.zeros(2), np.zeros(3)], (Shape.ITEMS, 2)),
    ([{"a": 1}, {"a": 2}, {"a": 3}], (Shape.ITEMS, 3)),
    ([1, "two", None], (Shape.ITEMS, 3)),
    ([], (Shape.ITEMS, 0)),
    ([np.zeros(()), np.zeros(())], (Shape.ITEMS, 2)),  # 0-d arrays have no rows: items
])
def test_layout_counts_rows_of_arrays_fields_and_items(value, expected):
    assert rows.layout(value) == expected
    assert rows.rows_of(value) == expected[1]


@pytest.mark.parametrize("value", [
    np.zeros(()),  # a 0-d array
    np.float64(3.0),  # a numpy scalar (shape ())
    7,
    3.5,
    "a string",
    b"bytes",
    None,
    {},
    (),
    {"a": np.zeros(3), "b": np.zeros(4)},  # mismatched first dims
    (np.zeros(3), np.zeros(4)),
    {"a": np.zeros(3), "n": 3},  # a field with no rows
    {"a": np.zeros(()), "b": np.zeros(())},
    np.ndarray,  # a class with a ``shape`` attribute is no array
])
def test_values_without_rows_have_none(value):
    assert rows.layout(value) is None
    assert rows.rows_of(value) is None


def test_a_symbolic_first_dimension_is_no_rows():
    class Symbolic:
        shape = (None, 3)

    assert rows.rows_of(Symbolic()) is None


def test_torch_tensors_have_rows_as_arrays_do():
    torch = pytest.importorskip("torch")
    assert rows.layout(torch.zeros(5, 2)) == (Shape.ARRAY, 5)
    assert rows.layout({"x": torch.zeros(3), "y": torch.zeros(3, 4)}) == (Shape.FIELDS, 3)
    assert rows.rows_of(torch.tensor(1.0)) is None


# -- take ------------------------------------------------------------------------------


def test_take_cuts_an_array_as_a_view():
    value = np.arange(20).reshape(10, 2)
    part = rows.take(value, 3, 7)
    np.testing.assert_array_equal(part, value[3:7])
    assert np.shares_memory(part, value)  # no copy
    assert rows.take(value, 0, 10) is value  # all of it: the value itself
    assert rows.take(value, 0, 99) is value
    assert rows.take(value, 4, 4).shape == (0, 2)


def test_take_cuts_every_field_the_same_way():
    batch = {"tokens": np.arange(12).reshape(6, 2), "mask": np.arange(6) % 2 == 0}
    part = rows.take(batch, 2, 5)
    assert list(part) == ["tokens", "mask"]
    np.testing.assert_array_equal(part["tokens"], batch["tokens"][2:5])
    np.testing.assert_array_equal(part["mask"], batch["mask"][2:5])
    assert all(np.shares_memory(part[k], batch[k]) for k in batch)
    pair = (np.arange(6), np.arange(6) * 10)
    cut_pair = rows.take(pair, 1, 3)
    assert type(cut_pair) is tuple and len(cut_pair) == 2
    assert [a.tolist() for a in cut_pair] == [[1, 2], [10, 20]]
    listed = rows.take([np.arange(4), np.arange(4) + 4], 0, 1)  # a list: its items
    assert type(listed) is list and [a.tolist() for a in listed] == [[0, 1, 2, 3]]


def test_take_cuts_a_list_of_items():
    items = [{"i": i} for i in range(5)]
    assert rows.take(items, 1, 3) == [{"i": 1}, {"i": 2}]
    assert rows.take([np.zeros(2), np.zeros(3), np.zeros(4)], 1, 3)[1].shape == (4,)


@pytest.mark.parametrize("value", [np.zeros(()), 5, {"a": np.zeros(2), "b": np.zeros(3)}])
def test_take_refuses_a_value_without_rows(value):
    with pytest.raises(TypeError, match="has no rows to slice"):
        rows.take(value, 0, 1)


def test_take_and_join_keep_a_named_tuple_of_arrays():
    # A batch as a NamedTuple of arrays is a tuple of arrays with one first dimension:
    # counted as rows, so it must be cut and joined as one too.
    Batch = collections.namedtuple("Batch", ["tokens", "lengths"])
    batch = Batch(np.arange(8).reshape(4, 2), np.arange(4))
    assert rows.layout(batch) == (Shape.FIELDS, 4)
    part = rows.take(batch, 1, 3)
    assert type(part) is Batch
    np.testing.assert_array_equal(part.tokens, batch.tokens[1:3])
    joined = rows.join([rows.take(batch, 0, 1), rows.take(batch, 1, 4)])
    assert type(joined) is Batch
    np.testing.assert_array_equal(joined.lengths, batch.lengths)


# -- pick and cut ----------------------------------------------------------------------


def test_pick_gathers_rows_of_an_array_in_the_order_given():
    value = np.arange(20).reshape(10, 2)
    part = rows.pick(value, (7, 0, 7, -1))
    np.testing.assert_array_equal(part, value[[7, 0, 7, -1]])
    assert not np.shares_memory(part, value)  # gathered: a value of its own
    assert rows.pick(value, ()).shape == (0, 2)
    assert rows.cut(value, range(2, 4)).base is not None  # a run: a view
    np.testing.assert_array_equal(rows.cut(value, (3, 1)), value[[3, 1]])
    assert rows.cut(value, range(10)) is value


def test_pick_gathers_every_field_alike_and_a_lists_items_by_number():
    batch = {"tokens": np.arange(12).reshape(6, 2), "mask": np.arange(6) % 2 == 0}
    part = rows.pick(batch, (4, 1))
    assert list(part) == ["tokens", "mask"]
    assert part["tokens"].tolist() == [[8, 9], [2, 3]] and part["mask"].tolist() == [1, 0]
    Batch = collections.namedtuple("Batch", ["tokens", "lengths"])
    named = rows.pick(Batch(np.arange(8).reshape(4, 2), np.arange(4)), (3, 3))
    assert type(named) is Batch and named.lengths.tolist() == [3, 3]
    pair = rows.pick((np.arange(3), np.arange(3) * 10), (2,))
    assert type(pair) is tuple and [a.tolist() for a in pair] == [[2], [20]]
    items = [{"i": i} for i in range(5)]
    assert rows.pick(items, (4, 0, 4)) == [{"i": 4}, {"i": 0}, {"i": 4}]
    ragged = rows.pick([np.zeros(2), np.zeros(3), np.zeros(4)], (2, 0))
    assert [len(r) for r in ragged] == [4, 2]
    with pytest.raises(TypeError, match="has no rows to slice"):
        rows.pick(5, (0,))


def test_pick_gathers_torch_tensors_with_torch():
    torch = pytest.importorskip("torch")
    value = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    part = rows.pick(value, (4, 0))
    assert isinstance(part, torch.Tensor) and part.tolist() == [[8.0, 9.0], [0.0, 1.0]]
    assert rows.pick(value, ()).shape == (0, 2)
    fields = rows.pick({"t": torch.arange(3), "n": np.arange(3)}, (2, 1))
    assert isinstance(fields["t"], torch.Tensor) and fields["t"].tolist() == [2, 1]
    assert isinstance(fields["n"], np.ndarray) and fields["n"].tolist() == [2, 1]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.data(), st.sampled_from(["array", "dict", "items"]))
def test_pick_is_numpys_indexing_of_the_rows(n, data, kind):
    picked = tuple(data.draw(st.lists(st.integers(0, n - 1), max_size=15)))
    base = np.arange(n * 3).reshape(n, 3)
    value = {"array": base, "dict": {"a": base, "b": base[:, 0]},
             "items": [f"row {i}" for i in range(n)]}[kind]
    got = rows.pick(value, picked)
    if kind == "items":
        assert got == [f"row {i}" for i in picked]
    elif kind == "dict":
        np.testing.assert_array_equal(got["a"], base[list(picked)])
        np.testing.assert_array_equal(got["b"], base[list(picked), 0])
    else:
        np.testing.assert_array_equal(got, base[list(picked)])


# -- join ------------------------------------------------------------------------------


def test_join_concatenates_arrays_fields_and_chains_items():
    a, b = np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)
    np.testing.assert_array_equal(rows.join([a, b]), np.concatenate([a, b]))
    first = {"x": np.arange(3), "y": np.zeros((3, 2))}
    second = {"x": np.arange(3, 5), "y": np.ones((2, 2))}
    joined = rows.join([first, second])
    assert list(joined) == ["x", "y"]
    assert joined["x"].tolist() == [0, 1, 2, 3, 4]
    assert joined["y"].tolist() == [[0, 0]] * 3 + [[1, 1]] * 2
    pairs = rows.join([(np.arange(2), np.arange(2) * 2), (np.arange(1), np.arange(1) * 2)])
    assert type(pairs) is tuple and [p.tolist() for p in pairs] == [[0, 1, 0], [0, 2, 0]]
    assert rows.join([[1, 2], [3], []]) == [1, 2, 3]
    one = {"x": np.arange(3)}
    assert rows.join([one]) is one  # one part: itself
    assert rows.join([]) == []  # a handle on no kept result: an empty list


def test_join_chains_items_whatever_shape_the_items_of_each_cut_have():
    # Rollouts of different lengths are a list of items; a chunk spanning two producers
    # joins a cut of each. A cut whose items happen to share a length is still items.
    first = [np.zeros(5), np.zeros(3)]
    second = [np.ones(3), np.ones(7)]
    assert rows.layout(first) == rows.layout(second) == (Shape.ITEMS, 2)
    joined = rows.join([rows.take(first, 1, 2), rows.take(second, 0, 1)])
    assert [item.tolist() for item in joined] == [[0.0] * 3, [1.0] * 3]


def test_join_concatenates_torch_tensors_with_torch():
    torch = pytest.importorskip("torch")
    joined = rows.join([torch.arange(3), torch.arange(3, 5)])
    assert isinstance(joined, torch.Tensor) and joined.tolist() == [0, 1, 2, 3, 4]
    fields = rows.join([{"t": torch.zeros(2)}, {"t": torch.ones(1)}])
    assert isinstance(fields["t"], torch.Tensor) and fields["t"].tolist() == [0, 0, 1]


@pytest.mark.parametrize(("parts", "message"), [
    ([np.zeros(2), [1, 2]], r"part 1 is a list \(items, 2 rows\), part 0 a ndarray"),
    ([{"a": np.zeros(1), "b": np.zeros(1)}, {"a": np.zeros(1), "b": np.zeros(1)},
      {"a": np.zeros(1), "c": np.zeros(1)}],
     r"part 2 is a dict of \['a', 'c'\], part 0 a dict of \['a', 'b'\]"),
    ([(np.zeros(1), np.zeros(1)), (np.zeros(1),)], r"part 1 is a tuple"),
    ([[np.zeros(1)], (np.zeros(1),)], r"part 1 is a tuple"),
    ([np.zeros(1), 5], r"part 1 is a int"),
])
def test_join_names_the_first_part_that_does_not_match(parts, message):
    with pytest.raises(TypeError, match=message):
        rows.join(parts)


def test_join_refuses_parts_without_rows():
    with pytest.raises(TypeError, match="cannot join parts of type int"):
        rows.join([1, 2])


_SPLITS = st.lists(st.integers(0, 30), max_size=5)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30), _SPLITS, st.sampled_from(["array", "dict", "tuple", "items"]))
def test_joining_the_cuts_of_a_value_gives_the_value(n, splits, kind):
    base = np.arange(n * 2).reshape(n, 2)
    value = {"array": base,
             "dict": {"a": base, "b": base[:, 0] * 10},
             "tuple": (base, base[:, 0] * 10),
             "items": [{"i": i} for i in range(n)]}[kind]
    bounds = [0, *sorted(min(s, n) for s in splits), n]
    parts = [rows.take(value, a, b) for a, b in itertools.pairwise(bounds)]
    assert sum(rows.rows_of(p) for p in parts) == n
    joined = rows.join(parts)
    if kind == "items":
        assert joined == value
    elif kind == "dict":
        assert list(joined) == ["a", "b"]
        assert all(np.array_equal(joined[k], value[k]) for k in value)
    elif kind == "tuple":
        assert type(joined) is tuple
        assert all(np.array_equal(j, v) for j, v in zip(joined, value, strict=True))
    else:
        np.testing.assert_array_equal(joined, value)


# -- handles: ResultRef, SliceRef, chunk (on a stand-in owner) ---------------------------


class Owner:
    """A stand-in for a group's KeptResults: what a handle needs of its owner."""

    def __init__(self) -> None:
        self.freed: list[int] = []
        self.values: dict[int, object] = {}

    def free(self, record) -> None:
        if record.free():
            self.freed.append(record.id)

    def describe(self, record) -> str:
        return f"the result of {record.method}() on rank {record.rank} of group G"

    def reduce(self, ref, consumer):
        record = ref.record
        return rankkept.read, (record.location, self.describe(record), None)

    def get(self, ref, timeout):
        return self.values[ref.id]


_IDS = iter(range(1, 1 << 30))


def make_ref(n: int | None, owner: Owner | None = None, value: object = None) -> ResultRef:
    """A real ResultRef on ``n`` rows (None: a value without rows), as KeptResults.adopt
    makes one."""
    owner = owner or Owner()
    record = KeptRecord(next(_IDS), 0, -1, "make", 8 * (n or 1), None, None, n)
    if value is not None:
        owner.values[record.id] = value
    return ResultRef(owner, record)


def flat(parts) -> list[tuple[int, int]]:
    """Every row the parts name, as (handle id, row), in order."""
    return [(ref.id, row) for ref, rows in parts for row in rows]


def rows_of_refs(refs) -> list[tuple[int, int]]:
    out = []
    for ref in refs:
        out += flat(ref.parts) if isinstance(ref, SliceRef) else flat([(ref, range(ref.rows))])
    return out


def test_a_handle_is_sliced_by_rows():
    ref = make_ref(10)
    assert ref.rows == 10
    part = ref[2:5]
    assert isinstance(part, px.SliceRef)
    assert part.parts == ((ref, range(2, 5)),) and part.rows == 3 == len(part)
    assert part.refs == (ref,)
    assert part.indices == range(2, 5)
    assert ref[-3:].parts == ((ref, range(7, 10)),)
    assert ref[:].parts == ((ref, range(10)),)
    assert ref[:100].parts == ((ref, range(10)),)  # clamped, as a list's slice is
    assert ref[7:3].rows == 0  # empty, at row 7
    assert ref[7:3].parts == ((ref, range(7, 7)),)
    assert ref[::1].rows == 10


def test_a_handle_picks_rows_by_number_in_the_order_given():
    ref = make_ref(10)
    part = ref[[5, 0, 2]]
    assert isinstance(part, px.SliceRef)
    assert part.parts == ((ref, (5, 0, 2)),) and part.rows == 3
    assert part.indices == [5, 0, 2]  # a list: numpy reads a tuple as dimensions
    assert ref[[-1, -10]].parts == ((ref, (9, 0)),)  # from the end, as Python's
    assert ref[[3, 3]].parts == ((ref, (3, 3)),)  # a row twice, as numpy gives it
    assert ref[range(4, 1, -1)].parts == ((ref, (4, 3, 2)),)
    # a run of rows is read as the slice of it is: views, nothing gathered
    assert ref[[2, 3, 4]].parts == ref[2:5].parts == ((ref, range(2, 5)),)
    assert ref[[2, 3, 4]].indices == range(2, 5)
    assert ref[[]].rows == 0 and ref[[]].parts == ((ref, range(0)),)
    assert "[[5, 0, 2]] (3 rows)" in repr(part)


def test_a_handle_picks_rows_by_a_mask_and_by_arrays():
    ref = make_ref(6)
    mask = [True, False, True, True, False, False]
    assert ref[mask].parts == ((ref, (0, 2, 3)),)
    assert ref[np.array(mask)].parts == ((ref, (0, 2, 3)),)
    assert ref[np.array([4, -6], dtype=np.int32)].parts == ((ref, (4, 0)),)
    assert ref[np.array([1, 2], dtype=np.uint8)].parts == ((ref, range(1, 3)),)
    assert ref[[np.int64(5), np.int64(1)]].parts == ((ref, (5, 1)),)
    assert ref[list(np.array(mask))].parts == ((ref, (0, 2, 3)),)  # numpy's own bools
    assert ref[[False] * 6].rows == 0
    torch = pytest.importorskip("torch")
    assert ref[torch.tensor([3, 1])].parts == ((ref, (3, 1)),)
    assert ref[torch.tensor(mask)].parts == ((ref, (0, 2, 3)),)


@pytest.mark.parametrize(("index", "error", "message"), [
    (slice(None, None, 2), ValueError, r"step 1.*ref\[\[0, 2, 4\]\]"),
    (slice(None, None, -1), ValueError, "step 1"),
    (3, TypeError, r"indexed by rows.*ref\[\[3\]\]"),
    (np.int64(3), TypeError, "indexed by rows"),
    ("a", TypeError, "indexed by rows"),
    (None, TypeError, "indexed by rows"),
    ({0, 1}, TypeError, "indexed by rows"),
    ((0, 2), TypeError, r"by a list, not a tuple.*ref\[\[0, 2\]\]"),
    ((slice(0, 1), slice(0, 1)), TypeError, "by a list, not a tuple"),
    ([0.5], TypeError, r"integers or bools, not float \(0.5\)"),
    (["0"], TypeError, "integers or bools, not str"),
    ([True, 1], TypeError, "mixes bools and row numbers"),
    (np.array([0.0, 1.0]), TypeError, "not of float64"),
    (np.zeros((2, 2), int), TypeError, "one-dimensional"),
    ([10], IndexError, "row 10 is out of range for its 10 rows"),
    ([0, -11], IndexError, "row -11 is out of range for its 10 rows"),
    ([True] * 9, IndexError, "a mask of length 9 for a value of 10 rows"),
    (np.ones(11, bool), IndexError, "a mask of length 11 for a value of 10 rows"),
])
def test_what_cannot_index_a_handle_is_refused_naming_it(index, error, message):
    ref = make_ref(10)
    with pytest.raises(error, match=message):
        ref[index]
    with pytest.raises(error, match=message):
        make_ref(12)[1:11][index]


def test_an_index_error_names_the_handle():
    ref = make_ref(4)
    with pytest.raises(IndexError, match=r"<ResultRef the result of make\(\) on rank 0"):
        ref[[4]]


def test_a_handle_without_rows_cannot_be_sliced():
    ref = make_ref(None)
    assert ref.rows is None
    with pytest.raises(TypeError, match="has no rows"):
        ref[0:1]
    with pytest.raises(TypeError, match="has no rows"):
        ref[[0]]


def test_a_slice_ref_of_no_parts_is_an_empty_list_and_none_is_pickled_by_hand():
    empty = SliceRef([])
    assert empty.rows == 0 and empty.parts == () and empty.refs == ()
    assert empty.indices == range(0) and empty.get() == []
    assert empty.reduce_for(object()) == (rankkept.read_rows, ([], []))
    assert rankkept.read_rows([], []) == []
    assert empty[:].rows == 0 and empty[[]].rows == 0
    with pytest.raises(IndexError, match="out of range for its 0 rows"):
        empty[[0]]
    assert "SliceRef of 0 rows" in repr(empty)
    part = make_ref(4)[1:3]
    with pytest.raises(TypeError, match="a group's calls"):
        pickle.dumps(part)
    assert "SliceRef of 2 rows" in repr(part) and "[1:3]" in repr(part)


def test_a_slice_keeps_its_handles_alive():
    owner = Owner()
    ref = make_ref(6, owner)
    ref_id = ref.id
    part = ref[1:4]
    picked = ref[[5, 0]]
    del ref
    gc.collect()
    assert owner.freed == []  # the slices hold it
    del part
    gc.collect()
    assert owner.freed == []
    del picked
    gc.collect()
    assert owner.freed == [ref_id]


def test_get_of_a_slice_joins_the_rows_of_its_handles():
    a = make_ref(4, value={"x": np.arange(4), "y": np.arange(4) * 10})
    b = make_ref(3, value={"x": np.arange(4, 7), "y": np.arange(4, 7) * 10})
    (whole,) = chunk([a[1:], b[:2]], 1)
    got = whole.get()
    assert got["x"].tolist() == [1, 2, 3, 4, 5]
    assert got["y"].tolist() == [10, 20, 30, 40, 50]
    picked = chunk([a, b], 1)[0][[6, 0, 5, 1]]
    got = picked.get()
    assert got["x"].tolist() == [6, 0, 5, 1]
    assert got["y"].tolist() == [60, 0, 50, 10]


def test_get_fetches_each_kept_result_once():
    fetched = []

    class Counting(Owner):
        def get(self, ref, timeout):
            fetched.append(ref.id)
            return super().get(ref, timeout)

    owner = Counting()
    a = make_ref(5, owner, np.arange(5))
    assert a[[4, 0, 3, 1]].get().tolist() == [4, 0, 3, 1]
    (both,) = chunk([a[[4]], make_ref(2, owner, np.arange(2) + 10), a[:2]], 1)
    assert both.get().tolist() == [4, 10, 11, 0, 1]
    assert sorted(fetched) == sorted([a.id, a.id, a.id + 1])


def test_a_slice_pickles_into_a_call_as_where_each_result_is_read_and_its_rows():
    a, b = make_ref(4), make_ref(5)
    (both,) = chunk([a[1:], b], 1)
    function, (places, parts) = both.reduce_for(object())
    assert function is rankkept.read_rows
    assert parts == [(0, range(1, 4)), (1, range(0, 5))]
    assert [where[1] for where in places] == [a.owner.describe(a.record)] * 2
    # a result cut into several parts is read once
    (mixed,) = chunk([a[[3, 0]], b[1:2], a[1:3]], 1)
    _, (places, parts) = mixed.reduce_for(object())
    assert len(places) == 2
    assert parts == [(0, (3, 0)), (1, range(1, 2)), (0, range(1, 3))]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.sampled_from(["whole", "slice", "pick"])),
                min_size=1, max_size=6),
       st.integers(1, 20), st.data())
def test_chunk_covers_every_row_once_in_order_in_sizes_differing_by_one(specs, n, data):
    refs: list = []
    for size, how in specs:
        ref = make_ref(size)
        if how == "slice":  # a slice of a handle goes into chunk as a handle does
            a = data.draw(st.integers(0, size))
            ref = ref[a:data.draw(st.integers(a, size))]
        elif how == "pick" and size:
            ref = ref[data.draw(st.lists(st.integers(-size, size - 1), max_size=8))]
        refs.append(ref)
    chunks = chunk(refs, n)
    assert len(chunks) == n
    assert all(isinstance(c, px.SliceRef) and c.parts for c in chunks)
    sizes = [c.rows for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ones the larger
    every = rows_of_refs(refs)
    assert [r for c in chunks for r in flat(c.parts)] == every
    assert [i for c in chunks for i in c.indices] == list(range(len(every)))
    assert all(len(c.indices) == c.rows == len(flat(c.parts)) for c in chunks)
    for c in chunks:
        assert isinstance(c.indices, range)  # a chunk of all the rows: a run of them
        assert [every[i] for i in c.indices] == flat(c.parts)
        for ref, named in c.parts:
            assert all(0 <= row < ref.rows for row in named)
            if isinstance(named, range):
                assert 0 <= named.start <= named.stop <= ref.rows
        if c.rows:
            assert all(len(named) for _, named in c.parts)
        else:
            assert len(c.parts) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10), min_size=1, max_size=5), st.integers(1, 4),
       st.data())
def test_slicing_or_picking_from_a_slice_is_doing_so_on_its_rows(sizes, n, data):
    refs = [make_ref(s) for s in sizes]
    part = data.draw(st.sampled_from(chunk(refs, n)))
    every = flat(part.parts)
    bound = st.none() | st.integers(-len(every) - 2, len(every) + 2)
    a, b = data.draw(bound), data.draw(bound)
    narrowed = part[a:b]
    assert flat(narrowed.parts) == every[a:b]
    assert narrowed.rows == len(every[a:b])
    assert list(narrowed.indices) == list(range(len(every)))[a:b]
    c, d = data.draw(bound), data.draw(bound)
    assert flat(narrowed[c:d].parts) == every[a:b][c:d]
    if not every:
        return
    picked = data.draw(st.lists(st.integers(-len(every), len(every) - 1), max_size=12))
    chosen = part[picked]
    assert flat(chosen.parts) == [every[i] for i in picked]
    assert list(chosen.indices) == [i % len(every) for i in picked]
    mask = data.draw(st.lists(st.booleans(), min_size=len(every), max_size=len(every)))
    assert flat(part[mask].parts) == [r for r, keep in zip(every, mask, strict=True) if keep]
    if chosen.rows:  # a pick of a pick, a slice of a pick
        again = data.draw(st.lists(st.integers(0, chosen.rows - 1), max_size=6))
        assert flat(chosen[again].parts) == [every[picked[i]] for i in again]
        assert flat(chosen[c:d].parts) == [every[i] for i in picked][c:d]


def test_chunk_checks_its_arguments():
    ref = make_ref(4)
    with pytest.raises(TypeError, match="n must be an int"):
        chunk([ref], 2.0)
    with pytest.raises(TypeError, match="n must be an int"):
        chunk([ref], True)
    with pytest.raises(TypeError, match="n must be an int"):
        chunk([ref], "2")
    with pytest.raises(ValueError, match="at least 1"):
        chunk([ref], 0)
    with pytest.raises(ValueError, match="at least 1"):
        chunk([ref], -3)
    with pytest.raises(IndexError, match=r"chunk\(select=...\): rows\[mask\]: a mask of "
                       "length 3 for a value of 4 rows"):
        chunk([ref], 2, select=[True] * 3)
    with pytest.raises(TypeError, match=r"chunk\(select=...\)"):
        chunk([ref], 2, select=1)


def test_chunk_of_no_handles_is_n_empty_chunks():
    for refs in ([], iter([])):
        chunks = chunk(refs, 3)
        assert len(chunks) == 3
        assert all(c.rows == 0 and c.parts == () and c.indices == range(0) for c in chunks)
        assert [c.get() for c in chunks] == [[], [], []]
    assert [c.rows for c in chunk([], 2, select=[])] == [0, 0]


def test_chunk_names_the_handle_that_has_no_rows():
    put = px.ObjectRef(Owner(), PutRecord(HeldObject(7, "t", None, 16, "list")))
    with pytest.raises(TypeError, match=r"handle 1 .*put"):
        chunk([make_ref(3), put], 2)
    with pytest.raises(TypeError, match=r"handle 0 .*has no rows"):
        chunk([make_ref(None), make_ref(3)], 2)
    with pytest.raises(TypeError, match="handle 2 "):
        chunk([make_ref(3), make_ref(3), np.zeros(3)], 2)


def test_chunk_takes_any_iterable_and_more_chunks_than_rows():
    a, b = make_ref(2), make_ref(1)
    chunks = chunk(iter([a, b]), 5)
    assert [c.rows for c in chunks] == [1, 1, 1, 0, 0]
    assert [c.parts for c in chunks[:3]] == [((a, range(0, 1)),), ((a, range(1, 2)),),
                                             ((b, range(0, 1)),)]
    assert chunks[4].parts == ((b, range(1, 1)),)  # empty, at the end of the last handle
    assert [c.indices for c in chunks] == [range(0, 1), range(1, 2), range(2, 3),
                                           range(3, 3), range(3, 3)]


def test_chunk_of_selected_rows_gives_their_numbers_as_indices():
    a, b = make_ref(4), make_ref(3)
    every = rows_of_refs([a, b])
    mask = [True, False, False, True, True, False, True]
    chunks = chunk([a, b], 2, select=mask)
    assert [list(c.indices) for c in chunks] == [[0, 3], [4, 6]]
    for c in chunks:
        assert flat(c.parts) == [every[i] for i in c.indices]
    # per-row arrays of the controller, cut by them, line up with the rows delivered
    advantages = np.arange(7) * 10.0
    assert [advantages[c.indices].tolist() for c in chunks] == [[0.0, 30.0], [40.0, 60.0]]
    numbered = chunk([a, b], 3, select=np.array([6, 0, 1, 2]))
    assert [list(c.indices) for c in numbered] == [[6, 0], [1], [2]]
    assert flat(numbered[0].parts) == [every[6], every[0]]
    with pytest.raises(IndexError, match="row 7 is out of range for its 7 rows"):
        chunk([a, b], 2, select=[7])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 8), max_size=5), st.integers(1, 6), st.data())
def test_chunk_with_select_delivers_the_selected_rows_with_their_indices(sizes, n, data):
    refs = [make_ref(s) for s in sizes]
    every = rows_of_refs(refs)
    total = len(every)
    if data.draw(st.booleans()):
        select = data.draw(st.lists(st.booleans(), min_size=total, max_size=total))
        wanted = [i for i, keep in enumerate(select) if keep]
    else:
        select = data.draw(st.lists(st.integers(-total, total - 1), max_size=12)) if total \
            else []
        wanted = [i % total for i in select]
    chunks = chunk(refs, n, select=select)
    assert [i for c in chunks for i in c.indices] == wanted
    assert [r for c in chunks for r in flat(c.parts)] == [every[i] for i in wanted]
    sizes_out = [c.rows for c in chunks]
    assert max(sizes_out) - min(sizes_out) <= 1


def test_chunk_exports():
    assert px.chunk is chunk and px.SliceRef is SliceRef
    assert px.keep is rankkept.keep


# -- read_rows: rows read from real kept blocks, in this process -------------------------


def _kept_here(kept: rankkept.Kept, value: object) -> tuple[tuple, int | None]:
    """``value`` kept in a block of this process, as a rank keeps a px.keep() value: where
    a consumer's call reads it (read()'s arguments), and its rows."""
    _, key, _, location, n = kept.keep_piece(value)
    return (rankkept.location_of(location), f"value {key}", None), n


def test_read_rows_reads_cuts_of_kept_blocks_without_copying_and_joins_them():
    kept = rankkept.Kept()
    a, rows_a = _kept_here(kept, {"x": np.arange(10.0), "y": np.arange(20).reshape(10, 2)})
    b, rows_b = _kept_here(kept, {"x": np.arange(10.0, 17.0), "y": np.zeros((7, 2), int)})
    try:
        assert (rows_a, rows_b) == (10, 7) and len(kept) == 2
        one = rankkept.read_rows([a], [(0, range(2, 5))])
        assert one["x"].tolist() == [2.0, 3.0, 4.0]
        assert not one["x"].flags.writeable  # a view of the producer's block
        both = rankkept.read_rows([a, b], [(0, range(8, 10)), (1, range(0, 3))])
        assert both["x"].tolist() == [8.0, 9.0, 10.0, 11.0, 12.0]
        assert both["y"].tolist() == [[16, 17], [18, 19], [0, 0], [0, 0], [0, 0]]
        picked = rankkept.read_rows([a, b], [(1, (6, 0)), (0, range(9, 10)), (0, (3, 3))])
        assert picked["x"].tolist() == [16.0, 10.0, 9.0, 3.0, 3.0]
        assert picked["y"].tolist() == [[0, 0], [0, 0], [18, 19], [6, 7], [6, 7]]
        gathered = rankkept.read_rows([a], [(0, (5, 1))])
        assert gathered["x"].tolist() == [5.0, 1.0]
        assert gathered["x"].flags.writeable  # gathered: a copy of its own
        del one, both, picked, gathered
    finally:
        kept.drop([-1, -2])
    assert len(kept) == 0
