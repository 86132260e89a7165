"""Groups with a mesh: call_sharded's slicing rules, rank0_only_axes, common_kwargs, dp leaders."""

from __future__ import annotations

import time

import psutil
import pytest

import phalanx.controller.request as group_module
from phalanx import NamedSharding, ShardedFuture, WorkerDied, WorkerError, WorkerGroup
from tests import helpers
from tests.workers import CountingPickles, MeshProbe, Probe

MESH = {"dp": 2, "tp": 2}  # row-major: dp=0 -> ranks 0, 1; dp=1 -> ranks 2, 3
WORLD = 4


def noted(rank: int, *args, **kwargs) -> tuple:
    return rank, args, kwargs


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        MeshProbe, procs_per_node=WORLD, mesh=MESH, backend=backend, echo_output=False
    ) as group:
        yield group


@pytest.fixture(scope="module")
def flat(backend):
    """A group without a mesh."""
    with helpers.long_lived_group(
        MeshProbe, procs_per_node=2, backend=backend, echo_output=False
    ) as group:
        yield group


@pytest.fixture
def clean(group):
    group.call("clear")
    return group


def nothing_ran(group) -> bool:
    return group.call("history") == [[]] * group.world_size



def test_group_sharding_is_the_row_major_mesh(group):
    assert group.sharding == NamedSharding.from_mesh(MESH)
    assert group.sharding.layout.tolist() == [[0, 1], [2, 3]]
    assert group.sharding.names == ["dp", "tp"]


def test_a_permuted_layout_is_accepted_and_respected(make_group):
    mesh = NamedSharding(layout=[[0, 2], [1, 3]], names=["dp", "tp"])
    group = make_group(MeshProbe, procs_per_node=WORLD, mesh=mesh)
    assert group.sharding == mesh
    # rank 0: dp0 tp0, rank 1: dp1 tp0, rank 2: dp0 tp1, rank 3: dp1 tp1
    by_dp = group.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"],
                               replicate_on_axes=["tp"]).result(timeout=10)
    assert by_dp == [noted(0, "a"), noted(1, "b"), noted(2, "a"), noted(3, "b")]
    data = [["00", "01"], ["10", "11"]]
    both = group.call_sharded("note", data, in_sharded_axes=["dp", "tp"]).result(timeout=10)
    assert both == [noted(0, "00"), noted(1, "10"), noted(2, "01"), noted(3, "11")]
    free = group.call_sharded("note", x=["a", "b"], in_sharded_axes=["dp"])
    assert free.called_ranks == [0, 1]  # tp=0 holds ranks 0 and 1 in this layout
    assert free.result(timeout=10) == [noted(0, x="a"), noted(1, x="b")]
    assert (group.dp_size, group.dp_leader(0), group.dp_leader(1)) == (2, 0, 1)


@pytest.mark.parametrize(
    "mesh",
    [
        {"dp": 2, "tp": 3},  # 6 ranks
        {"dp": 2},  # 2 ranks
        NamedSharding([[0, 1], [2, 5]], ["dp", "tp"]),  # size 4, but no rank 3
    ],
    ids=["too-large", "too-small", "missing-rank"],
)
def test_a_mesh_that_does_not_match_the_world_raises_before_any_process_starts(
    backend, monkeypatch, mesh
):
    opened = []
    real_create = group_module.create_backend

    def create(*args, **kwargs):
        created = real_create(*args, **kwargs)
        monkeypatch.setattr(created, "open", lambda *a, **k: opened.append(1))
        return created

    monkeypatch.setattr(group_module, "create_backend", create)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as info:
        WorkerGroup(Probe, procs_per_node=WORLD, mesh=mesh, backend=backend, echo_output=False)
    assert "mesh" in str(info.value) and "world size of 4" in str(info.value)
    assert opened == [], "a backend was opened for a group whose mesh is invalid"
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before and helpers.stray_children() == []



def test_data_sharded_on_dp_as_positional_and_keyword_arguments(clean):
    future = clean.call_sharded("note", ["p0", "p1"], item=("k0", "k1"),
                                in_sharded_axes=["dp"], replicate_on_axes=["tp"])
    assert isinstance(future, ShardedFuture)
    assert future.called_ranks == [0, 1, 2, 3] and future.result_ranks == [0, 1, 2, 3]
    assert future.result(timeout=10) == [
        noted(r, f"p{r // 2}", item=f"k{r // 2}") for r in range(WORLD)
    ]


@pytest.mark.parametrize(
    "axes, coords",
    [(["dp", "tp"], lambda r: (r // 2, r % 2)), (["tp", "dp"], lambda r: (r % 2, r // 2))],
    ids=["dp-tp", "tp-dp"],
)
def test_data_sharded_on_both_axes_is_indexed_in_the_order_given(clean, axes, coords):
    data = [[f"{i}{j}" for j in range(2)] for i in range(2)]
    kw = [[f"k{i}{j}" for j in range(2)] for i in range(2)]
    future = clean.call_sharded("note", data, kw=kw, in_sharded_axes=axes)
    assert future.called_ranks == future.result_ranks == [0, 1, 2, 3]
    expected = []
    for r in range(WORLD):
        i, j = coords(r)
        expected.append(noted(r, data[i][j], kw=kw[i][j]))
    assert future.result(timeout=10) == expected


def test_a_replicated_slice_is_pickled_once_per_distinct_slice(group):
    CountingPickles.pickled = 0
    future = group.call_sharded("identity", [CountingPickles(), CountingPickles()],
                                in_sharded_axes=["dp"], replicate_on_axes=["tp"])
    assert CountingPickles.pickled == 2, "2 dp shards replicated on tp: 2 pickles, not 4"
    results = future.result(timeout=10)
    assert len(results) == WORLD and all(isinstance(r, CountingPickles) for r in results)
    CountingPickles.pickled = 0
    data = [[CountingPickles(), CountingPickles()], [CountingPickles(), CountingPickles()]]
    group.call_sharded("identity", data, in_sharded_axes=["dp", "tp"]).result(timeout=10)
    assert CountingPickles.pickled == 4


def test_free_axes_are_not_called_without_dummy_calls(clean):
    future = clean.call_sharded("note", ["a", "b"], item=["x", "y"], in_sharded_axes=["dp"])
    assert future.called_ranks == [0, 2] and future.result_ranks == [0, 2]
    assert future.result(timeout=10) == [noted(0, "a", item="x"), noted(2, "b", item="y")]
    assert clean.call("history") == [
        [(("a",), {"item": "x"})], [], [(("b",), {"item": "y"})], []
    ]
    clean.call("clear")
    assert clean.call_sharded("note").result(timeout=10) == [noted(0)]  # every axis free
    assert clean.call("history") == [[((), {})], [], [], []]


def test_dummy_calls_give_free_axes_none_for_every_data_argument(clean):
    future = clean.call_sharded("note", ["a", "b"], item=["x", "y"], in_sharded_axes=["dp"],
                                dummy_calls_to_free_axes=True)
    assert future.called_ranks == [0, 1, 2, 3] and future.result_ranks == [0, 2]
    assert future.result(timeout=10) == [noted(0, "a", item="x"), noted(2, "b", item="y")]
    dummy = ((None,), {"item": None})
    assert clean.call("history") == [
        [(("a",), {"item": "x"})], [dummy], [(("b",), {"item": "y"})], [dummy]
    ]
    assert [f.rank for f in future.futures] == [0, 1, 2, 3]
    assert future.futures[3].result(timeout=10) == noted(3, None, item=None)


def test_output_is_replicated_keeps_one_result_per_dp_shard(clean):
    future = clean.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"],
                                replicate_on_axes=["tp"], output_is_replicated=["tp"])
    assert future.called_ranks == [0, 1, 2, 3] and future.result_ranks == [0, 2]
    assert future.result(timeout=10) == [noted(0, "a"), noted(2, "b")]
    assert clean.call("history") == [[(("a",), {})], [(("a",), {})],
                                     [(("b",), {})], [(("b",), {})]]


def test_common_kwargs_reach_every_called_rank_dummies_included(clean):
    future = clean.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"],
                                dummy_calls_to_free_axes=True, common_kwargs={"step": 7})
    assert future.result(timeout=10) == [noted(0, "a", step=7), noted(2, "b", step=7)]
    assert [f.result(timeout=10) for f in future.futures] == [
        noted(0, "a", step=7), noted(1, None, step=7), noted(2, "b", step=7),
        noted(3, None, step=7),
    ]


def test_a_keyword_both_per_rank_and_common_raises_and_sends_nothing(clean):
    with pytest.raises(ValueError, match="step"):
        clean.call_sharded("note", step=[1, 2], in_sharded_axes=["dp"],
                           common_kwargs={"step": 7})
    assert nothing_ran(clean)


@pytest.mark.parametrize(
    "args, kwargs, words",
    [
        ((["a", "b"],), {"in_sharded_axes": ["pp"]}, ["pp"]),
        ((), {"replicate_on_axes": ["pp"]}, ["pp"]),
        ((), {"output_is_replicated": ["pp"]}, ["pp"]),
        ((["a", "b"],), {"in_sharded_axes": ["dp"], "replicate_on_axes": ["dp"]},
         ["dp", "both sharded and replicated"]),
        ((["a", "b", "c"],), {"in_sharded_axes": ["dp"]}, ["'dp'", "2", "3"]),
        ((), {"x": ["a"], "in_sharded_axes": ["dp"]}, ["'dp'", "2", "1", "'x'"]),
        (([["a", "b", "c"], ["d", "e", "f"]],), {"in_sharded_axes": ["dp", "tp"]},
         ["'tp'", "2", "3", "level 1"]),
        ((), {"x": [["a", "b"], ["c"]], "in_sharded_axes": ["dp", "tp"]},
         ["'tp'", "2", "1", "level 1", "'x'"]),
    ],
    ids=["unknown-sharded", "unknown-replicated", "unknown-output", "sharded-and-replicated",
         "length-level0", "length-level0-keyword", "length-level1", "length-level1-keyword"],
)
def test_bad_call_sharded_raises_before_anything_is_sent(clean, args, kwargs, words):
    with pytest.raises(ValueError) as info:
        clean.call_sharded("note", *args, dummy_calls_to_free_axes=True, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert nothing_ran(clean)


def test_call_sharded_on_a_group_without_a_mesh_raises(flat):
    flat.call("clear")
    assert flat.sharding is None
    with pytest.raises(ValueError, match="mesh"):
        flat.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"])
    assert nothing_ran(flat)



def test_rank0_only_axes_on_call_and_call_async(group):
    assert group.call("rank", rank0_only_axes=["tp"]) == [0, 2]
    assert group.call("rank", rank0_only_axes=["dp"]) == [0, 1]
    assert group.call("rank", rank0_only_axes=["dp", "tp"]) == [0]
    assert group.call_async("rank", rank0_only_axes=["tp"]).result(timeout=10) == [0, 2]
    assert group.call("rank", workers=[1, 2, 3], rank0_only_axes=["tp"]) == [2]


def test_rank0_only_axes_on_map(clean):
    assert clean.map("note", ["x", "y"], k=[1, 2], rank0_only_axes=["tp"]) == [
        noted(0, "x", k=1), noted(2, "y", k=2)
    ]
    assert clean.call("history") == [[(("x",), {"k": 1})], [], [(("y",), {"k": 2})], []]
    clean.call("clear")
    with pytest.raises(ValueError) as info:
        clean.map("note", ["a", "b", "c", "d"], rank0_only_axes=["tp"])
    assert "4" in str(info.value) and "2" in str(info.value)
    assert nothing_ran(clean)
    assert clean.map_async("note", ["x", "y"], rank0_only_axes=["tp"]).result(timeout=10) == [
        noted(0, "x"), noted(2, "y")
    ]


def test_map_with_common_kwargs(clean):
    assert clean.map("note", ["x", "y"], rank0_only_axes=["tp"], common_kwargs={"step": 3}) == [
        noted(0, "x", step=3), noted(2, "y", step=3)
    ]
    assert clean.map("add", [1, 2, 3, 4], common_kwargs={"b": 10}) == [11, 12, 13, 14]
    clean.call("clear")
    with pytest.raises(ValueError, match="b"):
        clean.map("note", [1, 2, 3, 4], b=[1, 2, 3, 4], common_kwargs={"b": 10})
    assert nothing_ran(clean)


def test_rank0_only_axes_errors(group, flat):
    with pytest.raises(ValueError, match="pp"):
        group.call("rank", rank0_only_axes=["pp"])
    with pytest.raises(ValueError, match="pp"):
        group.map("rank", rank0_only_axes=["pp"])
    with pytest.raises(ValueError, match="mesh"):
        flat.call("rank", rank0_only_axes=["tp"])
    with pytest.raises(ValueError, match="mesh"):
        flat.map("add", [1], rank0_only_axes=["tp"])
    assert group.call("rank") == [0, 1, 2, 3]



def test_dp_size_and_leaders(group, flat, make_group):
    assert group.dp_size == 2
    assert [group.dp_leader(i) for i in range(group.dp_size)] == [0, 2]
    for bad in (2, -1):
        with pytest.raises(IndexError):
            group.dp_leader(bad)
    by_tp = make_group(Probe, procs_per_node=WORLD, mesh=MESH, dp_axis="tp")
    assert (by_tp.dp_size, by_tp.dp_leader(0), by_tp.dp_leader(1)) == (2, 0, 1)
    assert flat.dp_size == flat.world_size == 2
    assert [flat.dp_leader(i) for i in range(2)] == [0, 1]
    with pytest.raises(IndexError):
        flat.dp_leader(2)



def test_a_three_axis_mesh(make_group):
    mesh = {"dp": 2, "pp": 2, "tp": 2}  # rank = 4 * dp + 2 * pp + tp
    group = make_group(MeshProbe, nodes=1, procs_per_node=8, mesh=mesh)
    assert group.sharding == NamedSharding.from_mesh(mesh)
    assert (group.dp_size, group.dp_leader(0), group.dp_leader(1)) == (2, 0, 4)
    future = group.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"],
                                replicate_on_axes=["tp"], output_is_replicated=["tp"])
    assert future.called_ranks == [0, 1, 4, 5] and future.result_ranks == [0, 4]
    assert future.result(timeout=10) == [noted(0, "a"), noted(4, "b")]
    data = [[f"pp{p}dp{d}" for d in range(2)] for p in range(2)]
    future = group.call_sharded("note", data, in_sharded_axes=["pp", "dp"],
                                replicate_on_axes=["tp"])
    assert future.called_ranks == future.result_ranks == list(range(8))
    assert future.result(timeout=10) == [
        noted(r, f"pp{(r // 2) % 2}dp{r // 4}") for r in range(8)
    ]
    future = group.call_sharded("note", x=["a", "b"], in_sharded_axes=["dp"],
                                dummy_calls_to_free_axes=True, common_kwargs={"s": 1})
    assert future.called_ranks == list(range(8)) and future.result_ranks == [0, 4]
    assert future.result(timeout=10) == [noted(0, x="a", s=1), noted(4, x="b", s=1)]
    assert future.futures[7].result(timeout=10) == noted(7, x=None, s=1)
    assert group.call("rank", rank0_only_axes=["pp", "tp"]) == [0, 4]
    assert group.map("rank", rank0_only_axes=["dp", "tp"]) == [0, 2]



def test_a_worker_error_inside_call_sharded_fails_fast_with_its_rank(make_group):
    group = make_group(MeshProbe, procs_per_node=WORLD, mesh=MESH)
    # Every rank runs fail_on_rank(rank=3, sleep=5): rank 3 raises, the others sleep.
    future = group.call_sharded("fail_on_rank", [3, 3], in_sharded_axes=["dp"],
                                replicate_on_axes=["tp"], common_kwargs={"sleep": 5})
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        future.result(timeout=10)
    # the others sleep 5 s; the error comes well before (room for a loaded machine)
    assert time.monotonic() - started < 4, "the sleeping ranks must not delay the error"
    assert info.value.rank == 3 and info.value.exc_type == "KeyError"
    group.shutdown(timeout=0.2)  # the other ranks are still sleeping: do not wait for them


def test_a_killed_rank_makes_call_sharded_raise_worker_died_at_once(make_group, ranks):
    group = make_group(MeshProbe, procs_per_node=WORLD, mesh=MESH)
    pid = group.call_one(3, "pid")
    ranks.kill(group, 3)
    assert helpers.wait_dead(pid)
    started = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        group.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"], replicate_on_axes=["tp"])
    # at once: the call has no timeout, so the fault is a call that never ends; a dead
    # rank's end reaches the controller in ms, seconds on a loaded machine
    assert time.monotonic() - started < 3
    assert info.value.rank == 3 and info.value.signal == "SIGKILL"
    # A plan that does not call rank 3 still runs.
    future = group.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"])
    assert future.result(timeout=10) == [noted(0, "a"), noted(2, "b")]
