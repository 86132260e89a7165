"""The group's state machine and its operation lock (no process started)."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx import GroupClosed
from phalanx.controller.state import MOVES, Gate, GroupState


def test_every_state_has_its_moves_and_closed_is_final():
    assert set(MOVES) == set(GroupState)
    assert MOVES[GroupState.CLOSED] == frozenset()
    documented = GroupState.__doc__ or ""
    for state, targets in MOVES.items():
        for target in targets:
            assert f"{state.name:<9} -> {target.name}" in documented


def test_an_illegal_move_is_refused():
    gate = Gate("g")
    with pytest.raises(RuntimeError, match="no move from STARTING to REPLACING"):
        gate.move(GroupState.REPLACING)
    gate.move(GroupState.RUNNING)
    with pytest.raises(RuntimeError):
        gate.move(GroupState.CLOSED)


def test_operations_exclude_each_other_and_return_to_running():
    gate = Gate("g")
    gate.move(GroupState.RUNNING)
    inside: list[str] = []
    overlap: list[bool] = []

    def operation(name: str) -> None:
        with gate.operation(name):
            overlap.append(bool(inside))
            inside.append(name)
            time.sleep(0.02)
            inside.remove(name)

    threads = [threading.Thread(target=operation, args=(f"op{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert overlap == [False] * 4
    assert gate.state is GroupState.RUNNING


def test_an_operation_that_raises_still_returns_to_running():
    gate = Gate("g")
    gate.move(GroupState.RUNNING)
    with pytest.raises(ValueError), gate.operation("recreate"):
        assert gate.state is GroupState.REPLACING
        raise ValueError("bad ranks")
    assert gate.state is GroupState.RUNNING


def _running_operation(gate: Gate) -> tuple[threading.Thread, threading.Event]:
    """A thread inside one of ``gate``'s operations until the event it returns is set."""
    started, release = threading.Event(), threading.Event()

    def operation() -> None:
        with gate.operation("restart"):
            started.set()
            release.wait(30)

    thread = threading.Thread(target=operation)
    thread.start()
    assert started.wait(30)
    return thread, release


def test_closing_waits_for_an_operation_then_refuses_new_ones():
    gate = Gate("g")
    gate.move(GroupState.RUNNING)
    thread, release = _running_operation(gate)
    threading.Timer(0.1, release.set).start()
    began = time.monotonic()
    with gate.closing(30) as first:
        assert first and gate.state is GroupState.CLOSING
        assert time.monotonic() - began >= 0.05  # it waited for the restart to end
    thread.join(timeout=30)
    assert gate.state is GroupState.CLOSED
    with pytest.raises(GroupClosed, match="group g has been shut down"):
        gate.check()
    with pytest.raises(GroupClosed), gate.operation("recreate"):
        pass
    with gate.closing(1) as first:
        assert not first  # closing twice does nothing


def test_closing_does_not_wait_past_its_bound():
    gate = Gate("g")
    gate.move(GroupState.RUNNING)
    thread, release = _running_operation(gate)
    try:
        with gate.closing(0.05) as first:
            assert first and gate.state is GroupState.CLOSING
    finally:
        release.set()
        thread.join(timeout=30)
    assert gate.state is GroupState.CLOSED  # the late operation did not reopen it


@pytest.mark.parametrize("through", ["closing", "move"])
def test_shut_says_a_call_must_fail_exactly_when_check_raises(through):
    """A call reads ``shut`` instead of calling check(): the two agree in every state."""
    gate = Gate("g")
    seen: list[tuple[bool, bool]] = []

    def look() -> None:
        try:
            gate.check()
            raised = False
        except GroupClosed:
            raised = True
        seen.append((gate.shut, raised))

    look()
    gate.move(GroupState.RUNNING)
    look()
    with gate.operation("restart"):
        look()
    look()
    if through == "closing":
        with gate.closing(1):
            look()
    else:
        gate.move(GroupState.CLOSING)
        look()
        gate.move(GroupState.CLOSED)
    look()
    assert seen == [(False, False)] * 4 + [(True, True)] * 2

