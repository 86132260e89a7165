"""This user's own ``phalanx agent`` on this machine: what holds a detached group's ranks
on the local backend, so that they outlive the controller process on a laptop too.

``WorkerGroup(..., detached=True)`` with the local backend runs the group on this agent (a
cluster backend of one node, on loopback) instead of as the controller's children:
:func:`ensure` finds the agent running, or starts one. ``px.attach(name)`` with the local
backend finds it with :func:`running`. It lives in a private directory of the user's
(``$XDG_RUNTIME_DIR/phalanx``, else ``~/.cache/phalanx/run``; 0700, checked by
:func:`phalanx.output.ownfiles.private_dir`) with its token (a fresh one, 0600) and a state
file naming its pid and port; a lock file keeps two controllers from starting two.

The agent is started in a session of its own (a signal to the controller's process group
does not reach it) with ``--once`` (it exits as the last of its sessions ends: the last
detached group stopped, ended, or given up after its ``detach_timeout``) and
``--idle-timeout`` (an agent no controller reached exits): nothing stays behind once no
detached group needs it. Its log is ``agent.log`` beside the state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.backends.cluster import token as tokens
from phalanx.output.ownfiles import private_dir

HOST = "127.0.0.1"
IDLE_TIMEOUT = 60.0  # seconds an agent nobody connected to waits before it exits
START_TIMEOUT = 30.0  # seconds for a new agent to listen
_WHY = "phalanx keeps its local agent's token and state only in a directory of yours"


def state_dir() -> Path:
    """The private directory of this user's local agent (made if missing)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = (Path(runtime) / "phalanx" if runtime and os.path.isdir(runtime)
            else Path.home() / ".cache" / "phalanx" / "run")
    private_dir(base, str(base), _WHY)
    return base


def running() -> tuple[str, str] | None:
    """``(host:port, token file)`` of this user's local agent, if one runs and listens."""
    directory = state_dir()
    try:
        state = json.loads((directory / "local-agent.json").read_text())
        pid, port = int(state["pid"]), int(state["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    token_file = directory / "local-agent.token"
    if not _alive(pid) or not token_file.exists() or not _listening(port):
        return None
    return f"{HOST}:{port}", str(token_file)


def ensure() -> tuple[str, str]:
    """``(host:port, token file)`` of this user's local agent, started if none runs."""
    directory = state_dir()
    with open(directory / "local-agent.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one controller starts it; the others find it
        found = running()
        if found is not None:
            return found
        return _start(directory)


def _start(directory: Path) -> tuple[str, str]:
    token_file = directory / "local-agent.token"
    with contextlib.suppress(FileNotFoundError):
        token_file.unlink()  # the last agent's: each agent has a token of its own
    tokens.write_token_file(str(token_file))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("PHALANX_TOKEN", None)
    with open(directory / "agent.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", HOST, "--port", str(port),
             "--token-file", str(token_file), "--no-http", "--once",
             "--idle-timeout", str(IDLE_TIMEOUT)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            start_new_session=True, close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT
    while not _listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            raise RuntimeError(f"this user's local phalanx agent did not start (exit status "
                               f"{proc.returncode}); its log: {directory / 'agent.log'}")
        time.sleep(0.05)
    (directory / "local-agent.json").write_text(json.dumps({"pid": proc.pid, "port": port}))
    return f"{HOST}:{port}", str(token_file)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number
        return False
    return True


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port
