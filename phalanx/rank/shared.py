"""A rank's side of shared objects (:mod:`phalanx.node.shm`): where each is, mapping its block,
unpickling it once, and telling a pooled block's holder when no view of it is left.

A block is mapped once and kept (shared, its arrays handed out read-only: no page of it is
ever written here), so an object written later into a reused block costs no new mapping.
An object whose views must be writable -- a call's own arguments, which the method may
change as it would its own copy, and torch tensors, which have no read-only form -- gets a
copy-on-write mapping instead: a write changes only this rank's pages, and never outlives
the object. Once no view of such an object is left, the pages this rank wrote are dropped
(:func:`forget_writes`) and its mapping of a pooled block is kept for the block's next
writable object: a call's large arguments, in a block the holder reuses call after call,
cost no new mapping of every page each time.

Every buffer of an object (a numpy array's data, a torch tensor's) is handed to pickle as
a view of a small ctypes object over the block's mapping: whatever the rank builds from it
keeps that object referenced, so its reference count says whether the rank still holds
any view of the object -- what RELEASED promises the holder before it reuses the block.

On Ray a rank in its actor's worker is told where the object is in Ray's object store
instead (:data:`RAY_LOCATION`): it reads it with ``ray.get``, its arrays read-only views
of the node's store, and Ray keeps those pages while any view lives.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.config import SHARE_BLOCK_PREFIX as NAME

RAY_LOCATION = "ray"  # a location in Ray's object store (phalanx.backends.ray.store)
RAY_GET_TIMEOUT = 120.0  # seconds for Ray to bring an object to this node

if TYPE_CHECKING:
    import ctypes
    import mmap

# ctypes and mmap are imported on first use: a rank that is never sent a shared object
# (most) does not pay for them at start-up.


class NotShared(LookupError):
    """A call named a shared object this rank has no location for."""


def map_block(pid: int, fd: int, name: str, size: int, private: bool,
              locked: bool = False) -> mmap.mmap:
    """Map another process's block: shared (handed out read-only), or ``private``
    (copy-on-write: writes stay this process's own); ``locked``: holding the block's read
    lock while the mapping lives (a kept result's block, which its holder reuses once no
    reader holds that lock: :meth:`phalanx.wire.memfd.Block.unread`)."""
    import mmap

    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise NotShared(f"its holder (pid {pid}) no longer holds it ({exc.strerror})") from None
    if not target.startswith(f"/memfd:{NAME}{name}"):  # the number was reused meanwhile
        raise NotShared(f"its holder (pid {pid}) no longer holds it")
    # ctypes views need a writable mapping; the shared one is only ever handed out read-only
    file = os.open(path, (os.O_RDONLY if private else os.O_RDWR) | os.O_CLOEXEC)
    try:
        block = mmap.mmap(file, size, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if locked:
            from phalanx.wire.memfd import read_lock

            read_lock(file, block)  # closes the descriptor with the mapping
    except BaseException:
        os.close(file)
        raise
    if not locked:
        os.close(file)
    try:  # map every page now, in one go, without copying any (MAP_POPULATE would copy)
        block.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
    except OSError:  # before Linux 5.14: pages are mapped as they are first read
        pass
    return block


class RankShares:
    """A rank's shared objects: where each is (from SHARE) and, once used, the object."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[str, tuple[Any, ...]]] = {}  # ref id -> (token, location)
        self._objects: dict[int, Any] = {}  # ref id -> the object, once unpickled
        self._maps: dict[str, mmap.mmap] = {}  # block name -> this rank's mapping
        # copy-on-write mappings of pooled blocks: an object's while its views live (ref
        # id -> block name, mapping), then spare for the block's next such object
        self._private: dict[int, tuple[str, mmap.mmap]] = {}
        self._spare: dict[str, mmap.mmap] = {}  # block name -> a mapping of it no view uses
        self._owners: dict[int, list[Any]] = {}  # ref id -> what its views reference
        self._pending: dict[int, tuple[Any, ...]] = {}  # freed, views left: ref id -> location
        self._lock = threading.Lock()  # calls on a thread pool may resolve at once
        self.notify: Callable[[int], None] = lambda ref_id: None  # sends RELEASED

    def add(self, ref_id: int, token: str, location: tuple[Any, ...]) -> None:
        with self._lock:
            self._where[ref_id] = (token, tuple(location))

    def resolve(self, ref_id: int, token: str, private: bool = False) -> Any:
        """The object (unpickled on first use, then kept); ``private``: a call's own
        arguments, unpickled for that call only, its arrays writable as a copy's would be
        (the mapping is copy-on-write: a write never reaches another rank)."""
        with self._lock:
            if not private and ref_id in self._objects:
                return self._objects[ref_id]
            where = self._where.get(ref_id)
            if where is None or where[0] != token:
                raise NotShared(f"shared object {ref_id} is not on this rank's node (freed, "
                                "or put by another group)")
            if where[1][0] == RAY_LOCATION:
                obj = from_ray(ref_id, where[1], private)
                if not private:
                    self._objects[ref_id] = obj
                return obj
            pid, fd, name, layout, capacity, pooled, writable = where[1]
            writable = writable or private
            if not writable:
                block = self._maps.get(name)
            else:  # a spare copy-on-write mapping of the block (see poll)
                block = self._spare.pop(name, None) if pooled else None
            if block is None:
                try:
                    block = map_block(pid, fd, name, capacity, writable)
                except NotShared as exc:
                    raise NotShared(f"shared object {ref_id}: {exc}") from None
                if not writable:
                    self._maps[name] = block
            if writable and pooled:
                self._private[ref_id] = (name, block)
            owners = self._owners.setdefault(ref_id, [])
            obj = unpickle(block, layout, writable, owners)
            if not private:
                self._objects[ref_id] = obj
            return obj

    def drop(self, ref_id: int) -> None:
        """UNSHARE: forget the object; tell its holder once no view of it is left."""
        with self._lock:
            entry = self._where.pop(ref_id, None)
            self._objects.pop(ref_id, None)
        if entry is None:  # never told of it: nothing of it here
            self.notify(ref_id)
            return
        with self._lock:
            location = entry[1]
            if location[0] == RAY_LOCATION:  # the rank's views keep Ray's pages
                return
            if not location[5]:  # a block of its own (not pooled): unmap it with the views
                self._owners.pop(ref_id, None)
                self._maps.pop(location[2], None)
                self._private.pop(ref_id, None)
                return
            self._pending[ref_id] = location
        self.poll()

    def unmap(self, name: str) -> None:
        """UNMAP: the holder closed a pooled block (views of it keep their pages)."""
        with self._lock:
            self._maps.pop(name, None)
            self._spare.pop(name, None)

    def poll(self) -> None:
        """Tell holders about freed objects of which no view is left now."""
        if not self._pending:
            return
        with self._lock:
            done = [r for r in self._pending if not _in_use(self._owners.get(r, ()))]
            for ref_id in done:
                del self._pending[ref_id]
                self._owners.pop(ref_id, None)
                private = self._private.pop(ref_id, None)
                # no view of it left: the mapping is the block's next writable object's,
                # the pages written here given back now (none can be written meanwhile)
                if private is not None and forget_writes(private[1]):
                    self._spare[private[0]] = private[1]
        for ref_id in done:
            self.notify(ref_id)


# A page of a copy-on-write mapping that this process wrote is its own (anonymous)
# copy: /proc/self/pagemap says so in each page's top byte -- present and not a file page,
# or swapped out. A page never written maps the block's own, as it is now.
_WRITTEN = bytes(1 if (b & 0x80 and not b & 0x20) or b & 0x40 else 0 for b in range(256))
_PAGEMAP: list[int] = []  # this process's /proc/self/pagemap, once opened


def _forget_pagemap() -> None:
    """In a forked child: an inherited pagemap descriptor reads the parent's pages (its
    memory is the one of the process that opened it), so the child opens its own."""
    while _PAGEMAP:
        try:
            os.close(_PAGEMAP.pop())
        except OSError:
            pass


os.register_at_fork(after_in_child=_forget_pagemap)


def forget_writes(block: mmap.mmap) -> bool:
    """Drop the pages this process wrote in copy-on-write mapping ``block``: read again,
    they are the block's as it is now, and the pages never written stay mapped (a mapping
    made anew costs every page's mapping again). False where pagemap cannot tell."""
    import ctypes
    import mmap

    size = mmap.PAGESIZE
    try:
        if not _PAGEMAP:
            _PAGEMAP.append(os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
        anchor = ctypes.c_char.from_buffer(block)
        start = ctypes.addressof(anchor)
        del anchor  # (a buffer export of the mapping while it lives)
        pages = len(block) // size
        entries = os.pread(_PAGEMAP[0], pages * 8, start // size * 8)
    except (OSError, ValueError, BufferError):
        return False
    if len(entries) != pages * 8:
        return False
    written = entries[7::8].translate(_WRITTEN)
    first = written.find(1)
    while first >= 0:
        end = written.find(0, first)
        end = pages if end < 0 else end
        block.madvise(mmap.MADV_DONTNEED, first * size, (end - first) * size)
        first = written.find(1, end)
    return True


def _in_use(owners: Any) -> bool:
    # an owner referenced only by the list (and by getrefcount's argument) has no view
    return any(sys.getrefcount(owners[i]) > 2 for i in range(len(owners)))


def ray_location(ref: Any) -> tuple[Any, ...]:
    """Where a Ray worker of the same cluster finds the object of ``ref``: its id and its
    owner, serialized without pinning it (as the plain pickling of a reference would);
    the owner keeps it as long as it holds ``ref``. Read back by :func:`from_ray`."""
    import ray

    worker: Any = ray._private.worker.global_worker  # noqa: SLF001 - no public way to it
    core = worker.core_worker
    _, owner, status = core.serialize_object_ref(ref)
    return (RAY_LOCATION, ref.binary(), owner, status)


def ray_ref(location: tuple[Any, ...]) -> Any:
    """The Ray ``ObjectRef`` a :func:`ray_location` names, made again in this process (a
    Ray worker or driver of the same cluster), borrowed from its owner."""
    from ray._private.serialization import _object_ref_deserializer

    _, binary, owner, status = location[:4]
    return _object_ref_deserializer(  # type: ignore[no-untyped-call]  # Ray's, untyped
        binary, "", owner, status, None)


def from_ray(ref_id: int, location: tuple[Any, ...], private: bool) -> Any:
    """An object in Ray's store, this process being a Ray worker of the controller's
    cluster: its buffers are read-only views of the node's store (objects whose views
    must be writable come through the node's block instead)."""
    import ray

    ref = ray_ref(location)
    try:
        parts = ray.get(ref, timeout=RAY_GET_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - Ray's errors have no common base
        raise NotShared(f"shared object {ref_id} could not be read from Ray's object "
                        f"store: {type(exc).__name__}: {exc}") from None
    del ref
    head, *rest = parts
    buffers: list[Any]
    if private:  # never sent so (see ray.store), but a private copy is what it asks
        buffers = [bytearray(part) for part in rest]
    else:
        buffers = [memoryview(part) for part in rest]
    return pickle.loads(memoryview(head), buffers=buffers)


def unpickle(block: mmap.mmap | ctypes.Array[ctypes.c_char], layout: list[tuple[int, int]],
             writable: bool, owners: list[Any]) -> Any:
    import ctypes

    (start, length), *rest = layout
    buffers: list[Any] = []
    for offset, size in rest:
        if not size:
            buffers.append(b"")
            continue
        owner = (ctypes.c_char * size).from_buffer(block, offset)
        owners.append(owner)
        view = memoryview(owner).cast("B")
        buffers.append(view if writable else view.toreadonly())
    stream = memoryview(block)[start:start + length]
    try:
        return pickle.loads(stream, buffers=buffers)
    finally:
        stream.release()


RANK_SHARES = RankShares()


def resolve(ref_id: int, token: str, private: bool = False) -> Any:
    """What a shared object's handle unpickles to in a rank (see
    :class:`phalanx.controller.refs.ObjectRef`)."""
    return RANK_SHARES.resolve(ref_id, token, private)
