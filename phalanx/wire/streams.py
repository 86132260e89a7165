"""Byte streams between two processes, and the self-pipe that wakes a poll loop.

A :class:`Stream` is what :mod:`phalanx.wire.framing` frames travel over: a pair of pipes between
processes on one machine (:class:`PipeStream`), a connected socket otherwise
(:class:`SocketStream`). Reads may block; writes never do.
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import math
import os
import select

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    import socket
    import ssl
    from typing import Any

# socket is imported where a socket is used, not with this module: a local rank's stream
# is a pair of pipes, and socket's Python layer is several ms of its start.

MAX_SEGMENTS = 512  # buffers per writev/sendmsg call, well under IOV_MAX
_SOCKET_BUFFER = 4 * 1024 * 1024
_PIPE_BUFFER = 1024 * 1024  # the default /proc/sys/fs/pipe-max-size
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)



class ConnectionLost(Exception):
    """The peer closed the stream or the socket failed (internal, never reaches users)."""

class Stream:
    """A byte stream to one peer: where frames are read from and written to.

    ``read_into`` blocks only when ``block`` is true and the stream supports it;
    ``write_nowait`` never blocks and returns how many bytes were taken.
    """

    read_fd: int
    write_fd: int
    hangup_events: int  # poll() mask that reports the peer going away without reading data
    # a descriptor os.write() takes a frame's bytes on without blocking, whole or in part
    # (a pipe's non-blocking write end), or -1 (a socket, TLS): write_nowait, one hop less
    direct_write_fd = -1
    # the lock a non-blocking read of read_fd holds, which close() takes to retire the
    # number (a compiled read takes it too: phalanx.wire._speedups); None: reads need none
    read_lock: Any = None

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        raise NotImplementedError

    def read_chunk(self, buf: Any) -> int:
        """A non-blocking :meth:`read_into` of the whole of ``buf``: what a poll loop
        reads each time the stream is readable."""
        return self.read_into(buf, len(buf), False)

    def write_nowait(self, segments: list[Any]) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SocketStream(Stream):
    """A connected stream socket (Unix or TCP), used in both directions."""

    def __init__(self, sock: socket.socket) -> None:
        import socket

        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
            except OSError:  # pragma: no cover - the kernel caps it, which is fine
                pass
        self.sock = sock
        self.read_fd = self.write_fd = sock.fileno()
        self.hangup_events = getattr(select, "POLLRDHUP", 0)
        self._dontwait = socket.MSG_DONTWAIT

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        return self.sock.recv_into(buf, nbytes, 0 if block else self._dontwait)

    def write_nowait(self, segments: list[Any]) -> int:
        if len(segments) == 1:
            return self.sock.send(segments[0], self._dontwait)
        return self.sock.sendmsg(segments[:MAX_SEGMENTS], (), self._dontwait)

    def close(self) -> None:
        close_socket(self.sock)


class TLSStream(Stream):
    """A TLS connection (``ssl.SSLSocket``, non-blocking underneath). One OpenSSL object
    must not be driven by two threads at once, so every read and write holds a lock; a
    blocking read waits for the socket outside it. Writes copy their segments into one
    buffer (TLS encrypts a copy anyway)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        import ssl
        import threading

        self.sock = sock
        self.read_fd = self.write_fd = sock.fileno()
        self.hangup_events = getattr(select, "POLLRDHUP", 0)
        self._lock = threading.Lock()
        self._want = (ssl.SSLWantReadError, ssl.SSLWantWriteError)
        self.timeout: float | None = None  # how long a blocking read may wait
        sock.setblocking(False)

    def pending(self) -> int:
        """Bytes decrypted already, which no poll() on the socket would announce."""
        return self.sock.pending()

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        while True:
            with self._lock:
                try:
                    return self.sock.recv_into(buf, nbytes)
                except self._want:
                    if not block:
                        raise BlockingIOError from None
            if not wait_readable([self.read_fd], self.timeout):
                raise TimeoutError("timed out waiting for the peer")

    def write_nowait(self, segments: list[Any]) -> int:
        data = segments[0] if len(segments) == 1 else b"".join(segments[:MAX_SEGMENTS])
        with self._lock:
            try:
                return self.sock.send(data)
            except self._want:
                raise BlockingIOError from None

    def close(self) -> None:
        close_socket(self.sock)


def socket_stream(sock: socket.socket) -> Stream:
    """The stream for a connected socket: TLS when it is wrapped in it."""
    import ssl

    return TLSStream(sock) if isinstance(sock, ssl.SSLSocket) else SocketStream(sock)


LINK_TIMEOUT = 15  # seconds of silence from the peer's kernel after which a link is cut


def tune_link(sock: socket.socket) -> None:
    """The options of every TCP link phalanx opens: ``TCP_NODELAY``, so that a small frame
    leaves at once (with Nagle's algorithm a second frame sent before the first is
    acknowledged waits for that acknowledgement, which the peer may delay 40 ms: a call to
    two ranks behind one agent reached the second 41-44 ms late), and :func:`keep_alive`."""
    import socket

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive and a user timeout, so a peer whose machine vanished, or a link cut
    without a FIN, is noticed within about ``LINK_TIMEOUT`` s, whether the connection
    carries nothing (the kernel probes it: idle 5 s, then every 3 s) or has data its peer
    never acknowledged (Linux's TCP_USER_TIMEOUT; retransmissions alone take 15 minutes)."""
    import socket

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3),
                          ("TCP_USER_TIMEOUT", LINK_TIMEOUT * 1000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def close_socket(sock: socket.socket) -> None:
    """Shut down, then close: the peer sees the end, and a thread of ours blocked in
    ``recv``/``accept`` on it wakes (``close`` alone does neither while one is blocked)."""
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class PipeStream(Stream):
    """A pair of pipes, one per direction: the local backend's transport.

    Pipes keep readers and writers on separate wait queues, so a reader asleep in
    ``read()`` is not woken each time its peer drains what it wrote (as a Unix socket
    reader is): one context switch per call instead of two. The read end blocks only if
    ``blocking_reads`` (the worker's main loop); the write end never blocks.

    A non-blocking read and :meth:`close` exclude each other, and a closed stream's reads
    and writes fail (``EBADF``): the controller's pump may read a rank's stream just as
    another thread closes it, and the number, free again, may be a new rank's pipe by
    then, whose first frames such a read would take (a fresh rank never heard).
    """

    def __init__(self, read_fd: int, write_fd: int, *, blocking_reads: bool) -> None:
        self.read_fd = read_fd
        self.write_fd = self.direct_write_fd = write_fd  # (non-blocking: set below)
        self.hangup_events = 0  # POLLHUP is always reported on a read end without writers
        self._blocking_reads = blocking_reads
        self._closing = _thread.allocate_lock()
        if not blocking_reads:
            self.read_lock = self._closing
        os.set_blocking(read_fd, blocking_reads)
        os.set_blocking(write_fd, False)
        for fd in (read_fd, write_fd):
            try:
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BUFFER)
            except OSError:  # above /proc/sys/fs/pipe-max-size: keep the default
                pass

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        if self._blocking_reads:  # the rank's own loop, which alone reads and closes it
            if not block:
                raise ValueError("non-blocking read on a blocking pipe")
            return self._read(buf, nbytes)
        with self._closing:  # _read, inlined for a whole buffer: the pump's every read
            if nbytes == len(buf):
                return os.readv(self.read_fd, (buf,))
            return self._read(buf, nbytes)

    def read_chunk(self, buf: Any) -> int:
        if self._blocking_reads:
            raise ValueError("non-blocking read on a blocking pipe")
        with self._closing:  # (see read_into)
            return os.readv(self.read_fd, (buf,))

    def _read(self, buf: Any, nbytes: int) -> int:
        if nbytes == len(buf):
            return os.readv(self.read_fd, (buf,))
        with memoryview(buf) as mv:
            return os.readv(self.read_fd, (mv[:nbytes],))

    def write_nowait(self, segments: list[Any]) -> int:
        if len(segments) == 1:
            return os.write(self.write_fd, segments[0])
        return os.writev(self.write_fd, segments[:MAX_SEGMENTS])

    def close(self) -> None:
        with self._closing:
            fds = (self.read_fd, self.write_fd)
            self.read_fd = self.write_fd = -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


class WakePipe:
    """A self-pipe that interrupts a thread blocked in ``poll()`` on its read end.

    :meth:`wake` may come from any thread at any moment, :meth:`close` among them (a
    burial thread posting a death as its group's dispatcher is released): the two exclude
    each other, and a wake-up after the close does nothing. Without that, a wake-up between
    the two ``os.close`` calls met a pipe with no reader (``BrokenPipeError`` in the waker's
    thread), and one after them wrote its byte to whatever descriptor had taken the write
    end's number since (another group's pipe, a rank's control stream). Any other failure
    of the write is a bug and is raised."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = _thread.allocate_lock()  # wake() against close()

    def wake(self) -> None:
        with self._lock:
            if self._write_fd < 0:  # closed: nobody is left to wake
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # a wake-up is already pending

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._write_fd < 0:  # closed already: the numbers may be others' by now
                return
            fds, self._write_fd = (self._write_fd, self.fd), -1
            for fd in fds:  # the write end first: no wake-up ever meets a pipe without reader
                try:
                    os.close(fd)
                except OSError:
                    pass


def wait_readable(fds: list[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` that are readable (or at their end) within ``timeout`` s (None: no
    limit), as ``select.select`` tells it, for descriptors of any number: ``select``
    refuses those from 1024 on (``FD_SETSIZE``), which a controller of a few hundred ranks
    holds, three descriptors each. Raises ``OSError(EBADF)`` for a descriptor that is not
    open, as ``select`` does."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    wait = -1 if timeout is None else max(0, math.ceil(timeout * 1000))  # ms
    ready = []
    for fd, events in poller.poll(wait):
        if events & select.POLLNVAL:
            raise OSError(errno.EBADF, f"descriptor {fd} is not open")
        ready.append(fd)
    return ready
