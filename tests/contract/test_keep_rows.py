"""``px.keep()`` inside results and rows of kept results (``ref[a:b]``, ``ref[[0, 2]]``,
``ref[mask]``, ``px.chunk``), on every backend with the same test code: handles in place
of the kept parts (in call, call_one, map and streamed items), read by another group's
ranks and freed on the producer; slices and picked rows of arrays, tensors, dicts and
lists reaching a rank as only those rows, in order; chunks across producers joined into
one value, empty chunks as empty lists, and chunks' ``indices`` lining the controller's
per-row arrays up with the rows each rank receives; the errors; a freed parent, a dead
producer; and the controller's memory while chunks move."""

from __future__ import annotations

import gc
import os
import re
import threading
import time

import numpy as np
import psutil
import pytest

import phalanx as px
from phalanx import ObjectFreed, ObjectLost, WorkerError, WorkerGroup
from tests import helpers
from tests.helpers import wait_until

MIB = 1 << 20
T = 60  # seconds: no call of this module waits longer


def tokens(n: int, rank: int, base: float = 0.0) -> np.ndarray:
    """What Producer.batch keeps on ``rank``: n rows of two columns."""
    return np.arange(n * 2, dtype=np.float64).reshape(n, 2) + base + 1000 * rank


def fields(n: int, base: int) -> dict:
    """What Producer.fields keeps: a dict of arrays with one first dimension."""
    return {"a": np.arange(n) + base, "b": (np.arange(2 * n) + base).reshape(n, 2)}


class Producer:
    def rank(self) -> int:
        return int(os.environ["RANK"])

    def batch(self, n: int, base: float = 0.0) -> dict:
        return {"tokens": px.keep(tokens(n, self.rank(), base)), "lengths": [n, self.rank()]}

    def batch_or_fail(self, n: int, failing: int, parts: bool) -> dict | np.ndarray:
        """:meth:`batch` (``parts``: with a px.keep() part; else a plain array), except
        on rank ``failing``, which raises once the others have answered (so that the call
        fails with every other rank's answer in)."""
        if self.rank() == failing:
            time.sleep(0.5)
            raise ValueError("this rank's batch failed")
        return self.batch(n) if parts else tokens(n, self.rank())

    def whole(self, n: int) -> px.keep:
        return px.keep(np.arange(n) + 100 * self.rank())

    def listed(self, n: int) -> list:
        return [px.keep(np.arange(n) + 100 * self.rank()), "tag",
                px.keep({"rank": self.rank()})]

    def stream(self, k: int):
        for i in range(k):
            yield {"i": i, "data": px.keep(np.full(3, 10.0 * self.rank() + i))}

    def fields(self, n: int, base: int):
        return px.keep(fields(n, base))

    def items(self, n: int, base: int):
        return px.keep([{"i": base + i} for i in range(n)])

    def rollouts(self, lengths: list[int], base: int):
        """Rollouts of different lengths: a list of items."""
        return px.keep([np.full(length, float(base + i)) for i, length in enumerate(lengths)])

    def scored(self, groups: int, size: int) -> dict:
        """GRPO-shaped: ``size`` completions of each of ``groups`` prompts. The rows (ids
        numbered across ranks) stay here; their rewards come back. Every odd group's
        rewards all tie: GRPO drops such a group, it has nothing to learn from."""
        ids = np.arange(groups * size) + 1000 * self.rank()
        rewards = [1.0 if g % 2 else float(i == self.rank() % size)
                   for g in range(groups) for i in range(size)]
        return {"rows": px.keep({"id": ids, "x": ids * 2.0}), "rewards": rewards}

    def tensor(self, n: int, base: float):
        import torch

        return px.keep(torch.arange(n, dtype=torch.float32) + base)

    def scalar(self):
        return px.keep(3.5)

    def big(self, n: int, cols: int):
        return px.keep(np.full((n, cols), float(self.rank() + 1)))

    def nested(self):
        return px.keep({"inner": px.keep(np.arange(3))})

    def with_keep(self):
        return {"inner": px.keep(np.arange(3))}

    def unpicklable(self):
        return [px.keep(np.arange(4)), threading.Lock()]

    def held(self) -> list:
        from phalanx.rank.kept import KEPT  # what this rank holds for the controller

        return list(KEPT._held)

    def pid(self) -> int:
        return os.getpid()

    def import_torch(self) -> None:
        import torch

        torch.set_num_threads(1)


def _arrays(value) -> list:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


class Consumer:
    looks = 0

    def look(self, value) -> tuple:
        """What this rank received, and whether each of its arrays is writable."""
        self.looks += 1
        return value, [bool(a.flags.writeable) for a in _arrays(value)]

    def looked(self) -> int:
        return self.looks

    def look_tensor(self, value) -> tuple:
        return type(value).__name__, str(value.dtype), value.tolist()

    def bump(self, tensor) -> float:
        tensor.add_(1000)  # in place, into what this rank received
        return float(tensor.sum())

    def total(self, value) -> tuple[float, int]:
        return float(value.sum()), int(value.shape[0])

    def ping(self) -> str:
        return "pong"

    def import_torch(self) -> None:
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def groups(backend):
    nodes = 2 if not isinstance(backend, str) else 1  # on agents: two nodes, 127.0.0.2-3
    procs = 1 if nodes == 2 else 2
    with helpers.long_lived_group(Producer, nodes=nodes, procs_per_node=procs,
                                  backend=backend, echo_output=False) as producers, \
            helpers.long_lived_group(Consumer, nodes=nodes, procs_per_node=procs,
                                     backend=backend, echo_output=False) as consumers:
        yield producers, consumers


@pytest.fixture(scope="module")
def torch_groups(groups):
    """The groups, torch imported at once on the ranks the tensor tests use (both
    producers, consumer 1): seconds each, else one after the other as calls reach them."""
    helpers.requires("torch")  # (without importing it)
    producers, consumers = groups
    futures = [producers.call_async("import_torch"),
               consumers.call_async("import_torch", workers=[1])]
    pytest.importorskip("torch")  # the controller's, meanwhile
    for future in futures:
        future.result(timeout=T)
    return groups


def held(producers) -> list[set]:
    """The keys of the results each producer rank holds (a px.keep() value's is new each
    time: never one of a result held before)."""
    return [set(keys) for keys in producers.call("held", timeout=T)]


def new_since(producers, before: list[set]) -> list[int]:
    """How many results each rank holds that it did not hold at ``before``."""
    return [len(now - then) for now, then in zip(held(producers), before, strict=True)]


def freed_since(producers, before: list[set], seconds: float = 10) -> bool:
    """Whether, within ``seconds``, the ranks hold nothing that they did not hold at
    ``before`` (once what the test dropped is collected)."""
    gc.collect()
    return wait_until(lambda: all(now <= then for now, then in
                                  zip(held(producers), before, strict=True)), seconds)


# -- px.keep() in results ----------------------------------------------------------------


def test_px_keep_in_a_dict_leaves_a_handle_in_place_of_the_kept_part(groups):
    producers, consumers = groups
    before = held(producers)
    results = producers.call("batch", 4, timeout=T)
    assert [r["lengths"] for r in results] == [[4, 0], [4, 1]]  # plain fields come back
    refs = [r["tokens"] for r in results]
    assert all(type(r) is px.ResultRef for r in refs)
    assert [r.rank for r in refs] == [0, 1] and [r.rows for r in refs] == [4, 4]
    assert "px.keep() value in the result of batch() on rank 1" in repr(refs[1])
    assert producers.name in repr(refs[1]) and refs[0].nbytes >= 64
    assert new_since(producers, before) == [1, 1]  # the bytes stayed on the ranks
    np.testing.assert_array_equal(refs[1].get(timeout=T), tokens(4, 1))
    # another group's ranks read them: each consumer the other producer's
    got = consumers.map("look", refs[::-1], timeout=T)
    for (value, writable), rank in zip(got, [1, 0], strict=True):
        np.testing.assert_array_equal(value, tokens(4, rank))
        assert writable == [False]  # a view of the producer's memory, no copy
    one = producers.call_one(1, "batch", 3, timeout=T)
    mapped = producers.map("batch", [2, 5], timeout=T)
    assert one["lengths"] == [3, 1] and one["tokens"].rank == 1
    assert [m["tokens"].rows for m in mapped] == [2, 5]
    np.testing.assert_array_equal(mapped[1]["tokens"].get(timeout=T), tokens(5, 1))
    assert new_since(producers, before) == [2, 3]
    del results, refs, got, one, mapped
    assert freed_since(producers, before)  # dropped handles free them on the ranks


def test_px_keep_as_the_whole_result_and_inside_a_list(groups):
    producers, consumers = groups
    before = held(producers)
    whole = producers.call_one(0, "whole", 5, timeout=T)
    assert type(whole) is px.ResultRef and whole.rows == 5
    np.testing.assert_array_equal(whole.get(timeout=T), np.arange(5))
    listed = producers.call_one(1, "listed", 3, timeout=T)
    assert listed[1] == "tag" and type(listed[0]) is type(listed[2]) is px.ResultRef
    assert listed[0].rows == 3 and listed[2].rows is None  # a dict of no arrays: no rows
    assert listed[2].get(timeout=T) == {"rank": 1}
    value, _ = consumers.call_one(0, "look", listed[0], timeout=T)
    np.testing.assert_array_equal(value, np.arange(3) + 100)
    assert consumers.call("look", listed[2], timeout=T) == [({"rank": 1}, [])] * 2
    listed[0].free()
    with pytest.raises(ObjectFreed):
        consumers.call("look", listed[0], timeout=T)
    assert wait_until(lambda: new_since(producers, before) == [1, 1], 10)  # one freed
    del whole, listed
    assert freed_since(producers, before)


def test_px_keep_in_streamed_items(groups):
    producers, consumers = groups
    before = held(producers)
    items: dict[int, list] = {0: [], 1: []}
    for rank, item in producers.call_stream("stream", 3, timeout=T):
        items[rank].append(item)
    assert [[i["i"] for i in items[r]] for r in (0, 1)] == [[0, 1, 2]] * 2
    refs = [item["data"] for r in (0, 1) for item in items[r]]
    assert all(type(r) is px.ResultRef for r in refs)
    assert [float(r.get(timeout=T)[0]) for r in refs] == [0, 1, 2, 10, 11, 12]
    assert new_since(producers, before) == [3, 3]
    value, _ = consumers.call_one(1, "look", items[1][2]["data"], timeout=T)
    np.testing.assert_array_equal(value, np.full(3, 12.0))
    del items, refs, item
    assert freed_since(producers, before)


# -- slices ------------------------------------------------------------------------------


def test_slices_of_an_array_a_dict_and_a_list_reach_a_rank_as_those_rows(groups):
    producers, consumers = groups
    before = held(producers)
    array = producers.call_one(0, "whole", 10, timeout=T)
    batch = producers.call_one(1, "fields", 6, 100, timeout=T)
    items = producers.call_one(0, "items", 5, 0, timeout=T)
    assert (array.rows, batch.rows, items.rows) == (10, 6, 5)
    part = array[2:7]
    assert type(part) is px.SliceRef and part.rows == 5
    for value, writable in consumers.call("look", part, timeout=T):  # on every node
        np.testing.assert_array_equal(value, np.arange(2, 7))
        assert writable == [False]  # a view of the producer's memory, no copy
    value, _ = consumers.call_one(1, "look", array[-3:], timeout=T)
    np.testing.assert_array_equal(value, [7, 8, 9])
    value, _ = consumers.call_one(0, "look", part[1:3], timeout=T)  # sliced again
    np.testing.assert_array_equal(value, [3, 4])
    value, writable = consumers.call_one(0, "look", batch[1:4], timeout=T)
    expected = fields(6, 100)
    assert list(value) == ["a", "b"]
    np.testing.assert_array_equal(value["a"], expected["a"][1:4])
    np.testing.assert_array_equal(value["b"], expected["b"][1:4])
    assert writable == [False, False]
    assert consumers.call_one(1, "look", items[1:3], timeout=T) == ([{"i": 1}, {"i": 2}], [])
    assert consumers.call_one(1, "look", items[4:2], timeout=T) == ([], [])  # no rows
    np.testing.assert_array_equal(part.get(timeout=T), np.arange(2, 7))
    got = batch[4:].get(timeout=T)
    np.testing.assert_array_equal(got["b"], expected["b"][4:])
    assert items[:2].get(timeout=T) == [{"i": 0}, {"i": 1}]
    del array, batch, items, part
    assert freed_since(producers, before)


def test_slices_and_chunks_of_torch_tensors(torch_groups):
    pytest.importorskip("torch")
    producers, consumers = torch_groups
    first = producers.call_one(0, "tensor", 8, 0.0, timeout=T)
    second = producers.call_one(1, "tensor", 5, 100.0, timeout=T)
    assert (first.rows, second.rows) == (8, 5)
    assert consumers.call_one(1, "look_tensor", first[3:6], timeout=T) == (
        "Tensor", "torch.float32", [3.0, 4.0, 5.0])
    chunks = px.chunk([first, second], 2)
    assert [c.rows for c in chunks] == [7, 6]
    got = [consumers.call_one(1, "look_tensor", c, timeout=T) for c in chunks]
    assert got == [("Tensor", "torch.float32", [float(i) for i in range(7)]),
                   ("Tensor", "torch.float32", [7.0] + [100.0 + i for i in range(5)])]
    assert chunks[1].get(timeout=T).tolist() == [7.0] + [100.0 + i for i in range(5)]
    picked = chunks[1][[5, 0, 5]]  # rows of both producers, one twice
    assert consumers.call_one(1, "look_tensor", picked, timeout=T) == (
        "Tensor", "torch.float32", [104.0, 7.0, 104.0])


def test_a_rank_writing_into_a_tensor_it_received_leaves_the_kept_value_alone(torch_groups):
    # torch has no read-only tensors: what a rank receives must not be the producer's
    # memory, or one consumer's in-place op changes what every other one reads next.
    pytest.importorskip("torch")
    producers, consumers = torch_groups
    ref = producers.call_one(0, "tensor", 6, 0.0, timeout=T)
    assert consumers.call_one(1, "bump", ref[1:3], timeout=T) == 2003.0
    assert consumers.call_one(1, "look_tensor", ref, timeout=T)[2] == [0, 1, 2, 3, 4, 5]
    assert ref.get(timeout=T).tolist() == [0, 1, 2, 3, 4, 5]


# -- chunks ------------------------------------------------------------------------------


def test_a_chunk_of_two_producers_results_reaches_each_rank_as_one_value(groups):
    producers, consumers = groups
    before = held(producers)
    refs = [r["tokens"] for r in producers.map("batch", [10, 7], timeout=T)]
    chunks = px.chunk(refs, 3)
    assert [c.rows for c in chunks] == [6, 6, 5]
    assert {r.rank for r in chunks[1].refs} == {0, 1}  # the middle one spans both
    expected = np.concatenate([tokens(10, 0), tokens(7, 1)])
    for i, c in enumerate(chunks):  # three chunks to the consumers in turn
        value, _ = consumers.call_one(i % 2, "look", c, timeout=T)
        np.testing.assert_array_equal(value, expected[6 * i:6 * i + c.rows])
    np.testing.assert_array_equal(chunks[1].get(timeout=T), expected[6:12])
    # a dict of arrays: joined key by key
    dicts = producers.map("fields", [10, 7], [0, 100], timeout=T)
    got = [consumers.call_one(i % 2, "look", c, timeout=T)[0]
           for i, c in enumerate(px.chunk(dicts, 3))]
    both = [fields(10, 0), fields(7, 100)]
    for key in ("a", "b"):
        whole = np.concatenate([both[0][key], both[1][key]])
        for i, value in enumerate(got):
            np.testing.assert_array_equal(value[key], whole[6 * i:6 * i + len(value[key])])
    # a list of items: chained
    lists = producers.map("items", [4, 3], [0, 100], timeout=T)
    assert consumers.map("look", px.chunk(lists, 2), timeout=T) == [
        ([{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}], []),
        ([{"i": 100}, {"i": 101}, {"i": 102}], [])]
    assert consumers.call_one(0, "look", px.chunk(lists, 3)[1], timeout=T)[0] == [
        {"i": 3}, {"i": 100}]
    del refs, chunks, dicts, lists, c
    assert freed_since(producers, before)


def test_chunks_of_chunks_and_slices(groups):
    producers, consumers = groups
    refs = producers.map("whole", [9, 6], timeout=T)  # 0..8, then 100..105
    halves = px.chunk(refs, 2)
    assert [h.rows for h in halves] == [8, 7]
    again = px.chunk([halves[1], refs[0][:3], halves[0][2:4]], 2)
    expected = np.concatenate([[8, 100, 101, 102, 103, 104, 105], [0, 1, 2], [2, 3]])
    assert [c.rows for c in again] == [6, 6]
    got = consumers.map("look", again, timeout=T)
    np.testing.assert_array_equal(got[0][0], expected[:6])
    np.testing.assert_array_equal(got[1][0], expected[6:])
    np.testing.assert_array_equal(again[1][1:4].get(timeout=T), expected[7:10])
    value, _ = consumers.call_one(1, "look", {"x": [again[0][4:]]}, timeout=T)  # nested
    np.testing.assert_array_equal(value["x"][0], expected[4:6])


def test_a_chunk_of_rollouts_of_different_lengths_is_a_list_of_those_rollouts(groups):
    producers, consumers = groups
    refs = producers.map("rollouts", [[5, 3], [3, 6, 2]], [0, 10], timeout=T)
    assert [r.rows for r in refs] == [2, 3]  # rollouts are items
    got = [value for value, _ in consumers.map("look", px.chunk(refs, 2), timeout=T)]
    assert [[float(r[0]), len(r)] for r in got[0]] == [[0, 5], [1, 3], [10, 3]]
    assert [[float(r[0]), len(r)] for r in got[1]] == [[11, 6], [12, 2]]


# -- picked rows, empty chunks, indices --------------------------------------------------


def test_picked_rows_reach_a_rank_as_those_rows_in_the_order_given(groups):
    producers, consumers = groups
    before = held(producers)
    array = producers.call_one(0, "whole", 10, timeout=T)
    batch = producers.call_one(1, "fields", 6, 100, timeout=T)
    items = producers.call_one(0, "items", 5, 0, timeout=T)
    part = array[[7, 0, 7, -1]]
    assert type(part) is px.SliceRef and part.rows == 4 and part.indices == [7, 0, 7, 9]
    for value, writable in consumers.call("look", part, timeout=T):  # on every node
        np.testing.assert_array_equal(value, [7, 0, 7, 9])
        assert writable == [True]  # gathered: a value of the rank's own
    value, writable = consumers.call_one(1, "look", array[[3, 4, 5]], timeout=T)
    np.testing.assert_array_equal(value, [3, 4, 5])
    assert writable == [False]  # a run of rows: a view of the producer's, as array[3:6]
    mask = np.array([True, False, False, True, True, False])
    value, _ = consumers.call_one(0, "look", batch[mask], timeout=T)
    expected = fields(6, 100)
    assert list(value) == ["a", "b"]
    np.testing.assert_array_equal(value["a"], expected["a"][mask])
    np.testing.assert_array_equal(value["b"], expected["b"][mask])
    assert consumers.call_one(1, "look", items[[4, 1]], timeout=T) == (
        [{"i": 4}, {"i": 1}], [])
    # a pick of a pick, a slice of a pick, a pick across two producers
    value, _ = consumers.call_one(0, "look", part[[1, 3]][1:], timeout=T)
    np.testing.assert_array_equal(value, [9])
    both = px.chunk([array, producers.call_one(1, "whole", 3, timeout=T)], 1)[0]
    value, _ = consumers.call_one(1, "look", both[[11, 0, 12, 9]], timeout=T)
    np.testing.assert_array_equal(value, [101, 0, 102, 9])
    np.testing.assert_array_equal(both[[11, 0]].get(timeout=T), [101, 0])
    assert items[[False, True, False, False, True]].get(timeout=T) == [{"i": 1}, {"i": 4}]
    del array, batch, items, part, both
    assert freed_since(producers, before)


def test_chunks_of_nothing_reach_their_ranks_as_empty_lists(groups):
    producers, consumers = groups
    chunks = px.chunk([], consumers.world_size)
    assert [c.rows for c in chunks] == [0, 0] and [c.get() for c in chunks] == [[], []]
    assert consumers.map("look", chunks, timeout=T) == [([], []), ([], [])]
    stored = consumers.put({"rows": chunks[0]})  # names no kept result: put as its value
    assert consumers.call_one(1, "look", stored, timeout=T) == ({"rows": []}, [])
    stored.free()
    # and a step whose rows were all dropped: empty chunks of a handle's type
    ref = producers.call_one(0, "whole", 4, timeout=T)
    empty = px.chunk([ref], 2, select=[False] * 4)
    got = consumers.map("look", empty, timeout=T)
    assert [value.shape for value, _ in got] == [(0,), (0,)]


def test_chunk_indices_line_per_row_arrays_up_with_the_rows_each_rank_receives(groups):
    producers, consumers = groups
    before = held(producers)
    size = 4
    outs = producers.map("scored", [3, 2], [size, size], timeout=T)
    refs = [o["rows"] for o in outs]
    rewards = np.concatenate([o["rewards"] for o in outs]).reshape(-1, size)
    ids = np.concatenate([np.arange(3 * size), np.arange(2 * size) + 1000])
    spread = rewards.std(axis=1)
    keep = np.repeat(spread > 0, size)  # groups whose rewards all tie are dropped
    advantages = ((rewards - rewards.mean(axis=1, keepdims=True))
                  / np.where(spread > 0, spread, 1)[:, None]).reshape(-1)
    assert keep.sum() == 3 * size  # groups 0 and 2 of rank 0, group 0 of rank 1
    chunks = px.chunk(refs, 2, select=keep)
    assert [c.rows for c in chunks] == [6, 6]
    assert [list(c.indices) for c in chunks] == [[0, 1, 2, 3, 8, 9], list(range(10, 16))]
    got = consumers.map("look", [{"rows": c, "advantages": advantages[c.indices]}
                                 for c in chunks], timeout=T)
    by_id = dict(zip(ids.tolist(), advantages.tolist(), strict=True))
    delivered = []
    for (value, _), c in zip(got, chunks, strict=True):
        np.testing.assert_array_equal(value["rows"]["id"], ids[c.indices])
        np.testing.assert_array_equal(value["rows"]["x"], ids[c.indices] * 2.0)
        assert [by_id[i] for i in value["rows"]["id"].tolist()] == value[
            "advantages"].tolist()
        delivered += value["rows"]["id"].tolist()
    assert delivered == ids[keep].tolist()  # every kept row once, in order
    del outs, refs, chunks, c
    assert freed_since(producers, before)


# -- errors ------------------------------------------------------------------------------


def test_what_cannot_be_sliced_or_chunked_is_refused(groups):
    producers, consumers = groups
    ref = producers.call_one(0, "whole", 5, timeout=T)
    with pytest.raises(ValueError, match="step 1"):
        ref[::2]
    with pytest.raises(TypeError, match=r"indexed by rows.*ref\[\[3\]\]"):
        ref[3]
    with pytest.raises(IndexError, match="row 5 is out of range for its 5 rows"):
        ref[[0, 5]]
    with pytest.raises(IndexError, match="a mask of length 4 for a value of 5 rows"):
        ref[[True] * 4]
    with pytest.raises(TypeError, match="not float"):
        ref[[0.0]]
    scalar = producers.call_one(0, "scalar", timeout=T)
    assert scalar.rows is None and scalar.get(timeout=T) == 3.5
    with pytest.raises(TypeError, match="has no rows"):
        scalar[0:1]
    with pytest.raises(TypeError, match="n must be an int"):
        px.chunk([ref], 2.0)
    with pytest.raises(ValueError, match="at least 1"):
        px.chunk([ref], 0)
    with pytest.raises(IndexError, match=r"chunk\(select=...\)"):
        px.chunk([ref], 2, select=[9])
    put = consumers.put(np.ones(3))
    with pytest.raises(TypeError, match="handle 1"):
        px.chunk([ref, put], 2)
    with pytest.raises(TypeError, match=r"handle 0 .*has no rows"):
        px.chunk([scalar, ref], 2)
    with pytest.raises(TypeError, match="cannot be put"):
        consumers.put({"rows": ref[1:3]})
    assert consumers.call("ping", timeout=T) == ["pong", "pong"]


def test_px_keep_inside_a_kept_value_or_sent_from_the_controller_is_refused(groups):
    producers, consumers = groups
    before = held(producers)
    with pytest.raises(WorkerError, match=r"px.keep\(\) inside a value that is itself kept"):
        producers.call_one(0, "nested", timeout=T)
    with pytest.raises(WorkerError, match=r"px.keep\(\) inside a value that is itself kept"):
        producers.call_one(1, "with_keep", timeout=T, keep=True)
    with pytest.raises(px.SerializationError, match="cannot be sent from the controller"):
        consumers.call("look", {"x": px.keep(np.ones(2))}, timeout=T)
    assert new_since(producers, before) == [0, 0]  # nothing was kept
    assert consumers.call("ping", timeout=T) == ["pong", "pong"]


def test_a_freed_parent_is_object_freed_where_its_rows_are_passed(groups):
    producers, consumers = groups
    before = held(producers)
    parent, other = producers.map("whole", [6, 4], timeout=T)
    part = parent[1:4]
    picked = parent[[5, 0]]
    spanning = px.chunk([part, other], 1)[0]
    only_other = px.chunk([part, other], 2)[1]
    assert only_other.refs == (other,)
    parent.free()
    looked = consumers.call("looked", timeout=T)
    with pytest.raises(ObjectFreed, match="freed"):
        consumers.call("look", part, timeout=T)
    with pytest.raises(ObjectFreed, match="freed"):
        consumers.call("look", picked, timeout=T)
    with pytest.raises(ObjectFreed, match="freed"):
        consumers.call_one(0, "look", {"chunk": spanning}, timeout=T)
    with pytest.raises(ObjectFreed, match="freed"):
        consumers.map("look", [only_other, spanning], timeout=T)
    assert consumers.call("looked", timeout=T) == looked  # no call was sent
    with pytest.raises(ObjectFreed):
        part.get(timeout=T)
    value, _ = consumers.call_one(1, "look", only_other, timeout=T)  # the other is there
    np.testing.assert_array_equal(value, np.arange(100, 104)[1:])
    assert wait_until(lambda: new_since(producers, before)[0] == 0, 10)  # freed on its rank
    # a slice keeps its parent alive while it lives (dropping the parent does not free it)
    keeper = producers.call_one(0, "whole", 6, timeout=T)[2:5]
    gc.collect()
    np.testing.assert_array_equal(consumers.call_one(0, "look", keeper, timeout=T)[0],
                                  [2, 3, 4])
    assert new_since(producers, before)[0] == 1
    del part, picked, spanning, only_other, other, keeper
    assert freed_since(producers, before)


def test_rows_of_a_dead_producer_are_object_lost_naming_it(backend):
    with WorkerGroup(Producer, procs_per_node=2, backend=backend, echo_output=False) as p, \
            WorkerGroup(Consumer, backend=backend, echo_output=False) as c:
        refs = [r["tokens"] for r in p.call("batch", 4, timeout=T)]
        spanning = px.chunk(refs, 1)[0]
        p.inject_fault(1, "pid", "signal")
        with pytest.raises(px.WorkerDied):
            p.call_one(1, "pid", timeout=T)
        where = f"rank 1 of group {p.name}"
        with pytest.raises(ObjectLost, match=re.escape(where)):
            c.call("look", refs[1][1:3], timeout=T)
        with pytest.raises(ObjectLost, match=re.escape(where)):
            c.call("look", spanning, timeout=T)
        with pytest.raises(ObjectLost, match=re.escape(where)):
            c.call("look", px.chunk(refs, 2)[1], timeout=T)  # chunked after it died
        with pytest.raises(ObjectLost, match=re.escape(where)):
            c.call("look", spanning[[0, 7]], timeout=T)
        with pytest.raises(ObjectLost):
            refs[1][:2].get(timeout=T)
        value, _ = c.call_one(0, "look", refs[0][1:3], timeout=T)  # rank 0's is there
        np.testing.assert_array_equal(value, tokens(4, 0)[1:3])
        assert c.call("ping", timeout=T) == ["pong"]


# -- a result that never left its rank -------------------------------------------------


def test_px_keep_values_of_a_result_that_could_not_be_pickled_are_freed(groups):
    # The values were kept as the result was pickled; the call failed on its rank, so no
    # handle on them will ever exist: the rank must not hold them until the group ends.
    producers, _ = groups
    before = held(producers)
    with pytest.raises(WorkerError, match="pickling the result"):
        producers.call_one(0, "unpicklable", timeout=T)
    assert freed_since(producers, before, 5), (
        f"still held on the ranks: {new_since(producers, before)}")


# -- memory ------------------------------------------------------------------------------


def test_re_chunking_kept_results_does_not_grow_the_controller(groups):
    producers, consumers = groups
    me = psutil.Process()
    n, cols = 4096, 1024  # 32 MiB of float64 per producer

    def round_trip() -> list[tuple[float, int]]:
        refs = producers.call("big", n, cols, timeout=T)
        return consumers.map("total", px.chunk([refs[0][1024:], refs[1]], 2), timeout=T)

    for _ in range(2):  # warm: the first rounds allocate what every round reuses
        round_trip()
    gc.collect()
    before = me.memory_info().rss
    for _ in range(6):  # 6 x 2 x 32 MiB kept, re-chunked across both producers
        assert round_trip() == [(float((3072 + 512 * 2) * cols), 3584),
                                (float(3584 * 2 * cols), 3584)]
    gc.collect()
    grown = me.memory_info().rss - before
    assert grown < 16 * MIB, f"the controller grew {grown / MIB:.1f} MiB"


@pytest.mark.parametrize("keep", [False, True], ids=["px.keep parts", "keep=True"])
def test_a_failed_calls_kept_results_are_freed_with_the_call(groups, keep):
    """The ranks that answered a call that failed on another rank hold what they kept
    only as long as the caller holds the call: with the error caught and dropped, reference
    counting frees it on the ranks (no garbage collection run needed)."""
    producers, _ = groups
    before = held(producers)
    gc.disable()  # what frees them must not be the cyclic collector
    try:
        view = producers.options(keep=True) if keep else producers
        with pytest.raises(WorkerError, match="this rank's batch failed"):
            view.call("batch_or_fail", 1000, producers.world_size - 1, not keep)
        assert wait_until(lambda: sum(new_since(producers, before)) == 0, T)
    finally:
        gc.enable()
