"""``recreate()`` under load and when the fresh rank cannot start (local backend): calls
racing a replacement, a constructor that never returns, and re-admitting a fresh rank into
a torch.distributed group."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from phalanx import StartupError, WorkerDied
from tests import helpers
from tests.workers import FailsOnceFlagged, Probe, TorchReadmit

RECREATES = 50
CALLERS = 4


@pytest.fixture(scope="module")
def backend() -> str:
    """Replacing local processes (the Ray backend's recreate is in the contract suite)."""
    return "local"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_calls_racing_recreate_succeed_or_see_the_old_rank_die(make_group):
    group = make_group(Probe, procs_per_node=2)
    stop = threading.Event()
    outcomes: list[list[str]] = [[] for _ in range(CALLERS)]
    wrong: list[str] = []

    def one_call(index: int, value: tuple) -> tuple[list, list]:
        """A call in one of the ways a user makes them: what came back, what should have."""
        way = index % CALLERS
        if way == 0:
            return group.call("identity", value, timeout=30), [value, value]
        if way == 1:
            return group.map("identity", [value, (value, 1)], timeout=30), [value, (value, 1)]
        if way == 2:
            return group.call_async("identity", value, workers=[1]).result(30), [value]
        result = group.call("identity", value, workers="ready", timeout=30)
        return result, [value] * len(result)

    def caller(index: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            value = (index, n)
            try:
                result, expected = one_call(index, value)
            except WorkerDied:
                outcomes[index].append("died")
                time.sleep(0.001)  # let the recreate proceed
                continue
            except BaseException as exc:  # every other outcome is the bug
                wrong.append(f"caller {index}: {type(exc).__name__}: {exc}")
                return
            if result != expected or not result:
                wrong.append(f"caller {index}: sent {value}, got {result}")
                return
            outcomes[index].append("ok")

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(CALLERS)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    try:
        for i in range(RECREATES):
            if wrong:
                break
            group.recreate(1, timeout=30)  # every one must succeed
            assert time.monotonic() - started < 75, f"only {i + 1} recreates in 75 s"
    finally:
        stop.set()
        for thread in threads:
            thread.join(40)
    assert not any(t.is_alive() for t in threads), "a call hung after recreate()"
    assert not wrong, "\n".join(wrong)
    assert all("ok" in o for o in outcomes), "some caller never got a call through"
    assert group.call("rank", timeout=10) == [0, 1]


@pytest.mark.timeout(60)
def test_recreate_gives_up_on_a_constructor_that_never_returns(make_group, tmp_path):
    flag = tmp_path / "rank1-hangs"
    group = make_group(FailsOnceFlagged, args=(str(flag), "hang"), procs_per_node=2)
    flag.touch()  # from now on rank 1's constructor sleeps for 10 minutes
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        group.recreate(1, timeout=2)
    took = time.monotonic() - started
    assert 1.5 < took < 8, f"recreate(timeout=2) gave up after {took:.1f} s"
    assert "ranks [1]" in str(info.value) and "within 2 s" in str(info.value), str(info.value)
    health = group.health()[1]
    assert not health.alive
    if health.pid is not None:
        assert helpers.wait_dead(health.pid, 3), "the hung fresh rank was left running"
    assert group.call("rank", workers="ready", timeout=10) == [0]
    # the no-leftover fixture checks that no process of the hung rank remains


# --------------------------------------------------------------------------- torch


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fresh_rank_is_readmitted_into_the_torch_group(make_group):
    pytest.importorskip("torch")
    group = make_group(TorchReadmit, procs_per_node=3, framework="torch", start_timeout=90)
    assert group.map("all_reduce", [1.0, 2.0, 4.0], timeout=60) == [7.0] * 3
    pid = group.call_one(1, "pid", timeout=10)
    os.kill(pid, signal.SIGKILL)
    assert helpers.wait_until(lambda: not group.health()[1].alive, 10)

    group.recreate(1, readmit="readmit", timeout=60)
    assert group.call_one(1, "pid", timeout=10) != pid
    assert group.map("all_reduce", [1.0, 20.0, 400.0], timeout=60) == [421.0] * 3
