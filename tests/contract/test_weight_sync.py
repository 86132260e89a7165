"""``px.weight_sync(source, targets, src_rank)``: a trainer rank's state dict pushed to every
generator rank, through shared memory or a gloo broadcast, on every backend with the same
test code: values, dtypes and shapes as the source's, pushes after pushes, many buckets, a
recreated generator, a stopped one, failing ``get``/``set`` methods, closing, bad input."""

from __future__ import annotations

import gc

import pytest

import phalanx as px
from phalanx import GroupClosed, WorkerDied, WorkerError, WorkerGroup
from phalanx.controller.weightsync import SyncState
from tests import helpers

torch = pytest.importorskip("torch", reason="a weight sync moves torch tensors: pip install torch")

TRANSPORTS = ["auto", "broadcast"]  # auto: shared memory where every member is on one machine


def _weights(step: int) -> dict:
    """The trainers' state dict at ``step``: every kind of tensor a push must carry."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "layer.weight": torch.rand(256, 300, generator=g),  # 300 KiB: packed, or cut
        "layer.bias": torch.rand(300, generator=g, dtype=torch.float64),
        "big": torch.rand(1_200_000, generator=g),  # 4.6 MiB: in place
        "steps": torch.arange(7, dtype=torch.int64) * (step + 1),
        "half": torch.rand(33, 5, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(0.5 + step),  # 0-d
        "transposed": torch.rand(40, 30, generator=g).t(),  # not contiguous
        "mask": torch.rand(17, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "param": torch.nn.Parameter(torch.full((9,), float(step))),  # requires grad
    }


def _digest(state: dict) -> list:
    import hashlib

    import torch

    out = []
    for name in sorted(state):
        t = state[name].detach()
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append((name, str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest()[:16]))
    return out


class Trainer:
    """Holds the weights of a step, in a torch world of its own (the group's)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # framework="torch" set its rendezvous
        self.step(0)

    def step(self, step: int) -> list:
        self.weights = _weights(step)
        return _digest(self.weights)

    def state(self) -> dict:
        return self.weights

    def digest(self) -> list:
        return _digest(self.weights)

    def broken_state(self) -> dict:
        raise RuntimeError("no weights today")

    def not_a_state(self) -> list:
        return [1, 2]

    def own_world(self) -> tuple[int, float]:
        """Its own world's size, and an all-reduce over it (it still works)."""
        import torch
        import torch.distributed as dist

        total = torch.ones(1)
        dist.all_reduce(total)
        return dist.get_world_size(), float(total)

    def syncs(self) -> int:
        from phalanx.rank.weightsync import SYNCS

        return len(SYNCS)


class Generator:
    """Loads what it is given: copied into tensors of its own, or kept as given."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.weights: dict = {}
        self.keep_given = False
        self.refuse = False

    def configure(self, keep_given: bool = False, refuse: bool = False) -> None:
        self.keep_given, self.refuse = keep_given, refuse

    def load(self, state: dict) -> None:
        import torch

        if self.refuse:
            raise ValueError("load refused")
        assert all(type(t) is torch.Tensor and not t.requires_grad for t in state.values())
        if self.keep_given:
            self.weights = state
        else:
            self.weights = {name: t.clone() for name, t in state.items()}

    def scribble(self) -> None:
        """Write into every tensor it holds (given ones too: they are its own)."""
        for t in self.weights.values():
            if t.numel():
                t.view(-1)[0] = 1

    def digest(self) -> list:
        return _digest(self.weights)

    def world(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized()

    def syncs(self) -> int:
        from phalanx.rank.weightsync import SYNCS

        return len(SYNCS)


class Idle:
    """A worker that imports nothing (a group started only to be shut down)."""

    def load(self, state: dict) -> None:
        pass


@pytest.fixture(scope="module")
def groups(backend):
    """Two trainers, each on a node of its own (rank 1 is not on node 0), and two
    generators, for the whole module."""
    with helpers.long_lived_group(Trainer, nodes=2, procs_per_node=1, framework="torch",
                                  backend=backend, echo_output=False) as trainers, \
            helpers.long_lived_group(Generator, procs_per_node=2, backend=backend,
                                     echo_output=False) as generators:
        yield trainers, generators


@pytest.fixture
def fresh(groups):
    """The groups, every generator loading copies again and the trainers at step 0."""
    trainers, generators = groups
    generators.call("configure")
    trainers.call("step", 0)
    return trainers, generators


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_generator_gets_the_source_state(fresh, transport, backend):
    trainers, generators = fresh
    expected = trainers.call_one(0, "step", 3)
    with px.weight_sync(trainers, generators, src_rank=0, transport=transport) as sync:
        assert sync.state is SyncState.NEW
        stats = sync.push("state", "load")
        assert sync.state.name == "FORMED" and stats.formed and stats.targets == 2
        assert stats.tensors == 10 and stats.bytes > 5_000_000
        if transport == "broadcast":
            assert sync.transport == "broadcast"
        elif getattr(backend, "name", backend) == "local":  # one machine
            assert sync.transport == "shared"
        assert generators.call("digest") == [expected, expected]
    assert trainers.call("own_world") == [(2, 2.0), (2, 2.0)]  # the trainers' world, as it was
    assert generators.call("world") == [False, False]  # and no default world made here
    assert trainers.call("syncs") == [0, 0] and generators.call("syncs") == [0, 0]  # closed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pushes_follow_the_weights_in_many_buckets(fresh, transport):
    trainers, generators = fresh
    with px.weight_sync(trainers, [generators], src_rank=1, transport=transport) as sync:
        for step, (keep_given, bucket_mb) in enumerate([(False, 0.05), (True, 0.05),
                                                        (True, None), (False, 1)]):
            expected = trainers.call_one(1, "step", step)
            generators.call("configure", keep_given)
            stats = sync.push("state", "load", bucket_mb=bucket_mb)
            assert stats.formed == (step == 0)
            if sync.transport == "broadcast" and bucket_mb == 0.05:
                assert stats.buckets > 50  # 50 KiB buckets: the big tensor alone is 94
            assert generators.call("digest") == [expected, expected], f"push {step}"
            generators.call_one(0, "scribble")  # its tensors are its own, even those given
            assert generators.call_one(1, "digest") == expected
            assert trainers.call_one(1, "digest") == expected
        assert sync.generation == 1


def test_a_recreated_generator_gets_the_next_push_and_a_dead_one_fails_it(fresh, ranks):
    trainers, generators = fresh
    with px.weight_sync(trainers, generators, transport="broadcast") as sync:
        sync.push("state", "load")
        generators.recreate([1])  # a fresh process: the next push forms the world again
        expected = trainers.call_one(0, "step", 5)
        stats = sync.push("state", "load")
        assert stats.formed and sync.generation == 2
        assert generators.call("digest") == [expected, expected]
        ranks.kill(generators, 1)
        with pytest.raises(WorkerDied) as died:  # before anything is sent to the others
            sync.push("state", "load")
        assert (died.value.rank, died.value.group) == (1, generators.name)
        assert trainers.call_one(0, "syncs") == 1  # still in its generation-2 world
        generators.recreate([1])
        expected = trainers.call_one(0, "step", 6)
        assert sync.push("state", "load").formed
        assert generators.call("digest") == [expected, expected]


def test_a_stopped_generator_times_out_the_push_and_the_next_forms_again(fresh, ranks):
    trainers, generators = fresh
    with px.weight_sync(trainers, generators, transport="broadcast", timeout=3) as sync:
        sync.push("state", "load")
        ranks.stop(generators, 1)
        try:
            # gloo's timeout on a rank, or the controller's just after it: never a hang
            with pytest.raises((WorkerError, px.CallTimeout)):
                sync.push("state", "load")
        finally:
            ranks.resume(generators, 1)
        assert sync.state.name == "BROKEN"
        expected = trainers.call_one(0, "step", 7)
        assert sync.push("state", "load").formed
        assert generators.call("digest") == [expected, expected]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failing_method_names_its_rank_and_the_next_push_works(fresh, transport):
    trainers, generators = fresh
    with px.weight_sync(trainers, generators, src_rank=1, transport=transport) as sync:
        generators.call_one(1, "configure", refuse=True)
        with pytest.raises(WorkerError, match="load refused") as refused:
            sync.push("state", "load")
        assert (refused.value.rank, refused.value.group) == (1, generators.name)
        generators.call_one(1, "configure")
        with pytest.raises(WorkerError, match="no weights today") as broken:
            sync.push("broken_state", "load")
        assert (broken.value.rank, broken.value.group) == (1, trainers.name)
        with pytest.raises(WorkerError, match=r"dict of name -> torch\.Tensor"):
            sync.push("not_a_state", "load")
        expected = trainers.call_one(1, "step", 8)
        assert sync.push("state", "load").formed
        assert generators.call("digest") == [expected, expected]


def test_close_and_collection_let_every_rank_go(fresh):
    trainers, generators = fresh
    sync = px.weight_sync(trainers, generators, transport="broadcast")
    sync.push("state", "load")
    assert trainers.call_one(0, "syncs") == 1 and generators.call("syncs") == [1, 1]
    sync.close()
    sync.close()  # idempotent
    assert trainers.call_one(0, "syncs") == 0 and generators.call("syncs") == [0, 0]
    with pytest.raises(GroupClosed, match="closed"):
        sync.push("state", "load")
    collected = px.weight_sync(trainers, generators)
    collected.push("state", "load")
    assert generators.call("syncs") == [1, 1]
    del collected
    gc.collect()
    assert helpers.wait_until(lambda: generators.call("syncs") == [0, 0] and
                      trainers.call_one(0, "syncs") == 0, 10)


def test_bad_arguments_are_refused_before_anything_is_sent(fresh, backend):
    trainers, generators = fresh
    with pytest.raises(TypeError, match="source must be a WorkerGroup"):
        px.weight_sync("trainers", generators)
    with pytest.raises(TypeError, match=r"targets\[1\]"):
        px.weight_sync(trainers, [generators, 3])
    with pytest.raises(ValueError, match="no target group"):
        px.weight_sync(trainers, [])
    with pytest.raises(ValueError, match="among the targets"):
        px.weight_sync(trainers, [generators, trainers])
    with pytest.raises(ValueError, match="given twice"):
        px.weight_sync(trainers, [generators, generators])
    with pytest.raises(ValueError, match="src_rank 2 is outside"):
        px.weight_sync(trainers, generators, src_rank=2)
    with pytest.raises(TypeError, match="src_rank must be an integer"):
        px.weight_sync(trainers, generators, src_rank="0")
    with pytest.raises(ValueError, match="transport='smoke'"):
        px.weight_sync(trainers, generators, transport="smoke")
    with pytest.raises(ValueError, match="timeout"):
        px.weight_sync(trainers, generators, timeout=0)
    with px.weight_sync(trainers, generators) as sync:
        with pytest.raises(TypeError, match="get method must be a name"):
            sync.push(trainers.state, "load")
        with pytest.raises(TypeError, match="set method must be a name"):
            sync.push("state", None)
        with pytest.raises(AttributeError, match="no method 'lode'"):
            sync.push("state", "lode")
        for bad in (0, -1, float("nan")):
            with pytest.raises(ValueError, match="bucket_mb"):
                sync.push("state", "load", bucket_mb=bad)
        with pytest.raises(TypeError, match="bucket_mb"):
            sync.push("state", "load", bucket_mb="16")
        assert sync.state.name == "NEW"  # nothing was sent
        assert generators.call("syncs") == [0, 0]
    with WorkerGroup(Idle, backend=backend, echo_output=False) as gone:
        pass
    with pytest.raises(GroupClosed, match=f"group {gone.name} was shut down"):
        px.weight_sync(trainers, [generators, gone])


def test_the_buckets_cover_every_byte_once_and_hold_no_more_than_asked():
    from phalanx.rank import kept, weightsync

    assert kept.WEIGHT_SYNC == weightsync.PREFIX  # how the runtime finds the built-ins
    sizes = [0, 10, 5 << 20, 300, 3 << 20, 1, 0, 64 << 20, 7]
    for bucket in (1000, 1 << 20, 4 << 20, 16 << 20, 1 << 30):
        covered: dict[int, list[tuple[int, int]]] = {}
        for op in weightsync.plan(sizes, bucket):
            assert 0 < sum(length for _, _, length in op) <= bucket
            for i, start, length in op:
                covered.setdefault(i, []).append((start, length))
        for i, size in enumerate(sizes):
            offset = 0
            for start, length in sorted(covered.get(i, [])):
                assert start == offset
                offset += length
            assert offset == size, (bucket, i)


def test_metadata_from_a_peer_is_checked_before_anything_is_allocated():
    from phalanx.rank.weightsync import MAX_BUCKET_BYTES, parse_meta

    good = b'{"bucket": 16, "tensors": [["w", "bfloat16", [2, 3]], ["s", "int64", []]]}'
    assert parse_meta(good) == (16, [("w", torch.bfloat16, (2, 3)), ("s", torch.int64, ())])
    for bad in (b"\x80pickle", b"[]", b'{"bucket": 0, "tensors": []}',
                b'{"bucket": %d, "tensors": []}' % (MAX_BUCKET_BYTES + 1),
                b'{"bucket": 1, "tensors": [["w", "Tensor", [1]]]}',
                b'{"bucket": 1, "tensors": [["w", "float32", [-1]]]}',
                b'{"bucket": 1, "tensors": [["w", "float32"]]}'):
        with pytest.raises(ValueError, match="source"):
            parse_meta(bad)
