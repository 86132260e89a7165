"""The workloads W1-W6. Each runs every contender side by side: trials (W2: batches) are
interleaved, in an order that changes from trial to trial (:func:`bench.util.trial_order`),
and each timed section is preceded by :func:`bench.util.settle`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from bench.cluster import w9_cluster
from bench.cold import COLD, fresh_start
from bench.contenders import RAY_NAMES, Contender
from bench.launcher import w8_launcher
from bench.sharded import w7_sharded
from bench.util import (
    Errors,
    Row,
    clock,
    descendants,
    describe,
    new_descendants,
    settle,
    still_running,
    trial_order,
)

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Plan:
    """How many trials of what; ``ray`` and ``phalanx-ray`` trials (``*_ray_trials``) are
    fewer because each takes much longer."""

    quick: bool
    w1_trials: dict[int, int]  # workers -> trials
    w1_ray_trials: dict[int, int]
    w2_sizes: tuple[int, ...] = (1, 4, 16)
    w2_batches: int = 15  # a 2-core VM's batches spread by +-15%: enough for a steady median
    w2_calls: int = 500  # per batch (fewer for a contender that would take over the budget)
    w2_batch_budget_s: float = 1.0
    w2_warmup_s: float = 0.5
    w3_calls: int = 20_000
    w3_trials: int = 9  # W3 is bimodal on a 2-core VM (CPU placement): more trials, steadier median
    w3_ray_trials: int = 3
    w4_mib: int = 64
    w4_workers: int = 4
    w4_trials: int = 5
    w4_ray_trials: int = 5  # one Ray call of 64 MiB spreads 0.03-0.08 s: 3 flip its goal
    w4_big: tuple[int, int] = (256, 16)  # MiB, workers: how W4 grows
    w5_workers: int = 4
    w5_trials: int = 15  # bimodal (where the dying rank's last thread runs): as W3
    w5_ray_trials: int = 5
    w6_workers: int = 4
    w6_trials: int = 3


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan(
            quick=True, w1_trials={4: 3, 16: 2}, w1_ray_trials={4: 2, 16: 1},
            w2_batches=5, w2_calls=200, w2_batch_budget_s=0.3, w2_warmup_s=0.2,
            w3_trials=3, w3_ray_trials=1, w4_trials=3, w4_ray_trials=2,
            w5_trials=4, w5_ray_trials=2, w6_trials=1,
        )  # fmt: skip
    return Plan(quick=False, w1_trials={4: 7, 16: 3}, w1_ray_trials={4: 3, 16: 2})


def _schedule(contenders: Sequence[Contender], trials: int, ray_trials: int | None = None):
    """(trial, contender) pairs: trial by trial, in an order that changes; ray and
    phalanx-ray run ``ray_trials`` trials (default: as many as the others)."""
    counts = {
        c.name: ray_trials if c.name in RAY_NAMES and ray_trials is not None else trials
        for c in contenders
    }
    for trial in range(max(counts.values(), default=0)):
        active = [c for c in contenders if trial < counts[c.name]]
        yield from ((trial, c) for c in trial_order(active, trial))


def start_all(
    contenders: Sequence[Contender], n: int, errors: Errors, where: str
) -> list[Contender]:
    started = []
    for c in contenders:
        if errors.attempt(where, c.name, lambda c=c: c.start(n) or True):
            started.append(c)
        elif c.running():
            errors.attempt(where, c.name, c.stop)
    return started


def stop_all(contenders: Sequence[Contender], errors: Errors, where: str) -> None:
    for c in contenders:
        if c.running():
            errors.attempt(where, c.name, c.stop)


def warm_up(contenders: Sequence[Contender], errors: Errors) -> None:
    """One untimed start and stop each: imports, helper threads and processes (the spawn
    thread, multiprocessing's resource tracker, ray's worker pool) exist before W1 times."""
    stop_all(start_all(contenders, 1, errors, "warm-up"), errors, "warm-up")


def w1_startup(contenders: Sequence[Contender], plan: Plan, errors: Errors, *,
               fresh: bool = False) -> list[Row]:
    """Start-up and teardown in this process (phalanx imported already) at each size; with
    ``fresh`` (``bench.run``'s W1), then for phalanx and pipe_pool start to ready from a
    fresh process (``W1.cold.N``, :func:`bench.cold.fresh_start`). ``bench.versions``
    calls it without: two rows a size, this process's contenders only."""
    rows = []
    cold = [c for c in contenders if c.name in COLD] if fresh else []
    cold_failed = _cold_warm_up(cold, errors) if cold else set()
    for n in sorted(plan.w1_trials):
        start = Row(f"W1.startup.{n}", f"W1 startup to ready, {n} workers", "s", "lower")
        stop = Row(f"W1.teardown.{n}", f"W1 teardown, {n} workers", "s", "lower")
        failed: set[str] = set()
        for _, c in _schedule(contenders, plan.w1_trials[n], plan.w1_ray_trials[n]):
            if c.name in failed:
                continue
            settle()
            t0 = clock()
            try:
                c.start(n)
                t1 = clock()
                c.stop()
                t2 = clock()
            except Exception as exc:
                errors.record(f"W1@{n}", c.name, exc)
                failed.add(c.name)
                stop_all([c], errors, f"W1@{n}")
                continue
            start.add(c.name, t1 - t0)
            stop.add(c.name, t2 - t1)
        rows += [start, stop]
        if cold:
            rows.append(_w1_cold(cold, n, plan, errors, cold_failed))
    return rows


def _cold_warm_up(contenders: Sequence[Contender], errors: Errors) -> set[str]:
    """One untimed fresh-process trial (1 worker) each, so that the first timed one does not
    read the contender's files from disk; the names of those that failed."""
    failed = set()
    for c in contenders:
        settle()
        where = "W1@1 fresh process (warm-up)"
        found = errors.attempt(where, c.name, partial(fresh_start, c.name, 1))
        if found is None:
            failed.add(c.name)
        elif found["left"]:
            errors.record(where, c.name, RuntimeError(f"left behind: {found['left']}"))
    return failed


def _w1_cold(contenders: Sequence[Contender], n: int, plan: Plan, errors: Errors,
             failed: set[str]) -> Row:
    """``W1.cold.N``: a fresh interpreter per trial, from its first statement to ready; the
    import and start parts, the teardown, the child process's whole life as seen from
    here and any process it left behind in ``extra``. ``failed`` (names) is updated."""
    row = Row(f"W1.cold.{n}", f"W1 fresh process: start to ready, {n} workers", "s", "lower")
    parts = ("import_s", "start_s", "stop_s", "process_s")
    row.extra = {part: {} for part in (*parts, "left_behind")}
    where = f"W1@{n} fresh process"
    for _, c in _schedule(contenders, plan.w1_trials[n]):
        if c.name in failed:
            continue
        settle()
        found = errors.attempt(where, c.name, partial(fresh_start, c.name, n))
        if found is None:
            failed.add(c.name)
            continue
        row.add(c.name, found["ready_s"])
        for part in parts:
            row.extra[part].setdefault(c.name, []).append(found[part])
        if found["left"]:
            row.extra["left_behind"].setdefault(c.name, []).extend(found["left"])
            errors.record(where, c.name, RuntimeError(f"left behind: {found['left']}"))
    return row


def _run_batch(c: Contender, calls: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, all its threads) for ``calls`` no-ops."""
    noop = c.noop
    c0, t0 = time.process_time(), clock()
    for _ in range(calls):
        noop()
    return clock() - t0, time.process_time() - c0


def _warm_calls(c: Contender, plan: Plan) -> int:
    """Warm ``c`` up; the calls per batch that fit the batch budget (at most w2_calls)."""
    done, t0 = 0, clock()
    while done < 20 or clock() - t0 < plan.w2_warmup_s:
        c.noop()
        done += 1
    per_call = (clock() - t0) / done
    return max(20, min(plan.w2_calls, int(plan.w2_batch_budget_s / per_call)))


def w2_fanout(contenders: Sequence[Contender], plan: Plan, errors: Errors) -> list[Row]:
    rows = []
    for n in plan.w2_sizes:
        where = f"W2@{n}"
        row = Row(f"W2.noop.{n}", f"W2 no-op call fan-out, {n} worker(s)", "us/call", "lower")
        cpu = Row(f"W2.cpu.{n}", f"W2 controller CPU per call, {n} worker(s)", "us CPU/call",
                  "lower")
        live = start_all(contenders, n, errors, where)
        try:
            calls: dict[str, int] = {}
            for c in list(live):
                found = errors.attempt(where, c.name, partial(_warm_calls, c, plan))
                if found is None:
                    live.remove(c)
                else:
                    calls[c.name] = found
            for batch in range(plan.w2_batches):
                for c in trial_order(live, batch):
                    k = calls[c.name]
                    settle()
                    took = errors.attempt(where, c.name, partial(_run_batch, c, k))
                    if took is None:
                        live.remove(c)
                    else:
                        row.add(c.name, took[0] / k * 1e6)
                        cpu.add(c.name, took[1] / k * 1e6)
            row.extra["calls_per_batch"] = calls
        finally:
            stop_all(contenders, errors, where)
        rows += [row, cpu]
    return rows


def w3_pipelined(contenders: Sequence[Contender], plan: Plan, errors: Errors) -> list[Row]:
    count = plan.w3_calls
    row = Row("W3.pipelined", f"W3 pipelined {count:,} no-ops to 1 worker", "calls/s", "higher")
    cpu = Row("W3.cpu", "W3 controller CPU per call", "us CPU/call", "lower")
    live = start_all(contenders, 1, errors, "W3")
    try:
        for c in list(live):  # warm-up
            if errors.attempt("W3", c.name, lambda c=c: c.pipelined(1000) or True) is None:
                live.remove(c)
        for _, c in _schedule(live, plan.w3_trials, plan.w3_ray_trials):
            settle()
            c0, t0 = time.process_time(), clock()
            if errors.attempt("W3", c.name, lambda c=c: c.pipelined(count) or True):
                row.add(c.name, count / (clock() - t0))
                cpu.add(c.name, (time.process_time() - c0) / count * 1e6)
    finally:
        stop_all(contenders, errors, "W3")
    return [row, cpu]


def w4_broadcast(contenders: Sequence[Contender], plan: Plan, errors: Errors) -> list[Row]:
    """One array to every worker, which returns its sum: a plain call (``W4.seconds``) and,
    where the contender can, stored once and named in the call (``W4.put.seconds``: put,
    call and free, all timed; Ray's one way, ``ray.put``, in both rows); then the same at
    ``plan.w4_big`` (MiB, workers) to show how the cost grows."""
    rows = _w4(contenders, plan, errors, plan.w4_mib, plan.w4_workers, "")
    call, put = rows[0], rows[2]
    ratio = Row("W4.call_over_put", "W4 plain call / put (same array, same workers)", "x",
                "lower")
    for name in call.raw:
        if call.value(name) is not None and put.value(name) and name not in ("ray",):
            ratio.add(name, call.value(name) / put.value(name))
    big_mib, big_n = plan.w4_big
    return [*rows, ratio, *_w4(contenders, plan, errors, big_mib, big_n, f".{big_mib}x{big_n}")]


def _w4(contenders: Sequence[Contender], plan: Plan, errors: Errors, mib: int, n: int,
        suffix: str) -> list[Row]:
    size = mib * MIB
    array = np.ones(size // 8, dtype=np.float64)
    expected = [float(array.size)] * n
    what = f"{mib} MiB float64 array to {n} workers"
    seconds = Row(f"W4.seconds{suffix}", f"W4 broadcast {what}, plain call", "s", "lower")
    rate = Row(f"W4.gbps{suffix}", f"W4 effective bandwidth ({mib} MiB x {n} / time)",
               "GB/s", "higher")
    put = Row(f"W4.put.seconds{suffix}", f"W4 broadcast {what}, put once", "s", "lower")

    def once(c: Contender, putting: bool = False) -> float:
        t0 = clock()
        sums = c.array_sum_put(array) if putting else c.array_sum(array)
        elapsed = clock() - t0
        if sums != expected:
            raise RuntimeError(f"wrong sums {sums}, expected {expected}")
        return elapsed

    live = start_all(contenders, n, errors, "W4")
    try:
        for c in list(live):  # warm-up (twice): buffers, page faults, the object store
            if errors.attempt("W4", c.name, lambda c=c: [once(c), once(c), once(c, c.puts),
                                                        once(c, c.puts)]) is None:
                live.remove(c)
        for _, c in _schedule(live, plan.w4_trials, plan.w4_ray_trials):
            for putting in (False, True) if c.puts else (False,):
                settle()
                elapsed = errors.attempt("W4", c.name, lambda c=c, p=putting: once(c, p))
                if elapsed is None:
                    continue
                if putting:
                    put.add(c.name, elapsed)
                else:
                    seconds.add(c.name, elapsed)
                    rate.add(c.name, size * n / elapsed / 1e9)
    finally:
        stop_all(contenders, errors, "W4")
    return [seconds, rate, put]


def w5_death(contenders: Sequence[Contender], plan: Plan, errors: Errors) -> list[Row]:
    row = Row("W5.kill", "W5 SIGKILL inside a call -> call raises", "ms", "lower")
    live = start_all(contenders, plan.w5_workers, errors, "W5")
    failed: set[str] = set()
    try:
        for _, c in _schedule(live, plan.w5_trials, plan.w5_ray_trials):
            if c.name in failed:
                continue
            settle()
            elapsed = errors.attempt("W5", c.name, c.kill_latency)
            if elapsed is None:
                failed.add(c.name)
            else:
                row.add(c.name, elapsed * 1e3)
    finally:
        stop_all(contenders, errors, "W5")
    return [row]


def w6_leftovers(contenders: Sequence[Contender], plan: Plan, errors: Errors) -> list[Row]:
    """Descendants of this process that a group started, still alive after its shutdown.

    Ray and phalanx-ray are left out: their actor processes belong to raylet, not to this
    process."""
    n = plan.w6_workers
    row = Row(
        "W6.leftover",
        f"W6 processes alive after shutdown, {n} workers",
        "count",
        "lower",
        agg="max",
    )
    row.extra = {"started": {}, "left": {}}
    subjects = [c for c in contenders if c.name not in RAY_NAMES]

    def trial(c: Contender) -> None:
        before = set(descendants(recursive=False))
        c.start(n)
        try:
            started = new_descendants(before)
        finally:
            c.stop()
        left = still_running(started)
        row.add(c.name, len(left))
        row.extra["started"].setdefault(c.name, []).append(len(started))
        row.extra["left"].setdefault(c.name, []).extend(describe(left))

    for _, c in _schedule(subjects, plan.w6_trials):
        errors.attempt("W6", c.name, lambda c=c: trial(c))
        stop_all([c], errors, "W6")
    return [row]


WORKLOADS: dict[str, Callable[[Sequence[Contender], Plan, Errors], list[Row]]] = {
    "W1": partial(w1_startup, fresh=True),
    "W2": w2_fanout,
    "W3": w3_pipelined,
    "W4": w4_broadcast,
    "W5": w5_death,
    "W6": w6_leftovers,
    "W7": w7_sharded,
    "W8": w8_launcher,
    "W9": w9_cluster,
}
