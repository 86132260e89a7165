"""The Slurm test cluster itself (tests/slurmcluster.py) is real and usable: jobs run on
both nodes, batch jobs complete, and a job's processes stay below this process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil

from tests import helpers


def slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_srun_runs_a_task_on_each_node(slurm_cluster):
    done = slurm("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
                 "echo $SLURMD_NODENAME $SLURM_NODEID $SLURM_JOB_NUM_NODES")
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(": ", 1)[1] for line in done.stdout.splitlines())
    assert lines == ["n1 0 2", "n2 1 2"], done.stdout


def test_sbatch_wait_runs_a_batch_job_to_its_end(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent("""\
        #!/bin/sh
        #SBATCH --nodes=2
        srun --ntasks-per-node=1 sh -c 'echo step on $SLURMD_NODENAME'
        echo batch on $SLURMD_NODENAME
        exit 3
        """))
    out = tmp_path / "out"
    # sbatch --wait polls the job's state 2 s after submitting, then 8 s later: a job
    # this short is seen done at the first poll
    done = slurm("sbatch", "--wait", "--parsable", f"--output={out}", str(script))
    assert done.returncode == 3, done.stderr  # the batch script's exit status
    lines = out.read_text().splitlines()
    assert sorted(lines) == ["batch on n1", "step on n1", "step on n2"], lines


def test_a_job_runs_below_this_process_and_ends_with_scancel(slurm_cluster):
    srun = subprocess.Popen(["srun", "--nodes=2", "--job-name=sleeper", "sleep", "60"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    def sleepers() -> list[psutil.Process]:
        found = []
        for proc in slurm_cluster.steps():
            try:
                if proc.name() == "sleep":
                    found.append(proc)
            except psutil.NoSuchProcess:  # a process of the step's start, gone meanwhile
                pass
        return found

    try:
        assert helpers.wait_until(lambda: len(sleepers()) == 2, 10), slurm_cluster.logs()
        below_us = {p.pid for p in psutil.Process().children(recursive=True)}
        assert {p.pid for p in slurm_cluster.steps()} <= below_us  # none went to init
        assert sorted(p.environ().get("SLURMD_NODENAME") for p in sleepers()) == ["n1", "n2"]
        done = slurm("scancel", "--name=sleeper")
        assert done.returncode == 0, done.stderr
        assert srun.wait(15) != 0
        assert slurm_cluster.leftovers() == []
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait(10)


def test_a_lost_node_fails_its_job_and_comes_back(slurm_cluster):
    srun = subprocess.Popen(["srun", "--nodes=2", "sleep", "60"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert helpers.wait_until(lambda: len(slurm_cluster.steps()) >= 4, 10)
        slurm_cluster.kill_node("n1", mark_down=True)
        assert srun.wait(15) != 0
        said = srun.stderr.read()
        # srun hears of the loss from slurmctld ("Node failure on n1") or, on a loaded
        # machine, first from its broken connection to the step on n1 ("Job step aborted"):
        # either way the job failed, and slurmctld ends it
        assert "Node failure on n1" in said or "Job step aborted" in said, said
        assert helpers.wait_until(lambda: slurm_cluster.jobs() == [], 15), slurm_cluster.jobs()
        assert slurm_cluster.node_states()["n1"].startswith("down")
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait(10)
        srun.stderr.close()
        slurm_cluster.restart_node("n1")
    assert slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"} or \
        helpers.wait_until(lambda: slurm_cluster.node_states() == {"n1": "idle",
                                                                   "n2": "idle"}, 10)
    done = slurm("srun", "--nodes=2", "hostname")
    assert done.returncode == 0, done.stderr


def test_the_cluster_and_its_helpers_import_without_pytest():
    # bench.slurm starts this cluster outside the suite, where pytest need not be installed
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pytest'] = None\n"
         "import tests.slurmcluster, tests.helpers\n"
         "assert 'pytest' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}"],
        cwd=helpers.REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
