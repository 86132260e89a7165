"""Rows of kept results, without a rank: how a value's rows are counted, cut and joined
(:mod:`phalanx.rank.rows`), how handles are sliced (``ref[a:b]``, ``SliceRef[a:b]``) and
re-cut across several (:func:`px.chunk`), checked on every case hypothesis finds; and a
slice read in this process from a real kept block (``read_rows``)."""

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
from phalanx.controller.refs import ResultRef, SliceRef, cut
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


# -- handles: ResultRef, SliceRef, cut, chunk (on a fake owner) --------------------------


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
    return [(ref.id, row) for ref, start, stop in parts for row in range(start, stop)]


def rows_of_refs(refs) -> list[tuple[int, int]]:
    out = []
    for ref in refs:
        out += flat(ref.parts) if isinstance(ref, SliceRef) else flat([(ref, 0, ref.rows)])
    return out


def test_a_handle_is_sliced_by_rows():
    ref = make_ref(10)
    assert ref.rows == 10
    part = ref[2:5]
    assert isinstance(part, px.SliceRef)
    assert part.parts == ((ref, 2, 5),) and part.rows == 3 == len(part)
    assert part.refs == (ref,)
    assert ref[-3:].parts == ((ref, 7, 10),)
    assert ref[:].parts == ((ref, 0, 10),)
    assert ref[:100].parts == ((ref, 0, 10),)  # clamped, as a list's slice is
    assert ref[7:3].rows == 0  # empty, at row 7
    assert ref[7:3].parts == ((ref, 7, 7),)
    assert ref[::1].rows == 10


@pytest.mark.parametrize(("index", "error"), [
    (slice(None, None, 2), ValueError),
    (slice(None, None, -1), ValueError),
    (3, TypeError),
    ("a", TypeError),
    ((slice(0, 1), slice(0, 1)), TypeError),
])
def test_a_handle_is_sliced_only_by_one_slice_of_step_one(index, error):
    ref = make_ref(10)
    with pytest.raises(error, match="rows"):
        ref[index]
    with pytest.raises(error, match="rows"):
        ref[0:8][index]


def test_a_handle_without_rows_cannot_be_sliced():
    ref = make_ref(None)
    assert ref.rows is None
    with pytest.raises(TypeError, match="has no rows"):
        ref[0:1]


def test_a_slice_ref_names_at_least_one_part_and_cannot_be_pickled_by_hand():
    with pytest.raises(ValueError, match="at least one part"):
        SliceRef([])
    part = make_ref(4)[1:3]
    with pytest.raises(TypeError, match="a group's calls"):
        pickle.dumps(part)
    assert "SliceRef of 2 rows" in repr(part) and "[1:3]" in repr(part)


def test_a_slice_keeps_its_handles_alive():
    owner = Owner()
    ref = make_ref(6, owner)
    ref_id = ref.id
    part = ref[1:4]
    del ref
    gc.collect()
    assert owner.freed == []  # the slice holds it
    del part
    gc.collect()
    assert owner.freed == [ref_id]


def test_get_of_a_slice_joins_the_rows_of_its_handles():
    a = make_ref(4, value={"x": np.arange(4), "y": np.arange(4) * 10})
    b = make_ref(3, value={"x": np.arange(4, 7), "y": np.arange(4, 7) * 10})
    (whole,) = chunk([a[1:], b[:2]], 1)
    got = whole.get()
    assert got["x"].tolist() == [1, 2, 3, 4, 5]
    assert got["y"].tolist() == [10, 20, 30, 40, 50]


def test_a_slice_pickles_into_a_call_as_its_parts_and_their_rows():
    a, b = make_ref(4), make_ref(5)
    (both,) = chunk([a[1:], b], 1)
    function, (parts,) = both.reduce_for(object())
    assert function is rankkept.read_rows
    assert [(start, stop) for _, start, stop in parts] == [(1, 4), (0, 5)]
    assert [where[1] for where, _, _ in parts] == [a.owner.describe(a.record)] * 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=6), st.data())
def test_cut_names_exactly_the_rows_asked_for(sizes, data):
    refs = [make_ref(n) for n in sizes]
    parts = [(ref, 0, ref.rows) for ref in refs]
    every = flat(parts)
    start = data.draw(st.integers(0, len(every) + 2))
    stop = data.draw(st.integers(0, len(every) + 2))
    out = cut(parts, start, stop)
    assert out, "a cut is never empty"
    assert flat(out) == every[start:stop]
    assert all(0 <= a <= b <= ref.rows for ref, a, b in out)
    if start < stop <= len(every):
        assert all(a < b for _, a, b in out)  # no empty parts in a cut with rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.booleans()), min_size=1, max_size=6),
       st.integers(1, 20), st.data())
def test_chunk_covers_every_row_once_in_order_in_sizes_differing_by_one(specs, n, data):
    refs: list = []
    for size, sliced in specs:
        ref = make_ref(size)
        if sliced:  # a slice of a handle goes into chunk as a handle does
            a = data.draw(st.integers(0, size))
            ref = ref[a:data.draw(st.integers(a, size))]
        refs.append(ref)
    chunks = chunk(refs, n)
    assert len(chunks) == n
    assert all(isinstance(c, px.SliceRef) and c.parts for c in chunks)
    sizes = [c.rows for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ones the larger
    assert [r for c in chunks for r in flat(c.parts)] == rows_of_refs(refs)
    for c in chunks:
        assert all(0 <= a <= b <= ref.rows for ref, a, b in c.parts)
        if c.rows:
            assert all(a < b for _, a, b in c.parts)
        else:
            assert len(c.parts) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 10), min_size=1, max_size=5), st.integers(1, 4),
       st.data())
def test_slicing_a_slice_is_slicing_its_rows(sizes, n, data):
    refs = [make_ref(s) for s in sizes]
    part = data.draw(st.sampled_from(chunk(refs, n)))
    every = flat(part.parts)
    bound = st.none() | st.integers(-len(every) - 2, len(every) + 2)
    a, b = data.draw(bound), data.draw(bound)
    narrowed = part[a:b]
    assert flat(narrowed.parts) == every[a:b]
    assert narrowed.rows == len(every[a:b])
    c, d = data.draw(bound), data.draw(bound)
    assert flat(narrowed[c:d].parts) == every[a:b][c:d]


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
    with pytest.raises(ValueError, match="no handles"):
        chunk([], 2)
    with pytest.raises(ValueError, match="no handles"):
        chunk(iter([]), 2)


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
    assert [c.parts for c in chunks[:3]] == [((a, 0, 1),), ((a, 1, 2),), ((b, 0, 1),)]
    assert chunks[4].parts == ((b, 1, 1),)  # empty, at the end of the last handle


def test_chunk_exports():
    assert px.chunk is chunk and px.SliceRef is SliceRef
    assert px.keep is rankkept.keep


# -- read_rows: a slice read from a real kept block, in this process ---------------------


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
        one = rankkept.read_rows([(a, 2, 5)])
        assert one["x"].tolist() == [2.0, 3.0, 4.0]
        assert not one["x"].flags.writeable  # a view of the producer's block
        both = rankkept.read_rows([(a, 8, 10), (b, 0, 3)])
        assert both["x"].tolist() == [8.0, 9.0, 10.0, 11.0, 12.0]
        assert both["y"].tolist() == [[16, 17], [18, 19], [0, 0], [0, 0], [0, 0]]
        del one, both
    finally:
        kept.drop([-1, -2])
    assert len(kept) == 0
