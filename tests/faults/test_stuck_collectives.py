"""A chaos matrix of collectives, on local and agents: real torch ranks in a real gloo world,
one of them (rank 2) misbehaving around an ``all_reduce`` the others wait in. In every case
the wedge is told (0 undetected), the rank the others wait for is named with what it was
doing, and the ranks that waited are released: the group answers calls again without the
user restarting anything.

- it skips the collective (returns from the method): ``CollectiveStuck``, "it returned";
- it is SIGSTOPped before entering: ``CollectiveStuck``, "it is stopped";
- it is busy in another call: ``CollectiveStuck``, "it is in busy()";
- it is SIGKILLed inside the collective: the call fails (``WorkerDied``), and no survivor
  stays inside (gloo's own error, or phalanx recreating them);
- it enters with another shape: gloo ends one side (its assertion), the call fails naming
  it, and no survivor stays inside;
- it enters late, twice: no error; the warning names rank 2 as the one the others wait for,
  and how late it entered each.

Each prints its detection time (misbehaviour to error) and release time (error to the
group answering again); the matrix in the closing note comes from these lines.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

import phalanx as px
from bench.stuck import CULPRIT, Member  # the ranks W16 times: rank 2 misbehaves
from tests import helpers
from tests.conftest import BACKENDS

pytest.importorskip("torch", reason="the collectives are torch.distributed's: pip install torch")

TIMEOUT = 2.0  # collective_timeout of the group under test


@pytest.fixture(scope="module", params=[b for b in ("local", "cluster") if b in BACKENDS])
def where(request):
    if request.param == "cluster":
        return request.getfixturevalue("agent_cluster").backend()
    return "local"


@pytest.fixture(scope="module")
def group(where):
    with helpers.long_lived_group(Member, procs_per_node=3, framework="torch", backend=where,
                                  echo_output=False, collective_timeout=TIMEOUT,
                                  straggler_warning=1.0, start_timeout=120) as group:
        assert group.call("reduce", timeout=60) == [3.0, 3.0, 3.0]
        yield group


def _answers_again(group: px.WorkerGroup, within: float = 60.0) -> float:
    """Seconds until every rank answers a collective again."""
    began = time.monotonic()
    assert helpers.wait_until(lambda: _works(group), within), "the group did not answer again"
    return time.monotonic() - began


def _works(group: px.WorkerGroup) -> bool:
    try:
        return group.call("reduce", timeout=30) == [3.0, 3.0, 3.0]
    except px.PhalanxError:
        return False


def _stuck(group: px.WorkerGroup, call: px.GroupFuture, began: float) -> px.CollectiveStuck:
    with pytest.raises(px.CollectiveStuck) as info:
        call.result(timeout=90)
    error = info.value
    took = time.monotonic() - began
    released = float(error.released.rsplit(" in ", 1)[1].split(" s")[0])
    print(f"\n{error.culprits[CULPRIT]!r}: error {took:.1f} s after the misbehaviour "
          f"(collective_timeout={TIMEOUT:g} s; {released:.1f} s of it releasing)")
    assert set(error.culprits) == {CULPRIT}, error.culprits
    assert error.waiting == {0: "all_reduce", 1: "all_reduce"}, error.waiting
    assert error.collective == "all_reduce" and error.group == group.name
    assert f"rank {CULPRIT} never entered all_reduce" in str(error), str(error)
    assert "ranks 0, 1 of group" in str(error) and "recreated" in error.released
    assert _answers_again(group, within=5.0) < 5.0  # at once: released before the error
    return error


def test_a_rank_that_skips_the_collective_is_named_and_the_others_released(group):
    with group.trace(timeout=2) as trace:
        began = time.monotonic()
        error = _stuck(group, group.call_async("reduce", "skip"), began)
    assert error.culprits[CULPRIT] == "it returned from reduce()"
    # the trace says what was done too: the waiting ranks' slices end with the error
    (stuck,) = [c for c in trace.calls if c.method == "reduce" and c.errors]
    assert sorted(stuck.errors) == [0, 1]
    assert all(e.startswith("CollectiveStuck: ") and "recreated" in e
               for e in stuck.errors.values()), stuck.errors


def test_a_stopped_rank_is_named_as_stopped(group):
    began = time.monotonic()
    error = _stuck(group, group.call_async("reduce", "stop"), began)
    assert error.culprits[CULPRIT].startswith("it is stopped or hung"), error.culprits


def test_a_rank_busy_in_another_call_is_named_with_that_call(group):
    busy = group.call_async("busy", 120, workers=[CULPRIT])
    time.sleep(0.5)
    began = time.monotonic()
    error = _stuck(group, group.call_async("reduce"), began)
    assert error.culprits[CULPRIT] == "it is in busy()", error.culprits
    with pytest.raises(px.CollectiveStuck):  # its rank was recreated too
        busy.result(timeout=10)


def _no_survivor_inside(group: px.WorkerGroup, call: px.GroupFuture, began: float,
                        what: str) -> None:
    with pytest.raises(px.PhalanxError) as info:
        call.result(timeout=90)
    detected = time.monotonic() - began
    assert isinstance(info.value, (px.WorkerDied, px.WorkerError, px.CollectiveStuck)), info.value
    # Every rank alive answers within the bound: none is left waiting in the collective.
    # (A rank whose death is not told yet -- gloo's assertion ends the one that got the
    # other shape, and the call may fail first on another rank's error -- counts once told.)
    try:
        survivors = [h.rank for h in group.health() if h.alive]
        released = time.monotonic()
        for rank in survivors:
            assert helpers.wait_until(lambda r=rank: _out_of_it(group, r), 30), (
                f"rank {rank} is still inside the collective")
        print(f"\n{what}: {type(info.value).__name__} {detected:.1f} s after it, survivors "
              f"{[h.rank for h in group.health() if h.alive]} answering "
              f"{time.monotonic() - released:.1f} s later")
    finally:
        group.restart()  # a dead rank's world is the user's to form again
    assert _works(group)


def _out_of_it(group: px.WorkerGroup, rank: int) -> bool:
    """The rank answers a call of its own, or its death is told."""
    return _answers_alone(group, rank) or not any(
        h.alive for h in group.health() if h.rank == rank)


def _answers_alone(group: px.WorkerGroup, rank: int) -> bool:
    try:
        return isinstance(group.call_one(rank, "pid", timeout=2), int)
    except px.PhalanxError:
        return False


def test_a_rank_killed_inside_the_collective_leaves_no_survivor_inside(group):
    pids = group.call("pid")
    call = group.call_async("reduce", "", 0.0, 1.5)  # rank 2 inside, 0 and 1 enter later
    time.sleep(1.0)
    began = time.monotonic()
    os.kill(pids[CULPRIT], signal.SIGKILL)
    _no_survivor_inside(group, call, began, "killed inside")


def test_a_rank_with_another_shape_fails_the_call_and_no_survivor_stays_inside(group):
    began = time.monotonic()
    _no_survivor_inside(group, group.call_async("reduce", "shape"), began, "another shape")


def test_a_late_rank_is_named_as_the_one_waited_for_and_how_late(group, caplog):
    caplog.set_level(logging.WARNING, logger="phalanx.controller.collectivewatch")
    delay = 1.6  # past straggler_warning, well within collective_timeout
    assert group.call("reduce", "late", delay, timeout=60) == [9.0, 9.0, 9.0]

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    # both warnings of each collective may land after the call returned, on a loaded machine
    assert helpers.wait_until(
        lambda: len(said("have waited")) >= 2 and len(said("entered all_reduce")) >= 2, 10), \
        [r.getMessage() for r in caplog.records]
    waited_for, late = said("have waited"), said("entered all_reduce")
    print("\n" + "\n".join(waited_for + late))
    assert len(waited_for) == 2 and all(f"for ranks {CULPRIT}:" in m for m in waited_for)
    # the first stack is taken while rank 2 still sleeps in reduce() (0.6 s of margin). The
    # second may be taken after its late entry, once the call has ended: then it is idle
    assert f"rank {CULPRIT}: it is still in reduce()" in waited_for[0], waited_for[0]
    assert all(f"rank {CULPRIT}: it is still in reduce()" in m or f"rank {CULPRIT}: it is idle" in m
               for m in waited_for[1:]), waited_for
    for message in late:
        assert message.startswith(f"rank {CULPRIT} of group {group.name} entered all_reduce")
        seconds = float(message.split(") ")[1].split(" s after")[0])
        assert delay - 0.5 < seconds < delay + 5, message
