"""``px.SlurmBackend`` against a real Slurm (tests/slurmcluster.py: a slurmctld and two
slurmds on this machine, nodes n1 at 127.0.0.2 and n2 at 127.0.0.3): the job it submits,
its agents started by srun on the nodes' addresses, the job's end with its group, its pool
or its controller, Slurm's refusals quoted, and scancel failing pending calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import phalanx as px
from tests import helpers
from tests.workers import Probe

pytestmark = pytest.mark.usefixtures("slurm_cluster")

STATE_ENDED = ("COMPLETED", "CANCELLED", "")  # "": Slurm has forgotten it


class SlurmProbe(Probe):
    def where(self) -> dict:
        import socket

        return {"job": os.environ.get("SLURM_JOB_ID"),
                "node": os.environ.get("SLURMD_NODENAME"),
                "rank": int(os.environ["RANK"]), "pid": os.getpid(),
                "host": socket.gethostname(),
                "addr": os.environ.get("MASTER_ADDR")}

    def rows(self, n: int):
        import numpy as np

        return np.full(n, int(os.environ["RANK"]), dtype=np.int64)

    def total(self, data) -> int:
        return int(data.sum())


def job_state(job_id: str) -> str:
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=30)
    for field in done.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return ""


def queued_jobs() -> list[str]:
    done = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                          timeout=30, check=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


def wait_ended(job_id: str, timeout: float = 30.0) -> str:
    state = "?"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in STATE_ENDED:
            return state
        time.sleep(0.3)
    raise AssertionError(f"slurm job {job_id} still {state} after {timeout:g} s")


def test_a_group_runs_on_the_job_it_submitted_and_the_job_completes_as_it_closes(tmp_path):
    backend = px.SlurmBackend(nodes=2, state_dir=str(tmp_path))
    with px.WorkerGroup(SlurmProbe, nodes=2, procs_per_node=2, backend=backend) as group:
        seen = group.call("where", timeout=60)
        job = seen[0]["job"]
        # every rank runs in the job, two on each of its nodes
        assert {s["job"] for s in seen} == {job}
        assert sorted(s["node"] for s in seen) == ["n1", "n1", "n2", "n2"]
        assert [s["rank"] for s in seen] == [0, 1, 2, 3]
        # the first node's agent listens on its NodeAddr: ranks rendezvous there
        assert {s["addr"] for s in seen} == {"127.0.0.2"}
        assert job_state(job) == "RUNNING"
        # the job's token never shows on a command line
        assert not any(group._backend.job.token in " ".join(p.info["cmdline"] or ())
                       for p in psutil.process_iter(["cmdline"]))
    # the agents exit as the group's connections end: the job completes, not cancelled
    assert wait_ended(job) in ("COMPLETED", "")
    assert not list(tmp_path.iterdir()), "the job's private directory is removed"


def test_kept_results_cross_between_the_jobs_nodes():
    with px.WorkerGroup(SlurmProbe, nodes=2, backend=px.SlurmBackend(nodes=2)) as group:
        kept = group.call("rows", 1000, keep=True, timeout=60)
        # node 0's result to node 1's rank and back
        assert group.call_one(1, "total", kept[0], timeout=60) == 0
        assert group.call_one(0, "total", kept[1], timeout=60) == 1000


@pytest.mark.parametrize(("request_", "slurm_says"), [
    ({"partition": "nosuch"}, "invalid partition"),
    ({"nodes": 5}, "node configuration is not available|PartitionConfig|PartitionNodeLimit"),
    ({"time": "soon"}, "Invalid --time specification"),
])
def test_a_request_slurm_refuses_is_an_error_quoting_slurm_and_leaves_no_job(
        request_, slurm_says):
    before = queued_jobs()
    started = time.monotonic()
    with pytest.raises(px.PhalanxError, match=slurm_says):
        px.WorkerGroup(SlurmProbe, backend=px.SlurmBackend(**request_))
    assert time.monotonic() - started < 15
    assert queued_jobs() == before


def test_scancel_fails_the_pending_call_naming_the_job_and_the_node():
    group = px.WorkerGroup(SlurmProbe, nodes=2, backend=px.SlurmBackend(
        nodes=2, node_timeout=5))
    try:
        job = group.call("where", timeout=60)[0]["job"]
        pending = group.call_async("sleep", 60)
        cancelled = time.monotonic()
        subprocess.run(["scancel", job], check=True, timeout=30)
        with pytest.raises(px.PhalanxError) as failure:
            pending.result(timeout=30)
        took = time.monotonic() - cancelled
        assert f"slurm job {job} node n" in str(failure.value)
        assert took < 10
    finally:
        group.shutdown()
    assert wait_ended(job) in STATE_ENDED


CONTROLLER = textwrap.dedent("""
    import os, sys, time
    import phalanx as px
    from tests.workers import Probe

    group = px.WorkerGroup(Probe, nodes=2, backend=px.SlurmBackend(nodes=2))
    print(group.call("env", "SLURM_JOB_ID", timeout=60)[0]["SLURM_JOB_ID"],
          flush=True)
    time.sleep(600)
""")


def test_the_job_ends_when_its_controller_is_killed(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=helpers.REPO, env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    try:
        job = proc.stdout.readline().strip()
        assert job, "the controller printed no job id"
        assert job_state(job) == "RUNNING"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        # its agents see their connections end and exit: the job completes by itself
        assert wait_ended(job, timeout=30) in ("COMPLETED", "")
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()


INSIDE = textwrap.dedent("""
    import os
    import phalanx as px
    from tests.workers import Probe

    with px.WorkerGroup(Probe, nodes=2, backend=px.SlurmBackend()) as group:
        seen = group.call("env", "SLURM_JOB_ID", "SLURMD_NODENAME", timeout=60)
    print("OWN", os.environ["SLURM_JOB_ID"])
    print("RANKS", sorted({s["SLURM_JOB_ID"] for s in seen}),
          sorted(s["SLURMD_NODENAME"] for s in seen))
""")


def test_inside_an_allocation_it_uses_it_and_submits_nothing(tmp_path):
    script = tmp_path / "inside.py"
    script.write_text(INSIDE)
    out = tmp_path / "out.txt"
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={out}",
                    f"--chdir={helpers.REPO}", f"--export=ALL,PYTHONPATH={helpers.REPO}",
                    str(batch)], check=True, timeout=120, capture_output=True)
    text = out.read_text()
    own = text.split("OWN ", 1)[1].split()[0]
    assert f"RANKS ['{own}'] ['n1', 'n2']" in text, text


def test_a_pool_shares_one_job_between_its_colocated_groups():
    before = queued_jobs()
    with px.ResourcePool(nodes=2, procs_per_node=1, colocate=2,
                         backend=px.SlurmBackend(nodes=2)) as pool:
        first = px.WorkerGroup(SlurmProbe, pool=pool)
        second = px.WorkerGroup(SlurmProbe, pool=pool)
        a = first.call("where", timeout=60)
        b = second.call("where", timeout=60)
        first.shutdown()
        # the job outlives a group: the pool holds it
        c = second.call("where", timeout=60)
        second.shutdown()
        job = a[0]["job"]
        assert {s["job"] for s in a + b + c} == {job}
        assert [s["node"] for s in a] == [s["node"] for s in b] == ["n1", "n2"]
        assert len(queued_jobs()) == len(before) + 1
    assert wait_ended(job) in STATE_ENDED


def test_phalanx_run_under_srun_needs_no_flags(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import os\nprint('RANK', os.environ['RANK'], 'OF', "
                      "os.environ['WORLD_SIZE'], 'AT', os.environ['MASTER_ADDR'], flush=True)\n")
    done = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-m", "phalanx", "run",
         "-n", "2", str(script)], capture_output=True, text=True, timeout=120,
        cwd=helpers.REPO, env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split("RANK", 1)[1] for line in done.stdout.splitlines()
                   if "RANK" in line)
    assert lines == [f" {r} OF 4 AT 127.0.0.2" for r in range(4)], done.stdout
