"""What users pay, in one run: the call path, rank start-up with torch, and results handed
between groups -- the three suites one after the other, and their goals in one table.

    python -m bench.goals [--quick] [--json PATH] [--no-ray] [--no-torch]

Runs ``bench.run --only W1,W2,W3,W4,W5`` (the local backend against the pipe pool, phalanx on
Ray against raw Ray actors), ``bench.torchstart`` (W1t at 4 and 16 ranks; skipped without
torch) and ``bench.handoff --only W11 --soak 0`` in turn, each in a process of its own with
its own JSON (next to this run's), and prints every goal the three judged, then the
controller's CPU time per call beside each wall-clock ratio of W2 and W3 (CPU time is the
cost itself; a wall ratio moves with the machine). Exit status 1 when a suite failed or a
goal did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.util import machine_info

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "goals.json"
ROOT = Path(__file__).resolve().parent.parent
SUITE_TIMEOUT = 1800.0  # seconds a suite may take (the torch start-up one: ~8 min on 2 cores)


def _suites(args: argparse.Namespace, json_dir: Path) -> list[tuple[str, list[str], Path]]:
    """``(name, command, its JSON)`` of each suite of this run."""
    quick = ["--quick"] if args.quick else []
    no_ray = ["--no-ray"] if args.no_ray else []
    suites = [("call path and Ray (bench.run)",
               ["-m", "bench.run", "--only", "W1,W2,W3,W4,W5", *quick, *no_ray],
               json_dir / "goals-run.json")]
    if not args.no_torch:
        trials = ["--trials", "1"] if args.quick else []
        suites.append(("start-up with torch (bench.torchstart)",
                       ["-m", "bench.torchstart", "--sizes", "4,16", *trials],
                       json_dir / "goals-torchstart.json"))
    suites.append(("results between groups (bench.handoff)",
                   ["-m", "bench.handoff", "--only", "W11", "--soak", "0", *quick, *no_ray],
                   json_dir / "goals-handoff.json"))
    return [(name, [sys.executable, *argv, "--json", str(path)], path)
            for name, argv, path in suites]


def verdicts(name: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A suite's judged goals as ``{suite, goal, verdict, measured}`` (bench.run's
    ``targets``, bench.torchstart's ``goals``, bench.handoff's ``targets``)."""
    out = []
    for t in payload.get("targets", payload.get("goals", [])):
        verdict = t.get("verdict", t.get("result"))
        if verdict == "SKIP":
            continue
        out.append({"suite": name, "goal": t.get("name", t.get("target")),
                    "verdict": verdict, "measured": t.get("measured"),
                    "measure": t.get("measure")})
    return out


def cpu_beside_wall(payload: dict[str, Any]) -> list[str]:
    """W2 and W3: the wall-clock ratio of phalanx to its base, and beside it the
    controller's CPU time per call of each."""
    rows = {row["key"]: row["values"] for row in payload.get("rows", [])}
    lines = []
    for wall_key, cpu_key, what in (("W2.noop.4", "W2.cpu.4", "W2@4 latency"),
                                    ("W2.noop.1", "W2.cpu.1", "W2@1 latency"),
                                    ("W3.pipelined", "W3.cpu", "W3 throughput")):
        wall, cpu = rows.get(wall_key), rows.get(cpu_key)
        if not wall or not cpu:
            continue
        for subject, base in (("phalanx", "pipe_pool"), ("phalanx-ray", "ray")):
            if None in (wall.get(subject), wall.get(base), cpu.get(subject), cpu.get(base)):
                continue
            lines.append(f"  {what:<14} {subject:>11} / {base:<9}  wall "
                         f"{wall[subject] / wall[base]:5.2f}x   CPU per call "
                         f"{cpu[subject]:8.2f} us / {cpu[base]:8.2f} us = "
                         f"{cpu[subject] / cpu[base]:5.2f}x")
    return lines


def _shown(goal: dict[str, Any]) -> str:
    measured = goal["measured"]
    if measured is None:
        return ""
    return f"{measured:.2f}x" if goal.get("measure") == "ratio" else f"{measured:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goals",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each suite's --quick")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    parser.add_argument("--no-torch", action="store_true", help="leave W1t out")
    args = parser.parse_args(argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    goals: list[dict[str, Any]] = []
    failures: list[str] = []
    cpu_lines: list[str] = []
    seconds: dict[str, float] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for name, command, path in _suites(args, args.json.parent):
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
        path.unlink(missing_ok=True)
        started = time.monotonic()
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, timeout=SUITE_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            code = None
        seconds[name] = time.monotonic() - started
        if code != 0:
            failures.append(f"{name}: " + ("timed out" if code is None else f"exit status {code}"))
        if not path.exists():
            failures.append(f"{name}: wrote no results")
            continue
        payload = json.loads(path.read_text())
        goals += verdicts(name, payload)
        if "rows" in payload and name.endswith("(bench.run)"):
            cpu_lines = cpu_beside_wall(payload)
    print(f"\n=== Goals, one run ({time.monotonic() - began:.0f} s)")
    width = max((len(g["goal"]) for g in goals), default=0)
    for goal in goals:
        print(f"  {goal['verdict']:<4}  {goal['goal']:<{width}}  {_shown(goal)}")
    if cpu_lines:
        print("\nThe controller's CPU time per call beside the wall-clock ratios")
        print("\n".join(cpu_lines))
    for failure in failures:
        print(f"error: {failure}")
    failed = [g for g in goals if g["verdict"] == "FAIL"]
    args.json.write_text(json.dumps({
        "finished_unix_time": time.time(), "machine": machine_info(),
        "load_avg_at_end": os.getloadavg(), "suite_seconds": seconds, "goals": goals,
        "cpu_beside_wall": cpu_lines, "failures": failures}, indent=1) + "\n")
    print(f"\n{len(goals) - len(failed)} of {len(goals)} goals met; JSON: {args.json}")
    return 1 if failures or failed else 0


if __name__ == "__main__":
    sys.exit(main())
