"""The cluster's token stays with its agents: a rank started by an agent never sees
``$PHALANX_TOKEN`` nor the token file's path (in its environment, its arguments, or those
of the processes between it and the agent), and a token file anyone but its owner could
read or write is refused by both sides, with the fix in the message.

Agents here are real ``phalanx agent`` processes of this test's own on 127.0.0.5 and
127.0.0.6, stopped when the test ends.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import psutil
import pytest

import phalanx as px
from phalanx.backends.cluster import token as cluster_token
from tests import helpers
from tests.agentcluster import free_port, listening, terminate

START_TIMEOUT = 20.0


class Snoop:
    """What a rank can see of itself and of the processes above it, up to its agent."""

    def __init__(self, agent_pid: int) -> None:
        self.agent_pid = agent_pid

    def seen(self) -> dict:
        own = psutil.Process()
        found = {"environ": dict(os.environ), "argv": list(sys.argv),
                 "cmdline": own.cmdline(), "above": []}
        for parent in own.parents():
            if parent.pid == self.agent_pid:
                break
            try:
                found["above"].append({"pid": parent.pid, "environ": parent.environ(),
                                       "cmdline": parent.cmdline()})
            except psutil.Error:
                pass
        return found


def agent_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PHALANX_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


@pytest.fixture
def agent():
    """``agent(host, *flags, env=...)``: a ``phalanx agent`` on ``host``, its address
    returned; stopped when the test ends."""
    procs: list[subprocess.Popen] = []

    def start(host: str, *flags: str, env: dict[str, str]) -> tuple[str, int]:
        port = free_port(host)
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
             "--no-http", "--heartbeat-timeout", "10", *flags],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL)
        procs.append(proc)
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(host, port),
                                  START_TIMEOUT, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        return f"{host}:{port}", proc.pid

    try:
        yield start
    finally:
        terminate(procs)


def private_file(path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def assert_nowhere(seen: dict, *secrets_: str) -> None:
    places = [("the rank's environment", "\n".join(f"{k}={v}" for k, v in
                                                 seen["environ"].items())),
              ("the rank's sys.argv", " ".join(seen["argv"])),
              ("the rank's command line", " ".join(seen["cmdline"]))]
    for above in seen["above"]:
        places += [(f"the environment of pid {above['pid']} above the rank",
                    "\n".join(f"{k}={v}" for k, v in above["environ"].items())),
                   (f"the command line of pid {above['pid']} above the rank",
                    " ".join(above["cmdline"]))]
    for secret in secrets_:
        for where, text in places:
            assert secret not in text, f"{secret!r} is in {where}"


def test_an_agent_given_phalanx_token_keeps_it_from_its_ranks(agent):
    token = secrets.token_urlsafe(32)
    address, pid = agent("127.0.0.5", env=agent_env(PHALANX_TOKEN=token))
    backend = px.ClusterBackend([address], token=token)
    with px.WorkerGroup(Snoop, args=(pid,), procs_per_node=2, backend=backend,
                        echo_output=False) as group:
        seen = group.call("seen")
    for rank in seen:
        assert "PHALANX_TOKEN" not in rank["environ"]
        assert rank["above"], "the rank's keeper and supervisor were not looked at"
        for above in rank["above"]:
            assert "PHALANX_TOKEN" not in above["environ"], above["pid"]
        assert_nowhere(rank, token)


def test_an_agent_given_phalanx_token_holds_it_in_no_environment_block_of_its_own(agent):
    """Removing a variable from os.environ leaves it in the block /proc/<pid>/environ
    shows: the agent runs itself again with the token on a pipe instead."""
    token = secrets.token_urlsafe(32)
    address, pid = agent("127.0.0.7", env=agent_env(PHALANX_TOKEN=token))
    with open(f"/proc/{pid}/environ", "rb") as f:
        block = f.read()
    assert token.encode() not in block and b"PHALANX_TOKEN" not in block
    assert token not in " ".join(psutil.Process(pid).cmdline())
    backend = px.ClusterBackend([address], token=token)  # and it serves with that token
    with px.WorkerGroup(Snoop, args=(pid,), backend=backend, echo_output=False) as group:
        assert group.call("seen")[0]["environ"].get("PHALANX_TOKEN") is None


def test_an_agent_given_a_token_file_keeps_its_path_and_token_from_its_ranks(agent,
                                                                             tmp_path):
    token = secrets.token_urlsafe(32)
    token_file = private_file(tmp_path / "agent-token", token)
    address, pid = agent("127.0.0.6", "--token-file", token_file, env=agent_env())
    backend = px.ClusterBackend([address], token_file=token_file)
    with px.WorkerGroup(Snoop, args=(pid,), procs_per_node=1, backend=backend,
                        echo_output=False) as group:
        (seen,) = group.call("seen")
    assert_nowhere(seen, token, token_file)


@pytest.mark.parametrize("mode, says", [
    (0o640, "its group can read it"),
    (0o604, "others can read it"),
    (0o622, "its group can write it; others can write it"),
    (0o660, "its group can read and write it"),
])
def test_a_token_file_others_can_use_is_refused_naming_its_mode_and_the_fix(
        tmp_path, mode, says):
    path = private_file(tmp_path / "token", secrets.token_urlsafe(32), mode)
    for read in (lambda: cluster_token.read_token(path, {}),  # an agent's way
                 lambda: px.ClusterBackend(["127.0.0.5:1"], token_file=path)):  # a controller's
        with pytest.raises(ValueError) as info:
            read()
        message = str(info.value)
        assert f"mode {mode:04o}" in message and says in message, message
        assert f"chmod 600 {path}" in message, message


def test_a_private_token_file_is_read(tmp_path):
    token = secrets.token_urlsafe(32)
    for mode in (0o600, 0o400):
        path = private_file(tmp_path / f"token-{mode:o}", token + "\n", mode)
        assert cluster_token.read_token(path, {}) == token.encode()


def test_an_agent_refuses_to_start_with_a_loose_token_file(tmp_path):
    path = private_file(tmp_path / "token", secrets.token_urlsafe(32), 0o640)
    port = free_port("127.0.0.5")
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "agent", "--host", "127.0.0.5", "--port", str(port),
         "--no-http", "--token-file", path], env=agent_env(), cwd=helpers.REPO,
        capture_output=True, text=True, timeout=20)
    assert result.returncode != 0
    assert "mode 0640" in result.stderr and f"chmod 600 {path}" in result.stderr, result.stderr
    assert not listening("127.0.0.5", port)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_token_file_of_another_user_is_refused(tmp_path):
    path = private_file(tmp_path / "token", secrets.token_urlsafe(32))
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(ValueError, match=r"belongs to user 65534, not to this user"):
        cluster_token.read_token(path, {})


def test_the_owner_rule_names_the_fix():
    with pytest.raises(ValueError, match=r"belongs to user 1234.*chmod 600"):
        cluster_token.check_private("F", 0o100600, owner=1234, uid=1000)
    cluster_token.check_private("F", 0o100600, owner=1000, uid=1000)
    cluster_token.check_private("F", 0o100400, owner=0, uid=1000)  # root's: root reads all
    with pytest.raises(ValueError, match="not a regular file"):
        cluster_token.check_private("F", 0o010600, owner=1000, uid=1000)
