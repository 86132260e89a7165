"""A Ray rank's output across the network, sealed: the actor's :class:`SealedOutput` frames
what the rank writes with its connection's keys (:mod:`phalanx.wire.seal`), and the
controller's :class:`OutputUnsealer` checks every frame before any of it is shown, so that
nothing else that reaches the controller's socket can pass for a rank's output. Over a Unix
socket (the same machine, the same user) output travels as it was written.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from phalanx.wire import seal

OUTPUT_CHUNK = 65536  # the most output bytes a sealed frame carries (a pipe's capacity)


class SealedOutput:
    """One output stream of a rank across the network: the rank writes to a pipe, and a
    thread here sends what it reads as frames sealed with the connection's keys
    (:mod:`phalanx.wire.seal`), so that nothing else that reaches the controller's socket
    can pass for the rank's output (:class:`OutputUnsealer` checks them there). Ends, with
    the connection, when every writer of the pipe has closed it."""

    def __init__(self, sock: socket.socket, auth: seal.FrameAuth) -> None:
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.settimeout(None)
        self._auth = auth
        self._read_fd, self.write_fd = os.pipe()
        self._thread = threading.Thread(target=self._relay, name="phalanx-output", daemon=True)

    def start(self) -> None:
        """Once the rank holds the write end: this process's copy is closed."""
        os.close(self.write_fd)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _relay(self) -> None:
        from phalanx.wire import framing

        try:
            while data := os.read(self._read_fd, OUTPUT_CHUNK):
                self._sock.sendall(b"".join(framing.seal_frames(framing.frame([data]),
                                                                self._auth)))
        except OSError:  # the controller is gone: nobody reads this output any more
            pass
        finally:
            os.close(self._read_fd)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


class OutputUnsealer:
    """The controller's side of a :class:`SealedOutput`: fed the bytes received, it returns
    the output in the frames that passed their tags (``b""`` while a frame is incomplete),
    and raises :class:`~phalanx.wire.streams.ConnectionLost` at the first that does not
    (or that is malformed or larger than a :class:`SealedOutput` makes one): the stream
    cannot be trusted from there on."""

    def __init__(self, auth: seal.FrameAuth) -> None:
        from phalanx.wire import framing

        self._data: bytes = b""
        self._pos = 0
        self._auth = auth
        self._reader = framing.FrameReader(self)  # read_into: this object is its byte source
        self._reader.limit = OUTPUT_CHUNK + 64  # the data, its tag and their lengths
        self._reader.max_segments = 2

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        """The frame reader's stream: what :meth:`__call__` was fed."""
        n = min(nbytes, len(self._data) - self._pos)
        if n <= 0:
            raise BlockingIOError
        buf[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def __call__(self, data: bytes) -> bytes:
        self._data, self._pos = data, 0
        out = []
        while self._pos < len(data):
            before = self._pos
            for segments in self._reader.recv_frames(block=False):
                if not self._auth.check(segments):
                    raise seal.FrameRejected(
                        f"output frame {self._auth.received} failed authentication (forged, "
                        "altered or out of order: something else wrote to the connection)")
                out += segments[:-1]
            if self._pos == before:  # pragma: no cover - a reader that took nothing
                break
        self._data = b""
        return b"".join(out)
