"""The node supervisor: the parent of a node's ranks, and the reaper of all they start.

Workers start subprocesses (data loaders, compilers, servers, ``setsid`` daemons); none of
them may outlive the rank that started it, nor the controller. The supervisor is a small
process of its own, started by the controller for its group's local ranks, that

- forks a *keeper* per rank: a child subreaper that starts the rank's interpreter, reports
  its pid and later its exit status on the rank's *status pipe*, and then kills whatever the
  rank left behind (in its process group, in a new session, double-forked: all of it is
  re-parented to the keeper) before exiting, which closes the status pipe;
- when the controller goes away (its pidfd turns readable, or the request socket closes:
  SIGKILL, SIGTERM, a crash or a clean exit alike), kills every process below it and exits.

A supervisor killed outright cannot clean up (Ray, for one, SIGKILLs the direct children of
an actor that exits); its keepers then learn of its death from ``PR_SET_PDEATHSIG``
(SIGTERM, caught) and each ends its rank's whole tree, all of which is below it. A rank
whose keeper dies gets SIGKILL the same way (armed by the keeper before ``exec``).

Process tree, and what ends whom::

    controller --(pidfd, socket EOF)--> supervisor --(PDEATHSIG: SIGTERM)--> keeper
               --(PDEATHSIG: SIGKILL)--> rank --> whatever the rank starts (kept below
               the keeper, its subreaper, and killed by it when the rank exits)

The controller sends one message per rank to start (marshalled, plus the descriptors the rank
gets) over a ``SOCK_SEQPACKET`` socket. Nothing else passes through the supervisor: control
streams, output, signals and the status pipe go straight between the controller and the
rank.

"The controller" is whoever started the supervisor: the group's controller process for its
local ranks, or a Ray rank actor for its rank (then the actor's death, however it comes,
ends the rank's whole tree). The same code is what a cluster agent runs for its node.
"""

from __future__ import annotations

import logging
import marshal
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx import config
from phalanx.node import proctree
from phalanx.wire import streams
from phalanx.world.layout import rank_scheduling

if TYPE_CHECKING:
    from phalanx.node.keeper import StartRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")
# a job of the spawn thread: what to call, and where its (ok, result or exception) goes
_Job = tuple[Callable[[], Any], queue.SimpleQueue[tuple[bool, Any]]]

# It needs the standard library and phalanx only: without ``site`` (-S) it starts ~10 ms
# sooner, and every rank of a group waits for it (see phalanx.node.keeper).
_BOOT = "import sys; sys.path.insert(0, {root!r}); from phalanx.node.keeper import main; main()"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _SpawnThread:
    """Runs every ``Popen`` of this process on one long-lived daemon thread.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the
    process; spawning from a thread that lives as long as the process means supervisors
    (and so workers) die with the controller and never with some short-lived thread of the
    user's.
    """

    _instance: _SpawnThread | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process it spawns for (a forked child needs its own)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="phalanx-spawn", daemon=True).start()

    @classmethod
    def get(cls) -> _SpawnThread:
        """This process's spawn thread (a new one after a fork)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def run(self, fn: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
        """``fn()`` on the spawn thread. Interrupted meanwhile (Ctrl-C), it still waits for
        ``fn`` to finish, hands its result to ``undo`` and re-raises the interruption: a
        process being forked is never left behind unknown."""
        done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
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
            result: T = value  # what fn() returned: see _run
            return result
        raise value

    def _run(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                done.put((False, exc))


# --------------------------------------------------------------------------- controller side


class Supervisor:
    """The controller's handle on its node supervisor process."""

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-S", "-c", _BOOT.format(root=_ROOT), str(theirs.fileno()),
                str(os.getpid())]

        def start() -> subprocess.Popen[bytes]:
            if sys.version_info >= (3, 11):
                return subprocess.Popen(argv, pass_fds=(theirs.fileno(),),  # novermin
                                        stdin=subprocess.DEVNULL, process_group=0)
            # 3.10 has no process_group: the supervisor leaves our group itself, first
            # thing (a preexec_fn would do it sooner, but is unsafe in a threaded process)
            return subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)

        try:
            self._popen = _SpawnThread.get().run(start, _undo_start)
        except BaseException:  # it did not start (out of descriptors, say): our end too
            self._sock.close()
            raise
        finally:
            theirs.close()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        *,
        stacks_fd: int | None = None,
        stream: tuple[str, Sequence[int]] | None = None,
        output: tuple[int, int] | None = None,
    ) -> SupervisedProcess:
        """Start a worker (``argv``: the interpreter running :func:`phalanx.rank.runtime.main`,
        see :func:`phalanx.node.spawn.worker_argv`) with ``env`` in ``cwd``; returns at once
        (its pid arrives on the status pipe).

        Its control stream is a pair of pipes made here, unless ``stream`` hands over one
        already made: ``(spec, fds)``, a spec as the worker reads it from ``PHALANX_FD``, in
        which ``{i}`` stands for ``fds[i]`` (``"socket:{0}"``, ``"pipe:{0},{1}"``: read
        end, write end, or ``"handoff:{0}"`` for a process started before its rank is
        known).
        Its stdout and stderr are pipes made here, unless ``output`` names descriptors.
        The caller keeps its copies of what it hands over; the returned process holds our
        ends of what was made here (-1 for what was handed over).
        """
        made: list[int] = []  # every pipe end made here, until it is sent or kept

        def pipe() -> tuple[int, int]:
            ends = os.pipe()
            made.extend(ends)
            return ends

        try:
            read_fd = write_fd = stdout_fd = stderr_fd = -1
            if stream is None:
                (to_r, write_fd), (read_fd, from_w) = pipe(), pipe()
                spec, control = "pipe:{0},{1}", [to_r, from_w]
            else:
                spec, control = stream[0], list(stream[1])
                spec.format(*control)  # a spec naming a descriptor not handed over fails here
            if output is None:
                (stdout_fd, out_w), (stderr_fd, err_w) = pipe(), pipe()
                output = (out_w, err_w)
            status_fd, status_w = pipe()
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        n = len(control)  # the rank's descriptors: control..., stdout, stderr, status, stacks
        theirs = [*control, *output, status_w]
        fd_env = {config.ENV_FD: spec}
        passed = list(range(n))
        if stacks_fd is not None:
            theirs.append(stacks_fd)
            fd_env[config.ENV_STACKS_FD] = f"{{{n + 3}}}"
            passed.append(n + 3)
        env = dict(env)
        preload = [m for m in env.pop(config.ENV_PRELOAD, "").split(",") if m]
        path = [p for p in env.pop(config.ENV_PRELOAD_PATH, "").split(os.pathsep) if p]
        request: StartRequest = {
            "argv": list(argv), "env": env, "cwd": cwd, "pass": passed,
            "stdout": n, "stderr": n + 1, "status": n + 2, "fd_env": fd_env,
            "pid_env": config.ENV_PARENT_PID, "batch": rank_scheduling(env) == "batch",
            "preload": preload, "preload_path": path, "forked": False, "why_not": "",
        }
        mine = [fd for fd in (read_fd, write_fd, stdout_fd, stderr_fd, status_fd) if fd >= 0]
        try:
            with self._lock:  # (a plain dict of it: marshal's types know no TypedDict)
                socket.send_fds(self._sock, [marshal.dumps(dict(request))], theirs)
        except OSError as exc:
            for fd in mine:
                os.close(fd)
            raise OSError(f"the node supervisor (pid {self.pid}) is gone: {exc}") from exc
        finally:
            for fd in made:
                if fd not in mine:
                    os.close(fd)
        return SupervisedProcess(status_fd, read_fd, write_fd, stdout_fd, stderr_fd)

    def close(self, timeout: float = 5.0) -> None:
        """End the supervisor; it kills whatever is still below it first."""
        self._sock.close()
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - it only kills and reaps
            logger.error("node supervisor pid %d did not exit; killing it", self.pid)
            self._popen.kill()
            self._popen.wait()


def _undo_start(popen: subprocess.Popen[bytes]) -> None:
    popen.kill()
    popen.wait()


_SLICE = 0.1  # seconds: the longest a status wait sleeps before looking again
_REAPED_WAIT = 0.05  # s: a reaped worker's keeper writes its status at once


_noted: set[str] = set()


def _note_once(why: str) -> None:
    """Say once per process why ranks start as fresh interpreters despite ``preload``."""
    if why not in _noted:
        _noted.add(why)
        logger.warning("ranks start without their preloaded modules: %s", why)


class SupervisedProcess:
    """One worker started by the node supervisor, as its starter (the controller, or a Ray
    rank actor) sees it.

    Its status pipe is the death event: it turns readable with the exit record (after the
    pid record, read on the way), and reads end of file once the keeper has ended what the
    worker left behind (:meth:`wait_cleaned`).
    """

    def __init__(self, status_fd: int, read_fd: int, write_fd: int, stdout_fd: int,
                 stderr_fd: int) -> None:
        self.death_fd: int | None = status_fd
        os.set_blocking(status_fd, False)
        self.read_fd, self.write_fd = read_fd, write_fd
        self.stdout_fd, self.stderr_fd = stdout_fd, stderr_fd
        self._lock = threading.Lock()
        self._buffer = b""
        self._pid: int | None = None
        self._code: int | None = None
        self._error: str | None = None
        self._ended = False  # the keeper closed the pipe: its cleanup is over

    # -- the status pipe --------------------------------------------------------------

    def _read(self, timeout: float | None) -> None:
        """Take what the keeper wrote, waiting up to ``timeout`` for something (the wait
        holds no lock: the dispatcher may look at the same pipe meanwhile)."""
        fd = self.death_fd
        if fd is None or self._ended:
            return
        if timeout != 0:
            try:
                streams.wait_readable([fd], timeout)
            except OSError:  # released meanwhile
                return
        with self._lock:
            if self.death_fd is None or self._ended:
                return
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                return
            if not data:
                self._ended = True
                if self._code is None:  # the keeper itself was killed, and the rank with it
                    self._code = 127 if self._pid is None else -signal.SIGKILL
                return
            *lines, self._buffer = (self._buffer + data).split(b"\n")
            for line in lines:  # the keeper's lines: "pid N", "status N", "error TEXT"
                what, _, value = line.decode(errors="replace").partition(" ")
                if what == "pid":
                    self._pid = int(value)
                elif what == "error":
                    self._error = value
                    logger.error("could not start a worker: %s", value)
                    self._code = 127
                elif what == "status":
                    self._code = os.waitstatus_to_exitcode(int(value))
                elif what == "note":  # not forked from the preloaded modules: why
                    _note_once(value)

    def _until(self, done: Any, timeout: float | None) -> None:
        if timeout == 0:  # one look (a death's path makes several: each one read)
            if not done():
                self._read(0)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        left = timeout
        while not done() and not self._ended and self.death_fd is not None:
            # at least once, even with no time to wait; in slices, as another thread may
            # take what arrives (the relay's death watch) and leave this one waiting
            self._read(_SLICE if left is None else min(left, _SLICE))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._read(0)
                return

    @property
    def pid(self) -> int | None:
        """The worker's pid (None if it could not be started)."""
        self._until(lambda: self._pid is not None or self._code is not None,
                    config.SPAWN_TIMEOUT)
        return self._pid

    @property
    def start_error(self) -> str | None:
        return self._error

    def exitcode(self, timeout: float | None = 0.0) -> int | None:
        """The exit code (negative: killed by that signal); None if still running after
        ``timeout``."""
        self._until(lambda: self._code is not None, timeout)
        return self._code

    def alive(self) -> bool:
        return self.exitcode(0) is None

    def wait_cleaned(self, timeout: float) -> bool:
        """Wait until the keeper has ended what the worker left behind; True too when the
        status pipe was released meanwhile (its owner forgot the rank, whose keeper goes on
        cleaning up: nothing is left to wait on here)."""
        self._until(lambda: False, timeout)
        return self._ended or self.death_fd is None

    # -- signals ----------------------------------------------------------------------

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the worker, its process group and its descendants."""
        pid = self.pid
        if pid is None or self._code is not None:
            return
        proctree.signal_descendants(pid, sig)
        self.signal_group(sig)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the worker alone, unless it is known to have exited: cheap (no look at
        ``/proc``), as its keeper ends whatever it left behind once it exits."""
        if self.exitcode(0) is not None or self._pid is None:
            return
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def look_for_exit(self) -> int | None:
        """The exit code, if the worker has exited, without waiting for its keeper's word:
        its control stream just ended, which the kernel does as the process exits, a
        moment before the keeper is woken to reap it and write the status (about a
        millisecond of scheduling on a small machine, which every death would wait). An
        exiting worker's status (a zombie's, or one still tearing itself down: see
        :func:`~phalanx.node.proctree.exit_status`) is read from ``/proc``; a worker reaped
        already had its status told first (its keeper tells, then reaps), read within
        ``_REAPED_WAIT``. None: it still runs (or its keeper is slow); the status follows
        on the pipe as always."""
        code = self.exitcode(0)
        if code is not None or self._pid is None:
            return code
        status = proctree.exit_status(self._pid)
        if status is not None:
            with self._lock:
                if self._code is None:
                    self._code = os.waitstatus_to_exitcode(status)
            return self._code
        if proctree.state(self._pid) is None:  # reaped: the keeper is writing its status
            return self.exitcode(_REAPED_WAIT)
        return None

    def signal_group(self, sig: int) -> None:
        pid = self.pid
        if pid is None or self._code is not None:
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def release(self) -> None:
        with self._lock:
            if self.death_fd is not None:
                os.close(self.death_fd)
                self.death_fd = None
