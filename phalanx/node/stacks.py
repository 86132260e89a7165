"""Every thread's Python stack of a rank, taken from outside whatever its code is doing,
without ever interrupting it.

A signal handler that runs on a thread blocked in a system call cuts the call short:
``nanosleep``, ``poll``, ``epoll_wait`` are not restarted after one, and C code that does
not retry ``EINTR`` returns early or fails. So a capture never signals the rank's process,
nor any thread of the user's: only the rank's own stack thread (``config.STACKS_THREAD``,
found by its name in ``/proc/PID/task``), with ``tgkill``. The rank's side is
:mod:`phalanx.rank.stacks`; a node side hands each rank a file
(:func:`phalanx.rank.runtime.arm_stack_dumps` arms it) and takes its stacks with
:meth:`StackFile.take`:

1. ``config.STACKS_REQUEST`` to the stack thread, which takes the GIL and writes every
   other thread's stack, read with ``sys._current_frames()``, as one record between two
   ``config.STACKS_MARK`` bytes. The GIL is free, or freed within the switch interval,
   unless a C call keeps it.
2. No record after ``GIL_WAIT``: a C call keeps the GIL (a deadlock holding it, a long
   computation in an extension). ``config.STACKS_SIGNAL`` to the same thread makes
   :mod:`faulthandler`'s handler dump every thread there without the GIL; the stack thread
   is then waiting for the GIL, and that wait resumes after the handler.

A stopped process (SIGSTOP) cannot run either; :meth:`StackFile.take` says so instead of
waiting. Reading the dumps is :mod:`phalanx.dumps` (pure).
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable

from phalanx import config
from phalanx.node import proctree

SIGNAL = config.STACKS_SIGNAL
# seconds the stack thread has to take the GIL and answer before the dump without it: the
# GIL changes hands every 5 ms while Python runs, so only a C call that keeps it lasts this
GIL_WAIT = 0.25
_POLL = 0.002  # seconds between looks at the file while an answer is due
_SETTLE = 0.01  # seconds faulthandler's dump must stay the same size to count as complete
# tgkill(2) where the C library has no wrapper for it (glibc before 2.30)
_TGKILL_SYSCALL = {"x86_64": 234, "aarch64": 131, "ppc64le": 250, "s390x": 241,
                   "riscv64": 131, "i686": 270, "armv7l": 268}
_MARK = config.STACKS_MARK.encode()


class StackFile:
    """Node side: the file one rank writes its stacks into, and taking them."""

    def __init__(self, fd: int | None = None) -> None:
        """A new file (unnamed, gone once closed); or, given ``fd``, the file open on that
        descriptor (a dump file made by another process and handed over, as the warden's:
        its actor dumps there), which this object now owns."""
        if fd is None:
            import tempfile  # here: the warden, which is handed its file, starts without it

            self._file = tempfile.TemporaryFile(prefix="phalanx-stacks-")
        else:
            self._file = os.fdopen(fd, "w+b")
        self.fd = self._file.fileno()
        # every write appends, whatever offset the other side left: a truncated file is
        # written from its start, with no hole of zeros before
        _set_append(self.fd)
        self._lock = threading.Lock()
        self._thread: tuple[int, int] | None = None  # (pid, tid) of the last stack thread

    def take(self, pid: int | None, timeout: float = config.STACKS_TIMEOUT) -> str:
        """The stacks of process ``pid`` now, or a line saying why there are none."""
        if pid is None:
            return "(no stack: the process has not started)"
        with self._lock:
            why = _cannot_run(pid)
            if why is not None:
                return why
            tid = self._stack_thread(pid)
            if tid is None:
                return "(no stack: the process has not reached the point where it can dump " \
                       "its stacks yet)"
            os.ftruncate(self.fd, 0)
            started = time.monotonic()
            deadline = started + timeout
            if not _pending(pid, tid, config.STACKS_REQUEST):  # else one waits for the GIL
                why = _signal(pid, tid, config.STACKS_REQUEST)
                if why is not None:
                    return why
            record, _ = self._wait(min(deadline, started + min(GIL_WAIT, timeout / 2)))
            if record is not None:
                return record
            # a C call keeps the GIL: faulthandler dumps without it, on the stack thread
            held = time.monotonic() - started
            if not proctree.catches(pid, SIGNAL):
                return _cannot_run(pid) or (
                    f"(no stack: the GIL was not released within {held:.2f} s and the "
                    "process no longer dumps its stacks without it)")
            why = _signal(pid, tid, SIGNAL)
            if why is not None:
                return why
            record, dump = self._wait(deadline, settle=True)
            if record is not None:
                return record
            if dump:
                return (f"(the GIL was not released within {held:.2f} s -- a C call keeps "
                        f"it -- so these stacks were read without it)\n{dump}")
            return _cannot_run(pid) or \
                f"(no stack: the process did not dump one within {timeout:g} s)"

    def _stack_thread(self, pid: int) -> int | None:
        """The thread id of ``pid``'s stack thread; None if it has none (yet)."""
        if self._thread is not None and self._thread[0] == pid and \
                _comm(pid, self._thread[1]) == config.STACKS_THREAD:
            return self._thread[1]
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for name in tids:
            if name.isdigit() and _comm(pid, int(name)) == config.STACKS_THREAD:
                self._thread = (pid, int(name))
                return int(name)
        return None

    def _wait(self, deadline: float, settle: bool = False) -> tuple[str | None, str]:
        """Until ``deadline``: the stack thread's record as soon as one is complete, or
        (``settle``) faulthandler's dump once it stops growing. The record (None if there
        is none) and the dump (what else the file holds)."""
        size, record, dump = 0, None, ""
        while True:
            time.sleep(_POLL if not settle or not dump else _SETTLE)
            now = os.fstat(self.fd).st_size
            if now == size:
                if settle and dump:
                    return None, dump
            else:
                size = now
                record, dump = _split(os.pread(self.fd, size, 0))
                if record is not None:
                    return record, dump
            if time.monotonic() >= deadline:
                return record, dump

    def close(self) -> None:
        self._file.close()


def _split(data: bytes) -> tuple[str | None, str]:
    """The file's last complete record, and the rest (faulthandler's dump, if any)."""
    parts = data.split(_MARK)
    # even indexes lie outside records; a last odd one is a record still being written
    complete = parts[1:len(parts) - 1 if len(parts) % 2 == 0 else len(parts):2]
    record = complete[-1].decode(errors="replace") if complete else None
    rest = b"".join(parts[0::2]).replace(b"\0", b"").decode(errors="replace").strip()
    return record, rest


def _cannot_run(pid: int) -> str | None:
    """Why ``pid`` cannot write its stacks now (gone, stopped); None if it can."""
    state = proctree.state(pid)
    if state is None or state in "ZX":
        return "(no stack: the process has exited)"
    if state in "Tt":
        return "(no stack: the process is stopped (SIGSTOP or a debugger), so it cannot " \
               "run the dump)"
    return None


def _comm(pid: int, tid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
            return f.read().rstrip(b"\n").decode(errors="replace")
    except OSError:
        return None


def _pending(pid: int, tid: int, sig: int) -> bool:
    """Whether ``sig`` waits on thread ``tid`` already (the thread's ``SigPnd``): one that
    waits for the GIL answers every request made meanwhile, so none piles up."""
    return proctree.signal_in(f"/proc/{pid}/task/{tid}/status", b"SigPnd:", sig)


def _signal(pid: int, tid: int, sig: int) -> str | None:
    """``sig`` to thread ``tid`` of ``pid`` alone; None, or why it could not be sent."""
    try:
        _tgkill()(pid, tid, sig)
    except ProcessLookupError:
        return _cannot_run(pid) or "(no stack: the process's stack thread has ended)"
    except OSError as exc:
        return f"(no stack: cannot signal the process's stack thread: {exc})"
    return None


@functools.cache
def _tgkill() -> Callable[[int, int, int], None]:
    """``tgkill(2)``: a signal to one thread of a process (``os.kill`` reaches the process,
    and the kernel picks the thread: mostly its main one)."""
    import ctypes  # only once stacks are asked for: the node side's start stays light

    libc = ctypes.CDLL(None, use_errno=True)
    call: Callable[..., int]
    if hasattr(libc, "tgkill"):
        call = libc.tgkill
    else:  # pragma: no cover - glibc before 2.30
        import platform

        number = _TGKILL_SYSCALL.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, f"no tgkill for {platform.machine()}")
        syscall = libc.syscall

        def call(pid: int, tid: int, sig: int) -> int:
            return int(syscall(number, pid, tid, sig))

    def tgkill(pid: int, tid: int, sig: int) -> None:
        if call(pid, tid, sig) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code)) if code != errno.ESRCH else \
                ProcessLookupError(code, os.strerror(code))

    return tgkill


def _set_append(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
