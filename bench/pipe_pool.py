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
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, factory), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if conn.recv_bytes() != b"ready":
                raise RuntimeError("worker failed to start")

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

    def call_watching(self, method: str, *args: Any) -> None:
        """One call to worker 0 that returns (or raises EOFError) when the worker dies."""
        conn = self.conns[0]
        conn.send_bytes(pickle.dumps((method, args), protocol=5))
        wait([conn, self.procs[0].sentinel])
        if not self.procs[0].is_alive() or not conn.poll():
            raise EOFError("worker died")
        pickle.loads(conn.recv_bytes())

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
