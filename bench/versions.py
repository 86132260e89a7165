"""W1, W2, W3 and W5 of two versions of phalanx, alternately, in one run: a change's cost
on start-up, the call path and death detection, measured against the commit before it on
the same machine at the same time.

    python -m bench.versions --old REV [--new PATH] [--batches 9] [--json PATH]
                             [--w1-batches N] [--w5-batches N]
    python -m bench.versions --old REV --backend cluster   # W2 and W9 on node agents
    python -m bench.versions --old REV --backend ray       # W2 and W3 on Ray

``--old`` is a git revision (checked out into a temporary worktree) or a directory holding
a phalanx tree; ``--new`` defaults to this checkout. Each version runs in a process of its
own (its ``phalanx`` first on ``sys.path``), on the local backend, built only with the
public API so that any two versions compare. It holds a group of 4 ranks (W2: one no-op
call fanned out to all 4), a group of 1 (W3: 20,000 pipelined no-ops) and a group of 4
for W5, and starts a group of its own for each W1 trial. W1 and W5 are bench.run's own
(``bench.measure.w1_startup``, ``PhalanxContender.kill_latency``), taken from this tree's
bench/ in both versions' processes, so the same code measures both: W1 starts 4 workers
until the constructor has returned on every one, then shuts them down until every process
is gone (startup and teardown seconds apart); W5 SIGKILLs rank 0 50 ms into a
``sleep(10)`` call and times ``os.kill`` until the caller's wait raises ``WorkerDied``,
the rank recreated afterwards (``group.recreate(0)``, not timed). The driver asks the
versions in turn, batch by batch, one sample of each workload a batch, the order
swapping every batch, so that whatever else the machine does lands on both alike.
W2 and W3 on the local backend report the controller's CPU time per call (its whole
process: ``time.process_time()`` around the batch) beside the wall clock. ``--batches``
counts W2 and W3's batches, ``--w1-batches`` and ``--w5-batches`` those of
W1 and W5 (default: as many; 0 leaves one out). Prints a table of medians (about two
minutes at the defaults on 2 cores) and writes JSON.

With ``--backend cluster`` each version's process starts two ``phalanx agent`` of its own
(127.0.0.2 and 127.0.0.3, a private token file) and measures, on 2 agents x 2 ranks, W2
(one no-op call fanned out to the 4 ranks) and W9's broadcast (a 64 MiB float64 array
sent to every rank: it crosses to each node once), as each node's bandwidth: 64 MiB over
the call's seconds (no W1 or W5 there).

With ``--backend ray`` each version's process starts a Ray of its own, as bench.run does
(``ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False)``),
on 127.0.0.1 and with a session directory of its own under /tmp (``_node_ip_address``,
``_temp_dir``), and measures W2 (one no-op call fanned out to a ``backend="ray"`` group of
4 ranks, one actor each) and W3 (20,000 pipelined no-ops to a group of 1) on it, the
batches alternating between the versions as on the local backend (no W1 or W5 there).
Two Rays, not one shared: a Ray's workers import phalanx from the environment its raylet
was started with, so a Ray started by each version's own process (``PYTHONPATH`` its
tree) runs that version's ranks, and the server checks that every rank imported its
phalanx; one Ray started by the driver would run the driver's phalanx (this checkout's
editable install) in both versions' ranks unless a runtime_env rerouted each job's
workers, and a ``ray start --head`` Ray is stopped by ``ray stop``, which stops every
Ray on the machine. The cost is a second idle Ray (its GCS, raylet and agents: about 5%
of a CPU each on this machine), the same for both versions. Each server calls
``ray.shutdown()`` on the way out, errors included; the driver then waits up to 10 s for
the processes the servers had started and those of their Rays (marked by an environment
variable they inherit: a server killed midway leaves Ray's agents behind, orphaned and
retitled), kills any still running by pid, reports them and exits 1.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.util import compile_sources, describe, machine_info, median, settle, still_running

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "bench" / "results" / "versions.json"

# The process serving one version: reads commands on stdin, answers seconds on stdout (a
# line of them; "error ..." when a trial failed). W1 and W5 are bench.measure's and
# bench.contenders' own, from the bench/ of the tree being run (argv[1] holds only it).
_SERVER = r'''
import dataclasses, logging, sys, time
sys.path.insert(0, sys.argv[1])  # this tree's bench/, before the version's own tree
import phalanx as px
from bench.contenders import PhalanxContender
from bench.measure import make_plan, w1_startup, warm_up
from bench.util import Errors, settle

logging.getLogger("phalanx").setLevel(logging.ERROR)  # W5's deaths are expected

class Bench:
    def noop(self):
        return None

fanout = px.WorkerGroup(Bench, procs_per_node=4, echo_output=False)
single = px.WorkerGroup(Bench, procs_per_node=1, echo_output=False)
starts = PhalanxContender()  # W1: started and shut down in each trial
warm_up([starts], Errors())
killed = PhalanxContender()  # W5: one group throughout, its rank 0 recreated after each kill
killed.start(4)
for _ in range(300):
    fanout.call("noop")
for f in [single.call_async("noop", workers=[0]) for _ in range(2000)]:
    f.result()
print("ready", px.__file__, flush=True)
for line in sys.stdin:
    kind, count = line.split()
    count = int(count)
    if kind == "w2":  # wall-clock and CPU seconds of the batch
        call = fanout.call
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(count):
            call("noop")
        answer = [time.perf_counter() - t0, time.process_time() - c0]
    elif kind == "w3":
        c0, t0 = time.process_time(), time.perf_counter()
        futures = [single.call_async("noop", workers=[0]) for _ in range(count)]
        for f in futures:
            f.result()
        answer = [time.perf_counter() - t0, time.process_time() - c0]
    elif kind == "w1":  # count trials: startup and teardown seconds of each
        errors = Errors()
        plan = dataclasses.replace(make_plan(False), w1_trials={4: count},
                                   w1_ray_trials={4: count})
        startup, teardown = w1_startup([starts], plan, errors)
        if errors.items:
            print("error", errors.items[0]["error"], flush=True)
            continue
        answer = [x for pair in zip(startup.raw[starts.name], teardown.raw[starts.name])
                  for x in pair]
    elif kind == "w5":  # count kills: seconds from os.kill until WorkerDied, each
        answer = []
        for _ in range(count):
            settle()
            answer.append(killed.kill_latency())
    else:
        break
    print(*answer, flush=True)
fanout.shutdown()
single.shutdown()
killed.stop()
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

# The same for the Ray backend: a Ray of this version's own (its session directory in
# RAY_DIR_VARIABLE), a group of 4 ranks (W2) and one of 1 (W3): bench.run's ray.init, on
# loopback.
RAY_DIR_VARIABLE = "PHALANX_VERSIONS_RAY_DIR"
_RAY_SERVER = r'''
import logging, os, sys, time
import ray
import phalanx as px

logging.getLogger("phalanx").setLevel(logging.ERROR)

class Bench:
    def noop(self):
        return None

    def phalanx_file(self):
        return sys.modules["phalanx"].__file__

groups = []
try:
    ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
             _temp_dir=os.environ["PHALANX_VERSIONS_RAY_DIR"])
    fanout = px.WorkerGroup(Bench, procs_per_node=4, backend="ray", echo_output=False)
    groups.append(fanout)
    single = px.WorkerGroup(Bench, procs_per_node=1, backend="ray", echo_output=False)
    groups.append(single)
    mine = os.path.realpath(px.__file__)
    theirs = {os.path.realpath(f) for g in groups for f in g.call("phalanx_file")}
    if theirs != {mine}:
        raise RuntimeError(f"the ranks imported phalanx from {sorted(theirs)}, not {mine}")
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
finally:
    for group in groups:
        try:
            group.shutdown()
        except Exception as exc:
            print(f"group.shutdown failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    ray.shutdown()
'''


class Version:
    """One version's serving process: ``tree``'s phalanx, and the bench/ that ``shim``
    holds (this tree's), first on its path."""

    def __init__(self, name: str, tree: Path, shim: Path, server: str = _SERVER,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.tree = name, tree
        self.proc = subprocess.Popen(
            [sys.executable, "-c", server, str(shim)], cwd=tree, text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.started: dict[int, psutil.Process] = {}  # what it started, seen when ready
        ready = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        if not ready or ready[0] != "ready":
            self.close()
            raise RuntimeError(f"the {name} version ({tree}) did not start")
        self.module = ready[1]
        self._note_started()

    def _note_started(self) -> None:
        """Add the server's live descendants to ``started`` (its Ray's processes: once it
        has died they are no longer its descendants)."""
        try:
            self.started.update({p.pid: p for p in
                                 psutil.Process(self.proc.pid).children(recursive=True)})
        except psutil.Error:
            pass

    def ask(self, kind: str, count: int) -> list[float]:
        """The server's answer to ``kind count``: its line of seconds."""
        self.proc.stdin.write(f"{kind} {count}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        answer = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        if not answer:
            raise RuntimeError(f"the {self.name} version ({self.tree}) ended during {kind}: "
                               "its error is above")
        if answer[0] == "error":
            raise RuntimeError(f"{kind} failed on the {self.name} version ({self.tree}): "
                               + " ".join(answer[1:]))
        return [float(x) for x in answer]

    def run(self, kind: str, count: int) -> float:
        return self.ask(kind, count)[0]

    def close(self) -> None:
        """Ask the server to end (its groups shut down, its Ray too) and wait for it,
        killing it after 60 s; what it had started is kept in ``started``."""
        self._note_started()
        try:
            self.proc.stdin.write("quit 0\n")  # type: ignore[union-attr]
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _zombie(proc: psutil.Process) -> bool:
    """Whether ``proc`` has ended and waits only to be reaped (by a parent still running:
    not a process left running), or is gone."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _marked(proc: psutil.Process, ray_dirs: list[str]) -> bool:
    """Whether ``proc`` belongs to one of the servers' Rays: ``RAY_DIR_VARIABLE`` (which
    every process a server starts inherits; Ray's agents retitle their command lines) or
    its command line names one of ``ray_dirs``."""
    try:
        if proc.environ().get(RAY_DIR_VARIABLE) in ray_dirs:
            return True
        return any(d in " ".join(proc.cmdline()) for d in ray_dirs)
    except psutil.Error:
        return False


def _stop_leftovers(versions: list[Version], ray_dirs: list[Path]) -> list[str]:
    """Processes the closed ``versions`` had started or that belong to their Rays (see
    :func:`_marked`), still running 10 s after the servers ended (a Ray's processes take
    a moment to exit): killed by pid, and described."""
    started = [p for v in versions for p in v.started.values()]
    dirs = [str(d) for d in ray_dirs]
    deadline = time.monotonic() + 10.0
    while True:
        left = {p.pid: p for p in still_running(started)}
        left.update({p.pid: p for p in psutil.process_iter() if _marked(p, dirs)})
        left.pop(os.getpid(), None)
        left = [p for p in left.values() if not _zombie(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    text = describe(left)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return text


def _tree(spec: str, scratch: Path) -> Path:
    """A directory holding a phalanx tree: ``spec`` itself, or a worktree of revision ``spec``."""
    if Path(spec, "phalanx", "__init__.py").is_file():
        return Path(spec).resolve()
    where = scratch / "old"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), spec],
                   check=True, capture_output=True)
    return where


# What each workload's samples are, how they are shown, and their key in the JSON's medians.
_ROWS = {
    "W1.startup": ("W1 startup, 4 workers (s)", "{:>12.3f}", "{:,.3f}", "W1.startup.4_s"),
    "W1.teardown": ("W1 teardown, 4 workers (s)", "{:>12.3f}", "{:,.3f}", "W1.teardown.4_s"),
    "W2": ("W2 no-op fan-out to 4 (us/call)", "{:>12.1f}", "{:,.1f}", "W2.noop.4_us"),
    "W2.cpu": ("W2 controller CPU (us/call)", "{:>12.2f}", "{:,.2f}", "W2.cpu.4_us"),
    "W3": ("W3 pipelined to 1 (calls/s)", "{:>12,.0f}", "{:,.1f}", "W3.pipelined_calls_per_s"),
    "W3.cpu": ("W3 controller CPU (us/call)", "{:>12.2f}", "{:,.2f}", "W3.cpu_us"),
    "W5": ("W5 SIGKILL to WorkerDied (ms)", "{:>12.1f}", "{:,.1f}", "W5.kill_ms"),
}
_RAY_ROWS = {
    "W2": ("W2 Ray no-op fan-out 4 (us/call)", "{:>12.1f}", "{:,.1f}", "W2.noop.4_us"),
    "W3": ("W3 Ray pipelined to 1 (calls/s)", "{:>12,.0f}", "{:,.1f}",
           "W3.pipelined_calls_per_s"),
}
_CLUSTER_ROWS = {
    "W2": ("W2 no-op fan-out, 2x2 (us/call)", "{:>12.1f}", "{:,.1f}", "W2.noop.4_us"),
    "W9": ("W9 64 MiB, MiB/s a node", "{:>12,.0f}", "{:,.1f}",
           "W9.bcast_64MiB_MiB_per_s_per_node"),
}


def measure(versions: list[Version], batches: int, w2_calls: int, w3_calls: int,
            cluster: bool = False, w1_batches: int = 0, w5_batches: int = 0) -> dict:
    """Per version, one sample a batch of each workload: W1's startup and teardown in s
    (local only, ``w1_batches`` of them), W2 in us/call, W3 in calls/s (or, on the
    cluster, W9 in MiB/s a node: one 64 MiB broadcast per sample, ``w3_calls`` ignored),
    on the local backend W2's and W3's controller CPU time per call beside them (us),
    then W5 in ms (local only, ``w5_batches``). The versions take turns, the order
    swapping every batch."""
    other = "W9" if cluster else "W3"
    names = [*(["W1.startup", "W1.teardown"] if w1_batches else []), "W2", "W2.cpu", other,
             "W3.cpu", *(["W5"] if w5_batches else [])]
    raw: dict[str, dict[str, list[float]]] = {v.name: {n: [] for n in names} for v in versions}
    for batch in range(max(batches, w1_batches, w5_batches)):
        order = versions if batch % 2 == 0 else versions[::-1]
        if batch < w1_batches:
            for v in order:  # settle() is bench.measure's, in the server before each trial
                startup, teardown = v.ask("w1", 1)
                raw[v.name]["W1.startup"].append(startup)
                raw[v.name]["W1.teardown"].append(teardown)
        if batch < batches:
            for v in order:
                settle()
                answer = v.ask("w2", w2_calls)
                raw[v.name]["W2"].append(answer[0] / w2_calls * 1e6)
                if len(answer) > 1:  # the local server's CPU seconds too
                    raw[v.name]["W2.cpu"].append(answer[1] / w2_calls * 1e6)
            for v in order:
                settle()
                if cluster:
                    raw[v.name]["W9"].append(BROADCAST_MIB / v.run("w9", 1))
                    continue
                answer = v.ask("w3", w3_calls)
                raw[v.name]["W3"].append(w3_calls / answer[0])
                if len(answer) > 1:
                    raw[v.name]["W3.cpu"].append(answer[1] / w3_calls * 1e6)
        if batch < w5_batches:
            for v in order:  # settle() in the server, as bench.measure.w5_death does
                raw[v.name]["W5"].append(v.run("w5", 1) * 1e3)
    return raw


def _compile(trees: list[Path]) -> None:
    """Byte-compile each version's phalanx, and this tree's phalanx and bench, as
    bench.run does (:func:`bench.util.compile_sources`): where PYTHONDONTWRITEBYTECODE is
    set, every rank of a fresh worktree would otherwise compile it anew, and W1 would time
    that for one version only."""
    compile_sources()
    for tree in trees:
        compileall.compile_dir(str(tree / "phalanx"), quiet=1, workers=0)
        _build_compiled(tree)


def _build_compiled(tree: Path) -> None:
    """Build a tree's compiled parts in place where it has them and one is not built yet (a
    worktree of a revision holds only its sources), as its editable install does: else that
    version would run their pure-Python twins, and the comparison would time those."""
    sources = list((tree / "phalanx").rglob("_*.c"))
    if not (tree / "setup.py").is_file() or not sources:
        return
    if all(list(source.parent.glob(f"{source.stem}.*.so")) for source in sources):
        return
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versions",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="git revision or phalanx tree")
    parser.add_argument("--new", default=str(REPO), help="phalanx tree (default: this one)")
    parser.add_argument("--old-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the old version's environment (and its ranks'): "
                             "--old . --old-env PHALANX_PURE_PYTHON=1 times this tree's "
                             "pure-Python steps against its compiled ones")
    parser.add_argument("--batches", type=int, default=9, help="of W2 and W3 (or W9)")
    parser.add_argument("--w1-batches", type=int, default=None,
                        help="W1 trials a version (default: --batches; 0: no W1)")
    parser.add_argument("--w5-batches", type=int, default=None,
                        help="W5 kills a version (default: --batches; 0: no W5)")
    parser.add_argument("--w2-calls", type=int, default=500)
    parser.add_argument("--w3-calls", type=int, default=20_000)
    parser.add_argument("--backend", choices=("local", "cluster", "ray"), default="local")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    old_env = dict(item.partition("=")[::2] for item in args.old_env)
    if any(not name for name in old_env) or not all("=" in item for item in args.old_env):
        parser.error(f"--old-env takes NAME=VALUE, not {args.old_env}")
    cluster, on_ray = args.backend == "cluster", args.backend == "ray"
    server = {"local": _SERVER, "cluster": _CLUSTER_SERVER, "ray": _RAY_SERVER}[args.backend]
    local = args.backend == "local"
    w1_batches = 0 if not local else args.batches if args.w1_batches is None else args.w1_batches
    w5_batches = 0 if not local else args.batches if args.w5_batches is None else args.w5_batches
    leftovers: list[str] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-versions-") as scratch:
        old_tree = _tree(args.old, Path(scratch))
        new_tree = Path(args.new).resolve()
        shim = Path(scratch, "bench-only")  # this tree's bench/, and no phalanx beside it
        shim.mkdir()
        (shim / "bench").symlink_to(REPO / "bench", target_is_directory=True)
        _compile([old_tree, new_tree])
        versions: list[Version] = []
        ray_dirs: list[Path] = []  # each version's Ray session directory (short: sockets)
        try:
            for name, tree in (("old", old_tree), ("new", new_tree)):
                env: dict[str, str] = dict(old_env) if name == "old" else {}
                if on_ray:
                    ray_dirs.append(Path(tempfile.mkdtemp(prefix=f"pxv-{name}-", dir="/tmp")))
                    env[RAY_DIR_VARIABLE] = str(ray_dirs[-1])
                versions.append(Version(name, tree, shim, server, env))
            for v in versions:
                print(f"{v.name}: {v.module}", flush=True)
            raw = measure(versions, args.batches, args.w2_calls, args.w3_calls, cluster,
                          w1_batches, w5_batches)
        finally:
            for v in versions:
                v.close()
            if on_ray:
                leftovers = _stop_leftovers(versions, ray_dirs)
                if leftovers and sys.exc_info()[0] is not None:  # not reported below
                    print("left running, killed:", *leftovers, sep="\n  ", file=sys.stderr)
                for directory in ray_dirs:
                    shutil.rmtree(directory, ignore_errors=True)
            if old_tree.parent == Path(scratch):
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(old_tree)], check=False, capture_output=True)
    table = _CLUSTER_ROWS if cluster else _RAY_ROWS if on_ray else _ROWS
    rows = {k: row for k, row in table.items()
            if raw["old"].get(k)}  # a workload given 0 batches has no row
    medians = {k: {name: median(r[k]) for name, r in raw.items()} for k in rows}
    result: dict[str, Any] = {
        "old": args.old, "old_env": old_env, "new": args.new, "backend": args.backend,
        "batches": args.batches,
        "w1_batches": w1_batches, "w5_batches": w5_batches,
        "w2_calls": args.w2_calls, "w3_calls": args.w3_calls, "raw": raw,
        "median": {row[3]: medians[k] for k, row in rows.items()},
        "modules": {v.name: v.module for v in versions},
        "leftover_processes": leftovers,
        "machine": machine_info(),
    }
    print(f"{'workload':<34}{'old':>12}{'new':>12}{'new/old':>10}")
    for k, (label, number, _, _) in rows.items():
        values = medians[k]
        print(f"{label:<34}" + number.format(values["old"]) + number.format(values["new"])
              + f"{values['new'] / values['old']:>10.3f}")
    for k, (_, _, bound, _) in rows.items():
        spread = ", ".join(f"{name} {bound.format(min(r[k]))}..{bound.format(max(r[k]))}"
                           for name, r in raw.items())
        print(f"  {k} range: {spread}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.json}")
    if leftovers:
        print(f"{len(leftovers)} process(es) left running after the servers ended, killed:")
        for text in leftovers:
            print(f"  {text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
