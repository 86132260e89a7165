"""framework="jax": jax.distributed.initialize() with no arguments, and a real exchange."""

from __future__ import annotations

import pytest

import phalanx as px

pytest.importorskip("jax", reason="jax is not installed (pip install 'phalanx[jax]')")


def allgather_process_ids() -> dict:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.distributed.initialize()  # coordinator, process id and count come from phalanx
    gathered = multihost_utils.process_allgather(np.array([jax.process_index() * 10]))
    return {
        "index": jax.process_index(),
        "count": jax.process_count(),
        "gathered": gathered.ravel().tolist(),
        "global_devices": jax.device_count(),
    }


@pytest.mark.slow
def test_two_processes_initialise_and_all_gather_across_processes():
    results = px.spmd(allgather_process_ids, nodes=2, framework="jax", echo_output=False)()
    assert [r["index"] for r in results] == [0, 1]
    assert all(r["count"] == 2 for r in results)
    assert all(r["gathered"] == [0, 10] for r in results)
    assert all(r["global_devices"] == 2 for r in results)  # one CPU device per process
