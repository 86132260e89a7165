"""An agent holding its node's copy of a controller's put objects (``group.put()``).

The controller sends each object once per node (HOLD, the pickle and its buffers as the
payload); the session writes it into a shared-memory block (:mod:`phalanx.node.shm`) and tells
every rank of the node where it is (SHARE), and every rank started there later too. DROP
frees it: the ranks forget it (UNSHARE) and the block goes once no rank maps it. Blocks
live only in the agent's memory: they end with the session, however it ends.
"""

from __future__ import annotations

import threading
from typing import Any

from phalanx.node import shm
from phalanx.wire import framing, protocol


class Holding:
    """Mixin of :class:`~phalanx.backends.cluster.agent.ranks.Session`: the node's shared
    objects."""

    _lock: threading.Lock
    _ranks: dict[int, Any]
    _launched: list[tuple[int, Any]]

    def _init_holding(self) -> None:
        self._blocks: dict[int, tuple[shm.Block, str, tuple]] = {}  # block, token, where

    def _hold(self, ref_id: int, token: str, writable: bool, payload: list[Any]) -> int:
        """HOLD: write the object into a block; every rank of the node hears of it."""
        if not shm.supported():
            raise RuntimeError("this node cannot hold shared objects (it needs Linux's "
                               "memfd_create and /proc)")
        block, layout = shm.Block.holding(payload)
        location = block.location(layout, writable=writable)
        with self._lock:  # a rank being launched now is in _launched: none is missed
            previous = self._blocks.pop(ref_id, None)
            self._blocks[ref_id] = (block, token, location)
            for rank in self._node_ranks():
                _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))
        if previous is not None:
            previous[0].close()
        return block.capacity

    def _drop(self, ref_id: int) -> None:
        """DROP: the object was freed."""
        with self._lock:
            held = self._blocks.pop(ref_id, None)
            if held is None:
                return
            for rank in self._node_ranks():
                _send(rank, protocol.unshare_frame(rank.rank, ref_id))
        held[0].close()

    def _node_ranks(self) -> list[Any]:
        """Every rank of the node, those being launched included (lock held)."""
        return [*self._ranks.values(), *(rank for _, rank in self._launched)]

    def _share_with(self, rank: Any) -> None:
        """A rank just launched (lock held): where every object held now is."""
        for ref_id, (_, token, location) in self._blocks.items():
            _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))

    def _end_holding(self) -> None:
        with self._lock:
            held, self._blocks = list(self._blocks.values()), {}
        for block, _, _ in held:
            block.close()


def _send(rank: Any, frame: list[Any]) -> None:
    try:
        rank.conn.send(frame)
    except framing.ConnectionLost:
        pass  # its death is reported from the status pipe
