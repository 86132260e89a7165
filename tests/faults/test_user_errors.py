"""User-code failures that are awkward to report: exceptions whose ``__init__`` pickle cannot
call, exceptions that cannot be rebuilt in the controller at all, code shipped from the
user's ``__main__``, results that cannot be pickled, a clean ``sys.exit()`` in a call."""

from __future__ import annotations

import pytest

from phalanx import WorkerDied, WorkerError
from phalanx.errors import RemoteTraceback
from tests import helpers
from tests.workers import NeedsTwoArguments, Probe


@pytest.fixture(scope="module")
def shared_group(backend):
    with helpers.long_lived_group(Probe, procs_per_node=2, backend=backend,
                                  echo_output=False) as group:
        yield group


@pytest.fixture
def group(shared_group):
    """The module's group, every rank alive (one a failed test left dead is recreated)."""
    dead = [h.rank for h in shared_group.health() if not h.alive]
    if dead:
        shared_group.recreate(dead)
    return shared_group


def test_an_exception_whose_init_takes_two_arguments_is_rebuilt(group):
    with pytest.raises(WorkerError) as info:
        group.call("raise_unrebuildable")
    error = info.value
    assert error.exc_type == "NeedsTwoArguments"
    assert "cannot be rebuilt here" in str(error)
    with pytest.raises(NeedsTwoArguments) as original:
        raise error.__cause__
    assert type(original.value) is NeedsTwoArguments
    assert original.value.args == ("cannot be rebuilt here",)
    assert original.value.code == 7
    assert isinstance(original.value.__cause__, RemoteTraceback)
    assert "raise_unrebuildable" in str(original.value.__cause__)
    assert group.call("rank") == [0, 1]


def test_errors_from_code_in_the_users_main_are_rebuilt_and_name_the_script(backend, tmp_path):
    script = helpers.write_script(tmp_path, f"""
        import json
        import threading

        import phalanx as px
        from phalanx.errors import RemoteTraceback


        class TwoArguments(Exception):
            def __init__(self, a, b):
                super().__init__(f"{{a}}-{{b}}")
                self.a = a
                self.b = b


        class HoldsALock(Exception):
            def __init__(self):
                super().__init__("holds a lock")
                self.lock = threading.Lock()


        class Worker:
            def fail(self):
                try:
                    self.lookup()
                except KeyError as exc:
                    raise TwoArguments("x", 2) from exc

            def lookup(self):
                return {{}}["missing"]

            def fail_unpicklably(self):
                raise HoldsALock()


        def report(group, method):
            try:
                group.call_one(0, method)
            except px.WorkerError as error:
                cause = error.__cause__
                try:
                    raise cause
                except TwoArguments:
                    caught = True
                except Exception:
                    caught = False
                return {{
                    "caught": caught,
                    "type": type(cause).__name__,
                    "args": list(cause.args),
                    "attributes": [getattr(cause, "a", None), getattr(cause, "b", None)],
                    "remote": isinstance(cause.__cause__, RemoteTraceback),
                    "traceback": error.traceback,
                }}


        if __name__ == "__main__":
            with px.WorkerGroup(Worker, backend={backend!r}, echo_output=False) as group:
                print(json.dumps(report(group, "fail")))
                print(json.dumps(report(group, "fail_unpicklably")))
    """)
    lines = script.read_text().splitlines()
    done = helpers.run_script(script)
    assert done.returncode == 0, done.stderr
    rebuilt, text_only = helpers.json_lines(done.stdout)

    assert rebuilt["caught"] and rebuilt["type"] == "TwoArguments"
    assert rebuilt["args"] == ["x-2"] and rebuilt["attributes"] == ["x", 2]
    assert rebuilt["remote"]
    # Every frame of the chain names the script and shows its source, as a local traceback does.
    assert "<dynamic-code>" not in rebuilt["traceback"]
    for source in ('raise TwoArguments("x", 2) from exc', 'return {}["missing"]', "self.lookup()"):
        number = next(i for i, line in enumerate(lines, 1) if line.strip() == source)
        assert f'File "{script}", line {number}' in rebuilt["traceback"]
        assert f"    {source}\n" in rebuilt["traceback"]

    assert text_only["type"] == "RemoteTraceback" and not text_only["caught"]
    assert f'File "{script}"' in text_only["traceback"]
    assert "HoldsALock: holds a lock" in text_only["traceback"]


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
