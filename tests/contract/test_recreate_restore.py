"""``recreate(ranks, readmit=..., restore_from=..., get=..., set=...)``: a fresh rank of a
data-parallel trainer (DDP over gloo, Adam) gets a healthy peer's model and optimizer
state straight from that peer before it rejoins the torch world, so every rank holds the
same state after the recreate and after the next step -- for rank 1, and for rank 0, whose
DDP re-wrap broadcasts its state to every rank. Bad arguments raise before any rank is
stopped; a plain ``recreate`` of a torch rank (no ``readmit``) times out with the fresh
rank's stack and a message naming ``readmit``.

On the local and cluster (agents) backends: the ranks on three nodes, so that on the
cluster a fresh rank reads its peer's state from another node's agent.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from phalanx import StartupError
from tests import helpers

torch = pytest.importorskip("torch", reason="the trainer is torch DDP: pip install torch")

# The backends whose kept results a fresh rank reads from its peer (a block mapped on this
# machine, an agent's copy); Ray's object store path is the kept results' own suite's.
_BACKENDS = [b for b in os.environ.get("PHALANX_TEST_BACKENDS", "local,cluster").split(",")
             if b in ("local", "cluster")]

_RESTORE = {"readmit": "readmit", "restore_from": "peers", "get": "state", "set": "load",
            "timeout": 60}


class DDPTrainer:
    """A rank of a data-parallel trainer: a small model in DDP, Adam, its own batches."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.manual_seed(0)  # every rank starts from the same weights, as DDP assumes
        self.model = torch.nn.Linear(16, 4)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.ddp = None
        self.told: dict[str, str] = {}
        if os.environ.get("PHALANX_READMIT") != "1":  # a fresh rank joins in readmit()
            dist.init_process_group("gloo")  # framework="torch" set its rendezvous
            self._wrap()

    def _wrap(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(self.model)  # broadcasts rank 0's weights

    def readmit(self, rendezvous: dict) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.update(rendezvous)
        dist.init_process_group("gloo")
        self._wrap()
        self.told = {k: rendezvous[k] for k in ("PHALANX_FRESH_RANKS", "PHALANX_RESTORED")}

    def train(self, step: int) -> str:
        """One step on this rank's own batch (DDP averages the gradients)."""
        import torch

        batch = torch.Generator().manual_seed(1000 * step + int(os.environ["RANK"]))
        x, y = torch.randn(32, 16, generator=batch), torch.randn(32, 4, generator=batch)
        self.optim.zero_grad()
        ((self.ddp(x) - y) ** 2).mean().backward()
        self.optim.step()
        return self.digest()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])

    def lost_state(self) -> dict:
        raise RuntimeError("this rank's state is on a disk that failed")

    def digest(self) -> str:
        """The model's weights and every tensor and number of the optimizer's state."""
        return _digest(self.state())

    def weights(self) -> str:
        return _digest(self.model.state_dict())

    def initial_weights(self) -> str:
        import torch

        torch.manual_seed(0)
        return _digest(torch.nn.Linear(16, 4).state_dict())

    def told_on_readmit(self) -> dict:
        return self.told


class Shard:
    """A rank of a dp x tp mesh holding a state of its own."""

    def __init__(self) -> None:
        self.held = f"fresh {os.environ['RANK']}"

    def state(self) -> str:
        return self.held

    def load(self, state: str) -> None:
        self.held = state


def _digest(value: object) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().numpy().tobytes())
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()


@pytest.fixture(scope="module", params=_BACKENDS)
def backend(request):
    if request.param == "cluster":
        return request.getfixturevalue("agent_cluster").backend()
    return request.param


@pytest.fixture(scope="module")
def trainers(backend):
    with helpers.long_lived_group(DDPTrainer, nodes=3, procs_per_node=1, framework="torch",
                                  backend=backend, start_timeout=60,
                                  echo_output=False) as group:
        yield group


def _same(digests: list[str]) -> str:
    assert len(set(digests)) == 1, f"the ranks' states differ: {digests}"
    return digests[0]


def _kill(group, rank: int) -> None:
    group.send_signal(signal.SIGKILL, [rank])
    assert helpers.wait_until(lambda: not group.health()[rank].alive, 10)


def _pids(group) -> list:
    return [h.pid for h in group.health()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_comes_back_with_its_peers_model_and_optimizer(trainers, victim):
    for step in (1, 2):
        _same(trainers.call("train", step, timeout=60))
    before = _same(trainers.call("digest", timeout=30))
    _kill(trainers, victim)

    started = time.monotonic()
    trainers.recreate(victim, **_RESTORE)
    took = time.monotonic() - started

    after = _same(trainers.call("digest", timeout=30))
    assert after == before  # the fresh rank holds its peer's exact state, Adam's too
    assert trainers.call("told_on_readmit", timeout=30) == [
        {"PHALANX_FRESH_RANKS": str(victim), "PHALANX_RESTORED": "1"}] * 3
    # rank 0's DDP re-wrap broadcast its (restored) weights: not the initial ones
    assert trainers.call_one(0, "weights") != trainers.call_one(0, "initial_weights")
    _same(trainers.call("train", 3, timeout=60))  # and they stay in step
    print(f"recreate+restore of rank {victim} ({trainers.backend}): {took:.2f} s; "
          "digests match")


@pytest.mark.timeout(60)
def test_peers_on_a_mesh_are_the_same_place_in_another_replica(make_group):
    group = make_group(Shard, procs_per_node=4, mesh={"dp": 2, "tp": 2})
    group.map("load", [f"dp{r // 2} tp{r % 2}" for r in range(4)])
    group.recreate([0, 3], restore_from="peers", get="state", set="load", timeout=30)
    # rank 0 (dp 0, tp 0) from rank 2 (dp 1, tp 0); rank 3 (dp 1, tp 1) from rank 1
    assert group.call("state") == ["dp1 tp0", "dp0 tp1", "dp1 tp0", "dp0 tp1"]
    with pytest.raises(ValueError, match=r"no live rank .* holds rank 1's state"):
        group.recreate([1, 3], restore_from="peers", get="state", set="load")


@pytest.mark.timeout(60)
def test_bad_restore_arguments_raise_before_anything_is_stopped(trainers):
    pids = _pids(trainers)
    with pytest.raises(TypeError, match="needs get= and set="):
        trainers.recreate(1, readmit="readmit", restore_from="peers", set="load")
    with pytest.raises(TypeError, match="restore_from="):
        trainers.recreate(1, readmit="readmit", get="state", set="load")
    with pytest.raises(ValueError, match="peer rank 1 is recreated too"):
        trainers.recreate(1, readmit="readmit", restore_from=1, get="state", set="load")
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        trainers.recreate(1, readmit="readmit", restore_from={1: 7}, get="state", set="load")
    with pytest.raises(ValueError, match=r"no peer for fresh ranks \[2\]"):
        trainers.recreate([1, 2], readmit="readmit", restore_from={1: 0}, get="state",
                          set="load")
    with pytest.raises(ValueError, match="'neighbours'"):
        trainers.recreate(1, readmit="readmit", restore_from="neighbours", get="state",
                          set="load")
    with pytest.raises(ValueError, match="no live rank"):
        trainers.recreate([0, 1, 2], readmit="readmit", restore_from="peers", get="state",
                          set="load")
    with pytest.raises(AttributeError, match="no method 'stat'"):
        trainers.recreate(1, readmit="readmit", restore_from="peers", get="stat", set="load")
    assert _pids(trainers) == pids
    _same(trainers.call("train", 4, timeout=60))  # the world is untouched


@pytest.mark.timeout(120)
def test_a_failed_restore_names_both_ranks_and_the_method(trainers):
    with pytest.raises(StartupError) as failed:
        trainers.recreate(1, readmit="readmit", restore_from=2, get="lost_state",
                          set="load", timeout=60)
    text = str(failed.value)
    assert "restoring rank 1 of group" in text and "from rank 2" in text
    assert "lost_state() on rank 2" in text and "disk that failed" in text
    assert not trainers.health()[1].alive  # no rank with fresh state left serving calls
    trainers.recreate(1, **_RESTORE)
    _same(trainers.call("train", 7, timeout=60))


@pytest.mark.timeout(120)
def test_recreating_a_torch_rank_without_readmit_says_to_pass_it(trainers, caplog):
    _kill(trainers, 2)
    with pytest.raises(StartupError) as failed:
        trainers.recreate(2, timeout=6)
    text = str(failed.value)
    assert "did not become ready within 6 s" in text
    assert "readmit=" in text and "restore_from=" in text
    assert "its stack when the start timed out" in text and "__init__" in text

    # what the message says to do works; rank 0 is not fresh: no warning about it
    with caplog.at_level(logging.WARNING, logger="phalanx.controller.lifecycle"):
        trainers.recreate(2, **_RESTORE)
    assert not [r for r in caplog.records if "rank 0" in r.getMessage()]
    _same(trainers.call("train", 5, timeout=60))


@pytest.mark.timeout(120)
def test_a_fresh_rank_0_not_restored_is_warned_about(trainers, caplog):
    with caplog.at_level(logging.WARNING, logger="phalanx.controller.lifecycle"):
        trainers.recreate(0, readmit="readmit", timeout=60)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("rank 0" in m and "restore_from" in m and "DDP" in m for m in warned), warned
    # the hazard it names: DDP's re-wrap gave every rank rank 0's fresh weights
    assert trainers.call("told_on_readmit", timeout=30) == [
        {"PHALANX_FRESH_RANKS": "0", "PHALANX_RESTORED": "0"}] * 3
    assert _same(trainers.call("weights", timeout=30)) == trainers.call_one(
        0, "initial_weights")
    state = trainers.call_one(1, "state", keep=True)  # every rank in step again
    trainers.call("load", state, timeout=30)
    state.free()
    _same(trainers.call("train", 6, timeout=60))
