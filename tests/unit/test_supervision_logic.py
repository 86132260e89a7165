"""The pure parts of supervision: reading stack dumps, checking options, failure records,
the start-up table, and the variables a user may not override."""

from __future__ import annotations

import math
import os
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import phalanx
from phalanx.controller.watch import RankStartup, StartupReport
from phalanx.dumps import format_report, innermost_user_frames, is_user_file
from phalanx.errors import (
    CallTimeout,
    ProcessFailure,
    WorkerDied,
    WorkerUnresponsive,
    death_error,
)
from phalanx.options import check_count, check_seconds
from phalanx.world.layout import merge_env

STDLIB = os.path.dirname(os.__file__)
PHALANX = os.path.dirname(phalanx.__file__)

DUMP = f"""\
Thread 0x00007f6a737fe6c0 (most recent call first):
  File "{PHALANX}/worker.py", line 70 in beat
  File "{STDLIB}/threading.py", line 982 in run

Current thread 0x00007f6a79c77b80 (most recent call first):
  File "{STDLIB}/threading.py", line 320 in wait
  File "/home/me/train.py", line 41 in step
  File "/home/me/train.py", line 12 in train
  File "{PHALANX}/worker.py", line 310 in _run_call
  File "<string>", line 1 in <module>
"""


def test_the_innermost_user_frame_of_each_thread_running_user_code():
    assert innermost_user_frames(DUMP) == ['File "/home/me/train.py", line 41 in step']


def test_phalanx_the_stdlib_and_generated_code_are_not_user_code():
    assert not is_user_file(f"{PHALANX}/group.py")
    assert not is_user_file(f"{STDLIB}/threading.py")
    assert not is_user_file("<string>")
    assert is_user_file("/home/me/train.py")


def test_a_dump_with_no_user_code_or_no_dump_at_all_names_no_frame():
    assert innermost_user_frames("(no stack: the process is stopped)") == []
    assert innermost_user_frames(DUMP.split("Current")[0]) == []


def test_a_report_puts_each_rank_under_its_own_header_in_rank_order():
    text = format_report({1: "b\n", 0: "a"}, {0: "rank 0 (node 0, pid 7)"})
    assert text.index("=== rank 0 (node 0, pid 7) ===\na") < text.index("=== rank 1 ===\nb")


@given(st.floats(min_value=0, allow_nan=False) | st.integers(min_value=0))
def test_any_non_negative_number_of_seconds_is_accepted(value):
    assert check_seconds(value) == float(value)


@pytest.mark.parametrize("value", [-1, -0.5, math.nan])
def test_negative_or_nan_seconds_are_refused_naming_the_option(value):
    with pytest.raises(ValueError, match="heartbeat_timeout must be zero or more seconds"):
        check_seconds(value, "heartbeat_timeout")


@pytest.mark.parametrize("value", ["x", "2", True, [1]])
def test_seconds_of_the_wrong_type_are_refused_naming_the_option(value):
    with pytest.raises(TypeError, match="timeout must be a number of seconds or None"):
        check_seconds(value)


def test_zero_seconds_can_be_refused_and_none_means_no_limit():
    with pytest.raises(ValueError, match="more than zero"):
        check_seconds(0, "start_timeout", allow_zero=False)
    assert check_seconds(None) is None


def test_counts_must_be_integers_of_at_least_the_minimum():
    assert check_count(2, "nodes") == 2
    with pytest.raises(TypeError, match="nodes must be an integer, got '2'"):
        check_count("2", "nodes")
    with pytest.raises(ValueError, match="nodes must be a positive integer, got 0"):
        check_count(0, "nodes")


def test_user_variables_may_not_change_what_phalanx_sets():
    generic = {"RANK": "1", "MASTER_PORT": "29500", "PHALANX_MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=r"env sets MASTER_PORT, RANK, which phalanx sets"):
        merge_env({}, generic, {"RANK": "99", "MASTER_PORT": "1", "OTHER": "x"}, None)
    with pytest.raises(ValueError, match="rank_env sets RANK"):
        merge_env({}, generic, None, {"RANK": "5"})


def test_user_variables_that_agree_or_are_new_are_taken():
    env = merge_env({"HOME": "/h"}, {"RANK": "1"}, {"RANK": "1", "A": "a"}, {"B": "b"})
    assert env["RANK"] == "1" and env["A"] == "a" and env["B"] == "b" and env["HOME"] == "/h"


def test_a_later_account_of_a_death_keeps_why_the_rank_was_killed():
    declared = ProcessFailure(2, 0, 99, None, reason="silent", silent_for=3.5, stack="dump")
    reaped = ProcessFailure(2, 0, 99, -9, ("last line",))
    merged = reaped.merged(declared)
    assert (merged.exitcode, merged.reason, merged.silent_for, merged.stack) == (
        -9, "silent", 3.5, "dump")
    assert merged.stderr_tail == ("last line",)
    assert reaped.merged(None) is reaped


def test_an_unresponsive_rank_fails_its_calls_with_its_silence_and_where_it_was():
    failure = ProcessFailure(2, 1, 99, -9, reason="it gave no sign of life for 3.5 s",
                             silent_for=3.5, stack=DUMP)
    error = death_error(failure, "train")
    assert isinstance(error, WorkerUnresponsive) and isinstance(error, WorkerDied)
    assert error.silent_for == 3.5 and error.stack == DUMP
    text = str(error)
    assert "rank 2 (node 1, pid 99) died while running train()" in text
    assert "no sign of life for 3.5 s" in text
    assert 'File "/home/me/train.py", line 41 in step' in text
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is WorkerUnresponsive and again.silent_for == 3.5
    assert type(death_error(ProcessFailure(2, 1, 99, -9))) is WorkerDied


def test_a_call_timeout_says_where_the_late_ranks_are():
    error = CallTimeout("train", 2.0, [1, 3], {1: DUMP, 3: "(no stack: stopped)"})
    text = str(error)
    assert "train() did not finish within 2 s on ranks [1, 3]" in text
    assert 'rank 1: File "/home/me/train.py", line 41 in step' in text
    assert "rank 3:" not in text  # nothing known about where it is
    assert error.stacks[3] == "(no stack: stopped)"
    assert CallTimeout("f", 1.0, [0]).stacks == {}


def test_the_startup_report_is_a_table_with_a_row_per_rank():
    report = StartupReport([RankStartup(0, 1.5, 0.2, 0.3, 0.01, None, 0.4, 0.59)])
    lines = str(report).splitlines()
    assert lines[0].split() == ["rank", "total", "spawn", "interpreter", "waiting",
                                "framework", "imports", "constructor"]
    assert lines[1].split() == ["0", "1.500", "0.200", "0.300", "0.010", "-", "0.400", "0.590"]

