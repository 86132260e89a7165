"""Results kept on the rank that made them (``group.call(..., keep=True)``), and reading a
kept result named in a call of any group.

A call whose method name starts with :data:`KEEP` runs as any other, but its result stays
here: pickled once (protocol 5) into an anonymous memory block of this process
(:class:`phalanx.wire.memfd.Block`), or, in a Ray worker, into Ray's object store
(``ray.put``, owned by this worker). The answer is only its size and where it is; the
controller makes a handle of it (:class:`phalanx.controller.kept.ResultRef`). A rank whose
call names the handle reads the value straight from here: on the same machine it maps the
block through ``/proc/<pid>/fd/<n>`` (no copy: arrays are read-only views of it); on Ray
it reads Ray's object store of its node; on an agent's node of another machine it maps
the copy its agent fetched straight from the producer's agent. The controller never sees
the bytes.

Two built-in calls (names starting with :data:`BUILTIN`) serve the controller:
``@fetch`` (a kept value, for ``handle.get()`` from another machine) and ``@drop`` (the
handles were freed: forget them; views other ranks hold keep their pages).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from phalanx.errors import ObjectLost
from phalanx.rank import shared
from phalanx.wire import pickling

KEEP = "~"  # a call's method name starts with it: keep its result here
BUILTIN = "@"  # the name of a call phalanx's runtime serves itself
IN_RAY_WORKER = False  # set when the rank runs in its Ray actor's worker (serve_in_actor)


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
        self._held: dict[int, Any] = {}  # call id -> (its Block, extents), or its ObjectRef
        self._lock = threading.Lock()  # calls on a thread pool may keep at once

    def keep(self, call_id: int, value: Any) -> list[Any]:
        """Hold ``value``; the answer: its size and where it is (see ResultRef)."""
        parts = pickling.dumps(value)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if IN_RAY_WORKER:
            import numpy
            import ray

            held = ray.put([numpy.frombuffer(p, numpy.uint8) for p in parts])
            location: tuple = shared.ray_location(held)
        else:
            from phalanx.wire import memfd

            block, extents = memfd.Block.holding(parts)
            held = (block, extents)
            location = (machine(), os.getpid(), block.fd, block.token, extents,
                        block.capacity)
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
            return read((machine(), os.getpid(), block.fd, block.token, extents,
                         block.capacity), f"the result of call {call_id}")
        return read(shared.ray_location(held), f"the result of call {call_id}")

    def drop(self, call_ids: list[int]) -> None:
        """Forget these results (``@drop``): their blocks close once no view maps them."""
        with self._lock:
            dropped = [self._held.pop(i, None) for i in call_ids]
        for held in dropped:
            if isinstance(held, tuple):
                held[0].close()

    def __len__(self) -> int:
        return len(self._held)


KEPT = Kept()


def builtin(name: str) -> Any:
    """The function a built-in call runs, or None."""
    return {"@fetch": KEPT.fetch, "@drop": KEPT.drop}.get(name)


def read(location: tuple, producer: str, copy: tuple | None = None) -> Any:
    """A kept result, read where it is (what a handle unpickles to in a rank); ObjectLost
    naming ``producer`` when it is gone. ``copy``: the id and token under which this
    rank's node holds a copy of it, where the node is another machine than the
    producer's (its agent fetched it from the producer's: see ``Backend.copy_kept``)."""
    if location[0] == shared.RAY_LOCATION:
        if not (IN_RAY_WORKER or _is_ray_driver()):
            raise NotImplementedError(
                f"{producer} is kept in Ray's object store, which only ranks on Ray (and the "
                "controller) can read; fetch it with .get() and pass the value")
        try:
            return shared._from_ray(0, location, False)
        except shared.NotShared as exc:
            raise ObjectLost(f"{producer} is lost: {exc}") from None
    _, pid, fd, name, extents, capacity = location
    if location[0] != machine() and copy is not None:
        try:
            return shared.resolve(*copy)
        except shared.NotShared as exc:
            raise ObjectLost(f"{producer} is lost: this node's copy of it is gone "
                             f"({exc})") from None
    if location[0] != machine():
        raise NotImplementedError(
            f"{producer} is kept on another machine: a rank reads kept results of its own "
            "machine (or Ray's object store) only; fetch it with .get() and pass the "
            "value, or put() it")
    try:
        block = shared.map_block(pid, fd, name, capacity, False)
    except shared.NotShared as exc:
        raise ObjectLost(f"{producer} is lost: {exc} (the rank that made it is gone)") from None
    return shared._unpickle(block, extents, False, [])


def _is_ray_driver() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
