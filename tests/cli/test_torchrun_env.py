"""``phalanx run`` gives its ranks the variables torchrun gives its workers, so programs
written for torchrun (``is_torchelastic_launched()``, Lightning's ``GROUP_RANK``, torch's
``@record`` error files) cannot tell the difference. Compared against the real torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import helpers

PRINT_ENV = """\
import json, os
names = sorted(k for k in os.environ
               if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                        "ROLE_RANK", "ROLE_WORLD_SIZE", "OMP_NUM_THREADS")
               or k.startswith(("TORCHELASTIC_", "TORCH_NCCL_")))
with open(f"env-{os.environ['RANK']}.json", "w") as f:  # not stdout: torchrun's ranks
    json.dump({k: os.environ[k] for k in names}, f)      # share it unbuffered, unprefixed
open(f"touched-{os.environ['RANK']}", "w").close()
"""

# values that name this run rather than what it is (ports, ids, temporary paths), and the
# one torchrun sets because its agent hosts the store
DIFFERENT = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
             "TORCHELASTIC_USE_AGENT_STORE"}


def run(command: list[str], directory: Path,
        **extra_env: str) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PHALANX_PROGRESS": "0", **extra_env}
    env["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                          timeout=120)
    envs = [json.loads(path.read_text()) for path in directory.glob("env-*.json")]
    return done.returncode, sorted(envs, key=lambda e: int(e["RANK"])), done.stderr


def torchrun() -> list[str]:
    helpers.requires("torch")
    return [sys.executable, "-m", "torch.distributed.run"]


def phalanx_run() -> list[str]:
    return [sys.executable, "-m", "phalanx", "run"]


def test_the_same_variables_as_torchrun_with_the_same_values(tmp_path):
    ours, theirs = tmp_path / "phalanx", tmp_path / "torchrun"
    for directory in (ours, theirs):
        directory.mkdir()
        (directory / "show.py").write_text(PRINT_ENV)
    status, torch_envs, err = run([*torchrun(), "--nproc-per-node", "2", "show.py"], theirs)
    assert status == 0, err
    status, our_envs, err = run([*phalanx_run(), "-n", "2", "show.py"], ours)
    assert status == 0, err
    assert sorted(p.name for p in ours.glob("touched-*")) == ["touched-0", "touched-1"]
    assert len(our_envs) == len(torch_envs) == 2
    for mine, reference in zip(our_envs, torch_envs, strict=True):
        assert sorted(mine) == sorted(reference)
        same = {k: v for k, v in reference.items() if k not in DIFFERENT}
        assert {k: mine[k] for k in same} == same
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(f"/{mine['RANK']}/error.json")
    assert our_envs[0]["TORCHELASTIC_RUN_ID"] == our_envs[1]["TORCHELASTIC_RUN_ID"]


def run_nodes(launcher: list[str], directory: Path, nodes: int = 2,
              procs: int = 2) -> tuple[list[int], list[dict], str]:
    """``launcher --nnodes 2 --node-rank I ...`` once per node, at the same time, on this
    machine: every launcher's status, the ranks' variables, the launchers' stderr."""
    with socket.socket() as sock:  # a free port for the job's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PHALANX_PROGRESS": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), env.get("PYTHONPATH", "")])
    launchers = [subprocess.Popen(
        [*launcher, "--nnodes", str(nodes), "--node-rank", str(node), "--master-addr",
         "127.0.0.1", "--master-port", str(port), "--nproc-per-node", str(procs), "show.py"],
        cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for node in reversed(range(nodes))]
    try:
        errs = [launcher.communicate(timeout=120)[1] for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait()
    envs = [json.loads(path.read_text()) for path in directory.glob("env-*.json")]
    return ([launcher.returncode for launcher in launchers],
            sorted(envs, key=lambda e: int(e["RANK"])), "\n".join(errs))


def test_two_launchers_as_two_nodes_give_torchrun_s_variables(tmp_path):
    ours, theirs = tmp_path / "phalanx", tmp_path / "torchrun"
    for directory in (ours, theirs):
        directory.mkdir()
        (directory / "show.py").write_text(PRINT_ENV)
    statuses, torch_envs, err = run_nodes(torchrun(), theirs)
    assert statuses == [0, 0], err
    statuses, our_envs, err = run_nodes(phalanx_run(), ours)
    assert statuses == [0, 0], err
    assert sorted(p.name for p in ours.glob("touched-*")) == [f"touched-{r}" for r in range(4)]
    assert len(our_envs) == len(torch_envs) == 4
    for mine, reference in zip(our_envs, torch_envs, strict=True):
        assert sorted(mine) == sorted(reference)
        same = {k: v for k, v in reference.items() if k not in DIFFERENT}
        assert {k: mine[k] for k in same} == same  # GROUP_RANK, ROLE_RANK, LOCAL_RANK...
    assert len({e["TORCHELASTIC_RUN_ID"] for e in our_envs}) == 1  # one job
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in our_envs}) == 1


@pytest.mark.parametrize("ending", ["pass", "raise ValueError('no data')", "sys.exit(3)",
                                    "os._exit(4)"])
def test_the_exit_status_is_torchrun_s(tmp_path, ending):
    ours, theirs = tmp_path / "phalanx", tmp_path / "torchrun"
    for directory in (ours, theirs):
        directory.mkdir()
        (directory / "end.py").write_text(
            f"import os, sys\nif os.environ['RANK'] == '1':\n    {ending}\n")
    expected, _, err = run([*torchrun(), "--nproc-per-node", "2", "end.py"], theirs)
    status, _, err = run([*phalanx_run(), "--nproc-per-node", "2", "end.py"], ours)
    assert status == expected, err
    assert (status == 0) == (ending == "pass")


def test_a_program_sees_that_it_was_launched_by_torchelastic(tmp_path):
    helpers.requires("torch")
    (tmp_path / "check.py").write_text(textwrap.dedent("""\
        import torch.distributed as dist
        assert dist.is_torchelastic_launched()
    """))
    status, _, err = run([*phalanx_run(), "-n", "2", "check.py"], tmp_path)
    assert status == 0, err


def test_the_role_flag_names_the_role(tmp_path):
    (tmp_path / "show.py").write_text(PRINT_ENV)
    status, envs, err = run([*phalanx_run(), "-n", "2", "--role", "trainer", "show.py"],
                            tmp_path)
    assert status == 0, err
    assert [e["ROLE_NAME"] for e in envs] == ["trainer", "trainer"]


def test_what_a_rank_recorded_with_torch_record_is_in_the_report(tmp_path):
    helpers.requires("torch")
    (tmp_path / "recorded.py").write_text(textwrap.dedent("""\
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            with open(f"error-file-{os.environ['RANK']}", "w") as f:
                f.write(os.environ["TORCHELASTIC_ERROR_FILE"])
            if os.environ["RANK"] == "1":
                raise ValueError("the data shard is empty")

        try:
            main()
        except ValueError:
            os._exit(7)  # the error file is all that tells why
    """))
    temporary = tmp_path / "tmp"  # its own: other launchers may run beside this test
    temporary.mkdir()
    status, _, err = run([*phalanx_run(), "-n", "2", "recorded.py"], tmp_path,
                         TMPDIR=str(temporary))
    assert status == 1, err  # as torchrun
    assert "root cause: rank 1" in err
    assert "it recorded: ValueError: the data shard is empty" in err
    assert 'recorded.py", line 9, in main' in err  # the traceback torchrun would show
    error_file = Path((tmp_path / "error-file-1").read_text())
    assert temporary in error_file.parents
    assert list(temporary.iterdir()) == []  # its error files are cleaned up


@pytest.mark.parametrize("restarts", [0, 2])
def test_the_restart_budget_is_in_torchelastic_max_restarts(tmp_path, restarts):
    (tmp_path / "show.py").write_text(PRINT_ENV)
    status, envs, err = run([*phalanx_run(), "-n", "1", "--max-restarts", str(restarts),
                             "show.py"], tmp_path)
    assert status == 0, err
    assert envs[0]["TORCHELASTIC_MAX_RESTARTS"] == str(restarts)
    assert envs[0]["TORCHELASTIC_RESTART_COUNT"] == "0"
