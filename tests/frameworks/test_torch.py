"""framework="torch": real gloo collectives over the environment phalanx sets."""

from __future__ import annotations

import pytest

import phalanx as px

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")


def all_reduce_ranks() -> dict:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # everything else comes from the environment
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(os.environ["NODE_RANK"])]))
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": value.item(),
        "nodes": [t.item() for t in gathered],
    }


@pytest.mark.slow
def test_gloo_all_reduce_across_two_simulated_nodes():
    results = px.spmd(all_reduce_ranks, nodes=2, procs_per_node=2, framework="torch",
                      echo_output=False)()
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 for r in results)
    assert all(r["sum"] == 0 + 1 + 2 + 3 for r in results)
    assert all(r["nodes"] == [0, 0, 1, 1] for r in results)


def _data():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(32, 5, generator=generator)
    targets = inputs @ torch.arange(1.0, 6.0).unsqueeze(1) + 0.1 * torch.randn(32, 1,
                                                                                generator=generator)
    return inputs, targets


def _model():
    torch.manual_seed(1)
    return torch.nn.Linear(5, 1)


def train(steps: int, lr: float, distributed: bool) -> list:
    """SGD on a linear model; with ``distributed`` each rank takes its shard and DDP averages
    the gradients, which for equal shards equals the full-batch gradient."""
    import torch.distributed as dist

    inputs, targets = _data()
    model = _model()
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        shard = len(inputs) // world
        inputs = inputs[rank * shard:(rank + 1) * shard]
        targets = targets[rank * shard:(rank + 1) * shard]
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    module = model.module if distributed else model
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.slow
def test_data_parallel_training_matches_single_process_full_batch_training():
    expected = train(steps=20, lr=0.05, distributed=False)
    results = px.spmd(train, procs_per_node=4, framework="torch", echo_output=False)(
        steps=20, lr=0.05, distributed=True
    )
    assert len(results) == 4
    for params in results:
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and training did move the weights
    assert not torch.allclose(expected[0], _model().weight)


def test_the_process_group_is_destroyed_at_worker_exit():
    import torch.distributed as dist

    from phalanx.rank import bootstrap

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert dist.is_initialized()
    bootstrap.torch_cleanup()
    assert not dist.is_initialized()
    bootstrap.torch_cleanup()  # nothing to do the second time
