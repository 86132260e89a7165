"""``WorkerGroup(python=...)``: the ranks of a group run an interpreter of its own, on every
backend, and import phalanx from that interpreter's environment."""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from phalanx import StartupError, WorkerGroup
from tests import helpers
from tests.workers import Probe

_REPO = Path(__file__).resolve().parents[2]


class Interpreter:
    """What a rank sees of the interpreter it runs."""

    def where(self) -> tuple[str, str, str]:
        import phalanx

        return sys.executable, sys.prefix, os.path.dirname(os.path.abspath(phalanx.__file__))


@pytest.fixture(scope="session")
def venvs(tmp_path_factory):
    """Three venvs: ``with_phalanx`` has phalanx installed into it (the way an editable
    install does: a ``.pth`` naming the repository, and this venv's packages for what
    phalanx and the tests import), ``without`` has the packages but no phalanx, ``other``
    a copy of phalanx that says it is another release."""
    root = tmp_path_factory.mktemp("venvs")
    packages = sysconfig.get_paths()["purelib"]
    release = root / "release"
    shutil.copytree(_REPO / "phalanx", release / "phalanx",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = release / "phalanx" / "version.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', '__version__ = "99.0"', init.read_text()))
    return {"with_phalanx": helpers.make_venv(root / "with", str(_REPO), packages),
            "without": helpers.make_venv(root / "without", packages),
            "other": helpers.make_venv(root / "other", str(release), str(_REPO), packages)}


def test_ranks_run_the_given_interpreter(backend, venvs, make_group):
    python = venvs["with_phalanx"]
    group = make_group(Interpreter, procs_per_node=2, python=python)
    for executable, prefix, package in group.call("where"):
        assert executable == python
        assert Path(prefix) == Path(python).parent.parent
        assert Path(package) == _REPO / "phalanx"


def test_groups_with_different_interpreters_run_side_by_side(backend, venvs, make_group):
    python = venvs["with_phalanx"]
    own = make_group(Interpreter, python=python)
    default = make_group(Interpreter)
    assert [where[0] for where in own.call("where")] == [python]
    assert [where[1] for where in default.call("where")] == [sys.prefix]
    assert own.call("where")[0][0] == python  # both still serve


def test_an_interpreter_without_phalanx_fails_the_start_at_once(backend, venvs, tmp_path):
    python = venvs["without"]
    if backend == "ray":
        pytest.skip("every worker of the test Ray cluster finds phalanx in the repository "
                    "(its job's PYTHONPATH)")
    began = time.monotonic()
    with pytest.raises(StartupError) as info:
        # cwd and PYTHONPATH: not the repository (the test agents set it), where phalanx is
        WorkerGroup(Probe, python=python, backend=backend, echo_output=False,
                    cwd=str(tmp_path), env={"PYTHONPATH": ""}, start_timeout=60)
    took = time.monotonic() - began
    message = str(info.value)
    assert python in message, message
    assert "No module named 'phalanx'" in message, message
    assert took < 20, f"the failure took {took:.1f} s"


def test_an_interpreter_with_another_phalanx_release_is_refused(backend, venvs, tmp_path):
    python = venvs["other"]
    if backend == "ray":
        pytest.skip("every worker of the test Ray cluster finds phalanx in the repository "
                    "(its job's PYTHONPATH)")
    with pytest.raises(StartupError) as info:
        WorkerGroup(Probe, python=python, backend=backend, echo_output=False,
                    cwd=str(tmp_path), env={"PYTHONPATH": ""}, start_timeout=60)
    message = str(info.value)
    assert python in message and "phalanx 99.0" in message, message


def test_a_missing_interpreter_is_a_value_error_before_anything_runs(backend, tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(ValueError, match="no such interpreter") as info:
        WorkerGroup(Probe, python=missing, backend=backend, echo_output=False)
    assert missing in str(info.value)
    assert not helpers.stray_children() or helpers.wait_until(
        lambda: not helpers.stray_children(), 3)


def test_a_file_that_is_no_interpreter_is_refused(backend, tmp_path):
    script = tmp_path / "python"
    script.write_text("not a program\n")
    with pytest.raises(ValueError, match="not executable"):
        WorkerGroup(Probe, python=str(script), backend=backend, echo_output=False)


def test_python_must_be_a_path():
    with pytest.raises(TypeError, match="python must be the path"):
        WorkerGroup(Probe, python=3)


def test_a_launch_bounds_the_interpreter_it_names():
    from phalanx.backends.cluster import messages

    def launch(python):
        messages.check_request(messages.LAUNCH, ([], [], {"python": python}, None), [])

    launch("/usr/bin/python3")
    for bad, error in (("python3", messages.Malformed), (3, messages.Malformed),
                       ("/bin/py\0thon", messages.Malformed),
                       ("/" + "x" * 5000, messages.OverLimit)):
        with pytest.raises(error):
            launch(bad)


def test_a_node_side_tells_what_keeps_an_interpreter_from_running_ranks(venvs, tmp_path,
                                                                        monkeypatch):
    """What a Ray node checks before its actors run ``python=`` (a Ray worker that cannot
    start is retried, not reported)."""
    from phalanx import __version__
    from phalanx.node.machine import interpreter_problem

    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert interpreter_problem(venvs["with_phalanx"], __version__, "here") is None
    kind, why = interpreter_problem(str(tmp_path / "python"), __version__, "here")
    assert kind == "missing" and "no such interpreter on here" in why
    kind, why = interpreter_problem(venvs["without"], __version__, "here")
    assert kind == "unusable" and venvs["without"] in why and "No module named" in why
    kind, why = interpreter_problem(venvs["other"], __version__, "here")
    assert kind == "unusable" and "runs phalanx 99.0" in why
    # what a rank's Ray actor needs besides phalanx: Ray itself, of the controller's release
    python = venvs["with_phalanx"]
    kind, why = interpreter_problem(python, __version__, "here", {"no_such_package": "1.0"})
    assert kind == "unusable" and f"{python} (python=) on here has no no_such_package" in why
    kind, why = interpreter_problem(python, __version__, "here", {"numpy": "0.0.1"})
    assert kind == "unusable" and "but the controller runs numpy 0.0.1" in why
