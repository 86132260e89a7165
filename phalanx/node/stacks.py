"""Every thread's Python stack of a rank, taken from outside whatever its code is doing.

A worker arms :mod:`faulthandler` on ``config.STACKS_SIGNAL`` with a file its node side
handed it (:func:`phalanx.rank.runtime.arm_stack_dumps`). The dump runs in the C signal handler,
so it works while the main thread is stuck in user code, in a deadlocked collective, or in
a C call that holds the GIL. Only a stopped process (SIGSTOP) cannot dump;
:meth:`StackFile.take` says so instead of waiting.

Reading the dumps is :mod:`phalanx.dumps` (pure).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

from phalanx import config
from phalanx.node import proctree

SIGNAL = config.STACKS_SIGNAL
_SETTLE = 0.01  # seconds the dump file must stay the same size to count as complete


class StackFile:
    """Node side: the file one rank dumps its stacks into, and taking a dump."""

    def __init__(self, fd: int | None = None) -> None:
        """A new file (unnamed, gone once closed); or, given ``fd``, the file open on that
        descriptor (a dump file made by another process and handed over, as the warden's:
        its actor dumps there), which this object now owns."""
        self._file = (tempfile.TemporaryFile(prefix="phalanx-stacks-") if fd is None
                      else os.fdopen(fd, "w+b"))
        self.fd = self._file.fileno()
        self._lock = threading.Lock()

    def take(self, pid: int | None, timeout: float = config.STACKS_TIMEOUT) -> str:
        """The stacks of process ``pid`` now, or a line saying why there are none."""
        if pid is None:
            return "(no stack: the process has not started)"
        with self._lock:
            state = proctree.state(pid)
            if state is None or state in "ZX":
                return "(no stack: the process has exited)"
            if state in "Tt":
                return "(no stack: the process is stopped (SIGSTOP or a debugger), so it " \
                       "cannot run the dump)"
            if not proctree.catches(pid, SIGNAL):
                return "(no stack: the process has not reached the point where it can dump " \
                       "its stacks yet)"
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
            try:
                os.kill(pid, SIGNAL)
            except ProcessLookupError:
                return "(no stack: the process has exited)"
            deadline = time.monotonic() + timeout
            size = -1
            while True:
                time.sleep(_SETTLE)
                now = os.fstat(self.fd).st_size
                if now > 0 and now == size:
                    break
                size = now
                if time.monotonic() >= deadline:
                    if size <= 0:
                        return f"(no stack: the process did not dump one within {timeout:g} s)"
                    break
            return os.pread(self.fd, size, 0).decode(errors="replace")

    def close(self) -> None:
        self._file.close()
