"""Results kept on the rank that made them (``group.call(..., keep=True)``), and reading a
kept result named in a call of any group.

A call with the ``KEEP`` flag (:mod:`phalanx.wire.protocol`) runs as any other, but its result stays
here: pickled once (protocol 5) into an anonymous memory block of this process
(:class:`phalanx.wire.memfd.Block`), on every backend. The answer is only its size and
where it is; the controller makes a handle of it (:class:`phalanx.controller.refs.ResultRef`),
and where it is, a :class:`BlockLocation`, is what the handle carries into other calls. A
rank whose call names the handle reads the value straight from here: on the same machine it
maps the block through ``/proc/<pid>/fd/<n>`` (no copy: arrays are read-only views of it);
on an agent's node of another machine it maps the copy its agent fetched straight from the
producer's agent; on Ray, from another machine, it has a Ray task on the producer's node
read the block there, and Ray's object store bring the value over. The controller never
sees the bytes.

A Ray worker keeps its results in its own block too, not in Ray's object store: a
``ray.put`` of 64 MiB took a Ray worker 9-60 ms on a 2-core machine (its store allocating),
writing them into a block it pooled 6 ms; and a rank of the same machine maps the block
with no copy, as a Ray worker maps its node's store.

Built-in calls (the ``BUILTIN`` flag; their names start with :data:`BUILTIN`, which keeps
them apart from the user's methods in traces) serve the controller: ``@fetch`` (a
kept value, for ``handle.get()`` from another machine), ``@drop`` (the handles were freed:
forget them; views other ranks hold keep their pages), ``@kept`` (every result kept here,
with its call and method: what a controller attaching to a detached group makes handles
of again) and ``@trace`` (the spans a trace recorded: :mod:`phalanx.rank.tracing`).

A dropped result's block is kept for the next results (at most :data:`POOL_BLOCKS`, each
closed after :data:`POOL_IDLE` s unused): writing into pages that exist is a plain memory
copy, several times faster than making a new block's. A block is reused only once no
process reads it: every reader holds a shared lock on it while a view of what it read
lives (one per read, :class:`Mappings`; a copy-on-write mapping's while the mapping lives,
:func:`phalanx.wire.memfd.read_lock`), released with its last view or its process.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx.config import SHARE_BLOCK_PREFIX
from phalanx.rank import rows, shared, tracing
from phalanx.wire import pickling

if TYPE_CHECKING:  # what a handle's rows are; the rank never needs the module itself
    from phalanx.wire.memfd import Block, Extents
    from phalanx.world.rowselect import Rows

BUILTIN = "@"  # the names of the calls phalanx's runtime serves itself start with it
IN_RAY_WORKER = False  # set when the rank runs in its Ray actor's worker (start_in_actor)
POOL_BLOCKS = 4  # dropped results' blocks a rank keeps for its next results
POOL_IDLE = 2.0  # seconds a pooled block waits for a result before it is closed
MAP_IDLE = 1.0  # seconds a reader's mapping of a kept block stays unused before it goes
RANK: int | None = None  # this process's rank, set by its runtime (None: not a rank)


class BlockLocation(NamedTuple):
    """A result kept in a memory block of its producer's process."""

    machine: str  # whose blocks these are (memfd.block_domain): who may map it
    pid: int
    fd: int  # the block's descriptor in that process (/proc/<pid>/fd/<fd>)
    token: str  # the block's name: a reused descriptor number is never mistaken for it
    extents: list[Any]  # (offset, length) of the pickle, then of each buffer
    capacity: int  # the block's size
    # it holds torch tensors: readers map it copy-on-write (torch has no read-only views,
    # and a rank writing into what it was given must not change the producer's value)
    tensors: bool = False
    # the producer's Ray node, where it runs on Ray: a rank of another machine has a Ray
    # task there read the block (read_on_node); None on the other backends
    ray_node: str | None = None

    def block(self) -> list[Any]:
        """(pid, fd, token, extents, capacity, tensors): what an agent that copies the
        result from the producer's agent names (the cluster backend's COPY)."""
        return [self.pid, self.fd, self.token, self.extents, self.capacity, self.tensors]


KeptLocation = BlockLocation  # where a kept result is, as handles carry it


def _lost(message: str) -> Exception:
    """ObjectLost with ``message``: phalanx.errors is imported at the first loss, not with
    every rank (its dataclasses and tracebacks are a good part of a rank's start-up)."""
    from phalanx.errors import ObjectLost

    return ObjectLost(message)


def location_of(answer: Any) -> KeptLocation:
    """A rank's answer to a kept call says where the result is as a plain tuple (so that
    it pickles as fast as any small answer); the same, named."""
    return BlockLocation(*answer)


@functools.cache
def machine() -> str:
    """Whose blocks this process may map (:func:`phalanx.wire.memfd.block_domain`), asked
    once, on first use: a rank that never keeps or reads a result does not pay for it at
    start-up."""
    from phalanx.wire import memfd

    return memfd.block_domain()


@functools.cache
def _ray_node_id() -> str:
    import ray

    node: str = ray.get_runtime_context().get_node_id()
    return node


def ray_node() -> str | None:
    """This rank's Ray node (asked once), in a Ray worker; None elsewhere."""
    return _ray_node_id() if IN_RAY_WORKER else None


class Kept:
    """This rank's kept results, by the id of the call that made them (``keep=True``) or
    by a negative id of their own (a :func:`keep` inside a result)."""

    def __init__(self) -> None:
        # key -> (its Block, extents, whether it holds tensors)
        self._held: dict[Hashable, tuple[Block, Extents, bool]] = {}
        self._pool: list[tuple[float, Any]] = []  # (when, Block) of dropped results
        self._lock = threading.Lock()  # calls on a thread pool may keep at once
        self._trimmer: threading.Thread | None = None
        self._pieces = itertools.count(-1, -1)  # keys of px.keep() values: never a call id
        # call id -> (its method, its answer): what a controller that attaches to a
        # detached group makes handles of again (``@kept``)
        self._answers: dict[Hashable, tuple[str, tuple[Any, ...]]] = {}

    def keep(self, call_id: int, value: Any, method: str = "") -> list[Any]:
        """Hold ``value``; the answer: its size, where it is and its rows (see ResultRef)."""
        answer = self._hold(call_id, value)
        with self._lock:
            if call_id in self._held:
                self._answers[call_id] = (method, answer)
        return pickling.dumps_fast(answer)

    def listing(self) -> list[tuple[Any, ...]]:
        """Every result a call kept here and no handle dropped (``@kept``): (call id,
        method, answer) for each, oldest first."""
        with self._lock:
            return [(key, method, answer) for key, (method, answer) in self._answers.items()
                    if key in self._held]

    def keep_piece(self, value: Any) -> tuple[Any, ...]:
        """Hold a :func:`keep` value met in a result: what the controller makes a handle
        of (the rank, its key, its size, where it is, its rows)."""
        key = next(self._pieces)
        return (RANK, key, *self._hold(key, value))

    def _hold(self, key: Hashable, value: Any) -> tuple[Any, ...]:
        _NESTING.depth += 1
        try:
            parts, tensors = pickling.dumps_noting(value)
        finally:
            _NESTING.depth -= 1
        nbytes = sum(memoryview(p).nbytes for p in parts)
        from phalanx.wire import memfd

        extents, size = memfd.extents_of(parts)
        block = self._reusable(size) or memfd.Block(size)
        held = (*block.fill(parts, extents), tensors)
        location = _location(*held)
        with self._lock:
            self._held[key] = held
        made = _NESTING.made
        if made is not None:
            made.append(key)
        return nbytes, location, rows.rows_of(value)

    def fetch(self, call_id: Hashable) -> Any:
        """A kept value, unpickled here (``@fetch``)."""
        with self._lock:
            held = self._held.get(call_id)
        if held is None:
            raise _lost(f"no result of call {call_id} is kept on this rank")
        return read(BlockLocation(*_location(*held)), f"the result of call {call_id}")

    def drop(self, call_ids: list[Hashable]) -> None:
        """Forget these results (``@drop``): their blocks go to the pool (the oldest of
        a full one closes: its memory goes once no view maps it)."""
        now = time.monotonic()
        closing = []
        with self._lock:
            for call_id in call_ids:
                self._answers.pop(call_id, None)
                held = self._held.pop(call_id, None)
                if held is not None:
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


class _Nesting(threading.local):
    depth = 0  # > 0 while this thread pickles a value it keeps
    made: list[Hashable] | None = None  # px.keep() values held while a result is pickled


def dumps_result(result: Any) -> list[Any]:
    """A call's result pickled to be sent back (the values it marks with :func:`keep`
    held here); if it cannot be, the values it had held are dropped again."""
    plain = pickling.dumps_plain(result)
    if plain is not None:
        return plain
    made: list[Hashable] = []
    _NESTING.made = made
    try:
        return pickling.dumps(result)
    except BaseException:
        if made:
            KEPT.drop(made)
        raise
    finally:
        _NESTING.made = None


_NESTING = _Nesting()


class Keep:
    """A value inside a rank's result that stays on the rank: what :func:`keep` returns.

    Pickled with the result, it is held here as a ``keep=True`` result is, and crosses
    to the controller as the small answer :func:`piece` makes a handle of."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        if RANK is None:
            raise TypeError("px.keep() marks a value in the result of a rank's method; "
                            "it cannot be sent from the controller")
        if _NESTING.depth:
            raise TypeError("px.keep() inside a value that is itself kept (keep=True or "
                            "another px.keep()); keep the parts side by side instead")
        return piece, KEPT.keep_piece(self.value)

    def __repr__(self) -> str:
        return f"px.keep({type(self.value).__name__})"


def keep(value: Any) -> Keep:
    """Keep ``value`` on this rank while the rest of the method's result goes back: the
    caller receives a :class:`~phalanx.controller.refs.ResultRef` in its place, as
    ``keep=True`` gives for a whole result. ``return {"tokens": px.keep(tokens),
    "lengths": lengths}`` sends the lengths and a handle on the tokens, whose bytes go
    only to the ranks whose calls name the handle."""
    return Keep(value)


class _Adopting(threading.local):
    # the future decoding a result on this thread (a controller's Call: .adopt_piece)
    future: Any = None


ADOPTING = _Adopting()


def piece(rank: int, key: int, nbytes: int, location: Any, rows: int | None) -> Any:
    """What a :func:`keep` value unpickles to in the controller: a handle made by the
    future whose result holds it (see :data:`ADOPTING`)."""
    future = ADOPTING.future
    if future is None:
        raise TypeError("a px.keep() value can only be read in the result of the call "
                        "that kept it")
    return future.adopt_piece(rank, key, (nbytes, location, rows))


def _location(block: Any, extents: list[Any], tensors: bool) -> tuple[Any, ...]:
    """Where a result kept in ``block`` of this process is: a :class:`BlockLocation`'s
    fields, as a plain tuple."""
    return (machine(), os.getpid(), block.fd, block.token, extents, block.capacity, tensors,
            ray_node())


WEIGHT_SYNC = "@sync."  # px.weight_sync's built-ins start so (phalanx.rank.weightsync.PREFIX)
SHARD_SYNC = "@sync.shard."  # those of its sharded sync (phalanx.rank.shardsync.PREFIX)


def builtin(name: str, obj: Any = None) -> Any:
    """The function a built-in call runs, or None. ``px.weight_sync``'s
    (:mod:`phalanx.rank.weightsync`, imported with the first of them: a rank that syncs
    no weights never imports it, nor torch) call the methods of the rank's object
    ``obj``."""
    if name.startswith(SHARD_SYNC):
        from phalanx.rank import shardsync

        return shardsync.builtin(name, obj)
    if name.startswith(WEIGHT_SYNC):
        from phalanx.rank import weightsync

        return weightsync.builtin(name, obj)
    return {"@fetch": KEPT.fetch, "@drop": KEPT.drop, "@trace": tracing.take,
            "@kept": KEPT.listing}.get(name)


def read_rows(places: list[tuple[Any, ...]], parts: list[tuple[int, Rows]]) -> Any:
    """What a handle on rows of kept results unpickles to in a rank: each kept result it
    cuts read where it is (``places``: :func:`read`'s arguments; once each, however many
    parts cut it), each part (the index of its place, its rows) cut out of its value,
    and the cuts joined in order (no parts: an empty list)."""
    values = [read(*where) for where in places]
    return rows.join([rows.cut(values[place], picked) for place, picked in parts])


def read(location: KeptLocation, producer: str, copy: tuple[int, str] | None = None) -> Any:
    """A kept result, read where it is (what a handle unpickles to in a rank); ObjectLost
    naming ``producer`` when it is gone. ``copy``: the id and token under which this
    rank's node holds a copy of it, where the node is another machine than the
    producer's (its agent fetched it from the producer's: see ``Backend.copy_kept``)."""
    if location.machine == machine():
        return _mapped(location, producer)
    if copy is not None:
        try:
            # tensors: a fresh copy-on-write mapping per call, as the producer's own is
            return shared.resolve(*copy, private=location.tensors)
        except shared.NotShared as exc:
            raise _lost(f"{producer} is lost: this node's copy of it is gone "
                             f"({exc})") from None
    if location.ray_node is not None and (IN_RAY_WORKER or _is_ray_driver()):
        return _read_through_ray(location, producer)
    raise NotImplementedError(
        f"{producer} is kept on another machine: a rank reads kept results of its own "
        "machine (or, on Ray, of its Ray cluster) only; fetch it with .get() and pass the "
        "value, or put() it")


def _mapped(location: KeptLocation, producer: str) -> Any:
    """A kept result of this machine, unpickled from a mapping of its block (holding the
    block's read lock while any view of it lives): the mapping this process keeps of it
    (:class:`Mappings`), or, for torch tensors, a copy-on-write mapping of this read's own."""
    try:
        if not location.tensors:
            return MAPPINGS.read(location)
        block = shared.map_block(location.pid, location.fd, location.token,
                                 location.capacity, location.tensors, locked=True)
    except shared.NotShared as exc:
        raise _lost(f"{producer} is lost: {exc} (the rank that made it is gone)") from None
    return shared.unpickle(block, location.extents, location.tensors, [])


class Mappings:
    """This process's mappings of kept blocks, kept from one read to the next.

    A rank that reads another's results round after round reads the same few blocks (its
    producer reuses them: :meth:`Kept._reusable`); mapped once, a block costs nothing the
    next time, where mapping 64 MiB afresh -- its page table filled, then torn down after
    the call -- costs a reader half of what summing its floats does. The read lock that
    keeps the producer from writing into the block is not the mapping's: each read takes
    it on a descriptor of its own, released once no view of that read is left, so a
    block nobody holds a view of is reused while it stays mapped here (a shared mapping:
    the next result is in it). A mapping goes :data:`MAP_IDLE` s after its last read (its
    pages once no view of them is left), so that it holds no block its producer let go
    for long; one of the same descriptor with another name (a new block) goes at once.
    """

    def __init__(self) -> None:
        # (pid, fd, name) -> [the mapping, when it was last read]
        self._maps: dict[tuple[int, int, str], list[Any]] = {}
        self._lock = threading.Lock()  # calls on a thread pool may read at once
        self._trimmer: threading.Thread | None = None

    def read(self, location: KeptLocation) -> Any:
        """The value in ``location``'s block, its arrays read-only views of the mapping;
        NotShared when the producer no longer holds the block."""
        import ctypes
        import fcntl
        import weakref

        key = (location.pid, location.fd, location.token)
        lock = _open_block(*key)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)  # before the first view: see Block.unread
            mapping = self._mapping(key, lock, location.capacity)
            whole = (ctypes.c_char * location.capacity).from_buffer(mapping)
            # every view of this read references ``whole``: the lock goes with the last
            weakref.finalize(whole, os.close, lock).atexit = False
        except BaseException:
            os.close(lock)
            raise
        return shared.unpickle(whole, location.extents, False, [])

    def _mapping(self, key: tuple[int, int, str], lock: int, capacity: int) -> Any:
        """The mapping of ``key``'s block, made (from ``lock``, the read's descriptor of
        it) if this process has none."""
        import mmap

        now = time.monotonic()
        with self._lock:
            entry = self._maps.get(key)
            if entry is not None:
                entry[1] = now
                return entry[0]
        # a descriptor of its own: the mapping keeps one open, which must hold no lock
        file = os.open(f"/proc/self/fd/{lock}", os.O_RDWR | os.O_CLOEXEC)
        try:  # writable: ctypes views need it; only read-only views are handed out
            mapping = mmap.mmap(file, capacity, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(file)
        try:  # every page mapped in one go, none copied (see shared.map_block)
            mapping.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
        except OSError:
            pass
        with self._lock:
            for other in [k for k in self._maps if k[:2] == key[:2]]:
                del self._maps[other]  # that descriptor holds another block now
            self._maps[key] = [mapping, now]
            if self._trimmer is None:
                self._trimmer = threading.Thread(target=self._trim, daemon=True,
                                                 name="phalanx-kept-maps")
                self._trimmer.start()
        return mapping

    def _trim(self) -> None:
        """Forget mappings unread for MAP_IDLE s; end once there is none."""
        while True:
            time.sleep(MAP_IDLE / 2)
            now = time.monotonic()
            with self._lock:
                for key in [k for k, (_, used) in self._maps.items() if now - used >= MAP_IDLE]:
                    del self._maps[key]  # unmapped with its last view
                if not self._maps:
                    self._trimmer = None  # the next mapping starts another
                    return

    def __len__(self) -> int:
        return len(self._maps)


MAPPINGS = Mappings()


def _open_block(pid: int, fd: int, name: str) -> int:
    """A descriptor of this process's own on block ``name``, descriptor ``fd`` of process
    ``pid``; NotShared when that is not, or no longer, the block."""
    try:
        file = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise shared.NotShared(f"its holder (pid {pid}) no longer holds it "
                               f"({exc.strerror})") from None
    try:  # what was opened, not what the number named a moment before
        opened = os.readlink(f"/proc/self/fd/{file}")
    except OSError:
        opened = ""
    if not opened.startswith(f"/memfd:{SHARE_BLOCK_PREFIX}{name}"):
        os.close(file)
        raise shared.NotShared(f"its holder (pid {pid}) no longer holds it")
    return file


def read_on_node(location: KeptLocation, producer: str) -> Any:
    """What the Ray task that reads a kept result on its producer's node runs: the value,
    mapped from the block there; Ray copies it into its object store as the task's
    return, and from there to whoever gets it."""
    if location.machine != machine():
        raise _lost(f"{producer} could not be read: the Ray task sent to its node ran on "
                    "another machine")
    return _mapped(location, producer)


@functools.cache
def _read_task(ray: Any) -> Any:
    return ray.remote(num_cpus=0, max_retries=0)(read_on_node)


def ray_reader(location: KeptLocation) -> Any:
    """The Ray task (:func:`read_on_node`, no CPU of its own: it runs beside the ranks)
    bound to the node of ``location``'s producer, a rank on Ray."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert location.ray_node is not None  # kept by a rank on Ray
    where = NodeAffinitySchedulingStrategy(node_id=location.ray_node, soft=False)
    return _read_task(ray).options(scheduling_strategy=where)


def _read_through_ray(location: KeptLocation, producer: str) -> Any:
    """A kept result of a rank on Ray on another machine: read by a Ray task on its node
    and brought here by Ray (read-only arrays of this node's object store)."""
    import ray

    try:
        return ray.get(ray_reader(location).remote(location, producer),
                       timeout=shared.RAY_GET_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"Ray did not bring {producer} to this node within "
                           f"{shared.RAY_GET_TIMEOUT:.0f} s") from None
    except ray.exceptions.RayError as exc:  # the task failed, or its node is gone
        cause = getattr(exc, "cause", None) or exc
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if type(cause).__name__ == "ObjectLost":
            raise _lost(text) from None
        raise _lost(f"{producer} could not be read on its node: {text}") from None


def resolve_ray_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]
                          ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments as a Ray actor's method receives them: a Ray ``ObjectRef`` given
    as an argument itself (not nested in one) is replaced by its value, fetched here by
    Ray -- so code written against Ray actors moves as it is. Only in a Ray worker."""
    import ray

    refs = [a for a in (*args, *kwargs.values()) if isinstance(a, ray.ObjectRef)]
    if not refs:
        return args, kwargs
    try:
        values = dict(zip(map(id, refs), ray.get(refs, timeout=shared.RAY_GET_TIMEOUT),
                          strict=True))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"Ray did not bring the ObjectRef arguments {refs} to this node "
                           f"within {shared.RAY_GET_TIMEOUT:.0f} s") from None
    return (tuple(values.get(id(a), a) for a in args),
            {k: values.get(id(v), v) for k, v in kwargs.items()})


def _is_ray_driver() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
