"""An agent holding its node's copy of a controller's put objects (``group.put()``).

The controller sends each object once per node (HOLD, the pickle and its buffers as the
payload); the session writes it into a shared-memory block -- the node side's one holder,
:class:`phalanx.node.shm.Holder` -- and tells every rank of the node where it is (SHARE),
and every rank started there later too; at most ``config.AGENT_MAX_HELD`` objects at once,
each a descriptor of the agent's. DROP frees it: the ranks forget it (UNSHARE) and the
block goes once no rank maps it. Blocks live only in the agent's memory: they end with
the session, however it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.node import shm
from phalanx.wire import framing, protocol


class NodeObjects:
    """A session's put objects, and telling the node's ranks of them.

    ``lock`` is the session's: held while the ranks are told, and while the session adds a
    rank it launches to those ``ranks()`` returns, so that every rank hears of every
    object exactly once. A rank is anything with ``rank`` (its number) and ``conn``.
    """

    def __init__(self, lock: threading.Lock, ranks: Callable[[], list[Any]]) -> None:
        self._lock = lock
        self._ranks = ranks
        self._holder = shm.Holder()

    def check_room(self, ref_id: int) -> None:
        """Before a HOLD starts: OverLimit if it would hold one object more than
        ``config.AGENT_MAX_HELD`` (replacing one held already takes no room)."""
        held = len(self._holder.objects())
        if held >= config.AGENT_MAX_HELD and self._holder.where(ref_id) is None:
            raise agentwire.OverLimit(f"HOLD: the objects held are {held + 1}, over the "
                                      f"agent's limit of {config.AGENT_MAX_HELD} "
                                      "(phalanx.config.AGENT_MAX_HELD)")

    def hold(self, ref_id: int, token: str, writable: bool, payload: list[Any]) -> int:
        """HOLD: write the object into a block; every rank of the node hears of it. The
        block's size."""
        if not shm.supported():
            raise RuntimeError("this node cannot hold shared objects (it needs Linux's "
                               "memfd_create and /proc)")
        written = self._holder.write(payload)  # the copy is made before the lock is taken
        with self._lock:
            location = self._holder.keep(ref_id, token, written, writable=writable)
            for rank in self._ranks():
                _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))
        return written[0].capacity

    def drop(self, ref_id: int) -> None:
        """DROP: the object was freed."""
        with self._lock:
            if self._holder.where(ref_id) is None:
                return
            for rank in self._ranks():
                _send(rank, protocol.unshare_frame(rank.rank, ref_id))
            self._holder.drop(ref_id)

    def share_with(self, rank: Any) -> None:
        """A rank just launched (the session's lock held): where every object held now
        is."""
        for ref_id, token, location in self._holder.objects():
            _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))

    def close(self) -> None:
        self._holder.close()


def _send(rank: Any, frame: list[Any]) -> None:
    try:
        rank.conn.send(frame)
    except framing.ConnectionLost:
        pass  # its death is reported from the status pipe
