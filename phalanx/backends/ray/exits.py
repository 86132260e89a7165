"""How a rank's actor process on the controller's machine ended, read by the controller
itself: the exit status of a process that is not its child.

A rank on Ray runs in its actor's worker process, whose parent is Ray's raylet: only the
raylet can wait for it. When the actor dies (a ``kill -9``, the out-of-memory killer), its
rank's control stream ends at once, but how it ended would otherwise come from two slower
places: its warden (:mod:`phalanx.node.warden`, another process, which reads the status
the kernel keeps for a zombie, and misses it when the raylet reaps the actor first) and
Ray's own account (the raylet, then Ray's control store, then this process: later than a
raw Ray actor's caller learns of the death).

:class:`ExitWatch` holds a *pidfd* for the actor process (``pidfd_open``, Linux 5.3),
opened while the actor is connected to the controller over its Unix socket (the peer's
pid as this machine's kernel gives it, ``SO_PEERCRED``; the peer still connected after
the pidfd is open proves that the pid named that process then). Its exit status is, in
the order the kernel has it:

- while its threads end: the code every one of them exits with, which ``/proc/PID/stat``
  shows for the process (``exit_code``) once its ``flags`` say it is exiting
  (``PF_EXITING``). A process's descriptors close when its last thread has let go of
  them, after each set that code: so when the rank's stream ends because its process
  dies, the status is there already, a few ms before the process is gone;
- while it is a zombie: the same field;
- once reaped, by whoever: the record the kernel keeps for the pidfd
  (``ioctl(PIDFD_GET_INFO)`` with ``PIDFD_INFO_EXIT``, Linux 6.15).

Each reading of ``/proc`` is followed by a look at that record: the process not reaped yet
means the pid was still its own when read. None where neither says (it still runs; an
older kernel whose raylet reaped the actor first): the other accounts then tell it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import socket
import struct
import threading
import time

from phalanx.node.proctree import stat_fields

logger = logging.getLogger(__name__)

# ioctl(pidfd, PIDFD_GET_INFO, struct pidfd_info *): _IOWR(0xFF, 11, struct pidfd_info)
# of the structure's first version (64 bytes), whose last field is exit_code
_INFO_SIZE = 64
PIDFD_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11
PIDFD_INFO_EXIT = 1 << 3  # in the request's mask: the exit status; in the answer's: known
_MASK = struct.Struct("=Q")  # struct pidfd_info's first field
_EXIT_CODE = struct.Struct("=i")  # its exit_code: a wait status
_EXIT_CODE_OFFSET = 60
_CRED = struct.Struct("=3i")  # struct ucred: pid, uid, gid
_NO_INFO = (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP)  # a kernel without the ioctl
PF_EXITING = 0x4  # in a task's flags (include/linux/sched.h): it is in do_exit()
# /proc/PID/stat, past the command's closing parenthesis: state (field 3), flags (9),
# exit_code (52, Linux 3.5)
_STATE, _FLAGS, _EXIT_FIELD = 0, 6, 49
_BEING_REAPED = 0.005  # seconds: the longest look at a process between zombie and reaped


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of the Unix socket ``sock`` (as it was when
    it connected), in this process's pid namespace; None where the kernel does not say
    (another namespace, not a Unix socket, no ``SO_PEERCRED``)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, _, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _CRED.size))
    except OSError:
        return None
    return pid if pid > 0 else None


def _peer_connected(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has not hung up (it sends nothing before its pipes)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def exiting_status(pid: int) -> int | None:
    """The wait status ``pid`` ends with, from ``/proc/PID/stat``, once it is known there:
    a zombie's, or an exiting process's (``PF_EXITING``, a code set); None while it runs,
    once it is gone, or where the kernel does not say."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        state, flags, code = fields[_STATE], int(fields[_FLAGS]), int(fields[_EXIT_FIELD])
    except (IndexError, ValueError):
        return None
    if state == b"Z" or (flags & PF_EXITING and code):
        return code
    return None


class ExitWatch:
    """One process of this machine, watched for its end through a pidfd (see the
    module's docstring). Thread-safe: once :meth:`close` returned (it waits for a look
    under way, a moment), the pidfd is not used again."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self._info = True  # whether the kernel may know PIDFD_GET_INFO

    @classmethod
    def of_peer(cls, sock: socket.socket) -> ExitWatch | None:
        """A watch of the process connected at the other end of ``sock``, or None where
        it cannot be had (see :func:`peer_pid`; no pidfds on this system)."""
        pid = peer_pid(sock)
        opener = getattr(os, "pidfd_open", None)
        if pid is None or opener is None:
            return None
        try:
            fd = opener(pid)
        except OSError as exc:  # gone already, or pidfds not allowed here
            logger.debug("no pidfd for process %d: %s", pid, exc)
            return None
        if not _peer_connected(sock):  # the pid may name another process by now
            os.close(fd)
            return None
        return cls(pid, fd)

    def ended(self, timeout: float = 0.0) -> bool:
        """Whether the process is gone (a zombie whose threads all ended, or reaped),
        waiting up to ``timeout`` s for it (keep it short: :meth:`close` waits for it);
        True once closed."""
        with self._lock:
            if self._fd is None:
                return True
            return self._gone(self._fd, timeout)

    @staticmethod
    def _gone(fd: int, timeout: float) -> bool:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, round(timeout * 1000))))

    def status(self) -> int | None:
        """Its exit status as soon as the kernel has it (see the module's docstring): the
        exit code, or minus the signal that killed it; None while it runs, where the
        kernel no longer says, or once closed. A process being reaped at that moment is
        neither a zombie nor reaped yet: it is looked at again, ``_BEING_REAPED`` s at
        most."""
        deadline = time.monotonic() + _BEING_REAPED
        while True:
            with self._lock:
                if self._fd is None:
                    return None
                found = self._reaped_status(self._fd)
                if found is not None:
                    return found
                read = exiting_status(self.pid)
                # reaped meanwhile: the kernel's record; not reaped after the reading: it
                # was this process's (its pid is not free for another until then)
                found = self._reaped_status(self._fd)
                if found is None and read is not None:
                    found = os.waitstatus_to_exitcode(read)
                between = found is None and self._info and self._gone(self._fd, 0)
            if not between or time.monotonic() >= deadline:
                return found
            time.sleep(_BEING_REAPED / 20)

    def _reaped_status(self, fd: int) -> int | None:
        """The exit status the kernel keeps for the process once reaped (Linux 6.15)."""
        if not self._info:
            return None
        info = bytearray(_INFO_SIZE)
        _MASK.pack_into(info, 0, PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(fd, PIDFD_GET_INFO, info)
        except OSError as exc:
            if exc.errno in _NO_INFO:
                self._info = False
            return None
        (mask,) = _MASK.unpack_from(info, 0)
        if not mask & PIDFD_INFO_EXIT:
            return None
        (status,) = _EXIT_CODE.unpack_from(info, _EXIT_CODE_OFFSET)
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
