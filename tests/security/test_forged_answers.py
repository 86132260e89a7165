"""A rank speaks for itself alone. Through an agent, every rank of a node shares one
connection to the controller, and each frame names its rank: so the agent checks what comes
up each rank's pipe -- the frame names that rank, is of a kind a rank sends, and answers
only a call passed down to that rank and not answered yet. A rank that breaks this is
ended, and its error says so; the controller never takes the forged answer. The local
backend's controller knows which pipe a frame came on and does the same for what it can
tell there: a frame naming another rank, or whose header cannot be read.

The forger is a real rank: its method writes frames of its own making to its control
connection, the runtime's (found up its own stack), as a rank's code could. The victim's
call id is what the victim itself saw (written to a file the test reads): the forger
needs nothing the controller would not have sent some rank anyway.

The agents are the session's (127.0.0.2-4), and so is the Ray cluster (a Ray rank's frames
reach the controller's dispatcher on its own channel, as a local rank's); every wait is
bounded.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import phalanx as px
from phalanx.errors import WorkerDied
from tests import helpers
from tests.workers import my_rank

CALL_WAIT = 60.0  # s: a generous bound on a loaded machine; a hang, not a slow call, fails


def _runtime_and_call() -> tuple[Any, int]:
    """The rank runtime serving this call, and the call's id (up this thread's stack)."""
    from phalanx.rank.runtime import WorkerRuntime

    frame = sys._getframe(1)
    while frame is not None:
        runtime = frame.f_locals.get("self")
        if isinstance(runtime, WorkerRuntime) and "call_id" in frame.f_locals:
            return runtime, frame.f_locals["call_id"]
        frame = frame.f_back
    raise RuntimeError("not inside a rank's call")


class Forger:
    """A worker that can answer as someone else."""

    def victim(self, path: str, seconds: float) -> str:
        """Say which call this is (in ``path``), then answer it once ``path.done`` exists
        (``seconds`` at most)."""
        _, call_id = _runtime_and_call()
        Path(path + ".tmp").write_text(str(call_id))
        os.replace(path + ".tmp", path)
        helpers.wait_until(lambda: os.path.exists(path + ".done"), seconds)
        return f"real-{my_rank()}"

    def answer(self, call_id: int, as_rank: int, value: str) -> str:
        """A RESULT of call ``call_id`` in the name of rank ``as_rank``."""
        from phalanx.rank import kept
        from phalanx.wire import protocol

        runtime, _ = _runtime_and_call()
        runtime.conn.send(protocol.result_frame(call_id, as_rank, kept.dumps_result(value)))
        time.sleep(0.5)  # the controller's verdict, if any, comes first
        return f"real-{my_rank()}"

    def send_raw(self, segments: list[bytes]) -> str:
        """A frame of exactly ``segments``."""
        from phalanx.wire import framing

        runtime, _ = _runtime_and_call()
        runtime.conn.send(framing.frame(list(segments)))
        time.sleep(0.5)
        return f"real-{my_rank()}"

    def rank(self) -> int:
        return my_rank()


def _victim_call(group: px.WorkerGroup, tmp_path: Path) -> tuple[Any, int, Callable[[], None]]:
    """Rank 1's call in progress (until released, or 30 s), its id, and its release."""
    path = tmp_path / "victim-call"
    future = group.call_async("victim", str(path), 30.0, workers=[1])
    assert helpers.wait_until(path.exists, CALL_WAIT), "the victim's call did not start"
    return future, int(path.read_text()), (tmp_path / "victim-call.done").touch


def _ended(group: px.WorkerGroup, method: str, *args: Any,
           then: Callable[[], None] | None = None) -> WorkerDied:
    """The error of rank 0's call ``method(*args)``, which must end it; ``then()`` before
    rank 1 is called (the victim's release)."""
    with pytest.raises(WorkerDied) as caught:
        group.call_one(0, method, *args, timeout=CALL_WAIT)
    assert caught.value.rank == 0
    with pytest.raises(WorkerDied):  # it is gone, not just this call
        group.call_one(0, "rank", timeout=CALL_WAIT)
    if then is not None:
        then()
    assert group.call_one(1, "rank", timeout=CALL_WAIT) == 1  # the other rank goes on
    return caught.value


@pytest.fixture
def on_agent(agent_cluster):
    """A group of two ranks on one of the session's agents."""
    group = px.WorkerGroup(Forger, backend=agent_cluster.backend(), nodes=1,
                           procs_per_node=2, echo_output=False)
    try:
        yield group
    finally:
        group.shutdown(timeout=5)


@pytest.fixture
def local_group():
    group = px.WorkerGroup(Forger, procs_per_node=2, echo_output=False)
    try:
        yield group
    finally:
        group.shutdown(timeout=5)


@pytest.fixture
def ray_group(ray_cluster):
    group = px.WorkerGroup(Forger, procs_per_node=2, backend="ray", echo_output=False)
    try:
        yield group
    finally:
        group.shutdown(timeout=5)


# --------------------------------------------------------------------------- through an agent


def test_an_answer_forged_as_another_rank_is_not_taken(on_agent, tmp_path):
    future, call_id, release = _victim_call(on_agent, tmp_path)
    error = _ended(on_agent, "answer", call_id, 1, "FORGED-by-rank-0", then=release)
    assert ("rank 0 broke the protocol: it sent an answer as rank 1 (ended by the agent)"
            in str(error)), str(error)
    assert future.result(timeout=CALL_WAIT) == ["real-1"]


def test_an_answer_to_a_call_sent_to_another_rank_ends_the_rank(on_agent, tmp_path):
    future, call_id, release = _victim_call(on_agent, tmp_path)
    error = _ended(on_agent, "answer", call_id, 0, "FORGED-by-rank-0", then=release)
    assert (f"rank 0 broke the protocol: it answered call {call_id}, which was not sent to "
            "it" in str(error)), str(error)
    assert future.result(timeout=CALL_WAIT) == ["real-1"]


def test_a_node_message_from_a_rank_ends_the_rank(on_agent):
    """A rank cannot speak for its node: LOST (every node of the subtree gone) from a
    rank's pipe would have ended every rank of the node."""
    from phalanx.backends.cluster import messages as agentwire
    from phalanx.wire import protocol

    forged = protocol.header(agentwire.LOST, 0, 0, [0, 1, 2, 3], "forged by rank 0")
    error = _ended(on_agent, "send_raw", [forged])
    assert (f"rank 0 broke the protocol: it sent a message of kind {agentwire.LOST}, which "
            "no rank sends (ended by the agent)" in str(error)), str(error)


# --------------------------------------------------------------------------- local and Ray ranks


def test_an_answer_forged_as_another_rank_ends_the_local_rank(local_group, tmp_path):
    future, call_id, release = _victim_call(local_group, tmp_path)
    error = _ended(local_group, "answer", call_id, 1, "FORGED-by-rank-0", then=release)
    assert ("rank 0 broke the protocol: it sent an answer as rank 1 (ended by the "
            "controller)" in str(error)), str(error)
    assert future.result(timeout=CALL_WAIT) == ["real-1"]


def test_an_answer_forged_as_another_rank_ends_the_ray_rank(ray_group, tmp_path):
    future, call_id, release = _victim_call(ray_group, tmp_path)
    error = _ended(ray_group, "answer", call_id, 1, "FORGED-by-rank-0", then=release)
    assert ("rank 0 broke the protocol: it sent an answer as rank 1 (ended by the "
            "controller)" in str(error)), str(error)
    assert future.result(timeout=CALL_WAIT) == ["real-1"]


def test_a_malformed_header_ends_the_local_rank_not_the_pump(local_group):
    error = _ended(local_group, "send_raw", [b"\x02\x00\x00"])
    assert ("rank 0 broke the protocol: it sent a malformed message header (3 bytes) "
            "(ended by the controller)" in str(error)), str(error)


@pytest.mark.parametrize("fields", [
    ("not a failure",),                                   # ERROR of a call of its own
    (["ValueError", "m", "tb"],),                          # too few fields
    (["ValueError", "m", "tb", "stage", 7],),              # a pickle that is no bytes
], ids=["text", "short", "not-bytes"])
def test_a_malformed_error_report_ends_the_local_rank_not_the_pump(local_group, fields):
    """An ERROR whose failure report has not the fields one has (to a call that is the
    rank's own: nothing else about it is wrong) ends the rank, told as a protocol
    violation; the group goes on."""
    from phalanx.wire import protocol

    forged = [protocol.header(protocol.ERROR, 0, 0, *fields)]
    error = _ended(local_group, "send_raw", forged)
    assert ("rank 0 broke the protocol: it sent a malformed failure report (ended by the "
            "controller)" in str(error)), str(error)


def test_a_malformed_ready_ends_the_local_rank_not_the_pump(local_group):
    from phalanx.wire import protocol

    forged = [protocol.header(protocol.READY, 0, 0, "pid", {}, {}, None)]
    error = _ended(local_group, "send_raw", forged)
    assert ("rank 0 broke the protocol: it sent a malformed READY (ended by the controller)"
            in str(error)), str(error)
