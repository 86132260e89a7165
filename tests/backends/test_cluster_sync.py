"""Shipping the controller's code to the agents (``ClusterBackend(sync=...)``): ranks run
the shipped tree, ``group.reload()`` ships a change and restarts them on it, and only the
files a node lacks cross the wire.

Each test starts agents of its own on 127.0.0.5-9, each with a ``--store`` in the test's
temporary directory and an HTTP port for ``/metrics`` (stopped when the test ends).
"""

from __future__ import annotations

import importlib
import os
import secrets
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

import phalanx as px
from phalanx.backends.cluster import codesync
from tests import helpers
from tests.agentcluster import free_port, terminate

MIB = 1 << 20

WORK = '''\
import os

from . import mod


class Worker:
    def where(self):
        return {"value": mod.value(), "file": mod.__file__, "cwd": os.getcwd(),
                "pid": os.getpid(), "version": os.environ.get("PHALANX_CODE_VERSION")}
'''


def value_source(value: int) -> str:
    return f"def value():\n    return {value}\n"


# --------------------------------------------------------------------------- own agents


class StoreAgent:
    """A ``phalanx agent`` this test started, with its own ``--store``."""

    def __init__(self, host: str, port: int, http_port: int, store: Path,
                 proc: subprocess.Popen) -> None:
        self.host, self.port, self.http_port, self.store, self.proc = (
            host, port, http_port, store, proc)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _get(self, path: str) -> str:
        url = f"http://{self.host}:{self.http_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    def received(self) -> float:
        for line in self._get("/metrics").splitlines():
            if line.startswith("phalanx_agent_received_bytes_total "):
                return float(line.split()[1])
        raise AssertionError("no phalanx_agent_received_bytes_total in /metrics")

    def healthy(self) -> bool:
        try:
            return '"ok"' in self._get("/health")
        except OSError:
            return False

    def descendants(self) -> set[int]:
        try:
            return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def tree(self, version: str) -> str:
        return os.path.realpath(self.store / "trees" / version)


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(secrets.token_urlsafe(32))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def agents(token_file, tmp_path):
    """``agents(*hosts)``: start an agent on each host, with its store under tmp_path;
    all are stopped (SIGTERM, then SIGKILL) when the test ends."""
    started: list[StoreAgent] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(helpers.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

    def start(*hosts: str) -> list[StoreAgent]:
        batch = []
        for host in hosts:
            port, http_port = free_port(host), free_port(host)
            store = tmp_path / f"store-{host}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
                 "--token-file", token_file, "--http-port", str(http_port),
                 "--heartbeat-timeout", "10", "--store", str(store)],
                env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL)
            agent = StoreAgent(host, port, http_port, store, proc)
            started.append(agent)
            batch.append(agent)
        for agent in batch:
            assert helpers.wait_until(lambda a=agent: a.proc.poll() is not None or a.healthy(),
                                      20, interval=0.05)
            assert agent.proc.poll() is None, f"the agent on {agent.address} exited"
        return batch

    try:
        yield start
    finally:
        terminate([agent.proc for agent in started])


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package of the controller's, uniquely named, in ``tmp_path/code``: ``(code
    directory, package directory, Worker class)``; importable here through sys.path."""
    name = f"shipped_{uuid.uuid4().hex[:10]}"
    code = tmp_path / "code"
    pkg = code / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(value_source(1))
    (pkg / "work.py").write_text(WORK)
    monkeypatch.syspath_prepend(str(code))
    try:
        yield code, pkg, importlib.import_module(f"{name}.work").Worker
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def sync_group(agents_, token_file: str, code: Path, worker, **kwargs) -> px.WorkerGroup:
    backend = px.ClusterBackend([a.address for a in agents_], token_file=token_file,
                                sync=str(code))
    kwargs.setdefault("nodes", len(agents_))
    return px.WorkerGroup(worker, backend=backend, echo_output=False, **kwargs)


def check_runs(group: px.WorkerGroup, agents_: list[StoreAgent], version: str, value: int,
               ) -> list[dict]:
    """Every rank runs ``version`` from its agent's store (returns value, imports mod from
    the tree, works in it, is the agent's descendant); their reports."""
    reports = group.call("where")
    trees = {a.tree(version): a for a in agents_}
    for rank, report in enumerate(reports):
        assert report["value"] == value, f"rank {rank}: {report}"
        assert report["version"] == version, f"rank {rank}: {report}"
        cwd = os.path.realpath(report["cwd"])
        assert cwd in trees, f"rank {rank} works in {cwd}, not a store's tree of {version}"
        agent = trees[cwd]
        assert os.path.realpath(report["file"]).startswith(cwd + os.sep), \
            f"rank {rank} imported mod from {report['file']}, not from {cwd}"
        assert report["pid"] in agent.descendants(), f"rank {rank} is not {agent.address}'s"
    health = group.health()
    assert [h.code_version for h in health] == [version] * len(reports)
    assert [h.pid for h in health] == [r["pid"] for r in reports]
    return reports


# --------------------------------------------------------------------------- tests


def test_ranks_run_the_shipped_code_from_their_agents_store(agents, token_file, package):
    code, pkg, worker = package
    nodes = agents("127.0.0.5", "127.0.0.6")
    version = codesync.scan(code)[0]
    with sync_group(nodes, token_file, code, worker, procs_per_node=2) as group:
        reports = check_runs(group, nodes, version, 1)
        by_agent = {a.address: [r for r in reports
                                if os.path.realpath(r["cwd"]) == a.tree(version)]
                    for a in nodes}
        assert [len(v) for v in by_agent.values()] == [2, 2], by_agent
        assert [h.node for h in group.health()] == [0, 0, 1, 1]
        for agent in nodes:  # the tree holds the package as the controller has it
            shipped = Path(agent.tree(version)) / pkg.name
            for name in ("__init__.py", "mod.py", "work.py"):
                assert (shipped / name).read_bytes() == (pkg / name).read_bytes()


def test_reload_ships_a_change_and_restarts_every_rank_on_it(agents, token_file, package):
    code, pkg, worker = package
    nodes = agents("127.0.0.7", "127.0.0.8")
    old = codesync.scan(code)[0]
    with sync_group(nodes, token_file, code, worker, procs_per_node=2) as group:
        before = check_runs(group, nodes, old, 1)
        nodes_before = [h.node for h in group.health()]
        (pkg / "mod.py").write_text(value_source(2))
        new = codesync.scan(code)[0]
        assert new != old
        assert group.reload() == new
        after = check_runs(group, nodes, new, 2)
        assert not {r["pid"] for r in before} & {r["pid"] for r in after}
        assert [h.node for h in group.health()] == nodes_before
        assert helpers.wait_dead([r["pid"] for r in before])
        # Each rank is on the agent it was on: in that agent's tree of each version.
        assert [{a.tree(old): a.address for a in nodes}[os.path.realpath(r["cwd"])]
                for r in before] == \
               [{a.tree(new): a.address for a in nodes}[os.path.realpath(r["cwd"])]
                for r in after]
        for agent in nodes:  # both versions are kept, side by side
            assert os.path.isdir(agent.tree(old)) and os.path.isdir(agent.tree(new))


def test_only_the_files_a_node_lacks_cross_the_wire(agents, token_file, package):
    code, pkg, worker = package
    (pkg / "blob.bin").write_bytes(os.urandom(2 * MIB))
    nodes = agents("127.0.0.9", "127.0.0.5")
    first = codesync.scan(code)[0]

    def received() -> list[float]:
        return [a.received() for a in nodes]

    start = received()
    with sync_group(nodes, token_file, code, worker, procs_per_node=1) as group:
        check_runs(group, nodes, first, 1)
        shipped = received()
        for agent, b, a in zip(nodes, start, shipped, strict=True):
            assert a - b >= 2 * MIB, f"{agent.address} received {a - b} bytes at the start"

        assert group.reload() == first  # nothing changed: nothing but the listing crosses
        check_runs(group, nodes, first, 1)
        again = received()
        for agent, b, a in zip(nodes, shipped, again, strict=True):
            assert a - b < 64 * 1024, f"{agent.address} received {a - b} bytes for no change"

        (pkg / "mod.py").write_text(value_source(3))
        blobs = [len(os.listdir(a.store / "blobs")) for a in nodes]
        second = group.reload()
        assert second == codesync.scan(code)[0] != first
        check_runs(group, nodes, second, 3)
        changed = received()
        for agent, b, a in zip(nodes, again, changed, strict=True):
            assert a - b < 64 * 1024, f"{agent.address} received {a - b} bytes for one file"
        assert [len(os.listdir(a.store / "blobs")) for a in nodes] == [n + 1 for n in blobs]


def test_sync_of_a_path_that_is_not_a_directory_is_refused_naming_it(tmp_path, token_file):
    file = tmp_path / "not-a-dir.py"
    file.write_text("x = 1\n")
    for path in (file, tmp_path / "absent"):
        with pytest.raises(ValueError, match="is not a directory") as info:
            px.ClusterBackend([f"127.0.0.5:{free_port('127.0.0.5')}"], token_file=token_file,
                              sync=str(path))
        assert str(path) in str(info.value)
