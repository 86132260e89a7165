"""The rank state machine and the rank table, with no process behind them: every legal
move, the moves that are ignored, what ``health()`` calls each state, selections."""

from __future__ import annotations

import threading

import pytest

from phalanx.controller.ranks import RankEntry, RankState, RankTable, channels_of
from phalanx.errors import GroupClosed, ProcessFailure, RemoteFailure, WorkerDied

READY_EXTRA = (1234, ["step"], {"constructor": 0.1}, "v1")


class FakeChannel:
    def __init__(self, ranks=(0,)) -> None:
        self.ranks = list(ranks)
        self.dying_ranks: set[int] = set()  # deaths known, EXITED still on its way

    def dying(self, rank: int) -> bool:
        return rank in self.dying_ranks

    def sender(self):
        return lambda frame: None  # (nothing is sent here)


class FakeDispatcher:
    group_name = None  # a group of no name: messages name the ranks alone

    def __init__(self) -> None:
        self.deaths = 0
        self.polls = 0

    def poll_now(self) -> None:
        self.polls += 1


class Future:
    def __init__(self, tolerant: bool) -> None:
        self.tolerant = tolerant


def entry(rank=0) -> RankEntry:
    return RankEntry(rank, 0, FakeChannel([rank]))


def failure(rank=0) -> ProcessFailure:
    return ProcessFailure(rank, 0, 1234, -9)


def init_failure() -> RemoteFailure:
    return RemoteFailure("ValueError", "bad", "Traceback ...", "constructing the worker", None)


def test_every_state_has_the_health_word_it_always_had():
    assert {s: s.health for s in RankState} == {
        RankState.STARTING: "starting",
        RankState.READY: "ready",
        RankState.FAILED_START: "starting",
        RankState.UNRESPONSIVE: "unresponsive",
        RankState.EXITED: "dead",
    }


def test_a_rank_starts_then_is_ready_with_what_ready_told():
    s = entry()
    assert (s.state, s.alive, s.heard, s.ever_ready) == (RankState.STARTING, True, False, False)
    s.became_ready(*READY_EXTRA)
    assert (s.state, s.alive, s.ever_ready) == (RankState.READY, True, True)
    assert (s.pid, s.methods, s.code_version) == (1234, ["step"], "v1")
    assert s.timings["total"] >= 0 and s.settled_start()


def test_a_constructor_that_raised_fails_the_start_and_the_rank_can_then_only_exit():
    s = entry()
    s.failed_to_start(init_failure())
    assert s.state is RankState.FAILED_START and s.alive and s.settled_start()
    assert not s.suspect()  # being stopped: its silence is not judged
    s.exited(failure())
    assert s.state is RankState.EXITED and not s.alive


@pytest.mark.parametrize("before", [RankState.STARTING, RankState.READY])
def test_a_silent_rank_is_suspected_and_goes_back_where_it_was_if_it_speaks(before):
    s = entry()
    if before is RankState.READY:
        s.became_ready(*READY_EXTRA)
    assert s.suspect()
    assert s.state is RankState.UNRESPONSIVE and s.alive
    assert not s.suspect()  # once is enough
    s.clear_suspicion()
    assert s.state is before


def test_ready_arriving_while_suspected_is_where_the_rank_goes_back_to():
    s = entry()
    s.suspect()
    s.became_ready(*READY_EXTRA)
    assert s.state is RankState.UNRESPONSIVE and s.ever_ready
    s.clear_suspicion()
    assert s.state is RankState.READY


def test_exited_is_final_and_a_late_message_changes_nothing_but_the_record():
    s = entry()
    s.became_ready(*READY_EXTRA)
    s.exited(failure())
    for move in (lambda: s.became_ready(*READY_EXTRA), lambda: s.failed_to_start(
            init_failure()), s.suspect, s.clear_suspicion):
        move()
        assert s.state is RankState.EXITED and not s.alive
    s.exited(None)  # the shutdown stopping a rank already dead keeps its record
    assert s.failure == failure()


def test_a_fuller_account_of_a_death_is_merged_into_the_record():
    s = entry()
    s.exited(ProcessFailure(0, 0, 1234, None, reason="silent for 5 s"))
    s.add_account(ProcessFailure(0, 0, 1234, -9))
    assert s.failure.exitcode == -9 and "silent" in s.failure.reason


def test_the_last_sign_of_life_is_the_launch_until_the_rank_speaks():
    s = entry()
    assert s.last_sign == s.started
    s.seen = s.started + 5
    assert s.heard and s.last_sign == s.started + 5


def test_pending_calls_are_taken_all_or_by_a_rule():
    s = entry()
    strict, tolerant = Future(False), Future(True)
    s.pending.update({1: strict, 2: tolerant})
    assert s.take_pending(lambda f: not f.tolerant) == [strict]
    assert s.pending == {2: tolerant}
    assert s.take_pending() == [tolerant] and s.pending == {}


def test_pending_calls_are_read_at_once_while_answers_come():
    """The watchdog's thread reads every call a rank owes while the pumping thread takes
    answered ones away: ``pending.calls()`` is one snapshot (a lookup per id, as
    ``values()`` makes, fails on a call answered in between)."""
    s = entry()
    calls = {i: Future(False) for i in range(64)}
    s.pending.update(calls)
    stop = threading.Event()

    def answer() -> None:  # as the pump does: a call taken, another registered
        i = 64
        while not stop.is_set():
            s.calls.pop(i - 64, None)
            s.calls[i] = calls[i % 64]
            i += 1

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        for _ in range(3000):
            assert len(s.pending.calls()) in (63, 64)  # (one taken, its next not yet in)
    finally:
        stop.set()
        thread.join(10)


def test_channels_of_names_a_shared_channel_once():
    channel = FakeChannel([0, 1])
    assert channels_of([RankEntry(0, 0, channel), RankEntry(1, 0, channel)]) == [channel]


def table_of(n: int, dead=()) -> tuple[RankTable, FakeDispatcher]:
    dispatcher = FakeDispatcher()
    table = RankTable(n, dispatcher)  # type: ignore[arg-type]
    table.install([entry(r) for r in range(n)])
    for r in dead:
        table.entries[r].exited(failure(r))  # type: ignore[union-attr]
        dispatcher.deaths += 1
    return table, dispatcher


def test_selections_follow_the_rules_and_a_dead_rank_named_raises():
    table, dispatcher = table_of(3, dead=[1])
    assert table.select("ready") == [0, 2] and dispatcher.polls == 1
    assert table.select("any") == [0]
    assert table.select([0, 2]) == [0, 2]
    with pytest.raises(WorkerDied):
        table.select("all")
    with pytest.raises(WorkerDied):
        table.select([1])
    assert [s.rank for s in table.live()] == [0, 2]
    assert table.alive_flags() == [True, False, True]


def test_ready_and_any_skip_a_rank_whose_death_is_known_but_not_yet_told():
    table, _ = table_of(3)
    table.entries[0].channel.dying_ranks.add(0)  # type: ignore[union-attr]
    assert table.select("ready") == [1, 2]
    assert table.select("any") == [1]
    assert table.select("all") == [0, 1, 2]  # still alive: a call to it fails as it dies


def test_all_is_answered_from_memory_until_a_rank_dies():
    table, dispatcher = table_of(2)
    table.select("all")  # looks: every rank is alive
    first = table.select("all")
    assert table.select("all") is first == [0, 1]  # nothing died since: no look
    table.entries[0].exited(failure())  # type: ignore[union-attr]
    dispatcher.deaths += 1
    with pytest.raises(WorkerDied):
        table.select("all")
    assert table.checked([1]) == [1]
    with pytest.raises(WorkerDied):
        table.checked([0, 1])


def test_a_user_list_is_copied_and_checked():
    table, _ = table_of(3)
    mine = [0, 2]
    assert table.select(mine) == mine and table.select(mine) is not mine
    with pytest.raises(ValueError):
        table.select([2, 2])
    with pytest.raises(TypeError):
        table.select([True])


def test_any_with_no_live_rank_is_group_closed():
    table, _ = table_of(2, dead=[0, 1])
    with pytest.raises(GroupClosed):
        table.select("any")


def test_reset_forgets_every_slot_but_keeps_the_list():
    table, _ = table_of(2)
    entries = table.entries
    table.reset(3)
    assert table.entries is entries and entries == [None, None, None] and len(table) == 3
    assert table.known() == [] and table.live_channels() == []
