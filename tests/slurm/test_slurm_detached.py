"""Detached groups on ``px.SlurmBackend`` against a real Slurm (tests/slurmcluster.py): a
controller in a process of its own starts a detached group on a job it submits, and dies
(SIGKILL in the middle of a call, or a normal exit); the job and its agents run on.
``px.attach(name, backend=px.SlurmBackend(job=JOBID))`` from another process finds the
job's directory and takes the very same ranks over; the group ended for good (shut down,
or nobody attaching within ``detach_timeout``) ends the job, its directory with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import phalanx as px
from tests import helpers
from tests.slurm.test_slurm_backend import job_state, queued_jobs, wait_ended

pytestmark = pytest.mark.usefixtures("slurm_cluster")

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    state_dir, name, timeout, end = sys.argv[1:]
    group = px.WorkerGroup(Probe, backend=px.SlurmBackend(nodes=2, state_dir=state_dir),
                           name=name, detached=True, detach_timeout=float(timeout),
                           echo_output=False)
    group.call("record", "before", timeout=60)
    print(json.dumps({"job": group.call("env", "SLURM_JOB_ID")[0]["SLURM_JOB_ID"],
                      "pids": group.call("pid"),
                      "directory": group._backend.job.directory}), flush=True)
    running = group.call_async("sleep", 2.0, "slept")
    time.sleep(0.3)
    print("running", flush=True)
    if end == "exit":  # a normal exit: the group is detached (atexit), not shut down
        sys.exit(0)
    time.sleep(120)  # killed here, inside the running call
""")


def _controller(state: Path, name: str, timeout: float, end: str = "kill"
                ) -> tuple[subprocess.Popen, dict]:
    """A controller process that started the detached group on a job of its own and runs
    a 2 s call; what it printed (the job, the ranks' pids, the job's directory)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(state), name, str(timeout), end],
        stdout=subprocess.PIPE, text=True, cwd=helpers.REPO,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    running = proc.stdout.readline()  # type: ignore[union-attr]
    if not line or running != "running\n":
        proc.kill()
        pytest.fail(f"the controller ended before starting its group (code {proc.wait(30)})")
    return proc, json.loads(line)


def _end(proc: subprocess.Popen, started: dict | None) -> None:
    """However the test went: the controller gone, and its job too (nothing left)."""
    proc.kill()
    proc.wait(30)
    proc.stdout.close()  # type: ignore[union-attr]
    if started is not None and job_state(started["job"]) not in ("COMPLETED", ""):
        subprocess.run(["scancel", started["job"]], timeout=30, check=False)
        wait_ended(started["job"])


def test_a_killed_controllers_group_is_attached_by_its_job_id_and_ends_with_it(tmp_path):
    state = tmp_path / "state"
    proc, started = _controller(state, "policy", timeout=60)
    try:
        job, pids = started["job"], started["pids"]
        proc.send_signal(signal.SIGKILL)  # inside the 2 s call
        proc.wait(30)
        backend = px.SlurmBackend(job=job, state_dir=str(state))
        # the job runs on: its agents keep the group for the next controller
        assert job_state(job) == "RUNNING"
        listed = px.attached(backend)
        assert [(g["name"], g["ranks"], g["holder"]) for g in listed] == [
            ("policy", [0, 1], None)]
        with pytest.raises(LookupError, match="no agent keeps a detached group named 'nope'"):
            px.attach("nope", backend=backend)
        t0 = time.monotonic()
        group = px.attach("policy", backend=backend, echo_output=False)
        try:
            assert time.monotonic() - t0 < 20
            assert group.call("pid", timeout=30) == pids  # the same processes: 0 restarts
            assert [e["SLURMD_NODENAME"] for e in group.call("env", "SLURMD_NODENAME")] == [
                "n1", "n2"]
            assert group.call("history") == [["before"], ["before"]]  # their state
            # the call running as the first controller died: its answers wait here
            assert helpers.wait_until(lambda: len(group.orphaned()) == 2, 15)
            assert [(o.rank, o.method, o.value, o.error) for o in group.orphaned()] == [
                (0, "sleep", "slept", None), (1, "sleep", "slept", None)]
            assert group.call("add", 1, 2) == [3, 3]
        finally:
            group.shutdown()
        # ended for good: the agents exit, the job completes, its directory goes
        assert wait_ended(job, timeout=30) in ("COMPLETED", "")
        assert not any(line.split()[0] == job for line in queued_jobs())
        assert helpers.wait_until(lambda: not helpers.alive(pids), 10)
        assert helpers.wait_until(lambda: not Path(started["directory"]).exists(), 10), \
            list(Path(started["directory"]).rglob("*"))
    finally:
        _end(proc, started)


def test_nobody_attaching_within_the_timeout_ends_the_job(tmp_path):
    state = tmp_path / "state"
    # a normal exit: its backend lets go of the agents, and the job must not end with it
    proc, started = _controller(state, "alone", timeout=3, end="exit")
    try:
        job = started["job"]
        assert proc.wait(30) == 0
        assert job_state(job) == "RUNNING"
        assert helpers.alive(started["pids"]) == started["pids"]
        # no one came within detach_timeout: the ranks stop, the agents exit, the job ends
        assert wait_ended(job, timeout=30) in ("COMPLETED", "")
        assert not helpers.alive(started["pids"])
        assert helpers.wait_until(lambda: not Path(started["directory"]).exists(), 10), \
            list(Path(started["directory"]).rglob("*"))
        # a job that is over, or that never was, is named in the error
        with pytest.raises(px.PhalanxError, match=re.escape(
                f"slurm job {job} has no phalanx directory under {state}: it is COMPLETED")):
            px.SlurmBackend(job=job, state_dir=str(state))
        with pytest.raises(px.PhalanxError, match=r"slurm job 999999 has no phalanx "
                                                  r"directory .*Slurm knows no such job"):
            px.SlurmBackend(job="999999", state_dir=str(state))
        with pytest.raises(ValueError, match="job must be a Slurm job id"):
            px.SlurmBackend(job="4711; rm")
        with pytest.raises(ValueError, match=r"job=.*attaches to a running job: nodes, "
                                             r"partition shape a job that is submitted"):
            px.SlurmBackend(job=job, nodes=2, partition="debug")
    finally:
        _end(proc, started)
