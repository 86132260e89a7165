"""The local backend: workers are child processes of the controller on this machine.

``nodes > 1`` simulates several nodes (distinct ``NODE_RANK`` values) on one machine.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from phalanx import node, streams, wire
from phalanx.backends.base import Backend, WorkerHandle, WorkerSpec
from phalanx.logs import LogPump, OutputOptions, OutputTap


class LocalWorker(WorkerHandle):
    def __init__(self, spec: WorkerSpec, proc: node.LocalProcess, conn: wire.Connection,
                 tap: OutputTap) -> None:
        self.rank = spec.rank
        self.node = spec.node
        self.pid = proc.pid
        self.proc = proc
        self.conn = conn
        self.death_fd = proc.death_fd
        self._tap = tap

    def exitcode(self, timeout: float = 0.0) -> int | None:
        return self.proc.exitcode(timeout)

    def kill(self) -> None:
        self.proc.signal_tree(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        self.proc.signal_group(sig)

    def wait_output_closed(self, timeout: float) -> bool:
        return self._tap.wait_closed(timeout)

    def stderr_tail(self) -> tuple[str, ...]:
        return self._tap.stderr_tail()


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *, output: OutputOptions | None = None) -> None:
        self._writer = wire.BacklogWriter()
        self._logs = LogPump(output)

    def _start(self, spec: WorkerSpec) -> WorkerHandle:
        proc = node.spawn_worker(spec.env, cwd=spec.cwd)
        try:
            tap = self._logs.attach(spec.rank, proc.stdout_fd, proc.stderr_fd)
        except BaseException:  # e.g. its log file vanished: it has no handle to stop it by
            node.stop_processes([proc], force=True)
            for fd in (proc.stdout_fd, proc.stderr_fd, proc.read_fd, proc.write_fd):
                os.close(fd)
            proc.release()
            raise
        stream = streams.PipeStream(proc.read_fd, proc.write_fd, blocking_reads=False)
        conn = wire.Connection(stream, self._writer)
        return LocalWorker(spec, proc, conn, tap)

    def _stop(self, handles: list[WorkerHandle], *, grace: float, force: bool) -> None:
        procs = [h.proc for h in handles if isinstance(h, LocalWorker)]
        node.stop_processes(procs, grace=grace, force=force)
        for proc in procs:
            proc.release()

    def wait_exited(self, handles: Sequence[WorkerHandle], timeout: float) -> None:
        node.wait_all_exit([h.proc for h in handles if isinstance(h, LocalWorker)], timeout)

    def close(self) -> None:
        self._logs.stop()
        self._writer.stop()
