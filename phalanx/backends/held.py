"""What a backend holds on its nodes for the controller, as it crosses the boundary.

Two kinds of data live outside the controller and its frames:

- a **held object** (:class:`HeldObject`): ``group.put(obj)``'s pickle and buffers, or a
  call's large arguments (put for the length of the call), which a backend that offers
  :class:`~phalanx.backends.parts.ObjectHolding` holds once on each node of a group;
- a **kept copy** (:class:`KeptCopy`): a result kept on a rank of another group
  (``keep=True``) that this group's nodes on other machines than its producer's hold as
  a copy, fetched straight from the producer's node by a backend that offers
  :class:`~phalanx.backends.parts.KeptCopying`. Where the result itself is is a
  :data:`~phalanx.rank.kept.KeptLocation`, made by the producing rank.

Both are named by an id and a token: the id is the group's, the token (random) names the
memory of the object on a node, so that a rank never maps anything else by mistake. The
controller keeps its own record of each (its users, whether its handle was freed:
:mod:`phalanx.controller.refs`); a backend sees only these.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.rank.kept import BlockLocation

NodeAddress = tuple[str, int]  # how other nodes reach a node's agent: (host, port)


@dataclasses.dataclass(eq=False)
class HeldObject:
    """One put object, as a backend holds it."""

    id: int
    token: str
    # The pickle and its buffers, until a backend has its own copy (a node's block, Ray's
    # store; then it sets None) or the object is freed.
    segments: list[Any] | None
    nbytes: int
    label: str  # what it is, for messages ("ndarray", "the arguments of step()")
    private: bool = False  # a call's own arguments: each rank gets writable copies
    tensors: bool = False  # holds torch tensors (their views are writable copies)


@dataclasses.dataclass(frozen=True, eq=False)
class KeptCopy:
    """A kept result of another machine, as this group's nodes hold a copy of it: under
    the id and token of a held object (dropped as one)."""

    id: int
    token: str
    location: BlockLocation  # where the producer keeps it
    source: NodeAddress  # its producer's node (KeptCopying.source_of)

    @property
    def machine(self) -> str:
        """Whose memory the result is in: nodes of this machine map it, others copy it."""
        return self.location.machine
