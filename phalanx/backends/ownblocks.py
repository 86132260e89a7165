"""Put objects held in memory blocks of the controller's own process, for the ranks that
can map them: every rank of the local backend, and a Ray group's ranks in processes of
the controller's machine (its pid and mount namespaces: see :func:`maps_blocks_of_here`).

An object is written once, into a pooled block (:class:`phalanx.node.shm.Holder`), and
each rank told of it maps the block itself -- one copy on the machine, however many ranks
read it, and no process between the controller and its ranks. Once the object is freed,
its block goes back to the pool when every rank told of it said RELEASED (or died); a
block the pool then closes is one its readers unmap.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.node import shm
from phalanx.wire import protocol

if TYPE_CHECKING:
    from phalanx.backends.base import Channel
    from phalanx.backends.held import HeldObject


class OwnBlocks:
    """This process's copies of put objects, for ranks that map its blocks."""

    def __init__(self, alive: Callable[[Any], bool]) -> None:
        self._alive = alive  # ``alive(channel)``: is its rank still there to answer?
        self._objects = shm.Holder(shm.Pool(alive))
        self._lock = threading.Lock()  # an object is written once, however shared

    def share(self, obj: HeldObject, channels: Sequence[Channel], *,
              keep_segments: bool = False,
              fetch: Callable[[], list[Any] | None] | None = None) -> None:
        """Write the object into a block once (from its segments, else from ``fetch()``:
        another holder's copy); tell each channel's rank where it is. The segments are let
        go once written, unless ``keep_segments`` (another holder still takes them)."""
        with self._lock:
            location = self._objects.where(obj.id)
            if location is None:
                parts = obj.segments
                if parts is None and fetch is not None:
                    parts = fetch()
                if parts is None:
                    return  # freed meanwhile
                location = self._objects.hold(obj.id, obj.token, parts, writable=obj.tensors)
                if not keep_segments:
                    obj.segments = None  # the block is the copy now
            self._objects.told(obj.id, channels)
        for channel in channels:
            channel.send(protocol.share_frame(channel.ranks[0], obj.id, obj.token, location))

    def unshare(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        """The object was freed: its ranks forget it; its block is reused once each of
        them let go of every view (RELEASED)."""
        for channel in channels:
            channel.send(protocol.unshare_frame(channel.ranks[0], obj.id))
        self._unmap(self._objects.drop(obj.id, channels))

    def released(self, channel: Channel, ref_id: int) -> None:
        self._unmap(self._objects.released(ref_id, channel))

    def parts(self, ref_id: int) -> list[Any] | None:
        """A copy of the object's pickle and buffers (None: not held here)."""
        return self._objects.parts(ref_id)

    def close(self) -> None:
        """Close every block (the memory goes with the last rank that maps it)."""
        self._objects.close()

    def _unmap(self, unmaps: list[tuple[str, set[Any]]]) -> None:
        """Closed blocks: the ranks that mapped them let go of their mappings too."""
        alive = self._alive
        for name, readers in unmaps:
            for channel in readers:
                if alive(channel):
                    channel.send(protocol.unmap_frame(channel.ranks[0], name))


_NAMESPACES = ("pid", "mnt")


def maps_blocks_of_here(pid: int) -> bool:
    """Whether process ``pid`` (of this machine) can map this process's blocks: it sees
    the same processes and the same files (``/proc/<pid>/fd/<n>`` names the block there
    as here)."""
    try:
        return all(os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}")
                   for ns in _NAMESPACES)
    except OSError:  # gone, or not ours to look at
        return False
