"""Testing your own recovery code against real failures, with ``inject_fault``.

``group.inject_fault(rank, method, kind)`` makes the next call of ``method`` on ``rank``
fail for real -- the process killed by a signal, exiting with a code, hanging, or the
method raising -- on any backend, so code that retries, recreates ranks or gives up can be
tested in CI. Run it: ``pytest examples/test_recovery.py``.
"""

from __future__ import annotations

import pytest

import phalanx as px


class Trainer:
    def step(self, n: int) -> int:
        return 2 * n


def run_step(group: px.WorkerGroup, n: int, retries: int = 2) -> list[int]:
    """The code under test: a rank that died is recreated and the step retried; a step
    that raised is the caller's problem."""
    for attempt in range(retries + 1):
        try:
            return group.call("step", n, timeout=60)
        except px.WorkerDied as exc:
            if attempt == retries:
                raise
            group.recreate(exc.rank)
    raise AssertionError("unreachable")


@pytest.fixture
def group():
    with px.WorkerGroup(Trainer, procs_per_node=2, echo_output=False) as group:
        yield group


def test_a_step_survives_a_rank_killed_in_it(group):
    group.inject_fault(1, "step", "signal")  # SIGKILL as rank 1's next step() starts
    assert run_step(group, 21) == [42, 42]


def test_a_step_survives_a_rank_that_exits(group):
    group.inject_fault(0, "step", "exit", code=3)
    assert run_step(group, 1) == [2, 2]


def test_a_step_that_raises_is_not_retried(group):
    group.inject_fault(0, "step", "raise", message="bad batch")
    with pytest.raises(px.WorkerError, match="bad batch"):
        run_step(group, 1)


def test_a_hung_step_ends_with_a_timeout(group):
    group.inject_fault(1, "step", "hang")
    with pytest.raises(px.CallTimeout):
        group.call("step", 1, timeout=1)
