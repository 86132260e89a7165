"""Shared data: ``group.put()`` handles, large arguments through shared memory, and fault
injection -- the same behaviour on every backend."""

from __future__ import annotations

import signal

import numpy as np
import pytest

import phalanx as px
from phalanx import (
    CallTimeout,
    InjectedFault,
    ObjectFreed,
    ObjectRef,
    WorkerDied,
    WorkerError,
)
from phalanx.config import AUTO_SHARE_BYTES

WORLD = 2


class Holder:
    """Receives put objects and reports what it got."""

    def total(self, array) -> float:
        return float(np.asarray(array).sum())

    def describe(self, value) -> dict:
        def walk(v):
            if isinstance(v, np.ndarray):
                return ("array", v.shape, float(v.sum()), bool(v.flags.writeable))
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [walk(x) for x in v]
            return v

        return walk(value)

    def write(self, array) -> str:
        try:
            array[0] = -1
        except ValueError as exc:
            return f"refused: {exc}"
        return "written"

    def write_tensor(self, tensor) -> float:
        tensor[0] = 1000.0  # a copy-on-write page: this rank's own
        return float(tensor.sum())

    def tensor_info(self, tensor) -> tuple:
        return (str(tensor.dtype), tuple(tensor.shape), float(tensor.float().sum()))

    def same_object(self, a, b) -> bool:
        return a is b

    def items(self, array, n: int):
        for i in range(n):
            yield float(array[i])

    def rank_sum(self, shard, scale) -> float:
        return float(np.asarray(shard).sum() * np.asarray(scale).sum())

    def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def group(backend):
    from tests import helpers

    with helpers.long_lived_group(Holder, procs_per_node=WORLD, backend=backend,
                                  echo_output=False) as group:
        yield group


def test_a_put_object_reaches_every_rank_in_every_kind_of_call(group):
    array = np.arange(100_000, dtype=np.float64)
    ref = group.put(array)
    try:
        assert isinstance(ref, ObjectRef) and ref.nbytes >= array.nbytes
        expected = float(array.sum())
        assert group.call("total", ref) == [expected] * WORLD
        assert group.call_async("total", ref).result(timeout=60) == [expected] * WORLD
        assert group.map("total", [(ref,), (ref,)]) == [expected] * WORLD
        assert group.call_one(1, "total", ref) == expected
        streamed = list(group.call_stream("items", ref, 3))
        assert sorted(item for _, item in streamed) == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        # reused: the same object again, without sending it again
        assert group.call("total", ref) == [expected] * WORLD
    finally:
        ref.free()


def test_refs_nested_in_lists_and_dicts_resolve_and_stay_one_object(group):
    a = group.put(np.ones(1000))
    b = group.put({"weights": np.full(10, 2.0), "step": 7})
    try:
        got = group.call("describe", {"a": [a, (b, 3)], "plain": "x"})
        assert got == [{"a": [("array", (1000,), 1000.0, False),
                              [{"weights": ("array", (10,), 20.0, False), "step": 7}, 3]],
                        "plain": "x"}] * WORLD
        assert group.call("same_object", a, a) == [True] * WORLD
    finally:
        a.free()
        b.free()


def test_arrays_of_a_put_object_are_read_only_views(group):
    ref = group.put(np.zeros(1000))
    try:
        answers = group.call("write", ref)
        assert all(a.startswith("refused") and "read-only" in a for a in answers)
        assert group.call("total", ref) == [0.0] * WORLD  # nobody changed it
    finally:
        ref.free()


def test_torch_tensors_of_a_put_object(group):
    torch = pytest.importorskip("torch", reason="needs torch (pip install 'phalanx[torch]')")
    tensor = torch.arange(1000, dtype=torch.bfloat16)
    ref = group.put(tensor)
    try:
        info = group.call("tensor_info", ref)
        assert info[0] == ("torch.bfloat16", (1000,), float(tensor.float().sum()))
    finally:
        ref.free()
    ones = group.put(torch.ones(100))
    try:
        # each rank writes into its view: it sees its own write, never another rank's
        assert group.call("write_tensor", ones) == [1099.0] * WORLD
    finally:
        ones.free()


def test_map_passes_refs_to_each_rank(group):
    ref = group.put(np.ones(8))
    try:
        shards = [np.full(2, float(r + 1)) for r in range(WORLD)]
        got = group.map("rank_sum", shards, [ref] * WORLD)
        assert got == [2.0 * (r + 1) * 8 for r in range(WORLD)]
        got = group.map("rank_sum", shards, common_kwargs={"scale": ref})
        assert got == [2.0 * (r + 1) * 8 for r in range(WORLD)]
    finally:
        ref.free()


def test_call_sharded_passes_refs_with_each_shard(make_group):
    group = make_group(Holder, procs_per_node=WORLD, mesh={"dp": WORLD})
    ref = group.put(np.ones(8))
    got = group.call_sharded("rank_sum", [[1.0], [2.0]], in_sharded_axes=["dp"],
                             common_kwargs={"scale": ref}).result(timeout=60)
    assert got == [8.0, 16.0]
    ref.free()


def test_a_freed_ref_raises_naming_it_before_anything_is_sent(group):
    ref = group.put(np.ones(10))
    ref.free()
    ref.free()  # idempotent
    assert ref.freed
    with pytest.raises(ObjectFreed, match=rf"ObjectRef {ref.id}: ndarray.*freed"):
        group.call("total", ref)
    with pytest.raises(ObjectFreed):
        group.map("total", [(ref,), ([ref],)])
    assert group.call("ping") == ["pong"] * WORLD


def test_freeing_while_a_call_runs_waits_for_the_call(group):
    ref = group.put(np.ones(1000))
    future = group.call_async("total", ref)
    ref.free()
    assert future.result(timeout=60) == [1000.0] * WORLD


def test_a_ref_dropped_is_freed(group):
    import gc

    ref = group.put(np.ones(10))
    record = ref.record
    del ref
    gc.collect()
    assert record.state is px.RefState.RELEASED


def test_a_put_handle_goes_into_another_groups_calls_and_is_freed_with_it(group, backend):
    import gc

    with px.WorkerGroup(Holder, procs_per_node=2, backend=backend,
                        echo_output=False) as other:
        ref = group.put({"w": np.arange(1000.0)})
        described = other.call("describe", ref)  # the other group's nodes hold a copy
        assert described == [{"w": ("array", (1000,), 499500.0, False)}] * 2
        assert other.call("describe", [ref, ref])[0][1] == described[0]
        assert group.call("describe", ref) == described  # its own group still reads it
        assert len(other._shared) == 1
        ref.free()
        assert len(other._shared) == 0 and len(group._shared) == 0  # the copy went too
        with pytest.raises(ObjectFreed, match="freed"):
            other.call("describe", ref)
        dropped = group.put(np.ones(10))
        assert other.call("total", dropped) == [10.0, 10.0]
        del dropped
        gc.collect()
        assert len(other._shared) == 0 and len(group._shared) == 0
        assert other.call("ping") == ["pong", "pong"]


def test_large_arguments_go_through_shared_memory_with_the_same_results(group):
    big = np.arange(AUTO_SHARE_BYTES // 8 * 2, dtype=np.float64)
    assert group.call("total", big) == [float(big.sum())] * WORLD
    # writable, as arguments always are: each rank writes into its own copy of a page
    assert group.call("write", big) == ["written"] * WORLD
    assert group.call("total", big) == [float(big.sum())] * WORLD
    # nothing stays held once the calls are done
    assert len(group._shared) == 0


def test_a_ref_cannot_be_pickled_by_hand(group, backend):
    import pickle

    ref = group.put(1)
    try:
        with pytest.raises(TypeError, match="WorkerGroup that put it"):
            pickle.dumps(ref)
    finally:
        ref.free()


def test_inject_fault_raise(group):
    group.inject_fault(1, "ping", "raise", message="planned failure")
    with pytest.raises(WorkerError, match="planned failure") as info:
        group.call("ping")
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, InjectedFault)
    assert group.call("ping") == ["pong"] * WORLD  # only the next call


def test_inject_fault_hang_is_caught_by_a_timeout(make_group):
    group = make_group(Holder, procs_per_node=WORLD)
    group.inject_fault(0, "ping", "hang")
    with pytest.raises(CallTimeout):
        group.call("ping", timeout=0.5)


@pytest.mark.parametrize("kind, options", [
    ("signal", {}),
    ("signal", {"signal": signal.SIGSEGV}),
    ("exit", {"code": 3}),
])
def test_inject_fault_kills_the_rank(make_group, ranks, kind, options):
    group = make_group(Holder, procs_per_node=WORLD)
    group.inject_fault(1, "ping", kind, **options)
    assert group.call("ping", workers=[0]) == ["pong"]  # another rank: unaffected
    with pytest.raises(WorkerDied) as info:
        group.call("ping")
    assert info.value.rank == 1
    if kind == "exit":
        assert info.value.exitcode == 3 or not ranks.reports_signal
    elif ranks.reports_signal:
        name = signal.Signals(options.get("signal", signal.SIGKILL)).name
        assert info.value.signal == name
    group.restart()
    assert group.call("ping") == ["pong"] * WORLD


def test_inject_fault_checks_its_arguments(group):
    with pytest.raises(ValueError, match="fault kind must be one of"):
        group.inject_fault(0, "ping", "explode")
    with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.1"):
        group.inject_fault(5, "ping", "raise")
    with pytest.raises(AttributeError, match="no method 'pong'"):
        group.inject_fault(0, "pong", "raise")
    with pytest.raises(ValueError, match="exit code"):
        group.inject_fault(0, "ping", "exit", code=300)
    with pytest.raises(ValueError, match="signal must be a signal number"):
        group.inject_fault(0, "ping", "signal", signal=999)
    assert group.call("ping") == ["pong"] * WORLD
