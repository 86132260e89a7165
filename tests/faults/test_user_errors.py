"""User-code failures that are awkward to report: exceptions that cannot be rebuilt in the
controller, results that cannot be pickled, a clean ``sys.exit()`` in the middle of a call."""

from __future__ import annotations

import pytest

from phalanx import WorkerDied, WorkerError
from phalanx.errors import RemoteTraceback
from tests.workers import Probe


@pytest.fixture
def group(make_group):
    return make_group(Probe, procs_per_node=2)


def test_an_exception_that_cannot_be_rebuilt_still_reports_type_message_and_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.call("raise_unrebuildable")
    error = info.value
    assert error.exc_type == "NeedsTwoArguments"
    assert "cannot be rebuilt here" in str(error)
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "raise_unrebuildable" in str(error.__cause__)
    assert group.call("rank") == [0, 1]


def test_an_unpicklable_result_is_reported_by_the_worker(group):
    with pytest.raises(WorkerError) as info:
        group.call_one(1, "return_unpicklable")
    assert info.value.rank == 1
    assert info.value.stage == "pickling the result"
    assert "lock" in str(info.value)
    assert group.call("rank") == [0, 1]


@pytest.mark.parametrize(
    ("code", "exitcode", "words"),
    [(None, 0, "exit code 0"), (0, 0, "exit code 0"), ("fatal: bad config", 1, "code 1")],
)
def test_sys_exit_during_a_call_is_a_death_not_a_result(group, code, exitcode, words):
    pid = group.call_one(0, "pid")
    with pytest.raises(WorkerDied) as info:
        group.call_one(0, "sys_exit", code, timeout=10)
    assert (info.value.rank, info.value.pid, info.value.exitcode) == (0, pid, exitcode)
    assert words in info.value.cause
    if isinstance(code, str):  # like a script: the message goes to stderr
        assert code in info.value.stderr_tail
    group.recreate(0)
    assert group.call("rank") == [0, 1]
