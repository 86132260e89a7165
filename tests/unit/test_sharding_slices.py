"""Slices of a mesh, tied axes and data-parallel leaders: pure rules, checked against their
statements and a brute-force reference on random meshes (and the group's ``Mesh`` part,
which applies them before anything starts)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.controller.meshcalls import Mesh
from phalanx.world.layout import Layout
from phalanx.world.sharding import (
    NamedSharding,
    check_dp_leaders,
    check_tied,
    dp_leaders,
    plan_sharded_call,
    slice_sharding,
    tied_groups,
)


@st.composite
def meshes(draw):
    """A sharding with 1-3 axes of size 1-4 over a random permutation of ranks."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    names = draw(st.permutations(["dp", "pp", "tp"]))[: len(sizes)]
    ranks = draw(st.permutations(range(int(np.prod(sizes)))))
    return NamedSharding(np.array(ranks, dtype=int).reshape(sizes), names)


@st.composite
def selections(draw, s: NamedSharding):
    """Coordinates for some axes of ``s``: ints, ranges or lists (any order)."""
    chosen = {}
    axes = draw(st.lists(st.sampled_from(s.names), unique=True)) if s.names else []
    for axis in axes:
        size = s.get_axis_size(axis)
        kind = draw(st.sampled_from(["int", "range", "list"]))
        if kind == "int":
            chosen[axis] = draw(st.integers(0, size - 1))
        elif kind == "range":
            start = draw(st.integers(0, size - 1))
            chosen[axis] = range(start, draw(st.integers(start + 1, size)),
                                 draw(st.integers(1, 2)))
        else:
            chosen[axis] = draw(st.lists(st.integers(0, size - 1), min_size=1, unique=True))
    return chosen


def _picked(value) -> list[int]:
    return [value] if isinstance(value, int) else sorted(value)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_slice_holds_exactly_the_ranks_at_its_coordinates(data):
    s = data.draw(meshes())
    coords = data.draw(selections(s))
    part = slice_sharding(s, coords)
    expected = sorted(
        r for r in s.ranks
        if all(s.get_worker_coords(r)[a] in _picked(v) for a, v in coords.items())
    )
    assert part.ranks == expected
    # an int removes its axis; a range or list keeps it, narrowed to its coordinates
    kept = [a for a in s.names if not isinstance(coords.get(a), int)]
    assert part.names == kept
    for axis in kept:
        size = len(_picked(coords[axis])) if axis in coords else s.get_axis_size(axis)
        assert part.get_axis_size(axis) == size
    # coordinate k of a kept axis is the k-th smallest coordinate picked there
    for rank in part.ranks:
        outer, inner = s.get_worker_coords(rank), part.get_worker_coords(rank)
        for axis in kept:
            picked = _picked(coords[axis]) if axis in coords else list(range(s.get_axis_size(axis)))
            assert picked[inner[axis]] == outer[axis]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_slicing_twice_is_slicing_once_by_both(data):
    s = data.draw(meshes())
    first = data.draw(selections(s))
    part = slice_sharding(s, first)
    second = data.draw(selections(part))
    twice = slice_sharding(part, second)
    assert twice.names == [a for a in part.names if not isinstance(second.get(a), int)]
    expected = [r for r in part.ranks
                if all(part.get_worker_coords(r)[a] in _picked(v) for a, v in second.items())]
    assert twice.ranks == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_sharded_call_on_a_slice_calls_only_its_ranks(data):
    s = data.draw(meshes())
    part = slice_sharding(s, data.draw(selections(s)))
    axes = data.draw(st.permutations(part.names))
    plan = plan_sharded_call(part, axes)
    assert plan.called_ranks == part.ranks == plan.result_ranks
    for rank in part.ranks:
        coords = part.get_worker_coords(rank)
        assert plan.paths[rank] == tuple(coords[a] for a in axes)


def test_every_axis_given_an_int_leaves_one_rank_and_no_axis():
    s = NamedSharding.from_mesh({"dp": 2, "pp": 3, "tp": 2})
    part = slice_sharding(s, {"dp": 1, "pp": 2, "tp": 0})
    assert part.names == [] and part.ranks == [10] and part.shape == {}
    assert plan_sharded_call(part).called_ranks == [10]


@pytest.mark.parametrize(
    "coords, error, words",
    [
        ({"xp": 0}, ValueError, ["'xp'", "'dp' (size 2)", "'tp' (size 2)"]),
        ({"dp": 2}, ValueError, ["coordinate 2", "'dp'", "size 2"]),
        ({"tp": -1}, ValueError, ["coordinate -1", "'tp'", "size 2"]),
        ({"dp": [0, 5]}, ValueError, ["coordinate 5", "'dp'", "size 2"]),
        ({"dp": range(0, 3)}, ValueError, ["coordinate 2", "'dp'", "size 2"]),
        ({"dp": []}, ValueError, ["'dp'", "no coordinate"]),
        ({"dp": [1, 1]}, ValueError, ["'dp'", "twice"]),
        ({"dp": "0"}, TypeError, ["'dp'", "str"]),
        ({"dp": True}, TypeError, ["'dp'"]),
        ({"dp": [0.0]}, TypeError, ["'dp'", "0.0"]),
    ],
)
def test_bad_coordinates_name_the_axis_and_its_size(coords, error, words):
    with pytest.raises(error) as info:
        slice_sharding(NamedSharding.from_mesh({"dp": 2, "tp": 2}), coords)
    for word in words:
        assert word in str(info.value)


# -- tied axes ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_tied_groups_are_the_ranks_that_differ_only_along_the_tied_axes(data):
    s = data.draw(meshes())
    tied = data.draw(st.lists(st.sampled_from(s.names), unique=True))
    groups = tied_groups(s, tied)
    assert sorted(r for g in groups for r in g) == s.ranks
    others = [a for a in s.names if a not in tied]
    for group in groups:
        assert group == sorted(group)
        keys = {tuple(s.get_worker_coords(r)[a] for a in others) for r in group}
        assert len(keys) == 1
    assert len(groups) == int(np.prod([s.get_axis_size(a) for a in others]))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_tied_check_refuses_exactly_the_layouts_that_split_a_group(data):
    s = data.draw(meshes())
    tied = data.draw(st.lists(st.sampled_from(s.names), unique=True))
    per_node = data.draw(st.sampled_from([d for d in range(1, s.size + 1) if s.size % d == 0]))
    layout = Layout(s.size // per_node, per_node)
    split = [g for g in tied_groups(s, tied) if len({layout.node_of(r) for r in g}) > 1]
    if split:
        with pytest.raises(ValueError) as info:
            check_tied(s, tied, layout.node_of)
        assert str(split[0]) in str(info.value)
    else:
        check_tied(s, tied, layout.node_of)


def test_a_tp_group_across_two_nodes_is_refused_naming_axis_ranks_and_nodes():
    s = NamedSharding.from_mesh({"dp": 1, "tp": 4})
    layout = Layout(2, 2)
    with pytest.raises(ValueError) as info:
        check_tied(s, ["tp"], layout.node_of)
    text = str(info.value)
    assert "'tp'" in text and "[0, 1, 2, 3]" in text and "nodes [0, 1]" in text
    assert "node 0: ranks [0, 1]" in text and "node 1: ranks [2, 3]" in text
    check_tied(NamedSharding.from_mesh({"dp": 2, "tp": 2}), ["tp"], layout.node_of)


def test_unknown_tied_axes_name_the_mesh_axes():
    with pytest.raises(ValueError, match=r"'xp'.*'dp' \(size 2\).*'tp' \(size 2\)"):
        tied_groups(NamedSharding.from_mesh({"dp": 2, "tp": 2}), ["xp"])
    with pytest.raises(TypeError, match="string"):
        tied_groups(NamedSharding.from_mesh({"dp": 2, "tp": 2}), "tp")


# -- data-parallel leaders ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_one_rank_of_each_replica_is_accepted_and_anything_else_refused(data):
    s = data.draw(meshes())
    dp = s.names[0]
    replicas = [s.get_ranks_by_coord(**{dp: i}) for i in range(s.get_axis_size(dp))]
    assert check_dp_leaders(s, dp, dp_leaders(s, dp)) == dp_leaders(s, dp)
    good = [data.draw(st.sampled_from(members)) for members in replicas]
    assert check_dp_leaders(s, dp, good) == good
    assert check_dp_leaders(s, dp, tuple(np.array(good))) == good  # numpy ints too
    bad = data.draw(st.lists(st.integers(-1, s.size), max_size=5))
    if len(bad) == len(replicas) and all(r in m for r, m in zip(bad, replicas, strict=True)):
        assert check_dp_leaders(s, dp, bad) == bad
    else:
        with pytest.raises(ValueError):
            check_dp_leaders(s, dp, bad)


@pytest.mark.parametrize(
    "leaders, error, words",
    [
        ([0], ValueError, ["one rank per data-parallel replica", "2 along 'dp'", "got 1"]),
        ([0, 2, 3], ValueError, ["2 along 'dp'", "got 3"]),
        ([0, 4], ValueError, ["rank 4", "0..3"]),
        ([-1, 2], ValueError, ["rank -1", "0..3"]),
        ([2, 0], ValueError, ["leader 0 (rank 2)", "replica 0 (ranks [0, 1])"]),
        ([1, 1], ValueError, ["twice"]),
        ([0, "2"], TypeError, ["integer ranks", "'2'"]),
        (3, TypeError, ["list of ranks"]),
    ],
)
def test_wrong_leaders_are_refused_saying_why(leaders, error, words):
    with pytest.raises(error) as info:
        check_dp_leaders(NamedSharding.from_mesh({"dp": 2, "tp": 2}), "dp", leaders)
    for word in words:
        assert word in str(info.value)


def test_without_a_dp_axis_the_mesh_is_one_replica():
    s = NamedSharding.from_mesh({"tp": 4})
    assert check_dp_leaders(s, "dp", [3]) == [3]
    with pytest.raises(ValueError, match="no 'dp' axis: 1"):
        check_dp_leaders(s, "dp", [0, 1])


# -- the group's Mesh part applies them ---------------------------------------------------


def test_mesh_follows_given_leaders_and_slices_keep_their_own_plans():
    mesh = Mesh({"dp": 2, "tp": 2}, "dp", 4, layout=Layout(2, 2), tied_axes=["tp"],
                dp_leaders=[1, 3])
    assert (mesh.dp_size, mesh.dp_leader(0), mesh.dp_leader(1)) == (2, 1, 3)
    part = mesh.sliced({"dp": 1})
    assert part.sharding.names == ["tp"] and part.sharding.ranks == [2, 3]
    plan, keep = part.plan(["tp"], (), (), False)
    assert plan.called_ranks == [2, 3] and keep == [0, 1]
    assert part.plan(["tp"], (), (), False)[0] is plan  # made once


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"tied_axes": ["tp"]}, ["tied_axes", "mesh="]),
        ({"dp_leaders": [0, 1]}, ["dp_leaders", "mesh="]),
    ],
)
def test_tied_axes_and_leaders_need_a_mesh(kwargs, words):
    with pytest.raises(ValueError) as info:
        Mesh(None, "dp", 4, layout=Layout(1, 4), **kwargs)
    for word in words:
        assert word in str(info.value)


def test_mesh_refuses_a_layout_that_splits_a_tied_group():
    with pytest.raises(ValueError, match=r"'tp'.*\[0, 1, 2, 3\].*of 2 node\(s\) x 2"):
        Mesh({"dp": 1, "tp": 4}, "dp", 4, layout=Layout(2, 2), tied_axes=["tp"])
    with pytest.raises(ValueError, match=r"unknown axis 'xp'"):
        Mesh({"dp": 2, "tp": 2}, "dp", 4, layout=Layout(1, 4), tied_axes=["xp"])
    with pytest.raises(ValueError, match="not a rank of data-parallel replica"):
        Mesh({"dp": 2, "tp": 2}, "dp", 4, dp_leaders=[2, 0])


def test_a_group_without_a_mesh_has_no_slices():
    with pytest.raises(ValueError, match=r"slice\(\) needs a group created with mesh="):
        Mesh(None, "dp", 4).sliced({"dp": 0})
