"""The floor: a minimal hand-written pool, one worker process and one Pipe each,
protocol-5 pickling. Workers start with the "spawn" method (a fresh interpreter, as
phalanx's workers are; "fork" is unsafe in a threaded controller).

It has none of phalanx's features (no errors, no death handling beyond EOF, no logs); it
shows what a library on the same machine could approach.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from multiprocessing.connection import Connection, wait
from typing import Any


def _serve(conn: Connection, factory: Any) -> None:
    obj = factory()
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
        self._ctx = mp.get_context("spawn")
        self._factory = factory
        self.conns: list[Any] = [None] * n
        self.procs: list[Any] = [None] * n
        for i in range(n):
            self._spawn(i)
        for conn in self.conns:
            self._await_ready(conn)

    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self._factory), daemon=True)
        proc.start()
        child.close()
        self.conns[i] = parent
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
        """The result of worker ``i``'s call; raises EOFError as soon as the worker dies."""
        conn = self.conns[i]
        wait([conn, self.procs[i].sentinel])
        if not conn.poll():
            raise EOFError("worker died")
        return pickle.loads(conn.recv_bytes())  # EOFError at end of stream

    def call_watching(self, method: str, *args: Any) -> Any:
        """One call to worker 0 that returns (or raises EOFError) when the worker dies."""
        self.submit(0, method, *args)
        return self.watch(0)

    def restart(self, i: int) -> None:
        """Replace worker ``i`` (killing it if it still runs) with a fresh one."""
        proc = self.procs[i]
        if proc.is_alive():
            proc.kill()
        proc.join()
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
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
