"""Benchmark phalanx against a minimal pipe pool and ray (phalanx's Ray backend against raw
ray actors), side by side.

    python -m bench.run [--quick] [--json PATH] [--only W1,W2,...] [--no-ray] [--observed]

See bench/README.md for what each workload measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.contenders import Contender, make_contenders
from bench.measure import WORKLOADS, make_plan, stop_all, warm_up
from bench.util import (
    Errors,
    Row,
    clock,
    compile_sources,
    cpu_snapshot,
    describe,
    machine_info,
    new_descendants,
    other_cpu_share,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"
RAY_CPUS = 32  # 1 CPU per actor (phalanx-ray: per bundle); W2@16 holds 16 + 16 at once
RAY_WORKLOADS = ("W1", "W2", "W3", "W4", "W5")  # W6 counts our own descendants: not ray's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials (about a minute)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--only", default="", help="comma-separated workloads, e.g. W2,W3")
    parser.add_argument("--no-ray", action="store_true", help="leave ray out")
    parser.add_argument("--observed", action="store_true",
                        help="also phalanx traced and under a dashboard (W2, W3)")
    args = parser.parse_args(argv)
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    args.workloads = [w for w in WORKLOADS if not only or w in only]
    return args


def start_ray(errors: Errors) -> tuple[Any, dict[str, Any]]:
    """``(ray module or None, info)``; ray is optional: any failure just leaves it out."""
    info: dict[str, Any] = {}
    t0 = clock()
    try:
        import ray
    except Exception as exc:
        info["skipped"] = f"import ray failed: {type(exc).__name__}: {exc}"
        return None, info
    info["version"] = ray.__version__
    try:
        ray.init(
            address="local",  # a Ray of our own, never one already running on the machine
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except Exception as exc:
        errors.record("ray.init", "ray", exc)
        info["skipped"] = f"ray.init failed: {type(exc).__name__}: {exc}"
        return None, info
    info["init_s"] = clock() - t0
    return ray, info


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("phalanx").setLevel(logging.ERROR)  # W5's deaths are expected
    errors = Errors()
    machine = machine_info()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cpu_at_start = cpu_snapshot()
    before = set(p.pid for p in new_descendants(set()))
    want_ray = not args.no_ray and any(w in RAY_WORKLOADS for w in args.workloads)
    ray_info: dict[str, Any] = {"skipped": "--no-ray" if args.no_ray else "no ray workload"}
    plan = make_plan(args.quick)
    if args.observed:  # its targets compare phalanx with itself, a few percent apart: more
        # batches, for medians steadier than this machine's noise
        plan = dataclasses.replace(plan, w2_batches=plan.w2_batches * 3)
    names: list[str] = []
    rows: list[Row] = []
    timings: dict[str, float] = {}
    t_start = clock()
    # Phase 1: phalanx and the pipe pool, with no ray daemons running. Ray's gcs_server,
    # raylet and agents take a good part of a CPU for as long as ray runs; on a 2-core
    # machine that would tilt the phalanx-vs-pipe-pool comparison the targets are about.
    local = errors.attempt("setup", "all", lambda: make_contenders(False, args.observed)) or []
    names += [c.name for c in local]
    rows += run_phase(local, args.workloads, plan, errors, timings)
    cpu_at_end = cpu_snapshot()
    # Phase 2: Ray up; raw ray actors and phalanx's Ray backend, on the same workloads.
    if want_ray:
        ray, ray_info = start_ray(errors)
        if ray is not None:
            try:
                remote = errors.attempt("setup", "ray", lambda: make_contenders(True)) or []
                names += [c.name for c in remote]
                ray_workloads = [w for w in args.workloads if w in RAY_WORKLOADS]
                rows = merge_rows(rows, run_phase(remote, ray_workloads, plan, errors, timings))
            finally:
                errors.attempt("teardown", "ray", ray.shutdown)
    leftovers = leftover_processes(before)
    total = clock() - t_start

    results = report.evaluate(rows, names)
    print()
    print(report.table(rows, names, errors))
    print("\ntargets:")
    print(report.targets_text(results))
    if errors.items:
        print(f"\n{len(errors.items)} error(s):")
        for e in errors.items:
            print(f"  {e['workload']} / {e['contender']}: {e['error']}")
    other = other_cpu_share(cpu_at_start, cpu_at_end)
    if other > 0.1:
        print(
            f"\nnote: processes outside this run used {other:.0%} of one CPU meanwhile; "
            "they competed with the contenders, expect noisier numbers"
        )
    print(f"\nleftover processes after the run: {len(leftovers)}")
    for text in leftovers:
        print(f"  {text}")
    payload = {
        "timestamp": started_at,
        "finished_unix_time": time.time(),
        "machine": machine,
        "other_processes_cpu_share": other,
        "args": {"quick": args.quick, "only": args.workloads, "no_ray": args.no_ray,
                 "observed": args.observed},
        "plan": plan.__dict__,
        "contenders": names,
        "ray": ray_info,
        "seconds_per_workload": timings,
        "total_seconds": total,
        "targets": results,
        "errors": errors.items,
        "leftover_processes": leftovers,
    }
    report.write_json(args.json, payload, rows)
    print(f"\nJSON: {args.json}   (total {total:.0f} s)")
    return 1 if errors.items or leftovers else 0


def run_phase(
    contenders: list[Contender],
    workloads: list[str],
    plan: Any,
    errors: Errors,
    timings: dict[str, float],
) -> list[Row]:
    """Run ``workloads`` with ``contenders`` interleaved; stop them all at the end."""
    rows: list[Row] = []
    if not contenders:
        return rows
    label = ", ".join(c.name for c in contenders)
    try:
        progress(f"contenders: {label}; workloads: {', '.join(workloads)}")
        warm_up(contenders, errors)
        for name in workloads:
            t0 = clock()
            progress(f"{name} ({label}) ...")
            rows += WORKLOADS[name]([c for c in contenders if c.only is None or name in c.only],
                                    plan, errors)
            timings[f"{name} ({label})"] = clock() - t0
            progress(f"{name} done in {clock() - t0:.1f} s")
    finally:
        stop_all(contenders, errors, "teardown")
    return rows


def merge_rows(first: list[Row], second: list[Row]) -> list[Row]:
    """Rows of both phases, one per key, in the order of ``first``."""
    by_key = {row.key: row for row in first}
    merged = list(first)
    for row in second:
        if row.key in by_key:
            for contender, values in row.raw.items():
                by_key[row.key].raw.setdefault(contender, []).extend(values)
            extra = by_key[row.key].extra
            for name, value in row.extra.items():  # e.g. W2's calls_per_batch: keep both
                if isinstance(value, dict) and isinstance(extra.get(name), dict):
                    extra[name] = {**extra[name], **value}
                else:
                    extra[name] = value
        else:
            merged.append(row)
    return merged


def leftover_processes(before: set[int]) -> list[str]:
    """Processes this run started that are still alive; they are killed and reported."""
    deadline = time.monotonic() + 5.0  # ray.shutdown's processes take a moment to exit
    while True:
        left = [p for p in new_descendants(set()) if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    text = describe(left)
    for proc in left:
        try:
            proc.kill()
        except Exception:
            pass
    return text


def main(argv: list[str] | None = None) -> None:
    compile_sources()
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
