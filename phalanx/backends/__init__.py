"""Where ranks run. A backend reserves nodes, launches one batch of ranks per node and hands
the group a :class:`~phalanx.backends.base.Channel` per rank (or per node) that delivers
events, several of them perhaps sharing a :class:`~phalanx.backends.base.Link` (an agent's
connection); the group, the dispatcher and the worker loop are the same for all of them.
See :mod:`phalanx.backends.base` for the boundary, :mod:`.parts` for what a backend may
offer beyond it and :mod:`.held` for what crosses it then; :mod:`.local`, :mod:`.ray` and
:mod:`.cluster` are the backends.

A backend may import :mod:`.base`, the node and rank sides and the layers below them;
never the controller, and never another backend (each stands alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.backends.base import (
        Backend,
        Boot,
        Channel,
        EventSink,
        Link,
        Node,
        RankStart,
        Receiver,
    )

_FROM_BASE = frozenset(("Backend", "Boot", "Channel", "EventSink", "Link", "Node",
                        "RankStart", "Receiver"))


def __getattr__(name: str) -> Any:
    """The boundary's names, from :mod:`.base` on first use: the node side (a Ray rank's
    actor, an agent) imports its backend's package without paying for the controller's
    half of it."""
    if name in _FROM_BASE:
        from phalanx.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

BACKENDS = ("local", "ray", "cluster", "slurm")


def create_backend(spec: str | Backend, **settings: Any) -> Backend:
    """A fresh, unopened backend for one group: by name (``"local"``, ``"ray"``,
    ``"cluster"``), built with ``settings`` (its constructor's keywords:
    ``create_backend("cluster", hosts=[...], token_file=...)``), or a copy of a configured
    one (``px.RayBackend(...)``), so one configuration serves many groups. Each backend is
    imported only when chosen (Ray is heavy). ``ValueError`` naming the known backends
    otherwise, or how to name the agents for ``"cluster"`` without settings."""
    from phalanx.backends.base import Backend

    if isinstance(spec, Backend):
        if settings:
            raise TypeError(f"settings {sorted(settings)} go with a backend's name; a "
                            f"{type(spec).__name__} object carries its own")
        copy = type(spec)(**spec.settings())
        copy.carry_over(spec)
        return copy
    if spec == "local":
        from phalanx.backends.local import LocalBackend

        return LocalBackend(**settings)
    if spec == "ray":
        from phalanx.backends.ray.backend import RayBackend

        return RayBackend(**settings)
    if spec == "cluster":
        if not settings:
            raise ValueError("the cluster backend needs its agents: give "
                             "backend=px.ClusterBackend(hosts=['host:port', ...]) or "
                             "px.ClusterBackend(dns='name')")
        from phalanx.backends.cluster.backend import ClusterBackend

        return ClusterBackend(**settings)
    if spec == "slurm":
        from phalanx.backends.cluster.slurm import SlurmBackend

        return SlurmBackend(**settings)
    raise ValueError(
        f"unknown backend {spec!r}; available: {', '.join(BACKENDS)} (or a backend object "
        "such as px.RayBackend(...))"
    )


__all__ = [
    "BACKENDS",
    "Backend",
    "Boot",
    "Channel",
    "EventSink",
    "Link",
    "Node",
    "RankStart",
    "Receiver",
    "create_backend",
]
