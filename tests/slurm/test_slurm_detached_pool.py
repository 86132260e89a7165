"""A detached resource pool on ``px.SlurmBackend`` against a real Slurm
(tests/slurmcluster.py): a controller in a process of its own reserves a detached pool of
two nodes (one job), places a group on each node and is SIGKILLed. The job runs on while
its agents keep the groups; another process attaches each group by its name and the job's
id, on the node it ran on, with the same ranks. Shutting the first down leaves the job
(and the other group) running; the last one's shutdown ends the job, its directory too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import phalanx as px
from tests import helpers
from tests.slurm.test_slurm_backend import job_state, wait_ended

pytestmark = pytest.mark.usefixtures("slurm_cluster")

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    pool = px.ResourcePool(nodes=2, procs_per_node=1, name="rl", detached=True,
                           detach_timeout=60, backend=px.SlurmBackend(state_dir=sys.argv[1]))
    first, second = pool.split([1, 1])
    groups = {"trainer": px.WorkerGroup(Probe, pool=first, name="trainer", echo_output=False),
              "actor": px.WorkerGroup(Probe, pool=second, name="actor", echo_output=False)}
    for name, group in groups.items():
        group.call("record", name, timeout=60)
    print(json.dumps({
        "job": groups["trainer"].call("env", "SLURM_JOB_ID")[0]["SLURM_JOB_ID"],
        "pids": {name: group.call("pid") for name, group in groups.items()},
        "nodes": {name: group.call("env", "SLURMD_NODENAME")[0]["SLURMD_NODENAME"]
                  for name, group in groups.items()}}), flush=True)
    time.sleep(120)  # SIGKILLed here
""")


def test_a_detached_pools_groups_keep_its_job_until_the_last_one_ends(tmp_path):
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(state)],
                            stdout=subprocess.PIPE, text=True, cwd=helpers.REPO,
                            env={**os.environ, "PYTHONPATH": str(helpers.REPO)})
    started = None
    groups: list[px.WorkerGroup] = []
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the controller ended before starting its groups (code {proc.wait(30)})"
        started = json.loads(line)
        job, pids = started["job"], started["pids"]
        assert started["nodes"] == {"trainer": "n1", "actor": "n2"}
        (directory,) = state.glob("job-*")
        proc.kill()
        proc.wait(30)
        assert job_state(job) == "RUNNING"  # its agents keep the pool's groups
        listed = px.attached(px.SlurmBackend(job=job, state_dir=str(state)))
        assert [(g["name"], g["holder"]) for g in listed] == [("actor", None),
                                                               ("trainer", None)]
        for name in ("trainer", "actor"):  # each on the node it ran on
            groups.append(px.attach(name, backend=px.SlurmBackend(job=job, state_dir=str(
                state)), echo_output=False))
        trainer, actor = groups
        assert trainer.call("pid") == pids["trainer"] and actor.call("pid") == pids["actor"]
        assert actor.call("env", "SLURMD_NODENAME") == [{"SLURMD_NODENAME": "n2"}]
        assert actor.call("history") == [["actor"]]

        trainer.shutdown()  # one group ended: the job runs on for the other
        assert helpers.wait_until(lambda: not helpers.alive(pids["trainer"]), 15)
        assert job_state(job) == "RUNNING"
        assert actor.call("pid") == pids["actor"]
        assert [g["name"] for g in px.attached(px.SlurmBackend(job=job, state_dir=str(
            state)))] == ["actor"]

        actor.shutdown()  # the last one: the job ends, its directory with it
        assert wait_ended(job, timeout=30) in ("COMPLETED", "")
        assert helpers.wait_until(lambda: not helpers.alive(pids["actor"]), 10)
        assert helpers.wait_until(lambda: not Path(directory).exists(), 10), \
            list(Path(directory).rglob("*"))
    finally:
        for group in groups:
            group.shutdown()
        proc.kill()
        proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]
        if started is not None and job_state(started["job"]) not in ("COMPLETED", ""):
            subprocess.run(["scancel", started["job"]], timeout=30, check=False)
            wait_ended(started["job"])
