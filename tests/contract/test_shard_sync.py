"""``px.weight_sync(trainers, generators, src_rank="all")``: weights moved by parts on every
backend with the same test code. Two trainer ranks each hold a row shard (``px.Shard``) of
two tensors and a replica of a third; generator ranks each want a region (``px.Region``) of
them. Each generator receives exactly its regions' values, and no byte more; ``stage``
moves the bytes while generators answer calls, ``apply`` hands them over; versions; a
generator killed mid-stage fails alone and, recreated, catches up without any other
receiving a byte; a failing source is named; ``src_rank=0`` pushes as before."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

import phalanx as px
from phalanx import PhalanxError
from tests import helpers

torch = pytest.importorskip("torch", reason="a weight sync moves torch tensors: pip install torch")

FULL = {"w": ((8, 6), "float32"), "e": ((4, 10), "float64"), "b": ((6,), "int64")}
ROW_SHARDED = ("w", "e")  # each trainer rank holds half the rows; "b" whole on both


def _full(name: str, step: int):
    """The full tensor ``name`` at ``step``: every element different, every step too."""
    import torch

    shape, dtype = FULL[name]
    count = 1
    for dim in shape:
        count *= dim
    base = {"w": 0, "e": 1000, "b": 5000}[name]
    return (torch.arange(count, dtype=torch.float64).reshape(shape) + base + 100_000 * step
            ).to(getattr(torch, dtype))


def _wants(split: bool, rank: int) -> dict:
    """What a generator rank wants: ``split``, its half of the columns of the sharded
    tensors (across both trainers' rows) and all of "b"; else all of "w", a box of "e"
    that straddles the trainers' shards, and no "b"."""
    if split:
        return {"w": px.Region((0, 3 * rank), (8, 3)), "e": px.Region((0, 5 * rank), (4, 5)),
                "b": None}
    return {"w": None, "e": px.Region((1, 2), (2, 7))}


def _expected(split: bool, rank: int, step: int) -> dict:
    out = {}
    for name, region in _wants(split, rank).items():
        full = _full(name, step)
        part = full if region is None else full[region.slices()]
        out[name] = (str(part.dtype), tuple(part.shape), part.tolist())
    return out


def _bytes(split: bool, rank: int) -> int:
    return sum(_full(name, 0)[(slice(None),) if region is None else region.slices()].nbytes
               for name, region in _wants(split, rank).items())


class Trainer:
    """Holds row shards of "w" and "e" and all of "b", at some step."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = int(os.environ["RANK"])
        self.at = 0
        self.delay = 0.0
        self.victim: int | None = None
        self.signal = signal.SIGKILL
        self.refuse = False

    def step(self, step: int) -> None:
        self.at = step

    def configure(self, delay: float = 0.0, victim: int | None = None,
                  sig: int = signal.SIGKILL, refuse: bool = False) -> None:
        """``delay``: seconds each ``shards`` takes; ``victim``: a pid rank 0 sends
        ``sig`` in its next ``shards`` (mid-stage: the targets are armed, nothing sent
        yet)."""
        self.delay, self.victim, self.signal, self.refuse = delay, victim, sig, refuse

    def shards(self) -> dict:
        time.sleep(self.delay)
        if self.refuse:
            raise RuntimeError("no weights today")
        if self.victim is not None and self.rank == 0:
            victim, self.victim = self.victim, None
            os.kill(victim, self.signal)
        out = {}
        for name, (shape, _) in FULL.items():
            full = _full(name, self.at)
            if name in ROW_SHARDED:
                half = shape[0] // 2
                rows = slice(self.rank * half, (self.rank + 1) * half)
                out[name] = px.Shard(full[rows].clone(), offset=(self.rank * half, 0),
                                     full=shape)
            else:
                out[name] = full
        return out

    def whole(self) -> dict:
        return {name: _full(name, self.at) for name in FULL}


class Generator:
    """Wants its regions (``split``: see :func:`_wants`) and keeps what it is given."""

    def __init__(self, split: bool) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = int(os.environ["RANK"])
        self.split = split
        self.got: dict = {}
        self.loads = 0

    def wanted(self) -> dict:
        return _wants(self.split, self.rank)

    def load(self, state: dict) -> None:
        self.got = {name: t.clone() for name, t in state.items()}
        self.loads += 1

    def received(self) -> dict:
        return {name: (str(t.dtype), tuple(t.shape), t.tolist()) for name, t in self.got.items()}

    def count(self) -> int:
        return self.loads

    def where(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def groups(backend):
    """Two trainers on a node each (rank 1's listener-less side on node 1), and two
    generator groups of two ranks: one wanting column halves, one other regions."""
    with helpers.long_lived_group(Trainer, nodes=2, procs_per_node=1, backend=backend,
                                  echo_output=False) as trainers, \
            helpers.long_lived_group(Generator, procs_per_node=2, backend=backend,
                                     rank_kwargs={0: {"split": True}, 1: {"split": True}},
                                     echo_output=False) as split, \
            helpers.long_lived_group(Generator, procs_per_node=2, backend=backend,
                                     rank_kwargs={0: {"split": False}, 1: {"split": False}},
                                     echo_output=False) as other:
        yield trainers, split, other


@pytest.fixture
def fresh(groups):
    trainers, split, other = groups
    trainers.call("configure")
    trainers.call("step", 0)
    return trainers, split, other


def _check(group, split: bool, step: int) -> None:
    got = group.call("received")
    for rank in range(2):
        assert got[rank] == _expected(split, rank, step), f"{group.name} rank {rank}"


def test_each_generator_gets_exactly_its_regions(fresh):
    trainers, split, other = fresh
    with px.weight_sync(trainers, [split, other], src_rank="all") as sync:
        assert sync.state.name == "NEW" and sync.version == 0
        trainers.call("step", 1)
        stats = sync.push("shards", "load", "wanted")
        assert sync.state.name == "FORMED" and sync.transport == "p2p"
        assert stats.formed and stats.plan_s > 0 and stats.version == sync.version == 1
        assert stats.targets == 4 and stats.tensors == 3
        assert stats.per_target == {(g.name, r): _bytes(s, r) for g, s in
                                    ((split, True), (other, False)) for r in range(2)}
        assert stats.bytes == sum(stats.per_target.values())
        assert stats.total_s >= stats.stage_s + stats.apply_s > 0
        _check(split, True, 1)
        _check(other, False, 1)
        # the next push: formed already; verify=True checks a digest of every transfer
        trainers.call("step", 2)
        stats = sync.push("shards", "load", "wanted", verify=True)
        assert not stats.formed and stats.plan_s == 0 and stats.version == 2
        _check(split, True, 2)
        _check(other, False, 2)
        assert set(sync.versions().values()) == {2} and len(sync.versions()) == 4
        assert sync.generation == 1


def test_stage_moves_the_bytes_while_generators_answer_and_apply_hands_them_over(fresh):
    trainers, split, other = fresh
    with px.weight_sync(trainers, [split, other], src_rank="all") as sync, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        sync.push("shards", "load", "wanted")  # formed, version 1 applied
        loads = split.call("count")
        trainers.call("step", 3)
        trainers.call("configure", delay=1.5)  # each source takes 1.5 s to get its shards
        staging = pool.submit(sync.stage, "shards", "wanted")
        time.sleep(0.3)  # the targets are armed by now; the sources are in get()
        began = time.monotonic()
        assert split.call("where") == [0, 1] and other.call("where") == [0, 1]
        answered = time.monotonic() - began
        assert not staging.done(), "stage() ended before the generators' call came back"
        assert answered < 1.0  # a call's round trip, not the stage's 1.5 s
        stats = staging.result(timeout=60)
        assert stats.version == 2 and stats.apply_s == 0 and stats.stage_s >= 1.5
        assert split.call("count") == loads  # staged, not applied
        assert sync.versions() == dict.fromkeys(sync.versions(), 1)
        trainers.call("step", 4)  # a step after stage() changes nothing it sent
        applied = sync.apply("load")
        assert applied.version == 2 and applied.targets == 4 and applied.apply_s > 0
        _check(split, True, 3)
        _check(other, False, 3)
        assert set(sync.versions().values()) == {2}
        with pytest.raises(PhalanxError, match="no target holds a staged version"):
            sync.apply("load")  # applied already


def test_a_generator_killed_mid_stage_fails_alone_and_catches_up(fresh):
    trainers, split, other = fresh
    with px.weight_sync(trainers, [split, other], src_rank="all") as sync:
        sync.push("shards", "load", "wanted")
        trainers.call("configure", delay=0.5)
        began = time.monotonic()
        sync.push("shards", "load", "wanted")
        baseline = time.monotonic() - began
        victim = other.call_one(0, "pid")
        trainers.call("configure", delay=0.5, victim=victim)
        trainers.call("step", 5)
        began = time.monotonic()
        with pytest.raises(PhalanxError, match=rf"rank 0 of group {other.name} failed") as failed:
            sync.push("shards", "load", "wanted")
        took = time.monotonic() - began
        error = failed.value
        assert set(error.failed) == {(other.name, 0)} and not error.sources
        assert error.stats.targets == 3 and error.stats.version == 3
        # nobody waited for the dead one: a generous bound over the same push's time
        assert took < 2 * baseline + 3, (took, baseline)
        _check(split, True, 5)  # the others got the weights
        assert other.call_one(1, "received") == _expected(False, 1, 5)
        versions = sync.versions()
        assert versions[(other.name, 0)] in (2, None)  # None once its death is known here
        assert {v for k, v in versions.items() if k != (other.name, 0)} == {3}
        assert helpers.wait_until(lambda: not other.health()[0].alive, 10)
        assert sync.versions()[(other.name, 0)] is None
        other.recreate([0])
        trainers.call("configure")
        loads = split.call("count")
        stats = sync.catch_up("shards", "load", "wanted")
        assert stats.per_target == {(other.name, 0): _bytes(False, 0)}  # only it received
        assert stats.version == 3 and set(sync.versions().values()) == {3}
        assert other.call_one(0, "received") == _expected(False, 0, 5)
        assert split.call("count") == loads  # applied nothing more
        assert sync.catch_up("shards", "load", "wanted").per_target == {}  # none behind


def test_a_stalled_generator_fails_alone_within_the_timeout(fresh, ranks):
    trainers, split, other = fresh
    with px.weight_sync(trainers, [split, other], src_rank="all", timeout=3) as sync:
        sync.push("shards", "load", "wanted")
        trainers.call("configure", victim=other.call_one(1, "pid"), sig=signal.SIGSTOP)
        trainers.call("step", 9)
        began = time.monotonic()
        try:
            with pytest.raises(PhalanxError,
                               match=rf"rank 1 of group {other.name} failed") as failed:
                sync.push("shards", "load", "wanted")
            took = time.monotonic() - began
        finally:
            ranks.resume(other, 1)
        assert set(failed.value.failed) == {(other.name, 1)}
        assert took < 3 + 5  # the sources' timeout of 3 s, and the rest of a push
        _check(split, True, 9)
        assert other.call_one(0, "received") == _expected(False, 0, 9)
        trainers.call("configure")
        trainers.call("step", 10)
        assert sync.push("shards", "load", "wanted").formed  # formed again: it is back
        _check(other, False, 10)


def test_add_gives_a_new_group_the_current_version(fresh):
    trainers, split, other = fresh
    with px.weight_sync(trainers, split, src_rank="all") as sync:
        trainers.call("step", 6)
        sync.push("shards", "load", "wanted")
        sync.add(other)
        assert sync.versions()[(other.name, 0)] is None
        stats = sync.catch_up("shards", "load", "wanted")
        assert set(stats.per_target) == {(other.name, 0), (other.name, 1)}
        _check(other, False, 6)
        assert set(sync.versions().values()) == {1}


def test_a_failing_source_is_named_and_nothing_is_applied(fresh):
    trainers, split, other = fresh
    with px.weight_sync(trainers, [split, other], src_rank="all") as sync:
        sync.push("shards", "load", "wanted")
        loads = split.call("count")
        trainers.call_one(1, "configure", refuse=True)
        with pytest.raises(PhalanxError, match=rf"source rank 1 of group {trainers.name} "
                                               "failed: .*no weights today") as failed:
            sync.push("shards", "load", "wanted")
        assert set(failed.value.sources) == {1}
        assert isinstance(failed.value.__cause__, px.WorkerError)
        assert split.call("count") == loads  # no target applied a part of it
        with pytest.raises(PhalanxError, match=rf"forming failed: source rank 1 of group "
                                               f"{trainers.name}") as failed:
            sync.push("shards", "load", "wanted")  # forms again: its blocks fail too
        assert set(failed.value.sources) == {1} and failed.value.stats.targets == 0
        trainers.call("configure")
        trainers.call("step", 7)
        sync.push("shards", "load", "wanted")
        _check(split, True, 7)


def test_src_rank_0_still_pushes_whole_state_dicts(fresh):
    trainers, split, _ = fresh
    trainers.call("step", 8)
    with px.weight_sync(trainers, split, src_rank=0) as sync:
        stats = sync.push("whole", "load")
        assert stats.transport in ("shared", "broadcast") and stats.per_target == {}
        whole = {name: (str(t.dtype), tuple(t.shape), t.tolist())
                 for name, t in ((n, _full(n, 8)) for n in FULL)}
        assert split.call("received") == [whole, whole]
        # want= moves parts, from rank 0 alone
        stats = sync.push("whole", "load", "wanted")
        assert stats.transport == "p2p" and sync.version == 1
        assert stats.per_target == {(split.name, r): _bytes(True, r) for r in range(2)}
        _check(split, True, 8)


def test_bad_arguments_are_refused_before_anything_is_sent(fresh):
    trainers, split, _ = fresh
    with pytest.raises(ValueError, match="leave transport='auto'"):
        px.weight_sync(trainers, split, src_rank="all", transport="broadcast")
    with pytest.raises(TypeError, match="integer or 'all'"):
        px.weight_sync(trainers, split, src_rank="some")
    with px.weight_sync(trainers, split, src_rank="all") as sync:
        with pytest.raises(TypeError, match="bucket_mb"):
            sync.push("shards", "load", bucket_mb=4)
        with pytest.raises(TypeError, match="want method must be a name"):
            sync.push("shards", "load", want=split.wanted)
        with pytest.raises(AttributeError, match="no method 'wants'"):
            sync.stage("shards", "wants")
        with pytest.raises(PhalanxError, match="nothing was staged yet"):
            sync.apply("load")
        with pytest.raises(ValueError, match="already a target"):
            sync.add(split)
        assert sync.state.name == "NEW"
    with pytest.raises(px.GroupClosed, match="closed"):
        sync.stage("shards")
