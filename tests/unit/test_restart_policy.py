"""The restart policy of ``phalanx run`` (:mod:`phalanx.launcher.policy`): how an attempt
ended goes in, what follows comes out. Plain values only; no process is started."""

from __future__ import annotations

import ast
import dataclasses
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.launcher import policy
from phalanx.launcher.policy import AttemptStatus, RestartDecision, decide
from phalanx.launcher.report import Failure

DONE, RESTART, REFORM, FAIL, STOP = (RestartDecision.DONE, RestartDecision.RESTART,
                                     RestartDecision.REFORM, RestartDecision.FAIL,
                                     RestartDecision.STOP)

RANK_EXIT = Failure(3, 1, 4242, 7, "exited with code 7")
RANK_KILLED = Failure(0, 0, 4243, 128 + signal.SIGKILL, "was killed by SIGKILL")
NODE_LOST = Failure(None, 2, None, 1, "lost its launcher: its connection closed")
STOPPED = Failure(None, 1, None, 128 + signal.SIGTERM, "was stopped: its launcher got SIGTERM")

failures = st.builds(
    Failure,
    rank=st.none() | st.integers(0, 1023),
    node=st.none() | st.integers(0, 127),
    pid=st.none() | st.integers(1, 1 << 22),
    status=st.integers(1, 255),
    summary=st.text(max_size=20),
    seen=st.floats(0, 1e10),
)
statuses = st.builds(
    AttemptStatus,
    attempt=st.integers(0, 50),
    max_restarts=st.integers(0, 50),
    failures=st.lists(failures, max_size=4).map(tuple),
    signal=st.none() | st.sampled_from([int(signal.SIGINT), int(signal.SIGTERM)]),
    joined=st.booleans(),
)


@pytest.mark.parametrize(("status", "expected"), [
    # every rank finished
    (AttemptStatus(0, 0), DONE),
    (AttemptStatus(2, 3), DONE),
    (AttemptStatus(3, 3), DONE),  # the last attempt allowed may succeed too
    # a rank's exit code, a rank killed by a signal, a node lost: restarts while allowed
    (AttemptStatus(0, 1, (RANK_EXIT,)), RESTART),
    (AttemptStatus(0, 3, (RANK_KILLED,)), RESTART),
    (AttemptStatus(2, 3, (NODE_LOST,)), RESTART),
    (AttemptStatus(0, 2, (RANK_EXIT, NODE_LOST)), RESTART),
    # ... and fails once none is left
    (AttemptStatus(0, 0, (RANK_EXIT,)), FAIL),
    (AttemptStatus(1, 1, (RANK_KILLED,)), FAIL),
    (AttemptStatus(3, 3, (NODE_LOST, RANK_EXIT)), FAIL),
    # a node joined during an attempt that no rank failed: start again, whatever the budget
    (AttemptStatus(0, 0, joined=True), REFORM),
    (AttemptStatus(5, 5, joined=True), REFORM),
    # a failure and a newcomer: the failure decides
    (AttemptStatus(0, 1, (RANK_EXIT,), joined=True), RESTART),
    (AttemptStatus(1, 1, (RANK_EXIT,), joined=True), FAIL),
    # a signal to a launcher ends the run, with or without failures, restarts left or not
    (AttemptStatus(0, 0, signal=signal.SIGINT), STOP),
    (AttemptStatus(0, 5, (STOPPED,), signal=signal.SIGTERM), STOP),
    (AttemptStatus(0, 5, (RANK_EXIT,), signal=signal.SIGINT, joined=True), STOP),
    (AttemptStatus(5, 5, (RANK_KILLED,), signal=signal.SIGTERM), STOP),
])
def test_the_decision_after_an_attempt(status, expected):
    assert decide(status) is expected


@given(statuses)
def test_a_signal_to_a_launcher_always_stops_the_run(status):
    assert (decide(status) is STOP) == (status.signal is not None)


@given(statuses)
def test_an_attempt_without_failures_ends_the_run_or_reforms_the_world(status):
    status = dataclasses.replace(status, failures=(), signal=None)
    assert decide(status) is (REFORM if status.joined else DONE)


@given(statuses)
def test_a_failure_restarts_exactly_while_the_budget_allows(status):
    if not status.failures:
        status = dataclasses.replace(status, failures=(RANK_EXIT,))
    status = dataclasses.replace(status, signal=None)
    expected = RESTART if status.attempt < status.max_restarts else FAIL
    assert decide(status) is expected
    assert decide(dataclasses.replace(status, joined=not status.joined)) is expected


@given(statuses)
def test_only_the_kind_of_failure_never_matters(status):
    """Which ranks failed and how (exit code, signal, a node lost) picks the root cause
    and the exit status, never the decision: only whether any failed does."""
    if status.failures:
        for other in ((RANK_EXIT,), (RANK_KILLED,), (NODE_LOST,), status.failures[::-1]):
            assert decide(dataclasses.replace(status, failures=other)) is decide(status)


def drive(max_restarts: int, outcomes: list[tuple[tuple[Failure, ...], bool]],
          ) -> tuple[list[int], RestartDecision]:
    """Run attempts the way the launchers do: the attempt numbers started, and how the run
    ended. ``outcomes`` are the attempts' failures and whether a node joined, in order."""
    attempt, started = 0, []
    for failed, joined in outcomes:
        started.append(attempt)
        decision = decide(AttemptStatus(attempt, max_restarts, failed, joined=joined))
        if decision is RESTART:
            attempt += 1
        elif decision is not REFORM:
            return started, decision
    raise AssertionError("the run did not end")  # pragma: no cover


@given(st.integers(0, 20))
def test_a_run_that_always_fails_makes_max_restarts_plus_one_attempts(max_restarts):
    started, end = drive(max_restarts, [((RANK_EXIT,), False)] * (max_restarts + 5))
    assert started == list(range(max_restarts + 1))
    assert end is FAIL


@given(st.integers(0, 10), st.lists(st.booleans(), max_size=30))
def test_newcomers_never_spend_the_restart_budget(max_restarts, pattern):
    """Attempts stopped by a joining node repeat their number; failed ones count."""
    outcomes = [((), True) if join else ((RANK_EXIT,), False) for join in pattern]
    outcomes += [((RANK_EXIT,), False)] * (max_restarts + 1)
    started, end = drive(max_restarts, outcomes)
    assert end is FAIL
    assert started[-1] == max_restarts
    assert started == sorted(started)  # REFORM repeats a number, RESTART adds one


@given(st.integers(0, 20), st.integers(0, 20))
def test_success_ends_the_run_at_any_attempt(max_restarts, failing):
    failing = min(failing, max_restarts)
    outcomes = [((RANK_EXIT,), False)] * failing + [((), False)]
    started, end = drive(max_restarts, outcomes)
    assert (started, end) == (list(range(failing + 1)), DONE)


@given(st.integers(0, 50), st.integers(0, 50))
def test_restarts_left(attempt, max_restarts):
    assert AttemptStatus(attempt, max_restarts).restarts_left == max(0, max_restarts - attempt)


@pytest.mark.parametrize(("attempt", "max_restarts"), [(-1, 0), (0, -1), (-3, -3)])
def test_a_negative_attempt_or_budget_is_refused_naming_both(attempt, max_restarts):
    with pytest.raises(ValueError, match=rf"attempt={attempt}, max_restarts={max_restarts}"):
        AttemptStatus(attempt, max_restarts)


def test_the_status_is_frozen():
    status = AttemptStatus(0, 1, (RANK_EXIT,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.attempt = 1  # type: ignore[misc]
    assert hash(status) == hash(AttemptStatus(0, 1, (RANK_EXIT,)))


def test_every_decision_is_reachable_and_documented():
    reached = {decide(s) for s in (AttemptStatus(0, 0), AttemptStatus(0, 1, (RANK_EXIT,)),
                                   AttemptStatus(0, 0, joined=True),
                                   AttemptStatus(0, 0, (RANK_EXIT,)),
                                   AttemptStatus(0, 0, signal=signal.SIGINT))}
    assert reached == set(RestartDecision)
    for decision in RestartDecision:
        assert f"-> {decision.name}" in policy.__doc__


def test_the_policy_imports_nothing_that_does_io():
    """Pure: the standard library's dataclasses and enum, and the failure record."""
    tree = ast.parse(Path(policy.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum", "phalanx.launcher.report"}
