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
(SIGTERM, caught) and each ends its rank's whole tree, all of which is below it.

The controller sends one message per rank to start (JSON, plus the descriptors the rank
gets) over a ``SOCK_SEQPACKET`` socket. Nothing else passes through the supervisor: control
streams, output, signals and the status pipe go straight between the controller and the
rank.

"The controller" is whoever started the supervisor: the group's controller process for its
local ranks, or a Ray rank actor for its rank (then the actor's death, however it comes,
ends the rank's whole tree). The same code is what a cluster agent runs for its node.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx import config, proctree

logger = logging.getLogger(__name__)

_ENV_SOCKET = "PHALANX_SUPERVISOR_FD"
_MAX_REQUEST = 1 << 20
_MAX_FDS = 16
# It needs the standard library and phalanx only: without ``site`` (-S) it starts ~10 ms
# sooner, which a Ray rank waits for (its interpreter is started by the supervisor).
_BOOT = "import sys; sys.path.insert(0, {root!r}); from phalanx.supervisor import main; main()"

# --------------------------------------------------------------------------- node side


def main() -> None:
    """The supervisor process: serve start requests until the controller goes away."""
    # Started from a thread of a Ray worker, this process inherits its blocked and ignored
    # signals: a keeper must receive the SIGTERM that says the supervisor died, and wait
    # for its rank (an ignored SIGCHLD would reap it unseen).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the controller's
    sock = socket.socket(fileno=int(os.environ.pop(_ENV_SOCKET)))
    parent = int(os.environ.pop(config.ENV_PARENT_PID, "0"))
    proctree.become_subreaper()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    try:
        controller = os.pidfd_open(parent)
        poller.register(controller, select.POLLIN)
    except (AttributeError, OSError):  # gone already, or an old kernel: EOF tells alone
        controller = -1
    keepers: dict[int, int] = {}  # pid -> pidfd (-1 without one)
    try:
        if parent and os.getppid() != parent:
            return
        while True:
            events = dict(poller.poll(1000))
            if controller in events:
                return
            if sock.fileno() in events:
                try:
                    request, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, _MAX_FDS)
                except OSError:
                    return
                if not request:
                    return
                pid = _fork_keeper(request, fds, sock, controller)
                keepers[pid] = _watch(poller, pid)
            _reap(keepers, poller)
    finally:
        proctree.kill_descendants()


def _watch(poller: select.poll, pid: int) -> int:
    """A pidfd for a keeper, polled: it is reaped as soon as it exits, so that nobody
    waiting for it (its pid is the rank's parent) waits for the next timeout of the poll."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # an old kernel: reaped within the poll's timeout
        return -1
    poller.register(pidfd, select.POLLIN)
    return pidfd


def _reap(keepers: dict[int, int], poller: select.poll) -> None:
    """Reap keepers that ended; a keeper killed before its cleanup leaves orphans here."""
    killed = False
    for pid, status in proctree.reap_children():
        pidfd = keepers.pop(pid, None)
        if pidfd is None:
            continue
        if pidfd >= 0:
            poller.unregister(pidfd)
            os.close(pidfd)
        killed |= os.WIFSIGNALED(status)
    if killed:  # its rank and what the rank started were re-parented to us: end them
        me, table = os.getpid(), proctree.parent_table()
        orphans = [pid for pid, (ppid, _) in table.items() if ppid == me and pid not in keepers]
        for orphan in orphans:  # not the other keepers' ranks, which live on
            for pid in (orphan, *proctree.descendants(orphan, table)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _fork_keeper(request: bytes, fds: list[int], sock: socket.socket, controller: int) -> int:
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:  # the keeper
        code = 1
        try:
            sock.close()
            if controller >= 0:
                os.close(controller)
            code = _keep(json.loads(request), fds, supervisor)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _keep(request: dict[str, Any], fds: list[int], supervisor: int) -> int:
    """Start one rank, report its pid and exit status, then end what it left behind."""
    proctree.become_subreaper()
    signal.signal(signal.SIGTERM, _orphaned)
    proctree.die_with_parent(signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the signal was armed
        return 1
    status = fds[request["status"]]
    env = dict(request["env"])
    for key, template in request["fd_env"].items():
        env[key] = template.format(*fds)
    env[config.ENV_PARENT_PID] = str(os.getpid())
    try:
        proc = subprocess.Popen(
            request["argv"], env=env, cwd=request["cwd"],
            pass_fds=[fds[i] for i in request["pass"]], stdin=subprocess.DEVNULL,
            stdout=fds[request["stdout"]], stderr=fds[request["stderr"]], process_group=0,
        )
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        _report(status, error=f"{type(exc).__name__}: {exc}")
        return 1
    for fd in fds:
        if fd != status:
            os.close(fd)
    _report(status, pid=proc.pid)
    while True:
        pid, code = os.waitpid(-1, 0)  # adopted orphans that exit are reaped here too
        if pid == proc.pid:
            break
    _report(status, status=code)
    proctree.kill_descendants()
    return 0


def _orphaned(signum: int, frame: Any) -> None:
    """The supervisor died without ending us (SIGKILLed): end the rank's tree, all of which
    is below this keeper, and go."""
    proctree.kill_descendants()
    os._exit(1)


def _report(fd: int, **record: Any) -> None:
    try:
        os.write(fd, json.dumps(record).encode() + b"\n")
    except OSError:  # the controller is gone: the supervisor ends us all
        pass


# --------------------------------------------------------------------------- controller side


class Supervisor:
    """The controller's handle on its node supervisor process."""

    def __init__(self) -> None:
        from phalanx import node

        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, _ENV_SOCKET: str(theirs.fileno()),
               config.ENV_PARENT_PID: str(os.getpid())}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

        def start() -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-S", "-c", _BOOT.format(root=root)], env=env,
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, process_group=0,
            )

        try:
            self._popen = node.spawn_thread().run(start, _undo_start)
        finally:
            theirs.close()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def spawn(
        self,
        env: Mapping[str, str],
        cwd: str | None,
        *,
        stacks_fd: int | None = None,
        stream: tuple[str, Sequence[int]] | None = None,
        output: tuple[int, int] | None = None,
    ) -> SupervisedProcess:
        """Start a worker interpreter (:func:`phalanx.worker.main`) with ``env`` in ``cwd``;
        returns at once (its pid arrives on the status pipe).

        Its control stream is a pair of pipes made here, unless ``stream`` hands over one
        already made: ``(spec, fds)``, a :func:`phalanx.worker._open_stream` spec in which
        ``{i}`` stands for ``fds[i]`` (``"socket:{0}"``, ``"pipe:{0},{1}"``: read end,
        write end, or ``"handoff:{0}"`` for a process started before its rank is known).
        Its stdout and stderr are pipes made here, unless ``output`` names descriptors.
        The caller keeps its copies of what it hands over; the returned process holds our
        ends of what was made here (-1 for what was handed over).
        """
        from phalanx import node

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
        request = {
            "argv": node.worker_argv(), "env": dict(env), "cwd": cwd, "pass": passed,
            "stdout": n, "stderr": n + 1, "status": n + 2, "fd_env": fd_env,
        }
        mine = [fd for fd in (read_fd, write_fd, stdout_fd, stderr_fd, status_fd) if fd >= 0]
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps(request).encode()], theirs)
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


def _undo_start(popen: subprocess.Popen) -> None:
    popen.kill()
    popen.wait()


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
                select.select([fd], [], [], timeout)
            except (OSError, ValueError):  # released meanwhile
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
            for line in lines:
                record = json.loads(line)
                if "pid" in record:
                    self._pid = record["pid"]
                elif "error" in record:
                    self._error = record["error"]
                    logger.error("could not start a worker: %s", self._error)
                    self._code = 127
                elif "status" in record:
                    self._code = os.waitstatus_to_exitcode(record["status"])

    def _until(self, done: Any, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        left = timeout
        while not done() and not self._ended and self.death_fd is not None:
            self._read(left)  # at least once, even with no time to wait
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
        """Wait until the keeper has ended what the worker left behind."""
        self._until(lambda: False, timeout)
        return self._ended

    # -- signals ----------------------------------------------------------------------

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the worker, its process group and its descendants."""
        from phalanx import node

        pid = self.pid
        if pid is None or self._code is not None:
            return
        node.signal_descendants(pid, sig)
        self.signal_group(sig)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

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
