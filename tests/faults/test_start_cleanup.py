"""A group whose start fails part way gives back everything it took: its name, the
descriptors (the dispatcher's epoll and wake pipe, the backend's pipes), its threads and
its processes.

The failures are real: the controller's descriptor limit is set just above what it holds,
a few more each time, so that the start runs out of descriptors at one step after
another (the dispatcher's, the backend's, a rank's pipes) until it has enough and starts.
A second test makes each step of the group's own build raise in turn.
"""

from __future__ import annotations

import os
import resource
import threading
import time

import psutil
import pytest

import phalanx as px
from phalanx.controller import group as group_module
from phalanx.controller.names import GROUP_NAMES
from tests.workers import Probe

NAME = "cleanup-probe"
SETTLE = 20.0  # s: threads and processes the failed start stopped take this long at most


@pytest.fixture(autouse=True)
def warm() -> None:
    """One group started and stopped first: what a process keeps for its life once it
    started any group (the spawn thread, whose forks make ranks die with it) is not
    what a failed start took."""
    with px.WorkerGroup(Probe, echo_output=False) as group:
        group.call("rank")


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _held() -> tuple[set[int], int, set[int]]:
    children = {p.pid for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE}
    return _open_fds(), threading.active_count(), children


def _settled(fds: set[int], threads: int,
             children: set[int]) -> tuple[set[int], int, set[int]]:
    """What is held once the failed start's threads and processes are gone (or SETTLE)."""
    deadline = time.monotonic() + SETTLE
    while True:
        now = _held()
        if (now[0] <= fds and now[1] <= threads and now[2] <= children) \
                or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _assert_nothing_held(before: tuple[set[int], int, set[int]], what: str) -> None:
    """Nothing more than ``before`` (what the test process held already: a session's
    agents, say) is held: descriptors, threads, processes, the group's name."""
    fds, threads, children = before
    now_fds, now_threads, now_children = _settled(fds, threads, children)
    assert now_fds <= fds, f"{what}: descriptors left open: {sorted(now_fds - fds)}"
    assert now_threads <= threads, f"{what}: threads left: {threading.enumerate()}"
    assert now_children <= children, \
        f"{what}: processes left: {sorted(now_children - children)}"
    GROUP_NAMES.check_free(NAME)  # the name is free again (ValueError if not)


@pytest.fixture
def no_free_numbers_below_the_highest():
    """Every free descriptor number below the highest one held, taken (so that the limit
    set above the highest is all there is to spare); given back at the end."""
    taken = []
    highest = max(_open_fds())
    while True:
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd > highest:
            os.close(fd)
            break
        taken.append(fd)
    yield
    for fd in taken:
        os.close(fd)


@pytest.mark.usefixtures("no_free_numbers_below_the_highest")
def test_a_start_out_of_descriptors_at_any_step_gives_back_everything():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = _held()
    fds = before[0]
    failures: list[str] = []
    started = False
    for extra in range(1, 400, 2):
        limit = max(fds) + 1 + extra
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
        try:
            group = px.WorkerGroup(Probe, procs_per_node=2, name=NAME, echo_output=False,
                                   start_timeout=60)
        except (OSError, px.PhalanxError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        else:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            try:
                assert group.call("rank") == [0, 1]
            finally:
                group.shutdown()
            started = True
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        _assert_nothing_held(before, f"with {extra} descriptors to spare")
        if started:
            break
    assert started, failures[-3:]
    assert len(failures) >= 3, failures  # it failed at several steps before it started


class _Forced(Exception):
    """The failure forced at one step of the build."""


# Each step of WorkerGroup._build that acquires something, by the part's method it calls.
STEPS = [
    ("Dispatcher", "__init__"),
    ("SharedObjects", "__init__"),
    ("Starter", "__init__"),
    ("Membership", "__init__"),
    ("Watchdog", "start"),
    ("Starter", "reserve"),
    ("Starter", "start"),
]


@pytest.mark.parametrize("part, method", STEPS, ids=[f"{p}.{m}" for p, m in STEPS])
def test_a_start_that_fails_at_each_step_gives_back_what_the_steps_before_took(
        monkeypatch, part, method):
    before = _held()
    cls = getattr(group_module, part)
    real = getattr(cls, method)

    def failing(self, *args, **kwargs):
        if method == "start" and part == "Starter":  # the ranks are running by then
            real(self, *args, **kwargs)
        raise _Forced(f"{part}.{method}")

    monkeypatch.setattr(cls, method, failing)
    with pytest.raises(_Forced):
        px.WorkerGroup(Probe, procs_per_node=2, name=NAME, echo_output=False,
                       start_timeout=60)
    monkeypatch.undo()
    _assert_nothing_held(before, f"failing at {part}.{method}")
    with px.WorkerGroup(Probe, name=NAME, echo_output=False) as group:  # the name is free
        assert group.call("rank") == [0]
