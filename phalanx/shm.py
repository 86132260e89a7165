"""Shared-memory blocks: one copy of a put object per node, mapped by every rank there.

A node's *holder* (the controller for the local backend, the agent on a cluster node, the
first Ray actor of a node) writes an object's pickle stream and its out-of-band buffers
into a :class:`Block`: an anonymous memory file (``memfd_create``) that lives exactly as
long as someone holds it -- an open descriptor or a mapping. Nothing is ever named in
``/dev/shm``, so nothing can be left behind: when the holder closes its descriptor (the
object freed) or dies (even by SIGKILL), the kernel frees the memory with its last user.

A rank learns where a block is from a SHARE message (:mod:`phalanx.protocol`): the holder's
pid, the descriptor's number there, the block's token and its layout. It maps the block
through ``/proc/<pid>/fd/<n>`` (checking the token, so a reused descriptor number is never
taken for the block) the first time a call's arguments name the object, unpickles it
once, and keeps it until UNSHARE. numpy arrays in it are read-only views of the mapping;
torch CPU tensors are views too, of a copy-on-write mapping: a rank writing into one gets
its own copy of the pages it writes, never changing another rank's.
"""

from __future__ import annotations

import mmap
import os
import pickle
import threading
import warnings
from collections.abc import Sequence
from typing import Any

_NAME = "phalanx-"
_ALIGN = 64  # every buffer starts on a cache line (numpy and torch want aligned data)
_CHUNK = 64 << 20
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def supported() -> bool:
    """Whether this machine can hold blocks (Linux: memfd_create and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def layout_of(parts: Sequence[Any]) -> tuple[list[tuple[int, int]], int]:
    """Where each part goes in a block, as ``(offset, length)``, and the block's size."""
    layout = []
    offset = 0
    for part in parts:
        offset = -(-offset // _ALIGN) * _ALIGN
        length = memoryview(part).nbytes
        layout.append((offset, length))
        offset += length
    return layout, max(offset, 1)


class Block:
    """An object's bytes in an anonymous memory file of this process (the holder's copy)."""

    def __init__(self, token: str, parts: Sequence[Any]) -> None:
        self.token = token
        self.layout, self.size = layout_of(parts)
        self.fd = os.memfd_create(_NAME + token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            for part, (offset, length) in zip(parts, self.layout, strict=True):
                _write_at(self.fd, memoryview(part).cast("B"), offset, length)
        except BaseException:
            os.close(self.fd)
            raise

    def location(self) -> tuple[int, int, str, list[tuple[int, int]], int]:
        """What a SHARE message tells ranks: ``(pid, fd, token, layout, size)``."""
        return os.getpid(), self.fd, self.token, self.layout, self.size

    def close(self) -> None:
        """Drop the holder's descriptor: the memory goes once no rank maps it any more."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _write_at(fd: int, view: memoryview, offset: int, length: int) -> None:
    done = 0
    while done < length:
        done += os.pwrite(fd, view[done:done + _CHUNK], offset + done)


# -- the rank's side ----------------------------------------------------------------------


class NotShared(LookupError):
    """A call named a shared object this rank has no location for."""


def map_block(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
    """Map another process's block (copy-on-write: writes stay this process's own)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise NotShared(f"its holder (pid {pid}) no longer holds it ({exc.strerror})") from None
    if not target.startswith(f"/memfd:{_NAME}{token}"):
        raise NotShared(f"its holder (pid {pid}) no longer holds it")
    file = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        block = mmap.mmap(file, size, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(file)
    try:  # map every page now, in one go, without copying any (MAP_POPULATE would copy)
        block.madvise(_MADV_POPULATE_READ)
    except OSError:  # before Linux 5.14: pages are mapped as they are first read
        pass
    return block


class RankShares:
    """A rank's shared objects: where each is (from SHARE) and, once used, the object."""

    def __init__(self) -> None:
        self._where: dict[int, tuple] = {}
        self._objects: dict[int, Any] = {}
        self._lock = threading.Lock()  # calls on a thread pool may resolve at once

    def add(self, ref_id: int, location: Sequence[Any]) -> None:
        with self._lock:
            self._where[ref_id] = tuple(location)

    def drop(self, ref_id: int) -> None:
        """Forget it (the mapping goes with the last view of it the user still has)."""
        with self._lock:
            self._where.pop(ref_id, None)
            self._objects.pop(ref_id, None)

    def resolve(self, ref_id: int, token: str, private: bool = False) -> Any:
        """The object (unpickled on first use, then kept); ``private``: a call's own
        arguments, unpickled for that call only, its arrays writable as a copy would be
        (the mapping is copy-on-write: a write never reaches another rank)."""
        with self._lock:
            if not private:
                try:
                    return self._objects[ref_id]
                except KeyError:
                    pass
            where = self._where.get(ref_id)
            if where is None or where[2] != token:
                raise NotShared(f"shared object {ref_id} is not on this rank's node (freed, "
                                "or put by another group)")
            pid, fd, _, layout, size = where
            try:
                block = map_block(pid, fd, token, size)
            except NotShared as exc:
                raise NotShared(f"shared object {ref_id}: {exc}") from None
            obj = _unpickle(block, layout, writable=private)
            if not private:
                self._objects[ref_id] = obj
            return obj

    def __len__(self) -> int:
        return len(self._where)


def _unpickle(block: mmap.mmap, layout: list[tuple[int, int]], writable: bool) -> Any:
    view = memoryview(block)
    (start, length), *rest = layout
    buffers = [view[o:o + n] if writable else view[o:o + n].toreadonly() for o, n in rest]
    stream = view[start:start + length]
    try:
        return pickle.loads(stream, buffers=buffers)
    finally:
        stream.release()


RANK_SHARES = RankShares()


def resolve(ref_id: int, token: str, private: bool = False) -> Any:
    """What a shared object's reference unpickles to in a rank (see ObjectRef)."""
    return RANK_SHARES.resolve(ref_id, token, private)


# -- torch CPU tensors as out-of-band buffers ---------------------------------------------


def reduce_tensor(tensor: Any) -> tuple | None:
    """A plain CPU tensor as its bytes (an out-of-band buffer, never copied) and how to
    rebuild it; None for tensors torch must pickle itself (grad, sparse, views of others'
    storage that are not contiguous, other devices)."""
    torch = _torch()
    if (tensor.device.type != "cpu" or tensor.requires_grad or tensor.layout != torch.strided
            or not tensor.is_contiguous() or tensor.is_quantized or tensor.is_conj()
            or tensor.is_neg()):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    data: Any = b""
    if tensor.numel():
        try:  # numpy hands over the memory without a copy
            data = pickle.PickleBuffer(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # no numpy, or a dtype it cannot view
            return None
    return rebuild_tensor, (data, dtype, tuple(tensor.shape))


def rebuild_tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    torch = _torch()
    kind = getattr(torch, dtype)
    if not memoryview(data).nbytes:
        return torch.empty(shape, dtype=kind)
    if isinstance(data, bytes):  # pickled in-band (not by phalanx): give torch its own copy
        data = bytearray(data)
    with warnings.catch_warnings():  # a read-only view: the mapping under it is copy-on-write
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(kind).reshape(shape)


def _torch() -> Any:
    import torch

    return torch
