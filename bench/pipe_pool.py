"""The floor: a minimal hand-written pool, one worker process and one duplex pipe (a Unix
socket pair, as ``multiprocessing.Pipe()``) each, protocol-5 pickling.

Each worker is a fresh interpreter (as phalanx's ranks are; fork is unsafe in a threaded
controller), started the way a hand-written pool would start it: ``python -c`` running
:func:`serve` of this module, which imports only the standard library. Its main module
has no file, so nothing of the benchmark that runs it is imported again in the child --
``multiprocessing``'s spawn would re-import the parent's main module (``bench.run`` and
everything it imports: phalanx among them, about 95 ms of CPU a child), which handicapped
the pool in earlier rounds. The worker class arrives pickled, as a rank's target does,
and is imported by reference (``bench.workloads``, standard library only) in both.

It has none of phalanx's features (no errors, no death handling beyond EOF, no logs); it
shows what a library on the same machine could approach.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection, wait
from typing import Any

# What each child runs: its connection's descriptor is its one argument.
_CHILD = "import sys; from bench.pipe_pool import serve; serve(int(sys.argv[1]))"
_STOP_TIMEOUT = 5.0  # s a worker has to exit once asked, before it is killed


def serve(fd: int) -> None:
    """A worker: build the object from the first message, then answer calls until EOF or
    ``(None, ())``."""
    conn = Connection(fd)
    obj = pickle.loads(conn.recv_bytes())()
    conn.send_bytes(b"ready")
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        method, args = pickle.loads(data)
        if method is None:
            return
        result = getattr(obj, method)(*args)
        conn.send_bytes(pickle.dumps(result, protocol=5))


class PipePool:
    def __init__(self, factory: Any, n: int) -> None:
        self._factory = pickle.dumps(factory, protocol=5)
        self.conns: list[Any] = [None] * n
        self.procs: list[Any] = [None] * n
        for i in range(n):
            self._spawn(i)
        for conn in self.conns:
            self._await_ready(conn)

    def _spawn(self, i: int) -> None:
        parent, child = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(child.fileno())],
                pass_fds=(child.fileno(),), cwd=_ROOT)
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send_bytes(self._factory)
        self.conns[i] = conn
        self.procs[i] = proc

    @staticmethod
    def _await_ready(conn: Connection) -> None:
        if conn.recv_bytes() != b"ready":
            raise RuntimeError("worker failed to start")

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def call(self, method: str, *args: Any) -> list[Any]:
        data = pickle.dumps((method, args), protocol=5)
        for conn in self.conns:
            conn.send_bytes(data)
        return [pickle.loads(conn.recv_bytes()) for conn in self.conns]

    def pipelined(self, method: str, count: int, window: int = 64) -> None:
        """``count`` calls to worker 0, keeping up to ``window`` in flight."""
        conn = self.conns[0]
        data = pickle.dumps((method, ()), protocol=5)
        sent = received = 0
        while received < count:
            while sent < count and sent - received < window:
                conn.send_bytes(data)
                sent += 1
            pickle.loads(conn.recv_bytes())
            received += 1

    def submit(self, i: int, method: str, *args: Any) -> None:
        """Send one call to worker ``i``; collect it with :meth:`watch`."""
        self.conns[i].send_bytes(pickle.dumps((method, args), protocol=5))

    def watch(self, i: int) -> Any:
        """The result of worker ``i``'s call; raises EOFError as soon as the worker dies
        (its end of the socket pair closes with it)."""
        conn = self.conns[i]
        wait([conn])
        return pickle.loads(conn.recv_bytes())  # EOFError at end of stream

    def call_watching(self, method: str, *args: Any) -> Any:
        """One call to worker 0 that returns (or raises EOFError) when the worker dies."""
        self.submit(0, method, *args)
        return self.watch(0)

    def restart(self, i: int) -> None:
        """Replace worker ``i`` (killing it if it still runs) with a fresh one."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.conns[i].close()
        self._spawn(i)
        self._await_ready(self.conns[i])

    def close(self) -> None:
        stop = pickle.dumps((None, ()), protocol=5)
        for conn in self.conns:
            try:
                conn.send_bytes(stop)
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where bench/ is
