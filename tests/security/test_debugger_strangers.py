"""``px.breakpoint()`` with strangers about: other local users can reach a waiting rank's
loopback port and can create paths in ``/tmp`` before we do.

- connections that say nothing (4, as a probe held them, and a flood of 300) do not keep
  the owner's ``phalanx debug`` from attaching at once;
- ``/tmp/phalanx-debug-<uid>`` made first by someone else is never used: the rank and
  ``phalanx debug`` both move to the owner's home directory, and a breakpoint still works;
- a ``$PHALANX_DEBUG_DIR`` that is another user's, or a link, is refused naming its owner
  and the fix; a directory made for us is 0700.

Ranks come from a real group, driven as in ``tests/cli/test_debug.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import phalanx as px
from phalanx import config
from phalanx.cli import debug
from phalanx.rank import debugger
from tests import helpers
from tests.cli.test_debug import (
    CLIENT_TIMEOUT,
    PHALANX,
    WAIT_TIMEOUT,
    Stopper,
    describe,
    phalanx_debug,
    wait_for_record,
)

ATTACH_WITHIN = 3.0  # seconds for `phalanx debug` to attach while strangers hold connections
NOBODY = 65534


@pytest.fixture
def debug_dir(tmp_path) -> Path:
    return tmp_path / "debug"


@pytest.fixture
def group(debug_dir):
    with px.WorkerGroup(Stopper, procs_per_node=2, echo_output=False,
                        env={debugger.ENV_DEBUG_DIR: str(debug_dir)}) as group:
        yield group


def hold_silent(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(sock)
    return socks


@pytest.mark.parametrize("strangers", [4, 300])
def test_the_owner_attaches_while_strangers_hold_silent_connections(group, debug_dir,
                                                                    strangers):
    future = group.call_async("compute", 6)
    record = wait_for_record(debug_dir)
    held = hold_silent(record.port, strangers)
    try:
        time.sleep(0.2)  # all of them taken by the rank and waiting for their token
        started = time.monotonic()
        session = phalanx_debug(debug_dir, "1", stdin="p secret_value\nc\n")
        took = time.monotonic() - started
        print(f"\nattached past {strangers} silent connections in {took:.2f} s")
        assert session.returncode == 0, describe(session)
        assert "6007" in session.stdout
        assert took < ATTACH_WITHIN, took
    finally:
        for sock in held:
            sock.close()
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (6008, True)


def test_a_silent_connection_is_dropped_at_the_token_deadline(group, debug_dir):
    future = group.call_async("compute", 2)
    record = wait_for_record(debug_dir)
    with socket.create_connection(("127.0.0.1", record.port), timeout=5) as silent:
        silent.settimeout(config.DEBUG_TOKEN_TIMEOUT + 5)
        started = time.monotonic()
        assert silent.recv(100) == b""  # hung up on, unanswered
        assert time.monotonic() - started < config.DEBUG_TOKEN_TIMEOUT + 2
    assert debug.waiting_ranks(debug_dir) == [record]  # and the rank still waits
    session = phalanx_debug(debug_dir, "1", stdin="c\n")
    assert session.returncode == 0, describe(session)
    assert future.result(timeout=WAIT_TIMEOUT)[1] == (2008, True)


# --------------------------------------------------------------------------- the directory


def test_a_directory_made_for_the_debugger_is_private(tmp_path):
    made = tmp_path / "a" / "debug"
    assert debugger.private_dir(made, create=True)
    assert os.stat(made).st_mode & 0o777 == 0o700


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's path needs "
                                                         "root")


@needs_root
def test_a_debug_dir_of_another_user_is_refused_naming_the_owner_and_the_fix(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PermissionError) as info:
        debugger.private_dir(theirs, create=True)
    message = str(info.value)
    assert f"uid {NOBODY}" in message and "not to you" in message, message
    assert debugger.ENV_DEBUG_DIR in message, message
    assert os.stat(theirs).st_uid == NOBODY  # left alone


def test_a_link_at_the_debug_dir_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "debug"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match="symbolic link"):
        debugger.private_dir(link, create=True)


WAITER = """\
import phalanx as px
px.breakpoint(timeout={patience})
print("continued", flush=True)
"""


@needs_root
def test_a_default_dir_taken_by_another_user_is_passed_over_and_breakpoints_still_work(
        tmp_path):
    taken = Path("/tmp") / f"phalanx-debug-{os.getuid()}"
    if os.path.lexists(taken):
        pytest.skip(f"{taken} exists already: this test makes it itself")
    env = {key: value for key, value in os.environ.items() if key != debugger.ENV_DEBUG_DIR}
    env["PYTHONPATH"] = os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])
    taken.mkdir(mode=0o777)  # as another user would have, first
    os.chown(taken, NOBODY, NOBODY)
    waiter = None
    try:
        fallback = debugger.default_dir({})
        assert fallback != taken and fallback.parts[-3:] == (".cache", "phalanx", "debug")
        script = tmp_path / "wait.py"
        script.write_text(textwrap.dedent(WAITER.format(patience=WAIT_TIMEOUT)))
        waiter = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert helpers.wait_until(lambda: bool(debug.waiting_ranks(fallback)), WAIT_TIMEOUT,
                                  interval=0.05), "the rank did not register"
        assert not list(taken.iterdir()), "a record went into the other user's directory"
        # phalanx debug, with no --dir and no PHALANX_DEBUG_DIR, finds it too
        (record,) = debug.waiting_ranks(fallback)
        session = subprocess.run([*PHALANX, "debug", "--pid", str(record.pid)], input="c\n",
                                 capture_output=True, text=True, timeout=CLIENT_TIMEOUT,
                                 env=env)
        assert session.returncode == 0, describe(session)
        out, err = waiter.communicate(timeout=WAIT_TIMEOUT)
        assert "continued" in out, err
        assert f"phalanx debug --pid {record.pid}'" in err  # the hint needs no --dir
    finally:
        if waiter is not None and waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
        os.rmdir(taken)
