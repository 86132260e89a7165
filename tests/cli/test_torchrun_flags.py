"""torchrun's command line, given to ``phalanx run``: both spellings of every flag, the
``PET_*`` environment defaults, flags without an effect here accepted with a notice, and
the ones with a meaning honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import helpers

SHOW = """\
import json, os
names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "ROLE_NAME")
with open(f"env-{os.environ['RANK']}.json", "w") as f:
    json.dump({k: os.environ.get(k) for k in names}, f)
print("hello from", os.environ["RANK"])
"""


def phalanx_run(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PHALANX_PROGRESS": "0", **env}
    environ["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args], cwd=directory,
                          env=environ, capture_output=True, text=True, timeout=120)


def envs(directory: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in directory.glob("env-*.json")]
    return sorted(found, key=lambda e: int(e["RANK"]))


@pytest.fixture
def show(tmp_path):
    (tmp_path / "show.py").write_text(SHOW)
    return tmp_path


@pytest.mark.parametrize("spelling", [["--nproc-per-node", "2"], ["--nproc_per_node", "2"],
                                      ["--nproc_per_node=2"], ["-n", "2"]])
def test_both_spellings_of_a_flag_mean_the_same(show, spelling):
    result = phalanx_run(show, *spelling, "show.py")
    assert result.returncode == 0, result.stderr
    assert [e["WORLD_SIZE"] for e in envs(show)] == ["2", "2"]


def test_pet_variables_are_the_defaults_of_their_flags(show):
    result = phalanx_run(show, "show.py", PET_NPROC_PER_NODE="2", PET_RDZV_ID="job-7",
                         PET_ROLE="trainer")
    assert result.returncode == 0, result.stderr
    assert [(e["WORLD_SIZE"], e["TORCHELASTIC_RUN_ID"], e["ROLE_NAME"]) for e in envs(show)] \
        == [("2", "job-7", "trainer")] * 2


def test_a_flag_given_on_the_command_line_wins_over_its_pet_variable(show):
    result = phalanx_run(show, "--nproc_per_node", "1", "show.py", PET_NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stderr
    assert len(envs(show)) == 1


def test_flags_without_an_effect_here_are_accepted_with_one_notice_each(show):
    result = phalanx_run(show, "--monitor_interval", "5", "--start-method", "spawn",
                         "--standalone", "--rdzv-backend", "c10d", "--rdzv_endpoint",
                         "localhost:0", "-r", "3", "--tee", "3", "--numa-binding", "node",
                         "--max_restarts", "0", "--log_dir", str(show / "logs"),
                         "--nproc-per-node", "2", "show.py")
    assert result.returncode == 0, result.stderr
    for flag in ("--monitor-interval", "--start-method", "--redirects", "--tee",
                 "--numa-binding"):
        assert result.stderr.count(f"phalanx run: {flag} has no effect here") == 1, \
            result.stderr
    assert (show / "logs" / "rank-1.stdout.log").read_text() == "hello from 1\n"


def test_the_rendezvous_id_is_the_run_id(show):
    result = phalanx_run(show, "--rdzv-id", "exp-42", "-n", "2", "show.py")
    assert result.returncode == 0, result.stderr
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs(show)} == {"exp-42"}


def test_one_process_per_core_with_cpu(show):
    result = phalanx_run(show, "--nproc-per-node", "cpu", "show.py")
    assert result.returncode == 0, result.stderr
    assert len(envs(show)) == os.cpu_count()


def test_the_local_ranks_filter_shows_only_those_ranks(show):
    result = phalanx_run(show, "-n", "2", "--local-ranks-filter", "1", "show.py")
    assert result.returncode == 0, result.stderr
    assert "hello from 1" in result.stdout and "hello from 0" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not supported: use static or c10d"),
     (["--nnodes", "2:3"], "--nnodes 2:3 needs --rdzv-backend c10d"),
     (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside 0..1 (--nnodes 2)"),
     (["--nnodes", "2", "--rdzv-backend", "c10d"], "c10d with several nodes needs "
                                                    "--rdzv-endpoint HOST:PORT"),
     (["--nnodes", "2", "--backend", "ray"], "with --backend ray or --hosts one launcher"),
     (["--nnodes", "2", "--nodes", "2"], "--nodes (several in one launcher) must be 1"),
     (["--nnodes", "2", "--standalone"], "--standalone is for one node"),
     (["--nnodes", "2", "--framework", "jax"], "--framework jax needs one controller"),
     (["--nnodes", "2", "--rdzv-conf", "join_timeout=x"], "join_timeout expects seconds"),
     (["--nnodes", "2", "--master-port", "70000"], "port"),
     (["--nnodes", "3:2"], "--nnodes expects N or MIN:MAX with 1 <= MIN <= MAX"),
     (["--node-rank", "1"], "--node-rank 1: with one node it must be 0"),
     (["--no-python", "no-such-command-xyz"], "no executable command 'no-such-command-xyz'")],
)
def test_flags_phalanx_cannot_honour_are_refused_before_anything_starts(show, args, message):
    target = [] if "--no-python" in args else ["show.py"]
    result = phalanx_run(show, *args, *target)
    assert result.returncode == 2
    assert message in result.stderr
    assert not envs(show)


def test_no_python_runs_a_command_on_every_rank_with_its_variables(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE"\nexit "$1"\n')
    script.chmod(0o755)
    result = phalanx_run(tmp_path, "-n", "2", "--no_python", "./job.sh", "0")
    assert result.returncode == 0, result.stderr
    assert "shell rank 0 of 2" in result.stdout and "shell rank 1 of 2" in result.stdout
    failed = phalanx_run(tmp_path, "-n", "1", "--no-python", "--exit-code", "rank", "./job.sh",
                         "3")
    assert failed.returncode == 3
    assert "root cause: rank 0" in failed.stderr


def test_run_path_takes_precedence_over_no_python(show):
    result = phalanx_run(show, "--run-path", "--no-python", "show.py")
    assert result.returncode == 0, result.stderr
    assert len(envs(show)) == 1


def test_the_master_address_and_port_given_are_the_ranks_rendezvous(tmp_path):
    helpers.requires("torch")
    from phalanx.node.machine import pick_free_ports

    (port,) = pick_free_ports("127.0.0.1", 1)
    (tmp_path / "reduce.py").write_text(textwrap.dedent("""\
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        print("sum", int(total.item()), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    """))
    result = phalanx_run(tmp_path, "--nproc_per_node", "2", "--master_addr", "localhost",
                         "--master-port", str(port), "reduce.py")
    assert result.returncode == 0, result.stderr
    assert f"sum 2 localhost {port}" in result.stdout


def test_a_bad_master_port_is_refused_before_anything_starts(show):
    result = phalanx_run(show, "--master-port", "70000", "show.py")
    assert result.returncode == 2
    assert "master_port must be a port number (1-65535), got 70000" in result.stderr
    assert not envs(show)
