"""What a dead rank's errors say happened: it died while running a call, it was dead before
the call was sent, or it never started (no pid to name). No process behind them."""

from __future__ import annotations

import pickle

import pytest

from phalanx.backends.parts import Capabilities
from phalanx.controller.calls import Sender
from phalanx.controller.dispatch import Dispatcher
from phalanx.controller.ranks import RankEntry, RankTable
from phalanx.controller.startup import startup_error
from phalanx.errors import ProcessFailure, WorkerDied, WorkerUnresponsive, death_error
from phalanx.wire import pickling, protocol

KILLED = ProcessFailure(1, 0, 4321, -9)
NEVER_STARTED = ProcessFailure(2, 0, None, 127)  # the node side's record: no pid, a status


def test_a_rank_that_died_during_a_call_died_while_running_it():
    assert str(death_error(KILLED, "who")).startswith(
        "rank 1 (node 0, pid 4321) died while running who(): killed by SIGKILL")


def test_a_rank_dead_before_the_call_was_sent_says_so():
    error = death_error(KILLED, "who", before_sent=True)
    assert str(error).startswith(
        "rank 1 (node 0, pid 4321) was already dead when who() was sent: killed by SIGKILL")
    assert error.before_sent and error.method == "who"
    assert pickle.loads(pickle.dumps(error)).before_sent


def test_a_rank_refused_before_any_call_just_died():
    assert str(death_error(KILLED)).startswith("rank 1 (node 0, pid 4321) died: killed by")


def test_a_rank_that_never_started_names_no_pid_and_no_exit_code():
    for error in (death_error(NEVER_STARTED), death_error(NEVER_STARTED, "who")):
        text = str(error)
        assert text.startswith("rank 2 (node 0) never started")
        assert "its node could not start its process" in text
        assert "pid" not in text and "exit" not in text
    assert "never started, so who() never ran: " in str(death_error(NEVER_STARTED, "who"))
    assert NEVER_STARTED.never_started and not KILLED.never_started


def test_a_rank_whose_node_was_lost_before_its_pid_was_heard_of_is_not_said_unstarted():
    lost = ProcessFailure(3, 1, None, None, reason="lost node 10.0.0.2: connection reset")
    assert not lost.never_started
    assert str(death_error(lost, "who")) == (
        "rank 3 (node 1) died while running who(): lost node 10.0.0.2: connection reset")


def test_an_unresponsive_rank_killed_before_the_call_was_sent_says_so_too():
    silent = ProcessFailure(1, 0, 4321, -9, reason="it gave no sign of life", silent_for=9.0)
    error = death_error(silent, "who", before_sent=True)
    assert isinstance(error, WorkerUnresponsive)
    assert "was already dead when who() was sent: it gave no sign of life" in str(error)


def test_the_start_up_error_of_a_rank_that_never_started_says_so():
    entry = RankEntry(2, 0, FakeChannel(2))
    entry.exited(NEVER_STARTED)
    error = startup_error(entry)
    assert str(error).startswith("rank 2 (node 0) never started: its node could not start")
    assert error.rank == 2 and isinstance(error.__cause__, WorkerDied)


def test_the_start_up_error_of_a_rank_that_died_starting_names_its_pid():
    entry = RankEntry(1, 0, FakeChannel(1))
    entry.exited(KILLED)
    assert str(startup_error(entry)).startswith(
        "rank 1 died during start-up: rank 1 (node 0, pid 4321) died: killed by SIGKILL")


class FakeChannel:
    link = None

    def __init__(self, rank: int) -> None:
        self.ranks = (rank,)
        self.sent: list[list] = []

    def send(self, frame: list) -> None:
        self.sent.append(frame)

    def sender(self):
        return self.send


class FakeBackend:
    name = "fake"
    capabilities = Capabilities()  # nothing beyond the basics


@pytest.fixture
def dispatcher():
    dispatcher = Dispatcher()
    yield dispatcher
    dispatcher.release()


def test_a_call_to_a_rank_whose_death_is_in_but_not_yet_read_fails_as_sent_too_late(
        dispatcher):
    table = RankTable(2, dispatcher)
    entries = [RankEntry(rank, 0, FakeChannel(rank)) for rank in range(2)]
    for entry in entries:
        dispatcher.add(entry)
        entry.became_ready(4320 + entry.rank, ["who"], {}, None)
    table.install(entries)
    sender = Sender(table, dispatcher, shared=None, backend=FakeBackend())  # type: ignore[arg-type]
    # the death arrived before the call; nothing has read it yet
    dispatcher.post(entries[1].channel, [protocol.exited_message(1, KILLED.as_dict())])
    future = sender.send("who", [0, 1], [pickling.dumps_plain(((), {}))])
    error = future.futures[1].exception(timeout=1)
    assert isinstance(error, WorkerDied) and error.before_sent
    assert "was already dead when who() was sent" in str(error)
    assert not future.futures[0].done()  # rank 0 got the call and has not answered yet
