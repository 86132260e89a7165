"""Shared-memory blocks: one copy of a put object per node, mapped by every rank there.

A node's :class:`Holder` -- one class, held by the controller for the local backend, by
the agent on a cluster node, by a store actor on a Ray node -- writes an object's pickle
stream and its out-of-band buffers into a :class:`Block`: an anonymous memory file
(``memfd_create``) that lives exactly as long as someone holds it -- an open descriptor or
a mapping. Nothing is ever named in ``/dev/shm``, so nothing can be left behind: when the
holder closes its descriptor or dies (even by SIGKILL), the kernel frees the memory with
its last user.

A rank learns where an object is from a SHARE message (:mod:`phalanx.wire.protocol`): the
holder's pid, the block's descriptor number there, its name, and where the object's parts
lie in it. It maps the block through ``/proc/<pid>/fd/<n>`` (:mod:`phalanx.rank.shared`).

A holder with a :class:`Pool` (the controller's) keeps its blocks once their object is
freed: the next object of a similar size is written into pages that already exist, and the
ranks keep their mappings -- together half the cost of a new block. A block is reused only
after every rank that received its object said it holds no view of it any more
(RELEASED), so a rank that kept an array of a freed object never sees it change.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from phalanx import config
from phalanx.wire.memfd import Block, Extents, Location, extents_of, supported

__all__ = ["Block", "Extents", "Holder", "Pool", "extents_of", "supported"]

_ROUND = 2 << 20  # a pooled block's size is a multiple of this


class Pool:
    """The controller's blocks: lent to objects, waiting for their ranks' RELEASED once
    the object is freed, then idle and reused (up to ``config.SHARE_POOL_BYTES``)."""

    def __init__(self, alive: Callable[[Any], bool]) -> None:
        self._alive = alive  # is this channel's rank still there to answer?
        self._returning: dict[int, tuple[Block, set[Any]]] = {}  # ref id -> block, waiting
        self._idle: list[Block] = []

    def take(self, size: int) -> Block:
        """A block of at least ``size`` bytes: an idle one not much larger, else new."""
        self._sweep()
        fits = [b for b in self._idle if size <= b.capacity <= 2 * size + _ROUND]
        if fits:
            block = min(fits, key=lambda b: b.capacity)
            self._idle.remove(block)
            return block
        return Block(-(-size // _ROUND) * _ROUND)

    def give_back(self, ref_id: int, block: Block, waiting: set[Any]) -> None:
        """The object in ``block`` was freed; ``waiting``: the channels told of it."""
        self._returning[ref_id] = (block, {c for c in waiting if self._alive(c)})
        self._settle(ref_id)

    def released(self, ref_id: int, channel: Any) -> None:
        """A rank holds no view of the object any more."""
        entry = self._returning.get(ref_id)
        if entry is not None:
            entry[1].discard(channel)
            self._settle(ref_id)

    def trim(self) -> list[Block]:
        """Close idle blocks beyond the pool's size; the ones closed (ranks unmap them)."""
        closed = []
        while (len(self._idle) > config.SHARE_POOL_BLOCKS
               or sum(b.capacity for b in self._idle) > config.SHARE_POOL_BYTES):
            oldest = self._idle.pop(0)
            oldest.close()
            closed.append(oldest)
        return closed

    def _sweep(self) -> None:
        """Ranks that died cannot answer: their mappings went with them."""
        for ref_id, (_, waiting) in list(self._returning.items()):
            waiting.difference_update([c for c in waiting if not self._alive(c)])
            self._settle(ref_id)

    def _settle(self, ref_id: int) -> None:
        block, waiting = self._returning[ref_id]
        if not waiting:
            del self._returning[ref_id]
            self._idle.append(block)

    def close(self) -> None:
        for block in self._idle + [b for b, _ in self._returning.values()]:
            block.close()
        self._idle, self._returning = [], {}


class Holder:
    """A node's copies of put objects: one block per object, until the object is dropped.

    Without a pool (an agent, a Ray node's store) each object gets a block of its own
    size, closed when the object is dropped. With one (the controller's, for the local
    backend) blocks come from the pool and go back to it; ranks then say RELEASED once
    they hold no view of a freed object (:meth:`released`), and a block the pool closes is
    one its readers must unmap (the readers returned by :meth:`drop` and :meth:`released`).
    *Readers* are whatever the caller tells of an object (channels, ranks): the holder only
    keeps them as keys. Thread-safe; no block is written while the holder's lock is held.
    """

    def __init__(self, pool: Pool | None = None) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Block, str, Location]] = {}  # ref id -> block, token, where

    def write(self, parts: Sequence[Any]) -> tuple[Block, Extents]:
        """A block holding ``parts`` (the pickle stream, then each out-of-band buffer), not
        yet anyone's: :meth:`keep` it, or close it."""
        if self._pool is None:
            return Block.holding(parts)
        extents, size = extents_of(parts)
        with self._lock:
            block = self._pool.take(size)
        return block.fill(parts, extents)

    def keep(self, ref_id: int, token: str, written: tuple[Block, Extents], *,
             writable: bool = False) -> Location:
        """Hold the block :meth:`write` returned as object ``ref_id``'s copy (an earlier
        copy is closed); where ranks find it (``writable``: their views must be writable,
        as torch tensors want)."""
        block, extents = written
        location = block.location(extents, release=self._pool is not None, writable=writable)
        with self._lock:
            previous = self._held.pop(ref_id, None)
            self._held[ref_id] = (block, token, location)
        if previous is not None:
            previous[0].close()
        return location

    def hold(self, ref_id: int, token: str, parts: Sequence[Any], *,
             writable: bool = False) -> Location:
        """:meth:`write` then :meth:`keep`."""
        return self.keep(ref_id, token, self.write(parts), writable=writable)

    def where(self, ref_id: int) -> Location | None:
        """Where object ``ref_id`` is, if held here."""
        with self._lock:
            held = self._held.get(ref_id)
        return None if held is None else held[2]

    def parts(self, ref_id: int) -> list[bytes] | None:
        """A copy of object ``ref_id``'s pickle and buffers, read back from its block
        (another holder's copy is made of them); None if it is not held here."""
        with self._lock:
            held = self._held.get(ref_id)
        if held is None:
            return None
        block, _, location = held
        try:
            return [_read(block.fd, offset, length) for offset, length in location[3]]
        except OSError:  # closed meanwhile: freed
            return None

    def objects(self) -> list[tuple[int, str, Location]]:
        """Every object held now, as ``(ref id, token, location)``: what a rank started
        later is told."""
        with self._lock:
            return [(ref_id, token, where) for ref_id, (_, token, where) in self._held.items()]

    def told(self, ref_id: int, readers: Iterable[Any]) -> None:
        """``readers`` were told where ``ref_id`` is: they may map its block (pooled: a
        reused block waits for them, a closed one must be unmapped by them)."""
        with self._lock:
            held = self._held.get(ref_id)
            if held is not None:
                held[0].mapped_by.update(readers)

    def drop(self, ref_id: int, readers: Iterable[Any] = ()) -> list[tuple[str, set[Any]]]:
        """Object ``ref_id`` was freed; ``readers``: those told of it. Without a pool its
        block closes now (the memory goes once no rank maps it); with one it waits for
        their RELEASED. The blocks the pool closed meanwhile, as ``(name, readers that
        mapped it)``: each of those must unmap it."""
        with self._lock:
            held = self._held.pop(ref_id, None)
            if held is None:
                return []
            block = held[0]
            if self._pool is None:
                closed = []
            else:
                self._pool.give_back(ref_id, block, set(readers) & block.mapped_by)
                closed = self._pool.trim()
        if self._pool is None:
            block.close()
        return _unmaps(closed)

    def released(self, ref_id: int, reader: Any) -> list[tuple[str, set[Any]]]:
        """``reader`` holds no view of freed object ``ref_id`` any more (RELEASED); the
        blocks the pool closed meanwhile, as :meth:`drop` returns them."""
        if self._pool is None:
            return []
        with self._lock:
            self._pool.released(ref_id, reader)
            closed = self._pool.trim()
        return _unmaps(closed)

    def close(self) -> None:
        """Close every block (the memory goes with the last rank that maps it)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
            if self._pool is not None:
                self._pool.close()
        for block, _, _ in held:
            block.close()


def _read(fd: int, offset: int, length: int) -> bytes:
    chunks, done = [], 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            raise OSError(f"a block ended {length - done} bytes early")
        chunks.append(chunk)
        done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unmaps(closed: list[Block]) -> list[tuple[str, set[Any]]]:
    unmaps = []
    for block in closed:
        unmaps.append((block.token, set(block.mapped_by)))
        block.mapped_by.clear()
    return unmaps
