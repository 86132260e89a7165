"""Telling a phalanx worker from other processes by command lines (``phalanx run``'s last
resort on a signal during a start kills exactly these): a fresh interpreter running the rank
runtime, or a rank forked from preloaded modules, which keeps its supervisor's command line
-- below a keeper and the supervisor, three alike, where a keeper has two."""

from __future__ import annotations

from phalanx.node.spawn import is_worker, worker_argv

SUPERVISOR = ["/usr/bin/python3", "-S", "-c",
              "import sys; sys.path.insert(0, '/x'); from phalanx.node.keeper import main; main()",
              "12", "4242"]
CONTROLLER = ["/usr/bin/python3", "-m", "phalanx", "run", "train.py"]


def test_a_fresh_worker_interpreter_is_a_worker():
    assert is_worker([worker_argv(), SUPERVISOR, SUPERVISOR])
    assert is_worker([worker_argv()])


def test_a_rank_forked_below_its_keeper_and_supervisor_is_a_worker():
    assert is_worker([SUPERVISOR, SUPERVISOR, SUPERVISOR])


def test_the_keeper_and_the_supervisor_are_not_workers():
    assert not is_worker([SUPERVISOR, SUPERVISOR, CONTROLLER])  # a keeper
    assert not is_worker([SUPERVISOR, CONTROLLER])  # the supervisor
    assert not is_worker([SUPERVISOR, CONTROLLER, ["/sbin/init"]])


def test_what_a_rank_started_is_not_a_worker():
    assert not is_worker([["sleep", "60"], SUPERVISOR, SUPERVISOR])
    assert not is_worker([["/usr/bin/python3", "-c", "print(1)"], SUPERVISOR, SUPERVISOR])
    assert not is_worker([])
