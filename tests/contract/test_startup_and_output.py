"""Start-up failures, worker output, spmd, and controllers written as scripts."""

from __future__ import annotations

import time

import pytest

import phalanx as px
from phalanx import CallTimeout, StartupError, WorkerDied, WorkerGroup
from tests import helpers
from tests.workers import FailingConstructor, SlowConstructor


def pids_in(directory) -> list[int]:
    return [int(p.read_text()) for p in sorted(directory.iterdir())]


def test_a_failing_constructor_fails_the_start_with_its_traceback(backend, tmp_path):
    with pytest.raises(StartupError) as info:
        WorkerGroup(FailingConstructor, args=(1,), kwargs={"pid_dir": str(tmp_path)},
                    procs_per_node=3, backend=backend, echo_output=False)
    error = info.value
    assert error.rank == 1
    message = str(error)
    assert "rank 1 of group FailingConstructor" in message and "(node 0" in message
    assert "pid None" not in message and error.group.startswith("FailingConstructor")
    assert "RuntimeError: constructor failed on rank 1" in message
    assert "Traceback" in message and "__init__" in message
    assert "constructor failed on rank 1" in error.traceback
    assert isinstance(error.__cause__, RuntimeError)
    pids = pids_in(tmp_path)  # the start fails fast: slower ranks may not have got this far
    assert 1 <= len(pids) <= 3
    assert helpers.wait_dead(pids, 1), "the other ranks must be torn down"


def test_a_rank_that_never_started_says_so(backend, tmp_path):
    with pytest.raises(StartupError) as info:
        WorkerGroup(SlowConstructor, args=(0,), procs_per_node=2, backend=backend,
                    echo_output=False, cwd=str(tmp_path / "missing"))
    message = str(info.value)
    assert isinstance(info.value.__cause__, WorkerDied)
    if getattr(backend, "name", backend) == "ray":  # there the rank's process applies cwd:
        assert "No such file or directory" in message and "pid None" not in message
        return  # it starts, then dies of it
    assert message.startswith(f"rank {info.value.rank} of group {info.value.group} (node 0) "
                              "never started: its node could not start its process"), message
    assert "pid" not in message and "exit" not in message


def test_a_worker_dying_in_its_constructor_fails_the_start(backend):
    with pytest.raises(StartupError) as info:
        WorkerGroup(FailingConstructor, args=(0,), kwargs={"exit_code": 7},
                    procs_per_node=2, backend=backend, echo_output=False)
    assert info.value.rank == 0
    assert isinstance(info.value.__cause__, WorkerDied)
    assert info.value.__cause__.exitcode == 7


def test_ranks_of_another_phalanx_release_refuse_the_controller_at_once(backend, monkeypatch):
    """A controller of another release (here: one that says so in every rank's INIT) is
    refused by each rank before it unpickles anything, naming both versions."""
    import phalanx.controller.startup as startup

    monkeypatch.setattr(startup, "__version__", "0.0.1")
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        WorkerGroup(FailingConstructor, args=(99,), procs_per_node=2, backend=backend,
                    echo_output=False)
    assert time.monotonic() - started < 15
    message = str(info.value)
    assert f"this rank runs phalanx {px.__version__}" in message
    assert "the controller runs phalanx 0.0.1" in message
    assert "checking phalanx's version" in message


def test_start_timeout_raises_startup_error_naming_the_setting(backend, tmp_path):
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        WorkerGroup(SlowConstructor, args=(60,), procs_per_node=2, start_timeout=1,
                    backend=backend, echo_output=False)
    assert time.monotonic() - started < 5
    assert "start_timeout" in str(info.value)
    assert "[0, 1]" in str(info.value)


@pytest.mark.slow
def test_a_failing_constructor_is_reported_without_waiting_for_slow_ranks(backend):
    # the bound includes starting the group (Ray's first actors on a cold cluster take
    # seconds): it proves the report waited neither for start_timeout nor the 60 s sleep
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        WorkerGroup(FailingConstructor, args=(1,), kwargs={"sleep": 60}, procs_per_node=2,
                    start_timeout=40, backend=backend, echo_output=False)
    assert info.value.rank == 1
    assert time.monotonic() - started < 20


def scaled_rank(scale, offset=0):
    import os

    return int(os.environ["RANK"]) * scale + offset


def test_spmd_returns_one_value_per_rank(backend):
    run = px.spmd(scaled_rank, procs_per_node=3, backend=backend, echo_output=False)
    assert run(10, offset=1) == [1, 11, 21]
    base = 5
    assert px.spmd(lambda: base, nodes=2, backend=backend, echo_output=False)() == [5, 5]


def sleep_then_return(seconds):
    time.sleep(seconds)
    return seconds


@pytest.mark.slow
def test_spmd_timeout_bounds_the_whole_run(backend):
    run = px.spmd(sleep_then_return, procs_per_node=2, timeout=1, backend=backend,
                  echo_output=False)
    started = time.monotonic()
    with pytest.raises(CallTimeout):
        run(60)
    assert time.monotonic() - started < 20  # start, the 1 s call and the teardown


def test_classes_defined_in_main_work(backend, tmp_path):
    script = helpers.write_script(tmp_path, f"""
        import json
        import phalanx as px

        class Counter:
            def __init__(self, start):
                self.n = start

            def bump(self, by):
                self.n += by
                return self.n

        if __name__ == "__main__":
            with px.WorkerGroup(Counter, args=(40,), procs_per_node=2,
                                backend={backend!r}) as group:
                print(json.dumps(group.call("bump", 2)))
    """)
    done = helpers.run_script(script)
    assert done.returncode == 0, done.stderr
    assert helpers.json_lines(done.stdout) == [[42, 42]]


@pytest.mark.parametrize("ending", ["return normally", "raise"])
def test_interpreter_exit_shuts_the_group_down(backend, tmp_path, ending):
    script = helpers.write_script(tmp_path, f"""
        import json
        import phalanx as px

        class Worker:
            def pid(self):
                import os
                return os.getpid()

        group = px.WorkerGroup(Worker, procs_per_node=3, backend={backend!r})
        print(json.dumps(group.call("pid")), flush=True)
        if {ending == "raise"!r}:
            raise RuntimeError("the script crashed without calling shutdown")
    """)
    started = time.monotonic()
    done = helpers.run_script(script)
    assert time.monotonic() - started < 20
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr
    (pids,) = helpers.json_lines(done.stdout)
    assert helpers.wait_dead(pids, 2), "workers outlived their controller"
