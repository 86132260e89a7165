"""``phalanx run --backend ray``: a script on every rank of a Ray cluster, driven from one
terminal, with the same prefixed output, report and exit statuses as on this machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests import helpers, raycluster

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    return ray_cluster


def phalanx_run(directory, *args: str) -> subprocess.CompletedProcess:
    env = {**helpers.script_env()}  # RAY_ADDRESS: the test cluster
    return subprocess.run([sys.executable, "-m", "phalanx", "run", "--backend", "ray", *args],
                          cwd=directory, env=env, capture_output=True, text=True, timeout=180)


def test_a_script_runs_on_every_rank_of_the_ray_cluster(tmp_path):
    (tmp_path / "where.py").write_text(textwrap.dedent("""\
        import os
        import psutil
        # the Ray node, read off its raylet's command line, independently of phalanx
        raylet = psutil.Process(int(os.environ["RAY_RAYLET_PID"])).cmdline()
        node_ip = next(a.split("=", 1)[1] for a in raylet if a.startswith("--node_ip_address="))
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "node",
              os.environ["NODE_RANK"], "group", os.environ["GROUP_RANK"], "on", node_ip)
    """))
    result = phalanx_run(tmp_path, "--nodes", "2", "-n", "2", "where.py")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if " rank " in line)
    assert len(lines) == 4, result.stdout
    for rank in range(4):
        line = next(line for line in lines if line.startswith(f"[rank {rank}] "))
        node = rank // 2
        assert f"rank {rank} of 4 node {node} group {node} on " in line
        assert line.rsplit(" ", 1)[1] in raycluster.NODE_ADDRESSES
    ips = {line.rsplit(" ", 1)[1] for line in lines}
    assert len(ips) == 2  # two Ray nodes


def test_a_failing_rank_on_ray_is_the_root_cause_and_the_exit_status(tmp_path):
    (tmp_path / "fail.py").write_text(textwrap.dedent("""\
        import os, sys
        if os.environ["RANK"] == "1":
            sys.exit(5)
    """))
    result = phalanx_run(tmp_path, "-n", "2", "--exit-code", "rank", "fail.py")
    assert result.returncode == 5, result.stderr
    assert "root cause: rank 1" in result.stderr
    assert "exited with code 5" in result.stderr


def test_an_address_without_the_ray_backend_is_refused(tmp_path):
    (tmp_path / "ok.py").write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "--address", "auto",
                             "ok.py"], cwd=tmp_path, env=helpers.script_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--address names a Ray cluster: use it with --backend ray" in result.stderr
