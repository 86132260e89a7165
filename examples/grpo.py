"""A GRPO-shaped loop: 3 generator ranks sample, 2 trainer ranks (DDP) learn, and the new
weights go back to the generators -- with no byte of rollouts or weights through the
controller.

The task is a contextual bandit: a prompt is a context vector, a completion is one of
``--actions`` actions, and its reward is 1 when it is the action a hidden linear rule
prefers. Each step:

1. every generator samples ``--group`` completions for each of its prompts with the
   weights it holds, scores them, and computes GRPO's group-relative advantages (each
   reward against the mean and spread of its prompt's group). It returns the mean reward
   and its row count, and keeps the batch itself on the rank (``px.keep``);
2. ``px.chunk`` re-cuts the three generators' batches into one per trainer (the counts
   differ, as they usually do): each trainer reads its rows straight from the generators,
   one value of its rows even where they span two of them;
3. the trainers take a policy-gradient step (DDP averages the gradients), and
   ``px.weight_sync(..., src_rank="all")`` moves the new weights by parts, as a sharded
   trainer would: each trainer offers the rows of each tensor that are its share
   (``px.Shard``, FSDP-style), and every generator receives each row from the one
   trainer that offers it, point to point (a memory block when they share a machine,
   TCP otherwise), on a plan formed on the first push (and again by itself after a rank
   is recreated). The generators here are whole replicas, so each wants every tensor
   whole (``want`` left out); a tensor-parallel generator would name its columns with
   ``px.Region`` (see the README).

The generators are checked to hold exactly the trainers' weights after every step, and the
mean reward climbs from chance (1/actions).

    python examples/grpo.py [--steps 30] [--backend local|ray] [--generators 3]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import phalanx as px

CONTEXT, ACTIONS, PROMPTS, GROUP = 8, 4, 32, 8


def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(arrays[name].tobytes())
    return h.hexdigest()[:16]


def _rule(actions: int):
    import numpy as np

    return np.random.default_rng(1234).standard_normal((CONTEXT, actions))  # hidden


class Generator:
    """Samples with the weights it was last given (numpy; the weights arrive as torch)."""

    def __init__(self, actions: int, prompts: int, group: int) -> None:
        import os

        import numpy as np

        self.actions, self.prompts, self.group = actions, prompts, group
        self.rank = int(os.environ["RANK"])
        self.rule = _rule(actions)
        self.weights = {"weight": np.zeros((actions, CONTEXT), np.float32),
                        "bias": np.zeros(actions, np.float32)}

    def load(self, state: dict) -> None:
        """What ``px.weight_sync`` hands over: the trainer's state dict (torch tensors)."""
        self.weights = {name: tensor.numpy().copy() for name, tensor in state.items()}

    def digest(self) -> str:
        return _digest(self.weights)

    def rollout(self, step: int) -> dict:
        import numpy as np

        rng = np.random.default_rng(10_000 * step + self.rank)
        prompts = rng.standard_normal((self.prompts, CONTEXT)).astype(np.float32)
        contexts = np.repeat(prompts, self.group, axis=0)  # each prompt, `group` times
        logits = contexts @ self.weights["weight"].T + self.weights["bias"]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        actions = np.array([rng.choice(self.actions, p=p) for p in probs])
        rewards = (actions == (contexts @ self.rule).argmax(axis=1)).astype(np.float32)
        grouped = rewards.reshape(self.prompts, self.group)
        advantages = ((grouped - grouped.mean(axis=1, keepdims=True))
                      / (grouped.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)
        batch = {"contexts": contexts, "actions": actions,
                 "advantages": advantages.astype(np.float32)}
        # the small fields come back; the batch stays here until a trainer reads its rows
        return {"batch": px.keep(batch), "reward": float(rewards.mean()),
                "rows": len(actions)}


class Trainer:
    """One data-parallel replica of the policy."""

    def __init__(self, actions: int, lr: float) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # phalanx set the rendezvous (framework="torch")
        self.net = torch.nn.Linear(CONTEXT, actions)
        torch.nn.init.zeros_(self.net.weight)
        torch.nn.init.zeros_(self.net.bias)
        self.model = DistributedDataParallel(self.net)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def train(self, batch: dict) -> int:
        """A policy-gradient step on this trainer's rows (read from the generators)."""
        import torch

        contexts = torch.from_numpy(batch["contexts"].copy())
        actions = torch.from_numpy(batch["actions"].copy()).long()
        advantages = torch.from_numpy(batch["advantages"].copy())
        logp = torch.log_softmax(self.model(contexts), dim=1)
        chosen = logp.gather(1, actions.unsqueeze(1)).squeeze(1)
        loss = -(advantages * chosen).mean()
        self.optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients of both trainers here
        self.optimizer.step()
        return len(actions)

    def shards(self) -> dict:
        """This trainer's share of the weights for ``px.weight_sync``: its rows of each
        tensor (as an FSDP rank holds them; DDP replicas hold all, and offer a part)."""
        import os

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out = {}
        for name, tensor in self.net.state_dict().items():
            rows = tensor.shape[0]
            first, last = rows * rank // size, rows * (rank + 1) // size
            out[name] = px.Shard(tensor.detach()[first:last], offset=(first,) + (0,) * (
                tensor.dim() - 1), full=tuple(tensor.shape))
        return out

    def digest(self) -> str:
        return _digest({k: v.detach().numpy() for k, v in self.net.state_dict().items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--actions", type=int, default=ACTIONS)
    parser.add_argument("--generators", type=int, default=3)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--backend", default="local")
    opts = parser.parse_args()

    started = time.perf_counter()
    with px.WorkerGroup(Trainer, args=(opts.actions, opts.lr), procs_per_node=opts.trainers,
                        framework="torch", backend=opts.backend) as trainers, \
            px.WorkerGroup(Generator, args=(opts.actions, PROMPTS, GROUP),
                           procs_per_node=opts.generators, backend=opts.backend) as generators, \
            px.weight_sync(trainers, generators, src_rank="all") as sync:
        print(f"{opts.trainers} trainers and {opts.generators} generators ready in "
              f"{time.perf_counter() - started:.1f} s")
        rewards = []
        for step in range(opts.steps):
            rollouts = generators.call("rollout", step, timeout=60)
            rewards.append(sum(r["reward"] for r in rollouts) / len(rollouts))
            batches = px.chunk([r["batch"] for r in rollouts], trainers.world_size)
            trained = trainers.map("train", batches, timeout=60)
            if sum(trained) != sum(r["rows"] for r in rollouts):
                raise SystemExit(f"step {step}: the trainers saw {trained} rows of "
                                 f"{[r['rows'] for r in rollouts]}")
            stats = sync.push("shards", "load")
            held, expected = generators.call("digest"), trainers.call("digest")
            if set(held) != set(expected) or len(set(expected)) != 1:
                raise SystemExit(f"step {step}: generators hold {held}, trainers {expected}")
            if step % 5 == 0 or step == opts.steps - 1:
                print(f"step {step:3d}: mean reward {rewards[-1]:.3f}, rows {trained}, "
                      f"weights {held[0]} ({sync.transport}, {stats.buckets} transfers)")
    chance = 1 / opts.actions
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} (chance {chance:.3f}); "
          f"done in {time.perf_counter() - started:.1f} s")
    if opts.steps >= 20 and rewards[-1] < 1.5 * chance:
        raise SystemExit("the policy did not learn")


if __name__ == "__main__":
    main()
