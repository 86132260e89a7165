"""W16: stuck collectives, the chaos matrix of tests/faults/test_stuck_collectives.py timed.

    python -m bench.stuck [--json PATH] [--backends local,cluster] [--cases skip,stop,...]

A group of 3 torch ranks (``framework="torch"``, gloo) with ``collective_timeout=2.0`` and
``straggler_warning=1.0``; rank 2 misbehaves around an ``all_reduce`` that ranks 0 and 1
wait in (:class:`Member`, the test's worker):

- **skip**: rank 2 returns from the method without entering it;
- **stop**: rank 2 SIGSTOPs itself before entering;
- **busy**: rank 2 is in another call (``busy(120)``, sent to it alone), the reduce is sent
  to all;
- **kill**: rank 2 inside, ranks 0 and 1 enter 1.5 s later; the benchmark SIGKILLs rank 2
  1.0 s into the call;
- **shape**: rank 2 enters with 8 elements where the others have 4;
- **late**: rank 2 enters 1.6 s late, twice (no error expected: the warning names it and
  how late it entered).

Per case and backend: the **outcome** (the exception type the call raised, or "ok"); the
**culprit** as phalanx named it (``error.culprits[2]`` of a ``CollectiveStuck``; for
*late*, how late the watch's warnings say rank 2 entered; for a ``WorkerDied`` the rank
that died and of what -- in *shape* gloo's assertion may abort another rank than 2, and
that one is named; otherwise the watch's "releasing them" line, or the error's first
line); **detection**, from the misbehaviour (the call's start, or the SIGKILL) to the
watch's decision (the time of its WARNING "...; releasing them", or for *late* its "have
waited" warning) or, where a rank died, to the call raising; **release**, from that
decision to the group answering again: for a ``CollectiveStuck`` the release the error
reports (``error.released``, "... in X.X s"), and apart the time from the decision to the
next successful ``reduce`` on every rank; where a rank died, until every survivor answered
``call_one(rank, "pid")`` (then ``group.restart()``, not timed, before the next case; in
*kill* that includes the 0.5 s the survivors sleep before entering); and **wedged**:
whether some survivor was still inside the collective (did not answer) 30 s after the
misbehaviour (must be False everywhere).

The watch's records are caught by a :class:`logging.Handler` on the ``phalanx`` logger
(their ``record.created`` is the decision's time); the others (a rank recreated, ...)
go to the JSON too rather than to stderr. One group per backend, reused across cases;
every wait is bounded. The agents (``cluster``) are two ``phalanx agent`` processes on
127.0.0.2 and .3 with a private token (:func:`bench.shardsync._agents`); the group runs on
the first. About 30 s per backend on 2 cores. Prints a table, writes JSON (default
bench/results/stuck.json); the exit status is 1 if a case failed to run, a survivor
stayed wedged or processes were left behind.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.util import (
    Errors,
    Row,
    compile_sources,
    descendants,
    describe,
    machine_info,
    new_descendants,
    still_running,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "stuck.json"
BACKENDS = ("local", "cluster")
CASES = ("skip", "stop", "busy", "kill", "shape", "late")
CRASHES = ("kill", "shape")  # a rank dies: the group is restarted after the case
TIMEOUT = 2.0  # collective_timeout of the group
STRAGGLER = 1.0  # straggler_warning of the group
CULPRIT = 2
LATE = 1.6  # past straggler_warning, well within collective_timeout
KILL_AFTER = 1.0  # s into the kill case's call (rank 2 inside, the others not yet)
WEDGE_S = 30.0  # a survivor not answering this long after the misbehaviour is wedged
CALL_BOUND = 60.0  # s for the misbehaving call to end one way or another
WATCH_LOGGER = "phalanx.controller.collectivewatch"
CULPRIT_WIDTH = 40


class Member:
    """A rank of a 3-rank gloo world; ``reduce(case)`` has rank 2 misbehave (the worker of
    tests/faults/test_stuck_collectives.py)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def pid(self) -> int:
        return os.getpid()

    def reduce(self, case: str = "", delay: float = 0.0, before: float = 0.0) -> float:
        import torch
        import torch.distributed as dist

        if self.rank != CULPRIT:
            time.sleep(before)
        elif case == "skip":
            return -1.0
        elif case == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif case == "late":
            time.sleep(delay)
        tensor = torch.ones(8 if case == "shape" and self.rank == CULPRIT else 4)
        dist.all_reduce(tensor)
        if case == "late":  # and once more, as late
            if self.rank == CULPRIT:
                time.sleep(delay)
            dist.all_reduce(tensor)
        return float(tensor[0])

    def busy(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


class Records(logging.Handler):
    """Every record of phalanx's loggers, as (time, logger, message), in order."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.items: list[tuple[float, str, str]] = []
        self._lock_items = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_items:
            self.items.append((record.created, record.name, record.getMessage()))

    def mark(self) -> int:
        with self._lock_items:
            return len(self.items)

    def watch(self, since: int, contains: str) -> list[tuple[float, str]]:
        """The collective watch's records after ``since`` whose message has ``contains``."""
        with self._lock_items:
            items = self.items[since:]
        return [(t, m) for t, name, m in items if name == WATCH_LOGGER and contains in m]


@contextmanager
def recording() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger("phalanx")
    old = root.level
    root.setLevel(logging.WARNING)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


# -- one case -------------------------------------------------------------------------------


def _works(group: Any) -> bool:
    import phalanx as px

    try:
        return bool(group.call("reduce", timeout=30) == [3.0, 3.0, 3.0])
    except px.PhalanxError:
        return False


def _answers_alone(group: Any, rank: int) -> bool:
    import phalanx as px

    try:
        return isinstance(group.call_one(rank, "pid", timeout=2), int)
    except px.PhalanxError:
        return False


def _until(predicate: Callable[[], bool], deadline: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``deadline`` (time.time()) passed; at least once."""
    while True:
        if predicate():
            return True
        if time.time() >= deadline:
            return False
        time.sleep(interval)


def _survivors_answer(group: Any, deadline: float) -> tuple[float | None, list[int]]:
    """Seconds until every live rank answered ``pid`` alone (None if some did not by
    ``deadline``), and the ranks that did not."""
    began = time.time()
    survivors = [h.rank for h in group.health() if h.alive]
    silent = [r for r in survivors
              if not _until(functools.partial(_answers_alone, group, r), deadline)]
    return (None if silent else time.time() - began), silent


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CULPRIT_WIDTH else text[:CULPRIT_WIDTH - 3] + "..."


def run_case(group: Any, case: str, records: Records) -> dict[str, Any]:
    """Rank 2 misbehaves as ``case`` says; what happened and how long each part took."""
    import phalanx as px

    out: dict[str, Any] = {"case": case, "outcome": None, "culprit": None, "detect_s": None,
                           "release_s": None, "next_call_s": None, "wedged": None}
    mark = records.mark()
    busy = None
    if case == "busy":
        busy = group.call_async("busy", 120, workers=[CULPRIT])
        time.sleep(0.5)
    if case == "late":
        began = time.time()
        try:
            answers = group.call("reduce", "late", LATE, timeout=CALL_BOUND)
            out["outcome"] = "ok" if answers == [9.0, 9.0, 9.0] else f"wrong {answers}"
        except Exception as exc:  # the outcome is the point
            out["outcome"], out["error"] = type(exc).__name__, str(exc).splitlines()[0]
        # the second late entry is told on a watch tick after the call returns
        _until(lambda: len(records.watch(mark, "entered all_reduce")) >= 2, time.time() + 10)
        waited = records.watch(mark, "have waited")
        late = records.watch(mark, "entered all_reduce")
        out["log"] = [m for _, m in waited + late]
        if waited:
            out["detect_s"] = waited[0][0] - began
        seconds = [float(found.group(1)) for _, m in late
                   if (found := re.search(r"\) ([0-9.]+) s after", m))]
        out["late_s"] = seconds
        if late:
            who = re.match(r"rank (\d+) ", late[0][1])
            out["culprit"] = (f"rank {who.group(1) if who else '?'} entered "
                              + ", ".join(f"{s:.1f}" for s in seconds) + " s late")
        out["wedged"] = _survivors_answer(group, began + WEDGE_S)[0] is None
        return out

    began = time.time()
    if case == "kill":
        pids: list[int] = group.call("pid")
        call = group.call_async("reduce", "", 0.0, 1.5)  # rank 2 inside, 0 and 1 enter later
        time.sleep(KILL_AFTER)
        began = time.time()
        os.kill(pids[CULPRIT], signal.SIGKILL)
    else:
        call = group.call_async("reduce", case)
    error: BaseException | None = None
    try:
        answers = call.result(timeout=CALL_BOUND)
        out["outcome"] = f"ok {answers}"
    except Exception as exc:  # the outcome is the point
        error = exc
        out["outcome"], out["error"] = type(exc).__name__, str(exc).splitlines()[0]
    raised = time.time()
    decisions = records.watch(mark, "; releasing them")
    decided = decisions[0][0] if decisions else None
    if decisions:
        out["decision"] = decisions[0][1]
    if isinstance(error, px.CollectiveStuck):
        out["culprit"] = error.culprits.get(CULPRIT, repr(error.culprits))
        found = re.search(r" in ([0-9.]+) s$", error.released)
        out["release_s"] = float(found.group(1)) if found else None
        out["released"] = error.released
    elif decisions:  # the watch's own words: "rank 2: it died inside ...: ranks 0, 1 of ..."
        out["culprit"] = decisions[0][1].split(": ranks ")[0]
    elif isinstance(error, px.WorkerDied):  # the rank that died, and of what
        out["culprit"] = f"rank {error.rank} died: {error.failure.cause}"
    elif error is not None:
        out["culprit"] = str(error).splitlines()[0]
    if case in CRASHES or not isinstance(error, px.CollectiveStuck):
        # a rank died (or the watch did not act): the survivors must answer alone
        out["detect_s"] = raised - began
        took, silent = _survivors_answer(group, began + WEDGE_S)
        out["release_s"], out["silent"] = took, silent
        out["wedged"] = bool(silent)
        group.restart()  # a dead rank's world is the user's to form again (not timed)
        if not _until(lambda: _works(group), time.time() + CALL_BOUND):
            raise RuntimeError(f"{case}: the group did not answer after restart()")
    else:
        out["detect_s"] = None if decided is None else decided - began
        ok = _until(lambda: _works(group), began + WEDGE_S)
        if ok and decided is not None:
            out["next_call_s"] = time.time() - decided
        out["wedged"] = not ok and _survivors_answer(group, began + WEDGE_S)[0] is None
    if busy is not None:  # its rank was recreated too: the call failed
        try:
            busy.result(timeout=10)
            out["busy_call"] = "returned"
        except Exception as exc:  # told, not judged
            out["busy_call"] = type(exc).__name__
    return out


# -- one backend ----------------------------------------------------------------------------


def run_backend(backend: Any, cases: list[str], records: Records, errors: Errors,
                name: str) -> dict[str, dict[str, Any]]:
    import phalanx as px
    from bench import stuck  # Member by its importable name, also when run as __main__

    results: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    group = px.WorkerGroup(stuck.Member, procs_per_node=3, framework="torch", backend=backend,
                           echo_output=False, collective_timeout=TIMEOUT,
                           straggler_warning=STRAGGLER, start_timeout=120)
    try:
        if group.call("reduce", timeout=60) != [3.0, 3.0, 3.0]:
            raise RuntimeError("the group's first all_reduce gave a wrong sum")
        print(f"W16 {name}: group up in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        for case in cases:
            result = errors.attempt(f"W16.{case}", name,
                                    functools.partial(run_case, group, case, records))
            if result is None:
                continue
            results[case] = result
            print(f"W16 {name} {case}: {result['outcome']}, detect {_s(result['detect_s'])} "
                  f"s, release {_s(result['release_s'])} s", file=sys.stderr, flush=True)
    finally:
        group.shutdown(timeout=10)
    return results


# -- the table and rows ---------------------------------------------------------------------


def table(results: dict[str, dict[str, dict[str, Any]]], cases: list[str]) -> str:
    head = ["case", "backend", "outcome", "culprit (as named)", "detect s", "release s",
            "next call s", "wedged"]
    body = []
    for case in cases:
        for backend, by_case in results.items():
            r = by_case.get(case)
            if r is None:
                body.append([case, backend, "ERR", "", "-", "-", "-", "-"])
                continue
            body.append([case, backend, str(r["outcome"]), _short(str(r["culprit"] or "-")),
                         _s(r["detect_s"]), _s(r["release_s"]), _s(r["next_call_s"]),
                         str(r["wedged"])])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(head), "-" * len(line(head)), *(line(cells) for cells in body)])


def rows(results: dict[str, dict[str, dict[str, Any]]], cases: list[str]) -> list[Row]:
    out: list[Row] = []
    for case in cases:
        measures = [("detect_s", "detection (misbehaviour to decision)"),
                    ("release_s", "release (decision to answering again)"),
                    ("next_call_s", "decision to the next successful reduce")]
        for key, label in measures:
            row = Row(f"W16.{case}.{key}", f"W16 {case}: {label}", "s", "lower")
            for backend, by_case in results.items():
                value = by_case.get(case, {}).get(key)
                if value is not None:
                    row.add(backend, value)
            if row.raw:
                out.append(row)
    wedges = Row("W16.undetected_wedges", "W16 survivors still inside 30 s after (cases)",
                 "cases", "lower", agg="max")
    for backend, by_case in results.items():
        wedges.add(backend, float(sum(bool(r["wedged"]) for r in by_case.values())))
    out.append(wedges)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stuck",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    names = [b for b in args.backends.split(",") if b]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [n for n in names if n not in BACKENDS] + [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown backends or cases: {', '.join(unknown)} (backends: "
                     f"{', '.join(BACKENDS)}; cases: {', '.join(CASES)})")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("W16 needs torch: pip install torch", file=sys.stderr)
        return 1
    compile_sources()  # the ranks would otherwise compile phalanx (see bench.util)
    errors = Errors()
    machine = machine_info()
    before = set(descendants())
    t_run = time.time()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with recording() as records:
        for name in names:
            def one(name: str = name) -> None:
                if name == "cluster":
                    import phalanx as px
                    from bench.shardsync import _agents

                    with _agents() as hosts:
                        token = _agents.token_file  # type: ignore[attr-defined]
                        backend = px.ClusterBackend(hosts[:1], token_file=token)
                        results[name] = run_backend(backend, cases, records, errors, name)
                else:
                    results[name] = run_backend(name, cases, records, errors, name)

            results.setdefault(name, {})
            errors.attempt("W16", name, one)
        log = [{"t": t - t_run, "logger": n, "message": m} for t, n, m in records.items]
    left = still_running(new_descendants(before))
    if left:
        errors.record("cleanup", "phalanx", RuntimeError(
            f"{len(left)} processes left: " + "; ".join(describe(left))))
    seconds = time.time() - t_run
    wedged = sum(bool(r["wedged"]) for by_case in results.values() for r in by_case.values())
    write_json(args.json, {
        "benchmark": "stuck", "seconds": seconds, "cases": results,
        "settings": {"collective_timeout": TIMEOUT, "straggler_warning": STRAGGLER,
                     "late_s": LATE, "kill_after_s": KILL_AFTER, "wedge_s": WEDGE_S},
        "undetected_wedges": wedged, "leftover_processes": describe(left), "log": log,
        "errors": errors.items, "machine": machine,
    }, rows(results, cases))
    print(f"W16 stuck collectives: 3 torch ranks (gloo), collective_timeout={TIMEOUT:g} s, "
          f"straggler_warning={STRAGGLER:g} s, rank {CULPRIT} misbehaving")
    print(table(results, cases))
    print(f"undetected wedges: {wedged}; processes left: {len(left)}")
    for error in errors.items:
        print(f"error: {error['workload']} / {error['contender']}: {error['error']}")
    print(f"({seconds:.0f} s)  JSON: {args.json}")
    return 1 if errors.items or wedged or left else 0


if __name__ == "__main__":
    sys.exit(main())
