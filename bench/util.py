"""Small helpers shared by the benchmark modules: statistics, ordering, process bookkeeping."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil

T = TypeVar("T")

clock = time.perf_counter
SETTLE_S = 0.1  # pause before each timed section (see settle())


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def trial_order(items: Sequence[T], trial: int) -> list[T]:
    """The order of ``items`` in trial ``trial``: cycles through every permutation (up to 4
    items; rotations beyond), so that no contender always goes first, nor always runs right
    after the same neighbour (whose after-effects, e.g. ray's background threads, would
    then always land on it)."""
    if len(items) <= 4:
        orders = list(itertools.permutations(items))
        return list(orders[trial % len(orders)])
    shift = trial % len(items)
    return [*items[shift:], *items[:shift]]


def reap(procs: Sequence[Any], timeout: float = 15.0) -> None:
    """Wait for each of ``procs`` (asked to end already) up to ``timeout`` s, then kill it."""
    import subprocess

    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def settle() -> None:
    """Collect garbage and pause briefly before a timed section, so that the previous
    contender's leftovers (garbage, ray's flushes) are not charged to the next one."""
    gc.collect()
    time.sleep(SETTLE_S)


def run_reported(errors: list[str], where: str, fn: Callable[[], None]) -> None:
    """Run one part of a benchmark: an exception it raises is reported (its first line, in
    ``errors`` and on stderr, named ``where``) and the run goes on with the next part."""
    try:
        fn()
    except Exception as exc:  # reported; the run goes on
        text = f"{where}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        errors.append(text)
        print(f"  ! {text}", file=sys.stderr, flush=True)


def rss_mib() -> float:
    """This process's resident memory in MiB, after collecting garbage."""
    gc.collect()
    return psutil.Process().memory_info().rss / (1 << 20)


def alternate_rounds(ways: dict[str, Callable[[int], Any]], rounds: int,
                     out: dict[str, dict[str, Any]],
                     check: Callable[[str, Any, int], None]) -> None:
    """One warm-up round per way, then ``rounds`` rounds, ways alternating round by round
    (order cycling through the permutations), each round's answer given to ``check(way,
    answer, round)``; into ``out[way]``: each round's seconds (``round_s``) and the
    controller's RSS change across it, after gc (``rss_delta_mib``)."""
    for name, way in ways.items():
        check(name, way(0), 0)
    for round_ in range(1, rounds + 1):
        for name in trial_order(list(ways), round_):
            settle()
            before = rss_mib()
            began = clock()
            answer = ways[name](round_)
            took = clock() - began
            check(name, answer, round_)
            rec = out.setdefault(name, {"round_s": [], "rss_delta_mib": []})
            rec["round_s"].append(took)
            rec["rss_delta_mib"].append(rss_mib() - before)


@dataclasses.dataclass
class Row:
    """One line of the results table: a measure of one workload for every contender."""

    key: str  # stable id, e.g. "W2.noop.4"; the targets refer to it
    label: str
    unit: str
    better: str  # "lower" or "higher"
    raw: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    agg: str = "median"  # how raw values become the reported one: "median" or "max"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def value(self, contender: str) -> float | None:
        values = self.raw.get(contender)
        if not values:
            return None
        return max(values) if self.agg == "max" else median(values)

    def add(self, contender: str, value: float) -> None:
        self.raw.setdefault(contender, []).append(value)


class Errors:
    """Collects failures so that one broken contender does not stop the run."""

    def __init__(self) -> None:
        self.items: list[dict[str, str]] = []

    def attempt(self, where: str, contender: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:
            self.record(where, contender, exc)
            return None

    def record(self, where: str, contender: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self.items.append({"workload": where, "contender": contender, "error": text})
        print(f"  ! {where} / {contender}: {text}", file=sys.stderr, flush=True)


# -- processes ----------------------------------------------------------------------------


def descendants(recursive: bool = True) -> dict[int, psutil.Process]:
    """Every live descendant (or child) of this process, by pid."""
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=recursive)}
    except psutil.Error:
        return {}


def new_descendants(before: set[int]) -> list[psutil.Process]:
    """Children of this process not in ``before``, with all their descendants.

    Processes that pre-existing children start meanwhile (ray's raylet starting workers)
    are not counted; nor is multiprocessing's resource tracker (see :func:`is_mp_helper`).
    """
    found = []
    for child in descendants(recursive=False).values():
        if child.pid in before or is_mp_helper(child):
            continue
        found.append(child)
        try:
            found.extend(child.children(recursive=True))
        except psutil.Error:
            pass
    return found


def still_running(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still exist (zombies included: they were not reaped).

    ``is_running`` compares creation times, so a recycled pid does not count.
    """
    alive = []
    for proc in procs:
        try:
            if proc.is_running():
                alive.append(proc)
        except psutil.Error:
            pass
    return alive


def describe(procs: Sequence[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} {proc.status()} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{proc.pid} (gone)")
    return out


def is_mp_helper(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per interpreter, started by the first spawn
    and ended when this interpreter exits; not a worker that anyone left behind."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall clock, CPU seconds the whole machine has been busy, CPU seconds of this run:
    this process, the children it reaped, and every live descendant with what it reaped)."""
    machine = psutil.cpu_times()
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    own = os.times()
    ours = own.user + own.system + own.children_user + own.children_system
    for proc in descendants().values():
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        ours += t.user + t.system + t.children_user + t.children_system
    return clock(), busy, ours


def other_cpu_share(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """The share of one CPU that processes outside this run used between two snapshots."""
    if end[0] <= start[0]:
        return 0.0
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def compile_sources() -> None:
    """Byte-compile phalanx and bench, as pip does for a phalanx it installs: with an
    editable install where PYTHONDONTWRITEBYTECODE is set, every rank, warden and Ray
    worker would compile them from source, and the start-up workloads would time that."""
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("phalanx", "bench"):
        compileall.compile_dir(os.path.join(root, name), quiet=1, workers=0)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }
    info["load_avg_at_start"] = os.getloadavg()
    return info
