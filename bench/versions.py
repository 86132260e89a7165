"""W2 and W3 of two versions of phalanx, alternately, in one run: a change's cost on the
call path, measured against the commit before it on the same machine at the same time.

    python -m bench.versions --old REV [--new PATH] [--batches 9] [--json PATH]
    python -m bench.versions --old REV --backend cluster   # W2 and W9 on node agents

``--old`` is a git revision (checked out into a temporary worktree) or a directory holding
a phalanx tree; ``--new`` defaults to this checkout. Each version runs in a process of its
own (its ``phalanx`` first on ``sys.path``) holding a group of 4 ranks (W2: one no-op call
fanned out to all 4) and a group of 1 (W3: 20,000 pipelined no-ops), both on the local
backend, built only with the public API so that any two versions compare. The driver asks
them in turn, batch by batch, the order swapping every batch, so that whatever else the
machine does lands on both alike. Prints a table and writes JSON.

With ``--backend cluster`` each version's process starts two ``phalanx agent`` of its own
(127.0.0.2 and 127.0.0.3, a private token file) and measures, on 2 agents x 2 ranks, W2
(one no-op call fanned out to the 4 ranks) and W9's broadcast (a 64 MiB float64 array
sent to every rank: it crosses to each node once), as each node's bandwidth: 64 MiB over
the call's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.util import machine_info, median, settle

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "bench" / "results" / "versions.json"

# The process serving one version: reads commands on stdin, answers seconds on stdout.
_SERVER = r'''
import sys, time
import phalanx as px

class Bench:
    def noop(self):
        return None

fanout = px.WorkerGroup(Bench, procs_per_node=4, echo_output=False)
single = px.WorkerGroup(Bench, procs_per_node=1, echo_output=False)
for _ in range(300):
    fanout.call("noop")
for f in [single.call_async("noop", workers=[0]) for _ in range(2000)]:
    f.result()
print("ready", px.__file__, flush=True)
for line in sys.stdin:
    kind, count = line.split()
    count = int(count)
    if kind == "w2":
        call = fanout.call
        t0 = time.perf_counter()
        for _ in range(count):
            call("noop")
    elif kind == "w3":
        t0 = time.perf_counter()
        futures = [single.call_async("noop", workers=[0]) for _ in range(count)]
        for f in futures:
            f.result()
    else:
        break
    print(time.perf_counter() - t0, flush=True)
fanout.shutdown()
single.shutdown()
'''

# The same for the cluster backend: two agents of this version's own, a group of 2 x 2.
_CLUSTER_SERVER = r'''
import os, secrets, socket, subprocess, sys, tempfile, time
import numpy as np
import phalanx as px

class Bench:
    def noop(self):
        return None

    def array_sum(self, array):
        return float(array.sum())

def free_port(host):
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

directory = tempfile.mkdtemp(prefix="phalanx-versions-")
token_file = os.path.join(directory, "token")
with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(secrets.token_urlsafe(32))
agents, addresses = [], []
for host in ("127.0.0.2", "127.0.0.3"):
    port = free_port(host)
    agents.append(subprocess.Popen(
        [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
         "--token-file", token_file], stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    addresses.append(f"{host}:{port}")
deadline = time.monotonic() + 60
for address in addresses:
    host, port = address.split(":")
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
array = np.ones(64 * (1 << 20) // 8)
try:
    group = px.WorkerGroup(Bench, nodes=2, procs_per_node=2, echo_output=False,
                           backend=px.ClusterBackend(addresses, token_file=token_file))
    for _ in range(300):
        group.call("noop")
    group.call("array_sum", array)
    print("ready", px.__file__, flush=True)
    for line in sys.stdin:
        kind, count = line.split()
        count = int(count)
        if kind == "w2":
            call = group.call
            t0 = time.perf_counter()
            for _ in range(count):
                call("noop")
        elif kind == "w9":
            t0 = time.perf_counter()
            for _ in range(count):
                group.call("array_sum", array)
        else:
            break
        print(time.perf_counter() - t0, flush=True)
    group.shutdown()
finally:
    for agent in agents:
        agent.terminate()
    for agent in agents:
        agent.wait(30)
    os.unlink(token_file)
    os.rmdir(directory)
'''
BROADCAST_MIB = 64


class Version:
    """One version's serving process."""

    def __init__(self, name: str, tree: Path, server: str = _SERVER) -> None:
        self.name, self.tree = name, tree
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", server], cwd=tree, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        ready = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        if not ready or ready[0] != "ready":
            raise RuntimeError(f"the {name} version ({tree}) did not start")
        self.module = ready[1]

    def run(self, kind: str, count: int) -> float:
        self.proc.stdin.write(f"{kind} {count}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return float(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit 0\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _tree(spec: str, scratch: Path) -> Path:
    """A directory holding a phalanx tree: ``spec`` itself, or a worktree of revision ``spec``."""
    if Path(spec, "phalanx", "__init__.py").is_file():
        return Path(spec).resolve()
    where = scratch / "old"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), spec],
                   check=True, capture_output=True)
    return where


def measure(versions: list[Version], batches: int, w2_calls: int, w3_calls: int,
            cluster: bool = False) -> dict:
    """Per version: W2 in us/call, then W3 in calls/s (or, on the cluster, W9 in MiB/s a
    node: one 64 MiB broadcast per sample, ``w3_calls`` ignored)."""
    other = "W9" if cluster else "W3"
    raw: dict[str, dict[str, list[float]]] = {v.name: {"W2": [], other: []} for v in versions}
    for batch in range(batches):
        order = versions if batch % 2 == 0 else versions[::-1]
        for v in order:
            settle()
            raw[v.name]["W2"].append(v.run("w2", w2_calls) / w2_calls * 1e6)
        for v in order:
            settle()
            if cluster:
                raw[v.name]["W9"].append(BROADCAST_MIB / v.run("w9", 1))
            else:
                raw[v.name]["W3"].append(w3_calls / v.run("w3", w3_calls))
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versions",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="git revision or phalanx tree")
    parser.add_argument("--new", default=str(REPO), help="phalanx tree (default: this one)")
    parser.add_argument("--batches", type=int, default=9)
    parser.add_argument("--w2-calls", type=int, default=500)
    parser.add_argument("--w3-calls", type=int, default=20_000)
    parser.add_argument("--backend", choices=("local", "cluster"), default="local")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    cluster = args.backend == "cluster"
    server = _CLUSTER_SERVER if cluster else _SERVER
    with tempfile.TemporaryDirectory(prefix="phalanx-versions-") as scratch:
        old_tree = _tree(args.old, Path(scratch))
        versions: list[Version] = []
        try:
            versions = [Version("old", old_tree, server),
                        Version("new", Path(args.new).resolve(), server)]
            raw = measure(versions, args.batches, args.w2_calls, args.w3_calls, cluster)
        finally:
            for v in versions:
                v.close()
            if old_tree.parent == Path(scratch):
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(old_tree)], check=False, capture_output=True)
    result: dict[str, Any] = {
        "old": args.old, "new": args.new, "backend": args.backend, "batches": args.batches,
        "w2_calls": args.w2_calls, "w3_calls": args.w3_calls, "raw": raw,
        "machine": machine_info(),
    }
    w2 = {name: median(r["W2"]) for name, r in raw.items()}
    if cluster:
        other, other_key = "W9", "W9.bcast_64MiB_MiB_per_s_per_node"
        rows = [("W2 no-op fan-out, 2x2 (us/call)", w2, "{:>12.1f}"),
                ("W9 64 MiB, MiB/s a node", None, "{:>12,.0f}")]
    else:
        other, other_key = "W3", "W3.pipelined_calls_per_s"
        rows = [("W2 no-op fan-out to 4 (us/call)", w2, "{:>12.1f}"),
                ("W3 pipelined to 1 (calls/s)", None, "{:>12,.0f}")]
    second = {name: median(r[other]) for name, r in raw.items()}
    result["median"] = {"W2.noop.4_us": w2, other_key: second}
    print(f"{'workload':<34}{'old':>12}{'new':>12}{'new/old':>10}")
    for label, values, number in rows:
        values = values if values is not None else second
        print(f"{label:<34}" + number.format(values["old"]) + number.format(values["new"])
              + f"{values['new'] / values['old']:>10.3f}")
    for name in ("W2", other):
        spread = {v: (min(r[name]), max(r[name])) for v, r in raw.items()}
        print(f"  {name} range: " + ", ".join(f"{v} {lo:,.1f}..{hi:,.1f}"
                                              for v, (lo, hi) in spread.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
