"""``phalanx run --hosts``: the script on every rank of every agent's node, from one
terminal, with the same prefixed output, root-cause report and exit status as locally
(three agents on 127.0.0.2-4, see tests/agentcluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import helpers

SHOW = """\
import os
import sys
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} node {os.environ['NODE_RANK']}"
      f" master {os.environ['MASTER_ADDR']}", flush=True)
if sys.argv[1:] == [os.environ["RANK"]]:  # the rank told to fail
    raise ValueError("the shard is empty")
"""


def phalanx_run(directory, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args], cwd=directory,
                          env={**helpers.script_env(), **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def script(tmp_path):
    (tmp_path / "show.py").write_text(SHOW)
    (tmp_path / "sub").mkdir()
    return tmp_path


def test_every_rank_of_every_agent_runs_the_script(agent_cluster, script):
    result = phalanx_run(script, "--hosts", ",".join(agent_cluster.hosts), "--token-file",
                         agent_cluster.token_file, "-n", "2", "show.py")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if " of 6 " in line)
    assert lines == [f"[rank {r}] rank {r} of 6 node {r // 2} master 127.0.0.2"
                     for r in range(6)]


def test_a_failing_rank_on_an_agent_is_the_root_cause(agent_cluster, script):
    result = phalanx_run(script, "--hosts", ",".join(agent_cluster.hosts[:2]), "-n", "2",
                         "show.py", "3", PHALANX_TOKEN=agent_cluster.token)
    assert result.returncode == 1, result.stderr
    assert "root cause: rank 3 (node 1, pid" in result.stderr
    assert "raised ValueError: the shard is empty" in result.stderr
    assert 'show.py", line 6, in <module>' in result.stderr


def test_nodes_takes_the_first_agents(agent_cluster, script):
    result = phalanx_run(script, "--hosts", ",".join(agent_cluster.hosts), "--nodes", "1",
                         "show.py", PHALANX_TOKEN=agent_cluster.token)
    assert result.returncode == 0, result.stderr
    assert "[rank 0] rank 0 of 1 node 0 master 127.0.0.2" in result.stdout


def test_sync_ships_the_script_and_the_ranks_run_the_shipped_copy(agent_cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper.py").write_text("ANSWER = 42\n")
    (code / "job.py").write_text(
        "import os\nimport helper\n"
        "print('answer', helper.ANSWER, 'in', os.path.basename(os.path.dirname("
        "os.path.dirname(helper.__file__))), 'version', os.environ['PHALANX_CODE_VERSION'],"
        " flush=True)\n")
    result = phalanx_run(tmp_path, "--hosts", ",".join(agent_cluster.hosts[:2]),
                         "--no-collapse", "--sync", "code", "code/job.py",
                         PHALANX_TOKEN=agent_cluster.token)
    assert result.returncode == 0, result.stderr
    from phalanx.backends.cluster.codesync import scan

    version = scan(code)[0]
    assert sorted(line for line in result.stdout.splitlines() if "answer" in line) == [
        f"[rank {r}] answer 42 in trees version {version}" for r in range(2)]


@pytest.mark.parametrize(("args", "message"), [
    (["--hosts", "127.0.0.2"], "hosts entries must be 'host:port', got '127.0.0.2'"),
    (["--backend", "cluster"], "--backend cluster needs --hosts H:P,..."),
    (["--hosts", "127.0.0.2:1", "--backend", "ray"], "--hosts names phalanx agents"),
    (["--token-file", "token"], "--token-file is the agents' token: use it with --hosts"),
    (["--hosts", "127.0.0.2:1", "--nnodes", "2"], "one launcher drives every node"),
    (["--sync", "."], "--sync ships code to the agents: use it with --hosts"),
    (["--hosts", "127.0.0.2:1", "--sync", "nowhere"], "--sync 'nowhere' is not a directory"),
    (["--hosts", "127.0.0.2:1", "--sync", "sub"], "--sync 'sub' does not hold the script"),
])
def test_bad_cluster_options_are_refused_before_anything_starts(script, args, message):
    result = phalanx_run(script, *args, "show.py", PHALANX_TOKEN="x" * 32)
    assert result.returncode == 2
    assert message in result.stderr


def test_no_token_is_a_usage_error_naming_the_ways_to_give_one(script):
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_TOKEN"}
    result = subprocess.run([sys.executable, "-m", "phalanx", "run", "--hosts", "127.0.0.2:9",
                             "show.py"], cwd=script, env={**env, **{
                                 k: v for k, v in helpers.script_env().items()
                                 if k != "PHALANX_TOKEN"}},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--hosts needs the agents' token: --token-file FILE or $PHALANX_TOKEN" in \
        result.stderr
