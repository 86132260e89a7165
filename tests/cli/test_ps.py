"""``phalanx ps``: which backend it asks is one flag, said clearly when two are given or a
flag lacks its partner, and a Slurm job that is not there is one line naming it, not a
traceback. (Listing the groups of agents, of a Slurm job and of a Ray cluster is tested
with them: tests/faults/test_detached_groups.py, tests/slurm, tests/backends.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


def _ps(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", "ps", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "said"), [
    (["--hosts", "127.0.0.1:1", "--ray", "auto"], "--hosts and --ray name two backends"),
    (["--slurm-job", "1", "--ray", "auto"], "--slurm-job and --ray name two backends"),
    (["--state-dir", "/tmp"], "--state-dir goes with --slurm-job"),
    (["--namespace", "x"], "--namespace goes with --ray"),
])
def test_flags_that_do_not_go_together_are_refused_saying_why(args, said):
    done = _ps(*args)
    assert done.returncode != 0
    assert said in done.stderr and "Traceback" not in done.stderr


def test_a_slurm_job_that_is_not_there_is_one_line_naming_it(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    done = _ps("--slurm-job", "987654", "--state-dir", str(state))
    assert done.returncode == 1
    assert "phalanx ps: slurm job 987654" in done.stderr
    assert "Traceback" not in done.stderr
