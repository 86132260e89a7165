"""Results that stay on ranks (``keep=True``) and their handles passed between groups, on
every backend with the same test code: values and order, ``get``/``free``, handles in
``call``/``map``/``call_sharded`` and nested in containers, a dead producer, dropped
handles freed on the producer, and the controller's memory while bytes move."""

from __future__ import annotations

import gc
import os
import re
import time

import numpy as np
import psutil
import pytest

import phalanx as px
from phalanx import ObjectFreed, ObjectLost, WorkerGroup
from tests import helpers
from tests.helpers import wait_until

MIB = 1 << 20


class Producer:
    def make(self, n: int, scale: float = 1.0) -> np.ndarray:
        return np.full(n, float(os.environ["RANK"]) + scale)

    def pair(self) -> dict:
        return {"rank": int(os.environ["RANK"]), "data": np.arange(4.0)}

    def kept(self) -> int:
        from phalanx.rank.kept import KEPT  # what this rank holds for the controller

        return len(KEPT)

    def pid(self) -> int:
        return os.getpid()

    def blocks(self) -> list[str]:
        """The memory blocks this rank keeps its results in."""
        from phalanx.rank.kept import KEPT

        return sorted(held[0].token for held in KEPT._held.values() if type(held) is tuple)

    def pooled(self) -> list[str]:
        """The blocks of dropped results this rank keeps for its next ones."""
        from phalanx.rank.kept import KEPT

        return sorted(block.token for _, block in KEPT._pool)


class Consumer:
    def total(self, array) -> tuple[float, bool]:
        return float(np.asarray(array).sum()), bool(np.asarray(array).flags.writeable)

    def totals(self, nested: dict) -> list[float]:
        return [float(a.sum()) for a in nested["arrays"]]

    def shard(self, items) -> float:
        return float(sum(a.sum() for a in items))

    def rank_of(self, value: dict) -> int:
        return value["rank"]

    def ping(self) -> str:
        return "pong"

    def hold(self, array) -> float:
        self.held = array  # a view the rank keeps after the call
        return float(array.sum())

    def held_sum(self) -> float:
        return float(self.held.sum())

    def release(self) -> None:
        self.held = None

    def mapped(self, tokens: list[str]) -> list[str]:
        """Which of these blocks this rank maps now."""
        with open("/proc/self/maps") as f:
            maps = f.read()
        return [t for t in tokens if t in maps]


@pytest.fixture(scope="module")
def groups(backend):
    nodes = 2 if not isinstance(backend, str) else 1  # on agents: two nodes, 127.0.0.2-3
    procs = 1 if nodes == 2 else 2
    with helpers.long_lived_group(Producer, nodes=nodes, procs_per_node=procs,
                                  backend=backend, echo_output=False) as producers, \
            helpers.long_lived_group(Consumer, nodes=nodes, procs_per_node=procs,
                                     backend=backend, mesh={"dp": 2},
                                     echo_output=False) as consumers:
        yield producers, consumers


def test_handles_carry_values_between_groups_in_any_order(groups):
    producers, consumers = groups
    refs = producers.call("make", 1000, keep=True)
    assert all(isinstance(r, px.ResultRef) for r in refs)
    assert "make() on rank 1" in repr(refs[1]) and "Producer" in repr(refs[1])
    assert refs[0].nbytes >= 8000
    # each consumer reads the other rank's result (across nodes on agents)
    assert consumers.map("total", refs[::-1]) == [(2000.0, False), (1000.0, False)]
    assert consumers.call("total", refs[0]) == [(1000.0, False)] * 2  # fetched per rank
    assert [float(r.get().sum()) for r in refs] == [1000.0, 2000.0]
    nested = consumers.call("totals", {"arrays": refs})  # inside containers
    assert nested == [[1000.0, 2000.0]] * 2
    one = producers.call_one(1, "pair", keep=True)
    assert consumers.call("rank_of", one) == [1, 1]
    mapped = producers.map("make", [10, 20], keep=True)
    assert [float(r.get().sum()) for r in mapped] == [10.0, 40.0]


def test_handles_go_into_call_sharded_and_come_out_of_it(groups):
    producers, consumers = groups
    refs = producers.call("make", 10, keep=True)
    result = consumers.call_sharded("shard", [refs[0], refs[1]], in_sharded_axes=["dp"])
    assert result.result(timeout=30) == [10.0, 20.0]
    sharded = consumers.call_sharded("shard", [refs[0], refs[1]], in_sharded_axes=["dp"],
                                     keep=True).result(timeout=30)
    assert [r.get() for r in sharded] == [10.0, 20.0]


def test_a_freed_handle_raises_before_anything_is_sent(groups):
    producers, consumers = groups
    ref = producers.call_one(0, "make", 10, keep=True)
    ref.free()
    ref.free()  # idempotent
    with pytest.raises(ObjectFreed, match="freed"):
        consumers.call("total", ref)
    with pytest.raises(ObjectFreed):
        ref.get()
    assert consumers.call("ping") == ["pong", "pong"]


def test_dropped_and_freed_handles_release_their_results_on_the_producers(groups):
    producers, consumers = groups
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)
    refs = producers.call("make", MIB, keep=True)
    kept = producers.call_async("make", 10, keep=True)
    assert producers.call("kept") == [2, 2]
    consumers.map("total", refs)
    del refs
    kept.result(timeout=30)[0].free()
    del kept
    gc.collect()
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)


def test_moving_bytes_between_groups_does_not_grow_the_controller(groups):
    producers, consumers = groups
    me = psutil.Process()
    for _ in range(3):  # warm: the first rounds allocate what every round reuses
        consumers.map("total", producers.call("make", 2 * MIB, keep=True))
    gc.collect()
    before = me.memory_info().rss
    for _ in range(30):  # 30 x 2 ranks x 16 MiB cross between the groups
        refs = producers.call("make", 2 * MIB, keep=True)
        assert [t for t, _ in consumers.map("total", refs[::-1])] == [
            float(2 * MIB * 2), float(2 * MIB)]
    del refs
    gc.collect()
    grown = me.memory_info().rss - before
    assert grown < 16 * MIB, f"the controller grew {grown / MIB:.1f} MiB"
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)


def test_a_dead_producer_is_object_lost_and_a_group_shut_down_is_object_freed(backend):
    with WorkerGroup(Producer, procs_per_node=2, backend=backend, echo_output=False) as p, \
            WorkerGroup(Consumer, backend=backend, echo_output=False) as c:
        refs = p.call("make", 100, keep=True)
        p.inject_fault(1, "pid", "signal")
        with pytest.raises(px.WorkerDied):
            p.call_one(1, "pid")
        with pytest.raises(ObjectLost) as info:
            c.call("total", refs[1])
        assert f"rank 1 of group {p.name}" in str(info.value)
        assert "died" in str(info.value) or "gone" in str(info.value)
        with pytest.raises(ObjectLost):
            refs[1].get()
        assert c.call("total", refs[0]) == [(100.0, False)]  # the other rank's is there
        assert c.call("ping") == ["pong"]
        put = c.put(np.ones(4))
    # once their groups are shut down, handles of both kinds say so, on every backend
    with pytest.raises(ObjectFreed, match=re.escape(f"group {p.name} was shut down")):
        refs[0].get()
    assert refs[0].state is px.RefState.RELEASED and refs[1].state is px.RefState.LOST
    assert put.state is px.RefState.RELEASED and put.freed


def test_a_result_a_rank_still_holds_is_never_overwritten_by_the_next(groups):
    producers, consumers = groups
    first = producers.call("make", MIB, keep=True)
    assert consumers.map("hold", first) == [1.0 * MIB, 2.0 * MIB]  # views kept by the ranks
    held = producers.call("blocks")
    del first
    gc.collect()
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)
    again = producers.call("make", MIB, 5.0, keep=True)
    assert consumers.map("total", again) == [(5.0 * MIB, False), (6.0 * MIB, False)]
    assert consumers.call("held_sum") == [1.0 * MIB, 2.0 * MIB]  # what they hold is intact
    now = producers.call("blocks")
    assert all(not set(h) & set(n) for h, n in zip(held, now, strict=True)), (held, now)
    consumers.call("release")
    del again


def test_a_block_no_one_reads_any_more_is_reused_for_the_next_result(groups):
    producers, consumers = groups
    first = producers.call("make", MIB, keep=True)
    consumers.map("total", first)  # read, and no view left
    blocks = producers.call("blocks")
    del first
    gc.collect()
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)
    pooled = producers.call("pooled")
    assert all(set(b) <= set(p) for b, p in zip(blocks, pooled, strict=True)), (blocks, pooled)
    second = producers.call("make", MIB, 3.0, keep=True)
    now = producers.call("blocks")  # pooled blocks, written again
    assert all(len(n) == 1 and n[0] in p for n, p in zip(now, pooled, strict=True)), (now, pooled)
    assert consumers.map("total", second) == [(3.0 * MIB, False), (4.0 * MIB, False)]
    assert [float(r.get().sum()) for r in second] == [3.0 * MIB, 4.0 * MIB]


def test_a_reader_maps_a_block_once_and_lets_it_go_once_unread(groups, backend):
    producers, consumers = groups
    first = producers.call("make", MIB, keep=True)
    consumers.map("total", first[::-1])
    held = producers.call("blocks")  # each producer's one block
    blocks = [token for tokens in held for token in tokens]
    del first
    gc.collect()
    assert wait_until(lambda: producers.call("kept") == [0, 0], 10)
    second = producers.call("make", MIB, 7.0, keep=True)  # into the same blocks, pooled
    read = time.monotonic()
    assert consumers.map("total", second[::-1]) == [(8.0 * MIB, False), (7.0 * MIB, False)]
    if isinstance(backend, str):  # (agents: each node reads a copy of its own)
        mapped = consumers.map("mapped", held[::-1])
        if time.monotonic() - read < 0.8:  # a mapping goes 1 s after its last read: a
            assert mapped == held[::-1]  # loaded machine may take that long between calls
    del second
    gc.collect()
    # freed, unread: the producers close their pooled blocks, the readers unmap them
    assert wait_until(lambda: consumers.call("mapped", blocks) == [[], []], 10)


def test_handles_cannot_be_put(groups):
    producers, consumers = groups
    ref = producers.call_one(0, "make", 10, keep=True)
    with pytest.raises(TypeError, match="cannot be put"):
        consumers.put({"ref": ref})
