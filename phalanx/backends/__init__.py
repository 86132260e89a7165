"""Where workers run. Each backend starts worker processes and hands back, per rank, a
connected :class:`~phalanx.wire.Connection` plus a way to learn how the process ended; the
group, the dispatcher and the worker loop are the same for all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.backends.base import Backend, WorkerHandle, WorkerSpec

if TYPE_CHECKING:
    from phalanx.logs import OutputOptions

BACKENDS = ("local",)


def create_backend(name: str, *, output: OutputOptions | None = None) -> Backend:
    """Instantiate a backend by name; ``ValueError`` naming the known ones otherwise."""
    if name == "local":
        from phalanx.backends.local import LocalBackend

        return LocalBackend(output=output)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "WorkerHandle", "WorkerSpec", "create_backend"]
