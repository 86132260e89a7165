"""What both kinds of ``px.weight_sync`` share (:mod:`phalanx.controller.weightsync`, one
source rank's whole state dict; :mod:`phalanx.controller.shardsync`, every source rank's
parts to every target's regions): the sync's states, the stats of a push, the check of a
method's name before anything is sent, and letting the ranks go (how long closing waits;
the finalizer of a sync never closed).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from phalanx.controller.internals import internals
from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.controller.group import WorkerGroup

logger = logging.getLogger(__name__)

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


def release(sync_id: str, groups: list[WorkerGroup], close: str, wait: float | None) -> None:
    """Tell every live rank of the open ``groups`` to forget the sync (the built-in call
    ``close``), waiting up to ``wait`` s (None: not at all)."""
    futures = []
    for group in groups:
        if group.closed:
            continue
        ranks = [h.rank for h in group.health() if h.alive]
        if not ranks:
            continue
        try:
            futures.append(internals(group).send_builtin(close, ranks,
                                                         [(sync_id,)] * len(ranks)))
        except PhalanxError as exc:  # shut down or died meanwhile: its ranks hold nothing
            logger.debug("weight sync %s: group %s not told to close: %s", sync_id,
                         group.name, exc)
    if wait is None:
        return
    for future in futures:
        try:
            future.result(wait)
        except PhalanxError as exc:
            logger.warning("weight sync %s: closing it on group %s: %s", sync_id,
                           future.group_name, exc)


def release_quietly(sync_id: str, groups: list[WorkerGroup], close: str) -> None:
    """The finalizer of a sync collected without close(): from a thread of its own (a
    collection may run inside any call, in any thread, even a sync's own module's)."""
    def run() -> None:
        try:
            release(sync_id, groups, close, None)
        except Exception as exc:  # noqa: BLE001 - a finalizer has no caller to tell
            logger.debug("weight sync %s: release failed: %s", sync_id, exc)

    threading.Thread(target=run, daemon=True, name=f"phalanx-weight-sync-{sync_id}").start()
