"""``preload=``: ranks forked from the modules their node's supervisor imported once, on the
local backend and on agents, behave as the fresh interpreters they replace.

What a user relies on, checked against a group whose ranks start fresh (``preload=False``)
where it matters:

- a preloaded module is loaded before the target's module is imported, and only then;
- the target's module is imported with the rank's environment set (``RANK``, the user's
  variables), ``sys.argv`` and ``__main__`` as ``python -c`` has them;
- each rank has its own random state (Python's, and numpy's global one when preloaded);
- ``sys.exit(3)`` ends the rank with code 3; ``atexit`` handlers run at a normal shutdown;
- a line printed without flushing reaches the controller while the rank runs on;
- writing to a closed pipe raises ``BrokenPipeError`` (the interpreter ignores SIGPIPE);
- torch's thread count is a fresh interpreter's, and its thread pool works in every rank.

Where a fork cannot be had -- a preloaded module started a thread, a rank's ``PYTHONPATH``
is not the node's, a preloaded file changed -- the group still starts, its ranks fresh, and
the node side says why once (local backend: the agents log on their own side). A bad
``preload=`` is refused before anything starts.

The target is tests/preloadtarget.py, a module of the user's own: each rank imports it
itself, and it records what it found at its import.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import pytest

import phalanx as px
from phalanx.node import supervisor
from tests import helpers
from tests.conftest import BACKENDS
from tests.preloadtarget import Rank, TorchRank

WORLD = 2
USER_ENV = {"PRELOAD_USER_VAR": "given"}
NOTE = "ranks start without their preloaded modules"


@pytest.fixture(scope="module", params=[b for b in ("local", "cluster") if b in BACKENDS])
def where(request):
    if request.param == "cluster":
        return request.getfixturevalue("agent_cluster").backend()
    return "local"


def _group(where, target=Rank, **kwargs) -> px.WorkerGroup:
    kwargs.setdefault("procs_per_node", WORLD)
    return px.WorkerGroup(target, backend=where, echo_output=False, **kwargs)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("preload-logs")


@pytest.fixture(scope="module")
def default(where, logs):
    """Ranks forked from what is preloaded by default (the rank runtime: the target's
    module imports no installed package), their output kept in ``logs``."""
    with helpers.long_lived_group(Rank, procs_per_node=WORLD, backend=where, env=USER_ENV,
                                  echo_output=False, log_dir=logs) as group:
        yield group


@pytest.fixture(scope="module")
def listed(where):
    """Ranks forked after ``decimal`` (and numpy, if installed) were preloaded."""
    modules = ["decimal", "numpy"] if helpers.installed("numpy") else ["decimal"]
    with helpers.long_lived_group(Rank, procs_per_node=WORLD, backend=where, env=USER_ENV,
                                  echo_output=False, preload=modules) as group:
        yield group


@pytest.fixture(scope="module")
def fresh(where):
    """Ranks started as fresh interpreters: the baseline."""
    with helpers.long_lived_group(Rank, procs_per_node=WORLD, backend=where, env=USER_ENV,
                                  echo_output=False, preload=False) as group:
        yield group


def _forked(command_line: list[str]) -> bool:
    """A rank forked from its supervisor keeps the supervisor's command line; a fresh
    interpreter's runs the rank runtime."""
    return any("phalanx.node.keeper" in part for part in command_line)


def test_a_preloaded_module_is_there_before_the_target_module_is_imported(listed, where):
    assert [seen["decimal"] for seen in listed.call("at_import")] == [True] * WORLD
    assert all(_forked(line) for line in listed.call("command_line"))
    if where == "local":  # its parent is its keeper, forked by the node's supervisor
        keepers = {psutil.Process(pid).ppid() for pid in listed.call("pid")}
        assert {psutil.Process(k).ppid() for k in keepers} == {listed._backend.supervisor_pid}
        assert len(keepers) == WORLD


def test_a_fresh_interpreter_has_not_imported_it(fresh):
    assert [seen["decimal"] for seen in fresh.call("at_import")] == [False] * WORLD
    assert not any(_forked(line) for line in fresh.call("command_line"))


def test_the_target_module_is_imported_with_the_ranks_environment_argv_and_main(default, fresh):
    seen = default.call("at_import")
    assert all(_forked(line) for line in default.call("command_line"))
    assert [s["env"] for s in seen] == [
        {"RANK": str(rank), "WORLD_SIZE": str(WORLD), **USER_ENV} for rank in range(WORLD)]
    assert [(s["argv"], s["main_name"]) for s in seen] == [(["-c"], "__main__")] * WORLD
    assert [{k: s[k] for k in ("env", "argv", "main_name")} for s in seen] == [
        {k: s[k] for k in ("env", "argv", "main_name")} for s in fresh.call("at_import")]


def test_each_rank_has_its_own_python_random_state(default, listed):
    for group in (default, listed):
        values = group.call("python_random")
        assert len(set(values)) == WORLD, values


@helpers.needs("numpy")
def test_each_rank_has_its_own_numpy_random_state_when_numpy_is_preloaded(listed):
    assert [seen["numpy"] for seen in listed.call("at_import")] == [True] * WORLD
    values = listed.call("numpy_random")
    assert len(set(values)) == WORLD, values


def test_sys_exit_in_a_method_ends_the_rank_with_its_code(where):
    with _group(where, procs_per_node=1) as group:
        assert _forked(group.call_one(0, "command_line"))
        with pytest.raises(px.WorkerDied) as info:
            group.call_one(0, "exit_with", 3, timeout=30)
        assert (info.value.rank, info.value.exitcode) == (0, 3)


def test_atexit_handlers_run_at_a_normal_shutdown(where, tmp_path):
    files = [tmp_path / f"exited-{rank}" for rank in range(WORLD)]
    group = _group(where)
    try:
        assert all(_forked(line) for line in group.call("command_line"))
        group.map("at_exit_write", path=[str(f) for f in files])
        assert not any(f.exists() for f in files)
    finally:
        group.shutdown()
    assert [f.read_text() for f in files] == [f"rank {r} exited\n" for r in range(WORLD)]


def test_a_line_printed_without_flushing_reaches_the_controller_while_the_rank_runs(
        default, logs, tmp_path):
    log = logs / "rank-0.stdout.log"
    flag = tmp_path / "seen"
    call = default.call_async("print_until", "unflushed line", str(flag), workers=[0])
    try:
        arrived = helpers.wait_until(
            lambda: log.exists() and "unflushed line" in log.read_text().splitlines(), 20)
    finally:
        flag.touch()  # the rank returns either way
    assert call.result(timeout=30) == [True]  # it was still in the call, waiting
    assert arrived, "the line did not reach the controller while the rank ran"


def test_writing_to_a_closed_pipe_raises_broken_pipe_as_in_a_fresh_interpreter(where, fresh):
    assert fresh.call("write_to_a_closed_pipe", timeout=30) == ["BrokenPipeError"] * WORLD
    with _group(where, procs_per_node=1) as group:
        assert _forked(group.call_one(0, "command_line"))
        assert group.call_one(0, "write_to_a_closed_pipe", timeout=30) == "BrokenPipeError"


@pytest.mark.parametrize(("preload", "error"), [
    ("numpy", TypeError), (3, TypeError), ({"numpy": True}, TypeError),
    (["1abc"], ValueError), (["numpy", "a..b"], ValueError), ([""], ValueError),
])
def test_a_bad_preload_is_refused_before_anything_starts(where, preload, error):
    with pytest.raises(error, match="preload") as info:
        _group(where, preload=preload)
    named = preload if isinstance(preload, (str, int, dict)) else preload[-1]
    assert repr(named) in str(info.value)
    assert helpers.stray_children() == []


# -- falling back to fresh interpreters (the local backend, whose node side logs here) ----


@pytest.fixture
def notes(caplog, monkeypatch):
    """The node side's notes of why ranks start fresh, from this test alone (each reason
    is said once per process: what an earlier test said is forgotten first)."""
    monkeypatch.setattr(supervisor, "_noted", set())
    caplog.set_level(logging.WARNING, logger=supervisor.logger.name)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == supervisor.logger.name and NOTE in r.getMessage()]

    return said


def _said_once(notes, within: float = 10.0) -> str:
    """The one note said (the keepers report it as their ranks start)."""
    assert helpers.wait_until(lambda: len(notes()) > 0, within), "no reason was logged"
    said = notes()
    assert len(said) == 1, said
    return said[0]


@pytest.mark.skipif("local" not in BACKENDS, reason="the local backend is not under test")
def test_a_module_that_starts_a_thread_on_import_makes_ranks_start_fresh(notes):
    with _group("local", preload=["tests.preloadthread"]) as group:
        assert not any(_forked(line) for line in group.call("command_line"))
        assert [s["env"]["RANK"] for s in group.call("at_import")] == ["0", "1"]
        note = _said_once(notes)
    assert "thread" in note and "tests.preloadthread" in note, note


@pytest.mark.skipif("local" not in BACKENDS, reason="the local backend is not under test")
def test_a_rank_whose_pythonpath_differs_from_the_nodes_starts_fresh(notes, tmp_path):
    with _group("local", rank_env={1: {"PYTHONPATH": str(tmp_path)}}) as group:
        forked = [_forked(line) for line in group.call("command_line")]
        assert forked == [True, False]
        assert str(tmp_path) in group.call_one(1, "sys_path")  # its PYTHONPATH was read
        note = _said_once(notes)
    assert "PYTHONPATH" in note, note


def test_recreated_and_restarted_ranks_are_forked_from_the_preload_too(where):
    # a recreate (one rank) and a restart (every rank) start ranks as the group did:
    # forked, the preloaded module there before the target's import
    with _group(where, preload=["decimal"]) as group:
        group.recreate(1)
        assert _forked(group.call_one(1, "command_line"))
        assert group.call_one(1, "at_import")["decimal"]
        group.restart()
        assert all(_forked(line) for line in group.call("command_line"))
        assert all(found["decimal"] for found in group.call("at_import"))


@pytest.mark.skipif("local" not in BACKENDS, reason="the local backend is not under test")
def test_a_preloaded_module_whose_file_changed_makes_later_ranks_start_fresh(
        notes, tmp_path, monkeypatch):
    module = tmp_path / "preloadchanging.py"
    module.write_text("VERSION = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # on the preload path the ranks get
    with _group("local", preload=["preloadchanging"]) as group:
        assert all(_forked(line) for line in group.call("command_line"))
        assert notes() == []
        when = module.stat().st_mtime + 5
        os.utime(module, (when, when))
        group.recreate(0)
        assert not _forked(group.call_one(0, "command_line"))
        assert group.call("at_import")[0]["env"]["RANK"] == "0"  # the recreated rank runs
        note = _said_once(notes)
    assert str(module) in note and "changed" in note, note


# -- torch ---------------------------------------------------------------------------------


def _threads_given() -> list[dict[str, str]]:
    """Each rank's OMP_NUM_THREADS: none, one, and more than the CPUs it may run on."""
    return [{}, {"OMP_NUM_THREADS": "1"},
            {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)) + 1)}]


@pytest.fixture(scope="module")
def torch_ranks(where):
    """Each rank's torch thread count in a fresh and in a preloaded ``framework="torch"``
    group (the ranks' variables as ``_threads_given``), and the preloaded group, running."""
    helpers.requires("torch")
    given = dict(enumerate(_threads_given()))
    with _group(where, TorchRank, procs_per_node=len(given), framework="torch",
                rank_env=given, preload=False) as group:
        fresh_threads = group.call("threads", timeout=120)
    with helpers.long_lived_group(TorchRank, procs_per_node=len(given), framework="torch",
                                  backend=where, echo_output=False, rank_env=given) as group:
        yield fresh_threads, group.call("threads", timeout=120), group


def test_torch_has_a_fresh_interpreters_thread_count(torch_ranks):
    fresh_threads, preloaded_threads, _ = torch_ranks
    assert preloaded_threads[:2] == fresh_threads[:2]


def test_torch_thread_count_given_above_the_cpus_is_a_fresh_interpreters(torch_ranks):
    fresh_threads, preloaded_threads, _ = torch_ranks
    assert preloaded_threads[2] == fresh_threads[2]


def test_torch_runs_a_parallel_matmul_in_every_preloaded_rank(torch_ranks):
    _, _, group = torch_ranks
    # an OpenMP pool copied by a fork hangs the first parallel region: the timeout says so
    assert group.call("matmul", timeout=30) == [1000.0] * len(_threads_given())
