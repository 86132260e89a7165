"""W9: the cluster backend (``phalanx agent`` per node) next to the local backend.

Four agents run on this machine, each on a loopback address of its own (127.0.0.2-5), with
``--http-port`` for their metrics. For 2 and 4 agents x 2 ranks, the same ``Bench`` group
runs on the cluster backend and on the local backend with the same layout (``nodes`` x 2,
simulated nodes), alternating:

- no-op fan-out latency (W2's batches), and the ratio cluster / local;
- a 64 MiB float64 array sent to every rank (W4), the seconds, and the bytes each agent
  received during it (``phalanx_agent_received_bytes_total``): a call's payload crosses to a
  node once, whatever its number of ranks, so about 64 MiB per node, not 64 MiB per rank.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from statistics import median

import numpy as np

from bench.contenders import Contender
from bench.util import Errors, Row, clock, reap, settle

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
SIZES = (2, 4)  # agents; 2 ranks each
RANKS_PER_NODE = 2
MIB = 1 << 20
BROADCAST_MIB = 64


def w9_cluster(contenders: Sequence[Contender], plan: object, errors: Errors) -> list[Row]:
    if not any(c.name == "phalanx" for c in contenders):
        return []
    quick = getattr(plan, "quick", False)
    rows: list[Row] = []
    with _Agents() as agents:
        for nodes in SIZES:
            rows += errors.attempt("W9", "phalanx", lambda nodes=nodes: _measure(
                agents, nodes, quick)) or []
    return rows


def _measure(agents: _Agents, nodes: int, quick: bool) -> list[Row]:
    import phalanx as px
    from bench.workloads import Bench

    shape = f"{nodes}x{RANKS_PER_NODE}"
    noop = {kind: Row(f"W9.noop.{shape}.{kind}", f"W9 no-op fan-out, {shape} ranks, {kind}",
                      "us/call", "lower") for kind in ("local", "cluster")}
    ratio = Row(f"W9.noop.{shape}.ratio", f"W9 fan-out {shape}: cluster / local", "x", "lower")
    bcast = {kind: Row(f"W9.bcast.{shape}.{kind}", f"W9 {BROADCAST_MIB} MiB to {shape} ranks, "
                       f"{kind}", "s", "lower") for kind in ("local", "cluster")}
    per_node = Row(f"W9.bytes.{shape}", f"W9 {BROADCAST_MIB} MiB broadcast: MiB received per "
                   "node", "MiB", "lower", agg="max")
    array = np.ones(BROADCAST_MIB * MIB // 8, dtype=np.float64)
    groups = {
        "local": px.WorkerGroup(Bench, nodes=nodes, procs_per_node=RANKS_PER_NODE,
                                echo_output=False),
        "cluster": px.WorkerGroup(Bench, nodes=nodes, procs_per_node=RANKS_PER_NODE,
                                  echo_output=False, backend=agents.backend(nodes)),
    }
    try:
        batches, calls = (3, 200) if quick else (7, 500)
        for group in groups.values():  # warm up
            for _ in range(100):
                group.call("noop")
            group.call("array_sum", array)
        for batch in range(batches):
            for kind in (("local", "cluster") if batch % 2 == 0 else ("cluster", "local")):
                group = groups[kind]
                settle()
                t0 = clock()
                for _ in range(calls):
                    group.call("noop")
                noop[kind].add("phalanx", (clock() - t0) / calls * 1e6)
        for trial in range(2 if quick else 4):
            for kind in (("local", "cluster") if trial % 2 == 0 else ("cluster", "local")):
                before = agents.received(nodes) if kind == "cluster" else None
                settle()
                t0 = clock()
                sums = groups[kind].call("array_sum", array)
                bcast[kind].add("phalanx", clock() - t0)
                if sums != [float(array.size)] * nodes * RANKS_PER_NODE:
                    raise RuntimeError(f"wrong sums {sums}")
                if before is not None:
                    after = agents.received(nodes)
                    for old, new in zip(before, after, strict=True):
                        per_node.add("phalanx", (new - old) / MIB)
    finally:
        for group in groups.values():
            group.shutdown()
    ratio.add("phalanx", median(noop["cluster"].raw["phalanx"])
              / median(noop["local"].raw["phalanx"]))
    return [noop["local"], noop["cluster"], ratio, bcast["local"], bcast["cluster"], per_node]


class _Agents:
    """Four ``phalanx agent`` processes on this machine, for the length of W9."""

    def __enter__(self) -> _Agents:
        directory = tempfile.mkdtemp(prefix="phalanx-bench-")
        self.token_file = str(Path(directory) / "token")
        Path(self.token_file).write_text(secrets.token_urlsafe(32))
        os.chmod(self.token_file, 0o600)
        self.hosts, self.http, self.procs = [], [], []
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
            "PYTHONPATH", "")])}
        for host in ADDRESSES:
            port, http = _free_port(host), _free_port(host)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
                 "--http-port", str(http), "--token-file", self.token_file],
                env=env, cwd=root, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.hosts.append(f"{host}:{port}")
            self.http.append(f"http://{host}:{http}/metrics")
        deadline = time.monotonic() + 30
        while not all(_answers(url) for url in self.http):
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the benchmark's agents did not start")
            time.sleep(0.1)
        return self

    def backend(self, nodes: int):
        import phalanx as px

        return px.ClusterBackend(self.hosts[:nodes], token_file=self.token_file)

    def received(self, nodes: int) -> list[float]:
        """Each agent's ``received_bytes_total`` now."""
        values = []
        for url in self.http[:nodes]:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            found = re.search(r"^phalanx_agent_received_bytes_total (\S+)$", text, re.M)
            values.append(float(found.group(1)) if found else float("nan"))
        return values

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            proc.terminate()
        reap(self.procs)
        os.unlink(self.token_file)
        os.rmdir(os.path.dirname(self.token_file))


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).read()
        return True
    except OSError:
        return False
