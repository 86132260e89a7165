"""W15: weights by parts, from row-sharded trainers to generators that want column halves.

Four trainer ranks each hold a quarter of every tensor by rows (16 float32 tensors of
4096 x 4096, 1 GiB in all; ``--quick``: 2048 x 2048, 256 MiB), as
``px.Shard(quarter, offset=(r0, 0), full=(4096, 4096))``. Two generator groups of two
ranks each want half of every tensor by columns (rank *r*: ``px.Region((0, r * 2048),
(4096, 2048))``), which their ``load`` copies into tensors of their own. Three ways:

- **sync**: ``px.weight_sync(trainers, [gen_a, gen_b], src_rank="all").push("parts",
  "load", "wanted")``: every trainer sends each generator the box of its quarter that
  the generator wants, point to point;
- **gather+broadcast**, what users do today: the trainers gather the full tensors on
  their rank 0 in their own torch.distributed gloo world (``dist.gather`` of each
  quarter: an FSDP trainer's full state dict on rank 0), then
  ``px.weight_sync(trainers, [gen_a, gen_b], src_rank=0).push("full_state",
  "load_full")``: every generator is handed the whole tensors and copies its half;
- **gloo scatter**, written by hand: ``px.rendezvous`` of the three groups and a
  ``ProcessGroupGloo`` over ``px.joint_store`` on all 8 ranks (built once, untimed);
  each trainer sends each generator the column half of its row quarter (a contiguous
  copy) with gloo ``send``, each generator receives it with ``recv`` straight into the
  rows of its own tensor.

Two placements: **one machine** (the local backend: every rank on it, shared memory
where a transport uses it) and **two nodes**: two ``phalanx agent`` processes on
127.0.0.2 and 127.0.0.3, each a memory domain of its own (``PHALANX_BLOCK_DOMAIN``: no
rank maps the other node's memory, as between machines), the trainers on the first and
both generator groups on the second, so that every byte crosses between the nodes, over
loopback TCP.

Generators are zeroed before each trial and their values checked after it (a grid of
rows and columns, every row quarter's edges among them; untimed). One warm-up trial of
each way (the sync's forming in it), then 3 trials (1 with ``--quick``), order cycling.
Then, on the sync, 3 rounds (1 with ``--quick``) of: a normal push, and a push during
which one generator rank is SIGKILLed from a thread here (0.5, 0.3 and 0.7 of the median
stage into it: before its sources reach it, or while they send), timed until it raises
naming that rank, against the normal pushes' median; the others' values checked; then the
rank recreated and given the current version by ``catch_up``: the bytes each target
received then.

The floor: this machine's memcpy bandwidth (numpy, 256 MiB) and loopback TCP bandwidth
(one connection between two processes, 256 MiB), measured in the same run.

    python -m bench.shardsync [--quick] [--json PATH] [--no-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.handoff import _table, _target
from bench.util import (
    Row,
    clock,
    compile_sources,
    machine_info,
    median,
    reap,
    run_reported,
    settle,
    trial_order,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "shardsync.json"
MiB = 1 << 20
TENSORS = 16
TRAINERS = 4  # ranks, each a row quarter
GENERATORS = 2  # ranks per generator group, each a column half
GROUPS = ("gen-a", "gen-b")
ADDRESSES = ("127.0.0.2", "127.0.0.3")  # the two simulated nodes
WAYS = ("sync", "gather+broadcast", "gloo scatter")
CASES = ("one machine", "two nodes")
FLOOR_BYTES = 256 * MiB
KILL_AT = (0.5, 0.3, 0.7)  # of a normal stage's time, when each round's victim is killed
TIMEOUT = 300.0  # seconds for any one step


# -- the values (the same function on every rank: checked without moving a tensor) -------


def _at(index: int, rows: Any, cols: Any, side: int) -> Any:
    """Tensor ``index``'s values at ``rows`` x ``cols`` (1-d int64 tensors): small whole
    numbers, exact in float32, different along rows, columns and tensors."""
    import torch

    grid = rows.unsqueeze(1) * side + cols.unsqueeze(0)
    return ((grid * 7 + index * 131) % 65521).to(torch.float32)


def _names() -> list[str]:
    return [f"layer{i}.weight" for i in range(TENSORS)]


def _join(world: dict[str, str]) -> tuple[Any, Any]:
    """(store, gloo process group) of a joint world of ``px.rendezvous``; the group needs
    the store kept alive."""
    from datetime import timedelta

    import torch.distributed as dist

    import phalanx as px

    rank, size = int(world["RANK"]), int(world["WORLD_SIZE"])
    store = px.joint_store(world, timeout=120)  # answers only the world's own ranks
    return store, dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=TIMEOUT))


# -- worker classes ----------------------------------------------------------------------


class Trainer:
    """A trainer rank: its row quarter of every tensor."""

    def __init__(self, side: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = int(os.environ["RANK"])
        self.side = side
        self.rows = side // TRAINERS
        self.r0 = self.rank * self.rows
        rows = torch.arange(self.r0, self.r0 + self.rows)
        cols = torch.arange(side)
        self.quarter = {name: _at(i, rows, cols, side) for i, name in enumerate(_names())}
        self.full: dict[str, Any] | None = None
        self.store: Any = None
        self.joint: Any = None

    def parts(self) -> dict[str, Any]:
        """The sync's ``get``: this rank's block of each tensor."""
        import phalanx as px

        return {name: px.Shard(t, offset=(self.r0, 0), full=(self.side, self.side))
                for name, t in self.quarter.items()}

    def init_world(self) -> None:
        """The trainers' own gloo world (``MASTER_ADDR`` / ``MASTER_PORT`` of the group),
        as a trainer that gathers a full state dict has."""
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT))

    def gather(self) -> None:
        """Every tensor's quarters gathered into full tensors on rank 0."""
        import torch
        import torch.distributed as dist

        if self.rank == 0 and self.full is None:
            self.full = {name: torch.empty(self.side, self.side) for name in self.quarter}
        for name, t in self.quarter.items():
            into = list(self.full[name].chunk(TRAINERS)) if self.full is not None else None
            dist.gather(t, into, dst=0)

    def full_state(self) -> dict[str, Any]:
        """The broadcast sync's ``get`` on rank 0: the gathered full tensors."""
        if self.full is None:
            raise RuntimeError("gather() first")
        return self.full

    def join(self, world: dict[str, str]) -> int:
        """The gloo world of the 8 ranks, for the hand-written scatter."""
        self.store, self.joint = _join(world)
        return int(world["RANK"])

    def scatter(self, targets: list[tuple[int, int]]) -> None:
        """Send each target (joint rank, first column) its column half of this quarter."""
        half = self.side // 2
        works, held = [], []
        for tag, t in enumerate(self.quarter.values()):
            for dst, c0 in targets:
                box = t[:, c0:c0 + half].contiguous()
                held.append(box)
                works.append(self.joint.send([box], dst, tag))
        for work in works:
            work.wait()

    def pid(self) -> int:
        return os.getpid()


class Generator:
    """A generator rank: its column half of every tensor, in tensors of its own."""

    def __init__(self, side: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = int(os.environ["RANK"])
        self.side = side
        self.half = side // GENERATORS
        self.c0 = self.rank * self.half
        self.weights = {name: torch.zeros(side, self.half) for name in _names()}
        self.received = 0  # bytes handed to the last load / received by the last recv
        self.load_s = 0.0  # the last load's copying
        self.store: Any = None
        self.joint: Any = None

    def wanted(self) -> dict[str, Any]:
        """The sync's ``want``: the column half of every tensor."""
        import phalanx as px

        return {name: px.Region((0, self.c0), (self.side, self.half)) for name in self.weights}

    def load(self, state: dict[str, Any]) -> None:
        """The sync's ``set``: the regions, copied into this rank's tensors."""
        began = time.perf_counter()
        received = 0
        for name, t in state.items():
            self.weights[name].copy_(t)
            received += t.nbytes
        self.received = received
        self.load_s = time.perf_counter() - began

    def load_full(self, state: dict[str, Any]) -> None:
        """The broadcast sync's ``set``: whole tensors, of which this rank copies its
        half."""
        import warnings

        received = 0
        with warnings.catch_warnings():  # tensors on read-only shared pages: copied here
            warnings.simplefilter("ignore")
            for name, t in state.items():
                self.weights[name].copy_(t[:, self.c0:self.c0 + self.half])
                received += t.nbytes
        self.received = received

    def join(self, world: dict[str, str]) -> int:
        """The gloo world of the 8 ranks, for the hand-written scatter."""
        self.store, self.joint = _join(world)
        return int(world["RANK"])

    def gather_recv(self, sources: list[tuple[int, int]]) -> None:
        """Receive from each source (joint rank, first row) its rows of this half."""
        rows = self.side // TRAINERS
        works = []
        received = 0
        for tag, t in enumerate(self.weights.values()):
            for src, r0 in sources:
                into = t[r0:r0 + rows]  # contiguous: whole rows of this rank's tensor
                works.append(self.joint.recv([into], src, tag))
                received += into.nbytes
        for work in works:
            work.wait()
        self.received = received

    def reset(self) -> None:
        for t in self.weights.values():
            t.zero_()
        self.received = 0

    def got(self) -> int:
        return self.received

    def load_seconds(self) -> float:
        return self.load_s

    def check(self) -> int:
        """How many values of a grid (every 61st row, every quarter's first and last row,
        every 67th column and the last) differ from the trainers'."""
        import torch

        quarters = self.side // TRAINERS
        edges = [q * quarters for q in range(TRAINERS)] + [q * quarters - 1
                                                           for q in range(1, TRAINERS + 1)]
        rows = torch.unique(torch.cat([torch.arange(0, self.side, 61), torch.tensor(edges)]))
        cols = torch.unique(torch.cat([torch.arange(0, self.half, 67),
                                       torch.tensor([self.half - 1])]))
        bad = 0
        for i, t in enumerate(self.weights.values()):
            want = _at(i, rows, cols + self.c0, self.side)
            bad += int((t[rows][:, cols] != want).sum())
        return bad

    def pid(self) -> int:
        return os.getpid()


# -- the floor ------------------------------------------------------------------------------


def _memcpy_gbps() -> float:
    import numpy as np

    src = np.ones(FLOOR_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(4):
        began = clock()
        np.copyto(dst, src)
        best = min(best, clock() - began)
    return FLOOR_BYTES / best / 1e9


_SENDER = """
import socket, sys
port, size, reps = map(int, sys.argv[1:])
data = memoryview(bytearray(b"x" * size))
with socket.create_connection(("127.0.0.1", port)) as sock:
    for _ in range(reps):
        sock.sendall(data)
        sock.recv(1)
"""


def _loopback_gbps(reps: int = 4) -> float:
    """One TCP connection over 127.0.0.1 from a child process to this one: the best of
    ``reps`` transfers of 256 MiB (each acknowledged before the next)."""
    buffer = bytearray(FLOOR_BYTES)
    view = memoryview(buffer)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(FLOOR_BYTES),
                                  str(reps)], stdin=subprocess.DEVNULL)
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                best = float("inf")
                for _ in range(reps):
                    got = 0
                    began = clock()
                    while got < FLOOR_BYTES:
                        n = conn.recv_into(view[got:])
                        if not n:
                            raise RuntimeError("the loopback sender closed early")
                        got += n
                    best = min(best, clock() - began)
                    conn.sendall(b"k")
        finally:
            reap([child])
    return FLOOR_BYTES / best / 1e9


# -- two simulated nodes --------------------------------------------------------------------


@contextmanager
def _agents(addresses: Sequence[str] = ADDRESSES) -> Iterator[list[str]]:
    """A ``phalanx agent`` process on each of ``addresses`` (default: 127.0.0.2 and .3),
    each a memory domain of its own; yields their ``host:port`` (the token file is
    ``_agents.token_file``)."""
    from bench.cluster import _free_port

    root = Path(__file__).resolve().parent.parent
    directory = tempfile.mkdtemp(prefix="phalanx-bench-")
    token_file = os.path.join(directory, "token")
    Path(token_file).write_text(secrets.token_urlsafe(32))
    os.chmod(token_file, 0o600)
    procs, hosts = [], []
    try:
        for i, host in enumerate(addresses):
            port = _free_port(host)
            env = {**os.environ, "PHALANX_BLOCK_DOMAIN": f"bench-node-{i}-{os.getpid()}",
                   "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
                 "--no-http", "--token-file", token_file],
                env=env, cwd=root, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            hosts.append(f"{host}:{port}")
        deadline = time.monotonic() + 30
        while not all(_listening(h) for h in hosts):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the benchmark's agents did not start")
            time.sleep(0.1)
        _agents.token_file = token_file  # type: ignore[attr-defined]
        yield hosts
    finally:
        for proc in procs:
            proc.terminate()
        reap(procs)
        os.unlink(token_file)
        os.rmdir(directory)


def _listening(hostport: str) -> bool:
    host, port = hostport.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


# -- one placement --------------------------------------------------------------------------


def _measure(case: str, side: int, trials: int, out: dict[str, Any],
             backends: Callable[[str], Any]) -> None:
    """Every way on one placement, then the kill and the catch-up, into ``out``."""
    import phalanx as px
    from bench.shardsync import Generator, Trainer

    region_bytes = TENSORS * side * (side // GENERATORS) * 4
    suffix = "local" if case == CASES[0] else "nodes"
    with px.WorkerGroup(Trainer, args=(side,), procs_per_node=TRAINERS,
                        backend=backends("trainers"), echo_output=False,
                        name=f"trainers-{suffix}") as trainers, \
            px.WorkerGroup(Generator, args=(side,), procs_per_node=GENERATORS,
                           backend=backends("generators"), echo_output=False,
                           name=f"{GROUPS[0]}-{suffix}") as gen_a, \
            px.WorkerGroup(Generator, args=(side,), procs_per_node=GENERATORS,
                           backend=backends("generators"), echo_output=False,
                           name=f"{GROUPS[1]}-{suffix}") as gen_b:
        gens = [gen_a, gen_b]
        # untimed set-up: the trainers' own world (for the gather), the joint world of all
        trainers.call("init_world", timeout=TIMEOUT)
        worlds = px.rendezvous(trainers, gen_a, gen_b)
        joined = [g.map_async("join", w) for g, w in zip([trainers, *gens], worlds, strict=True)]
        for future in joined:
            future.result(timeout=TIMEOUT)
        half = side // GENERATORS
        scatter_to = [(TRAINERS + g * GENERATORS + r, r * half)
                      for g in range(len(gens)) for r in range(GENERATORS)]
        scatter_from = [(t, t * (side // TRAINERS)) for t in range(TRAINERS)]
        sync = px.weight_sync(trainers, gens, src_rank="all", timeout=TIMEOUT)
        old = px.weight_sync(trainers, gens, src_rank=0, timeout=TIMEOUT)

        def by_parts() -> dict[str, Any]:
            stats = sync.push("parts", "load", "wanted")
            return {"stage_s": stats.stage_s, "apply_s": stats.apply_s, "plan_s": stats.plan_s,
                    "push_s": stats.total_s, "transport": stats.transport,
                    "per_target": {f"{k[0]}/{k[1]}": v for k, v in stats.per_target.items()}}

        def gather_broadcast() -> dict[str, Any]:
            began = clock()
            trainers.call("gather", timeout=TIMEOUT)
            gathered = clock() - began
            stats = old.push("full_state", "load_full")
            return {"gather_s": gathered, "push_s": stats.total_s,
                    "transport": stats.transport}

        def scatter() -> dict[str, Any]:
            futures = [trainers.call_async("scatter", scatter_to),
                       *(g.call_async("gather_recv", scatter_from) for g in gens)]
            for future in futures:
                future.result(timeout=TIMEOUT)
            return {}

        ways: dict[str, Callable[[], dict[str, Any]]] = {
            "sync": by_parts, "gather+broadcast": gather_broadcast, "gloo scatter": scatter}

        def checked(where: str, groups: list[tuple[Any, list[int]]]) -> list[int]:
            got = []
            for group, ranks in groups:
                bad = group.call("check", workers=ranks, timeout=TIMEOUT)
                if any(bad):
                    raise AssertionError(f"W15 {case}, {where}: {group.name} ranks {ranks} "
                                         f"hold {bad} wrong values")
                got += group.call("got", workers=ranks)
            return got

        trials_out: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for trial in range(-1, trials):  # trial -1: a warm-up of each way, untimed
            for name in trial_order(list(WAYS), max(trial, 0)):
                for g in gens:
                    g.call("reset")
                settle()
                began = clock()
                info = ways[name]()
                took = clock() - began
                info["seconds"] = took
                info["received"] = checked(name, [(g, list(range(GENERATORS))) for g in gens])
                if name == "sync":  # the longest of the targets' own copying in their set
                    info["set_s"] = max(s for g in gens for s in g.call("load_seconds"))
                if trial >= 0:
                    trials_out[name].append(info)
                print(f"  W15 {case}, {name}: {took:.3f} s"
                      f"{' (warm-up)' if trial < 0 else ''}", file=sys.stderr, flush=True)
        out["trials"] = trials_out
        out["region_bytes"] = region_bytes

        # generators SIGKILLed mid-stage, then recreated and caught up, round by round
        victims = [(gen_b, 0), (gen_a, 1), (gen_b, 1)]
        out["kills"], out["catch_ups"] = [], []
        normals = list(trials_out["sync"])  # the pushes a kill's push is compared with
        for round_, fraction in enumerate(KILL_AT[:max(trials, 1)]):
            group, rank = victims[round_ % len(victims)]
            kill, up = _kill_round(case, sync, gens, group, rank, fraction, normals, by_parts,
                                   checked, region_bytes)
            out["kills"].append(kill)
            out["catch_ups"].append(up)
        sync.close()
        old.close()


def _kill_round(case: str, sync: Any, gens: list[Any], group: Any, rank: int,
                fraction: float, pushes: list[dict[str, Any]],
                by_parts: Callable[[], dict[str, Any]],
                checked: Callable[[str, list[tuple[Any, list[int]]]], list[int]],
                region_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A normal push, then a push during which rank ``rank`` of ``group`` is SIGKILLed
    (from a thread here, ``fraction`` of the normal stages' median into it), then that
    rank recreated and caught up: (the kill's record, the catch-up's)."""
    import phalanx as px

    everyone = [(g, list(range(GENERATORS))) for g in gens]
    for g in gens:
        g.call("reset")
    settle()
    began = clock()
    normal = by_parts()
    normal["seconds"] = clock() - began
    checked("the push before a kill", everyone)
    pushes.append(normal)  # one more sample of a normal push, next to the kill
    victim = f"{group.name}/{rank}"
    pid = group.call_one(rank, "pid")
    for g in gens:
        g.call("reset")
    settle()
    delay = fraction * (median([p["stage_s"] for p in pushes]) or 0.0)
    timer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
    kill: dict[str, Any] = {"baseline_push_s": median([p["seconds"] for p in pushes]),
                            "killed_after_s": delay, "fraction_of_stage": fraction,
                            "victim": victim}
    began = clock()
    timer.start()
    try:
        sync.push("parts", "load", "wanted")
    except px.PhalanxError as exc:
        kill["seconds"] = clock() - began
        stats = getattr(exc, "stats", None)
        kill["failed"] = [f"{k[0]}/{k[1]}" for k in getattr(exc, "failed", {})]
        kill["per_target"] = ({} if stats is None else
                              {f"{k[0]}/{k[1]}": v for k, v in stats.per_target.items()})
        if stats is not None:
            kill.update(stage_s=stats.stage_s, apply_s=stats.apply_s, push_s=stats.total_s)
        kill["error"] = str(exc).splitlines()[0][:400]
    else:
        kill["seconds"] = clock() - began
        kill["failed"], kill["per_target"] = [], {}
        kill["error"] = "the push completed: the kill came after it"
    finally:
        timer.join()
    others = [(g, [r for r in range(GENERATORS) if g is not group or r != rank]) for g in gens]
    checked("the others, after a kill", others)
    kill["others_ok"] = kill["failed"] == [victim] and all(
        kill["per_target"].get(f"{g.name}/{r}") == region_bytes
        for g, ranks in others for r in ranks)
    print(f"  W15 {case}, {victim} killed {delay:.3f} s into a push: {kill['seconds']:.3f} s "
          f"(a normal push {normal['seconds']:.3f} s)", file=sys.stderr, flush=True)

    # recreated, it catches up: it alone receives the current version
    deadline = time.monotonic() + 30
    while group.health()[rank].alive and time.monotonic() < deadline:
        time.sleep(0.05)
    group.recreate([rank])
    settle()
    began = clock()
    stats = sync.catch_up("parts", "load", "wanted")
    up = {"seconds": clock() - began, "plan_s": stats.plan_s, "victim": victim,
          "per_target": {f"{k[0]}/{k[1]}": v for k, v in stats.per_target.items()}}
    checked("the recreated generator, after catch_up", [(group, [rank])])
    return kill, up


# -- report -------------------------------------------------------------------------------


def _rows(results: dict[str, dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    for case, res in results.items():
        trials = res.get("trials", {})
        region = res.get("region_bytes", 0)

        def row(key: str, label: str, unit: str, better: str = "lower", case: str = case
                ) -> Row:
            made = Row(f"W15.{case}.{key}", f"{case}: {label}", unit, better)
            rows.append(made)
            return made

        total = row("time", "time, every generator its half", "s")
        gathered = row("gather", "  of which the gather to trainer 0", "s")
        low = row("received_min", "MiB received per target, min", "MiB")
        high = row("received_max", "MiB received per target, max", "MiB")
        stage = row("stage", "the sync's stage", "s")
        apply = row("apply", "the sync's apply (the pause)", "s")
        copy = row("set", "  of which the set's own copy (max)", "s")
        share = row("apply_share", "apply / push", "%")
        own = row("apply_own_share", "apply less the set's own copy / push", "%")
        for way, infos in trials.items():
            for info in infos:
                total.add(way, info["seconds"])
                got = [b / MiB for b in info["received"]]
                low.add(way, min(got))
                high.add(way, max(got))
                if "gather_s" in info:
                    gathered.add(way, info["gather_s"])
                if way == "sync":
                    stage.add(way, info["stage_s"])
                    apply.add(way, info["apply_s"])
                    copy.add(way, info["set_s"])
                    share.add(way, 100 * info["apply_s"] / info["push_s"])
                    own.add(way, 100 * max(0.0, info["apply_s"] - info["set_s"])
                            / info["push_s"])
        low.raw = {k: [min(v)] for k, v in low.raw.items()}  # the least of any trial
        high.agg = "max"
        sync_s, old_s = total.value("sync"), total.value("gather+broadcast")
        speed = row("speedup", "gather+broadcast time / sync time", "x", "higher")
        if sync_s and old_s:
            speed.add("sync", old_s / sync_s)
        if res.get("kills"):
            kills = res["kills"]
            killed = row("kill", "push, one generator SIGKILLed mid-stage", "s")
            ratio = row("kill_ratio", "  / a normal push", "x")
            for kill in kills:
                killed.add("sync", kill["seconds"])
                ratio.add("sync", kill["seconds"] / kill["baseline_push_s"])
        if res.get("catch_ups"):
            ups = res["catch_ups"]
            taken = row("catch_up", "catch_up of the recreated generator", "s")
            mib = row("catch_up_mib", "  MiB received, by every target", "MiB")
            count = row("catch_up_targets", "  targets that received bytes", "ranks")
            for up in ups:
                taken.add("sync", up["seconds"])
                mib.add("sync", sum(up["per_target"].values()) / MiB)
                count.add("sync", len(up["per_target"]))
        row("region", "a target's region", "MiB").add("sync", region / MiB)
    return [r for r in rows if r.raw]


def _targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for case, res in results.items():
        region = res.get("region_bytes", 0)
        syncs = res.get("trials", {}).get("sync", [])
        got = [b for info in syncs for b in info["received"]]
        counted = [b for info in syncs for b in info["per_target"].values()]
        ok = None if not got else all(abs(b - region) <= 0.02 * region for b in got + counted)
        targets.append(_target(f"W15 {case}: every target received its region's bytes, "
                               "+-2% (the sync)", ok))
        # The pause the sync imposes: apply, less the target's own set() (here a copy of its
        # regions into tensors of its own, 512 MiB per generator at 1 GiB, which a set()
        # that keeps the tensors it is given does not pay). Both are in the table.
        shares = [max(0.0, info["apply_s"] - info["set_s"]) / info["push_s"]
                  for info in syncs]
        targets.append(_target(f"W15 {case}: the apply pause, less set()'s own copy, < 10% "
                               "of the push", None if not shares
                               else (median(shares) or 0.0) < 0.10))
        kills = res.get("kills") or []
        ratios = [k["seconds"] / k["baseline_push_s"] for k in kills]
        targets.append(_target(
            f"W15 {case}: with a generator SIGKILLed mid-stage, the others within 1.2x of "
            "a normal push (median over kills), and only it failed",
            None if not kills else all(k["others_ok"] for k in kills)
            and (median(ratios) or 0.0) <= 1.2))
        ups = res.get("catch_ups") or []
        targets.append(_target(
            f"W15 {case}: catch_up sends the recreated generator its region's bytes only",
            None if not ups else all(u["per_target"] == {u["victim"]: region} for u in ups)))
    nodes = results.get(CASES[1], {}).get("trials", {})
    sync_s = median([t["seconds"] for t in nodes.get("sync", [])])
    old_s = median([t["seconds"] for t in nodes.get("gather+broadcast", [])])
    targets.append(_target(f"W15 {CASES[1]}: the sync at least 2x faster than "
                           "gather+broadcast",
                           None if sync_s is None or old_s is None else old_s >= 2 * sync_s))
    return targets


def main(argv: list[str] | None = None) -> int:
    compile_sources()
    parser = argparse.ArgumentParser(prog="python -m bench.shardsync",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="256 MiB instead of 1 GiB, one trial (about a minute)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-cluster", action="store_true",
                        help="one machine only, no agents")
    args = parser.parse_args(argv)
    side, trials = (2048, 1) if args.quick else (4096, 3)
    total_mib = TENSORS * side * side * 4 // MiB
    info = machine_info()
    notes: list[str] = []
    errors: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        import torch  # noqa: F401
    except ImportError:
        print("W15 needs torch: pip install torch", file=sys.stderr)
        return 1

    def attempt(where: str, fn: Callable[[], None]) -> None:
        run_reported(errors, where, fn)

    print("W15 floor: memcpy and loopback bandwidth ...", file=sys.stderr, flush=True)
    floor = {"memcpy_gbps": _memcpy_gbps(), "loopback_gbps": _loopback_gbps()}
    print(f"W15 on one machine, {total_mib} MiB ...", file=sys.stderr, flush=True)
    results[CASES[0]] = {}
    attempt(f"W15 {CASES[0]}", lambda: _measure(CASES[0], side, trials, results[CASES[0]],
                                                lambda _: "local"))
    if args.no_cluster:
        notes.append(f"W15 {CASES[1]} skipped: --no-cluster")
    else:
        print(f"W15 on two nodes ({', '.join(ADDRESSES)}), {total_mib} MiB ...",
              file=sys.stderr, flush=True)
        results[CASES[1]] = {}

        def two_nodes() -> None:
            import phalanx as px

            with _agents() as hosts:
                token = _agents.token_file  # type: ignore[attr-defined]

                def backend(role: str) -> Any:
                    host = hosts[0] if role == "trainers" else hosts[1]
                    return px.ClusterBackend([host], token_file=token)

                _measure(CASES[1], side, trials, results[CASES[1]], backend)

        attempt(f"W15 {CASES[1]}", two_nodes)

    rows = _rows(results)
    print()
    if rows:
        _table(f"W15: {total_mib} MiB from {TRAINERS} trainer ranks (row quarters) to "
               f"{len(GROUPS)} x {GENERATORS} generator ranks (column halves); median over "
               f"{trials} trial{'s' if trials > 1 else ''}", rows, list(WAYS))
    moved = len(GROUPS) * GENERATORS * total_mib * MiB // GENERATORS  # the targets' bytes
    print(f"\nFloor: memcpy {floor['memcpy_gbps']:.2f} GB/s, loopback TCP (one connection) "
          f"{floor['loopback_gbps']:.2f} GB/s; the targets' {moved / MiB:.0f} MiB once at "
          f"memcpy speed: {moved / 1e9 / floor['memcpy_gbps']:.3f} s, over one loopback "
          f"connection: {moved / 1e9 / floor['loopback_gbps']:.3f} s")
    for case, res in results.items():
        for kill in res.get("kills") or []:
            print(f"{case}: {kill['victim']} killed {kill['killed_after_s']:.3f} s into a "
                  f"push: {kill['error']}")
    print("\nTargets")
    targets = _targets(results)
    for note in notes:
        print(f"note: {note}")
    for error in errors:
        print(f"error: {error}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "finished_unix_time": time.time(), "quick": args.quick, "trials": trials,
        "total_mib": total_mib, "machine": info, "load_avg_at_end": os.getloadavg(),
        "floor": floor,
        "rows": [{"key": r.key, "label": r.label, "unit": r.unit,
                  "values": {n: r.value(n) for n in r.raw}, "raw": r.raw} for r in rows],
        "results": results, "targets": targets, "notes": notes, "errors": errors,
    }, indent=1, default=str))
    print(f"JSON: {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
