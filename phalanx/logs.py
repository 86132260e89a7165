"""Streams workers' stdout and stderr to the controller, line by line, prefixed with the rank.

One thread per group reads every worker pipe (``poll``), forwards complete lines to
:mod:`phalanx.console` and keeps the last lines of each worker's stderr, which
:class:`~phalanx.errors.WorkerDied` quotes.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading

from phalanx import config, console
from phalanx.streams import WakePipe

logger = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("closed", "echo", "fd", "is_stderr", "partial", "prefix", "tail")

    def __init__(self, fd: int, prefix: str, is_stderr: bool, tail: collections.deque, echo: bool):
        self.fd = fd
        self.prefix = prefix
        self.is_stderr = is_stderr
        self.partial = b""
        self.tail = tail
        self.closed = threading.Event()
        self.echo = echo


class OutputTap:
    """What one worker process wrote: its stderr tail, and whether its pipes have closed."""

    def __init__(self, streams: list[_Stream], tail: collections.deque) -> None:
        self._streams = streams
        self._tail = tail

    def wait_closed(self, timeout: float) -> bool:
        """Wait (bounded) until the worker's pipes reach end of file: its last words are in."""
        for stream in self._streams:
            if not stream.closed.wait(timeout):
                return False
        return True

    def stderr_tail(self) -> tuple[str, ...]:
        return tuple(self._tail)


class LogPump:
    """The reader thread for all worker pipes of one group."""

    def __init__(self, echo: bool = True) -> None:
        self._echo = echo
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._new: list[_Stream] = []
        self._wake = WakePipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="phalanx-logs", daemon=True)
        self._thread.start()

    def attach(self, rank: int, stdout_fd: int, stderr_fd: int) -> OutputTap:
        """Start reading one worker's pipes (the pump owns and closes the descriptors)."""
        tail: collections.deque = collections.deque(maxlen=config.STDERR_TAIL_LINES)
        prefix = f"[rank {rank}]"
        streams = [
            _Stream(stdout_fd, prefix, False, collections.deque(maxlen=0), self._echo),
            _Stream(stderr_fd, prefix, True, tail, self._echo),
        ]
        for stream in streams:
            os.set_blocking(stream.fd, False)
        with self._lock:
            self._new.extend(streams)
        self._wake.wake()
        return OutputTap(streams, tail)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop after the pipes still open have drained (bounded by ``timeout``)."""
        self._stopping = True
        self._wake.wake()
        self._thread.join(timeout)
        for stream in list(self._streams.values()):
            self._close(stream)
        self._wake.close()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake.fd, select.POLLIN)
        while True:
            with self._lock:
                new, self._new = self._new, []
            for stream in new:
                self._streams[stream.fd] = stream
                poller.register(stream.fd, select.POLLIN)
            if self._stopping and not self._streams:
                return
            try:
                events = poller.poll(200 if self._stopping else None)
            except InterruptedError:  # pragma: no cover
                continue
            if self._stopping and not events:
                return  # pipes held open by stray grandchildren: stop waiting for them
            for fd, _ in events:
                if fd == self._wake.fd:
                    self._wake.drain()
                    continue
                stream = self._streams.get(fd)
                if stream is not None and not self._read(stream):
                    poller.unregister(fd)
                    self._close(stream)

    def _read(self, stream: _Stream) -> bool:
        """Forward complete lines; False at end of file."""
        try:
            data = os.read(stream.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            if stream.partial:
                self._emit(stream, stream.partial)
                stream.partial = b""
            return False
        data = stream.partial + data
        *lines, stream.partial = data.split(b"\n")
        for line in lines:
            self._emit(stream, line)
        return True

    def _emit(self, stream: _Stream, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        if stream.is_stderr:
            stream.tail.append(line)
        if stream.echo:
            console.write_line(stream.prefix, line, stderr=stream.is_stderr)

    def _close(self, stream: _Stream) -> None:
        if self._streams.pop(stream.fd, None) is not None:
            try:
                os.close(stream.fd)
            except OSError:
                pass
        stream.closed.set()
