"""A rank's side of :mod:`phalanx.node.stacks`: its threads' stacks, read without ever
interrupting what its code is doing.

A signal handler that runs on a thread blocked in a system call ends that call: ``nanosleep``,
``poll``, ``epoll_wait`` and others are not restarted after a handler, so a C library or an
extension that does not retry ``EINTR`` returns early or fails. So no stack capture signals
a thread of the user's. Each rank has a thread of its own, ``config.STACKS_THREAD``, that
phalanx's node side signals directly (``tgkill``), and nothing else:

- ``config.STACKS_REQUEST``: blocked on that thread, which waits for it in ``sigwait``. It
  then takes the GIL -- at once if the other threads are in blocking calls (a ``ctypes``
  call, I/O, ``time.sleep`` release it), within the switch interval (5 ms) if they run
  Python -- and writes every other thread's stack, read with :func:`sys._current_frames`,
  into the stack file as one record between two ``config.STACKS_MARK`` bytes, in
  faulthandler's format (plus each thread's name).
- ``config.STACKS_SIGNAL``: when the GIL is not to be had (a C call keeps it), the node side
  sends this one, to the same thread, and :mod:`faulthandler`'s handler dumps every thread
  from there without the GIL. That thread is then waiting for the GIL, or in ``sigwait``;
  both waits resume after a handler, so nothing returns early.

What it costs the rank: one idle thread, and per capture a few hundred microseconds
holding the GIL to format the stacks. The file is opened for appending (``O_APPEND``), so
both kinds of writes land after whatever is there, whatever offset the node side left.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import threading
import types

from phalanx import config

_MAX_DEPTH = 100  # frames per thread, as faulthandler
# control characters (the mark among them) as faulthandler writes them: the record stays
# one line per frame and never holds a mark of its own
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f]}


class _Server:
    """The stack thread of this process (one, whichever rank armed it last)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.identity = _identity(fd)
        # not named STACKS_THREAD here: Python 3.14 gives a thread's name to the OS as it
        # starts, and the node side must not find it before it blocks STACKS_REQUEST (whose
        # default action ends the process)
        self.thread = threading.Thread(target=self._serve, name="phalanx-stack-reader",
                                       daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        wanted = {config.STACKS_REQUEST}
        signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
        # the starting thread's mask is inherited: a Ray worker's threads block signals
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {config.STACKS_SIGNAL})
        try:  # the node side finds this thread by this name: only once it can be asked
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
                comm.write(config.STACKS_THREAD)
        except OSError:
            return  # no /proc to be found in: the node side says it cannot ask
        own = threading.get_ident()
        while True:
            signal.sigwait(wanted)
            while signal.sigtimedwait(wanted, 0) is not None:
                pass  # requests that queued up while the GIL was held: one answer for all
            record = config.STACKS_MARK + format_stacks(skip=own) + config.STACKS_MARK
            fd = self.fd
            if _identity(fd) != self.identity:
                continue  # its file was closed (the rank's actor has ended it): no answer
            data = record.encode(errors="backslashreplace")
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                continue


_SERVER: _Server | None = None
_LOCK = threading.Lock()


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def arm(fd: int) -> None:
    """Answer the node side's stack requests into the file open on ``fd`` (see the module
    docstring): faulthandler armed on ``config.STACKS_SIGNAL``, the stack thread started
    (once per process: a later call moves it to ``fd``)."""
    global _SERVER
    import faulthandler  # only with a stack file: a rank's start-up stays light

    os.set_inheritable(fd, False)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    faulthandler.register(config.STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
    if not hasattr(signal, "sigwait"):  # pragma: no cover - not Linux: faulthandler only
        return
    with _LOCK:
        if _SERVER is None:
            _SERVER = _Server(fd)
        else:
            _SERVER.fd, _SERVER.identity = fd, _identity(fd)


def _escaped(text: str) -> str:
    return text.translate(_ESCAPES)


def format_stacks(skip: int | None = None) -> str:
    """Every thread's Python stack but ``skip``'s, as faulthandler writes them (innermost
    frame first), each thread's header naming it. Called with the GIL held, so every
    thread's frames stand still while they are read."""
    frames = sys._current_frames()  # noqa: SLF001 - the documented way to read them
    threads = getattr(threading, "_active", {}).copy()  # no lock: a holder may be stuck
    lines: list[str] = []
    for ident, frame in frames.items():
        if ident == skip:
            continue
        thread = threads.get(ident)
        name = f" [{_escaped(thread.name)}]" if thread is not None else ""
        lines.append(f"Thread 0x{ident:016x}{name} (most recent call first):")
        lines += _frame_lines(frame)
        lines.append("")
    return "\n".join(lines)


def _frame_lines(frame: types.FrameType | None) -> list[str]:
    lines: list[str] = []
    while frame is not None:
        if len(lines) == _MAX_DEPTH:
            lines.append("  ...")
            break
        code = frame.f_code
        lines.append(f'  File "{_escaped(code.co_filename)}", line {frame.f_lineno} '
                     f"in {_escaped(code.co_name)}")
        frame = frame.f_back
    return lines or ["  <no Python frame>"]
