"""Anonymous memory blocks (``memfd_create``): how bytes are handed from one process to
others on the same machine without a copy each.

A :class:`Block` holds parts (a pickle stream and its out-of-band buffers, each aligned to
a cache line) in an anonymous memory file that lives exactly as long as someone holds it
-- an open descriptor or a mapping: nothing is named in ``/dev/shm``, so nothing is left
behind when its holder dies, even by SIGKILL. Another process of the same user maps it
through ``/proc/<pid>/fd/<n>`` from its :meth:`Block.location`
(:func:`phalanx.rank.shared.map_block`). The node side's put objects live in such blocks
(:mod:`phalanx.node.shm`), and so do results kept on a rank (:mod:`phalanx.rank.kept`).
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx import config

NAME = config.SHARE_BLOCK_PREFIX
_ALIGN = 64  # every buffer starts on a cache line (numpy and torch want aligned data)
_CHUNK = 64 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def supported() -> bool:
    """Whether this machine can hold blocks (Linux: memfd_create and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


Extents = list[tuple[int, int]]  # (offset, length) of the stream, then of each buffer
# what SHARE tells ranks (see Block.location): pid, fd, name, extents, capacity, release, writable
Location = tuple[int, int, str, Extents, int, bool, bool]


def machine_id() -> str:
    """This machine and mount namespace: equal for processes that see the same files and
    can map each other's blocks (a controller then also knows its cwd and sys.path mean
    something on an agent's node), distinct per pod."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", Path.read_text),
                       ("/proc/self/ns/mnt", lambda p: os.readlink(p))):
        try:
            parts.append(str(read(Path(path))).strip())
        except OSError:
            parts.append(socket.gethostname())
    return ":".join(parts)


def read_lock(fd: int, mapping: mmap.mmap) -> None:
    """Hold a shared ``flock`` on ``fd`` (a reader's own descriptor of a block) for as long
    as ``mapping`` lives, then close ``fd``: the block's holder does not reuse it meanwhile
    (:meth:`Block.unread`)."""
    import fcntl
    import weakref

    fcntl.flock(fd, fcntl.LOCK_SH)
    weakref.finalize(mapping, os.close, fd).atexit = False


def block_domain() -> str:
    """Which processes may map each other's blocks: this machine (:func:`machine_id`), or
    the domain ``$PHALANX_BLOCK_DOMAIN`` names -- set on agents that stand for separate
    machines on one, whose ranks then pass kept results as between machines."""
    return os.environ.get(config.ENV_BLOCK_DOMAIN) or machine_id()


def extents_of(parts: Sequence[Any]) -> tuple[Extents, int]:
    """Where each part goes in a block, and the bytes they need in all."""
    extents = []
    offset = 0
    for part in parts:
        offset = -(-offset // _ALIGN) * _ALIGN
        length = memoryview(part).nbytes
        extents.append((offset, length))
        offset += length
    return extents, max(offset, 1)


class Block:
    """An anonymous memory file of this process (a holder's copy of objects)."""

    def __init__(self, capacity: int) -> None:
        self.token = os.urandom(16).hex()  # 128 bits (secrets.token_hex): mapped by handle
        self.capacity = max(capacity, 1)
        self.fd = os.memfd_create(NAME + self.token, os.MFD_CLOEXEC)
        self.mapped_by: set[Any] = set()  # channels told where it is (pooled blocks)
        self._used = False
        self._map: mmap.mmap | None = None  # this process's own, once reused
        try:
            os.ftruncate(self.fd, self.capacity)
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def holding(cls, parts: Sequence[Any]) -> tuple[Block, Extents]:
        """A block of just the right size, with ``parts`` written in."""
        extents, size = extents_of(parts)
        return cls(size).fill(parts, extents)

    def fill(self, parts: Sequence[Any], extents: Extents) -> tuple[Block, Extents]:
        """:meth:`write` ``parts`` in, closing this block if that fails; the block and
        its extents."""
        try:
            self.write(parts, extents)
        except BaseException:
            self.close()
            raise
        return self, extents

    def write(self, parts: Sequence[Any], extents: Extents) -> None:
        """Copy ``parts`` in: a new block through the kernel (which makes its pages as it
        goes), a reused one through a mapping of this process kept for it (its pages and
        their mapping exist: a plain memory copy, twice as fast)."""
        if self._map is None and not self._used:
            self._used = True
            for part, (offset, length) in zip(parts, extents, strict=True):
                view = memoryview(part).cast("B")
                done = 0
                while done < length:
                    done += os.pwrite(self.fd, view[done:done + _CHUNK], offset + done)
            return
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.capacity)
            try:
                self._map.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # before Linux 5.14
                pass
        for part, (offset, length) in zip(parts, extents, strict=True):
            self._map[offset:offset + length] = memoryview(part).cast("B")

    def map_resident(self) -> None:
        """Map the whole block in this process, every page of it present, until
        :meth:`close`: its bytes then count in this process's resident set (``RssShmem`` in
        ``/proc/<pid>/status``), which the kernel's OOM killer weighs. A block's pages are
        charged to no process's resident set while only a descriptor holds them, so a
        holder of many would look small, and a node short of memory would kill a
        bystander instead of the process whose end frees them."""
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.capacity)
        try:
            self._map.madvise(_MADV_POPULATE_READ)  # maps the pages the write made
        except OSError:  # before Linux 5.14: read one byte of each page
            with memoryview(self._map) as whole, whole[::mmap.PAGESIZE] as pages:
                pages.tobytes()

    def location(self, extents: Extents, release: bool = False, writable: bool = False) -> Location:
        """What SHARE tells ranks: ``(pid, fd, name, extents, capacity, release,
        writable)``; ``release``: say RELEASED once no view of the object is left (a pooled
        block); ``writable``: its views must be writable (torch tensors)."""
        return os.getpid(), self.fd, self.token, extents, self.capacity, release, writable

    def unread(self) -> bool:
        """Whether no other process reads this block now: each reader holds a shared
        ``flock`` on its own descriptor of it while it maps it (:func:`read_lock`), so
        an exclusive one is refused while any does -- and a reader's end, however it
        ends, releases its lock."""
        import fcntl

        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        """Drop the holder's descriptor: the memory goes once no rank maps it any more."""
        fd, self.fd = self.fd, -1
        if self._map is not None:
            self._map.close()
            self._map = None
        if fd >= 0:
            os.close(fd)
