"""Slices of a group (``group.slice(dp=1)``), tied mesh axes and data-parallel leaders, on
every backend."""

from __future__ import annotations

import psutil
import pytest

import phalanx.controller.request as request_module
from phalanx import GroupClosed, GroupFuture, ShardedFuture, WorkerGroup
from tests import helpers
from tests.workers import MeshProbe, Probe

# Row-major on 2 nodes x 2 ranks: dp=0 -> ranks 0, 1 (node 0); dp=1 -> ranks 2, 3 (node 1).
MESH = {"dp": 2, "tp": 2}


def noted(rank: int, *args, **kwargs) -> tuple:
    return rank, args, kwargs


@pytest.fixture(scope="module")
def group(backend):
    """Each tp group on one node (tied), and the dp leaders at tp=1."""
    with helpers.long_lived_group(
        MeshProbe, nodes=2, procs_per_node=2, mesh=MESH, tied_axes=["tp"], dp_leaders=[1, 3],
        backend=backend, echo_output=False,
    ) as group:
        yield group


@pytest.fixture
def clean(group):
    group.call("clear")
    return group


def history(group) -> list:
    return [len(h) for h in group.call("history")]


def test_a_slice_shows_its_ranks_and_its_mesh(group):
    part = group.slice(dp=1)
    assert part.ranks == [2, 3] and part.world_size == part.size == 2
    assert part.mesh == {"tp": 2} and part.sharding.layout.tolist() == [2, 3]
    assert "ranks=[2, 3]" in repr(part) and "MeshProbe" in repr(part)
    whole = group.slice()
    assert whole.ranks == [0, 1, 2, 3] and whole.sharding == group.sharding
    assert whole.call("rank") == [0, 1, 2, 3]
    assert sorted(whole.call_stream("rank")) == [(r, r) for r in range(4)]


def test_every_call_form_reaches_only_the_slice(clean):
    part = clean.slice(dp=1)
    assert part.call("rank", timeout=10) == [2, 3]
    future = part.call_async("note", 1, k="v")
    assert isinstance(future, GroupFuture)
    assert future.result(timeout=10) == [noted(2, 1, k="v"), noted(3, 1, k="v")]
    assert part.map("note", ["a", "b"], common_kwargs={"c": 0}) == [
        noted(2, "a", c=0), noted(3, "b", c=0)]
    assert part.map_async("note", x=[5, 6]).result(timeout=10) == [
        noted(2, x=5), noted(3, x=6)]
    assert part.call_one(3, "rank") == 3
    assert sorted(part.call_stream("rank", timeout=10)) == [(2, 2), (3, 3)]
    assert part.note.call("attr") == [noted(2, "attr"), noted(3, "attr")]
    assert part.note.map(["p", "q"]) == [noted(2, "p"), noted(3, "q")]
    assert history(clean) == [0, 0, 5, 5]


def test_a_slice_on_two_axes_and_a_slice_of_a_slice(clean):
    column = clean.slice(dp=range(0, 2), tp=range(1, 2))  # ranges keep both axes
    assert column.ranks == [1, 3] and column.mesh == {"dp": 2, "tp": 1}
    assert column.call("rank") == [1, 3]
    one = clean.slice(dp=1, tp=0)  # ints remove both
    assert one.ranks == [2] and one.mesh == {} and one.call("rank") == [2]
    assert clean.slice(tp=[0, 1]).slice(dp=1).ranks == [2, 3]
    assert clean.slice(dp=[1, 0]).ranks == [0, 1, 2, 3]
    assert column.slice(dp=0).call("rank") == [1]
    with pytest.raises(ValueError, match=r"'dp'.*'tp' \(size 2\)"):
        clean.slice(dp=1).slice(dp=0)  # dp=1 removed the axis
    assert history(clean) == [0, 0, 0, 0]


def test_call_sharded_runs_over_the_axes_the_slice_kept(clean):
    replica = clean.slice(dp=1)
    future = replica.call_sharded("note", ["a", "b"], in_sharded_axes=["tp"])
    assert isinstance(future, ShardedFuture)
    assert future.called_ranks == [2, 3] and future.result_ranks == [2, 3]
    assert future.result(timeout=10) == [noted(2, "a"), noted(3, "b")]
    column = clean.slice(tp=1)
    assert column.call_sharded("note", x=["a", "b"], in_sharded_axes=["dp"]).result(
        timeout=10) == [noted(1, x="a"), noted(3, x="b")]
    # tp free on the whole-mesh slice: only tp=0 is called, as on the group
    free = clean.slice(dp=range(2)).call_sharded("note", ["a", "b"], in_sharded_axes=["dp"])
    assert free.called_ranks == [0, 2]
    assert free.result(timeout=10) == [noted(0, "a"), noted(2, "b")]
    replicated = replica.call_sharded("note", y=1, replicate_on_axes=["tp"],
                                      output_is_replicated=["tp"])
    assert replicated.called_ranks == [2, 3] and replicated.result(timeout=10) == [
        noted(2, y=1)]
    with pytest.raises(ValueError, match="unknown axis 'dp'"):
        replica.call_sharded("note", ["a", "b"], in_sharded_axes=["dp"])
    with pytest.raises(ValueError, match="'tp' has size 2"):
        replica.call_sharded("note", ["a", "b", "c"], in_sharded_axes=["tp"])
    assert history(clean) == [1, 1, 3, 3]


def test_rank0_only_axes_are_the_slices_axes(clean):
    assert clean.slice(tp=range(2)).call("rank", rank0_only_axes=["tp"]) == [0, 2]
    assert clean.slice(dp=1).map("note", [7], rank0_only_axes=["tp"]) == [noted(2, 7)]


@pytest.mark.parametrize(
    "coords, words",
    [
        ({"pp": 0}, ["'pp'", "'dp' (size 2)", "'tp' (size 2)"]),
        ({"dp": 2}, ["coordinate 2", "'dp'", "size 2"]),
        ({"tp": range(1, 3)}, ["coordinate 2", "'tp'", "size 2"]),
        ({"dp": [0, -1]}, ["coordinate -1", "'dp'", "size 2"]),
    ],
)
def test_unknown_axes_and_coordinates_out_of_range_are_refused(clean, coords, words):
    with pytest.raises(ValueError) as info:
        clean.slice(**coords)
    for word in words:
        assert word in str(info.value)


def test_a_slice_refuses_ranks_and_methods_it_does_not_have(clean):
    part = clean.slice(dp=1)
    with pytest.raises(ValueError, match=r"rank 0 is not in this slice.*\[2, 3\]"):
        part.call_one(0, "rank")
    with pytest.raises(AttributeError, match="no method 'nope'"):
        part.call("nope")
    with pytest.raises(AttributeError):
        part.nope  # noqa: B018
    with pytest.raises(ValueError, match="has 3 items but 2 ranks"):
        part.map("note", [1, 2, 3])
    assert history(clean) == [0, 0, 0, 0]


def test_given_dp_leaders_are_the_groups(group):
    assert (group.dp_size, group.dp_leader(0), group.dp_leader(1)) == (2, 1, 3)
    assert [group.call_one(group.dp_leader(i), "rank") for i in range(2)] == [1, 3]


def test_a_slice_of_a_shut_down_group_raises_group_closed(make_group):
    small = make_group(MeshProbe, procs_per_node=2, mesh={"dp": 2})
    part = small.slice(dp=1)
    assert part.call("rank") == [1]
    small.shutdown()
    for use in (lambda: part.call("rank"), lambda: part.call_async("rank"),
                lambda: part.map("note", [1]), lambda: part.call_one(1, "rank"),
                lambda: part.call_stream("rank"), lambda: part.rank.call(),
                lambda: part.call_sharded("note", [1], in_sharded_axes=[]),
                lambda: small.slice(dp=0), lambda: part.slice()):
        with pytest.raises(GroupClosed):
            use()


# -- refused before anything starts -------------------------------------------------------


def refused(backend, monkeypatch, **kwargs) -> str:
    """The ValueError ``WorkerGroup(Probe, **kwargs)`` raises, checked to have opened no
    backend and started no process."""
    opened = []
    real_create = request_module.create_backend

    def create(*args, **kw):
        created = real_create(*args, **kw)
        monkeypatch.setattr(created, "open", lambda *a, **k: opened.append(1))
        return created

    monkeypatch.setattr(request_module, "create_backend", create)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as info:
        WorkerGroup(Probe, backend=backend, echo_output=False, **kwargs)
    assert opened == [], "a backend was opened for a group that was refused"
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before and helpers.stray_children() == []
    return str(info.value)


@pytest.mark.parametrize(
    "mesh, words",
    [
        ({"dp": 1, "tp": 4}, ["'tp'", "[0, 1, 2, 3]", "nodes [0, 1]"]),
        ({"tp": 2, "dp": 2}, ["'tp'", "[0, 2]", "nodes [0, 1]"]),  # tp groups 0,2 and 1,3
    ],
)
def test_tied_ranks_split_across_nodes_are_refused_before_any_process_starts(
        backend, monkeypatch, mesh, words):
    text = refused(backend, monkeypatch, nodes=2, procs_per_node=2, mesh=mesh,
                   tied_axes=["tp"])
    for word in words:
        assert word in text


def test_unknown_tied_axes_and_tied_axes_without_a_mesh_are_refused(backend, monkeypatch):
    text = refused(backend, monkeypatch, procs_per_node=4, mesh=MESH, tied_axes=["xp"])
    assert "'xp'" in text and "'dp' (size 2)" in text and "'tp' (size 2)" in text
    text = refused(backend, monkeypatch, procs_per_node=4, tied_axes=["tp"])
    assert "tied_axes" in text and "mesh=" in text


@pytest.mark.parametrize(
    "leaders, words",
    [
        ([0], ["one rank per data-parallel replica", "got 1"]),
        ([0, 4], ["rank 4", "0..3"]),
        ([2, 0], ["leader 0 (rank 2)", "replica 0"]),
        ([1, 1], ["twice"]),
        (None, ["dp_leaders", "mesh="]),
    ],
)
def test_wrong_dp_leaders_are_refused_before_any_process_starts(
        backend, monkeypatch, leaders, words):
    mesh = MESH if leaders is not None else None
    text = refused(backend, monkeypatch, procs_per_node=4, mesh=mesh,
                   dp_leaders=leaders if leaders is not None else [0, 1, 2, 3])
    for word in words:
        assert word in text
