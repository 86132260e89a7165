"""Where workers run. Each backend starts worker processes and hands back, per rank, a
connected :class:`~phalanx.wire.Connection` plus a way to learn how the process ended; the
group, the dispatcher and the worker loop are the same for all of them.
"""

from __future__ import annotations

from phalanx.backends.base import Backend, WorkerHandle, WorkerSpec

BACKENDS = ("local",)


def create_backend(name: str, *, echo_output: bool = True) -> Backend:
    """Instantiate a backend by name; ``ValueError`` naming the known ones otherwise."""
    if name == "local":
        from phalanx.backends.local import LocalBackend

        return LocalBackend(echo_output=echo_output)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "WorkerHandle", "WorkerSpec", "create_backend"]
