"""A weight sync's plan (phalanx.world.syncplan), pure: the blocks sources hold, the regions
targets want, and the transfers that give every target each wanted element exactly once,
from one source holding it, spread over replicas."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import phalanx as px
from phalanx.world.syncplan import Block, Region, Shard, Transfer, plan

# -- layouts ---------------------------------------------------------------------------


def _splits(size: int, draw) -> list[tuple[int, int]]:
    """[start, stop) parts of 0..size, at random cut points."""
    points = sorted(draw(st.sets(st.integers(1, size - 1), max_size=2))) if size > 1 else []
    bounds = [0, *points, size]
    return list(itertools.pairwise(bounds))


@st.composite
def layouts(draw, full: tuple[int, ...]) -> list[Region]:
    """Boxes covering ``full``: rows, columns, a grid or the whole, as replicas, with
    extra overlapping boxes."""
    kind = draw(st.sampled_from(["whole", "rows", "cols", "grid"]))
    per_dim = [[(0, size)] for size in full]
    if kind == "rows":
        per_dim[0] = _splits(full[0], draw)
    elif kind == "cols":
        per_dim[-1] = _splits(full[-1], draw)
    elif kind == "grid":
        per_dim = [_splits(size, draw) for size in full]
    boxes = [Region(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
             for cell in itertools.product(*per_dim)]
    boxes *= draw(st.integers(1, 3))  # data-parallel replicas of the layout
    for _ in range(draw(st.integers(0, 2))):  # overlapping extras
        boxes.append(draw(regions(full)))
    return draw(st.permutations(boxes))


@st.composite
def regions(draw, full: tuple[int, ...]) -> Region:
    offset, shape = [], []
    for size in full:
        start = draw(st.integers(0, size - 1))
        offset.append(start)
        shape.append(draw(st.integers(1, size - start)))
    return Region(tuple(offset), tuple(shape))


DTYPES = [("float32", 4), ("bfloat16", 2), ("int64", 8)]


@st.composite
def problems(draw):
    """(sources, targets): 1-3 names of 1-3 dimensions, each laid out over the sources;
    targets wanting some of the names, a region or the whole of each."""
    names = draw(st.lists(st.sampled_from(["a", "b.weight", "c"]), min_size=1, max_size=3,
                          unique=True))
    metadata: dict[str, tuple[tuple[int, ...], str, int]] = {}
    laid_out: dict[str, list[Region]] = {}
    for name in names:
        full = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        metadata[name] = (full, *draw(st.sampled_from(DTYPES)))
        laid_out[name] = draw(layouts(full))
    count = max(len(boxes) for boxes in laid_out.values())
    keys = draw(st.lists(st.integers(0, 999), min_size=count, max_size=count, unique=True))
    sources: dict[int, list[Block]] = {}
    for name, boxes in laid_out.items():
        full, dtype, itemsize = metadata[name]
        for key, box in zip(draw(st.permutations(keys)), boxes, strict=False):
            sources.setdefault(key, []).append(
                Block(name, box.offset, box.shape, full, dtype, itemsize))
    targets: dict[tuple[int, int], dict[str, Region | None]] = {}
    for group, rank in draw(st.sets(st.tuples(st.integers(0, 2), st.integers(0, 3)),
                                    min_size=1, max_size=6)):
        wants: dict[str, Region | None] = {}
        for name in draw(st.lists(st.sampled_from(names), unique=True)):
            full = metadata[name][0]
            wants[name] = draw(st.none() | regions(full))
        targets[(group, rank)] = wants
    return sources, targets


def _blocks(sources) -> dict[tuple[int, str], Block]:
    return {(key, block.name): block for key, blocks in sources.items() for block in blocks}


# -- properties ------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_wanted_element_comes_once_from_a_source_holding_it(problem):
    sources, targets = problem
    result = plan(sources, targets)
    blocks = _blocks(sources)
    counts = {(target, name): np.zeros(want.shape, dtype=np.int64)
              for target, wanted in result.wanted.items() for name, want in wanted.items()}
    for t in result.transfers:
        block = blocks[(t.source, t.name)]
        region = result.wanted[t.target][t.name].region
        assert t.box.volume > 0
        assert block.region.contains(t.box) and region.contains(t.box)
        assert t.src_box == t.box.relative_to(block.region)
        assert t.dst_box == t.box.relative_to(region)
        assert t.nbytes == t.box.volume * block.itemsize
        counts[(t.target, t.name)][t.dst_box.slices()] += 1
    for where, count in counts.items():
        assert (count == 1).all(), f"{where}: elements covered {count.tolist()}"


@settings(max_examples=150, deadline=None)
@given(problems())
def test_bytes_per_target_are_its_regions_and_the_sources_send_them(problem):
    sources, targets = problem
    result = plan(sources, targets)
    assert set(result.per_target_bytes) == set(targets)
    assert set(result.per_source_bytes) == set(sources)
    for target, wants in targets.items():
        wanted = result.wanted[target]
        assert set(wanted) == set(wants)  # names a target omits are not sent to it
        for name, region in wants.items():
            assert region is None or wanted[name].region == region
            if region is None:
                assert wanted[name].region == Region.whole(wanted[name].full)
        assert result.per_target_bytes[target] == sum(w.nbytes for w in wanted.values())
        assert {t.name for t in result.for_target(target)} <= set(wants)
    assert sum(result.per_source_bytes.values()) == sum(result.per_target_bytes.values())
    for key in sources:
        assert sum(t.nbytes for t in result.for_source(key)) == result.per_source_bytes[key]
    by_source = [t for key in sorted(sources) for t in result.for_source(key)]
    by_target = [t for key in sorted(targets) for t in result.for_target(key)]
    assert sorted(map(id, by_source)) == sorted(map(id, result.transfers))
    assert list(map(id, by_target)) == list(map(id, result.transfers))


@settings(max_examples=100, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_the_same_input_gives_the_same_plan_in_any_order(problem, rng):
    sources, targets = problem
    first = plan(sources, targets)
    shuffled_sources = dict(rng.sample(list(sources.items()), len(sources)))
    shuffled_targets = {key: dict(rng.sample(list(wants.items()), len(wants)))
                        for key, wants in rng.sample(list(targets.items()), len(targets))}
    again = plan(shuffled_sources, shuffled_targets)
    assert again == first
    assert again.transfers == first.transfers


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_partition_gives_one_transfer_per_source_meeting_the_region(data):
    """Disjoint blocks (rows, columns, a grid): each source's part of a wanted region is
    one box, so one transfer."""
    full = tuple(data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    kind = data.draw(st.sampled_from(["rows", "cols", "grid"]))
    per_dim = [[(0, size)] for size in full]
    if kind == "rows":
        per_dim[0] = _splits(full[0], data.draw)
    elif kind == "cols":
        per_dim[-1] = _splits(full[-1], data.draw)
    else:
        per_dim = [_splits(size, data.draw) for size in full]
    blocks = [Block("w", tuple(a for a, _ in cell), tuple(b - a for a, b in cell), full,
                    "float32", 4) for cell in itertools.product(*per_dim)]
    sources = {index: [block] for index, block in enumerate(blocks)}
    region = data.draw(regions(full))
    result = plan(sources, {0: {"w": region}})
    meeting = [index for index, block in enumerate(blocks)
               if block.region.intersection(region) is not None]
    assert [t.source for t in sorted(result.transfers, key=lambda t: t.source)] == meeting
    for t in result.transfers:
        assert t.box == blocks[t.source].region.intersection(region)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.data())
def test_replicas_share_the_sending(replicas, data):
    """k sources holding the whole tensor, many targets: the bytes each sends differ by at
    most one target's share."""
    full = (data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12)))
    sources = {rank: [Block.whole("w", full, "float32", 4)] for rank in range(replicas)}
    targets = {rank: {"w": data.draw(st.none() | regions(full))}
               for rank in range(data.draw(st.integers(1, 20)))}
    result = plan(sources, targets)
    sent = result.per_source_bytes.values()
    assert max(sent) - min(sent) <= max(result.per_target_bytes.values())
    if len(targets) >= replicas:
        assert min(sent) > 0  # every replica sends


# -- worked examples -------------------------------------------------------------------


def _rows(count: int, full: tuple[int, int], dtype: str = "float32",
          itemsize: int = 4) -> dict[int, list[Block]]:
    rows = full[0] // count
    return {rank: [Block("w", (rank * rows, 0), (rows, full[1]), full, dtype, itemsize)]
            for rank in range(count)}


def test_four_row_shards_to_two_column_halves():
    sources = _rows(4, (8, 8))
    targets = {(0, 0): {"w": Region((0, 0), (8, 4))}, (0, 1): {"w": Region((0, 4), (8, 4))}}
    result = plan(sources, targets)
    for rank, target in enumerate(sorted(targets)):
        moves = result.for_target(target)
        assert [t.source for t in moves] == [0, 1, 2, 3]
        assert [t.box for t in moves] == [Region((2 * s, 4 * rank), (2, 4)) for s in range(4)]
        assert [t.src_box for t in moves] == [Region((0, 4 * rank), (2, 4))] * 4
        assert [t.dst_box for t in moves] == [Region((2 * s, 0), (2, 4)) for s in range(4)]
        assert all(t.nbytes == 2 * 4 * 4 for t in moves)
        assert result.per_target_bytes[target] == 8 * 4 * 4
        assert result.wanted[target]["w"].shape == (8, 4)
        assert result.wanted[target]["w"].dtype == "float32"
    assert dict(result.per_source_bytes) == {s: 2 * 8 * 4 for s in range(4)}
    assert [t.target for t in result.for_source(2)] == [(0, 0), (0, 1)]


def test_a_whole_tensor_from_source_zero_to_whole_targets():
    sources = {0: [Block.whole("w", (3, 5), "bfloat16", 2), Block.whole("b", (5,), "bfloat16", 2)]}
    result = plan(sources, {1: {"w": None, "b": None}, 2: {"w": None}})
    assert [(t.target, t.name, t.box) for t in result.transfers] == [
        (1, "b", Region((0,), (5,))), (1, "w", Region((0, 0), (3, 5))),
        (2, "w", Region((0, 0), (3, 5)))]
    for t in result.transfers:
        assert t.source == 0 and t.src_box == t.dst_box == t.box
    assert dict(result.per_target_bytes) == {1: 40, 2: 30}
    assert dict(result.per_source_bytes) == {0: 70}
    assert set(result.wanted[2]) == {"w"}


def test_replicas_of_shards_alternate_between_targets():
    """2 data-parallel replicas of 4 row shards (sources 0-3 and 4-7): whole targets take
    one replica each in turn."""
    sources = {rank: [Block("w", ((rank % 4) * 2, 0), (2, 8), (8, 8), "float32", 4)]
               for rank in range(8)}
    result = plan(sources, {target: {"w": None} for target in range(4)})
    assert [[t.source for t in result.for_target(target)] for target in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert set(result.per_source_bytes.values()) == {2 * 2 * 8 * 4}


def test_overlapping_blocks_send_each_element_once():
    sources = {0: [Block("w", (0, 0), (6, 8), (8, 8), "float32", 4)],
               1: [Block("w", (4, 0), (4, 8), (8, 8), "float32", 4)]}
    result = plan(sources, {0: {"w": None}})
    assert sum(t.box.volume for t in result.transfers) == 64
    assert result.per_target_bytes[0] == 256


def test_a_scalar_and_an_empty_region():
    sources = {0: [Block.whole("step", (), "int64", 8), Block.whole("w", (4, 4), "float32", 4)]}
    result = plan(sources, {0: {"step": None, "w": Region((2, 0), (0, 4))}})
    assert [(t.name, t.box, t.nbytes) for t in result.transfers] == [
        ("step", Region((), ()), 8)]
    assert result.wanted[0]["w"].shape == (0, 4)
    assert result.per_target_bytes[0] == 8


def test_a_target_that_wants_nothing_receives_nothing():
    result = plan(_rows(2, (4, 4)), {0: {}})
    assert result.for_target(0) == () and result.per_target_bytes[0] == 0
    assert dict(result.per_source_bytes) == {0: 0, 1: 0}
    with pytest.raises(KeyError, match="not a target"):
        result.for_target(1)
    with pytest.raises(KeyError, match="not a source"):
        result.for_source(7)


def test_a_realistic_model_plans_quickly():
    """500 names, 8 row-sharded sources, 16 targets each wanting a column half: 64,000
    transfers. The module docstring gives the time measured (a fraction of a second); the
    bound is generous for a loaded CI machine and catches a plan gone quadratic."""
    names = [f"layers.{i}.weight" for i in range(500)]
    n = 4096
    sources = {rank: [Block(name, (rank * n // 8, 0), (n // 8, n), (n, n), "float32", 4)
                      for name in names] for rank in range(8)}
    targets = {(group, rank): {name: Region((0, rank * n // 2), (n, n // 2)) for name in names}
               for group in range(8) for rank in range(2)}
    start = time.process_time()
    result = plan(sources, targets)
    assert time.process_time() - start < 10
    assert len(result.transfers) == 500 * 8 * 16
    assert set(result.per_target_bytes.values()) == {500 * n * n // 2 * 4}


# -- errors ----------------------------------------------------------------------------


def test_a_part_no_source_holds_is_named():
    sources = {0: [Block("w", (0, 0), (4, 8), (8, 8), "float32", 4)],
               1: [Block("w", (6, 0), (2, 8), (8, 8), "float32", 4)]}
    with pytest.raises(ValueError) as err:
        plan(sources, {(1, 3): {"w": None}})
    message = str(err.value)
    assert "target (1, 3) wants 'w'" in message
    assert "no source holds Region(offset=(4, 0), shape=(2, 8))" in message
    assert "16 of its 64 elements" in message
    assert "source 0 Region(offset=(0, 0), shape=(4, 8))" in message
    # a region within what is held is fine
    assert plan(sources, {(1, 3): {"w": Region((0, 0), (4, 8))}}).per_target_bytes[(1, 3)]


def test_sources_that_disagree_on_a_dtype():
    sources = {0: [Block("w", (0, 0), (2, 4), (4, 4), "float32", 4)],
               3: [Block("w", (2, 0), (2, 4), (4, 4), "bfloat16", 2)]}
    with pytest.raises(ValueError, match=r"sources disagree on 'w': source 0 says full shape "
                       r"\(4, 4\), dtype float32 \(4 bytes\); source 3 says full shape "
                       r"\(4, 4\), dtype bfloat16 \(2 bytes\)"):
        plan(sources, {})


@pytest.mark.parametrize(("block", "message"), [
    (Block("w", (0, 0), (2, 4), (4, 5), "float32", 4), "sources disagree on 'w'"),
    (Block("w", (3, 0), (2, 4), (4, 4), "float32", 4), "reaches past its full shape"),
    (Block("w", (-1, 0), (2, 4), (4, 4), "float32", 4), "none may be negative"),
    (Block("w", (0,), (2, 4), (4, 4), "float32", 4), "one number per dimension"),
    (Block("w", (0, 0), (2, 4), (4, 4), "float32", 0), "positive itemsize"),
])
def test_a_bad_block_names_its_source(block, message):
    sources = {0: [Block.whole("w", (4, 4), "float32", 4)], 5: [block]}
    with pytest.raises(ValueError, match=message) as err:
        plan(sources, {})
    assert "source 5" in str(err.value)


def test_a_source_holding_a_name_twice():
    block = Block.whole("w", (4,), "float32", 4)
    with pytest.raises(ValueError, match="source 0 holds 'w' twice"):
        plan({0: [block, block]}, {})


@pytest.mark.parametrize(("wants", "error", "message"), [
    ({"v": None}, ValueError, "target 2 wants 'v', which no source holds .*'w'"),
    ({"w": Region((2, 2), (3, 2))}, ValueError,
     r"target 2 wants 'w' at Region\(offset=\(2, 2\), shape=\(3, 2\)\), outside its full "
     r"shape \(4, 4\)"),
    ({"w": Region((0,), (4,))}, ValueError, "outside its full shape"),
    ({"w": (0, 4)}, TypeError, "a px.Region, or None"),
])
def test_a_bad_want_names_its_target(wants, error, message):
    with pytest.raises(error, match=message):
        plan({0: [Block.whole("w", (4, 4), "float32", 4)]}, {2: wants})


def test_keys_must_sort():
    with pytest.raises(TypeError, match="source keys must be sortable"):
        plan({0: [], "a": []}, {})


# -- the records -----------------------------------------------------------------------


def test_region_geometry():
    outer = Region((2, 4), (6, 6))
    inner = Region((3, 5), (2, 2))
    assert outer.end == (8, 10) and outer.volume == 36 and outer.ndim == 2
    assert outer.contains(inner) and not inner.contains(outer)
    assert inner.relative_to(outer) == Region((1, 1), (2, 2))
    assert outer.intersection(Region((0, 0), (3, 5))) == Region((2, 4), (1, 1))
    assert outer.intersection(Region((0, 0), (2, 4))) is None  # touching is not sharing
    array = np.arange(100).reshape(10, 10)
    assert (array[outer.slices()][inner.relative_to(outer).slices()]
            == array[inner.slices()]).all()
    with pytest.raises(ValueError, match="is not within"):
        outer.relative_to(inner)
    with pytest.raises(ValueError, match="different numbers of dimensions"):
        outer.contains(Region((0,), (1,)))


@pytest.mark.parametrize(("args", "error", "message"), [
    (((0, -1), (1, 1)), ValueError, "must not be negative"),
    (((0,), (1, 1)), ValueError, "one number per dimension"),
    (((0, 1.5), (1, 1)), TypeError, "whole numbers"),
    (((0, True), (1, 1)), TypeError, "whole numbers"),
    (("ab", (1, 1)), TypeError, "whole numbers"),
])
def test_region_checks_its_numbers(args, error, message):
    with pytest.raises(error, match=message):
        Region(*args)


def test_region_takes_any_sequence_of_whole_numbers():
    region = Region([np.int64(1), 2], range(2, 4))
    assert region == Region((1, 2), (2, 3))
    assert type(region.offset) is tuple and type(region.offset[0]) is int
    assert hash(region) == hash(Region((1, 2), (2, 3)))


def test_shard_checks_what_it_can_before_the_plan():
    weight = np.zeros((2, 8), dtype=np.float32)
    shard = Shard(weight, offset=[2, 0], full=(8, 8))
    assert shard.tensor is weight and shard.offset == (2, 0)
    assert repr(shard) == "Shard(tensor of shape (2, 8), offset=(2, 0), full=(8, 8))"
    with pytest.raises(ValueError, match=r"shape \(2, 8\) at offset \(7, 0\) does not fit "
                       r"within its full shape \(8, 8\)"):
        Shard(weight, offset=(7, 0), full=(8, 8))
    with pytest.raises(ValueError, match="does not fit"):
        Shard(weight, offset=(0, 0, 0), full=(8, 8, 1))
    with pytest.raises(ValueError, match="one number per dimension"):
        Shard(weight, offset=(0,), full=(8, 8))
    with pytest.raises(ValueError, match="must not be negative"):
        Shard(weight, offset=(-2, 0), full=(8, 8))
    assert Shard("no shape here", offset=(0,), full=(3,)).offset == (0,)


def test_shard_and_region_are_public():
    assert px.Shard is Shard and px.Region is Region
    assert isinstance(plan({0: [Block.whole("w", (1,), "f", 1)]}, {0: {"w": None}})
                      .transfers[0], Transfer)


def test_block_checks_types_and_leaves_numbers_to_the_plan():
    with pytest.raises(TypeError, match="name must be str"):
        Block(3, (0,), (1,), (1,), "f", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="itemsize must be an int"):
        Block("w", (0,), (1,), (1,), "f", 1.0)  # type: ignore[arg-type]
    assert Block("w", [-1], [1], [1], "f", 1).offset == (-1,)  # the plan names the source

