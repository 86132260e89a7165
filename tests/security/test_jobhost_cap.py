"""A multi-node ``phalanx run``'s host serves a bounded number of connections: each holds
a thread of node 0's launcher, so past the job's most nodes plus ``config.
JOB_MAX_EXTRA_CONNECTIONS`` a connection is refused at once with a message naming the limit
(a launcher refused says it and exits), the launcher's threads stay bounded, and the job
goes on once connections close.

Node 0 is a real launcher (``python -m phalanx run --nnodes 2``) hosting at a free port of
127.0.0.1; the connections are plain sockets that never send anything, then a real
launcher for node 1 (refused while they are open, admitted once they closed).
"""

from __future__ import annotations

import json
import select
import socket
import time

import psutil
import pytest

from phalanx import config
from tests import helpers
from tests.cli.test_multinode import (
    RUN_TIMEOUT,
    SHOW_ENV,
    START_TIMEOUT,
    STOP_WITHIN,
    Launchers,
    free_port,
    script,
)

NODES = 2
EXTRA = 20  # connections past the limit
REFUSED_WITHIN = 20.0  # seconds for every refusal to arrive, however loaded the machine
# threads node 0's launcher may start meanwhile that serve no connection (its ranks' output
# and signal helpers are not started before the job is)
SLACK = 4


@pytest.fixture
def launchers(tmp_path):
    group = Launchers(tmp_path)
    try:
        yield group
    finally:
        group.cleanup()


def _joined(pid: int, port: int) -> bool:
    """Whether the launcher ``pid`` listens on ``port`` and its own member connected."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
               for c in conns)


def _refusals(socks: list[socket.socket], wanted: int) -> dict[int, bytes]:
    """What the sockets that were answered received (index -> bytes up to their end),
    once ``wanted`` of them ended or within REFUSED_WITHIN."""
    got: dict[int, bytes] = {}
    ended: set[int] = set()
    deadline = time.monotonic() + REFUSED_WITHIN
    while len(ended) < wanted and (left := deadline - time.monotonic()) > 0:
        open_ = [s for i, s in enumerate(socks) if i not in ended]
        ready, _, _ = select.select(open_, [], [], left)
        for sock in ready:
            index = socks.index(sock)
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            got[index] = got.get(index, b"") + data
            if not data:
                ended.add(index)
    return got


def test_connections_past_the_limit_are_refused_naming_it_and_the_job_goes_on(tmp_path,
                                                                              launchers):
    show = script(tmp_path, "show.py", SHOW_ENV)
    port = free_port()
    node0 = launchers.node("node0", port, NODES, 0, "-n", "1", show)
    assert helpers.wait_until(lambda: _joined(node0.proc.pid, port), START_TIMEOUT, 0.05), \
        launchers.describe()
    host = psutil.Process(node0.proc.pid)
    before = host.num_threads()  # its own member's connection is served already
    limit = NODES + config.JOB_MAX_EXTRA_CONNECTIONS
    socks: list[socket.socket] = []
    try:
        for _ in range(limit - 1 + EXTRA):  # accepted in this order, after its own
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        got = _refusals(socks, EXTRA)
        refused = sorted(got)
        assert refused == list(range(limit - 1, limit - 1 + EXTRA)), (refused,
                                                                       launchers.describe())
        message = json.loads(got[refused[-1]].decode())
        assert message["type"] == "refused", message
        assert (f"the job's host serves {limit} connections already" in message["reason"]
                and "phalanx.config.JOB_MAX_EXTRA_CONNECTIONS" in message["reason"]), message
        threads = host.num_threads()
        assert threads <= before + limit - 1 + SLACK, (threads, before, limit)

        late = launchers.node("late", port, NODES, 1, "-n", "1", show)  # a real launcher
        assert launchers.wait(late, timeout=STOP_WITHIN) == [1], launchers.describe()
        assert (f"phalanx run: the job at 127.0.0.1:{port} refused this launcher: the job's "
                f"host serves {limit} connections already") in late.stderr, late.describe()
        assert host.num_threads() <= before + limit - 1 + SLACK
    finally:
        for sock in socks:
            sock.close()

    assert node0.returncode is None, launchers.describe()  # still hosting, still waiting
    node1 = launchers.node("node1", port, NODES, 1, "-n", "1", show)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-0", "ran-1"]


def test_a_connection_that_never_joins_gives_its_place_back(monkeypatch):
    """Silent connections cannot keep the places of the cap for good: one that sends no
    join within ``config.JOB_JOIN_WITHIN`` is closed (its thread ends), while a launcher's
    connection that joined stays served however quiet it is afterwards."""
    from phalanx.launcher.jobhost import JobHost, JobSpec

    monkeypatch.setattr(config, "JOB_JOIN_WITHIN", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    spec = JobSpec(min_nodes=2, max_nodes=2, static=True, run_id="r", max_restarts=0,
                   join_timeout=60, last_call=0, master_addr="127.0.0.1")
    host = JobHost(listener, spec, nonce="n")
    host.start()
    silent = joined = None
    try:
        silent = socket.create_connection(host.address, timeout=5)
        joined = socket.create_connection(host.address, timeout=5)
        joined.sendall(json.dumps({"type": "join", "run_id": "r", "nonce": "m"}).encode()
                       + b"\n")
        started = time.monotonic()
        # closed by the host (EOF) once its time to join is up; bounded, and generous for a
        # loaded machine: what it guards against is a place held forever
        assert _refusals([silent], 1) == {0: b""}, "the silent connection was not closed"
        assert time.monotonic() - started < REFUSED_WITHIN
        ready, _, _ = select.select([joined], [], [], 1.0)  # the member stays served
        assert not ready or joined.recv(65536, socket.MSG_PEEK), "the member was closed"
    finally:
        for sock in (silent, joined):
            if sock is not None:
                sock.close()
        host.close(timeout=5)
