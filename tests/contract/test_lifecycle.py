"""Health, recreate, restart and shutdown."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from phalanx import GroupClosed, StartupError, WorkerDied, WorkerGroup
from tests import helpers
from tests.workers import FailsOnceFlagged, Probe


def test_health_reports_every_rank(make_group, ranks):
    group = make_group(Probe, nodes=2, procs_per_node=1)
    pids = group.call("pid")
    health = group.health()
    assert [h.rank for h in health] == [0, 1]
    assert [h.node for h in health] == [0, 1]
    assert [h.pid for h in health] == pids
    assert all(h.alive and h.exitcode is None and h.calls_in_flight == 0 for h in health)

    future = group.call_async("sleep", 0.5, workers=[1])
    assert [h.calls_in_flight for h in group.health()] == [0, 1]
    future.result(timeout=10)
    assert [h.calls_in_flight for h in group.health()] == [0, 0]

    ranks.kill(group, 0)
    assert helpers.wait_dead(pids[0])
    dead = group.health()[0]
    assert (dead.alive, dead.exitcode, dead.pid) == (False, -signal.SIGKILL, pids[0])
    assert group.health()[1].alive


def test_recreate_replaces_a_killed_rank_with_the_same_identity(make_group, ranks):
    group = make_group(Probe, args=("ctor-arg",), procs_per_node=2, env={"USER_VAR": "u"})
    before = group.call("env", "RANK", "MASTER_PORT", "USER_VAR")
    old = group.call("pid")
    ranks.kill(group, 1, wait=False)
    with pytest.raises(WorkerDied):
        group.call("pid", timeout=10)
    group.recreate(1)
    new = group.call("pid")
    assert new[0] == old[0] and new[1] != old[1]
    assert group.call("env", "RANK", "MASTER_PORT", "USER_VAR") == before
    assert group.call("init_args") == [(("ctor-arg",), {})] * 2
    assert [h.alive for h in group.health()] == [True, True]


def test_a_call_to_a_rank_dead_before_it_was_sent_says_so(make_group, ranks):
    group = make_group(Probe, procs_per_node=2)
    pids = group.call("pid")
    ranks.kill(group, 1, wait=False)
    assert helpers.wait_dead(pids[1])
    # its death reaches the controller (on Ray too); no call waits on it
    assert helpers.wait_until(lambda: not group.health()[1].alive, 10), \
        "the group did not learn of rank 1's death within 10 s"
    # Either the call learns of the death as it is sent, or the watchdog's poll (once a
    # second) did before and the call is refused; never "died while running pid()".
    rank1 = rf"^rank 1 of group {re.escape(group.name)} \(node 0, pid {pids[1]}\)"
    with pytest.raises(WorkerDied, match=rank1 +
                       r" (was already dead when pid\(\) was sent|died): "):
        group.call("pid", timeout=10)
    with pytest.raises(WorkerDied, match=rank1 + " died: "):
        group.call("pid", timeout=10)  # known dead now: refused before anything is sent


def test_recreate_a_live_rank_stops_the_old_process(make_group):
    group = make_group(Probe, procs_per_node=2)
    old = group.call_one(0, "pid")
    group.recreate(0)
    assert helpers.wait_dead(old, 3)
    assert group.call_one(0, "pid") != old
    assert group.call("rank") == [0, 1]


def test_a_failed_recreate_leaves_the_rank_dead_not_hanging(make_group, tmp_path):
    flag = tmp_path / "flag"
    group = make_group(FailsOnceFlagged, args=(str(flag), "hang"), procs_per_node=2)
    flag.touch()
    with pytest.raises(StartupError) as info:
        group.recreate(1, timeout=1)  # the hang is 600 s: any bound shows it is not waited out
    assert info.value.rank == 1
    assert [h.alive for h in group.health()] == [True, False]
    started = time.monotonic()
    with pytest.raises(WorkerDied):
        group.call_one(1, "rank", timeout=5)
    assert time.monotonic() - started < 3  # a known death: not the call's 5 s (room for load)
    flag.unlink()
    group.recreate(1)  # the rank can still be brought back
    assert group.call("rank", timeout=5) == [0, 1]


def test_recreate_without_a_timeout_is_bounded_by_the_groups_start_timeout(tmp_path):
    flag = tmp_path / "flag"
    with WorkerGroup(FailsOnceFlagged, args=(str(flag), "hang"), procs_per_node=2,
                     backend="local", start_timeout=1, echo_output=False) as group:
        flag.touch()
        started = time.monotonic()
        with pytest.raises(StartupError) as info:
            group.recreate(1)
        assert info.value.rank == 1
        assert time.monotonic() - started < 5  # the hang is 600 s


def test_a_failed_restart_leaves_the_ranks_dead_not_hanging(make_group, tmp_path):
    flag = tmp_path / "flag"
    group = make_group(FailsOnceFlagged, args=(str(flag), "raise"), procs_per_node=2)
    flag.touch()
    with pytest.raises(StartupError) as info:
        group.restart()
    assert info.value.rank == 1
    assert [h.alive for h in group.health()] == [False, False]
    started = time.monotonic()
    with pytest.raises(WorkerDied):
        group.call_one(0, "rank", timeout=5)
    assert time.monotonic() - started < 3  # a known death: not the call's 5 s (room for load)
    flag.unlink()
    group.restart()
    assert group.call("rank", timeout=5) == [0, 1]


def test_restart_replaces_every_process(make_group):
    group = make_group(Probe, args=("x",), procs_per_node=3)
    old = group.call("pid")
    pending = group.call_async("sleep", 30, workers=[2])
    group.restart()
    with pytest.raises(WorkerDied):
        pending.result(timeout=5)
    new = group.call("pid")
    assert not set(old) & set(new) and len(set(new)) == 3
    assert helpers.wait_dead(old, 3)
    assert group.call("rank") == [0, 1, 2]
    assert group.call("init_args") == [(("x",), {})] * 3


def test_resize_with_the_same_nodes_keeps_the_group_as_it_is(make_group):
    # on the cluster backend three agents answer: the group still runs on the one it asked for
    group = make_group(Probe, nodes=1, procs_per_node=2)
    pids = group.call("pid")
    seen = []
    group.on_membership_change(seen.append)
    assert group.resize() == 2
    assert (group.world_size, group.nodes) == (2, 1)
    assert group.call("pid") == pids  # nothing restarted
    group.restart()
    assert group.world_size == 2 and group.call("pid") != pids
    assert seen == []


def test_shutdown_is_idempotent_and_closes_the_group(make_group):
    group = make_group(Probe, procs_per_node=2)
    pids = group.call("pid")
    group.shutdown()
    group.shutdown()
    assert helpers.wait_dead(pids, 1)
    assert [h.alive for h in group.health()] == [False, False]
    for call in (
        lambda: group.call("rank"),
        lambda: group.call_async("rank"),
        lambda: group.map("rank"),
        lambda: group.call_one(0, "rank"),
        lambda: group.recreate(0),
        lambda: group.restart(),
    ):
        with pytest.raises(GroupClosed):
            call()


def test_pending_calls_end_with_group_closed(make_group):
    group = make_group(Probe, procs_per_node=2)
    future = group.call_async("sleep", 60)
    started = time.monotonic()
    group.shutdown(timeout=0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(GroupClosed):
        future.result(timeout=5)


def test_cleanup_method_runs_on_every_rank(make_group, tmp_path):
    group = make_group(Probe, kwargs={"marker_dir": str(tmp_path)}, procs_per_node=3)
    pids = group.call("pid")
    group.shutdown(cleanup="cleanup")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]
    assert [int((tmp_path / f"rank{r}").read_text()) for r in range(3)] == pids
    assert helpers.wait_dead(pids, 1)


def test_a_failing_cleanup_does_not_stop_the_shutdown(make_group, tmp_path):
    # Rank 1 fails at once; the others' cleanup, still running then, ends all the same.
    kwargs = {"marker_dir": str(tmp_path), "fail_cleanup_on": 1, "cleanup_delay": 1.0}
    group = make_group(Probe, kwargs=kwargs, procs_per_node=3)
    pids = group.call("pid")
    group.shutdown(cleanup="cleanup", timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank2"]
    assert helpers.wait_dead(pids, 1)


def test_a_hanging_cleanup_is_bounded_by_the_shutdown_timeout(make_group):
    group = make_group(Probe, procs_per_node=2)
    pids = group.call("pid")
    started = time.monotonic()
    group.shutdown(cleanup="hang", timeout=0.5)
    assert time.monotonic() - started < 3
    assert helpers.wait_dead(pids, 1)


@pytest.mark.parametrize("timeout", [None, float("inf")])
def test_a_shutdown_with_no_limit_waits_for_the_cleanup_and_the_exit(make_group, tmp_path,
                                                                      timeout):
    group = make_group(Probe, kwargs={"marker_dir": str(tmp_path)}, procs_per_node=2)
    pids = group.call("pid")
    group.shutdown(cleanup="cleanup", timeout=timeout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert helpers.wait_dead(pids, 1)
    with pytest.raises(GroupClosed):
        group.call("pid")


def test_a_bad_shutdown_timeout_is_refused_before_anything_stops(make_group):
    group = make_group(Probe)
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("30", TypeError)):
        with pytest.raises(error, match="shutdown timeout"):
            group.shutdown(timeout=bad)
    assert group.call("rank") == [0]


def test_timeouts_of_any_length_are_waited_out(make_group):
    # a poll's timeout overflows past 2**31 ms (~25 days), a lock's past ~292 years
    group = make_group(Probe, procs_per_node=2)
    for timeout in (3e6, 1e9, 1e12, float("inf")):
        assert group.call("sleep", 0.01, "x", timeout=timeout) == ["x", "x"]
        assert group.call_one(1, "rank", timeout=timeout) == 1
        future = group.call_async("sleep", 0.01, "y")
        assert future.futures[1].result(timeout=timeout) == "y"
        assert future.result(timeout=timeout) == ["y", "y"]
    group.recreate(1, timeout=1e12)
    assert group.call("rank", timeout=1e12) == [0, 1]


def test_forced_shutdown_skips_cleanup_and_does_not_wait(make_group, tmp_path):
    group = make_group(Probe, kwargs={"marker_dir": str(tmp_path)}, procs_per_node=2)
    pids = group.call("pid")
    future = group.call_async("sleep", 60)
    started = time.monotonic()
    group.shutdown(cleanup="cleanup", force=True)
    assert time.monotonic() - started < 3
    assert list(tmp_path.iterdir()) == []
    assert helpers.wait_dead(pids, 1)
    with pytest.raises(GroupClosed):
        future.result(timeout=5)


def test_context_manager_shuts_down(backend):
    from phalanx import WorkerGroup

    with WorkerGroup(Probe, procs_per_node=2, backend=backend, echo_output=False) as group:
        pids = group.call("pid")
    assert helpers.wait_dead(pids, 1)
    with pytest.raises(GroupClosed):
        group.call("pid")


def test_two_groups_live_side_by_side(make_group):
    first = make_group(Probe, procs_per_node=2)
    second = make_group(Probe)
    first_pids, second_pids = first.call("pid"), second.call("pid")
    assert not set(first_pids) & set(second_pids)
    first.shutdown()
    assert helpers.wait_dead(first_pids, 1)
    assert second.call("pid") == second_pids


def test_workers_outlive_the_thread_that_started_them(make_group):
    # PR_SET_PDEATHSIG fires when the *thread* that forked a child exits.
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("group", make_group(Probe)))
    thread.start()
    thread.join(30)
    group = box["group"]
    pids = group.call("pid")
    time.sleep(0.2)
    assert helpers.pid_alive(pids[0])
    assert group.call("pid") == pids


def test_shutdown_leaves_no_worker_or_grandchild_alive(make_group):
    group = make_group(Probe, procs_per_node=2)
    pids = group.call("pid")
    grandchildren = group.call("spawn_sleeper")
    assert all(helpers.pid_alive(p) for p in grandchildren)
    group.shutdown()
    assert helpers.wait_dead(pids + grandchildren, 2)


def test_a_killed_worker_does_not_leave_its_children_running(make_group, ranks):
    group = make_group(Probe, procs_per_node=2)
    pid = group.call_one(1, "pid")
    grandchild = group.call_one(1, "spawn_sleeper")
    ranks.kill(group, 1, wait=False)
    group.recreate(1)
    group.shutdown()
    assert helpers.wait_dead([pid, grandchild], 2)


def test_shutdown_kills_grandchildren_that_left_the_process_group(make_group):
    group = make_group(Probe)
    grandchild = group.call_one(0, "spawn_sleeper", new_session=True)
    try:
        group.shutdown()
        assert helpers.wait_dead(grandchild, 2)
    finally:
        helpers.kill_quietly(grandchild, signal.SIGKILL)
