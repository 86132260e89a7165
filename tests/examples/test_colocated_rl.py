"""examples/colocated_rl.py runs as a user runs it: two colocated groups on one pool learn
the bandit, and the generators hold the trainers' weights after every step (the example
exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import REPO, make_venv

pytest.importorskip("torch", reason="the example trains with torch (pip install torch==2.13.0)")


def _run(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "colocated_rl.py"), "--steps", "20",
         *options], capture_output=True, text=True, timeout=180, cwd=REPO)


def test_colocated_rl_example_learns_with_the_generators_in_their_own_interpreter(tmp_path):
    """The generators run a second venv with phalanx installed into it (as an editable
    install does: a ``.pth`` naming the repository and this venv's packages); without
    ``--python`` they would run this interpreter, the path every other test takes."""
    python = make_venv(tmp_path / "gen-env", str(REPO), sysconfig.get_paths()["purelib"])
    done = _run("--python", python)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "policy and generators ready" in done.stdout
    first, last = (float(x) for x in
                   done.stdout.split("mean reward ")[-1].split(" (chance")[0].split(" -> "))
    assert last > first and last > 0.4, done.stdout[-1500:]
