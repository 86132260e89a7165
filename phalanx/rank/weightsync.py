"""A rank's side of ``px.weight_sync`` (:mod:`phalanx.controller.weightsync`): the built-in
calls that move a state dict from the source rank to every target rank.

The controller sends them as phalanx's own calls (names starting with :data:`PREFIX`;
:func:`phalanx.rank.kept.builtin` finds them here, importing this module on the first,
so a rank that never syncs weights never imports it, nor torch). Each runs on the rank's
main thread, as a user call does, and calls the user's methods on the rank's object:
the source's ``get`` (once per push) and each target's ``set``.

One weight sync, on one rank, is a :class:`_Member` in :data:`SYNCS`, under the sync's
id and the *generation* the controller formed it in: a call naming another generation
(the rank's process is younger than the sync's last formation, or an older formation
was replaced) fails at once instead of waiting for peers that will not come. A member
also knows the *version* (the push's number) it last sent or loaded, kept when the sync
forms again (the weights it holds are still that version's): :data:`HELD` tells the
generation and version of both kinds of sync, so that the controller of a detached
group that attached carries the sync on where the ranks are (see
:mod:`phalanx.controller.weightsync`).

Two transports:

``broadcast`` (:data:`SEND` on the source, :data:`RECEIVE` on the targets)
    Over a joint gloo world of the source and the targets, a store and a
    ``dist.ProcessGroupGloo`` of the sync's own (never ``init_process_group``: the
    groups' own torch worlds stay as they are), made by :data:`FORM`. The store is
    :func:`phalanx.rank.joint.secret_store`'s: one member serves it on its node's address
    (not the wildcard), and only a peer that proves the formation's secret (made by the
    controller, sent inside FORM's arguments) reads or writes a key; its server takes no
    new connection once the world formed. The source
    broadcasts a fixed header (its status: a ``get`` that raised tells the targets so,
    and they return at once), then the metadata as JSON bytes (names, dtypes, shapes,
    the bucket size: never a pickle from a peer), then the tensors' bytes as uint8
    buckets of at most the bucket size: small tensors packed together through a
    staging buffer, one of at least :data:`IN_PLACE_BYTES` sent from and received into
    its own memory (no copy on either side), :data:`IN_FLIGHT` buckets at once. Both
    sides cut the buckets by the same rule (:func:`plan`) from the metadata. Every count
    and size read from the peer is checked against a limit before anything is
    allocated. A target receives into an arena of its own, kept for the next push while
    no tensor of it outlives ``set`` (:meth:`_Member.receiving`).

``shared`` (:data:`STAGE` on the source, :data:`LOAD` on the targets)
    Every member on one machine: the source pickles the state dict (protocol 5, the
    tensors' bytes out of band) into a memory block of its own (:class:`Block
    <phalanx.wire.memfd.Block>`) and answers where it is; each target maps it
    copy-on-write (a tensor ``set`` writes to gets its own pages), holding the block's
    read lock while any view lives, and hands ``set`` tensors that are views of it:
    no copy but ``set``'s own. The block is the sync's, kept for the next push: written
    again once no target maps it (a page that exists is a plain memory copy, several
    times cheaper than a new one's), replaced by a fresh one while some ``set`` kept
    views of it. (``keep=True`` blocks are pooled for ``POOL_IDLE`` seconds only; an
    RL step is longer, so each push would pay for new pages.)
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

# Every built-in's name starts with it: phalanx.rank.kept.WEIGHT_SYNC, on which
# kept.builtin routes them here (this module imports no kept: it is kept's to import).
PREFIX = "@sync."
HELLO = PREFIX + "hello"  # -> (machine or None, pid): where the rank is
FORM = PREFIX + "form"  # (sync id, generation, world spec or None, timeout)
SEND = PREFIX + "send"  # source, broadcast: (sync id, generation, get, bucket bytes)
RECEIVE = PREFIX + "receive"  # target, broadcast: (sync id, generation, set)
STAGE = PREFIX + "stage"  # source, shared: (sync id, generation, get) -> where the block is
LOAD = PREFIX + "load"  # target, shared: (sync id, generation, set, where)
CLOSE = PREFIX + "close"  # (sync id): forget it, its world and its block
HELD = PREFIX + "held"  # (sync id) -> what this rank holds of it (see held())
# (send, receive, stage and load take the push's version last: what the member records)

IN_FLIGHT = 2  # buckets broadcast at once (gloo's two threads; 16 MiB ones: ~20% faster)
# A tensor this large moves in place, one smaller is packed: a bucket costs ~0.7 ms more
# than its bytes (1 vs 4 MiB buckets of W12's weights), packing costs two copies of them
# (~0.2 ms/MiB each, at the source and at the target): even at ~1.75 MiB.
IN_PLACE_BYTES = 2 << 20
MAX_META_BYTES = 64 << 20  # of the metadata a target accepts (~1M tensors' names)
MAX_TENSORS = 1 << 20  # entries of one state dict
MAX_BUCKET_BYTES = 4 << 30  # of one bucket, as the source says it
_ALIGN = 64  # each received tensor starts on a cache line
_MAGIC = 0x50585753  # "PXWS": the header of a push, not some other broadcast
_OK, _FAILED = 0, 1  # the source's status in the header


class _Member:
    """This rank's part in one weight sync, in one generation of it."""

    def __init__(self, generation: int, timeout: float, version: int = 0) -> None:
        self.generation = generation
        self.timeout = timeout
        self.version = version  # of the last push this rank sent or loaded
        self.store: Any = None  # its joint store (kept as long as the world)
        self.world: Any = None  # dist.ProcessGroupGloo, for the broadcast transport
        self.staging: list[Any] = []  # IN_FLIGHT uint8 buffers for packed buckets
        self.block: Any = None  # memfd.Block the source stages into (shared transport)
        self.arena: Any = None  # anonymous mmap a target receives into (broadcast)
        self._owners: list[Any] = []  # the arena's slices the last push's tensors hold

    def join(self, address: str, port: int, rank: int, size: int, master: bool,
             secret: bytes) -> None:
        """Form the joint gloo world (every member at once: the process group waits for
        every member), the store served by ``master`` on ``address:port``, every member
        proving ``secret`` to it."""
        from datetime import timedelta

        import torch.distributed as dist

        from phalanx.rank.joint import secret_store

        timeout = timedelta(seconds=self.timeout)
        self.store = secret_store(address, port, secret, serve=master, timeout=self.timeout)
        self.world = dist.ProcessGroupGloo(self.store, rank, size, timeout)
        if master:
            # Every member connected before: each set its address there, which the
            # master's group read to connect to it. Nobody else needs the port.
            self.store.stop_listening()

    def staging_buffers(self, nbytes: int) -> list[Any]:
        """:data:`IN_FLIGHT` buffers of at least ``nbytes`` (kept for the next push)."""
        import torch

        if not self.staging or self.staging[0].numel() < nbytes:
            self.staging = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
        return self.staging

    def receiving(self, entries: list[tuple[str, Any, tuple[int, ...]]]
                  ) -> tuple[dict[str, Any], list[Any]]:
        """Tensors for ``entries`` (and their bytes, flat), views of the member's arena:
        the last push's, if it fits and no view of it is left (``set`` copied what it
        was given), else a new one -- the old one stays with the tensors ``set`` kept.
        Pages that exist cost nothing to receive into; new ones cost 0.6-2.6 s/GiB on the
        machine of W12."""
        import mmap

        import torch

        offsets, total = [], 0
        for _, dtype, shape in entries:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        arena = self.arena
        if arena is None or not total <= len(arena) <= 2 * total or self.held():
            arena = self.arena = mmap.mmap(-1, max(total, 1))
        view = memoryview(arena)
        state, flats, owners = {}, [], []
        with warnings.catch_warnings():  # torch.frombuffer: "not writable" (it is)
            warnings.simplefilter("ignore", UserWarning)
            for (name, dtype, shape), offset in zip(entries, offsets, strict=True):
                nbytes = math.prod(shape) * dtype.itemsize
                if not nbytes:
                    state[name] = torch.empty(shape, dtype=dtype)
                    flats.append(torch.empty(0, dtype=torch.uint8))
                    continue
                owner = view[offset:offset + nbytes]
                owners.append(owner)
                flat = torch.frombuffer(owner, dtype=torch.uint8)
                flats.append(flat)
                state[name] = flat.view(dtype).reshape(shape)
        self._owners = owners
        return state, flats

    def held(self) -> bool:
        """Whether a tensor of the last push still views the arena (each holds its slice
        of it: one referenced by more than the list and getrefcount's argument)."""
        owners = self._owners
        return any(sys.getrefcount(owners[i]) > 2 for i in range(len(owners)))

    def block_for(self, nbytes: int) -> Any:
        """The block to stage ``nbytes`` into: the last one if it fits (without wasting
        half of it) and no target maps it any more, else a new one (the old one's memory
        goes once the views that hold it do)."""
        from phalanx.wire import memfd

        block = self.block
        if block is not None and nbytes <= block.capacity <= 2 * nbytes and block.unread():
            return block
        if block is not None:
            block.close()
        self.block = None
        self.block = memfd.Block(nbytes)
        return self.block

    def close(self) -> None:
        self.world = None  # before its store: the group's pairs close first
        store, self.store = self.store, None
        if store is not None:
            store.close()
        self.staging = []
        self.arena, self._owners = None, []  # views of it keep it
        if self.block is not None:
            self.block.close()
            self.block = None


class _Held(Protocol):
    generation: int

    def close(self) -> None: ...


M = TypeVar("M", bound=_Held)


class Syncs(Generic[M]):
    """This rank's weight syncs of one kind (``what``: "weight sync"), by id (calls on a
    thread pool may come at once); ``step``: what forms one again ("push")."""

    def __init__(self, what: str, step: str) -> None:
        self._what, self._step = what, step
        self._members: dict[str, M] = {}
        self._lock = threading.Lock()

    def form(self, sync_id: str, member: M) -> None:
        with self._lock:
            old = self._members.pop(sync_id, None)
            self._members[sync_id] = member
        if old is not None:
            old.close()

    def held(self, sync_id: str) -> M | None:
        """The sync's member, of whatever generation (None: this rank holds none)."""
        with self._lock:
            return self._members.get(sync_id)

    def get(self, sync_id: str, generation: int | None = None) -> M:
        """The sync's member (of ``generation``, unless None); LookupError if this rank
        holds none, or another generation."""
        with self._lock:
            member = self._members.get(sync_id)
        if member is None or (generation is not None and member.generation != generation):
            held = "none" if member is None else f"generation {member.generation}"
            raise LookupError(
                f"this rank holds no generation {generation} of {self._what} {sync_id} "
                f"(it holds {held}): its process started after the sync last formed; the "
                f"next {self._step} forms it again")
        return member

    def close(self, sync_id: str) -> None:
        with self._lock:
            member = self._members.pop(sync_id, None)
        if member is not None:
            member.close()

    def __len__(self) -> int:
        return len(self._members)


SYNCS: Syncs[_Member] = Syncs("weight sync", "push")


# -- the built-ins ------------------------------------------------------------------------


def hello(obj: Any, sync_id: str) -> tuple[str | None, int]:
    """Where this rank is: the machine whose blocks it maps (None: it maps none), its pid."""
    from phalanx.wire import memfd

    return (memfd.block_domain() if memfd.supported() else None), os.getpid()


def form(obj: Any, sync_id: str, generation: int, spec: tuple[Any, ...] | None,
         timeout: float) -> None:
    """Take part in ``generation`` of the sync (replacing any older one): in its joint
    gloo world ``spec`` = ``(address, port, rank, size, master, secret)``, or none
    (shared). The version of the weights it holds is the old member's."""
    old = SYNCS.held(sync_id)
    version = 0 if old is None else old.version
    SYNCS.close(sync_id)  # the old world first: a port or pages it holds are not needed
    member = _Member(generation, timeout, version)
    if spec is not None:
        try:
            member.join(*spec)
        except BaseException:
            member.close()
            raise
    SYNCS.form(sync_id, member)


def close(obj: Any, sync_id: str) -> None:
    SYNCS.close(sync_id)


def held(obj: Any, sync_id: str) -> dict[str, Any]:
    """What this rank holds of the sync ``sync_id``: its ``pid``; ``plain``, ``[generation,
    version]`` of its whole-state-dict member (None: none); ``parts``, ``[generation,
    applied version or None]`` of its by-parts member (:mod:`phalanx.rank.shardsync`,
    read only where this process imported it: else it holds none)."""
    member = SYNCS.held(sync_id)
    plain = None if member is None else [member.generation, member.version]
    parts = None
    shards = sys.modules.get("phalanx.rank.shardsync")
    if shards is not None:
        shard = shards.SYNCS.held(sync_id)
        if shard is not None:
            parts = [shard.generation, shard.applied]
    return {"pid": os.getpid(), "plain": plain, "parts": parts}


def send(obj: Any, sync_id: str, generation: int, get: str, bucket: int,
         version: int = 0) -> dict[str, int]:
    """The source's push over the joint world: header, metadata, buckets."""
    import torch

    member = _world_of(sync_id, generation)
    try:
        state = state_of(obj, get)
    except BaseException:
        _broadcast_header(member.world, _FAILED, 0)  # the targets return at once
        raise
    names = list(state)
    tensors = [state[name] for name in names]
    meta = json.dumps({"bucket": bucket, "tensors": [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        for name, t in zip(names, tensors, strict=True)]}).encode()
    _broadcast_header(member.world, _OK, len(meta))
    _broadcast(member.world, torch.frombuffer(bytearray(meta), dtype=torch.uint8)).wait()
    flats = [_bytes_of(t) for t in tensors]
    ops = plan([flat.numel() for flat in flats], bucket)
    _run(member, ops, flats, source=True)
    member.version = version
    return {"bytes": sum(flat.numel() for flat in flats), "tensors": len(tensors),
            "buckets": len(ops)}


def receive(obj: Any, sync_id: str, generation: int, set_: str,
            version: int = 0) -> dict[str, int]:
    """A target's push over the joint world: the source's state dict received into
    tensors of the member's arena (:meth:`_Member.receiving`), then ``set`` called with
    them: its own to keep (the next push then receives into a new arena)."""
    import torch

    member = _world_of(sync_id, generation)
    loader = _method(obj, set_)
    header = torch.zeros(4, dtype=torch.int64)
    _broadcast(member.world, header).wait()
    magic, status, length, _ = (int(v) for v in header)
    if magic != _MAGIC:
        raise RuntimeError(f"weight sync {sync_id}: the source's header is not a push's "
                           f"({magic:#x}); the joint world is out of step")
    if status != _OK:
        return {"bytes": 0, "tensors": 0, "buckets": 0, "received": 0}  # its error says why
    if not 0 < length <= MAX_META_BYTES:
        raise RuntimeError(f"weight sync {sync_id}: the source announced {length} bytes of "
                           f"metadata (at most {MAX_META_BYTES})")
    raw = torch.empty(length, dtype=torch.uint8)
    _broadcast(member.world, raw).wait()
    bucket, entries = parse_meta(bytes(raw.numpy()))
    state, flats = member.receiving(entries)
    ops = plan([flat.numel() for flat in flats], bucket)
    _run(member, ops, flats, source=False)
    received = sum(flat.numel() for flat in flats)
    del flats
    loader(state)
    member.version = version
    return {"bytes": received, "tensors": len(state), "buckets": len(ops), "received": 1}


def stage(obj: Any, sync_id: str, generation: int, get: str,
          version: int = 0) -> tuple[Any, ...]:
    """The source's push through shared memory: ``get``'s state dict into the sync's
    block; the answer is where it is, ``(machine, pid, fd, token, extents, capacity)``,
    and its ``(tensors, bytes)``."""
    from phalanx.wire import memfd, pickling

    member = SYNCS.get(sync_id, generation)
    state = state_of(obj, get)
    parts = pickling.dumps(state)
    extents, size = memfd.extents_of(parts)
    block = member.block_for(size)
    try:
        block.write(parts, extents)
    except BaseException:
        member.block = None
        block.close()
        raise
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    member.version = version
    where = (memfd.block_domain(), os.getpid(), block.fd, block.token, extents,
             block.capacity)
    return where, len(state), nbytes


def load(obj: Any, sync_id: str, generation: int, set_: str,
         where: tuple[Any, ...], version: int = 0) -> dict[str, int]:
    """A target's push through shared memory: ``set`` called with views of the source's
    block, mapped copy-on-write (and unmapped with the last view of it)."""
    from phalanx.rank import shared
    from phalanx.wire import memfd

    member = SYNCS.get(sync_id, generation)
    loader = _method(obj, set_)
    machine, pid, fd, token, extents, capacity = where
    if machine != memfd.block_domain():
        raise RuntimeError(f"weight sync {sync_id}: the source's block is on machine "
                           f"{machine}, this rank on {memfd.block_domain()}")
    mapping = shared.map_block(pid, fd, token, capacity, True, locked=True)
    state = shared.unpickle(mapping, extents, True, [])
    del mapping  # the views hold it (and its read lock) as long as they live
    loader(state)
    member.version = version
    return {"bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensors": len(state)}


_BUILTINS: dict[str, Callable[..., Any]] = {
    HELLO: hello, FORM: form, SEND: send, RECEIVE: receive, STAGE: stage, LOAD: load,
    CLOSE: close, HELD: held,
}


def builtin(name: str, obj: Any) -> Callable[..., Any] | None:
    """The function the built-in call ``name`` runs on this rank, its object ``obj``
    bound (None: no such built-in)."""
    fn = _BUILTINS.get(name)
    return None if fn is None else functools.partial(fn, obj)


# -- the state dict -----------------------------------------------------------------------


def state_of(obj: Any, get: str) -> dict[str, Any]:
    """``obj.get()``, checked to be a state dict (str -> dense torch tensor), as plain
    contiguous CPU tensors without autograd (views where they already are)."""
    import torch

    state = _method(obj, get)()
    if not isinstance(state, Mapping):
        raise TypeError(f"{get}() returned {type(state).__name__}; a weight sync needs a "
                        "dict of name -> torch.Tensor (a state_dict())")
    if len(state) > MAX_TENSORS:
        raise ValueError(f"{get}() returned {len(state)} tensors; a weight sync takes at "
                         f"most {MAX_TENSORS}")
    out = {}
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise TypeError(f"{get}() returned the key {name!r}; a weight sync needs str "
                            "names")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{get}()[{name!r}] is {type(tensor).__name__}, not a "
                            "torch.Tensor")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"{get}()[{name!r}] is a {tensor.layout} "
                            f"{'quantized ' if tensor.is_quantized else ''}tensor; a "
                            "weight sync moves dense (strided) tensors only")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        out[name] = tensor.resolve_conj().resolve_neg().contiguous()
    return out


def parse_meta(raw: bytes) -> tuple[int, list[tuple[str, Any, tuple[int, ...]]]]:
    """The bucket size and ``(name, dtype, shape)`` of each tensor, from the source's
    metadata, every field checked (ValueError naming the first that is wrong)."""
    import torch

    try:
        meta = json.loads(raw)
        bucket, listed = meta["bucket"], meta["tensors"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the source's metadata is not a weight sync's: {exc}") from None
    if type(bucket) is not int or not 0 < bucket <= MAX_BUCKET_BYTES:
        raise ValueError(f"the source's bucket size {bucket!r} is not 1..{MAX_BUCKET_BYTES}")
    if type(listed) is not list or len(listed) > MAX_TENSORS:
        raise ValueError(f"the source's metadata lists {type(listed).__name__} of tensors "
                         f"(at most {MAX_TENSORS})")
    entries = []
    for entry in listed:
        if type(entry) is not list or len(entry) != 3:
            raise ValueError(f"the source's metadata holds {entry!r}, not [name, dtype, shape]")
        name, dtype_name, shape = entry
        dtype = getattr(torch, dtype_name, None) if type(dtype_name) is str else None
        if type(name) is not str or not isinstance(dtype, torch.dtype):
            raise ValueError(f"the source's metadata holds {entry!r}: not a name and a "
                             "torch dtype")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"the source's metadata gives {name!r} the shape {shape!r}")
        entries.append((name, dtype, tuple(shape)))
    return bucket, entries


def plan(sizes: list[int], bucket: int) -> list[list[tuple[int, int, int]]]:
    """The buckets of a push: each a list of ``(tensor, offset, length)`` byte segments
    of at most ``bucket`` bytes in all, the same on every member (pure). A tensor of at
    least :data:`IN_PLACE_BYTES` (or a bucket) travels in place, cut into buckets of its
    own; smaller ones are packed in order, a bucket going out when the next does not fit.
    A bucket of one segment travels in place."""
    ops: list[list[tuple[int, int, int]]] = []
    packed: list[tuple[int, int, int]] = []
    used = 0
    in_place = min(IN_PLACE_BYTES, bucket)
    for i, size in enumerate(sizes):
        if size >= in_place:
            ops.extend([(i, start, min(bucket, size - start))]
                       for start in range(0, size, bucket))
            continue
        if not size:
            continue
        if used + size > bucket:
            ops.append(packed)
            packed, used = [], 0
        packed.append((i, 0, size))
        used += size
    if packed:
        ops.append(packed)
    return ops


# -- gloo -----------------------------------------------------------------------------------


def _world_of(sync_id: str, generation: int) -> _Member:
    member = SYNCS.get(sync_id, generation)
    if member.world is None:
        raise LookupError(f"weight sync {sync_id} generation {generation} formed no joint "
                          "world on this rank (it moves weights through shared memory)")
    return member


def _broadcast(world: Any, tensor: Any) -> Any:
    """Broadcast ``tensor`` from the joint world's rank 0 (the source), started."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return world.broadcast([tensor], options)


def _broadcast_header(world: Any, status: int, length: int) -> None:
    import torch

    _broadcast(world, torch.tensor([_MAGIC, status, length, 0], dtype=torch.int64)).wait()


def _run(member: _Member, ops: list[list[tuple[int, int, int]]], flats: list[Any],
         source: bool) -> None:
    """Broadcast every bucket of ``ops`` over ``flats`` (the tensors' bytes),
    :data:`IN_FLIGHT` at once: a bucket of one segment in place, the others through a
    staging buffer (packed before it is sent, unpacked once it is received)."""
    packed = max((sum(length for _, _, length in op) for op in ops if len(op) > 1),
                 default=0)
    staging = member.staging_buffers(packed) if packed else []
    window: collections.deque[tuple[Any, Callable[[], None] | None]] = collections.deque()
    try:
        for k, op in enumerate(ops):
            while len(window) >= IN_FLIGHT:  # frees the staging buffer this bucket may use
                _finish(*window.popleft())
            unpack: Callable[[], None] | None = None
            if len(op) == 1:
                i, start, length = op[0]
                buffer = flats[i][start:start + length]
            else:
                buffer = staging[k % IN_FLIGHT][:sum(length for _, _, length in op)]
                if source:
                    _pack(buffer, op, flats)
                else:
                    unpack = functools.partial(_unpack, buffer, op, flats)
            window.append((_broadcast(member.world, buffer), unpack))
        while window:
            _finish(*window.popleft())
    finally:
        for work, _ in window:  # a failed bucket: let those in flight end (or time out)
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the first failure is the one raised
                pass


def _finish(work: Any, unpack: Callable[[], None] | None) -> None:
    work.wait()
    if unpack is not None:
        unpack()


def _pack(buffer: Any, op: list[tuple[int, int, int]], flats: list[Any]) -> None:
    offset = 0
    for i, start, length in op:
        buffer[offset:offset + length].copy_(flats[i][start:start + length])
        offset += length


def _unpack(buffer: Any, op: list[tuple[int, int, int]], flats: list[Any]) -> None:
    offset = 0
    for i, start, length in op:
        flats[i][start:start + length].copy_(buffer[offset:offset + length])
        offset += length


def _bytes_of(tensor: Any) -> Any:
    """A contiguous tensor's bytes, as a flat uint8 view of it (no copy)."""
    import torch

    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.reshape(-1).view(torch.uint8)


def _method(obj: Any, name: str) -> Callable[..., Any]:
    method: Callable[..., Any] | None = getattr(obj, name, None)
    if method is None or not callable(method):
        raise AttributeError(f"{type(obj).__name__} has no method {name!r}")
    return method
