"""W2 and W3 of two versions of phalanx, alternately, in one run: a change's cost on the
call path, measured against the commit before it on the same machine at the same time.

    python -m bench.versions --old REV [--new PATH] [--batches 9] [--json PATH]

``--old`` is a git revision (checked out into a temporary worktree) or a directory holding
a phalanx tree; ``--new`` defaults to this checkout. Each version runs in a process of its
own (its ``phalanx`` first on ``sys.path``) holding a group of 4 ranks (W2: one no-op call
fanned out to all 4) and a group of 1 (W3: 20,000 pipelined no-ops), both on the local
backend, built only with the public API so that any two versions compare. The driver asks
them in turn, batch by batch, the order swapping every batch, so that whatever else the
machine does lands on both alike. Prints a table and writes JSON.
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


class Version:
    """One version's serving process."""

    def __init__(self, name: str, tree: Path) -> None:
        self.name, self.tree = name, tree
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], cwd=tree, env=env, text=True,
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


def measure(versions: list[Version], batches: int, w2_calls: int, w3_calls: int) -> dict:
    raw: dict[str, dict[str, list[float]]] = {v.name: {"W2": [], "W3": []} for v in versions}
    for batch in range(batches):
        order = versions if batch % 2 == 0 else versions[::-1]
        for v in order:
            settle()
            raw[v.name]["W2"].append(v.run("w2", w2_calls) / w2_calls * 1e6)
        for v in order:
            settle()
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
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="phalanx-versions-") as scratch:
        old_tree = _tree(args.old, Path(scratch))
        versions: list[Version] = []
        try:
            versions = [Version("old", old_tree), Version("new", Path(args.new).resolve())]
            raw = measure(versions, args.batches, args.w2_calls, args.w3_calls)
        finally:
            for v in versions:
                v.close()
            if old_tree.parent == Path(scratch):
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(old_tree)], check=False, capture_output=True)
    result: dict[str, Any] = {
        "old": args.old, "new": args.new, "batches": args.batches,
        "w2_calls": args.w2_calls, "w3_calls": args.w3_calls, "raw": raw,
        "machine": machine_info(),
    }
    w2 = {name: median(r["W2"]) for name, r in raw.items()}
    w3 = {name: median(r["W3"]) for name, r in raw.items()}
    result["median"] = {"W2.noop.4_us": w2, "W3.pipelined_calls_per_s": w3}
    print(f"{'workload':<34}{'old':>12}{'new':>12}{'new/old':>10}")
    print(f"{'W2 no-op fan-out to 4 (us/call)':<34}{w2['old']:>12.1f}{w2['new']:>12.1f}"
          f"{w2['new'] / w2['old']:>10.3f}")
    print(f"{'W3 pipelined to 1 (calls/s)':<34}{w3['old']:>12,.0f}{w3['new']:>12,.0f}"
          f"{w3['new'] / w3['old']:>10.3f}")
    for name in ("W2", "W3"):
        spread = {v: (min(r[name]), max(r[name])) for v, r in raw.items()}
        print(f"  {name} range: " + ", ".join(f"{v} {lo:,.1f}..{hi:,.1f}"
                                              for v, (lo, hi) in spread.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
