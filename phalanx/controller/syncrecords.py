"""What both kinds of ``px.weight_sync`` share (:mod:`phalanx.controller.weightsync`, one
source rank's whole state dict; :mod:`phalanx.controller.shardsync`, every source rank's
parts to every target's regions): the sync's states, the stats of a push, how long closing
waits, and the check of a method's name before anything is sent.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.controller.group import WorkerGroup

CLOSE_TIMEOUT = 10.0  # seconds close() waits for the members to let go


class SyncState(enum.Enum):
    """Where a :class:`~phalanx.controller.weightsync.WeightSync` is (the moves are in
    :mod:`phalanx.controller.weightsync`'s docstring).

    ``NEW``     constructed; nothing formed on any rank.
    ``FORMED``  the members hold the current generation: a push goes straight through
                (after checking that no member's process changed).
    ``BROKEN``  a push, or forming, failed: the next push forms the world again first.
    ``CLOSED``  closed by :meth:`WeightSync.close` (or collected); pushes raise
                GroupClosed.
    """

    NEW = "new"
    FORMED = "formed"
    BROKEN = "broken"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class PushStats:
    """What one push moved: ``bytes`` of ``tensors`` tensors to ``targets`` ranks, by
    ``transport``, in ``buckets`` buckets (0 for shared memory), in ``seconds``.

    A sync by parts (``src_rank="all"``, :mod:`phalanx.controller.shardsync`; transport
    ``"p2p"``) also gives the bytes each target rank received, ``per_target``:
    ``{(group name, rank): bytes}``, the seconds of each phase (``plan_s``: forming, 0.0
    when the last formation held; ``stage_s``, ``apply_s``; ``total_s`` is ``seconds``)
    and the ``version`` staged; its ``buckets`` are its transfers (source to target, one
    box of one tensor each), and ``targets`` the target ranks that completed the step."""

    transport: str
    tensors: int
    bytes: int
    targets: int
    buckets: int
    seconds: float
    formed: bool  # whether this push formed the world first
    per_target: Mapping[tuple[str, int], int] = dataclasses.field(default_factory=dict,
                                                                   hash=False)
    plan_s: float = 0.0
    stage_s: float = 0.0
    apply_s: float = 0.0
    version: int | None = None

    @property
    def total_s(self) -> float:
        return self.seconds


def check_method(group: WorkerGroup, name: str) -> None:
    """AttributeError naming the methods there are, as the group's calls raise (private
    names pass: the rank answers for them)."""
    methods = group.methods
    if name not in methods and not name.startswith("_"):
        raise AttributeError(f"group {group.name}'s workers have no method {name!r}; "
                             f"available: {', '.join(methods) or 'none'}")
