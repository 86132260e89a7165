"""The backend interface (template methods: public ``start``/``stop`` hold the shared checks,
subclasses implement ``_start``/``_stop``)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

from phalanx import wire


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one rank's process (pure data)."""

    rank: int
    node: int
    local_rank: int
    env: Mapping[str, str]
    cwd: str


class WorkerHandle(abc.ABC):
    """A started worker process as the controller sees it."""

    rank: int
    node: int
    pid: int | None
    conn: wire.Connection
    death_fd: int | None  # readable once the process has exited; None if the backend has none

    @abc.abstractmethod
    def exitcode(self, timeout: float = 0.0) -> int | None:
        """Exit code once ended (negative: killed by that signal); None if still running."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL the worker and everything it started."""

    @abc.abstractmethod
    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to the worker (and the processes of its process group)."""

    @abc.abstractmethod
    def wait_output_closed(self, timeout: float) -> bool:
        """Wait (bounded) until the worker's last output has been read."""

    @abc.abstractmethod
    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines the worker wrote to stderr."""


class Backend(abc.ABC):
    """Starts and stops the worker processes of one group."""

    name = "abstract"

    def start(self, specs: Sequence[WorkerSpec]) -> list[WorkerHandle]:
        """Start one process per spec; each handle's connection is ready for INIT."""
        if not specs:
            raise ValueError("no workers to start")
        handles: list[WorkerHandle] = []
        try:
            for spec in specs:
                handles.append(self._start(spec))
        except BaseException:
            self.stop(handles, grace=0.0, force=True)
            raise
        return handles

    def stop(self, handles: Sequence[WorkerHandle], *, grace: float, force: bool = False) -> None:
        """SIGTERM, wait up to ``grace`` s, SIGKILL, reap; returns when none is alive."""
        if handles:
            self._stop(list(handles), grace=grace, force=force)
        for handle in handles:
            handle.conn.close()

    def rendezvous_address(self) -> str:
        """The address rank 0's node is reachable at (``MASTER_ADDR``)."""
        return "127.0.0.1"

    @abc.abstractmethod
    def _start(self, spec: WorkerSpec) -> WorkerHandle: ...

    @abc.abstractmethod
    def _stop(self, handles: list[WorkerHandle], *, grace: float, force: bool) -> None: ...

    @abc.abstractmethod
    def wait_exited(self, handles: Sequence[WorkerHandle], timeout: float) -> None:
        """Wait up to ``timeout`` for the processes to exit on their own."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's own resources (threads, descriptors)."""
