"""A detached resource pool and a weight sync that outlive their controller.

A controller in a process of its own reserves a pool with ``detached=True`` on three
agents, places a trainer group on its first slot and a generator group on the two others,
pushes weights to the generators (twice whole, over a gloo broadcast; once by parts) and
is SIGKILLed. This process then attaches each group by its name -- the generators from
the pool's later agents, the backend listing all three -- finds the same ranks, makes the
same weight syncs again and carries on at the versions the ranks hold: the next pushes
are the next versions, with the trainer's new weights on every generator. On the local
backend a detached pool's groups live on this user's local agent, and ``pool.detach()``
leaves them to the next controller. Bad input is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import phalanx as px
from tests import helpers
from tests.conftest import BACKENDS
from tests.helpers import REPO, wait_until
from tests.workers import Probe

needs_agents = pytest.mark.skipif("cluster" not in BACKENDS,
                                  reason="the cluster backend is not under test")

# The workers are the controller script's own (pickled by value: px.attach rebuilds the
# groups from them in this process).
RL = textwrap.dedent("""
    import hashlib, json, os, sys, time
    import phalanx as px

    class Trainer:
        def __init__(self):
            import torch
            torch.set_num_threads(1)
            self.step(0)

        def step(self, step):
            import torch
            g = torch.Generator().manual_seed(step)
            self.weights = {"w": torch.rand(64, 48, generator=g),
                            "b": torch.rand(48, generator=g, dtype=torch.float64),
                            "step": torch.tensor(step)}
            return self.digest()

        def state(self):
            return self.weights

        def digest(self):
            return sorted([name, hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]]
                          for name, t in self.weights.items())

        def pid(self):
            return os.getpid()

    class Generator:
        def __init__(self):
            import torch
            torch.set_num_threads(1)
            self.weights = {}

        def load(self, state):
            self.weights = {name: t.clone() for name, t in state.items()}

        def digest(self):
            return sorted([name, hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]]
                          for name, t in self.weights.items())

        def pid(self):
            return os.getpid()

    hosts, token_file = json.loads(sys.argv[1])
    pool = px.ResourcePool(nodes=3, procs_per_node=1, name="rl", detached=True,
                           detach_timeout=60,
                           backend=px.ClusterBackend(hosts, token_file=token_file))
    learner, actors = pool.split([1, 2])
    trainer = px.WorkerGroup(Trainer, pool=learner, name="trainer", echo_output=False)
    generator = px.WorkerGroup(Generator, pool=actors, name="generator", echo_output=False)
    whole = px.weight_sync(trainer, generator, transport="broadcast")
    parts = px.weight_sync(trainer, generator, src_rank="all")
    for step in (1, 2):
        trainer.call("step", step)
        whole.push("state", "load")
    trainer.call("step", 3)
    parts.push("state", "load")
    print(json.dumps({"pids": {"trainer": trainer.call("pid"),
                               "generator": generator.call("pid")},
                      "whole": whole.version, "parts": parts.version,
                      "loaded": generator.call("digest"),
                      "held": trainer.call("digest")[0]}), flush=True)
    time.sleep(60)  # SIGKILLed here
""")

LOCAL = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    pool = px.ResourcePool(procs_per_node=2, name="rl-local", detached=True,
                           detach_timeout=30)
    first, second = pool.split([1, 1])
    actor = px.WorkerGroup(Probe, pool=first, name="actor", echo_output=False)
    learner = px.WorkerGroup(Probe, pool=second, name="learner", echo_output=False)
    actor.call("record", "acting")
    print(json.dumps({"actor": actor.call("pid"), "learner": learner.call("pid"),
                      "repr": repr(pool)}), flush=True)
    pool.detach()  # on purpose: the next controller finds both groups free to take
    print("detached", flush=True)
    time.sleep(60)  # SIGKILLed here
""")


def _controller(script: str, argument: object, lines: int = 1
                ) -> tuple[subprocess.Popen, list[str]]:
    """The controller process and the first ``lines`` lines it printed (the test fails,
    the process killed, when it ends before)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(argument)],
                            stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    said = [proc.stdout.readline() for _ in range(lines)]  # type: ignore[union-attr]
    if not all(said):
        _kill(proc)
        pytest.fail(f"the controller ended before starting its groups (code {proc.wait()})")
    return proc, said


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()  # type: ignore[union-attr]


def _end(groups: list[px.WorkerGroup], pids: list[int]) -> None:
    for group in groups:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(pids), 15)


@needs_agents
def test_a_detached_pools_groups_and_their_weight_syncs_carry_on_after_the_controller(
        agent_cluster):
    pytest.importorskip("torch", reason="a weight sync moves torch tensors")
    proc, said = _controller(RL, [agent_cluster.hosts, agent_cluster.token_file])
    started = json.loads(said[0])
    assert started["whole"] == 2 and started["parts"] == 1
    assert started["loaded"] == [started["held"]] * 2
    _kill(proc)
    pids = started["pids"]["trainer"] + started["pids"]["generator"]
    assert helpers.alive(pids) == pids  # the pool's nodes keep its groups
    backend = agent_cluster.backend
    listed = {g["name"]: g for g in px.attached(backend())}
    assert listed["generator"]["hosts"] == agent_cluster.hosts[1:]  # the pool's later slots
    trainer = px.attach("trainer", backend=backend(), echo_output=False)
    generator = None
    try:
        generator = px.attach("generator", backend=backend(), echo_output=False)
        assert trainer.call("pid") == started["pids"]["trainer"]  # the same processes
        assert generator.call("pid") == started["pids"]["generator"]
        assert generator.call("digest") == started["loaded"]  # the weights they hold

        whole = px.weight_sync(trainer, generator, transport="broadcast")
        parts = px.weight_sync(trainer, generator, src_rank="all")
        assert whole.version == 2  # where the ranks are, not 0
        assert parts.version == 1
        assert parts.versions() == {("generator", 0): 1, ("generator", 1): 1}
        with pytest.raises(ValueError, match="is open in this process"):
            px.weight_sync(trainer, generator)  # the same sync: one at a time

        held = trainer.call("step", 4)[0]
        stats = whole.push("state", "load")  # formed again, then the next version
        assert (stats.version, whole.version, stats.formed) == (3, 3, True)
        assert generator.call("digest") == [held, held]

        assert parts.catch_up("state", "load").bytes == 0  # none is behind version 1
        held = trainer.call("step", 5)[0]
        stats = parts.push("state", "load")
        assert stats.version == 2 == parts.version
        assert parts.versions() == {("generator", 0): 2, ("generator", 1): 2}
        assert generator.call("digest") == [held, held]
        whole.close()
        parts.close()
        again = px.weight_sync(trainer, generator, transport="broadcast")
        assert again.version == 0  # closed: the ranks let it go
        again.close()
    finally:
        _end([g for g in (trainer, generator) if g is not None], pids)


def test_a_detached_pool_on_the_local_backend_leaves_its_groups_to_the_next_controller(
        local_agent_dir):
    proc, said = _controller(LOCAL, None, lines=2)
    started = json.loads(said[0])
    assert "detached" in started["repr"] and said[1] == "detached\n"
    _kill(proc)
    assert {g["name"]: g["holder"] for g in px.attached()} == {"actor": None,
                                                                "learner": None}
    actor = px.attach("actor", echo_output=False)
    learner = None
    try:
        learner = px.attach("learner", echo_output=False)
        assert actor.call("pid") == started["actor"]
        assert learner.call("pid") == started["learner"]
        assert actor.call("history") == [["acting"]]
    finally:
        _end([g for g in (actor, learner) if g is not None],
             started["actor"] + started["learner"])


@needs_agents
def test_bad_detached_pools_are_refused_before_anything_starts(agent_cluster):
    with pytest.raises(ValueError, match="local agent, one node: nodes=2"):
        px.ResourcePool(nodes=2, detached=True)
    with pytest.raises(ValueError, match="detach_timeout must be a positive"):
        px.ResourcePool(backend=agent_cluster.backend(), detached=True, detach_timeout=0)
    with pytest.raises(ValueError, match="Ray Client"):  # its agents are connected to
        px.ResourcePool(backend=px.RayBackend(transport="ray"), detached=True)
    with px.ResourcePool(backend=agent_cluster.backend(), name="kept", detached=True,
                         detach_timeout=5) as pool:
        assert pool.detached and pool.detach_timeout == 5
        with pytest.raises(ValueError, match="another open pool of this process has it"):
            px.ResourcePool(backend=agent_cluster.backend(), name="kept")
        with pytest.raises(ValueError, match="kept is detached: each group placed on it "
                                             "needs name="):
            px.WorkerGroup(Probe, pool=pool)
        assert pool.placed() == {}
    with px.ResourcePool(backend=agent_cluster.backend()) as plain:
        with pytest.raises(ValueError, match="which is not detached"):
            px.WorkerGroup(Probe, pool=plain, name="x", detached=True)
        with pytest.raises(RuntimeError, match="not made with detached=True"):
            plain.detach()
