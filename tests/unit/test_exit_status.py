"""A dead worker's exit status read before its keeper reports it
(:func:`phalanx.node.proctree.exit_status`): what lets a SIGKILLed rank's calls fail as
soon as its control stream ends, naming the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from phalanx.node import proctree


def _zombie(code_or_signal: int, killed: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"] if killed
                            else [sys.executable, "-c", f"raise SystemExit({code_or_signal})"])
    if killed:
        os.kill(proc.pid, code_or_signal)
    deadline = time.monotonic() + 30
    while proctree.state(proc.pid) != "Z":  # exited, not reaped: we are its parent
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.005)
    return proc


def test_a_zombies_status_says_how_it_ended_until_it_is_reaped():
    for code, killed in ((3, False), (signal.SIGKILL, True)):
        proc = _zombie(code, killed)
        status = proctree.exit_status(proc.pid)
        assert status is not None
        assert os.waitstatus_to_exitcode(status) == (-code if killed else code)
        assert proc.wait(10) == (-code if killed else code)
        assert proctree.exit_status(proc.pid) is None  # reaped: gone


def test_a_running_process_has_no_exit_status():
    assert proctree.exit_status(os.getpid()) is None
