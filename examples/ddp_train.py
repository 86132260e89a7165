"""Data-parallel training of a small model on 4 ranks, driven by one controller.

Each rank builds the same model, trains on its own shard of a synthetic regression
problem, and averages gradients with torch DistributedDataParallel over gloo. phalanx sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT before the worker object is built
(``framework="torch"``), so ``init_process_group("gloo")`` needs no arguments. The
controller drives the epochs, collects the losses, and checks that every rank ends with
identical weights. Lines every rank prints alike are shown once, as ``[ranks 0-3] ...``.

    python examples/ddp_train.py [--ranks 4] [--epochs 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import phalanx as px


class Trainer:
    """One data-parallel replica."""

    def __init__(self, lr: float, seed: int = 0) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # env:// — phalanx set the rendezvous variables
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        self.model = DistributedDataParallel(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        print(f"joined the gloo process group of {self.world_size} ranks")
        # The task: y = <x, w_true> + noise; each rank samples its own shard of it.
        self.w_true = torch.linspace(-1.0, 1.0, 16)

    def train_epoch(self, epoch: int, steps: int, batch_size: int = 64) -> float:
        import torch

        generator = torch.Generator().manual_seed(1000 * epoch + self.rank)
        total = 0.0
        for step in range(steps):
            x = torch.randn(batch_size, 16, generator=generator)
            noise = 0.01 * torch.randn(batch_size, 1, generator=generator)
            y = (x @ self.w_true).unsqueeze(1) + noise
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()  # DDP all-reduces (averages) the gradients across ranks here
            self.optimizer.step()
            total += loss.item()
            if step % 20 == 0:
                print(f"epoch {epoch} step {step:3d} loss {loss.item():.4f}")
        return total / steps

    def weights_digest(self) -> str:
        h = hashlib.sha256()
        for p in self.model.module.parameters():
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    opts = parser.parse_args()

    started = time.perf_counter()
    with px.WorkerGroup(Trainer, args=(opts.lr,), procs_per_node=opts.ranks,
                        framework="torch") as group:
        print(f"{group.world_size} ranks ready in {time.perf_counter() - started:.1f} s")
        for epoch in range(opts.epochs):
            losses = group.call("train_epoch", epoch, opts.steps)
            shown = ", ".join(f"{loss:.4f}" for loss in losses)
            print(f"epoch {epoch}: mean loss per rank [{shown}]")
        digests = group.call("weights_digest")
    # leaving the block shut the group down; framework="torch" destroyed each process group
    if len(set(digests)) != 1:
        raise SystemExit(f"ranks disagree on the weights: {digests}")
    print(f"all {len(digests)} ranks hold identical weights (sha256 {digests[0]})")
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
