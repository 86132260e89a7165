"""examples/grpo.py runs as a user runs it: three tensor-parallel generator replicas'
rollouts (``px.keep``) re-cut for two trainers (``px.chunk``), the weights pushed back by
parts (``px.weight_sync``, trainers' rows to generators' columns); the policy learns and every
generator rank holds exactly its columns of the trainers' weights after every step (the
example exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("torch", reason="the example trains with torch (pip install torch==2.13.0)")


def test_grpo_example_learns_with_tensor_parallel_generators_fed_by_parts():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "grpo.py"), "--steps", "20"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 trainers and 3 generators (2 ranks each, tensor-parallel) ready" in done.stdout
    assert "rows [384, 384]" in done.stdout  # 3 x 256 rows cut in two, straight to them
    # each generator rank received half the weight's columns (4 x 4 float32) and the bias
    # (4): 80 bytes of the policy's 144
    assert "bytes per generator rank [80]" in done.stdout, done.stdout[-1500:]
    first, last = (float(x) for x in
                   done.stdout.split("mean reward ")[-1].split(" (chance")[0].split(" -> "))
    assert last > first and last > 0.4, done.stdout[-1500:]
