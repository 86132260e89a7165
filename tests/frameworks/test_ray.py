"""framework="ray": phalanx starts a Ray cluster (head on node 0, the other nodes join it),
runs the function on node 0 with RAY_ADDRESS set, and stops the cluster afterwards. Real:
two simulated nodes each run a Ray node on this machine. The start commands for nodes on
other hosts are checked as generated commands in tests/unit/test_frameworks.py."""

from __future__ import annotations

import glob
from pathlib import Path

import psutil
import pytest

import phalanx as px

pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")

RAY_DAEMONS = ("gcs_server", "raylet")


def use_the_cluster() -> dict:
    import os

    import ray

    ray.init()  # RAY_ADDRESS and the cluster's token come from the environment

    @ray.remote
    def square(x):
        return x * x

    nodes = [n for n in ray.nodes() if n["Alive"]]
    return {
        "address": os.environ["RAY_ADDRESS"],
        "squares": ray.get([square.remote(i) for i in range(4)]),
        "nodes": len(nodes),
        "rank": int(os.environ["RANK"]),
        "cluster_pids": sorted(
            p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in RAY_DAEMONS
        ),
    }


def _current_cluster_file() -> tuple[bool, float]:
    path = Path("/tmp/ray/ray_current_cluster")  # where a plain ray.init() looks for one
    return (True, path.stat().st_mtime) if path.exists() else (False, 0.0)


def _ray_daemons() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in RAY_DAEMONS}


@pytest.mark.slow
def test_ray_cluster_is_started_on_two_nodes_used_from_node_zero_and_stopped():
    before = _ray_daemons()
    cluster_file = _current_cluster_file()
    dirs_before = set(glob.glob("/tmp/phalanx-ray-*"))  # another run's are not this one's
    results = px.spmd(use_the_cluster, nodes=2, framework="ray", echo_output=False,
                      start_timeout=120)()
    assert len(results) == 1  # single controller: the function ran on node 0 only
    (result,) = results
    assert result["rank"] == 0
    assert result["address"].startswith("127.0.0.1:")
    assert result["squares"] == [0, 1, 4, 9]
    assert result["nodes"] == 2  # node 1's worker joined the cluster
    started = set(result["cluster_pids"]) - before
    assert started, "the group's Ray cluster had no gcs_server/raylet"
    assert not started & _ray_daemons(), "the group's Ray processes outlived it"
    # the group's Ray lived in a directory of its own, now removed: a later plain
    # ray.init() on this machine does not find (and try to join) the stopped cluster
    assert _current_cluster_file() == cluster_file
    assert set(glob.glob("/tmp/phalanx-ray-*")) <= dirs_before


def test_single_controller_frameworks_take_one_process_per_node():
    with pytest.raises(ValueError, match="procs_per_node"):
        px.WorkerGroup(object, procs_per_node=2, framework="ray")
