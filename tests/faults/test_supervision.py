"""Supervision of running ranks (local backend): heartbeats and unresponsive ranks, stack
dumps taken from outside, straggler reports, the start-up report, and the checks on the
numbers a user passes.

A rank is *unresponsive* when its heartbeat thread falls silent: the process is stopped,
or a C call holds the GIL. Slow Python code, or a sleep, keeps the heartbeat going and must
never be mistaken for it.
"""

from __future__ import annotations

import logging
import re
import signal
import time

import psutil
import pytest

import phalanx as px
from phalanx.errors import CallTimeout, WorkerDied, WorkerUnresponsive
from tests import helpers
from tests.workers import SlowConstructor, Supervised

HEARTBEAT = 1.0  # seconds of silence before a rank is declared unresponsive, in these tests
# An unresponsive rank is reported within about HEARTBEAT plus the watchdog's tick; more
# than this is a failure (a loaded CI machine gets a generous margin).
DECLARED_WITHIN = HEARTBEAT + 4.0
FRAME = re.compile(r'File ".*tests/workers\.py", line \d+ in (\w+)')


@pytest.fixture(scope="module")
def backend() -> str:
    """These are local-backend tests (signals and pids of this machine)."""
    return "local"


@pytest.fixture
def watched(make_group):
    """Two ranks whose silence is noticed after HEARTBEAT seconds."""
    return make_group(Supervised, procs_per_node=2, heartbeat_timeout=HEARTBEAT)


def assert_declared_unresponsive(group, rank: int, pid: int) -> None:
    """The rank is dead as far as the group is concerned, and its process is gone."""
    health = group.health()[rank]
    assert (health.alive, health.state) == (False, "dead"), health
    assert helpers.wait_dead(pid, 3), f"unresponsive rank {rank} (pid {pid}) was not killed"


# ------------------------------------------------------------------------- heartbeats


@pytest.mark.timeout(30)
def test_a_stopped_rank_is_declared_unresponsive_and_killed(watched):
    group = watched
    pid = group.health()[1].pid
    group.send_signal(signal.SIGSTOP, workers=[1])
    started = time.monotonic()
    with pytest.raises(WorkerUnresponsive) as info:
        group.call("whoami")  # no timeout: the heartbeat watch alone must end the call
    elapsed = time.monotonic() - started
    assert elapsed < DECLARED_WITHIN, f"declared unresponsive only after {elapsed:.1f} s"
    error = info.value
    assert isinstance(error, WorkerDied)
    assert error.rank == 1
    assert isinstance(error.silent_for, float) and error.silent_for >= HEARTBEAT
    assert "stopped" in error.stack, error.stack
    message = str(error)
    assert "rank 1" in message
    assert re.search(r"no sign of life for \d+\.\d s", message), message
    assert_declared_unresponsive(group, 1, pid)


@pytest.mark.timeout(30)
def test_a_stopped_rank_nobody_calls_is_declared_by_the_watchdog_alone(watched, ranks):
    group = watched
    pid = group.health()[1].pid
    ranks.stop(group, 1)
    started = time.monotonic()
    # no thread of the test waits on the group meanwhile: its watchdog thread notices
    while time.monotonic() - started < DECLARED_WITHIN and helpers.pid_alive(pid):
        time.sleep(0.05)
    assert not helpers.pid_alive(pid), "the stopped rank was not killed by the watchdog"
    assert_declared_unresponsive(group, 1, pid)
    started = time.monotonic()
    with pytest.raises(WorkerUnresponsive) as info:  # a later call learns why it died
        group.call("whoami", timeout=10)
    assert time.monotonic() - started < 5  # from what is known: not the call's 10 s
    assert info.value.rank == 1 and info.value.silent_for >= HEARTBEAT
    assert group.call("whoami", workers=[0], timeout=10) == [0]


@pytest.mark.timeout(30)
def test_a_rank_deadlocked_holding_the_gil_is_unresponsive_with_its_stack(watched):
    group = watched
    pid = group.health()[1].pid
    started = time.monotonic()
    with pytest.raises(WorkerUnresponsive) as info:
        group.call("deadlock_holding_gil", workers=[1])
    elapsed = time.monotonic() - started
    assert elapsed < DECLARED_WITHIN, f"declared unresponsive only after {elapsed:.1f} s"
    error = info.value
    assert error.rank == 1 and error.silent_for >= HEARTBEAT
    # faulthandler dumps from its C signal handler, GIL or not
    assert "in deadlock_holding_gil" in error.stack, error.stack
    assert "deadlock_holding_gil" in str(error)
    assert_declared_unresponsive(group, 1, pid)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["busy", "sleep"])
def test_slow_python_code_is_not_unresponsive(watched, method):
    seconds = 2.5 * HEARTBEAT
    future = watched.call_async(method, seconds, workers=[1])
    result = future.result(timeout=seconds + 10)[0]
    if method == "busy":
        assert result > 0
    assert [h.state for h in watched.health()] == ["ready", "ready"]
    assert watched.call("whoami", timeout=10) == [0, 1]


@pytest.mark.timeout(30)
def test_without_heartbeats_a_stopped_rank_only_times_out(make_group, ranks):
    group = make_group(Supervised, procs_per_node=2, heartbeat_timeout=None)
    ranks.stop(group, 1)
    try:
        with pytest.raises(CallTimeout) as info:
            group.call("whoami", timeout=2 * HEARTBEAT)
        assert not isinstance(info.value, WorkerDied)
        assert info.value.pending_ranks == [1]
        assert group.health()[1].alive
    finally:
        ranks.resume(group, 1)
    assert group.call("whoami", timeout=10) == [0, 1]


@pytest.mark.timeout(30)
def test_the_other_ranks_work_on_and_the_unresponsive_one_can_be_recreated(make_group):
    group = make_group(Supervised, procs_per_node=3, heartbeat_timeout=HEARTBEAT)
    old = group.health()[1].pid
    future = group.call_async("deadlock_holding_gil", workers=[1])
    assert group.call("whoami", workers=[0, 2], timeout=10) == [0, 2]
    with pytest.raises(WorkerUnresponsive):
        future.result(timeout=DECLARED_WITHIN)
    assert group.call("whoami", workers=[0, 2], timeout=10) == [0, 2]
    assert group.call("whoami", workers="ready", timeout=10) == [0, 2]
    with pytest.raises(WorkerDied) as info:  # a rank known dead fails at once
        group.call("whoami", timeout=10)
    assert info.value.rank == 1
    assert [h.alive for h in group.health()] == [True, False, True]

    group.recreate(1, timeout=30)
    assert group.call("whoami", timeout=10) == [0, 1, 2]
    assert group.health()[1].pid != old
    assert [h.state for h in group.health()] == ["ready"] * 3


@pytest.mark.timeout(30)
def test_a_rank_slow_to_start_is_governed_by_start_timeout_not_heartbeats(make_group,
                                                                           tmp_path):
    # rank 1's interpreter takes 2.5 heartbeat timeouts to start (as on a slow shared
    # file system): it cannot send heartbeats before it runs phalanx's code at all
    (tmp_path / "sitecustomize.py").write_text(f"import time; time.sleep({2.5 * HEARTBEAT})\n")
    group = make_group(Supervised, procs_per_node=2, heartbeat_timeout=HEARTBEAT,
                       start_timeout=30, rank_env={1: {"PYTHONPATH": str(tmp_path)}})
    assert group.startup_report()[1].total >= 2.5 * HEARTBEAT
    assert group.call("whoami", timeout=10) == [0, 1]


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (float("nan"), ValueError), ("x", TypeError),
     (True, TypeError)],
)
@pytest.mark.parametrize("option", ["heartbeat_timeout", "straggler_warning"])
def test_bad_supervision_settings_are_refused_before_anything_starts(option, value, error):
    started = time.monotonic()
    with pytest.raises(error, match=option):
        px.WorkerGroup(Supervised, backend="local", echo_output=False, **{option: value})
    assert time.monotonic() - started < 1.0
    assert not helpers.stray_children()


# ----------------------------------------------------------------------------- stacks


def test_stacks_show_a_rank_sleeping_in_a_method(make_group):
    group = make_group(Supervised, procs_per_node=2)
    future = group.call_async("sleep", 30, workers=[1])
    time.sleep(0.3)  # let the call start
    report = group.stacks(timeout=1.0)
    assert isinstance(report, dict) and sorted(report) == [0, 1]
    assert "in sleep" in report[1], report[1]
    text = str(report)
    for health in group.health():
        assert f"=== rank {health.rank} (node 0, pid {health.pid}) ===" in text, text
    assert "in sleep" not in report[0]
    future.cancel()
    group.shutdown(timeout=0.5)  # rank 1 still sleeps: stop it at once


@pytest.mark.timeout(30)
def test_stacks_of_a_rank_deadlocked_holding_the_gil(make_group):
    group = make_group(Supervised, procs_per_node=2, heartbeat_timeout=60)
    group.call_async("deadlock_holding_gil", workers=[1])
    time.sleep(0.3)
    started = time.monotonic()
    report = group.stacks(ranks=[1], timeout=1.0)
    assert time.monotonic() - started < 3
    assert list(report) == [1]
    assert "in deadlock_holding_gil" in report[1], report[1]
    assert group.health()[1].alive  # not unresponsive: the heartbeat limit is 60 s
    group.shutdown(timeout=0.5, force=True)


@pytest.mark.timeout(30)
def test_stacks_of_a_stopped_rank_say_so_promptly(make_group, ranks):
    group = make_group(Supervised, procs_per_node=2, heartbeat_timeout=60)
    ranks.stop(group, 1)
    try:
        # SIGSTOP takes effect once the rank's threads next run: wait for it
        stopped = psutil.Process(group.health()[1].pid)
        assert helpers.wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 5)
        started = time.monotonic()
        report = group.stacks(timeout=1.0)
        assert time.monotonic() - started < 5  # its 1 s, and room for a loaded machine
    finally:
        ranks.resume(group, 1)
    assert "stopped" in report[1], report[1]
    assert "Thread" in report[0]
    assert group.call("whoami", timeout=10) == [0, 1]


# ------------------------------------------------------------------------ stragglers


def straggler_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name.startswith("phalanx") and r.levelno >= logging.WARNING
            and "still waiting" in r.getMessage()]


@pytest.mark.timeout(30)
def test_a_late_rank_is_reported_once_with_where_it_is(make_group, caplog):
    caplog.set_level(logging.WARNING, logger="phalanx")
    group = make_group(Supervised, procs_per_node=2, straggler_warning=0.5)
    assert group.map("sleep", [0.0, 2.5], [0, 1], timeout=20) == [0, 1]
    warnings = straggler_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "sleep()" in message and "ranks [1]" in message, message
    assert "rank 1:" in message and "rank 0:" not in message, message
    assert FRAME.search(message) and FRAME.search(message)[1] == "sleep", message


def test_no_straggler_warning_when_every_rank_answers_together(make_group, caplog):
    caplog.set_level(logging.WARNING, logger="phalanx")
    group = make_group(Supervised, procs_per_node=2, straggler_warning=0.5)
    assert group.call("sleep", 1.2, "done", timeout=20) == ["done", "done"]
    assert group.map("sleep", [0.1, 0.2], timeout=20) == [None, None]
    assert not straggler_warnings(caplog)


def test_a_call_timeout_carries_the_late_ranks_stacks(make_group):
    group = make_group(Supervised, procs_per_node=2)
    future = group.map_async("sleep", [0.0, 30.0])
    started = time.monotonic()
    with pytest.raises(CallTimeout) as info:
        future.result(timeout=1.5)
    assert time.monotonic() - started < 5
    error = info.value
    assert error.pending_ranks == [1]
    assert list(error.stacks) == [1]
    assert "in sleep" in error.stacks[1]
    assert "rank 1:" in str(error) and FRAME.search(str(error))[1] == "sleep", str(error)
    future.cancel()
    group.shutdown(timeout=0.5)


# -------------------------------------------------------------------- start-up report


def test_startup_report_accounts_for_the_constructor(make_group):
    group = make_group(SlowConstructor, args=(0.3,), procs_per_node=2)
    report = group.startup_report()
    assert [entry.rank for entry in report] == [0, 1]
    fields = ("total", "spawn", "interpreter", "waiting", "framework", "imports", "constructor")
    for entry in report:
        for field in fields:
            value = getattr(entry, field)
            assert value is None or (isinstance(value, float) and value >= 0), (field, value)
        assert entry.constructor >= 0.3
        assert entry.total >= entry.constructor
    lines = str(report).splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["rank", *fields]
    assert [line.split()[0] for line in lines[1:]] == ["0", "1"]


# ---------------------------------------------------------------- calls and arguments


def test_a_rank_list_changed_after_the_call_is_sent_does_not_change_it(make_group):
    group = make_group(Supervised, procs_per_node=2)
    selected = [0, 1]
    future = group.call_async("whoami", workers=selected)
    selected.reverse()
    assert future.result(timeout=10) == [0, 1]
    assert future.ranks == [0, 1]


def test_bad_timeouts_and_counts_are_refused(make_group):
    group = make_group(Supervised, procs_per_node=2)
    with pytest.raises(ValueError, match="timeout"):
        group.call("whoami", timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        group.call("whoami", timeout="x")
    with pytest.raises(ValueError, match="timeout"):
        group.recreate(0, timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        group.shutdown(timeout="x")
    # nothing of that reached the ranks, nor stopped the group
    assert group.call("whoami", timeout=10) == [0, 1]


@pytest.mark.parametrize(("value", "error"), [("x", TypeError), (-1, ValueError)])
def test_a_bad_stacks_timeout_is_refused(make_group, value, error):
    group = make_group(Supervised, procs_per_node=2)
    with pytest.raises(error, match="timeout"):
        group.stacks(timeout=value)


@pytest.mark.parametrize(("value", "error"), [("x", TypeError), (-1, ValueError)])
def test_a_bad_result_timeout_is_refused_even_once_the_call_is_done(make_group, value, error):
    group = make_group(Supervised, procs_per_node=2)
    future = group.call_async("whoami")
    assert helpers.wait_until(future.done, 10)
    with pytest.raises(error, match="timeout"):
        future.result(timeout=value)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [({"nodes": "2"}, TypeError, "nodes"),
     ({"start_timeout": "x"}, TypeError, "start_timeout"),
     ({"start_timeout": -1}, ValueError, "start_timeout")],
)
def test_bad_group_options_are_refused_before_anything_starts(kwargs, error, name):
    with pytest.raises(error, match=name):
        px.WorkerGroup(Supervised, backend="local", echo_output=False, **kwargs)
    assert not helpers.stray_children()
