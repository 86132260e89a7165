"""W10: the cluster backend at scale, simulated: 10, 100 and 1,000 nodes, flat and tree.

``python -m bench.scale [--sizes 10,100,1000] [--calls N] [--out DIR]``

Every node is a real agent (``bench.simagents``: its own loopback address, listener,
token handshake and relay; in a tree, real adoption and forwarding) whose one rank is
simulated in-process, so that 1,000 nodes fit on a 2-core machine. ``PROCESSES`` processes
hold the agents; node ``i`` lives in process ``i % PROCESSES``, so even 10 nodes are spread
over all of them.

For each size, a group with one rank per node runs on ``px.ClusterBackend`` twice: *flat*
(``tree_threshold`` above the size: the controller connects to every agent) and *tree*
(``tree_threshold=1, fanout=50``: at most 50 connections, the agents adopting the rest).
Measured, each the median over the calls:

- a no-op call on every rank (ms), the controller's own CPU time per call (ms), and the
  CPU time all the agents' processes together spend per call (ms, the mean);
- a 1 MiB ``bytes`` argument sent to every rank, each returning its length (ms);
- the TCP connections the controller holds to agents (counted by psutil);
- group start-up (s).

It prints a table, writes JSON and a PNG (latency against node count) under ``--out``,
and checks the targets: in tree mode at most ``fanout`` connections, and a call to 1,000
nodes at most 3x a call to 10 nodes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import psutil

from bench.util import compile_sources, reap

PROCESSES = 8
FANOUT = 50
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


class Sim:
    """The simulated ranks' object."""

    def noop(self) -> None:
        return None

    def size(self, data: bytes) -> int:
        return len(data)


def addresses(count: int) -> list[str]:
    """``count`` loopback addresses outside 127.0.0.x (the tests' range)."""
    return [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(count)]


class SimCluster:
    """``count`` simulated agents over ``PROCESSES`` processes; ``hosts`` in node order."""

    def __init__(self, count: int) -> None:
        fd, self.token_file = tempfile.mkstemp(prefix="phalanx-bench-token-")
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        spread: list[list[str]] = [[] for _ in range(PROCESSES)]
        for i, address in enumerate(addresses(count)):
            spread[i % PROCESSES].append(address)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "bench.simagents", "--token-file", self.token_file, *part],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env, text=True)
            for part in spread if part]
        listed = [json.loads(p.stdout.readline()) for p in self.procs]  # type: ignore[union-attr]
        self.hosts = [listed[i % len(listed)][i // len(listed)] for i in range(count)]

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()  # type: ignore[union-attr]
        reap(self.procs)
        os.unlink(self.token_file)

    def cpu_seconds(self) -> float:
        """The CPU time the agents' processes have used so far."""
        total = 0.0
        for proc in self.procs:
            times = psutil.Process(proc.pid).cpu_times()
            total += times.user + times.system
        return total


def agent_connections(ports: set[int]) -> int:
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in ports)


def measure(cluster: SimCluster, nodes: int, tree: bool, calls: int) -> dict[str, Any]:
    import phalanx as px

    hosts = cluster.hosts[:nodes]
    backend = px.ClusterBackend(hosts, token_file=cluster.token_file,
                                tree_threshold=1 if tree else nodes + 1, fanout=FANOUT,
                                heartbeat_timeout=120, quorum_timeout=120)
    started = time.perf_counter()
    group = px.WorkerGroup(Sim, nodes=nodes, backend=backend, heartbeat_timeout=None,
                           straggler_warning=None, echo_output=False, start_timeout=600)
    startup = time.perf_counter() - started
    try:
        connections = agent_connections({int(h.rsplit(":", 1)[1]) for h in hosts})
        for _ in range(5):
            group.call("noop")
        noop, cpu = [], []
        agents_before, started = cluster.cpu_seconds(), time.perf_counter()
        while len(noop) < calls or time.perf_counter() - started < 1.0:  # CPU times tick
            c0, t0 = time.process_time(), time.perf_counter()  # every 10 ms: a second at
            group.call("noop")  # least, for the agents' mean
            noop.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        agents_cpu = (cluster.cpu_seconds() - agents_before) / len(noop)
        data = bytes(MIB)
        assert group.call("size", data) == [MIB] * nodes
        broadcast = []
        for _ in range(max(5, calls // 4)):
            t0 = time.perf_counter()
            group.call("size", data)
            broadcast.append(time.perf_counter() - t0)
    finally:
        group.shutdown()
    return {"nodes": nodes, "mode": "tree" if tree else "flat", "startup_s": startup,
            "connections": connections, "noop_ms": median(noop) * 1e3,
            "controller_cpu_ms": median(cpu) * 1e3, "agents_cpu_ms": agents_cpu * 1e3,
            "broadcast_1mib_ms": median(broadcast) * 1e3}


def table(results: list[dict[str, Any]]) -> str:
    head = ("nodes", "mode", "start-up s", "connections", "no-op ms", "controller CPU ms",
            "agents CPU ms", "1 MiB broadcast ms")
    keys = ("nodes", "mode", "startup_s", "connections", "noop_ms", "controller_cpu_ms",
            "agents_cpu_ms", "broadcast_1mib_ms")
    rows = [[f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def targets(results: list[dict[str, Any]]) -> list[tuple[str, float, bool]]:
    by = {(r["nodes"], r["mode"]): r for r in results}
    checks = []
    for (nodes, mode), r in sorted(by.items()):
        if mode == "tree":
            checks.append((f"tree, {nodes} nodes: controller connections <= {FANOUT}",
                           r["connections"], r["connections"] <= FANOUT))
    small, large = by.get((10, "tree")), by.get((1000, "tree"))
    if small and large:
        for key, what in (("noop_ms", "no-op call"), ("controller_cpu_ms", "controller CPU"),
                          ("broadcast_1mib_ms", "1 MiB broadcast")):
            ratio = large[key] / small[key]
            checks.append((f"tree: {what} at 1000 nodes / at 10 nodes <= 3", ratio,
                           ratio <= 3.0))
    return checks


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install 'phalanx[bench]' for matplotlib)")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "noop_ms", "no-op call"),
                           (axes[1], "broadcast_1mib_ms", "1 MiB to every rank")):
        for mode, style in (("flat", "o--"), ("tree", "s-")):
            points = sorted((r["nodes"], r[key]) for r in results if r["mode"] == mode)
            if points:
                ax.plot(*zip(*points, strict=True), style, label=mode)
        if key == "noop_ms":
            points = sorted((r["nodes"], r["controller_cpu_ms"]) for r in results
                            if r["mode"] == "tree")
            if points:
                ax.plot(*zip(*points, strict=True), "^:", label="tree: controller CPU")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes (one rank each)")
        ax.set_ylabel("ms per call (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"phalanx cluster backend, simulated nodes on {os.cpu_count()} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> None:
    compile_sources()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    import logging

    logging.getLogger("phalanx").setLevel(logging.ERROR)
    cluster = SimCluster(max(sizes))
    results = []
    try:
        for nodes in sizes:
            for tree in (False, True):
                result = measure(cluster, nodes, tree, args.calls)
                print(f"  {nodes} nodes, {result['mode']}: no-op {result['noop_ms']:.2f} ms",
                      file=sys.stderr, flush=True)
                results.append(result)
    finally:
        cluster.close()
    print(table(results))
    print("\ntargets:")
    checks = targets(results)
    for label, value, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}: {value:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    png = args.out / f"scale-{stamp}.png"
    drawn = plot(results, png)
    payload = {"timestamp": stamp, "cpus": os.cpu_count(), "processes": PROCESSES,
               "fanout": FANOUT, "calls": args.calls, "results": results,
               "targets": [{"target": t, "value": v, "pass": ok} for t, v, ok in checks],
               "plot": str(png) if drawn else None}
    path = args.out / "scale-latest.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nJSON: {path}" + (f"\nplot: {png}" if drawn else ""))


if __name__ == "__main__":
    main()
