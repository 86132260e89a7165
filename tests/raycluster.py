"""A real three-node Ray cluster on this machine, on loopback addresses, for the ray tests.

Ray's own test cluster (``ray.cluster_utils.Cluster``): a head node on 127.0.0.2 and two
worker nodes on 127.0.0.3 and 127.0.0.4, each with its own raylet, so ranks on different
nodes see different ``MASTER_ADDR``/``NODE_RANK`` values and a node can be removed.
Each node declares ``GPUS_PER_NODE`` GPUs (there are none: Ray only counts them and sets
``CUDA_VISIBLE_DEVICES``), so that placement by GPUs, fractions included, is tested.
The test code reaches the workers the way it reaches a cluster whose image holds it: on
``PYTHONPATH`` in the environment the nodes' daemons start with (so their workers inherit
it). Not in the job's ``runtime_env``: a job with one has every worker's start wait on the
node's runtime-env agent, about 0.2 s more per actor, which the suite's few hundred groups
would pay (tests of a ``runtime_env`` give their own).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.helpers import REPO

CPUS_PER_NODE = 8  # logical CPUs: enough bundles for the contract suite's groups
GPUS_PER_NODE = 2  # logical GPUs: Ray's bookkeeping only
# (not 127.0.0.1: Ray rewrites that address to the machine's own when connecting)
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
# How long a question to Ray's GCS may take in a check: Ray's calls wait on its GCS without
# a bound of their own, so a cluster whose raylet or GCS died would hold a teardown forever.
ANSWER_TIMEOUT = 20.0


class RayUnresponsive(RuntimeError):
    """Ray did not answer a check in time (its GCS or raylet is gone)."""


def _asked(what: str, question: Callable[[], Any]) -> Any:
    """``question()``'s answer, asked on a thread of its own and waited for at most
    ANSWER_TIMEOUT s (RayUnresponsive after that: the thread is left to Ray); never
    asked of a Ray this process is not connected to (Ray would start one to ask)."""
    import ray

    if not ray.is_initialized():
        raise RayUnresponsive(f"{what}: this process is not connected to Ray")
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["value"] = question()
        except BaseException as exc:  # handed to the asking thread
            answer["error"] = exc

    thread = threading.Thread(target=ask, daemon=True, name="raycluster-check")
    thread.start()
    thread.join(ANSWER_TIMEOUT)
    if thread.is_alive():
        raise RayUnresponsive(f"{what}: Ray did not answer within {ANSWER_TIMEOUT:g} s "
                              "(its GCS or a raylet is gone?)")
    if "error" in answer:
        raise answer["error"]
    return answer["value"]


@contextlib.contextmanager
def _code_on_path():
    """``PYTHONPATH`` naming this checkout while the nodes' daemons start."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old) if p)
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def start():
    import psutil
    import ray
    from ray.cluster_utils import Cluster

    from tests import helpers

    before = {p.pid for p in psutil.Process().children()}
    with _code_on_path():
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": CPUS_PER_NODE, "num_gpus": GPUS_PER_NODE,
                            "include_dashboard": False,
                            "node_ip_address": NODE_ADDRESSES[0]},
        )
        for address in NODE_ADDRESSES[1:]:
            cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE,
                             node_ip_address=address)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address=NODE_ADDRESSES[0], log_to_driver=True)
    helpers.CLUSTER_ROOTS.update(p.pid for p in psutil.Process().children()
                                 if p.pid not in before)
    return cluster


def stop(cluster) -> None:
    import ray

    from tests import helpers

    ray.shutdown()
    cluster.shutdown()
    helpers.CLUSTER_ROOTS.clear()


def add_node(cluster, address: str):
    import psutil

    from tests import helpers

    before = {p.pid for p in psutil.Process().children()}
    with _code_on_path():
        node = cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE,
                                node_ip_address=address)
    cluster.wait_for_nodes()
    helpers.CLUSTER_ROOTS.update(p.pid for p in psutil.Process().children()
                                 if p.pid not in before)
    return node


def _alive_actors() -> list[dict]:
    """Live named actors (phalanx names every actor it makes)."""
    import ray

    return _asked("listing the named actors",
                  lambda: ray.util.list_named_actors(all_namespaces=True))


def _live_placement_groups() -> list[str]:
    import ray

    table = _asked("reading the placement groups", ray.util.placement_group_table)
    return [f"placement group {info.get('name') or pg_id} ({info['state']})"
            for pg_id, info in table.items() if info.get("state") != "REMOVED"]


def leftovers(wait: float = 5.0) -> list[str]:
    """Actors not yet dead and placement groups not removed (waiting a moment: Ray
    records a kill asynchronously)."""
    deadline = time.monotonic() + wait
    while True:
        found = [f"actor {a['name']!r}" for a in _alive_actors()] + _live_placement_groups()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def clean() -> None:
    """Remove what a failed test left, so that later tests start from an empty cluster."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for actor in _alive_actors():
        try:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
        except Exception:
            pass
    for pg_id, info in _asked("reading the placement groups",
                              ray.util.placement_group_table).items():
        if info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
