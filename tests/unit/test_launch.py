"""The launcher's pure parts: exit statuses, the root-cause report, rank lists."""

from __future__ import annotations

import argparse

import pytest

from phalanx.errors import ProcessFailure, RemoteFailure, WorkerDied, WorkerError
from phalanx.launcher.flags import parse_ranks
from phalanx.launcher.report import (
    Failure,
    exit_status,
    failure_from,
    format_report,
    shell_status,
    signal_status,
)


@pytest.mark.parametrize(("code", "status"), [(0, 0), (3, 3), (255, 255), (-1, 255),
                                              (256, 1), (257, 1), (512, 1)])
def test_shell_status_never_turns_a_failure_into_success(code, status):
    assert shell_status(code) == status


@pytest.mark.parametrize(("exitcode", "status"), [(-9, 137), (-15, 143), (-2, 130), (4, 4)])
def test_signal_status_is_what_a_shell_reports(exitcode, status):
    assert signal_status(exitcode) == status


def test_a_worker_error_reports_type_message_and_traceback():
    remote = RemoteFailure("ValueError", "bad input", "Traceback ...\nValueError: bad input\n",
                           "running the method", None)
    failure = failure_from(WorkerError(remote, rank=2, node=1, pid=42, method="run"))
    assert failure == Failure(2, 1, 42, 1, "raised ValueError: bad input",
                              "Traceback ...\nValueError: bad input\n")
    report = format_report(failure).splitlines()
    assert report[1] == "phalanx run failed"
    assert report[2] == "root cause: rank 2 (node 1, pid 42) raised ValueError: bad input"
    assert report[3] == "exit status: 1"
    assert "ValueError: bad input" in report


def test_a_killed_rank_reports_the_signal_and_its_last_stderr_lines():
    died = WorkerDied(ProcessFailure(rank=0, node=0, pid=7, exitcode=-9,
                                     stderr_tail=("allocating 80 GiB",)))
    failure = failure_from(died)
    assert failure.status == 137
    report = format_report(failure, attempts=3)
    assert "phalanx run failed after 3 attempts" in report
    assert "rank 0 (node 0, pid 7) killed by SIGKILL" in report
    assert "  allocating 80 GiB" in report


def test_a_lost_node_reports_its_first_rank_the_agent_and_why():
    from phalanx.errors import MembershipChanged, NodeInfo

    lost = MembershipChanged([], [NodeInfo(1, "10.0.0.6:32300", (2, 3))], "run",
                             "its connection ended (end of stream)")
    failure = failure_from(lost)
    assert (failure.rank, failure.node, failure.status) == (2, 1, 1)
    report = format_report(failure)
    assert ("root cause: rank 2 (node 1) its node left the group (the agent at 10.0.0.6:32300):"
            " its connection ended (end of stream)") in report


@pytest.mark.parametrize(("text", "ranks"), [("0", (0,)), ("2,0", (0, 2)), ("0-3", (0, 1, 2, 3)),
                                             ("1,4-5,1", (1, 4, 5))])
def test_parse_ranks(text, ranks):
    assert parse_ranks(text) == ranks


@pytest.mark.parametrize("text", ["", "x", "1-", "-1", "0,,1"])
def test_parse_ranks_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError, match="ranks"):
        parse_ranks(text)


def test_a_failed_start_is_reported_once_with_its_traceback():
    from phalanx.errors import StartupError

    error = StartupError("rank 1 failed while starting the ray framework: RuntimeError: boom\n\n"
                         "Remote traceback:\nTraceback ...\nRuntimeError: boom",
                         rank=1, traceback="Traceback ...\nRuntimeError: boom\n")
    report = format_report(failure_from(error))
    assert "root cause: rank 1 could not start: rank 1 failed while starting the ray " \
           "framework: RuntimeError: boom" in report
    assert report.count("Traceback ...") == 1


@pytest.mark.parametrize(("status", "exit_code", "expected"),
                         [(3, "torchrun", 1), (137, "torchrun", 1), (3, "rank", 3),
                          (137, "rank", 137)])
def test_the_launcher_exits_1_like_torchrun_unless_asked_for_the_rank_status(
        status, exit_code, expected):
    failure = Failure(1, 0, 42, status, "exited")
    assert exit_status(failure, exit_code) == expected
    assert format_report(failure, status=expected).splitlines()[3] == f"exit status: {expected}"


def test_a_failure_crosses_between_launchers_unchanged():
    failure = Failure(3, 1, 42, 137, "killed by SIGKILL", None, ("oom",), seen=12.5)
    assert Failure.from_dict(failure.to_dict()) == failure
    with pytest.raises(ValueError, match="unknown fields"):
        Failure.from_dict({**failure.to_dict(), "evil": 1})
