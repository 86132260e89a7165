"""Named rank layouts and sharded-call planning: pure logic, checked against the stated rules
and against a brute-force reference on random meshes."""

from __future__ import annotations

import itertools
import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.world.sharding import (
    NamedSharding,
    NonIntegerLayoutError,
    UnknownAxisError,
    plan_sharded_call,
    take,
    validate_sharded_value,
)

# Row-major dp=2, tp=2: dp=0 -> [0, 1], dp=1 -> [2, 3].
DP_TP = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
# NeMo-RL's own test fixture: dp=1, pp=2, tp=4.
NEMO = NamedSharding([[[0, 1, 2, 3], [4, 5, 6, 7]]], ["dp", "pp", "tp"])


def mesh3() -> NamedSharding:
    return NamedSharding.from_mesh({"dp": 2, "pp": 2, "tp": 2})


def test_nested_lists_numpy_arrays_and_integral_floats_build_equal_shardings():
    a = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    b = NamedSharding(np.array([[0, 1], [2, 3]]), ["dp", "tp"])
    c = NamedSharding([[0.0, 1.0], [2.0, 3.0]], ["dp", "tp"])
    assert a == b == c
    assert c.get_worker_coords(3) == {"dp": 1, "tp": 1}


@pytest.mark.parametrize(
    "layout, names",
    [
        ([[0, 1], [2, 3]], ["dp"]),  # 2 dimensions, 1 name
        ([0, 1, 2, 3], ["dp", "tp"]),  # 1 dimension, 2 names
        ([[0, 1.5], [2, 3]], ["dp", "tp"]),  # not an integer
        ([[0, 1], [1, 3]], ["dp", "tp"]),  # rank 1 twice
    ],
)
def test_bad_layouts_raise_value_error(layout, names):
    with pytest.raises(ValueError):
        NamedSharding(layout, names)


def test_properties():
    assert DP_TP.names == ["dp", "tp"]
    assert list(DP_TP.shape.items()) == [("dp", 2), ("tp", 2)]
    assert DP_TP.ndim == 2
    assert DP_TP.size == 4
    assert isinstance(DP_TP.layout, np.ndarray)
    np.testing.assert_array_equal(DP_TP.layout, [[0, 1], [2, 3]])
    s = NamedSharding([[5, 4, 3], [2, 1, 0]], ["tp", "dp"])
    assert list(s.shape.items()) == [("tp", 2), ("dp", 3)]
    assert (s.ndim, s.size) == (2, 6)


def test_layout_and_names_are_copies():
    s = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    s.layout[0, 0] = 99
    s.names.append("pp")
    s.names[0] = "xx"
    np.testing.assert_array_equal(s.layout, [[0, 1], [2, 3]])
    assert s.names == ["dp", "tp"]
    assert s == DP_TP


def test_from_mesh_is_row_major():
    assert NamedSharding.from_mesh({"dp": 2, "tp": 2}) == DP_TP
    s = mesh3()
    assert s.names == ["dp", "pp", "tp"]
    np.testing.assert_array_equal(s.layout, np.arange(8).reshape(2, 2, 2))
    assert NamedSharding.from_mesh({"tp": 3}) == NamedSharding([0, 1, 2], ["tp"])


def test_equality_needs_same_layout_and_same_names():
    assert DP_TP == NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    assert DP_TP != NamedSharding([[0, 1], [2, 3]], ["tp", "dp"])
    assert DP_TP != NamedSharding([[0, 2], [1, 3]], ["dp", "tp"])
    assert DP_TP != NamedSharding([0, 1, 2, 3], ["dp"])
    assert DP_TP != "not a sharding"


def test_repr_shows_shape_and_names():
    text = repr(NamedSharding.from_mesh({"dp": 2, "tp": 3}))
    assert "(2, 3)" in text
    assert "dp" in text and "tp" in text


def test_worker_coords():
    assert DP_TP.get_worker_coords(0) == {"dp": 0, "tp": 0}
    assert DP_TP.get_worker_coords(1) == {"dp": 0, "tp": 1}
    assert DP_TP.get_worker_coords(2) == {"dp": 1, "tp": 0}
    assert list(DP_TP.get_worker_coords(2)) == ["dp", "tp"]
    for rank in (4, -1, 100):
        with pytest.raises(ValueError):
            DP_TP.get_worker_coords(rank)


def test_get_ranks_slices_and_indexes():
    assert DP_TP.get_ranks(dp=1) == NamedSharding([2, 3], ["tp"])
    assert DP_TP.get_ranks(tp=0) == NamedSharding([0, 2], ["dp"])
    rank = DP_TP.get_ranks(dp=1, tp=0)
    assert rank == 2 and isinstance(rank, int)
    assert DP_TP.get_ranks() == DP_TP
    with pytest.raises(ValueError, match="pp"):
        DP_TP.get_ranks(pp=0)
    for index in (2, -1):
        with pytest.raises(IndexError, match=r"tp(.|\n)*2"):
            DP_TP.get_ranks(tp=index)
    with pytest.raises(IndexError, match=r"dp(.|\n)*2"):
        DP_TP.get_ranks(dp=5, tp=0)


def test_get_ranks_by_coord():
    assert DP_TP.get_ranks_by_coord(dp=0) == [0, 1]
    assert DP_TP.get_ranks_by_coord(tp=1) == [1, 3]
    assert DP_TP.get_ranks_by_coord(dp=1, tp=1) == [3]
    assert DP_TP.get_ranks_by_coord() == [0, 1, 2, 3]
    assert DP_TP.get_ranks_by_coord(dp=2) == []
    assert DP_TP.get_ranks_by_coord(dp=0, tp=-1) == []
    with pytest.raises(ValueError, match="pp"):
        DP_TP.get_ranks_by_coord(pp=0)
    # Sorted even when the layout is not.
    assert NamedSharding([[3, 1], [2, 0]], ["dp", "tp"]).get_ranks_by_coord(tp=1) == [0, 1]


def test_three_dimensional_mesh():
    s = mesh3()
    assert s.get_worker_coords(5) == {"dp": 1, "pp": 0, "tp": 1}
    assert s.get_ranks(dp=1) == NamedSharding([[4, 5], [6, 7]], ["pp", "tp"])
    assert s.get_ranks(pp=1) == NamedSharding([[2, 3], [6, 7]], ["dp", "tp"])
    assert s.get_ranks(dp=0, tp=1) == NamedSharding([1, 3], ["pp"])
    assert s.get_ranks(dp=1, pp=1, tp=0) == 6
    assert s.get_ranks_by_coord(pp=1) == [2, 3, 6, 7]
    assert s.get_ranks_by_coord(dp=1, tp=0) == [4, 6]
    assert s.get_ranks_by_coord(dp=0, pp=1, tp=1) == [3]
    assert s.get_ranks_by_coord(pp=2) == []


def test_axis_index_and_size():
    s = NamedSharding.from_mesh({"dp": 2, "pp": 3, "tp": 4})
    assert [s.get_axis_index(n) for n in ("dp", "pp", "tp")] == [0, 1, 2]
    assert [s.get_axis_size(n) for n in ("dp", "pp", "tp")] == [2, 3, 4]
    with pytest.raises(ValueError, match="cp"):
        s.get_axis_index("cp")
    with pytest.raises(ValueError, match="cp"):
        s.get_axis_size("cp")


def test_is_axis_zero():
    assert NamedSharding.is_axis_zero({"dp": 1, "tp": 0}, ["tp"])
    assert not NamedSharding.is_axis_zero({"dp": 1, "tp": 0}, ["dp", "tp"])
    assert NamedSharding.is_axis_zero({"dp": 1}, ["tp", "pp"])  # missing axes count as 0
    assert NamedSharding.is_axis_zero({"dp": 1}, [])
    assert DP_TP.is_axis_zero(DP_TP.get_worker_coords(1), ["dp"])


# -- NeMo-RL compatibility: error wording, exception types, repr --------------------------


def raises_starting_with(exc_type, opening):
    """pytest.raises matched as a NeMo-RL test matches, plus: the message *starts* there."""

    class Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc_type, match=re.escape(opening))
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            assert str(self.info.value).startswith(opening), str(self.info.value)
            return handled

    return Check()


@pytest.mark.parametrize(
    "layout, names, exc_type, opening",
    [
        (
            [[0, 1], [2, 3]],
            ["dp", "pp", "tp"],
            ValueError,
            "Number of dimensions in layout (2) must match the number of names (3).",
        ),
        (
            [0, 1, 2, 3],
            ["dp", "tp"],
            ValueError,
            "Number of dimensions in layout (1) must match the number of names (2).",
        ),
        (
            [[0, 1.5], [2, 3]],
            ["dp", "pp"],
            ValueError,
            "Layout must contain only integer rank IDs.",
        ),
        ([[0, np.nan]], ["dp", "pp"], ValueError, "Layout must contain only integer rank IDs."),
        ([["a", "b"]], ["dp", "pp"], TypeError, "Layout must contain only integer rank IDs."),
        ([[0, None]], ["dp", "pp"], TypeError, "Layout must contain only integer rank IDs."),
        ([[0, 1j]], ["dp", "pp"], TypeError, "Layout must contain only integer rank IDs."),
        ([[0, 1], [2, 0]], ["dp", "pp"], ValueError, "Duplicate ranks found in layout: [0]"),
        ([[0, 1], [1, 0]], ["dp", "pp"], ValueError, "Duplicate ranks found in layout: [0, 1]"),
        (
            [[0, 1], [2]],
            ["dp", "pp"],
            ValueError,
            "Could not create NumPy array from layout: ",
        ),
    ],
)
def test_layout_errors_open_with_nemo_rl_wording(layout, names, exc_type, opening):
    with raises_starting_with(exc_type, opening):
        NamedSharding(layout, names)


def test_non_integer_layouts_raise_both_value_error_and_type_error():
    # NeMo-RL raises ValueError for fractional ranks and (through numpy) TypeError for strings.
    assert issubclass(NonIntegerLayoutError, ValueError)
    assert issubclass(NonIntegerLayoutError, TypeError)
    with pytest.raises(NonIntegerLayoutError):
        NamedSharding([[0, 1.5]], ["dp", "tp"])
    with pytest.raises(NonIntegerLayoutError):
        NamedSharding([["a", "b"]], ["dp", "tp"])


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.get_ranks(xx=0),
        lambda s: s.get_ranks(dp=0, xx=0),
        lambda s: s.get_axis_index("xx"),
        lambda s: s.get_axis_size("xx"),
        lambda s: s.get_ranks_by_coord(xx=0),
    ],
)
def test_invalid_axis_name_is_nemo_rl_wording(call):
    with raises_starting_with(ValueError, "Invalid axis name: 'xx'") as info:
        call(NEMO)
    assert str(info.value) == "Invalid axis name: 'xx'. Valid names are: ['dp', 'pp', 'tp']"


def test_invalid_axis_name_is_also_the_key_error_of_nemo_rls_get_axis_size():
    assert issubclass(UnknownAxisError, ValueError)
    assert issubclass(UnknownAxisError, KeyError)
    with pytest.raises(KeyError) as info:
        NEMO.get_axis_size("xx")
    assert str(info.value).startswith("Invalid axis name: 'xx'")  # not quoted like a KeyError
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnknownAxisError and str(again) == str(info.value)


@pytest.mark.parametrize("axis, index, size", [("pp", 2, 2), ("tp", 4, 4), ("pp", -1, 2)])
def test_index_out_of_bounds_is_nemo_rl_wording(axis, index, size):
    opening = f"Index {index} is out of bounds for axis '{axis}'"
    with raises_starting_with(IndexError, opening) as info:
        NEMO.get_ranks(**{axis: index})
    assert str(info.value) == f"{opening} with size {size}"
    with raises_starting_with(IndexError, "Index 2 is out of bounds for axis 'pp'"):
        NEMO.get_ranks(pp=np.int64(2))


def test_non_integer_index_is_an_index_error():
    with pytest.raises(IndexError, match=re.escape("Index 0.5 for axis 'pp'")):
        NEMO.get_ranks(pp=0.5)


@pytest.mark.parametrize("worker_id", [4, -1, 100, np.int64(4)])
def test_worker_not_found_is_nemo_rl_wording(worker_id):
    with raises_starting_with(
        ValueError, f"Worker ID {int(worker_id)} not found in sharding layout."
    ):
        DP_TP.get_worker_coords(worker_id)
    with raises_starting_with(ValueError, "Worker ID 8 not found in sharding layout."):
        NEMO.get_worker_coords(8)


def test_worker_not_found_details_say_what_the_layout_holds():
    with pytest.raises(ValueError) as info:
        DP_TP.get_worker_coords(4)
    assert str(info.value).endswith("The layout holds ranks 0..3.")
    with pytest.raises(ValueError) as info:
        NamedSharding([[10, 30]], ["dp", "tp"]).get_worker_coords(20)
    assert str(info.value).endswith("The layout holds ranks 10, 30.")
    with raises_starting_with(ValueError, "Worker ID 1 not found in sharding layout.") as info:
        DP_TP.get_worker_coords("1")
    assert "Worker IDs are integers, got str '1'" in str(info.value)


def test_repr_is_nemo_rls_with_numpy_printing_the_layout():
    text = repr(NEMO)
    assert text == (
        "NamedSharding(shape=(1, 2, 4), names=['dp', 'pp', 'tp'], "
        "layout=[[[0 1 2 3]\n  [4 5 6 7]]])"
    )
    # The substrings NeMo-RL's own test_repr checks.
    for part in ("NamedSharding", "shape=(1, 2, 4)", "names=['dp', 'pp', 'tp']", "layout="):
        assert part in text
    assert "[[[0 1 2 3]" in text and "[4 5 6 7]]]" in text
    assert text == (
        f"NamedSharding(shape=(1, 2, 4), names=['dp', 'pp', 'tp'], "
        f"layout={np.array([[[0, 1, 2, 3], [4, 5, 6, 7]]])}"
        ")"
    )


def test_repr_of_one_axis_and_of_integral_floats():
    # NeMo-RL joins the sizes: "(3)", not Python's "(3,)".
    assert repr(NamedSharding([3, 1, 2], ["tp"])) == (
        "NamedSharding(shape=(3), names=['tp'], layout=[3 1 2])"
    )
    assert repr(NamedSharding([[0.0, 1.0]], ["dp", "tp"])).endswith("layout=[[0 1]])")


# -- contains_worker_id / replace_worker_id ---------------------------------------------


def test_contains_worker_id():
    assert all(NEMO.contains_worker_id(r) for r in range(8))
    assert NEMO.contains_worker_id(np.int64(7))
    for absent in (8, -1, 100, "0", 0.5, None):
        assert not NEMO.contains_worker_id(absent)


def test_replace_worker_id_takes_over_the_slot_in_place():
    s = mesh3()
    before = s.get_worker_coords(5)
    assert s.replace_worker_id(5, 42) is True
    assert s.get_worker_coords(42) == before == {"dp": 1, "pp": 0, "tp": 1}
    assert s.contains_worker_id(42) and not s.contains_worker_id(5)
    assert s.get_ranks(dp=1, pp=0, tp=1) == 42
    assert s.get_ranks_by_coord(dp=1, pp=0) == [4, 42]
    assert s.ranks == [0, 1, 2, 3, 4, 6, 7, 42]
    np.testing.assert_array_equal(s.layout, [[[0, 1], [2, 3]], [[4, 42], [6, 7]]])
    with raises_starting_with(ValueError, "Worker ID 5 not found in sharding layout."):
        s.get_worker_coords(5)
    assert s == NamedSharding([[[0, 1], [2, 3]], [[4, 42], [6, 7]]], ["dp", "pp", "tp"])


def test_replace_worker_id_leaves_earlier_sub_shardings_alone():
    s = mesh3()
    sub = s.get_ranks(dp=0)
    s.replace_worker_id(0, 99)
    assert sub == NamedSharding([[0, 1], [2, 3]], ["pp", "tp"])


def test_replace_missing_worker_id_returns_false_and_changes_nothing():
    s = mesh3()
    assert s.replace_worker_id(8, 9) is False
    assert s.replace_worker_id("1", 9) is False
    assert s.replace_worker_id(8, 3) is False  # nothing to replace, so no duplicate either
    assert s == mesh3()


def test_replace_worker_id_with_itself_is_a_no_op():
    s = mesh3()
    assert s.replace_worker_id(3, 3) is True
    assert s == mesh3()


def test_replace_with_a_rank_already_in_the_layout_raises_and_changes_nothing():
    s = mesh3()
    with raises_starting_with(ValueError, "Duplicate ranks found in layout: [3]") as info:
        s.replace_worker_id(5, 3)
    assert "Cannot replace worker ID 5 with 3" in str(info.value)
    assert s == mesh3()
    assert s.get_worker_coords(5) == {"dp": 1, "pp": 0, "tp": 1}


@pytest.mark.parametrize("new_id", [1.5, "9", None, True])
def test_replace_with_a_non_integer_raises_and_changes_nothing(new_id):
    s = mesh3()
    with raises_starting_with(NonIntegerLayoutError, "Layout must contain only integer rank IDs."):
        s.replace_worker_id(5, new_id)
    assert s == mesh3()


def test_replace_widens_a_narrow_integer_layout():
    s = NamedSharding(np.array([[0, 1], [2, 3]], dtype=np.uint8), ["dp", "tp"])
    assert s.replace_worker_id(1, 1000) and s.replace_worker_id(2, -7)
    np.testing.assert_array_equal(s.layout, [[0, 1000], [-7, 3]])
    assert s.get_worker_coords(1000) == {"dp": 0, "tp": 1}
    with raises_starting_with(NonIntegerLayoutError, "Layout must contain only integer rank IDs."):
        s.replace_worker_id(0, 2**64)
    np.testing.assert_array_equal(s.layout, [[0, 1000], [-7, 3]])


def test_plan_shards_on_dp_and_replicates_on_tp():
    plan = plan_sharded_call(DP_TP, ["dp"], ["tp"], ["tp"])
    assert plan.called_ranks == [0, 1, 2, 3]
    assert plan.paths == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert plan.result_ranks == [0, 2]


def test_plan_free_axes_skip_or_dummy():
    plan = plan_sharded_call(DP_TP, in_sharded_axes=["dp"])  # tp is free
    assert plan.called_ranks == [0, 2]
    assert plan.paths == {0: (0,), 2: (1,)}
    assert plan.result_ranks == [0, 2]
    plan = plan_sharded_call(DP_TP, in_sharded_axes=["dp"], dummy_calls_to_free_axes=True)
    assert plan.called_ranks == [0, 1, 2, 3]
    assert plan.paths == {0: (0,), 1: None, 2: (1,), 3: None}
    assert plan.result_ranks == [0, 2]


def test_plan_paths_follow_the_order_of_in_sharded_axes():
    s = mesh3()
    plan = plan_sharded_call(s, ["tp", "dp"], ["pp"], ["pp"])
    assert plan.called_ranks == list(range(8))
    assert plan.paths[5] == (1, 1)  # dp=1, pp=0, tp=1
    assert plan.paths[6] == (0, 1)  # dp=1, pp=1, tp=0
    assert plan.result_ranks == [0, 1, 4, 5]


def test_plan_with_no_sharded_axes_calls_every_replica_with_the_whole_value():
    plan = plan_sharded_call(DP_TP, replicate_on_axes=["dp", "tp"], output_is_replicated=["dp"])
    assert plan.paths == {r: () for r in range(4)}
    assert plan.result_ranks == [0, 1]


@pytest.mark.parametrize(
    "kwargs, axis",
    [
        ({"in_sharded_axes": ["cp"]}, "cp"),
        ({"replicate_on_axes": ["ep"]}, "ep"),
        ({"in_sharded_axes": ["dp"], "output_is_replicated": ["zz"]}, "zz"),
        ({"in_sharded_axes": ["dp"], "replicate_on_axes": ["dp"]}, "dp"),
    ],
)
def test_plan_errors_name_the_axis(kwargs, axis):
    with pytest.raises(ValueError, match=axis):
        plan_sharded_call(DP_TP, **kwargs)


def test_validate_accepts_well_shaped_values():
    s = mesh3()
    validate_sharded_value([[1, 2], [3, 4]], ["dp", "tp"], s, "batch")
    validate_sharded_value(([1, 2], (3, 4)), ("pp", "tp"), s, "batch")
    validate_sharded_value("anything", [], s, "batch")
    validate_sharded_value(None, (), s, "batch")


@pytest.mark.parametrize(
    "value, axis, expected, got",
    [
        ([1, 2, 3], "dp", 2, 3),
        ([[1, 2, 3]], "dp", 2, 1),
        ([[1, 2, 3], [4]], "tp", 3, 1),  # the second sub-list is short
        ([[1, 2, 3, 4], [5, 6, 7]], "tp", 3, 4),  # the first sub-list is long
    ],
)
def test_validate_names_label_axis_and_sizes(value, axis, expected, got):
    s = NamedSharding.from_mesh({"dp": 2, "tp": 3})
    with pytest.raises(ValueError) as info:
        validate_sharded_value(value, ["dp", "tp"], s, "my_batch")
    text = str(info.value)
    assert "my_batch" in text and axis in text
    assert str(expected) in text and str(got) in text


def test_validate_checks_sizes_of_the_named_axis_not_the_layout_order():
    s = NamedSharding.from_mesh({"dp": 2, "tp": 3})
    validate_sharded_value([[1, 2], [3, 4], [5, 6]], ["tp", "dp"], s, "x")
    with pytest.raises(ValueError, match="x"):
        validate_sharded_value([[1, 2], [3, 4]], ["tp", "dp"], s, "x")
    with pytest.raises(ValueError, match="x"):  # not a list where axis dp is expected
        validate_sharded_value([[1, 2], 7, [5, 6]], ["tp", "dp"], s, "x")


def test_take():
    value = [[1, 2], [3, [4, 5]]]
    assert take(value, ()) is value
    assert take(value, (1,)) == [3, [4, 5]]
    assert take(value, (1, 1, 0)) == 4
    assert take(("a", "b"), (1,)) == "b"


@st.composite
def meshes(draw):
    """A sharding with 1-3 axes of size 1-4 over a random permutation of ranks."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    names = draw(st.permutations(["a", "b", "c"]))[: len(sizes)]
    ranks = draw(st.permutations(range(int(np.prod(sizes)))))
    return NamedSharding(np.array(ranks, dtype=int).reshape(sizes), names)


@st.composite
def plans(draw):
    """A sharding and plan_sharded_call arguments that the rules accept."""
    s = draw(meshes())
    roles = {n: draw(st.sampled_from(["sharded", "replicated", "free"])) for n in s.names}
    sharded = draw(st.permutations([n for n in s.names if roles[n] == "sharded"]))
    replicated = [n for n in s.names if roles[n] == "replicated"]
    if draw(st.booleans()):
        out_rep = list(replicated)
    else:
        out_rep = draw(st.lists(st.sampled_from(s.names), unique=True))
    return s, list(sharded), replicated, out_rep, draw(st.booleans())


def reference_plan(s, sharded, replicated, out_rep, dummy):
    """The rules, applied rank by rank."""
    free = [n for n in s.names if n not in sharded and n not in replicated]
    called, paths, results = [], {}, []
    for rank in range(s.size):
        coords = dict(zip(s.names, np.argwhere(s.layout == rank)[0].tolist(), strict=True))
        if all(coords[a] == 0 for a in free):
            called.append(rank)
            paths[rank] = tuple(coords[a] for a in sharded)
            if all(coords[a] == 0 for a in out_rep):
                results.append(rank)
        elif dummy:
            called.append(rank)
            paths[rank] = None
    return called, paths, results


def leaves(s, sharded):
    return set(itertools.product(*(range(s.get_axis_size(a)) for a in sharded)))


@settings(max_examples=300, deadline=None)
@given(case=plans())
def test_plans_follow_the_rules(case):
    s, sharded, replicated, out_rep, dummy = case
    plan = plan_sharded_call(
        s, sharded, replicated, output_is_replicated=out_rep, dummy_calls_to_free_axes=dummy
    )
    called, paths, results = reference_plan(s, sharded, replicated, out_rep, dummy)
    # (1) agrees with the brute-force reference
    assert plan.called_ranks == called
    assert plan.paths == paths
    assert plan.result_ranks == results
    assert set(plan.paths) == set(plan.called_ranks)
    # (2) every data leaf reaches at least one called rank
    assert leaves(s, sharded) <= {p for p in plan.paths.values() if p is not None}
    # (3) no rank off coordinate 0 of a free axis gets data
    free = [n for n in s.names if n not in sharded and n not in replicated]
    for rank in range(s.size):
        coords = s.get_worker_coords(rank)
        if any(coords[a] != 0 for a in free):
            assert plan.paths.get(rank) is None
            assert (rank in plan.called_ranks) == dummy
    # (4) replicated output: one result per data shard, covering every leaf
    if set(out_rep) == set(replicated):
        result_paths = [plan.paths[r] for r in plan.result_ranks]
        assert len(result_paths) == len(set(result_paths))
        assert set(result_paths) == leaves(s, sharded)
    # (5) result ranks come from called ranks; both sorted
    assert set(plan.result_ranks) <= set(plan.called_ranks)
    assert plan.called_ranks == sorted(plan.called_ranks)
    assert plan.result_ranks == sorted(plan.result_ranks)
    assert all(plan.paths[r] is not None for r in plan.result_ranks)


@settings(max_examples=200, deadline=None)
@given(s=meshes())
def test_worker_coords_and_get_ranks_are_inverse(s):
    # (6)
    for rank in range(s.size):
        coords = s.get_worker_coords(rank)
        assert list(coords) == s.names
        assert s.get_ranks(**coords) == rank
        assert s.get_ranks_by_coord(**coords) == [rank]
    for idx in itertools.product(*(range(n) for n in s.shape.values())):
        coords = dict(zip(s.names, idx, strict=True))
        assert s.get_worker_coords(s.get_ranks(**coords)) == coords


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_partial_coordinates_match_brute_force(data):
    s = data.draw(meshes())
    named = data.draw(st.lists(st.sampled_from(s.names), unique=True))
    coords = {n: data.draw(st.integers(-1, s.get_axis_size(n))) for n in named}
    expected = sorted(
        r for r in range(s.size) if all(s.get_worker_coords(r)[n] == c for n, c in coords.items())
    )
    assert s.get_ranks_by_coord(**coords) == expected
    if all(0 <= c < s.get_axis_size(n) for n, c in coords.items()) and len(named) < s.ndim:
        sub = s.get_ranks(**coords)
        assert sub.names == [n for n in s.names if n not in coords]
        assert sorted(sub.layout.ravel().tolist()) == expected


@st.composite
def replacements(draw):
    """A sharding, one of its ranks, and an id not in it."""
    s = draw(meshes())
    old = draw(st.sampled_from(s.ranks))
    new = draw(st.integers(-(2**63), 2**63 - 1).filter(lambda r: r not in s.ranks))
    return s, old, new


@settings(max_examples=200, deadline=None)
@given(case=replacements())
def test_replace_then_contains(case):
    s, old, new = case
    coords = {r: s.get_worker_coords(r) for r in s.ranks}
    assert s.replace_worker_id(old, new)
    assert s.contains_worker_id(new) and not s.contains_worker_id(old)
    assert s.get_worker_coords(new) == coords[old]
    assert s.get_ranks(**coords[old]) == new
    for rank, where in coords.items():
        if rank != old:
            assert s.get_worker_coords(rank) == where
    assert sorted(s.ranks) == sorted({*coords} - {old} | {new})
    rebuilt = NamedSharding(s.layout, s.names)  # still a valid layout: each rank once
    assert rebuilt == s and hash(rebuilt) == hash(s)
    assert not s.replace_worker_id(old, new)  # gone now
    assert s.replace_worker_id(new, old)  # and back
    assert s.get_worker_coords(old) == coords[old]
    assert {r: s.get_worker_coords(r) for r in s.ranks} == coords


@settings(max_examples=200, deadline=None)
@given(s=meshes(), worker_id=st.integers(-3, 70))
def test_contains_agrees_with_get_worker_coords(s, worker_id):
    if s.contains_worker_id(worker_id):
        assert worker_id in s.ranks
        s.get_worker_coords(worker_id)
    else:
        assert worker_id not in s.ranks
        with raises_starting_with(
            ValueError, f"Worker ID {worker_id} not found in sharding layout."
        ):
            s.get_worker_coords(worker_id)


@settings(max_examples=100, deadline=None)
@given(s=meshes())
def test_repr_embeds_numpys_printing_of_the_layout(s):
    sizes = ", ".join(str(n) for n in s.shape.values())
    assert repr(s) == f"NamedSharding(shape=({sizes}), names={s.names}, layout={s.layout})"
