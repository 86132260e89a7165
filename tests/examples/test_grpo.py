"""examples/grpo.py runs as a user runs it: three generators' rollouts (``px.keep``) re-cut
for two trainers (``px.chunk``), the weights pushed back (``px.weight_sync``); the policy
learns and the generators hold the trainers' weights after every step (the example exits
non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("torch", reason="the example trains with torch (pip install torch==2.13.0)")


def test_grpo_example_learns_with_more_generators_than_trainers():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "grpo.py"), "--steps", "20"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 trainers and 3 generators ready" in done.stdout
    assert "rows [384, 384]" in done.stdout  # 3 x 256 rows cut in two, straight to them
    first, last = (float(x) for x in
                   done.stdout.split("mean reward ")[-1].split(" (chance")[0].split(" -> "))
    assert last > first and last > 0.4, done.stdout[-1500:]
