"""What a backend may offer beyond reserving nodes and starting, signalling and stopping
ranks on them: each a typed part it has or not (as httpx's transports offer what they do).

A backend says what it offers once, in :attr:`Backend.capabilities
<phalanx.backends.base.Backend.capabilities>`, a :class:`Capabilities` whose fields are
the parts (None: not offered). The controller asks there, in the part that needs it, and
nowhere else; a part it lacks is a clear error naming the backend (:func:`lacking`), never
a method that returns None or raises NotImplementedError deep inside a call.

=================  ====================================================  =================
part               what it does                                          offered by
=================  ====================================================  =================
``objects``        holds put objects once on each node (``group.put``)   local, ray,
                                                                         cluster (Linux)
``kept_copies``    copies a kept result onto nodes of other machines     cluster
``slots``          reserves a resource pool's slots once                 local, ray, cluster
``code``           ships the controller's code to the nodes (``sync``)   cluster
``changing``       nodes that come and go while the group runs           cluster
``detaching``      ranks that outlive their controller (``detached=``),  cluster (flat)
                   handed to another (``px.attach``)
=================  ====================================================  =================

``shared_links`` says whether its channels may share one connection per node
(:attr:`Channel.link <phalanx.backends.base.Channel.link>`): a frame for several ranks
then crosses it once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.backends.held import HeldObject, KeptCopy, NodeAddress

if TYPE_CHECKING:
    from phalanx.backends.base import Backend, Channel
    from phalanx.world.pools import PoolSlot


class ObjectHolding(Protocol):
    """Holds put objects on the nodes of a group (``group.put()``, large arguments)."""

    def share(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        """Hold ``obj`` (its pickle and buffers, ``obj.segments``) once on each node of
        ``channels``, and tell each of their ranks where it is (SHARE, before any later
        message to it). Called again for ranks started later: a node that holds it
        already only tells them. Raises, naming the node, when a node cannot hold it."""

    def unshare(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        """Free ``obj`` on every node holding it; the ranks of ``channels`` forget it
        (UNSHARE). Never waits for a node: it may run on the thread that ends calls."""

    def released(self, channel: Channel, ref_id: int) -> None:
        """The rank of ``channel`` holds no view of freed object ``ref_id`` any more
        (RELEASED): a holder that reuses its blocks may reuse that one."""

    def segments(self, obj: HeldObject) -> list[Any] | None:
        """``obj``'s pickle and buffers as this backend holds them, for another group of
        the same backend to hold a copy of (its calls name the handle); None once freed."""


class KeptCopying(Protocol):
    """Copies results kept on one machine onto the nodes of other machines that read them."""

    def source_of(self, channel: Channel) -> NodeAddress | None:
        """Where other nodes fetch what ``channel``'s rank keeps (its node's agent)."""

    def copy_kept(self, copy: KeptCopy, channels: Sequence[Channel]) -> None:
        """Have each node of ``channels`` that cannot map ``copy.location`` (another
        machine than its producer's) hold a copy of it, fetched straight from the
        producer's node (``copy.source``), and tell its ranks where it is (SHARE
        ``copy.id``, before any later message to them). Raises, naming the node, when
        one cannot."""

    def release_copy(self, copy: KeptCopy) -> None:
        """Free ``copy`` on every node holding it. Never waits for a node."""


class SlotReservation(Protocol):
    """What a backend reserved for a resource pool (:meth:`SlotReserving.reserve_slots`)."""

    @property
    def gpus_per_worker(self) -> int:
        """What a group placed on it asks per rank (0 where the backend assigns GPUs)."""
        ...

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> Backend:
        """A fresh backend for one group whose rank i sits on ``slots[i]``, taking
        ``share`` of each slot (1/colocate)."""
        ...

    def release(self) -> None:
        """Free what was reserved (idempotent)."""
        ...


class SlotReserving(Protocol):
    """Reserves a resource pool's slots once, for groups placed on them later."""

    def reserve_slots(self, counts: Sequence[int], *, gpus: int,
                      resources: Mapping[str, float], timeout: float,
                      holder: str) -> SlotReservation:
        """``counts[n]`` slots on node ``n``, each with ``gpus`` GPUs and ``resources``,
        for the pool named ``holder``; raises, naming what is short (and who holds it),
        when they cannot be had. Never opens the backend."""
        ...


class CodeShipping(Protocol):
    """Ships the controller's code to the nodes (the cluster backend's ``sync``)."""

    def reload_code(self) -> str | None:
        """Make the code the controller has now what ranks started from now on run; its
        version (None: this configuration ships none)."""
        ...


class ChangingNodes(Protocol):
    """Nodes that may be lost or added while a group runs (agents found by DNS)."""

    def available_nodes(self) -> int:
        """How many nodes a group reserving now could have."""
        ...


class Detaching(Protocol):
    """Keeps a group's ranks running past its controller and hands them to another
    (``detached=True``, ``px.attach``; see :mod:`phalanx.controller.attach`)."""

    def detach(self, name: str, timeout: float | None, spec: bytes) -> None:
        """Have the nodes keep the group ``name`` for ``timeout`` s after this controller
        goes (None: no more), with ``spec``, its description, for the next one."""
        ...

    def attach_to(self, name: str, force: bool) -> None:
        """The ranks this backend starts next are those of detached group ``name``,
        taken over (``force``: even from a live controller) instead of launched."""
        ...

    def attaching(self) -> str | None:
        """The detached group whose ranks it takes over (:meth:`attach_to`), if any."""
        ...

    def describe(self, name: str) -> dict[str, Any]:
        """Detached group ``name`` as its nodes keep it: ``spec``, ``ranks``, ``holder``
        (the controller holding it, None while it waits), ``timeout``... (LookupError
        when no node keeps it). Asked before the backend opens."""
        ...

    def listing(self) -> list[dict[str, Any]]:
        """Every detached group the backend's nodes keep (as :meth:`describe`)."""
        ...

    def orphans(self, take: bool) -> list[list[Any]]:
        """The answers of calls whose controller left before they ended, as the nodes
        hold them: [rank, node, pid, call id, method, ok, segments] each (``take``:
        forgotten there)."""
        ...

    def leave(self) -> None:
        """Let go of the nodes without stopping their ranks (``group.detach()``)."""
        ...


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The parts a backend offers (None: not offered); see the module docstring."""

    objects: ObjectHolding | None = None
    kept_copies: KeptCopying | None = None
    slots: SlotReserving | None = None
    code: CodeShipping | None = None
    changing: ChangingNodes | None = None
    detaching: Detaching | None = None
    shared_links: bool = False


def lacking(backend_name: str, doing: str) -> NotImplementedError:
    """The error for a part the ``backend_name`` backend does not offer: it cannot
    ``doing`` ("hold shared objects")."""
    return NotImplementedError(f"the {backend_name} backend cannot {doing}")
