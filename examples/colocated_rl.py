"""An RL-style loop with two colocated groups: a torch policy that trains, and generators
that sample with its latest weights -- on the same slots of one resource pool.

The task is a contextual bandit: each sample is a context vector, the policy (a linear
softmax over ``--actions`` actions) picks an action, and the reward is 1 when it is the
action a hidden linear rule prefers. Each step:

1. the generation group (2 ranks, in its own interpreter with ``--python``) samples
   contexts, actions and rewards with the weights it holds, and keeps them on its ranks
   (``keep=True``: the controller gets handles, not the samples);
2. the policy group (2 ranks, DDP over gloo) trains on them -- rank i reads generator
   i's samples, which ran on the same slot, straight from it -- with REINFORCE;
3. the new weights go from trainer 0 to the generators over a gloo broadcast in one
   world of all four ranks (``px.rendezvous``), and every generator is checked to hold
   exactly the trainers' weights.

The mean reward climbs from chance (1/actions) as the policy learns.

    python examples/colocated_rl.py [--steps 30] [--backend local|ray] [--python PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import phalanx as px

CONTEXT, ACTIONS, BATCH = 8, 4, 256


def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(arrays[name].tobytes())
    return h.hexdigest()[:16]


def _rule(actions: int):
    import numpy as np

    return np.random.default_rng(1234).standard_normal((CONTEXT, actions))  # hidden


def join_world(world: dict):
    """A gloo process group over the ranks of both groups (``px.rendezvous``), beside the
    policy's own DDP world."""
    from datetime import timedelta

    import torch.distributed as dist

    import phalanx as px

    rank, size = int(world["RANK"]), int(world["WORLD_SIZE"])
    store = px.joint_store(world, timeout=60)  # answers only the world's own ranks
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))


def broadcast(group, tensor) -> None:
    """``tensor`` from the joint world's rank 0 (the first trainer) to every rank."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class Generator:
    """Samples with the weights it was last given (numpy; torch only for the broadcast)."""

    def __init__(self, actions: int) -> None:
        import os

        import numpy as np

        self.actions = actions
        self.rank = int(os.environ["RANK"])
        self.rule = _rule(actions)
        self.weights = {"weight": np.zeros((actions, CONTEXT), np.float32),
                        "bias": np.zeros(actions, np.float32)}

    def join(self, world: dict) -> None:
        import torch

        self.world = join_world(world)
        self.flat = torch.zeros(self.actions * CONTEXT + self.actions)

    def receive(self) -> str:
        """The new weights, broadcast by the first trainer."""
        broadcast(self.world, self.flat)
        flat = self.flat.numpy()
        self.weights = {"weight": flat[:-self.actions].reshape(self.actions, CONTEXT).copy(),
                        "bias": flat[-self.actions:].copy()}
        return _digest(self.weights)

    def generate(self, step: int) -> dict:
        import numpy as np

        rng = np.random.default_rng(10_000 * step + self.rank)
        contexts = rng.standard_normal((BATCH, CONTEXT)).astype(np.float32)
        logits = contexts @ self.weights["weight"].T + self.weights["bias"]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        actions = np.array([rng.choice(self.actions, p=p) for p in probs])
        rewards = (actions == (contexts @ self.rule).argmax(axis=1)).astype(np.float32)
        return {"contexts": contexts, "actions": actions, "rewards": rewards}


class Policy:
    """One data-parallel replica of the policy."""

    def __init__(self, actions: int, lr: float) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # phalanx set the rendezvous (framework="torch")
        torch.manual_seed(0)
        self.net = torch.nn.Linear(CONTEXT, actions)
        torch.nn.init.zeros_(self.net.weight)
        torch.nn.init.zeros_(self.net.bias)
        self.model = DistributedDataParallel(self.net)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def train(self, batch: dict) -> float:
        import torch

        contexts = torch.tensor(batch["contexts"])
        actions = torch.tensor(batch["actions"]).long()
        rewards = torch.tensor(batch["rewards"])
        logp = torch.log_softmax(self.model(contexts), dim=1)
        chosen = logp.gather(1, actions.unsqueeze(1)).squeeze(1)
        loss = -((rewards - rewards.mean()) * chosen).mean()  # REINFORCE with a baseline
        self.optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients of both ranks here
        self.optimizer.step()
        return float(rewards.mean())

    def join(self, world: dict) -> None:
        self.world = join_world(world)

    def send(self) -> str:
        """Broadcast the weights (trainer 0's; every member takes part) and their digest."""
        import torch

        with torch.no_grad():
            flat = torch.cat([self.net.weight.reshape(-1), self.net.bias]).contiguous()
        broadcast(self.world, flat)
        return self.digest()

    def digest(self) -> str:
        return _digest({k: v.detach().numpy() for k, v in self.net.state_dict().items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--actions", type=int, default=ACTIONS)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--python", default=None,
                        help="the interpreter the generators run (default: this one)")
    opts = parser.parse_args()

    started = time.perf_counter()
    with px.ResourcePool(procs_per_node=2, colocate=2, backend=opts.backend) as pool, \
            px.WorkerGroup(Policy, args=(opts.actions, opts.lr), pool=pool,
                           framework="torch") as policy, \
            px.WorkerGroup(Generator, args=(opts.actions,), pool=pool,
                           python=opts.python) as generators:
        print(f"{pool}: policy and generators ready in {time.perf_counter() - started:.1f} s")
        worlds = px.rendezvous(policy, generators)  # trainers are ranks 0-1, generators 2-3
        for joined in [policy.map_async("join", worlds[0]),
                       generators.map_async("join", worlds[1])]:
            joined.result(timeout=60)
        rewards = []
        for step in range(opts.steps):
            samples = generators.call("generate", step, keep=True)  # handles: they stay
            rewards.append(sum(policy.map("train", samples)) / len(samples))
            sent = policy.call_async("send")
            held = generators.call("receive", timeout=60)
            expected = sent.result(timeout=60)
            if set(held) != set(expected) or len(set(expected)) != 1:
                raise SystemExit(f"step {step}: generators hold {held}, trainers {expected}")
            if step % 5 == 0 or step == opts.steps - 1:
                print(f"step {step:3d}: mean reward {rewards[-1]:.3f}, weights {held[0]}")
    chance = 1 / opts.actions
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} (chance {chance:.3f}); "
          f"done in {time.perf_counter() - started:.1f} s")
    if opts.steps >= 20 and rewards[-1] < 1.5 * chance:
        raise SystemExit("the policy did not learn")


if __name__ == "__main__":
    main()
