"""What a Ray actor's process is while it runs a rank in place
(:mod:`phalanx.backends.ray.actor`): its notes to its warden (how it is about to end),
its signals and exits patched for the rank, and the end of what the rank left behind."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, NoReturn

from phalanx import config

_FATAL_BY_DEFAULT = frozenset(
    int(s) for s in (signal.SIGHUP, signal.SIGQUIT, signal.SIGILL, signal.SIGABRT,
                     signal.SIGFPE, signal.SIGKILL, signal.SIGSEGV, signal.SIGPIPE,
                     signal.SIGALRM, signal.SIGTERM, signal.SIGBUS, signal.SIGUSR1,
                     signal.SIGUSR2))

logger = logging.getLogger(__name__)


class Notes:
    """The actor's end of its warden's pipe: how the actor is about to end, written before
    it does (``exit N``, ``signal N``), and ``done N`` once it ended its rank itself."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def write(self, word: str, number: int) -> None:
        with self._lock:
            if self.fd < 0:
                return
            try:
                os.write(self.fd, f"{word} {int(number)}\n".encode())
            except OSError:  # the warden is gone
                pass

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


class HostPatches:
    """What the actor's process is while it runs a rank: SIGINT unblocked on its main thread
    (a Ray worker's blocks it) and raising KeyboardInterrupt, as in a fresh Python program;
    SIGTERM noted (``terminated``) and then handled by Ray's handler, which raises
    SystemExit so that Ray's worker exits as Ray means it to (Ray ends a worker with
    SIGTERM first); and ``os._exit``/``os.kill`` noting, before they take effect, how the
    process is about to end (the warden reports it: Ray does not know an exit status).
    :meth:`restore` puts Ray's back."""

    def __init__(self, notes: Notes) -> None:
        self._handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._mask = signal.pthread_sigmask(signal.SIG_SETMASK, set())
        self.terminated = False
        ray_term = self._handlers[signal.SIGTERM]

        def on_sigterm(signum: int, frame: Any) -> None:
            self.terminated = True
            notes.write("signal", signum)
            if callable(ray_term):
                ray_term(signum, frame)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, on_sigterm)
        self._exit, self._kill = os._exit, os.kill
        real_exit, real_kill, me = os._exit, os.kill, os.getpid()

        def _exit(status: int) -> NoReturn:  # os._exit's own signature
            notes.write("exit", status)
            real_exit(status)

        def kill(pid: int, sig: int) -> None:
            if pid in (0, me, -os.getpgrp()) and _fatal(int(sig)):
                notes.write("signal", int(sig))
            real_kill(pid, sig)

        os._exit, os.kill = _exit, kill

    def restore(self) -> None:
        os._exit, os.kill = self._exit, self._kill
        for sig, handler in self._handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)


def _fatal(sig: int) -> bool:
    """Whether ``sig`` ends this process as things stand (no Python handler for it)."""
    if sig == signal.SIGKILL:
        return True
    try:
        return sig in _FATAL_BY_DEFAULT and signal.getsignal(sig) in (signal.SIG_DFL, None)
    except ValueError:
        return False


def end_leftovers(spare: int | None, timeout: float = config.CLEANUP_WAIT) -> None:
    """SIGKILL everything below this process (a subreaper) but ``spare`` (the warden), and
    reap what was killed, until nothing is left or ``timeout`` passes."""
    from phalanx.node import proctree

    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while True:
        left = [pid for pid in proctree.descendants(os.getpid()) if pid != spare]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in list(killed):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    killed.discard(pid)
            except ChildProcessError:  # not our child (a grandchild), or reaped
                killed.discard(pid)
        if not left or time.monotonic() >= deadline:
            if left:
                logger.error("processes %s of the rank survived SIGKILL for %.1f s", left,
                             timeout)
            return
        time.sleep(0.005)
