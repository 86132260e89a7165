"""The real Slurm of tests/slurmcluster.py, started once per test run for tests/slurm."""

from __future__ import annotations

import os

import pytest

from tests import helpers


@pytest.fixture(scope="session")
def slurm_cluster():
    """A slurmctld and two slurmds (n1 at 127.0.0.2, n2 at 127.0.0.3) on this machine, with
    ``SLURM_CONF`` set for the session; skipped, saying why, where Slurm cannot run."""
    from tests import slurmcluster

    reason = slurmcluster.available()
    if reason is not None:
        pytest.skip(f"no Slurm test cluster: {reason}")
    cluster = slurmcluster.start()
    roots = {proc.pid for proc in cluster.procs.values()}
    helpers.CLUSTER_ROOTS.update(roots)
    old = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        helpers.CLUSTER_ROOTS.difference_update(roots)
        slurmcluster.stop(cluster)
