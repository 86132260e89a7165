"""Why Slurm ended a job, as ``SlurmJob.why_ended`` reads it from slurmstepd's notices in
the job's logs: the causes that take a minute or more to bring about on the test cluster
(a time limit is at least a minute, checked every 30 s; preemption and node failures need
more of it). scancel, read from the job's state and these notices alike, is in
test_slurm_backend.py against the real Slurm. Needs no Slurm: the logs are written here,
as slurmstepd writes them, and no job is asked about."""

from __future__ import annotations

import pytest

from phalanx.backends.cluster.slurmjob import JobRequest, SlurmJob

AGENT_LOG = """\
phalanx: phalanx agent listening on 127.0.0.2:36857
slurmstepd-n1: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-05-01T10:00:00{due} ***
phalanx: phalanx agent stopping: its controllers' ranks are being stopped
"""


def job_with_log(tmp_path, text: str, name: str = "agent-gpu17.log") -> SlurmJob:
    job = SlurmJob(JobRequest(nodes=2), environ={})  # no job id: Slurm is not asked
    (tmp_path / name).write_text(text)
    job.directory = str(tmp_path)
    return job


@pytest.mark.parametrize(("due", "means"), [
    (" DUE TO TIME LIMIT", "it reached its time limit"),
    (" DUE TO PREEMPTION", "it was preempted by another job"),
    (" DUE TO NODE FAILURE", "one of its nodes failed"),
    ("", "it was cancelled with scancel"),
])
def test_slurmsteps_notice_in_an_agents_log_says_why(tmp_path, due, means):
    job = job_with_log(tmp_path, AGENT_LOG.format(due=due))
    why = job.why_ended(wait=0)
    assert why is not None and why.startswith(f"Slurm ended a slurm job: {means}"), why
    assert f'"STEP 7.0 ON n1 CANCELLED AT 2026-05-01T10:00:00{due}"' in why


def test_the_batch_scripts_notice_says_it_too(tmp_path):
    job = job_with_log(tmp_path, "srun: forcing job termination\nslurmstepd-n1: error: *** "
                       "JOB 7 ON n1 CANCELLED AT 2026-05-01T10:00:00 DUE TO TIME LIMIT ***\n",
                       name="batch.log")
    assert "it reached its time limit" in (job.why_ended(wait=0) or "")


def test_no_notice_no_cause_and_a_job_whose_directory_is_gone_neither(tmp_path):
    assert job_with_log(tmp_path, "phalanx: phalanx agent listening on n1:1\n"
                        ).why_ended(wait=0) is None
    job = job_with_log(tmp_path, AGENT_LOG.format(due=""))
    job.directory = str(tmp_path / "removed by its last agent")
    assert job.why_ended(wait=0) is None
