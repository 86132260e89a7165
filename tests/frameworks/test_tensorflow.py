"""framework="tensorflow": TF_CONFIG with one worker task per node, and a real
MultiWorkerMirroredStrategy collective across two simulated nodes."""

from __future__ import annotations

import pytest

import phalanx as px

pytest.importorskip("tensorflow", reason="tensorflow is not installed "
                                         "(pip install 'phalanx[tensorflow]')")


def strategy_all_reduce() -> dict:
    import json
    import os

    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    per_replica = strategy.run(lambda: tf.constant(float(task + 1)))
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return {"task": task, "sum": float(total), "replicas": strategy.num_replicas_in_sync,
            "node": int(os.environ["NODE_RANK"])}


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_reduces_across_two_nodes():
    results = px.spmd(strategy_all_reduce, nodes=2, framework="tensorflow", echo_output=False,
                      env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)()
    assert [r["task"] for r in results] == [0, 1]  # task index = node rank
    assert [r["node"] for r in results] == [0, 1]
    assert all(r["replicas"] == 2 for r in results)
    assert all(r["sum"] == 1.0 + 2.0 for r in results)
