"""Results kept on the rank that made them (``group.call(..., keep=True)``), and reading a
kept result named in a call of any group.

A call whose method name starts with :data:`KEEP` runs as any other, but its result stays
here: pickled once (protocol 5) into an anonymous memory block of this process
(:class:`phalanx.wire.memfd.Block`), or, in a Ray worker, into Ray's object store
(``ray.put``, owned by this worker). The answer is only its size and where it is; the
controller makes a handle of it (:class:`phalanx.controller.refs.ResultRef`), and where it
is, a :data:`KeptLocation`, is what the handle carries into other calls. A rank whose
call names the handle reads the value straight from here: on the same machine it maps the
block through ``/proc/<pid>/fd/<n>`` (no copy: arrays are read-only views of it); on Ray
it reads Ray's object store of its node; on an agent's node of another machine it maps
the copy its agent fetched straight from the producer's agent. The controller never sees
the bytes.

Two built-in calls (names starting with :data:`BUILTIN`) serve the controller:
``@fetch`` (a kept value, for ``handle.get()`` from another machine) and ``@drop`` (the
handles were freed: forget them; views other ranks hold keep their pages).

A dropped result's block is kept for the next results (at most :data:`POOL_BLOCKS`, each
closed after :data:`POOL_IDLE` s unused): writing into pages that exist is a plain memory
copy, several times faster than making a new block's. A block is reused only once no
process reads it: every reader holds a shared lock on it while its mapping lives
(:func:`phalanx.wire.memfd.read_lock`), released with its last view or its process.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, NamedTuple

from phalanx.errors import ObjectLost
from phalanx.rank import shared
from phalanx.wire import pickling

KEEP = "~"  # a call's method name starts with it: keep its result here
BUILTIN = "@"  # the name of a call phalanx's runtime serves itself
IN_RAY_WORKER = False  # set when the rank runs in its Ray actor's worker (start_in_actor)
POOL_BLOCKS = 4  # dropped results' blocks a rank keeps for its next results
POOL_IDLE = 2.0  # seconds a pooled block waits for a result before it is closed


class BlockLocation(NamedTuple):
    """A result kept in a memory block of its producer's process."""

    machine: str  # whose blocks these are (memfd.block_domain): who may map it
    pid: int
    fd: int  # the block's descriptor in that process (/proc/<pid>/fd/<fd>)
    token: str  # the block's name: a reused descriptor number is never mistaken for it
    extents: list[Any]  # (offset, length) of the pickle, then of each buffer
    capacity: int  # the block's size


class RayLocation(NamedTuple):
    """A result kept in Ray's object store (see :func:`phalanx.rank.shared.ray_location`)."""

    kind: str  # shared.RAY_LOCATION
    object_id: bytes
    owner: Any  # its owner's address, as Ray serializes a reference
    status: Any


KeptLocation = BlockLocation | RayLocation


def location_of(answer: Any) -> KeptLocation:
    """A rank's answer to a kept call says where the result is as a plain tuple (so that
    it pickles as fast as any small answer); the same, named."""
    if answer[0] == shared.RAY_LOCATION:
        return RayLocation(*answer)
    return BlockLocation(*answer)


@functools.cache
def machine() -> str:
    """Whose blocks this process may map (:func:`phalanx.wire.memfd.block_domain`), asked
    once, on first use: a rank that never keeps or reads a result does not pay for it at
    start-up."""
    from phalanx.wire import memfd

    return memfd.block_domain()


class Kept:
    """This rank's kept results, by the id of the call that made them."""

    def __init__(self) -> None:
        self._held: dict[int, Any] = {}  # call id -> (its Block, extents), or its ray.ObjectRef
        self._pool: list[tuple[float, Any]] = []  # (when, Block) of dropped results
        self._lock = threading.Lock()  # calls on a thread pool may keep at once
        self._trimmer: threading.Thread | None = None

    def keep(self, call_id: int, value: Any) -> list[Any]:
        """Hold ``value``; the answer: its size and where it is (see ResultRef)."""
        parts = pickling.dumps(value)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        held: Any
        if IN_RAY_WORKER:
            import numpy
            import ray

            held = ray.put([numpy.frombuffer(p, numpy.uint8) for p in parts])
            location: tuple[Any, ...] = shared.ray_location(held)
        else:
            from phalanx.wire import memfd

            extents, size = memfd.extents_of(parts)
            block = self._reusable(size) or memfd.Block(size)
            held = block.fill(parts, extents)
            location = _location(block, extents)
        with self._lock:
            self._held[call_id] = held
        return pickling.dumps_fast((nbytes, location))

    def fetch(self, call_id: int) -> Any:
        """A kept value, unpickled here (``@fetch``)."""
        with self._lock:
            held = self._held.get(call_id)
        if held is None:
            raise ObjectLost(f"no result of call {call_id} is kept on this rank")
        if isinstance(held, tuple):
            block, extents = held
            return read(BlockLocation(*_location(block, extents)),
                        f"the result of call {call_id}")
        return read(RayLocation(*shared.ray_location(held)), f"the result of call {call_id}")

    def drop(self, call_ids: list[int]) -> None:
        """Forget these results (``@drop``): their blocks go to the pool (the oldest of
        a full one closes: its memory goes once no view maps it)."""
        now = time.monotonic()
        closing = []
        with self._lock:
            for call_id in call_ids:
                held = self._held.pop(call_id, None)
                if isinstance(held, tuple):
                    self._pool.append((now, held[0]))
            while len(self._pool) > POOL_BLOCKS:
                closing.append(self._pool.pop(0)[1])
            if self._pool and self._trimmer is None:
                self._trimmer = threading.Thread(target=self._trim, daemon=True,
                                                 name="phalanx-kept-pool")
                self._trimmer.start()
        for block in closing:
            block.close()

    def _reusable(self, size: int) -> Any:
        """A pooled block that fits ``size`` (without wasting half of it) and that no
        process reads any more, taken out of the pool; or None."""
        with self._lock:
            for i, (_, block) in enumerate(self._pool):
                if size <= block.capacity <= 2 * size and block.unread():
                    del self._pool[i]
                    return block
        return None

    def _trim(self) -> None:
        """Close pooled blocks unused for POOL_IDLE s; end once the pool is empty."""
        while True:
            time.sleep(POOL_IDLE / 2)
            now = time.monotonic()
            with self._lock:
                idle = [block for when, block in self._pool if now - when >= POOL_IDLE]
                self._pool = [(w, b) for w, b in self._pool if now - w < POOL_IDLE]
                done = not self._pool
                if done:
                    self._trimmer = None  # the next drop starts another
            for block in idle:
                block.close()
            if done:
                return

    def __len__(self) -> int:
        return len(self._held)


KEPT = Kept()


def _location(block: Any, extents: list[Any]) -> tuple[Any, ...]:
    """Where a result kept in ``block`` of this process is: a :class:`BlockLocation`'s
    fields, as a plain tuple."""
    return (machine(), os.getpid(), block.fd, block.token, extents, block.capacity)


def builtin(name: str) -> Any:
    """The function a built-in call runs, or None."""
    return {"@fetch": KEPT.fetch, "@drop": KEPT.drop}.get(name)


def read(location: KeptLocation, producer: str, copy: tuple[int, str] | None = None) -> Any:
    """A kept result, read where it is (what a handle unpickles to in a rank); ObjectLost
    naming ``producer`` when it is gone. ``copy``: the id and token under which this
    rank's node holds a copy of it, where the node is another machine than the
    producer's (its agent fetched it from the producer's: see ``Backend.copy_kept``)."""
    if isinstance(location, RayLocation):
        if not (IN_RAY_WORKER or _is_ray_driver()):
            raise NotImplementedError(
                f"{producer} is kept in Ray's object store, which only ranks on Ray (and the "
                "controller) can read; fetch it with .get() and pass the value")
        try:
            return shared.from_ray(0, location, False)
        except shared.NotShared as exc:
            raise ObjectLost(f"{producer} is lost: {exc}") from None
    if location.machine != machine() and copy is not None:
        try:
            return shared.resolve(*copy)
        except shared.NotShared as exc:
            raise ObjectLost(f"{producer} is lost: this node's copy of it is gone "
                             f"({exc})") from None
    if location.machine != machine():
        raise NotImplementedError(
            f"{producer} is kept on another machine: a rank reads kept results of its own "
            "machine (or Ray's object store) only; fetch it with .get() and pass the "
            "value, or put() it")
    try:
        block = shared.map_block(location.pid, location.fd, location.token,
                                 location.capacity, False, locked=True)
    except shared.NotShared as exc:
        raise ObjectLost(f"{producer} is lost: {exc} (the rank that made it is gone)") from None
    return shared.unpickle(block, location.extents, False, [])


def _is_ray_driver() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
