"""``phalanx token``: a fresh 256-bit token, printed or written to a new private file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from phalanx.backends.cluster import token as cluster_token
from tests import helpers


def _phalanx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True,
                          text=True, timeout=60, cwd=helpers.REPO, env=helpers.script_env())


def test_a_printed_token_holds_256_random_bits():
    first, second = _phalanx("token"), _phalanx("token")
    assert first.returncode == 0 and second.returncode == 0
    assert len(first.stdout.strip()) == 43  # 32 bytes, URL-safe base64
    assert first.stdout != second.stdout


def test_a_token_file_is_new_private_and_read_as_agents_read_it(tmp_path):
    path = tmp_path / "token"
    assert _phalanx("token", "--file", str(path)).returncode == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(cluster_token.read_token(str(path), {})) == 43
    again = _phalanx("token", "--file", str(path))  # never overwritten
    assert again.returncode == 2 and "exists" in again.stderr
    assert len(cluster_token.read_token(str(path), {})) == 43
