"""W14: several groups in one job, on each backend (local, Ray, agents).

- **start**: one 4-rank group, against two 2-rank groups colocated on one
  ``px.ResourcePool(procs_per_node=2, colocate=2)`` started one after the other (the pool's
  reservation included in the time, and apart);
- **slice**: no-op call latency on a ``{"dp": 2, "tp": 2}`` group: ``group.slice(dp=0)``
  against the group's own call on the same ranks (``workers=[0, 1]``), and
  ``group.slice(dp=range(2))`` against the whole group; the ratios are what a slice costs.

    python -m bench.groups [--quick] [--json PATH] [--backends local,ray,cluster]

Ray runs a local Ray of its own (``ray.init(address="local")``); the agents are four
``phalanx agent`` processes on loopback addresses (:class:`bench.cluster._Agents`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench.util import Row, clock, compile_sources, settle

BACKENDS = ("local", "ray", "cluster")
CALLS = 400  # no-op calls per latency trial
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "groups.json"


def _start(backend: Any, trials: int) -> dict[str, list[float]]:
    import phalanx as px
    from bench.workloads import Bench

    times: dict[str, list[float]] = {"one 4-rank group": [], "two colocated 2-rank groups": [],
                                     "  of which the pool": []}
    for _ in range(trials):
        settle()
        began = clock()
        group = px.WorkerGroup(Bench, procs_per_node=4, backend=backend, echo_output=False)
        group.call("noop")
        times["one 4-rank group"].append(clock() - began)
        group.shutdown()
        settle()
        began = clock()
        with px.ResourcePool(procs_per_node=2, colocate=2, backend=backend) as pool:
            reserved = clock()
            groups = [px.WorkerGroup(Bench, pool=pool, echo_output=False) for _ in range(2)]
            for g in groups:
                g.call("noop")
            times["two colocated 2-rank groups"].append(clock() - began)
            times["  of which the pool"].append(reserved - began)
            for g in groups:
                g.shutdown()
    return times


def _latency(call: Any, calls: int) -> float:
    began = clock()
    for _ in range(calls):
        call()
    return (clock() - began) / calls * 1e6


def _slices(backend: Any, trials: int) -> dict[str, list[float]]:
    import phalanx as px
    from bench.workloads import Bench

    out: dict[str, list[float]] = {k: [] for k in (
        "group, ranks 0-1", "slice(dp=0)", "whole group", "slice(dp=range(2))")}
    with px.WorkerGroup(Bench, procs_per_node=4, mesh={"dp": 2, "tp": 2}, backend=backend,
                        echo_output=False) as group:
        part, whole = group.slice(dp=0), group.slice(dp=range(2))
        ways = {"group, ranks 0-1": lambda: group.call("noop", workers=[0, 1]),
                "slice(dp=0)": lambda: part.call("noop"),
                "whole group": lambda: group.call("noop"),
                "slice(dp=range(2))": lambda: whole.call("noop")}
        for way in ways.values():
            _latency(way, CALLS // 4)  # warm
        for trial in range(trials):
            order = list(ways) if trial % 2 == 0 else list(reversed(ways))
            for name in order:
                out[name].append(_latency(ways[name], CALLS))
    return out


def _backend(name: str, agents: Any) -> Any:
    if name == "cluster":
        return agents.backend(1)
    return name


def main(argv: list[str] | None = None) -> int:
    compile_sources()
    parser = argparse.ArgumentParser(prog="python -m bench.groups",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args(argv)
    names = [b for b in args.backends.split(",") if b]
    trials = 3 if args.quick else 7
    rows: list[Row] = []
    agents = None
    try:
        if "ray" in names:
            import ray

            ray.init(address="local", num_cpus=8, include_dashboard=False,
                     log_to_driver=False)
        if "cluster" in names:
            from bench.cluster import _Agents

            agents = _Agents().__enter__()
        by_key: dict[str, Row] = {}

        def row(key: str, label: str, unit: str) -> Row:
            if key not in by_key:
                by_key[key] = Row(key, label, unit, "lower")
                rows.append(by_key[key])
            return by_key[key]

        for name in names:
            print(f"W14 on {name} ...", file=sys.stderr, flush=True)
            backend = _backend(name, agents)
            for label, values in _start(backend, trials).items():
                row(f"W14.start.{label.strip()}", f"W14 start, {label}", "s").raw[name] = values
            lat = _slices(backend, trials)
            for label, values in lat.items():
                row(f"W14.call.{label}", f"W14 no-op call, {label}",
                    "us/call").raw[name] = values
            for a, b in (("slice(dp=0)", "group, ranks 0-1"),
                         ("slice(dp=range(2))", "whole group")):
                row(f"W14.slice_ratio.{a}", f"W14 {a} / {b}", "x").raw[name] = [
                    median(lat[a]) / median(lat[b])]
    finally:
        if agents is not None:
            agents.__exit__()
        if "ray" in names:
            import ray

            ray.shutdown()
    width = max(len(r.label) for r in rows)
    print(f"{'workload':<{width}}  {'unit':<8}  " + "  ".join(f"{n:>9}" for n in names))
    for row in rows:
        cells = [row.value(n) for n in names]
        print(f"{row.label:<{width}}  {row.unit:<8}  " + "  ".join(
            f"{'-':>9}" if v is None else f"{v:>9.3f}" for v in cells))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "finished_unix_time": time.time(), "trials": trials,
        "rows": [{"key": r.key, "label": r.label, "unit": r.unit,
                  "values": {n: r.value(n) for n in r.raw}, "raw": r.raw} for r in rows],
    }, indent=1))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
