"""A rank process's watch thread: the heartbeat while user code holds the main thread, and
the process's end once the controller's end of its control stream closes."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import pytest

from phalanx import config

# The rank side of a control stream whose other end is the test's: the watch thread beats
# into a pipe of the test's every 50 ms while the main thread sleeps as stuck user code.
_RANK = r"""
import os, sys, time
from phalanx.rank import runtime
from phalanx.wire import streams

control, beats = int(sys.argv[1]), int(sys.argv[2])
spare_read, spare_write = os.pipe()  # (the stream's unused direction)
watch = runtime._Watch(streams.PipeStream(control, spare_write, blocking_reads=False))

def beat():
    os.write(beats, b"h")
    return True

watch.beat(beat, 0.05)
time.sleep(60)
"""


def _beats_within(fd: int, seconds: float) -> int:
    count, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            count += len(os.read(fd, 4096))
    return count


@pytest.mark.timeout(30)
def test_the_watch_beats_while_user_code_holds_the_main_thread_and_ends_the_orphan():
    control_read, control_write = os.pipe()
    beats_read, beats_write = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(control_read), str(beats_write)],
                            pass_fds=(control_read, beats_write))
    os.close(control_read)
    os.close(beats_write)
    try:
        assert select.select([beats_read], [], [], 10)[0]  # the first (start-up aside)
        # then one every 50 ms: 10 in 0.5 s, fewer on a loaded machine
        assert _beats_within(beats_read, 0.5) >= 3
        assert rank.poll() is None
        os.close(control_write)  # the controller is gone
        control_write = -1
        started = time.monotonic()
        assert rank.wait(config.ORPHAN_GRACE + 10) == 1
        assert time.monotonic() - started >= config.ORPHAN_GRACE * 0.9  # its grace kept
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(5)
        os.close(beats_read)
        if control_write >= 0:
            os.close(control_write)
