"""The real Slurm of tests/slurmcluster.py, started once per test run for tests/slurm."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def slurm_cluster():
    """A slurmctld and two slurmds (n1 at 127.0.0.2, n2 at 127.0.0.3) on this machine, with
    ``SLURM_CONF`` set for the session; skipped, saying why, where Slurm cannot run. Its
    daemons are registered in ``helpers.CLUSTER_ROOTS`` by tests/slurmcluster.py itself
    (a node a test restarts gets a new process)."""
    from tests import slurmcluster

    reason = slurmcluster.available()
    if reason is not None:
        pytest.skip(f"no Slurm test cluster: {reason}")
    cluster = slurmcluster.start()
    old = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        slurmcluster.stop(cluster)


@pytest.fixture(scope="module", autouse=True)
def no_job_left_on_slurm(request):
    """Once a test module is done, no job of it may be left on the cluster: none queued
    or running, no slurmstepd (nor a process below one) left under the slurmds. What is
    left is cancelled (and killed), so that the next module starts on an idle cluster."""
    yield
    from tests import slurmcluster

    cluster = slurmcluster.running
    if cluster is None:
        return
    left = cluster.leftovers()
    jobs = cluster.jobs() if cluster.alive("slurmctld") else []
    if left or jobs:
        cluster.cancel_all()
        for proc in cluster.steps():
            try:
                proc.kill()
            except Exception:
                pass
        pytest.fail(f"module {request.module.__name__} left on Slurm: jobs {jobs}, "
                    f"processes {left}", pytrace=False)
