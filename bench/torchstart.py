"""W1t: start N ranks whose module imports torch, to the first answer, each trial in a fresh
controller process.

    python -m bench.torchstart [--sizes 4,16] [--trials K] [--json PATH]

Every trial is a new interpreter (``python -c``, this checkout first on ``PYTHONPATH``, so
that the ranks it starts import :mod:`bench.torchtarget` from here), in a session of its
own: nothing is warm in the controller. The trial imports what its contender needs, waits
until its process tree is quiet, then times from just before the contender's start call to
the moment every rank has answered one call; it then tears the ranks down and reports, as
one JSON line, that time, the teardown's, and the CPU seconds that the trial process and
all its descendants (live ones, and those they reaped) used over the timed part, read while
every rank still lives (Ray's raylet reaps its workers without their CPU time reaching
anyone). The contenders:

- **phalanx**: ``px.WorkerGroup(Target, procs_per_node=N, preload=False)``, then
  ``group.call("ping")`` (the keyword left out while WorkerGroup has no ``preload``);
- **phalanx-preload**: the same with ``preload=True`` (unavailable without the keyword);
- **torchrun**: ``torchrun --standalone --nproc-per-node N -m bench.torchtarget`` (the one
  beside this interpreter); each process prints one ``ready`` line; timed until all N are
  read from its stdout, then it is left to exit;
- **ray**: N actors (``num_cpus=0``) whose constructor builds the target, one call each
  (``bench.contenders.RayContender``'s start), in a Ray the trial started before its timer
  (``address="local"``, on 127.0.0.1; ``ray.init`` is not timed);
- **forkserver**: the floor a preloading server can reach: ``multiprocessing``'s forkserver
  preloading ``bench.torchtarget``, N processes each sending its answer through a pipe,
  timed from the context's creation (the server's start and its import of torch included).

phalanx and the forkserver import the target module (and so torch) in the controller
before the timer: phalanx pickles the class, the forkserver the children's function. Their
ranks do not inherit that import (phalanx's start fresh interpreters or fork from its own
server; the forkserver is a fresh interpreter), and ray's and torchrun's controllers do
not need it.

Trials alternate between the contenders in changing order (:func:`bench.util.trial_order`),
after one untimed trial each with one rank (files read from disk, caches). Reported: the
median wall and CPU time per contender and size, the ratios, and the goals for N = 4.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import inspect
import json
import logging
import multiprocessing
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import psutil

from bench import report
from bench.cold import _tail, run_fresh
from bench.util import (
    Errors,
    Row,
    clock,
    compile_sources,
    cpu_snapshot,
    descendants,
    describe,
    is_mp_helper,
    machine_info,
    settle,
    still_running,
    trial_order,
)

CONTENDERS = ("phalanx", "phalanx-preload", "torchrun", "ray", "forkserver")
DEFAULT_TRIALS = {4: 3, 16: 2}  # size -> trials (other sizes: 2)
TIMEOUT_S = 300.0  # one trial process, spawn to exit (16 ranks importing torch on 2 cores)
READY_TIMEOUT_S = 200.0  # inside a trial: until every rank answered (+ EXIT: < TIMEOUT_S)
EXIT_TIMEOUT_S = 60.0  # inside a trial: torchrun's exit, the forkserver children's
GONE_GRACE_S = 5.0  # how long the ranks may take to be gone after the teardown
QUIET_SHARE = 0.2  # the process tree is quiet below this share of one CPU ...
QUIET_LIMIT_S = 30.0  # ... or after this long (Ray starting its worker pool)
RAY_CPUS = 32
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "torchstart.json"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOALS = [
    report.Target(
        "W1t@4 phalanx-preload within 1.3x the forkserver floor",
        "W1t.4",
        "ratio",
        "<=",
        1.3,
        "phalanx-preload",
        "forkserver",
    ),
    report.Target(
        "W1t@4 phalanx-preload >= 2.5x faster than torchrun",
        "W1t.4",
        "ratio",
        ">=",
        2.5,
        "torchrun",
        "phalanx-preload",
    ),
]
# table columns, median wall over median wall; the last two while preloading is unavailable
RATIOS = [
    ("phalanx-preload", "forkserver"),
    ("torchrun", "phalanx-preload"),
    ("phalanx", "forkserver"),
    ("torchrun", "phalanx"),
]

# argv: contender, ranks, preload ("on", "off" or "absent": WorkerGroup has no such keyword)
TRIAL = (
    "import sys\nfrom bench.torchstart import trial\n"
    "trial(sys.argv[1], int(sys.argv[2]), sys.argv[3])\n"
)


# -- inside a trial process -----------------------------------------------------------------


class _Contender:
    """One contender inside a trial process: constructed (imports, Ray's start) before the
    timer; ``start`` returns every rank's first answer; ``stop`` tears the ranks down;
    ``close`` ends what outlives them (Ray)."""

    def start(self, n: int) -> list[Any]:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def shown(self, answers: list[Any]) -> str:
        """What the trial records as its ranks' answer (untimed)."""
        return str(answers[0])


class _Phalanx(_Contender):
    def __init__(self, preload: str) -> None:
        import phalanx
        from bench.torchtarget import Target

        self.px, self.target = phalanx, Target
        self.options: dict[str, Any] = {} if preload == "absent" else {"preload": preload == "on"}
        self.group: Any = None

    def start(self, n: int) -> list[Any]:
        self.group = self.px.WorkerGroup(
            self.target, procs_per_node=n, echo_output=False, **self.options
        )
        return list(self.group.call("ping"))

    def stop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()


class _Torchrun(_Contender):
    def __init__(self) -> None:
        self.command = [torchrun_path(), "--standalone"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.err = tempfile.TemporaryFile()

    def start(self, n: int) -> list[Any]:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}
        self.proc = proc = subprocess.Popen(
            [*self.command, "--nproc-per-node", str(n), "-m", "bench.torchtarget"],
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
        )
        assert proc.stdout is not None
        lines: list[str] = []
        buf = b""
        deadline = clock() + READY_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while len(lines) < n:
                left = deadline - clock()
                if left <= 0 or not sel.select(left):
                    self._fail(f"{len(lines)} of {n} ranks ready after {READY_TIMEOUT_S:.0f} s")
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    self._fail(f"stdout closed with {len(lines)} of {n} ranks ready")
                buf += data
                *done, buf = buf.split(b"\n")
                lines += [x.decode() for x in done if x.startswith(b"ready")]
        return [line.split(" ", 2)[2] for line in lines]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            code = proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill_tree(proc)
            raise RuntimeError(
                f"torchrun still running {EXIT_TIMEOUT_S:.0f} s after every rank was ready; killed"
            ) from None
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        if code != 0:
            raise RuntimeError(f"torchrun exited {code}: {self._stderr()}")

    def _fail(self, what: str) -> NoReturn:
        proc = self.proc
        self.proc = None
        if proc is not None:
            self._kill_tree(proc)
        raise RuntimeError(f"torchrun: {what}; stderr: {self._stderr()}")

    @staticmethod
    def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
        """torchrun and its workers (each in a session of its own, so not in its group)."""
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait(10)

    def _stderr(self) -> str:
        self.err.seek(0)
        return _tail(self.err.read().decode(errors="replace"))


def _ray_actor() -> type:
    """The actor class, made inside a function so that Ray ships it by value: its workers
    import the target module in the constructor, and nothing of the benchmark's."""

    class RayTarget:
        def __init__(self) -> None:
            from bench.torchtarget import Target

            self.target = Target()

        def pid(self) -> int:
            return os.getpid()

        def ping(self) -> str:
            return self.target.ping()

    return RayTarget


class _Ray(_Contender):
    def __init__(self) -> None:
        import ray

        from bench.contenders import RayContender

        ray.init(
            address="local",
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
        )
        self.ray = ray
        self.contender = RayContender()
        self.contender.actor_class = ray.remote(num_cpus=0)(_ray_actor())

    def start(self, n: int) -> list[Any]:
        self.contender.start(n)  # N actors, one call each (their pid) until all answered
        return self.contender.pids()

    def shown(self, answers: list[Any]) -> str:
        # the timed call was pid (RayContender's start); the target's own answer, untimed
        actor = self.contender.actors[0]
        return str(self.ray.get(actor.ping.remote(), timeout=EXIT_TIMEOUT_S))

    def stop(self) -> None:
        self.contender.stop()

    def close(self) -> None:
        self.ray.shutdown()


class _Forkserver(_Contender):
    def __init__(self) -> None:
        from bench.torchtarget import answer

        self.answer = answer
        self.procs: list[Any] = []

    def start(self, n: int) -> list[Any]:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["bench.torchtarget"])
        readers = []
        for _ in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=self.answer, args=(writer,))
            proc.start()  # the first one starts the server, which imports torch first
            writer.close()
            self.procs.append(proc)
            readers.append(reader)
        deadline = clock() + READY_TIMEOUT_S
        answers: list[Any] = []
        for reader in readers:
            if not reader.poll(max(0.0, deadline - clock())):
                raise RuntimeError(f"{len(answers)} of {n} answers after {READY_TIMEOUT_S} s")
            answers.append(reader.recv())
            reader.close()
        return answers

    def stop(self) -> None:
        from multiprocessing import forkserver

        procs, self.procs = self.procs, []
        for proc in procs:
            proc.join(EXIT_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        # the server: stopped and reaped, so that its CPU time (and its children's) counts
        forkserver._forkserver._stop()  # type: ignore[attr-defined]


def _make(name: str, preload: str) -> _Contender:
    if name == "phalanx":
        return _Phalanx("absent" if preload == "absent" else "off")
    if name == "phalanx-preload":
        if preload == "absent":
            raise RuntimeError("WorkerGroup has no preload keyword")
        return _Phalanx("on")
    if name == "torchrun":
        return _Torchrun()
    if name == "ray":
        return _Ray()
    if name == "forkserver":
        return _Forkserver()
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


def _quiet() -> float:
    """Wait until this process and its descendants use under ``QUIET_SHARE`` of a CPU (Ray
    starting its workers after ``ray.init``), at most ``QUIET_LIMIT_S``; the seconds waited."""
    settle()
    began = before = cpu_snapshot()
    while clock() - began[0] < QUIET_LIMIT_S:
        time.sleep(0.25)
        now = cpu_snapshot()
        if (now[2] - before[2]) / (now[0] - before[0]) < QUIET_SHARE:
            break
        before = now
    return clock() - began[0]


def _gone(procs: Sequence[psutil.Process]) -> list[str]:
    """Those of ``procs`` still alive (zombies aside) ``GONE_GRACE_S`` after the teardown:
    described, and killed."""
    deadline = clock() + GONE_GRACE_S
    while True:
        alive = []
        for proc in still_running(procs):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        if not alive or clock() > deadline:
            break
        time.sleep(0.05)
    text = describe(alive)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return text


def trial(name: str, n: int, preload: str) -> None:
    """One trial, in a fresh process: prints one JSON line (``ready_s``: start call to every
    rank's first answer; ``stop_s``: the teardown; ``cpu_s``: the CPU time of this process
    and its descendants (live ones, and those they reaped) over ``ready_s``; ``left``:
    processes of the trial alive after it, killed)."""
    logging.basicConfig(level=logging.WARNING)
    contender = _make(name, preload)
    try:
        quiet_s = _quiet()
        cpu0 = cpu_snapshot()[2]
        t0 = clock()
        answers = contender.start(n)
        t1 = clock()
        # Read while every rank lives: Ray's raylet reaps its dead workers without their
        # CPU time reaching anyone, so a reading after the teardown would lose theirs.
        cpu = cpu_snapshot()[2] - cpu0
        seen = [p for p in descendants().values() if not is_mp_helper(p)]
        if len(answers) != n:
            raise RuntimeError(f"{len(answers)} answers from {n} ranks: {answers}")
        shown = contender.shown(answers)
        t2 = clock()
        contender.stop()
        t3 = clock()
    except BaseException:
        with contextlib.suppress(Exception):  # the error that matters is the first one
            contender.stop()
        raise
    finally:
        contender.close()
    gc.collect()
    print(
        json.dumps(
            {
                "ready_s": t1 - t0,
                "stop_s": t3 - t2,
                "cpu_s": cpu,
                "quiet_s": quiet_s,
                "answer": shown,
                "left": _gone(seen),
            }
        ),
        flush=True,
    )


# -- the driver ---------------------------------------------------------------------------


def torchrun_path() -> str:
    """The torchrun beside this interpreter (the environment's)."""
    return str(Path(sys.executable).parent / "torchrun")


def availability() -> dict[str, str]:
    """Why each contender that cannot run here cannot (absent: it can)."""
    out: dict[str, str] = {}
    import phalanx

    if "preload" not in inspect.signature(phalanx.WorkerGroup).parameters:
        out["phalanx-preload"] = "unavailable: WorkerGroup has no preload keyword yet"
    if not os.access(torchrun_path(), os.X_OK):
        out["torchrun"] = f"skipped: no torchrun at {torchrun_path()}"
    if importlib.util.find_spec("ray") is None:
        out["ray"] = "skipped: ray is not installed"
    if "forkserver" not in multiprocessing.get_all_start_methods():
        out["forkserver"] = "skipped: no forkserver start method on this platform"
    return out


def run_trial(name: str, n: int, preload: str) -> dict[str, Any]:
    """:data:`TRIAL` for ``name`` with ``n`` ranks in a fresh interpreter (a session of its
    own, this checkout first on ``PYTHONPATH``); its JSON line, with ``process_s`` (spawn to
    exit, seen from here) and in ``left`` what the trial or its session left behind (killed).
    Raises when it fails, runs past ``TIMEOUT_S`` or prints no JSON line."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else "")}
    return run_fresh([sys.executable, "-c", TRIAL, name, str(n), preload], env, TIMEOUT_S)


def _cell(wall: Row, cpu: Row, name: str, skipped: dict[str, str], failed: set[str]) -> str:
    if name in skipped:
        return "n/a"
    value = wall.value(name)
    if value is None:
        return "ERR" if name in failed else "-"
    return f"{report.fmt(value)} ({report.fmt(cpu.value(name))})"


def table(
    rows: Sequence[tuple[Row, Row]], skipped: dict[str, str], failed: dict[str, set[str]]
) -> str:
    head = ["W1t", *(f"{c} s (cpu)" for c in CONTENDERS), *(f"{s} / {b}" for s, b in RATIOS)]
    body = []
    for wall, cpu in rows:
        cells = [wall.key]
        cells += [_cell(wall, cpu, c, skipped, failed.get(wall.key, set())) for c in CONTENDERS]
        for s, b in RATIOS:
            r = report.ratio(wall, s, b)
            cells.append("-" if r is None else f"{r:.2f}x")
        body.append(cells)
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(
            [c[0].ljust(widths[0]), *(x.rjust(w) for x, w in zip(c[1:], widths[1:], strict=True))]
        )
        for c in [head, *body]
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def goals(rows: Sequence[tuple[Row, Row]]) -> list[dict[str, Any]]:
    by_key = {wall.key: wall for wall, _ in rows}
    out = []
    for goal in GOALS:
        row = by_key.get(goal.key)
        measured = None if row is None else report.ratio(row, goal.subject, goal.base)
        verdict = (
            "SKIP"
            if measured is None
            else ("PASS" if report._OPS[goal.op](measured, goal.limit) else "FAIL")
        )
        out.append({**vars(goal), "measured": measured, "verdict": verdict})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.torchstart", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="4,16", help="rank counts, e.g. 4,16")
    parser.add_argument(
        "--trials", type=int, default=None, help="trials per size (default: 3 at 4 ranks, 2 at 16)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    try:
        args.sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, not {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1 or (args.trials is not None and args.trials < 1):
        parser.error("sizes and trials must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("W1t needs torch (the ranks' module imports it)", file=sys.stderr)
        return 1
    machine = machine_info()
    compile_sources()
    skipped = availability()
    preload = "absent" if "phalanx-preload" in skipped else "on"
    names = [c for c in CONTENDERS if c not in skipped]
    errors = Errors()
    extra_parts = ("stop_s", "cpu_s", "quiet_s", "process_s")
    failed: dict[str, set[str]] = {}
    answers: dict[str, str] = {}
    left: list[str] = []

    def once(name: str, n: int, where: str) -> dict[str, Any] | None:
        settle()
        found = errors.attempt(where, name, partial(run_trial, name, n, preload))
        if found is not None:
            answers.setdefault(name, found["answer"])
            if found["left"]:
                left.extend(found["left"])
                errors.record(where, name, RuntimeError(f"left behind: {found['left']}"))
        return found

    print(f"W1t: contenders {', '.join(names)}", file=sys.stderr, flush=True)
    for name, why in skipped.items():
        print(f"  {name}: {why}", file=sys.stderr, flush=True)
    warm_failed = {name for name in names if once(name, 1, "W1t@1 (warm-up)") is None}
    rows: list[tuple[Row, Row]] = []
    for n in args.sizes:
        wall = Row(
            f"W1t.{n}", f"W1t fresh process: start {n} torch ranks to first answer", "s", "lower"
        )
        cpu = Row(f"W1t.cpu.{n}", f"W1t CPU, start to first answer, {n} ranks", "s", "lower")
        wall.extra = {part: {} for part in extra_parts}
        failed[wall.key] = bad = set(warm_failed)
        trials = args.trials or DEFAULT_TRIALS.get(n, 2)
        for t in range(trials):
            for name in trial_order([c for c in names if c not in bad], t):
                found = once(name, n, f"W1t@{n}")
                if found is None:
                    bad.add(name)
                    continue
                wall.add(name, found["ready_s"])
                cpu.add(name, found["cpu_s"])
                for part in extra_parts:
                    wall.extra[part].setdefault(name, []).append(found[part])
                print(
                    f"  W1t@{n} trial {t + 1}/{trials} {name}: {found['ready_s']:.2f} s, "
                    f"cpu {found['cpu_s']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
        rows.append((wall, cpu))
    results = goals(rows)
    print(table(rows, skipped, failed))
    print("\nGoals:")
    print(report.targets_text(results))
    for name, why in skipped.items():
        print(f"  {name}: {why}")
    if errors.items:
        print("\nErrors:")
        for e in errors.items:
            print(f"  {e['workload']} / {e['contender']}: {e['error']}")
    payload = {
        "benchmark": "W1t",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": machine,
        "sizes": args.sizes,
        "trials": {n: args.trials or DEFAULT_TRIALS.get(n, 2) for n in args.sizes},
        "contenders": names,
        "unavailable": skipped,
        "answers": answers,
        "ratios": {
            wall.key: {f"{s} / {b}": report.ratio(wall, s, b) for s, b in RATIOS}
            for wall, _ in rows
        },
        "goals": results,
        "errors": errors.items,
        "left_behind": left,
    }
    report.write_json(args.json, payload, [row for pair in rows for row in pair])
    print(f"\nJSON: {args.json}")
    return 1 if errors.items else 0


if __name__ == "__main__":
    sys.exit(main())
