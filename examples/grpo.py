"""A GRPO-shaped loop: 3 generator replicas sample, each tensor-parallel over 2 ranks,
2 trainer ranks (DDP) learn, and the new weights go back to the generators by parts -- with
no byte of rollouts or weights through the controller.

The task is a contextual bandit: a prompt is a context vector, a completion is one of
``--actions`` actions, and its reward is 1 when it is the action a hidden linear rule
prefers. Each step:

1. every generator replica samples ``--group`` completions for each of its prompts with
   the weights it holds, scores them, and computes GRPO's group-relative advantages (each
   reward against the mean and spread of its prompt's group). Its two ranks each hold half
   of the policy's columns (the input features), as a row-parallel layer does: each
   computes its part of the logits and one all-reduce within the replica sums them, so
   both sample the same completions. ``call_sharded`` returns one answer per replica: the
   mean reward and the row count; the batch itself stays on the replica's first rank
   (``px.keep``);
2. ``px.chunk`` re-cuts the three replicas' batches into one per trainer (the counts
   differ, as they usually do): each trainer reads its rows straight from the generators,
   one value of its rows even where they span two of them;
3. the trainers take a policy-gradient step (DDP averages the gradients), and
   ``px.weight_sync(..., src_rank="all")`` moves the new weights by parts: each trainer
   offers the rows of each tensor that are its share (``px.Shard``, FSDP-style), each
   generator rank asks for its columns of the weight and the whole bias
   (``px.Region``), and receives each element it asked for from the one trainer that
   holds it, point to point (a memory block when they share a machine, TCP otherwise),
   on a plan formed on the first push (and again by itself after a rank is recreated).
   ``stats.per_target`` shows each generator rank received its region's bytes, no more.

The generators are checked to hold exactly their columns of the trainers' weights after
every step, and the mean reward climbs from chance (1/actions).

    python examples/grpo.py [--steps 30] [--backend local|ray] [--generators 3] [--tp 2]
"""

from __future__ import annotations

import argparse
import time

import phalanx as px

CONTEXT, ACTIONS, PROMPTS, GROUP = 8, 4, 32, 8


def _rule(actions: int):
    import numpy as np

    return np.random.default_rng(1234).standard_normal((CONTEXT, actions))  # hidden


class Generator:
    """One rank of a tensor-parallel generator replica: it holds its columns of the policy's
    weight (the context features ``columns()`` names) and the whole bias."""

    def __init__(self, actions: int, prompts: int, group: int, tp: int) -> None:
        import os

        import numpy as np
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.actions, self.prompts, self.group, self.tp = actions, prompts, group, tp
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.replica, self.part = divmod(rank, tp)  # mesh {"dp": size // tp, "tp": tp}
        dist.init_process_group("gloo")  # phalanx set the rendezvous (framework="torch")
        # every rank makes every replica's group, as torch.distributed requires
        groups = [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(size // tp)]
        self.tp_group = groups[self.replica]
        self.rule = _rule(actions)
        first, last = self.columns()
        self.weights = {"weight": np.zeros((actions, last - first), np.float32),
                        "bias": np.zeros(actions, np.float32)}

    def columns(self) -> tuple[int, int]:
        return CONTEXT * self.part // self.tp, CONTEXT * (self.part + 1) // self.tp

    def wanted(self) -> dict:
        """For ``px.weight_sync``: this rank's columns of the weight, the bias whole."""
        first, last = self.columns()
        return {"weight": px.Region(offset=(0, first), shape=(self.actions, last - first)),
                "bias": None}

    def load(self, state: dict) -> None:
        """What ``px.weight_sync`` hands over: the regions ``wanted`` named (torch)."""
        self.weights = {name: tensor.numpy().copy() for name, tensor in state.items()}

    def held(self) -> dict:
        return {"columns": self.columns(), **self.weights}

    def rollout(self, step: int) -> dict:
        import numpy as np
        import torch
        import torch.distributed as dist

        # both ranks of a replica draw the same prompts and samples
        rng = np.random.default_rng(10_000 * step + self.replica)
        prompts = rng.standard_normal((self.prompts, CONTEXT)).astype(np.float32)
        contexts = np.repeat(prompts, self.group, axis=0)  # each prompt, `group` times
        first, last = self.columns()
        partial = torch.from_numpy(contexts[:, first:last] @ self.weights["weight"].T)
        dist.all_reduce(partial, group=self.tp_group)  # the replica's logits, summed
        logits = partial.numpy() + self.weights["bias"]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        actions = np.array([rng.choice(self.actions, p=p) for p in probs])
        rewards = (actions == (contexts @ self.rule).argmax(axis=1)).astype(np.float32)
        grouped = rewards.reshape(self.prompts, self.group)
        advantages = ((grouped - grouped.mean(axis=1, keepdims=True))
                      / (grouped.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)
        batch = {"contexts": contexts, "actions": actions,
                 "advantages": advantages.astype(np.float32)}
        # the small fields come back; the batch stays on the replica's first rank until a
        # trainer reads its rows (the other ranks' answers are the same, and dropped)
        return {"batch": px.keep(batch) if self.part == 0 else None,
                "reward": float(rewards.mean()), "rows": len(actions)}


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

    def weights(self) -> dict:
        return {k: v.detach().numpy() for k, v in self.net.state_dict().items()}


def _check(step: int, held: list, full: dict) -> None:
    """Every generator rank holds exactly its columns of the trainers' weight, and the bias."""
    import numpy as np

    for rank, state in enumerate(held):
        first, last = state["columns"]
        if not (np.array_equal(state["weight"], full["weight"][:, first:last])
                and np.array_equal(state["bias"], full["bias"])):
            raise SystemExit(f"step {step}: generator rank {rank} does not hold columns "
                             f"{first}:{last} of the trainers' weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--actions", type=int, default=ACTIONS)
    parser.add_argument("--generators", type=int, default=3, help="generator replicas")
    parser.add_argument("--tp", type=int, default=2, help="ranks per generator replica")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--backend", default="local")
    opts = parser.parse_args()
    replicas, tp = opts.generators, opts.tp

    started = time.perf_counter()
    with px.WorkerGroup(Trainer, args=(opts.actions, opts.lr), procs_per_node=opts.trainers,
                        framework="torch", backend=opts.backend) as trainers, \
            px.WorkerGroup(Generator, args=(opts.actions, PROMPTS, GROUP, tp),
                           procs_per_node=replicas * tp, mesh={"dp": replicas, "tp": tp},
                           framework="torch", backend=opts.backend) as generators, \
            px.weight_sync(trainers, generators, src_rank="all") as sync:
        print(f"{opts.trainers} trainers and {replicas} generators ({tp} ranks each, "
              f"tensor-parallel) ready in {time.perf_counter() - started:.1f} s")
        rewards = []
        for step in range(opts.steps):
            rollouts = generators.call_sharded(
                "rollout", step=[step] * replicas, in_sharded_axes=["dp"],
                replicate_on_axes=["tp"], output_is_replicated=["tp"]).result(timeout=60)
            rewards.append(sum(r["reward"] for r in rollouts) / len(rollouts))
            batches = px.chunk([r["batch"] for r in rollouts], trainers.world_size)
            trained = trainers.map("train", batches, timeout=60)
            if sum(trained) != sum(r["rows"] for r in rollouts):
                raise SystemExit(f"step {step}: the trainers saw {trained} rows of "
                                 f"{[r['rows'] for r in rollouts]}")
            stats = sync.push("shards", "load", "wanted")
            _check(step, generators.call("held"), trainers.call_one(0, "weights"))
            if step % 5 == 0 or step == opts.steps - 1:
                received = sorted(set(stats.per_target.values()))
                print(f"step {step:3d}: mean reward {rewards[-1]:.3f}, rows {trained}, "
                      f"bytes per generator rank {received} ({sync.transport}, "
                      f"{stats.buckets} transfers)")
    chance = 1 / opts.actions
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} (chance {chance:.3f}); "
          f"done in {time.perf_counter() - started:.1f} s")
    if opts.steps >= 20 and rewards[-1] < 1.5 * chance:
        raise SystemExit("the policy did not learn")


if __name__ == "__main__":
    main()
