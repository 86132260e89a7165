"""``phalanx run`` started as srun starts it: no flags, no terminal, only the variables of a
task of the step (as Slurm 22.05 sets them) and ``scontrol`` on PATH (a fake one, naming
127.0.0.1 as the first node's NodeAddr). Two launchers on this machine stand for the
step's two nodes; the real Slurm end-to-end test is elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers
from tests.cli.test_multinode import free_port
from tests.unit.test_slurm_run_defaults import FakeScontrol
from tests.unit.test_slurm_world import SRUN_N2_N3_TASK1, SRUN_N2_TASK0, SRUN_N2_TASK1

RUN_TIMEOUT = 60.0  # seconds for the two-node job to run to its end

SHOW = """\
import json, os
names = ("RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "MASTER_ADDR")
with open(f"env-{os.environ['RANK']}.json", "w") as f:
    json.dump({k: os.environ.get(k) for k in names}, f)
"""


def task_env(directory: Path, task: dict[str, str]) -> dict[str, str]:
    """This checkout's script environment, as an srun task's: no torchrun or Slurm
    variables of this process's own, the fake scontrol first on PATH."""
    env = {k: v for k, v in helpers.script_env().items()
           if not k.startswith(("SLURM", "PET_"))}
    env.update(task)
    env["PATH"] = f"{directory}{os.pathsep}{env.get('PATH', '')}"
    return env


def start(directory: Path, task: dict[str, str], name: str, *args: str) -> subprocess.Popen:
    with open(directory / f"{name}.out", "w") as out, open(directory / f"{name}.err",
                                                           "w") as err:
        return subprocess.Popen([sys.executable, "-m", "phalanx", "run", *args],
                                cwd=directory, env=task_env(directory, task), stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL)


@pytest.fixture
def job_dir(tmp_path):
    (tmp_path / "show.py").write_text(SHOW)
    FakeScontrol(tmp_path, address="127.0.0.1")
    return tmp_path


def test_the_tasks_of_a_two_node_step_form_one_world(job_dir):
    port = str(free_port())  # not 29500: tests run side by side
    launchers = [start(job_dir, task, f"node{i}", "-n", "2", "--master-port", port,
                       "show.py")
                 for i, task in enumerate((SRUN_N2_TASK0, SRUN_N2_TASK1))]
    try:
        statuses = [launcher.wait(RUN_TIMEOUT) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    logs = "\n".join((job_dir / f"node{i}.err").read_text() for i in range(2))
    assert statuses == [0, 0], logs
    envs = sorted((json.loads(p.read_text()) for p in job_dir.glob("env-*.json")),
                  key=lambda e: int(e["RANK"]))
    assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {("4", "127.0.0.1")}
    # every launcher asked scontrol for node 0's address once
    assert (job_dir / "calls").read_text().splitlines() == ["show node -o n1"] * 2


def test_several_tasks_on_a_node_are_refused_before_any_rank_starts(job_dir):
    launcher = start(job_dir, SRUN_N2_N3_TASK1, "crowded", "-n", "2", "show.py")
    assert launcher.wait(RUN_TIMEOUT) == 2
    err = (job_dir / "crowded.err").read_text()
    assert "phalanx run: srun runs 2 tasks on node n1 (step 1.0)" in err
    assert "srun --ntasks-per-node=1 phalanx run -n N" in err
    assert not list(job_dir.glob("env-*.json"))
