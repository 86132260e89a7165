"""No process a rank starts outlives it (local backend).

Each rank starts four sleepers (``Supervised.spawn_tree``): one in its own process group,
one in a new session, one a shell put in the background and then exited (an orphan), one
double-forked into a session of its own (a classic daemon). Whatever ends the rank -- the
controller SIGKILLed or SIGTERMed, ``shutdown()``, the rank's own death, its keeper's,
``recreate()`` -- every one of them must be gone within two seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time

import psutil
import pytest

import phalanx as px
from tests import helpers
from tests.workers import IgnoresTerm, Supervised

WORKER_CLASSES = [Supervised, IgnoresTerm]


@pytest.fixture(scope="module")
def backend() -> str:
    """Process trees are the local backend's (Ray's actors are covered elsewhere)."""
    return "local"


# ---------------------------------------------------------------- controller killed


def controller_script(tmp_path, worker_class: type):
    """The controller: two ranks with their sleepers; it prints their pids, then waits."""
    return helpers.write_script(tmp_path, f"""
        import json, time
        import phalanx as px
        from tests import helpers
        from tests.workers import {worker_class.__name__} as Worker

        group = px.WorkerGroup(Worker, procs_per_node=2, echo_output=False)
        trees = group.call("spawn_tree", timeout=30)
        own = sorted(helpers.live_worker_pids(group))  # ranks, supervisor, keepers
        print(json.dumps({{"trees": trees, "own": own}}), flush=True)
        time.sleep(60)
    """)


@pytest.mark.parametrize("worker_class", WORKER_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_nothing_outlives_a_killed_controller(tmp_path, tracked, sig, worker_class):
    with helpers.running_script(controller_script(tmp_path, worker_class)) as controller:
        ready, _, _ = select.select([controller.stdout], [], [], 60)
        assert ready, "the controller script did not start its workers"
        line = controller.stdout.readline()
        assert line, f"the controller script failed:\n{controller.stderr.read()}"
        report = json.loads(line)
        tracked.add_trees(report["trees"])
        for pid in report["own"]:
            tracked.add(pid, f"phalanx process {pid} of the controller")
        assert len(report["own"]) >= 3  # two ranks and their supervisor at least

        os.kill(controller.pid, sig)
        killed = time.monotonic()
        controller.wait(10)
        tracked.assert_gone(killed, f"the controller's {sig.name}")


# ------------------------------------------------------------------ inside the group


@pytest.mark.parametrize("worker_class", WORKER_CLASSES, ids=lambda c: c.__name__)
def test_nothing_outlives_shutdown(make_group, tracked, worker_class):
    group = make_group(worker_class, procs_per_node=2)
    tracked.add_trees(group.call("spawn_tree", timeout=30))
    for pid in helpers.live_worker_pids(group):
        tracked.add(pid, f"phalanx process {pid}")
    started = time.monotonic()
    group.shutdown(timeout=5)
    assert time.monotonic() - started < 5
    tracked.assert_gone(started, "shutdown()")


def test_nothing_outlives_shutdown_of_a_busy_rank_that_ignores_sigterm(make_group, tracked):
    group = make_group(IgnoresTerm, procs_per_node=2)
    tracked.add_trees(group.call("spawn_tree", timeout=30))
    for health in group.health():
        tracked.add(health.pid, f"rank {health.rank}")
    future = group.call_async("sleep", 60, workers=[1])
    time.sleep(0.2)
    started = time.monotonic()
    group.shutdown(timeout=1)
    assert future.done()
    tracked.assert_gone(started, "shutdown(timeout=1) of a busy rank ignoring SIGTERM")


@pytest.mark.parametrize("killed", ["rank", "keeper"])
@pytest.mark.parametrize("worker_class", WORKER_CLASSES, ids=lambda c: c.__name__)
def test_a_dead_ranks_descendants_go_with_it(make_group, tracked, worker_class, killed):
    """SIGKILL of rank 1, or of its keeper (the rank's parent-death signal, armed before
    exec, takes the rank): its whole tree goes, while the group lives on, rank 0 with its
    own subprocesses."""
    group = make_group(worker_class, procs_per_node=2)
    trees = group.call("spawn_tree", timeout=30)
    tracked.add_trees(trees[1:], ranks=[1])
    pid = group.health()[1].pid
    tracked.add(pid, "rank 1")
    os.kill(pid if killed == "rank" else psutil.Process(pid).ppid(), signal.SIGKILL)
    started = time.monotonic()
    tracked.assert_gone(started, f"the SIGKILL of rank 1's {killed}")
    if killed == "keeper":
        with pytest.raises(px.WorkerDied, match="SIGKILL"):
            group.call("whoami", workers=[1], timeout=10)
    assert group.call("whoami", workers=[0], timeout=10) == [0]
    assert all(helpers.pid_alive(p) for p in trees[0].values())


@pytest.mark.parametrize("worker_class", WORKER_CLASSES, ids=lambda c: c.__name__)
def test_recreate_leaves_nothing_of_the_old_rank(make_group, tracked, worker_class):
    group = make_group(worker_class, procs_per_node=2)
    trees = group.call("spawn_tree", timeout=30)
    tracked.add_trees(trees[1:], ranks=[1])
    tracked.add(group.health()[1].pid, "old rank 1")
    started = time.monotonic()
    group.recreate(1, timeout=30)
    # an idle rank that ignores SIGTERM is SIGKILLed after the term grace (3 s)
    took = time.monotonic() - started
    tracked.assert_gone(time.monotonic(), f"recreate(1) (which took {took:.1f} s)")
    assert group.call("whoami", timeout=10) == [0, 1]
    assert all(helpers.pid_alive(p) for p in trees[0].values())
