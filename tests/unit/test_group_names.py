"""Group names, pure: the rules a given name follows, the default names (the target's,
numbered, never given twice), the book of names open groups hold, and the errors that name
a group. No process behind them."""

from __future__ import annotations

import pickle
import string
import threading
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx import config
from phalanx.controller.names import GroupNames, base_of, check_name, holder
from phalanx.errors import (
    CallTimeout,
    ProcessFailure,
    RemoteFailure,
    StartupError,
    WorkerError,
    death_error,
)

ALLOWED = string.ascii_letters + string.digits + "-_."


@given(st.text(ALLOWED, min_size=1, max_size=config.MAX_GROUP_NAME))
def test_letters_digits_and_dash_underscore_dot_make_a_name(name):
    check_name(name)


@given(st.text(min_size=1, max_size=20).filter(lambda s: any(c not in ALLOWED for c in s)))
def test_any_other_character_is_refused_naming_the_argument_and_the_value(name):
    with pytest.raises(ValueError) as info:
        check_name(name)
    assert str(info.value).startswith(f"name={name!r} holds ")


def test_empty_long_and_non_str_names_are_refused():
    with pytest.raises(ValueError, match=r"^name='' is empty"):
        check_name("")
    with pytest.raises(ValueError, match="at most 64"):
        check_name("x" * (config.MAX_GROUP_NAME + 1))
    with pytest.raises(TypeError, match="name must be a str"):
        check_name(b"bytes")


def test_defaults_are_numbered_per_base_and_never_given_twice():
    names = GroupNames()
    assert [names.claim(None, "Policy") for _ in range(3)] == ["Policy", "Policy-2", "Policy-3"]
    assert names.claim(None, "Ref") == "Ref"  # a count per base
    names.release("Policy-2")
    assert names.claim(None, "Policy") == "Policy-4"  # a released default is not reused
    assert names.unused("Policy") == "Policy-5" and "Policy-5" not in names


def test_a_given_name_is_held_until_released_and_defaults_step_past_it():
    names = GroupNames()
    assert names.claim("Policy-2", "ignored") == "Policy-2"
    with pytest.raises(ValueError, match="name='Policy-2' is the name of a group"):
        names.claim("Policy-2", "Policy")
    with pytest.raises(ValueError, match="still open"):
        names.check_free("Policy-2")
    assert [names.claim(None, "Policy") for _ in range(2)] == ["Policy", "Policy-3"]
    names.release("Policy-2")
    names.check_free("Policy-2")
    assert names.claim("Policy-2", "x") == "Policy-2"  # free again once released


def test_threads_taking_default_names_at_once_each_get_their_own():
    names = GroupNames()
    taken: list[str] = []
    start = threading.Barrier(8)

    def take() -> None:
        start.wait()
        taken.extend(names.claim(None, "Policy") for _ in range(50))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(taken)) == 400 and "Policy" in taken and "Policy-400" in taken


class Policy:
    pass


def test_the_base_is_the_targets_name_made_fit_for_a_name():
    assert base_of(Policy) == "Policy"
    assert base_of(lambda: None) == "lambda"
    assert base_of(types.ModuleType("pkg.workers")) == "pkg.workers"
    assert base_of(object()) == "object"  # no __name__: its type's
    long = type("P" * 100, (), {})
    assert len(base_of(long)) <= config.MAX_GROUP_NAME - 6  # room for "-12345"


def test_holders_name_the_group_and_its_size():
    assert holder("Policy-2", 4) == "group Policy-2 (4 ranks)"
    assert holder("gen", 1) == "group gen (1 rank)"


KILLED = ProcessFailure(1, 0, 4321, -9)


def test_errors_name_the_rank_of_the_group_and_keep_it_through_pickling():
    died = death_error(KILLED, "step", group="Policy-2")
    assert str(died).startswith("rank 1 of group Policy-2 (node 0, pid 4321) died while "
                                "running step(): killed by SIGKILL")
    timeout = CallTimeout("step", 2.0, [1, 3], group="Policy-2")
    assert "step() did not finish within 2 s on ranks [1, 3] of group Policy-2;" in str(timeout)
    failure = RemoteFailure("ValueError", "bad", "tb", "running the method", None)
    error = WorkerError(failure, rank=2, node=1, pid=7, method="step", group="gen")
    assert str(error) == "ValueError on rank 2 of group gen (node 1, pid 7) in step(): bad"
    startup = StartupError("rank 1 of group gen ...", rank=1, group="gen")
    for exc in (died, timeout, error, startup):
        again = pickle.loads(pickle.dumps(exc))
        assert again.group == exc.group and str(again) == str(exc)
    assert str(death_error(KILLED, "step")).startswith("rank 1 (node 0, pid 4321) died")
