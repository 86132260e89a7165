"""Taking a rank's stacks never cuts short what the rank is doing, on every backend.

A C call blocked in a system call (libc ``sleep`` through ctypes, with the GIL released
as ``CDLL`` does or kept as ``PyDLL`` does) must take its full time while ``group.stacks()``
and a straggler warning read the rank's stacks, and those stacks must show the method. A
signal landing on the sleeping thread would end the sleep early (``nanosleep`` is not
restarted after a handler): that is what these tests catch. The other states a rank can
be in -- running Python, in ``time.sleep``, in a C loop that keeps the GIL, stopped --
must still give their stacks (or say why not).
"""

from __future__ import annotations

import logging
import os
import time

import psutil
import pytest

from tests import helpers

SLEEP = 4  # seconds rank 1 sleeps in libc: long enough for several stack captures


class Sleeper:
    """Methods that keep a rank busy in each way a stack capture must cope with."""

    def libc_sleep(self, seconds: int, keep_gil: bool = False) -> tuple[float, int]:
        """libc ``sleep(seconds)``; how long it took, measured here, and what libc says it
        left unslept (non-zero when a signal handler ran on this thread)."""
        import ctypes

        libc = ctypes.PyDLL(None) if keep_gil else ctypes.CDLL(None)
        started = time.monotonic()
        unslept = libc.sleep(seconds)
        return time.monotonic() - started, unslept

    def python_sleep(self, seconds: float, until: str | None = None) -> float:
        """``time.sleep`` for ``seconds``, or (in sleeps of 0.25 s) until the file
        ``until`` exists: the test's stacks have shown it."""
        started = time.monotonic()
        deadline = started + seconds
        while (left := deadline - time.monotonic()) > 0 and not (until and os.path.exists(until)):
            time.sleep(min(left, 0.25) if until else left)
        return time.monotonic() - started

    def python_loop(self, seconds: float, until: str | None = None) -> int:
        """Python code spinning for ``seconds``, or until the file ``until`` exists."""
        deadline = time.monotonic() + seconds
        spins = 0
        while time.monotonic() < deadline:
            spins += 1
            if until and spins % 10_000 == 0 and os.path.exists(until):
                break
        return spins

    def c_loop_keeping_gil(self, seconds: float) -> float:
        """One C call (``sum`` over a ``range``) that keeps the GIL for about ``seconds``:
        no other thread of the rank runs Python meanwhile."""
        started = time.monotonic()
        sum(range(10**6))
        per_million = max(time.monotonic() - started, 1e-4)
        started = time.monotonic()
        sum(range(int(10**6 * seconds / per_million)))
        return time.monotonic() - started


def rank1_stacks(group) -> str:
    return group.stacks(ranks=[1], timeout=5.0)[1]


def wait_for_frame(group, name: str, timeout: float = 20.0) -> str:
    """Rank 1's stacks once they show ``name`` running (the call has reached it)."""
    stack = ""
    deadline = time.monotonic() + timeout
    while f"in {name}" not in stack and time.monotonic() < deadline:
        stack = rank1_stacks(group)
    assert f"in {name}" in stack, stack
    return stack


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep_gil", [False, True], ids=["gil-released", "gil-kept"])
def test_a_blocking_c_call_takes_its_full_time_while_its_stacks_are_taken(
        make_group, caplog, keep_gil):
    caplog.set_level(logging.WARNING, logger="phalanx")
    group = make_group(Sleeper, procs_per_node=2, straggler_warning=1.0, heartbeat_timeout=120)
    sent = time.monotonic()
    future = group.map_async("libc_sleep", [0, SLEEP], keep_gil=[keep_gil, keep_gil])
    taken = [wait_for_frame(group, "libc_sleep")]
    while not future.done():
        stack = rank1_stacks(group)
        # a capture read before the sleep can have ended (it began after the call was
        # sent): one read as it ends, the answer not here yet, rightly shows what follows
        if time.monotonic() < sent + SLEEP:
            taken.append(stack)
        time.sleep(0.3)
    results = future.result(timeout=30)
    elapsed, unslept = results[1]
    assert unslept == 0 and elapsed >= SLEEP - 0.05, (
        f"libc sleep({SLEEP}) returned after {elapsed:.2f} s with {unslept} s left: a stack "
        "capture interrupted it")
    assert len(taken) >= 3, f"only {len(taken)} stack captures during the {SLEEP} s sleep"
    for stack in taken:
        assert "in libc_sleep" in stack, stack
    warnings = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(warnings) == 1 and "ranks [1]" in warnings[0], warnings
    assert "in libc_sleep" in warnings[0], warnings[0]


@pytest.mark.timeout(90)
def test_stacks_show_a_rank_in_python_code_a_sleep_or_a_c_loop(make_group, tmp_path):
    group = make_group(Sleeper, procs_per_node=2, heartbeat_timeout=120)
    # the sleep and the Python loop end once their stacks were seen (every backend's ranks
    # run on this machine here), else after 2 s; the C loop (one call) lasts its 2 s
    for method, until in (("python_sleep", tmp_path / "slept"),
                          ("python_loop", tmp_path / "looped"),
                          ("c_loop_keeping_gil", None)):
        kwargs = {"until": str(until)} if until else {}
        future = group.call_async(method, 2.0, workers=[1], **kwargs)
        try:
            wait_for_frame(group, method)
        finally:
            if until:
                until.touch()
        assert future.result(timeout=60)[0] > 0, method


@pytest.mark.timeout(60)
def test_stacks_of_a_stopped_rank_say_so_and_it_goes_on_after(make_group, ranks):
    group = make_group(Sleeper, procs_per_node=2, heartbeat_timeout=120)
    future = group.call_async("libc_sleep", 2, workers=[1])
    wait_for_frame(group, "libc_sleep")
    pid = group.health()[1].pid
    ranks.stop(group, 1)
    try:
        # every backend's ranks run on this machine in these tests; SIGSTOP takes effect
        # once the rank's threads next run: wait for it
        stopped = psutil.Process(pid)
        assert helpers.wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 5)
        started = time.monotonic()
        stack = rank1_stacks(group)
        assert time.monotonic() - started < 3
    finally:
        ranks.resume(group, 1)
    assert "stopped" in stack, stack
    elapsed, unslept = future.result(timeout=30)[0]
    # a stop and its SIGCONT restart the sleep where it was: it is not cut short either
    assert unslept == 0 and elapsed >= 2 - 0.05, (elapsed, unslept)
