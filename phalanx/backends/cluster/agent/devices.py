"""The GPUs of an agent's node, held across every controller it serves.

One :class:`NodeDevices` per agent process: each session (one controller's connection)
takes devices from it for a holder it names (a pool, a group: "pool-1 of the controller on
host, pid 4242"), and a request for devices another holder has is refused with the book's
account of who holds what and what is free (:class:`phalanx.world.devices.DeviceBook`).
A holder gives its devices back by asking for none; whatever a session still holds when it
ends (its controller closed the connection, was killed, or went silent) is free again. A
detached group's session does not end with its controller: it waits for the next one
holding what it held, tells the controller that attaches which GPUs those are
(:meth:`NodeDevices.held`, in its DESCRIBE answer: the ids its ranks run on, which that
controller gives the ranks it starts again), then serves it, and frees them when the group
ends (shut down, or nobody attached within its ``detach_timeout``).

A holder's name belongs to the session that first took devices under it while it holds
them: another session asking under the same name is refused, so that no controller can
free, or take over, what another holds.

Except where the holder let it: a pool's GPUs are *shared* with the sessions of the groups
placed on it. The pool's session takes them with a key (a DEVICES request whose payload is
``(SHARED, key)``); a group's session that shows the same key (``(SHARE, key)``) holds them
with it, taking nothing more. The devices stay held while any of their sessions does: a
session that asks for none, or ends, lets go of its share, and the last to let go frees
them. So a detached pool's GPUs outlive its controller (whose connection was the pool's
session) exactly as long as a detached group placed on it runs on the node -- its session
waits for the next controller, then serves it -- and are free once the last such group
ends, is shut down, or is not attached within its ``detach_timeout``. The key is the pool
controller's secret: no other controller can join, and so keep, what it holds.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Sequence
from typing import Any

from phalanx.backends.cluster import messages as agentwire
from phalanx.errors import DevicesTaken, printable
from phalanx.world.devices import DeviceBook

logger = logging.getLogger(__name__)

SHARED, SHARE = agentwire.DEVICES_SHARED, agentwire.DEVICES_SHARE  # a payload's modes
KEY_BYTES = 64  # the most a key may have


class NodeDevices:
    """The node's GPUs (the ids its ranks may be given), and who holds which."""

    def __init__(self, gpus: Sequence[str]) -> None:
        self.gpus = tuple(gpus)
        self._book = DeviceBook()
        # holder -> the sessions that hold for it: the one that took them first, then those
        # sharing them
        self._owners: dict[str, list[object]] = {}
        self._keys: dict[str, bytes] = {}  # holder -> the key that lets others share it
        self._lock = threading.Lock()

    def take(self, owner: object, count: int, holder: str,
             payload: Sequence[Any] = ()) -> dict[str, Any]:
        """``count`` GPUs for ``holder`` (what it held before is given back first; 0: only
        that) -> ``{"gpus": [...]}``, or ``{"refused": why}`` taking nothing. ``payload``:
        ``(SHARED, key)`` takes them sharable with ``key``; ``(SHARE, key)`` shares what
        ``holder`` took with that key instead. The name is shown to other controllers (in
        their refusals) and in ``/health``: one that is not printable text (no line break,
        no terminal escape) is refused; its length is bounded where the request is read
        (``messages``)."""
        if not isinstance(holder, str) or not holder.isprintable():
            return {"refused": "a holder's name must be printable text, not "
                               f"{printable(holder, 80)!r}"}
        mode, key = _sharing(payload)
        if mode is None:
            return {"refused": f"a DEVICES payload is (mode, key) of at most {KEY_BYTES} "
                               "bytes, mode 'shared' or 'share'"}
        with self._lock:
            owners = self._owners.get(holder, [])
            if mode == SHARE:
                return self._share(owner, holder, owners, key)
            if owners and owner not in owners:
                return {"refused": f"another controller's session holds GPUs as {holder!r}; "
                                   "a holder's name is its own while it holds them"}
            if len(owners) > 1:  # shared: this session lets go, the others keep them
                if count:
                    return {"refused": f"the GPUs held as {holder!r} are shared with "
                                       f"{len(owners) - 1} other session(s): give them back "
                                       "(ask for none) before asking again"}
                owners.remove(owner)
                return {"gpus": []}
            self._book.give_back(holder)
            self._owners.pop(holder, None)
            self._keys.pop(holder, None)
            if count == 0:
                return {"gpus": []}
            try:
                taken = self._book.take(count, holder, self.gpus)
            except DevicesTaken as exc:
                return {"refused": str(exc)}
            self._owners[holder] = [owner]
            if mode == SHARED:
                self._keys[holder] = key
            return {"gpus": list(taken)}

    def _share(self, owner: object, holder: str, owners: list[object],
               key: bytes) -> dict[str, Any]:
        """``owner`` holds ``holder``'s devices with its sessions (lock held)."""
        held = self._book.holders().get(holder, [])
        if not owners:
            return {"refused": f"no GPUs are held as {holder!r} on this node (the pool "
                               "that held them was closed)"}
        if owner not in owners:
            known = self._keys.get(holder)
            if known is None or not hmac.compare_digest(known, key):
                return {"refused": f"another controller's session holds GPUs as {holder!r}; "
                                   "a holder's name is its own while it holds them"}
            owners.append(owner)
        return {"gpus": held}

    def release(self, owner: object) -> list[str]:
        """``owner`` (a session that ended) lets go of what it holds -> the holders whose
        GPUs are free again (those other sessions still share stay held)."""
        freed, kept = [], []
        with self._lock:
            for holder, owners in list(self._owners.items()):
                if owner not in owners:
                    continue
                owners.remove(owner)
                if owners:
                    kept.append((holder, len(owners)))
                    continue
                self._book.give_back(holder)
                del self._owners[holder]
                self._keys.pop(holder, None)
                freed.append(holder)
        for holder, sessions in kept:
            logger.info("the GPUs held as %s stay held: %d session(s) of the groups placed "
                        "on them run on", holder, sessions)
        return freed

    def held(self, owner: object) -> list[str]:
        """The GPUs ``owner`` (a session) holds, or shares, in the order they were taken:
        a detached group's session tells the controller that attaches which of the node's
        GPUs its ranks run on (``DESCRIBE``)."""
        with self._lock:
            holders = self._book.holders()
            return [gpu for holder, owners in self._owners.items() if owner in owners
                    for gpu in holders.get(holder, [])]

    def holders(self) -> dict[str, list[str]]:
        """Holder -> the GPUs it holds (the agent's health report)."""
        with self._lock:
            return self._book.holders()


def _sharing(payload: Sequence[Any]) -> tuple[bytes | None, bytes]:
    """A DEVICES payload's (mode, key): (b"", b"") for none; (None, b"") for what is not
    one."""
    if not payload:
        return b"", b""
    if len(payload) != 2:
        return None, b""
    try:
        mode, key = bytes(payload[0]), bytes(payload[1])
    except (TypeError, ValueError):
        return None, b""
    if mode not in (SHARED, SHARE) or not 0 < len(key) <= KEY_BYTES:
        return None, b""
    return mode, key
