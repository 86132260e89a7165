"""Starting, watching and stopping worker processes on the machine they run on.

A worker is a fresh interpreter running :mod:`phalanx.rank.runtime` in its own process group (so
a terminal's Ctrl-C reaches the controller only, and the worker's whole process tree can be
signalled). Every worker is started by a node supervisor (:mod:`phalanx.node.supervisor`), which
returns it as a :class:`~phalanx.node.supervisor.SupervisedProcess`: the local backend's
controller runs one for its ranks, each Ray rank actor one for its rank. This module holds
what is common to both: the worker's command line, the one thread every ``Popen`` comes
from, a worker started before its rank is known (:class:`PrestartedWorker`), and stopping
workers with escalation.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from phalanx import config
from phalanx.node import proctree

if TYPE_CHECKING:
    from phalanx.node.supervisor import SupervisedProcess, Supervisor

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _SpawnThread:
    """Runs every ``Popen`` of this process on one long-lived daemon thread.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the
    process; spawning from a thread that lives as long as the process means workers die with
    the controller and never with some short-lived thread of the user's.
    """

    _instance: _SpawnThread | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="phalanx-spawn", daemon=True).start()

    @classmethod
    def get(cls) -> _SpawnThread:
        with cls._instance_lock:
            if cls._instance is None or cls._instance._pid != os.getpid():
                cls._instance = cls()
                cls._instance._pid = os.getpid()
            return cls._instance

    _pid = 0

    def run(self, fn: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
        """``fn()`` on the spawn thread. Interrupted meanwhile (Ctrl-C), it still waits for
        ``fn`` to finish, hands its result to ``undo`` and re-raises the interruption: a
        process being forked is never left behind unknown."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, done))
        interruption: BaseException | None = None
        while True:
            try:
                ok, value = done.get()
                break
            except BaseException as exc:  # noqa: BLE001 - re-raised once fn() has finished
                interruption = exc
        if interruption is not None:
            if ok and undo is not None:
                undo(value)
            raise interruption
        if ok:
            return value
        raise value

    def _run(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                done.put((False, exc))


def signal_descendants(pid: int, sig: int) -> None:
    """Signal the descendants that left the worker's process group (e.g. via setsid).

    Read from /proc, not with psutil: importing psutil while the interpreter exits (a
    group shut down by its atexit handler) would clear Python's note of an unhandled
    Ctrl-C, and the script would exit with status 1 instead of dying of SIGINT."""
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return
    for child in proctree.descendants(pid):
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass


# The worker must find phalanx even when the controller imported it from a path of its own
# (sys.path edits, a notebook's cwd): put the package's parent first, then run the worker.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); from phalanx.rank.runtime import main; main()"
)


def worker_argv() -> list[str]:
    """The command line of a worker interpreter."""
    return [sys.executable, "-c", _WORKER_BOOT.format(root=_PACKAGE_ROOT)]


def spawn_thread() -> _SpawnThread:
    """The thread every process this one starts is forked from (see :class:`_SpawnThread`)."""
    return _SpawnThread.get()


def is_worker_command(cmdline: list[str]) -> bool:
    """Whether a process command line is that of a phalanx worker started by this module."""
    return len(cmdline) == 3 and cmdline[1] == "-c" and "from phalanx.rank.runtime import main" in (
        cmdline[2]
    )


# Variables the interpreter or the dynamic loader read when a process starts: a rank whose
# environment changes one of them cannot use a process started ahead of time.
_READ_AT_START = ("LD_", "PYTHON", "MALLOC_")


class PrestartedWorker:
    """A worker interpreter started before its rank is known (its imports done meanwhile),
    under ``supervisor``, waiting on a Unix socket for its assignment; it exits if that
    socket closes first."""

    def __init__(self, supervisor: Supervisor, env: Mapping[str, str],
                 stacks_fd: int | None = None) -> None:
        self.env = dict(env)
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # until it is assigned, what it prints goes where its starter's output goes
            self.proc = supervisor.spawn({"PYTHONUNBUFFERED": "1", **env}, None,
                                         stacks_fd=stacks_fd,
                                         stream=("handoff:{0}", (child.fileno(),)),
                                         output=(1, 2))
        except BaseException:
            self._sock.close()
            raise
        finally:
            child.close()

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a rank with ``env`` can use this process (nothing read at start-up
        changes)."""
        return not any(
            key.startswith(_READ_AT_START) and self.env.get(key) != value
            for key, value in env.items()
            if key != "PYTHONUNBUFFERED"
        )

    def assign(self, env: Mapping[str, str], cwd: str | None, control: Sequence[int],
               stdout_fd: int, stderr_fd: int) -> SupervisedProcess:
        """Make it the rank: its variables, cwd, control stream (a socket, or a pair of
        pipes: read end, write end) and output (the caller keeps its copies of the
        descriptors)."""
        import json

        data = json.dumps({"env": dict(env), "cwd": cwd, "control": len(control)}).encode()
        socket.send_fds(self._sock, [struct.pack("<I", len(data)) + data[:4096]],
                        [*control, stdout_fd, stderr_fd])
        if len(data) > 4096:
            self._sock.sendall(data[4096:])
        self._sock.close()
        return self.proc

    def discard(self) -> None:
        """Not needed after all: it exits when its socket closes; reap it."""
        self._sock.close()
        stop_processes([self.proc], grace=1.0)
        self.proc.release()


def stop_processes(
    procs: Iterable[SupervisedProcess], *, grace: float = config.DEFAULT_TERM_GRACE,
    force: bool = False,
) -> None:
    """SIGTERM every process tree, wait up to ``grace`` s, SIGKILL what is left; returns
    once every worker has exited and its keeper has ended what it left behind (or
    ``config.CLEANUP_WAIT`` has passed). With ``force`` it goes straight to SIGKILL.
    """
    procs = list(procs)
    if not force:
        for proc in procs:
            if proc.alive():
                proc.signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.exitcode(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        proc.signal_tree(signal.SIGKILL)
    for proc in procs:
        if proc.exitcode(10.0) is None:  # pragma: no cover - SIGKILL cannot be ignored
            logger.error("worker pid %s did not exit after SIGKILL", proc.pid)
    deadline = time.monotonic() + config.CLEANUP_WAIT
    for proc in procs:
        if not proc.wait_cleaned(max(0.0, deadline - time.monotonic())):
            logger.error("what worker pid %s started was not all ended in time", proc.pid)


def wait_all_exit(procs: Iterable[SupervisedProcess], timeout: float) -> list[SupervisedProcess]:
    """Wait up to ``timeout`` for the processes to exit on their own; returns those still alive."""
    deadline = time.monotonic() + timeout
    return [proc for proc in procs
            if proc.exitcode(max(0.0, deadline - time.monotonic())) is None]
