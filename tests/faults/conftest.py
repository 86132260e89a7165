"""Fixtures the fault tests share."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from tests.helpers import pid_alive, wait_until


@pytest.fixture
def local_agent_dir(tmp_path, monkeypatch):
    """This user's local agent (which keeps the local backend's detached groups), in a
    private runtime directory of the test's own; stopped (if it still runs) at the end."""
    from phalanx.backends.cluster import localagent

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    yield runtime
    state = runtime / "phalanx" / "local-agent.json"
    if state.exists():
        pid = json.loads(state.read_text())["pid"]
        if not wait_until(lambda: not pid_alive(pid), 10):  # --once: it ends with its groups
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    assert localagent.running() is None
