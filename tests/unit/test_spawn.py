"""The node side's spawner in the parts that need no group: the one routine for a dead
rank (:class:`Burial`), told once however many ways the death shows, and a rank started as
its starter's own child (:meth:`RankSpawner.start_child`, a Ray actor's rank that runs
apart from it)."""

from __future__ import annotations

import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx import config
from phalanx.errors import ProcessFailure
from phalanx.node.spawn import Burial, RankSpawner
from phalanx.node.stacks import StackFile
from phalanx.wire import protocol
from tests import helpers

KILLED = ProcessFailure(3, 1, 4321, -9)


def told(event: list) -> ProcessFailure:
    """The failure record an EXITED event carries (for rank 3)."""
    kind, _, ranks, extra = protocol.parse(event[0])
    assert kind == protocol.EXITED and ranks == (3,)
    return ProcessFailure.from_dict(extra[0])


# -- Burial ---------------------------------------------------------------------------


def test_the_first_sign_of_a_death_claims_it_and_no_later_one_does():
    burial = Burial(3, lambda: KILLED)
    assert not burial.claimed and not burial.told and burial.deadline == math.inf
    before = time.monotonic()
    assert burial.claim()
    assert burial.claimed and not burial.told
    # a loop with no thread to spare waits for the last output until then, at most
    assert before + config.OUTPUT_WAIT <= burial.deadline <= (
        time.monotonic() + config.OUTPUT_WAIT)
    assert not burial.claim()


def test_of_many_threads_seeing_one_death_exactly_one_buries_it():
    burial = Burial(3, lambda: KILLED)
    start = threading.Barrier(8)
    claims: queue.SimpleQueue = queue.SimpleQueue()

    def claim() -> None:
        start.wait()
        claims.put(burial.claim())

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = [claims.get() for _ in range(8)]
    assert results.count(True) == 1


def test_a_rank_stopped_on_purpose_is_not_buried_by_its_death():
    burial = Burial(3, lambda: KILLED, lambda event: pytest.fail("nothing is told"))
    burial.stop()
    assert burial.claimed
    assert not burial.claim()
    assert not burial.told


def test_the_event_carries_the_record_as_known_when_it_is_built():
    record = [ProcessFailure(3, 1, None, None)]
    burial = Burial(3, lambda: record[0])
    assert burial.claim()
    record[0] = KILLED  # the exit status came meanwhile
    assert told(burial.exited()) == KILLED
    assert burial.told


def test_a_helper_thread_posts_the_event_once_what_completes_the_record_is_in():
    tail: list[str] = []
    output_ended = threading.Event()
    posted: queue.SimpleQueue = queue.SimpleQueue()
    burial = Burial(3, lambda: ProcessFailure(3, 1, 4321, -11, tuple(tail)), posted.put)
    assert burial.claim()
    burial.tell_later(lambda: output_ended.wait(10))
    with pytest.raises(queue.Empty):
        posted.get(timeout=0.2)  # settling: nothing posted yet
    tail.append("Fatal Python error: Segmentation fault")
    output_ended.set()
    assert told(posted.get(timeout=10)).stderr_tail == (
        "Fatal Python error: Segmentation fault",)
    assert burial.told


def test_a_stop_once_the_death_is_claimed_does_not_silence_it():
    posted: queue.SimpleQueue = queue.SimpleQueue()
    burial = Burial(3, lambda: KILLED, posted.put)
    assert burial.claim()
    burial.stop()  # the group closes the channel while the death settles
    burial.tell_later()
    assert told(posted.get(timeout=10)) == KILLED


def test_an_account_after_the_event_is_told_again_under_the_owners_lock():
    lock = threading.Lock()
    exitcode: list[int | None] = [None]
    posted: list[list] = []
    burial = Burial(3, lambda: ProcessFailure(3, 1, 4321, exitcode[0]), posted.append,
                    lock=lock)
    assert burial.claim()
    burial.tell()  # its stream ended, and a moment passed: no exit status yet
    with lock:  # the warden's word on it, as a Ray channel takes it
        exitcode[0] = -9
        late = burial.told
    if late:
        burial.tell()
    assert [told(event).exitcode for event in posted] == [None, -9]


def test_a_side_that_sends_its_own_message_builds_it_from_the_record():
    burial = Burial(3, lambda: KILLED, message=lambda failure: ["EXITED", 7, failure.exitcode])
    assert burial.claim()
    assert burial.exited() == ["EXITED", 7, -9]
    with pytest.raises(RuntimeError, match="nowhere to post"):
        burial.tell()  # an agent's relay queues the message itself


# -- RankSpawner.start_child ------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_started_as_a_child_shares_its_starters_group_and_output(tmp_path):
    """The Ray actor's rank apart from it: the rank's variables over the actor's, its control
    stream and stack file handed over, the actor's process group (Ray kills a dead worker's
    group: the rank goes with it) and fds 1 and 2, and no stdin."""
    to_rank_r, to_rank_w = os.pipe()
    from_rank_r, from_rank_w = os.pipe()
    stacks = StackFile()
    try:
        child = RankSpawner.start_child({"PHALANX_TEST_MARK": "rank 3"}, str(tmp_path),
                                        ("pipe:{0},{1}", (to_rank_r, from_rank_w)),
                                        stacks_fd=stacks.fd)
        try:  # it waits for its INIT meanwhile
            # until the child has exec'd, /proc shows the environment it forked with
            assert helpers.wait_until(lambda: "PHALANX_TEST_MARK" in _environ(child.pid), 10)
            environ = _environ(child.pid)
            assert environ["PHALANX_TEST_MARK"] == "rank 3"
            assert environ["PATH"] == os.environ["PATH"]
            assert environ[config.ENV_FD] == f"pipe:{to_rank_r},{from_rank_w}"
            assert environ[config.ENV_STACKS_FD] == str(stacks.fd)
            assert config.ENV_FRAME_KEYS not in environ  # pipes of this machine: no keys
            assert os.getpgid(child.pid) == os.getpgrp()
            assert os.readlink(f"/proc/{child.pid}/cwd") == os.path.realpath(tmp_path)
            assert os.readlink(f"/proc/{child.pid}/fd/0") == os.devnull
            for fd in (1, 2):
                assert os.readlink(f"/proc/{child.pid}/fd/{fd}") == os.readlink(
                    f"/proc/self/fd/{fd}")
        finally:
            os.close(to_rank_w)  # its control stream ends: it exits
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise
    finally:
        for fd in (to_rank_r, from_rank_r, from_rank_w):
            os.close(fd)
        stacks.close()


def test_a_burial_moves_alive_claimed_told_once_each():
    from phalanx.errors import ProcessFailure
    from phalanx.node.spawn import Burial, BurialState

    posted: list = []
    burial = Burial(3, lambda: ProcessFailure(3, 0, 42, -9), posted.append)
    assert burial.state is BurialState.ALIVE and not burial.claimed
    assert burial.claim() and burial.state is BurialState.CLAIMED
    assert not burial.claim()  # a second sign of the same death
    burial.stop()  # stopping once claimed changes nothing
    assert burial.state is BurialState.CLAIMED and not burial.told
    burial.tell()
    assert burial.state is BurialState.TOLD and burial.told and len(posted) == 1

    stopped = Burial(4, lambda: ProcessFailure(4, 0, 43, None))
    stopped.stop()
    assert stopped.state is BurialState.CLAIMED and not stopped.claim()
