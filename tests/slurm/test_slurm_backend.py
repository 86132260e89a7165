"""``px.SlurmBackend`` against a real Slurm (tests/slurmcluster.py: a slurmctld and two
slurmds on this machine, nodes n1 at 127.0.0.2 and n2 at 127.0.0.3): the job it submits,
its agents started by srun on the nodes' addresses, a group on every node of the job unless
it names fewer, the job's end with its group, its pool or its controller (its directory
with it), Slurm's refusals quoted, and scancel failing pending calls with Slurm's word on
why (tests/slurm/test_slurm_job.py reads the other causes, which take a minute and more to
bring about)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
    # no nodes=: every node of the job
    with px.WorkerGroup(SlurmProbe, procs_per_node=2, backend=backend) as group:
        seen = group.call("where", timeout=60)
        job = seen[0]["job"]
        # every rank runs in the job, two on each of its nodes
        assert group.nodes == 2
        assert {s["job"] for s in seen} == {job}
        assert sorted(s["node"] for s in seen) == ["n1", "n1", "n2", "n2"]
        assert [s["rank"] for s in seen] == [0, 1, 2, 3]
        # the first node's agent listens on its NodeAddr: ranks rendezvous there
        assert {s["addr"] for s in seen} == {"127.0.0.2"}
        assert job_state(job) == "RUNNING"
        # the job's token never shows on a command line, nor stays on the disk once every
        # agent has read it
        assert not any(group._backend.job.token in " ".join(p.info["cmdline"] or ())
                       for p in psutil.process_iter(["cmdline"]))
        directory = Path(group._backend.job.directory)
        assert (directory / "agents").is_dir()
        assert not (directory / "token").exists()
    # the agents exit as the group's connections end: the job completes, not cancelled
    assert wait_ended(job) in ("COMPLETED", "")
    assert not list(tmp_path.iterdir()), "the job's private directory is removed"


def test_kept_results_cross_between_the_jobs_nodes():
    # a backend that names no nodes submits a job of the group's
    with px.WorkerGroup(SlurmProbe, nodes=2, backend=px.SlurmBackend()) as group:
        assert [s["node"] for s in group.call("where", timeout=60)] == ["n1", "n2"]
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


def test_a_group_asking_for_more_nodes_than_the_backend_is_an_error_before_anything_starts(
        tmp_path):
    before = queued_jobs()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"nodes=3, but px\.SlurmBackend\(nodes=2\) asks "
                                         r"Slurm for 2 node"):
        px.WorkerGroup(SlurmProbe, nodes=3, backend=px.SlurmBackend(
            nodes=2, state_dir=str(tmp_path)))
    assert time.monotonic() - started < 5
    assert queued_jobs() == before
    assert not list(tmp_path.iterdir())  # nothing was made for a job


def test_scancel_fails_the_pending_call_naming_the_job_the_node_and_slurms_reason():
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
        # the first rank killed (WorkerDied) or node lost (MembershipChanged) fails it:
        # either names the job, the node, and that the job was cancelled
        text = str(failure.value)
        assert f"slurm job {job} node n" in text
        assert f"Slurm ended slurm job {job}: it was cancelled" in text, text
        assert "out-of-memory" not in text
        assert took < 10
        # and so do the records of every rank
        assert helpers.wait_until(lambda: not any(h.alive for h in group.health()), 15)
        causes = [h.cause or "" for h in group.health()]
        assert all(re.search(f"slurm job {job}.*it was cancelled", c) for c in causes), causes
    finally:
        group.shutdown()
    assert wait_ended(job) in STATE_ENDED


CONTROLLER = textwrap.dedent("""
    import os, sys, time
    import phalanx as px
    from tests.workers import Probe

    group = px.WorkerGroup(Probe, backend=px.SlurmBackend(nodes=2, state_dir=sys.argv[1]))
    print(group.call("env", "SLURM_JOB_ID", timeout=60)[0]["SLURM_JOB_ID"],
          group._backend.job.directory, flush=True)
    time.sleep(600)
""")


def test_the_job_and_its_directory_end_when_its_controller_is_killed(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, str(script), str(state)], stdout=subprocess.PIPE,
                            text=True, cwd=helpers.REPO,
                            env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    try:
        job, directory = proc.stdout.readline().split()
        assert job_state(job) == "RUNNING"
        assert Path(directory).parent == state and Path(directory).is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        # its agents see their connections end and exit: the job completes by itself, and
        # the last agent to go removes the job's directory (the logs; the token went as the
        # agents started)
        assert wait_ended(job, timeout=30) in ("COMPLETED", "")
        assert helpers.wait_until(lambda: not Path(directory).exists(), 10), \
            list(Path(directory).rglob("*"))
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()


def test_the_jobs_directory_goes_with_it_when_its_agents_are_killed_outright(tmp_path):
    group = px.WorkerGroup(SlurmProbe, backend=px.SlurmBackend(
        nodes=2, node_timeout=5, state_dir=str(tmp_path)))
    try:
        job = group.call("where", timeout=60)[0]["job"]
        directory = Path(group._backend.job.directory)
        # no agent can withdraw (nor the controller, which is not closing): the batch
        # script removes the directory as its srun returns
        subprocess.run(["scancel", "--signal=KILL", f"{job}.0"], check=True, timeout=30)
        assert helpers.wait_until(lambda: not directory.exists(), 20), \
            list(directory.rglob("*"))
        # (srun's tasks were killed: the script ends with srun's status, and the job FAILED)
        assert helpers.wait_until(lambda: job_state(job) in ("FAILED", ""), 30)
    finally:
        group.shutdown()


INSIDE = textwrap.dedent("""
    import os, sys
    import phalanx as px
    from tests.workers import Probe

    # as the README's sbatch script: no nodes=, every node of the allocation
    with px.WorkerGroup(Probe, procs_per_node=2, backend=px.SlurmBackend(
            state_dir=sys.argv[1])) as group:
        seen = group.call("env", "SLURM_JOB_ID", "SLURMD_NODENAME", timeout=60)
    print("OWN", os.environ["SLURM_JOB_ID"])
    print("RANKS", sorted({s["SLURM_JOB_ID"] for s in seen}),
          sorted(s["SLURMD_NODENAME"] for s in seen))
    for nodes, backend in ((3, px.SlurmBackend()), (None, px.SlurmBackend(nodes=3))):
        try:
            px.WorkerGroup(Probe, nodes=nodes, backend=backend)
        except ValueError as exc:
            print("REFUSED", exc)
""")

# a controller killed outright inside the allocation: its agents' step outlives it, and
# the last agent to exit removes the job's directory
KILLED_INSIDE = textwrap.dedent("""
    import os, signal, sys
    import phalanx as px
    from tests.workers import Probe

    group = px.WorkerGroup(Probe, backend=px.SlurmBackend(state_dir=sys.argv[1]))
    group.call("env", "SLURM_JOB_ID", timeout=60)
    print(group._backend.job.directory, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_inside_an_allocation_it_uses_it_and_submits_nothing(tmp_path):
    script = tmp_path / "inside.py"
    script.write_text(INSIDE)
    killed = tmp_path / "killed.py"
    killed.write_text(KILLED_INSIDE)
    state = tmp_path / "state"
    out = tmp_path / "out.txt"
    batch = tmp_path / "job.sh"
    batch.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {sys.executable} {script} {state}
        directory=$({sys.executable} {killed} {state})
        echo "KILLED $directory"
        tries=0  # up to 20 s for its agents to go
        while [ -e "$directory" ] && [ $tries -lt 200 ]; do sleep 0.1; tries=$((tries+1)); done
        if [ -e "$directory" ]; then echo "LEFT"; ls -laR "$directory"; else echo "GONE"; fi
        """))
    subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={out}",
                    f"--chdir={helpers.REPO}", f"--export=ALL,PYTHONPATH={helpers.REPO}",
                    str(batch)], check=True, timeout=120, capture_output=True)
    text = out.read_text()
    own = text.split("OWN ", 1)[1].split()[0]
    assert f"RANKS ['{own}'] ['n1', 'n1', 'n2', 'n2']" in text, text
    # more nodes than the allocation has, asked by the group or the backend: refused
    assert (f"REFUSED nodes=3, but this allocation (slurm job {own}) has 2 node(s)"
            in text), text
    assert f"REFUSED px.SlurmBackend(nodes=3) inside slurm job {own}, which has 2" in text, text
    assert f"KILLED {state}/job-" in text, text
    assert "GONE" in text, text


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


def test_a_sync_by_parts_crosses_the_jobs_nodes():
    """px.weight_sync(src_rank="all") through a Slurm job's agents: two trainers (one on
    each node) send their row shards, two generators get exactly their column regions."""
    pytest.importorskip("torch", reason="the weight sync needs torch (pip install torch)")
    from tests.contract.test_shard_sync import Generator, Trainer, _bytes, _check

    with px.ResourcePool(nodes=2, procs_per_node=1, colocate=2,
                         backend=px.SlurmBackend(nodes=2)) as pool:
        trainers = px.WorkerGroup(Trainer, pool=pool, echo_output=False)
        generators = px.WorkerGroup(Generator, pool=pool, echo_output=False,
                                    rank_kwargs={0: {"split": True}, 1: {"split": True}})
        with px.weight_sync(trainers, generators, src_rank="all", timeout=60) as sync:
            trainers.call("step", 3, timeout=60)
            stats = sync.push("shards", "load", "wanted")
            assert stats.per_target == {(generators.name, r): _bytes(True, r) for r in (0, 1)}
            _check(generators, True, 3)
        generators.shutdown()
        trainers.shutdown()
