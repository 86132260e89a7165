"""The node supervisor process (see :mod:`phalanx.node.supervisor` for what it does and for the
controller's side): its request loop and the per-rank keepers it forks.

Its start-up is on a Ray rank's critical path, so it imports only the standard library
modules it uses, :mod:`phalanx.config` and :mod:`phalanx.node.proctree` (no ``typing``,
``logging`` or ``dataclasses``).
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import socket
import subprocess

from phalanx import config
from phalanx.node import proctree

ENV_SOCKET = "PHALANX_SUPERVISOR_FD"
_MAX_REQUEST = 1 << 20
_MAX_FDS = 16


def main() -> None:
    """The supervisor process: serve start requests until the controller goes away."""
    # Started from a thread of a Ray worker, this process inherits its blocked and ignored
    # signals: a keeper must receive the SIGTERM that says the supervisor died, and wait
    # for its rank (an ignored SIGCHLD would reap it unseen).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the controller's
    sock = socket.socket(fileno=int(os.environ.pop(ENV_SOCKET)))
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
            code = _keep(marshal.loads(request), fds, supervisor)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _keep(request: dict[str, object], fds: list[int], supervisor: int) -> int:
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
        _report(status, "error", f"{type(exc).__name__}: {exc}")
        return 1
    for fd in fds:
        if fd != status:
            os.close(fd)
    _report(status, "pid", proc.pid)
    while True:
        pid, code = os.waitpid(-1, 0)  # adopted orphans that exit are reaped here too
        if pid == proc.pid:
            break
    _report(status, "status", code)
    proctree.kill_descendants()
    return 0


def _orphaned(signum: int, frame: object) -> None:
    """The supervisor died without ending us (SIGKILLed): end the rank's tree, all of which
    is below this keeper, and go."""
    proctree.kill_descendants()
    os._exit(1)


def _report(fd: int, what: str, value: object) -> None:
    """One line on the status pipe: ``pid N``, ``status N`` (a wait status) or
    ``error TEXT``."""
    text = " ".join(str(value).split())  # one line
    try:
        os.write(fd, f"{what} {text}\n".encode())
    except OSError:  # the controller is gone: the supervisor ends us all
        pass


