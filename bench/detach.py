"""W17: a controller killed and replaced -- ``detached=True`` and ``px.attach``, timed.

    python -m bench.detach [--json PATH] [--nodes 4] [--per-node 16] [--trials 3]

``--nodes`` ``phalanx agent`` processes on 127.0.0.2, .3, ... (a private token), and a
controller in a process of its own that starts a detached group of ``nodes x per_node``
ranks on them (64 by default) and a detached generator group of 2 ranks on the last
agent, forms a weight sync from the first group's rank 0 to the generators and pushes
twice (version 2), keeps a 1 MiB result on every rank (``keep=True``), starts a 1 s call
on every rank, and is SIGKILLed 0.5 s into it. This process then attaches
(``px.attach``) and makes its first call on every rank: **attach** is the time until
``px.attach`` returned the live group, **attach to first call** until that call answered
(from ``px.attach``'s start; it includes the rest of the call the ranks were running when
the controller died, which they finish first: up to 0.5 s).
Checked each trial: the ranks are the same processes (**restarts**: ranks whose pid
changed, must be 0), every kept result is usable through its new handle (**kept
usable**: ``get()`` of each equals what the killed controller read), and the running
call's answers are reachable (**orphans**: ``group.orphaned()`` once the call ended, one
per rank), and the weight sync carries on (**sync**: the generators attached,
``px.weight_sync`` made again says version 2, its next push is version 3 and every
generator holds the new weights; its time, attach to push done, beside). Prints a table,
writes JSON (default bench/results/detach.json).

    python -m bench.detach --simulated 1000 [--flat] [--trials 3]

The same at scale: 1,000 simulated nodes (``bench.simagents``, as ``bench.scale`` starts
them: real agents and sessions, one in-process rank each), in a tree as a cluster of that
size forms by default (the controller holds 4 connections, each agent adopts up to 50), or
``--flat`` (one connection to each). The killed controller
set every rank's state and left a call running on every rank (one that a simulated rank
never answers: a simulated rank answers at once or not at all, so no orphan comes, and
kept results, which live in a real rank, are not held); after the attach the first call
reads every rank's state back (**state kept**: all as the killed controller set it). The
controller's CPU time for the attach is beside its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

from bench.report import write_json
from bench.util import machine_info

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "detach.json"
ROOT = Path(__file__).resolve().parent.parent

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import phalanx as px

    class Rank:
        def make(self, n):
            return np.full(n, float(__import__("os").getpid()))
        def sleep(self, s):
            time.sleep(s)
            return "slept"
        def pid(self):
            return __import__("os").getpid()
        def train(self, step):
            self.step = step
        def weights(self):  # the sync's source, rank 0: torch there alone
            import torch
            return {"w": torch.full((1 << 16,), float(self.step))}  # 256 KiB

    class Generator:
        def load(self, state):
            self.state = {k: v.clone() for k, v in state.items()}
        def held(self):
            return float(self.state["w"][0])

    hosts, token_file, name, per_node = json.loads(sys.argv[1])
    group = px.WorkerGroup(Rank, nodes=len(hosts), procs_per_node=per_node,
                           backend=px.ClusterBackend(hosts, token_file=token_file),
                           name=name, detached=True, detach_timeout=120, echo_output=False)
    generator = px.WorkerGroup(Generator, nodes=1, procs_per_node=2, name=name + "-gen",
                               backend=px.ClusterBackend(hosts[-1:], token_file=token_file),
                               detached=True, detach_timeout=120, echo_output=False)
    sync = px.weight_sync(group, generator)
    for step in (1, 2):
        group.call("train", step)
        sync.push("weights", "load")
    kept = group.call("make", 1 << 17, keep=True)  # 1 MiB each
    print(json.dumps({"pids": group.call("pid"), "version": sync.version,
                      "kept": [float(h.get()[0]) for h in kept]}), flush=True)
    group.call_async("sleep", 1.0)
    time.sleep(0.5)
    print("running", flush=True)
    time.sleep(600)
""")


SIM_CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from bench.detach import SimPolicy, sim_backend

    hosts, token_file, name, tree = json.loads(sys.argv[1])
    group = px.WorkerGroup(SimPolicy, nodes=len(hosts),
                           backend=sim_backend(hosts, token_file, tree),
                           name=name, detached=True, detach_timeout=300, echo_output=False,
                           heartbeat_timeout=None, straggler_warning=None, start_timeout=600)
    group.call("step", 7)
    group.call_async("hang")
    time.sleep(0.5)
    print("running", flush=True)
    time.sleep(600)
""")


class SimPolicy:
    """A simulated rank's object (``--simulated``): state that must outlive its controller."""

    def __init__(self) -> None:
        self.step_seen = -1

    def step(self, i: int) -> int:
        self.step_seen = i
        return i

    def state(self) -> int:
        return self.step_seen

    def hang(self) -> object:
        from bench.simagents import NO_ANSWER

        return NO_ANSWER  # a call still running when the controller is killed


def sim_backend(hosts: list[str], token_file: str, tree: bool) -> Any:
    """The cluster backend of the simulated nodes, a tree or flat (their timeouts as
    bench.scale's: two CPUs shared by a thousand agents may leave one unscheduled for
    seconds)."""
    import phalanx as px
    from bench.scale import FANOUT

    return px.ClusterBackend(hosts, token_file=token_file,
                             tree_threshold=1 if tree else len(hosts) + 1, fanout=FANOUT,
                             heartbeat_timeout=120, quorum_timeout=120, node_timeout=120)


def _controller(script: str, argument: list[Any]) -> subprocess.Popen[str]:
    """A controller process running ``script`` (its argument as JSON), this checkout
    importable; its stdout read here."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, json.dumps(argument)],
                            stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)


def _kill_in_its_call(proc: subprocess.Popen[str]) -> float:
    """SIGKILL the controller ``proc`` once it says its call runs; when (perf_counter)."""
    try:
        if proc.stdout.readline() != "running\n":  # type: ignore[union-attr]
            raise RuntimeError("the controller did not start its call")
        killed = time.perf_counter()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def sim_trial(hosts: list[str], token_file: str, name: str, tree: bool) -> dict[str, Any]:
    import phalanx as px

    killed = _kill_in_its_call(_controller(SIM_CONTROLLER, [hosts, token_file, name, tree]))
    t0, c0 = time.perf_counter(), time.process_time()
    group = px.attach(name, backend=sim_backend(hosts, token_file, tree), echo_output=False,
                      start_timeout=600)
    attached, attach_cpu = time.perf_counter(), time.process_time() - c0
    try:
        states = group.call("state")
        first_call = time.perf_counter()
    finally:
        group.shutdown()
    return {"ranks": len(states), "attach_s": attached - t0, "attach_cpu_s": attach_cpu,
            "first_call_s": first_call - t0, "kill_to_first_call_s": first_call - killed,
            "state_kept": states == [7] * len(hosts)}


def simulated(args: argparse.Namespace) -> int:
    from bench.scale import SimCluster

    cluster = SimCluster(args.simulated)
    results = []
    try:
        for i in range(args.trials):
            result = sim_trial(cluster.hosts, cluster.token_file, f"bench-detach-sim-{i}",
                               not args.flat)
            results.append(result)
            print(f"trial {i}: {json.dumps(result)}", flush=True)
    finally:
        cluster.close()
    ok = all(r["state_kept"] and r["ranks"] == args.simulated for r in results)
    attach = median(r["attach_s"] for r in results)
    cpu = median(r["attach_cpu_s"] for r in results)
    first = median(r["first_call_s"] for r in results)
    shape = "flat" if args.flat else "tree"
    print(f"\nW17 {args.simulated} simulated nodes ({shape}): attach {attach:.2f} s "
          f"({cpu:.2f} s of the controller's CPU), attach to first call {first:.2f} s, "
          f"median of {len(results)}; every rank's state kept: {'yes' if ok else 'NO'}")
    print(f"  {'PASS' if first < 10.0 else 'FAIL'}  attach to first call < 10 s at "
          f"{args.simulated} nodes")
    write_json(args.json, {"benchmark": "detach", "simulated_nodes": args.simulated,
                           "shape": shape,
                           "trials": results, "attach_s": attach, "attach_cpu_s": cpu,
                           "first_call_s": first, "checks_ok": ok,
                           "machine": machine_info()}, [])
    print(f"JSON: {args.json}")
    return 0 if ok else 1


@contextmanager
def agents(count: int) -> Iterator[tuple[list[str], str]]:
    """``count`` agents on 127.0.0.2, .3, ...: their ``host:port`` and the token file."""
    from bench.shardsync import _agents

    with _agents([f"127.0.0.{i + 2}" for i in range(count)]) as hosts:
        yield hosts, _agents.token_file  # type: ignore[attr-defined]


def trial(hosts: list[str], token_file: str, per_node: int, name: str) -> dict[str, Any]:
    import phalanx as px

    proc = _controller(CONTROLLER, [hosts, token_file, name, per_node])
    started = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    killed = _kill_in_its_call(proc)
    t0 = time.perf_counter()
    group = px.attach(name, backend=px.ClusterBackend(hosts, token_file=token_file),
                      echo_output=False)
    attached = time.perf_counter()
    try:
        pids = group.call("pid")
        first_call = time.perf_counter()
        handles = group.kept()
        usable = sorted(float(h.get()[0]) for h in handles) == sorted(started["kept"])
        deadline = time.monotonic() + 30
        orphans = group.orphaned()
        while len(orphans) < len(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
            orphans = group.orphaned()
        # the weight sync: made again, at the ranks' version; its next push the one after
        t1 = time.perf_counter()
        generator = px.attach(name + "-gen", backend=px.ClusterBackend(
            hosts[-1:], token_file=token_file), echo_output=False)
        try:
            sync = px.weight_sync(group, generator)
            resumed_at = sync.version
            group.call("train", 3)
            pushed = sync.push("weights", "load").version
            sync_s = time.perf_counter() - t1
            sync_ok = (resumed_at == started["version"] == 2 and pushed == 3
                       and generator.call("held") == [3.0, 3.0])
            sync.close()
        finally:
            generator.shutdown()
    finally:
        group.shutdown()
    return {"ranks": len(pids), "attach_s": attached - t0, "first_call_s": first_call - t0,
            "sync_resumed": sync_ok, "sync_attach_and_push_s": sync_s,
            "kill_to_first_call_s": first_call - killed,
            "restarts": sum(a != b for a, b in zip(pids, started["pids"], strict=True)),
            "kept_usable": usable and len(handles) == len(pids),
            "orphans": sum(o.value == "slept" for o in orphans)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detach",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=16)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--simulated", type=int, default=0, metavar="NODES",
                        help="simulated nodes (bench.simagents) instead of real agents")
    parser.add_argument("--flat", action="store_true",
                        help="with --simulated: the controller connects to every node")
    args = parser.parse_args(argv)
    if args.simulated:
        if args.json == DEFAULT_JSON:
            args.json = DEFAULT_JSON.with_name(
                f"detach_simulated{'_flat' if args.flat else ''}.json")
        return simulated(args)
    results = []
    with agents(args.nodes) as (hosts, token_file):
        for i in range(args.trials):
            result = trial(hosts, token_file, args.per_node, f"bench-detach-{i}")
            results.append(result)
            print(f"trial {i}: {json.dumps(result)}", flush=True)
    ok = all(r["restarts"] == 0 and r["kept_usable"] and r["orphans"] == r["ranks"]
             and r["sync_resumed"] for r in results)
    attach = median(r["attach_s"] for r in results)
    first = median(r["first_call_s"] for r in results)
    total = median(r["kill_to_first_call_s"] for r in results)
    print(f"\nW17 {args.nodes} agents x {args.per_node} ranks: attach {attach:.2f} s, "
          f"attach to first call {first:.2f} s (kill to first call {total:.2f} s), median "
          f"of {len(results)}; restarts 0, kept usable, orphans reachable, the weight sync "
          f"carried on at its version: "
          f"{'yes' if ok else 'NO'}")
    print(f"  {'PASS' if first < 2.0 else 'FAIL'}  attach to first call < 2 s at "
          f"{args.nodes * args.per_node} ranks")
    write_json(args.json, {"benchmark": "detach", "nodes": args.nodes,
                           "per_node": args.per_node, "trials": results,
                           "attach_s": attach, "first_call_s": first,
                           "kill_to_first_call_s": total,
                           "checks_ok": ok, "machine": machine_info()}, [])
    print(f"JSON: {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
