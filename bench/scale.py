"""W10: the cluster backend at scale, simulated: 10, 100 and 1,000 nodes, flat and tree.

``python -m bench.scale [--sizes 10,100,1000,1000x10] [--ranks-per-node R] [--modes flat,tree]
[--calls N] [--out DIR]``

A size is a number of nodes, with ``--ranks-per-node`` ranks each (1 unless given), or
``NODESxRANKS``: ``1000x10`` is 10,000 ranks on 1,000 nodes.

Every node is a real agent (``bench.simagents``: its own loopback address, listener,
token handshake and relay; in a tree, real adoption and forwarding) whose one rank is
simulated in-process, so that 1,000 nodes fit on a 2-core machine. ``PROCESSES`` processes
hold the agents; node ``i`` lives in process ``i % PROCESSES``, so even 10 nodes are spread
over all of them.

For each size, a group runs on ``px.ClusterBackend`` twice: *flat* (``tree_threshold``
above the size: the controller connects to every agent) and *tree* (``tree_threshold=1,
fanout=50``, the backend's default ``top_fanout``: the controller holds at most 4
connections, each agent adopts up to 50 of the rest). Measured, each the
median over the calls:

- a no-op call on every rank (ms), the controller's own CPU time per call (ms, and per
  rank in us: ``time.process_time()`` around the call, every thread of the controller),
  and the CPU time all the agents' processes together spend per call (ms, the mean);
- a 1 MiB ``bytes`` argument sent to every rank, each returning its length (ms), and the
  bytes each link carried per such call (MiB: every agent's bytes received from whoever
  is above it, the most of them -- 1.0 when the argument crosses each link once);
- the TCP connections the controller holds to agents (counted by psutil);
- group start-up (s), and the controller's CPU time during it (s).

It prints a table, writes JSON and a PNG (latency against node count) under ``--out``,
and checks the targets: in tree mode at most ``top_fanout`` connections; a no-op call to
1,000 nodes at most 1 ms of the controller's CPU, to 10,000 ranks at most 2 ms; 1,000
nodes started in at most 2 s of its CPU; a broadcast crossing each link once; and a call
to 1,000 nodes at most 3x a call to 10 nodes.
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
TOP = 4  # the controller's connections in a tree: the backend's default top_fanout
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

    def received_bytes(self) -> dict[str, int]:
        """Per agent (``host:port``), the bytes it has received from above so far: from the
        controller, or its parent agent in a tree."""
        totals: dict[str, int] = {}
        for proc in self.procs:
            proc.stdin.write("bytes\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        for proc in self.procs:
            totals.update(json.loads(proc.stdout.readline()))  # type: ignore[union-attr]
        return totals

    def stop_agent(self, host: str) -> None:
        """Stop the agent at ``host`` (``host:port``) as if its machine went: its
        connections end, to the controller or its parent and to its children."""
        proc = self.procs[self.hosts.index(host) % len(self.procs)]
        proc.stdin.write(f"stop {host}\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert json.loads(proc.stdout.readline()) == f"stopped {host}"  # type: ignore[union-attr]

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


def descriptors_short(nodes: int, ranks: int) -> str | None:
    """Why this process cannot hold a group of ``ranks`` ranks on ``nodes`` nodes (None: it
    can): the controller keeps one descriptor per connection (at most ``nodes``), and a
    rank's output pipes only once it prints (phalanx.backends.cluster.link.AgentRankChannel:
    the simulated ranks print nothing). The soft limit is raised to the hard one first."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = nodes + 512
    if soft < needed and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    return f"{ranks} ranks need about {needed} descriptors here; the limit is {soft}"


def measure(cluster: SimCluster, nodes: int, tree: bool, calls: int,
            ranks_per_node: int = 1) -> dict[str, Any]:
    import phalanx as px

    hosts = cluster.hosts[:nodes]
    ranks = nodes * ranks_per_node
    backend = px.ClusterBackend(hosts, token_file=cluster.token_file,
                                tree_threshold=1 if tree else nodes + 1, fanout=FANOUT,
                                top_fanout=TOP,
                                heartbeat_timeout=120, quorum_timeout=120,
                                node_timeout=120)  # 1 GiB through loopback, flat: slow
    started, cpu_started = time.perf_counter(), time.process_time()
    group = px.WorkerGroup(Sim, nodes=nodes, procs_per_node=ranks_per_node, backend=backend,
                           heartbeat_timeout=None, straggler_warning=None, echo_output=False,
                           start_timeout=600)
    startup = time.perf_counter() - started
    startup_cpu = time.process_time() - cpu_started
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
        assert group.call("size", data) == [MIB] * ranks
        broadcast = []
        received = cluster.received_bytes()
        for _ in range(max(5, calls // 4)):
            t0 = time.perf_counter()
            group.call("size", data)
            broadcast.append(time.perf_counter() - t0)
        after = cluster.received_bytes()
        per_link = [(after.get(h, 0) - received.get(h, 0)) / len(broadcast) / MIB
                    for h in hosts]
    finally:
        group.shutdown()
    return {"nodes": nodes, "ranks": ranks, "mode": "tree" if tree else "flat",
            "startup_s": startup, "startup_cpu_s": startup_cpu, "connections": connections,
            "noop_ms": median(noop) * 1e3, "controller_cpu_ms": median(cpu) * 1e3,
            "controller_cpu_per_rank_us": median(cpu) * 1e6 / ranks,
            "agents_cpu_ms": agents_cpu * 1e3, "broadcast_1mib_ms": median(broadcast) * 1e3,
            "broadcast_mib_per_link": max(per_link)}


def table(results: list[dict[str, Any]]) -> str:
    head = ("nodes", "ranks", "mode", "start-up s", "start-up CPU s", "connections",
            "no-op ms", "controller CPU ms", "CPU/rank us", "agents CPU ms",
            "1 MiB broadcast ms", "MiB/link")
    keys = ("nodes", "ranks", "mode", "startup_s", "startup_cpu_s", "connections", "noop_ms",
            "controller_cpu_ms", "controller_cpu_per_rank_us", "agents_cpu_ms",
            "broadcast_1mib_ms", "broadcast_mib_per_link")
    rows = [[f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def targets(results: list[dict[str, Any]]) -> list[tuple[str, float, bool]]:
    by = {(r["nodes"], r["ranks"], r["mode"]): r for r in results}
    checks = []
    for (nodes, ranks, mode), r in sorted(by.items()):
        if mode == "tree":
            checks.append((f"tree, {ranks} ranks on {nodes} nodes: controller connections "
                           f"<= {TOP}", r["connections"], r["connections"] <= TOP))
    for (_, ranks, mode), r in sorted(by.items()):
        checks.append((f"{mode}, {ranks} ranks: a 1 MiB argument crosses each link once "
                       "(MiB per link per call <= 1.05)", r["broadcast_mib_per_link"],
                       r["broadcast_mib_per_link"] <= 1.05))
    for key, most in (((1000, 1000, "tree"), 1.0), ((1000, 10000, "tree"), 2.0)):
        r = by.get(key)
        if r is not None:
            checks.append((f"tree, {key[1]} ranks on {key[0]} nodes: controller CPU per "
                           f"no-op call <= {most:g} ms", r["controller_cpu_ms"],
                           r["controller_cpu_ms"] <= most))
    r = by.get((1000, 1000, "tree"))
    if r is not None:
        checks.append(("tree, 1000 nodes: start-up in <= 2 s of the controller's CPU",
                       r["startup_cpu_s"], r["startup_cpu_s"] <= 2.0))
    small, large = by.get((10, 10, "tree")), by.get((1000, 1000, "tree"))
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
            points = sorted((r["ranks"], r[key]) for r in results if r["mode"] == mode)
            if points:
                ax.plot(*zip(*points, strict=True), style, label=mode)
        if key == "noop_ms":
            points = sorted((r["ranks"], r["controller_cpu_ms"]) for r in results
                            if r["mode"] == "tree")
            if points:
                ax.plot(*zip(*points, strict=True), "^:", label="tree: controller CPU")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
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
    parser.add_argument("--sizes", default="10,100,1000,1000x10",
                        help="nodes, or NODESxRANKS (ranks per node), comma-separated")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="ranks per node where a size does not say")
    parser.add_argument("--modes", default="flat,tree")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    sizes = []
    for size in args.sizes.split(","):
        nodes, _, per = size.partition("x")
        sizes.append((int(nodes), int(per) if per else args.ranks_per_node))
    modes = [m.strip() for m in args.modes.split(",")]
    import logging

    logging.getLogger("phalanx").setLevel(logging.ERROR)
    cluster = SimCluster(max(nodes for nodes, _ in sizes))
    results = []
    try:
        for nodes, per in sizes:
            for tree in (False, True):
                if ("tree" if tree else "flat") not in modes:
                    continue
                short = descriptors_short(nodes, nodes * per)
                if short is not None:
                    print(f"  skipped {nodes}x{per}: {short}", file=sys.stderr, flush=True)
                    continue
                result = measure(cluster, nodes, tree, args.calls, per)
                print(f"  {result['ranks']} ranks on {nodes} nodes, {result['mode']}: no-op "
                      f"{result['noop_ms']:.2f} ms, controller CPU "
                      f"{result['controller_cpu_ms']:.2f} ms", file=sys.stderr, flush=True)
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
               "fanout": FANOUT, "top_fanout": TOP, "calls": args.calls, "results": results,
               "targets": [{"target": t, "value": v, "pass": ok} for t, v, ok in checks],
               "plot": str(png) if drawn else None}
    path = args.out / "scale-latest.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nJSON: {path}" + (f"\nplot: {png}" if drawn else ""))


if __name__ == "__main__":
    main()
