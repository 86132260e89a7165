"""The GPUs of an agent's node, held across every controller it serves.

One :class:`NodeDevices` per agent process: each session (one controller's connection)
takes devices from it for a holder it names (a pool, a group: "pool-1 of the controller on
host, pid 4242"), and a request for devices another holder has is refused with the book's
account of who holds what and what is free (:class:`phalanx.world.devices.DeviceBook`).
A holder gives its devices back by asking for none; whatever a session still holds when it
ends (its controller closed the connection, was killed, or went silent) is free again.

A holder's name belongs to the session that first took devices under it while it holds
them: another session asking under the same name is refused, so that no controller can
free, or take over, what another holds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from phalanx.errors import DevicesTaken, printable
from phalanx.world.devices import DeviceBook


class NodeDevices:
    """The node's GPUs (the ids its ranks may be given), and who holds which."""

    def __init__(self, gpus: Sequence[str]) -> None:
        self.gpus = tuple(gpus)
        self._book = DeviceBook()
        self._owners: dict[str, object] = {}  # holder -> the session that holds for it
        self._lock = threading.Lock()

    def take(self, owner: object, count: int, holder: str) -> dict[str, Any]:
        """``count`` GPUs for ``holder`` (what it held before is given back first; 0: only
        that) -> ``{"gpus": [...]}``, or ``{"refused": why}`` taking nothing. The name is
        shown to other controllers (in their refusals) and in ``/health``: one that is not
        printable text (no line break, no terminal escape) is refused; its length is bounded
        where the request is read (``messages``)."""
        if not isinstance(holder, str) or not holder.isprintable():
            return {"refused": "a holder's name must be printable text, not "
                               f"{printable(holder, 80)!r}"}
        with self._lock:
            other = self._owners.get(holder)
            if other is not None and other is not owner:
                return {"refused": f"another controller's session holds GPUs as {holder!r}; "
                                   "a holder's name is its own while it holds them"}
            self._book.give_back(holder)
            self._owners.pop(holder, None)
            if count == 0:
                return {"gpus": []}
            try:
                taken = self._book.take(count, holder, self.gpus)
            except DevicesTaken as exc:
                return {"refused": str(exc)}
            self._owners[holder] = owner
            return {"gpus": list(taken)}

    def release(self, owner: object) -> list[str]:
        """Every holder of ``owner`` (a session that ended) gives its GPUs back -> their
        names."""
        with self._lock:
            mine = [holder for holder, who in self._owners.items() if who is owner]
            for holder in mine:
                self._book.give_back(holder)
                del self._owners[holder]
        return mine

    def holders(self) -> dict[str, list[str]]:
        """Holder -> the GPUs it holds (the agent's health report)."""
        with self._lock:
            return self._book.holders()
