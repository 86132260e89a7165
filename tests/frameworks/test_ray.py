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


def _daemons_of(marker: str) -> set[int]:
    """The gcs_server and raylet processes of one Ray cluster: those whose command line
    names its directory (``marker``: Ray's ``--session-dir``/``--log_dir`` lie below it).
    Only this group's, never another Ray on the machine (another test run's, a user's)."""
    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] in RAY_DAEMONS and marker in " ".join(proc.info["cmdline"] or ()):
            found.add(proc.pid)
    return found


def _cluster_marker(token: str) -> str:
    """What the directories of the Ray a group starts begin with: phalanx gives each of
    its nodes ``/tmp/phalanx-ray-<the first 8 characters of the group's token>-<node>``
    (phalanx.world.frameworks.ray_temp_dir)."""
    return f"/tmp/phalanx-ray-{token[:8]}-"


def use_the_cluster() -> dict:
    import os

    import ray

    ray.init()  # RAY_ADDRESS and the cluster's token come from the environment

    @ray.remote
    def square(x):
        return x * x

    nodes = [n for n in ray.nodes() if n["Alive"]]
    marker = _cluster_marker(os.environ["RAY_AUTH_TOKEN"])
    return {
        "address": os.environ["RAY_ADDRESS"],
        "squares": ray.get([square.remote(i) for i in range(4)]),
        "nodes": len(nodes),
        "rank": int(os.environ["RANK"]),
        "marker": marker,
        "cluster_pids": sorted(_daemons_of(marker)),
    }


def _current_cluster() -> str:
    """The address a plain ``ray.init()`` on this machine would join ("" for none): another
    Ray on the machine (the suite's, another run's) may start or stop meanwhile."""
    try:
        return Path("/tmp/ray/ray_current_cluster").read_text().strip()
    except OSError:
        return ""


@pytest.mark.slow
def test_ray_cluster_is_started_on_two_nodes_used_from_node_zero_and_stopped():
    results = px.spmd(use_the_cluster, nodes=2, framework="ray", echo_output=False,
                      start_timeout=120)()
    assert len(results) == 1  # single controller: the function ran on node 0 only
    (result,) = results
    assert result["rank"] == 0
    assert result["address"].startswith("127.0.0.1:")
    assert result["squares"] == [0, 1, 4, 9]
    assert result["nodes"] == 2  # node 1's worker joined the cluster
    # the group's own daemons (by their directory: other Rays on this machine, the suite's
    # test cluster or another run's, are not counted): a GCS, and a raylet per node
    started = set(result["cluster_pids"])
    assert len(started) >= 3, f"the group's Ray cluster had too few daemons: {started}"
    assert not started & _daemons_of(result["marker"]), "the group's Ray outlived it"
    # the group's Ray lived in a directory of its own, now removed: a later plain
    # ray.init() on this machine does not find (and try to join) the stopped cluster
    port = result["address"].rsplit(":", 1)[1]
    assert not _current_cluster().endswith(f":{port}"), _current_cluster()
    assert not glob.glob(result["marker"] + "*")


def test_single_controller_frameworks_take_one_process_per_node():
    with pytest.raises(ValueError, match="procs_per_node"):
        px.WorkerGroup(object, procs_per_node=2, framework="ray")
