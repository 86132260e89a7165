"""``px.breakpoint()`` (:mod:`phalanx.rank.debugger`) and ``phalanx debug``
(:mod:`phalanx.cli.debug`), end to end with real processes.

A rank of a real group (or of ``phalanx run``) stops in ``px.breakpoint()``; the tests find
its record in a per-test ``PHALANX_DEBUG_DIR`` and drive the real ``phalanx debug`` command in
a subprocess, its pdb commands given on stdin (``input()`` reads them as a user's lines).
Every rank calls ``px.breakpoint`` with a timeout, so a failing test cannot leave a rank
waiting forever, and every subprocess runs on a deadline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import phalanx as px
from phalanx.cli import debug
from phalanx.rank import debugger
from tests import helpers

PHALANX = [sys.executable, "-m", "phalanx"]
CLIENT_TIMEOUT = 20.0  # seconds for one `phalanx debug` run
WAIT_TIMEOUT = 20.0  # seconds for a rank to register, or a call to finish
RANK_PATIENCE = 30.0  # seconds a rank waits for a debugger before it gives up


class Stopper:
    """Rank 1 stops in the debugger with a local variable worth printing."""

    def compute(self, x: int, patience: float = RANK_PATIENCE) -> tuple[int, bool]:
        rank = int(os.environ["RANK"])
        if rank != 1:
            return x, False
        secret_value = x * 1000 + 7
        attached = px.breakpoint(timeout=patience)
        return secret_value + 1, attached


@pytest.fixture
def debug_dir(tmp_path) -> Path:
    return tmp_path / "debug"


@pytest.fixture
def group(debug_dir):
    with px.WorkerGroup(Stopper, procs_per_node=2, echo_output=False,
                        env={debugger.ENV_DEBUG_DIR: str(debug_dir)}) as group:
        yield group


def phalanx_debug(debug_dir: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, debugger.ENV_DEBUG_DIR: str(debug_dir)}
    return subprocess.run([*PHALANX, "debug", *args], input=stdin, capture_output=True,
                          text=True, timeout=CLIENT_TIMEOUT, env=env)


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}--- stderr\n{result.stderr}"


def wait_for_record(debug_dir: Path) -> debugger.WaitingRank:
    records: list[debugger.WaitingRank] = []

    def registered() -> bool:
        records[:] = debug.waiting_ranks(debug_dir)
        return bool(records)

    assert helpers.wait_until(registered, WAIT_TIMEOUT, interval=0.05), "no rank registered"
    assert len(records) == 1, records
    return records[0]


def test_attach_prints_a_local_and_continue_completes_the_call(group, debug_dir):
    future = group.call_async("compute", 5)
    record = wait_for_record(debug_dir)
    assert record.rank == 1 and record.function == "compute"
    assert record.file == __file__ and record.on_this_host

    listing = phalanx_debug(debug_dir, "--list")
    assert listing.returncode == 0, describe(listing)
    row = next(line.split() for line in listing.stdout.splitlines() if str(record.pid) in line)
    assert row[0] == "1" and row[2] == socket.gethostname()
    assert record.group == group.name and row[3] == group.name
    assert f"{Path(__file__).name}:{record.line}" in listing.stdout

    session = phalanx_debug(debug_dir, "1", stdin="p secret_value\nc\n")
    assert session.returncode == 0, describe(session)
    assert "5007" in session.stdout
    assert f"attached to rank 1 of group {group.name} (pid {record.pid})" in session.stderr
    assert future.result(timeout=WAIT_TIMEOUT) == [(5, False), (5008, True)]
    assert not list(debug_dir.glob("*.json")), "the record outlived the wait"


def test_ranks_of_two_groups_are_told_apart_by_their_groups_names(debug_dir):
    env = {debugger.ENV_DEBUG_DIR: str(debug_dir)}
    with px.WorkerGroup(Stopper, procs_per_node=2, echo_output=False, env=env,
                        name="policy") as policy, \
            px.WorkerGroup(Stopper, procs_per_node=2, echo_output=False, env=env,
                           name="reward") as reward:
        futures = [policy.call_async("compute", 1), reward.call_async("compute", 2)]
        records: list[debugger.WaitingRank] = []

        def both_registered() -> bool:
            records[:] = debug.waiting_ranks(debug_dir)
            return len(records) == 2

        assert helpers.wait_until(both_registered, WAIT_TIMEOUT, interval=0.05), records
        assert sorted(r.group for r in records) == ["policy", "reward"]

        listing = phalanx_debug(debug_dir, "--list")
        assert listing.returncode == 0, describe(listing)
        for record in records:
            row = next(line.split() for line in listing.stdout.splitlines()
                       if str(record.pid) in line.split())
            assert row[3] == record.group, listing.stdout

        ambiguous = phalanx_debug(debug_dir, "1")
        assert ambiguous.returncode == 1, describe(ambiguous)
        for record in records:
            assert f"rank 1 of group {record.group} (pid {record.pid})" in ambiguous.stderr
        assert "--pid" in ambiguous.stderr

        for record in records:
            session = phalanx_debug(debug_dir, "--pid", str(record.pid), stdin="c\n")
            assert session.returncode == 0, describe(session)
            assert f"rank 1 of group {record.group}" in session.stderr
        assert [f.result(timeout=WAIT_TIMEOUT)[1] for f in futures] == [(1008, True),
                                                                       (2008, True)]


def test_the_only_waiting_rank_is_attached_without_naming_it(group, debug_dir):
    future = group.call_async("compute", 2)
    record = wait_for_record(debug_dir)
    session = phalanx_debug(debug_dir, stdin="secret_value * 2\ncontinue\n")
    assert session.returncode == 0, describe(session)
    assert "4014" in session.stdout and f"pid {record.pid}" in session.stderr
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (2008, True)


def test_wrong_token_is_refused_and_the_rank_keeps_waiting(group, debug_dir):
    future = group.call_async("compute", 3)
    record = wait_for_record(debug_dir)
    with socket.create_connection(("127.0.0.1", record.port), timeout=5) as sock:
        sock.sendall(b"0" * len(record.token) + b"\n")
        assert sock.recv(100).startswith(b"refused")
        assert sock.recv(100) == b""  # and hung up
    assert debug.waiting_ranks(debug_dir) == [record]
    session = phalanx_debug(debug_dir, "--pid", str(record.pid), stdin="p secret_value\nc\n")
    assert session.returncode == 0, describe(session)
    assert "3007" in session.stdout
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (3008, True)


def test_a_client_that_vanishes_lets_the_rank_continue(group, debug_dir):
    future = group.call_async("compute", 4)
    record = wait_for_record(debug_dir)
    with socket.create_connection(("127.0.0.1", record.port), timeout=5) as sock:
        sock.sendall(record.token.encode() + b"\n")
        received = b""
        while debugger.INPUT_MARKER not in received:  # up to pdb's first prompt, then hang up
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    assert b"(Pdb)" in received
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (4008, True)
    assert group.call("compute", 1, 0.0)[1] == (1008, False)  # the rank still serves


def test_end_of_input_at_the_client_detaches_and_the_rank_continues(group, debug_dir):
    future = group.call_async("compute", 6)
    wait_for_record(debug_dir)
    session = phalanx_debug(debug_dir, "1", stdin="p secret_value\n")
    assert session.returncode == 0, describe(session)
    assert "6007" in session.stdout and "detached from rank 1" in session.stderr
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (6008, True)


def test_a_breakpoint_with_a_timeout_gives_up_and_continues(group, debug_dir):
    started = time.monotonic()
    assert group.call("compute", 1, 0.3, timeout=WAIT_TIMEOUT)[1] == (1008, False)
    assert time.monotonic() - started < 5
    assert not list(debug_dir.glob("*.json"))


def test_stale_records_are_ignored_and_removed(debug_dir):
    debugger.private_dir(debug_dir, create=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT, check=True)
    dead = debugger.WaitingRank(
        rank=1, pid=int(gone.stdout), host=socket.gethostname(), port=1, token="x", group=None,
        process_start=time.time(), since=time.time(), file="train.py", line=3, function="f")
    # a live pid that belongs to another process than the recorded one (a reused pid)
    reused = dataclasses.replace(dead, rank=2, pid=os.getpid(), process_start=1.0)
    paths = [dead.write(debug_dir), reused.write(debug_dir)]
    (debug_dir / "garbage.json").write_text("not json")

    listing = phalanx_debug(debug_dir, "--list")
    assert listing.returncode == 0, describe(listing)
    assert "no rank is waiting" in listing.stdout
    assert not any(path.exists() for path in paths)

    attach = phalanx_debug(debug_dir, "1")
    assert attach.returncode == 1, describe(attach)
    assert "no rank is waiting for a debugger" in attach.stderr


def test_naming_a_rank_that_is_not_waiting_is_an_error(group, debug_dir):
    future = group.call_async("compute", 7)
    wait_for_record(debug_dir)
    result = phalanx_debug(debug_dir, "0")
    assert result.returncode == 1, describe(result)
    assert "rank 0 is not waiting" in result.stderr and "rank 1" in result.stderr
    assert phalanx_debug(debug_dir, "1", stdin="c\n").returncode == 0
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (7008, True)


def test_debug_dir_of_another_kind_is_refused(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(PermissionError, match="PHALANX_DEBUG_DIR"):
        debugger.private_dir(not_a_dir, create=True)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o777)
    assert debugger.private_dir(loose, create=False)
    assert os.stat(loose).st_mode & 0o777 == 0o700


def test_a_record_is_private_and_names_the_rank(tmp_path):
    record = debugger.WaitingRank(
        rank=None, pid=os.getpid(), host="h", port=1, token="t", group=None,
        process_start=0.0, since=0.0, file="f.py", line=1, function="g")
    path = record.write(tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["token"] == "t"
    assert debugger.WaitingRank.read(path) == record
    assert record.who == f"rank ? (pid {os.getpid()})"


SCRIPT = """\
import os
import phalanx as px

rank = int(os.environ["RANK"])
if rank == 1:
    loss = 0.25 * (rank + 1)
    px.breakpoint(timeout={patience})
    print(f"rank {{rank}} done, loss {{loss}}", flush=True)
"""


def test_a_rank_of_phalanx_run_is_debugged_from_another_terminal(tmp_path):
    debug_dir = tmp_path / "debug"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(patience=RANK_PATIENCE)))
    env = {**os.environ, "PHALANX_PROGRESS": "0", debugger.ENV_DEBUG_DIR: str(debug_dir)}
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        launcher = subprocess.Popen([*PHALANX, "run", "-n", "2", str(script)], cwd=tmp_path,
                                    env=env, stdout=stdout, stderr=stderr)
    try:
        record = wait_for_record(debug_dir)
        assert record.rank == 1 and record.function == "<module>"
        assert record.group == "train"  # phalanx run's group: the script's name
        session = phalanx_debug(debug_dir, "1", stdin="p loss\nc\n")
        assert session.returncode == 0, describe(session)
        assert "0.5" in session.stdout and "(Pdb)" in session.stdout
        assert launcher.wait(timeout=WAIT_TIMEOUT) == 0, err.read_text()
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=WAIT_TIMEOUT)
    assert "[rank 1] rank 1 done, loss 0.5" in out.read_text()
    assert "is waiting for a debugger" in err.read_text() + out.read_text()

