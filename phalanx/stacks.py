"""Every thread's Python stack of a rank, taken from outside whatever its code is doing.

A worker arms :mod:`faulthandler` on ``config.STACKS_SIGNAL`` with a file its node side
handed it (:func:`phalanx.worker.arm_stack_dumps`). The dump runs in the C signal handler,
so it works while the main thread is stuck in user code, in a deadlocked collective, or in
a C call that holds the GIL. Only a stopped process (SIGSTOP) cannot dump;
:meth:`StackFile.take` says so instead of waiting.

:func:`innermost_user_frames` (pure) picks out, per thread, the frame nearest the top that
belongs to the user's code rather than to phalanx, the standard library or site-packages:
what straggler reports and :class:`~phalanx.errors.CallTimeout` quote.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig
import tempfile
import threading
import time

from phalanx import config, proctree

SIGNAL = config.STACKS_SIGNAL
_SETTLE = 0.01  # seconds the dump file must stay the same size to count as complete


class StackFile:
    """Node side: the file one rank dumps its stacks into, and taking a dump."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="phalanx-stacks-")
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


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_PHALANX = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[key]) + os.sep
                  for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)})


def is_user_file(filename: str) -> bool:
    """Not phalanx's, not the standard library's, not an installed package's."""
    if filename.startswith("<") or filename.startswith(_PHALANX):
        return False
    return not os.path.realpath(filename).startswith(_library_dirs())


def innermost_user_frames(dump: str) -> list[str]:
    """For each thread of a faulthandler dump that runs user code: its innermost user frame,
    as ``File "x.py", line 3 in train``."""
    frames = []
    found = False
    for line in dump.splitlines():
        if _THREAD.match(line):
            found = False
            continue
        match = _FRAME.match(line)
        if match and not found and is_user_file(match["file"]):
            found = True
            frames.append(line.strip())
    return frames


def format_report(stacks: dict[int, str], titles: dict[int, str] | None = None) -> str:
    """Ranks' dumps as one text, each under a header line naming the rank."""
    parts = []
    for rank in sorted(stacks):
        title = (titles or {}).get(rank, f"rank {rank}")
        parts.append(f"=== {title} ===\n{stacks[rank].rstrip()}\n")
    return "\n".join(parts)
