"""A rank's side of a sharded weight sync (``px.weight_sync(..., src_rank="all")``, the
controller's :mod:`phalanx.controller.shardsync`): every source rank sends the boxes of the
blocks it holds that the controller's plan (:mod:`phalanx.world.syncplan`) gives it, point
to point, to the target ranks that want them; each target stages what it receives and hands
it to the user's ``set`` when told to apply it.

The controller calls them as phalanx's own calls, named under :data:`PREFIX`
(:func:`phalanx.rank.kept.builtin` routes them here, importing this module on the first: a
rank that never syncs never imports it, nor torch). Each runs as a user call does; the
bytes arrive on threads of the target's own, never its main thread, so a target keeps
answering calls (generating) while a version is staged.

A sync, on one rank, is a :class:`_Member` in :data:`SYNCS`, under the sync's id and the
*generation* the controller formed it in: a call naming another generation fails at once
(the rank is younger than the formation) instead of waiting for peers that will not come.

A target (:func:`listen`) serves a :class:`phalanx.wire.shardwire.Listener` on its node's
address; every source proves the generation's secret there before it sends a byte
(:mod:`phalanx.wire.shardwire` is the pair protocol). :func:`expect` arms it for one
version: staging tensors of each wanted region's shape, views of an arena that is reused
for the next version while no tensor of it outlives ``set`` (the broadcast transport's
rule: :meth:`phalanx.rank.weightsync._Member.receiving`), and the transfers it will get.

A source (:func:`send`) calls ``get`` and sends what its tensors hold *while the call
runs*: every distinct box (a name's offset and shape) is copied once, however many targets
get it, in the order the targets need them, and each box's sends start as soon as it is
copied (copying box *k* overlaps sending box *k - 1*; the targets' connections are made
meanwhile). The call runs on the rank's main thread and returns once every target acked
(or failed), so nothing of the user's code on that thread (an optimizer step) runs while it
sends: what is sent is the tensors' values when ``send`` was called, and a step once it
returned changes nothing sent. A thread of the user's own writing the tensors while the
call runs races with it, as with any read of them (what it sends is then undefined, and a
``verify`` digest may fail). The boxes go:

- to a target on another machine, over TCP: from a buffer of the source's (reused while no
  sender of the last send is left), or straight from the tensor's memory where the box is
  contiguous there (a CPU tensor: nothing to copy); the target receives straight into its
  staging tensor's memory where the box is contiguous there, else into a buffer it then
  copies from;
- to targets on the same machine (``machine_id`` equal: :func:`phalanx.wire.memfd.block_domain`),
  into one memory block of the source's holding each box once for all of them
  (:class:`phalanx.wire.memfd.Block`, the shared transport's, written again only once no
  target maps it); only frames naming offsets in it cross the socket, and each target maps
  it (once per send), copies into staging and unmaps it before it acks the last batch.

Targets are sent to concurrently, a thread each, each bounded by ``timeout``: a target that
is dead, unreachable, stalls, or fails a transfer (``verify``: a blake2b digest per
transfer, which the target checks) is reported in ``send``'s errors and the others
complete. :func:`apply` calls ``set`` with the staged regions once every transfer of the
version arrived.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from phalanx.rank import weightsync
from phalanx.rank.weightsync import _method
from phalanx.wire import kvproto, shardwire, streams
from phalanx.wire.handshake import HandshakeIncomplete

logger = logging.getLogger(__name__)

# Under weightsync's "@sync." (kept.builtin sends that prefix to torch's side), but their
# own: "@sync.send" and "@sync.close" are the broadcast transport's.
PREFIX = "@sync.shard."
# (the arguments and answers of each: the functions of the same name below)
BLOCKS = PREFIX + "blocks"  # source: what it holds
WANTS = PREFIX + "wants"  # target: what it wants
LISTEN = PREFIX + "listen"  # target: serve its receiver -> (host, port, machine)
EXPECT = PREFIX + "expect"  # target: stage a version
SEND = PREFIX + "send"  # source: snapshot and send a version
APPLY = PREFIX + "apply"  # target: set() the staged version
VERSION = PREFIX + "version"  # target: the version applied, or None
CLOSE = PREFIX + "close"  # (sync id): forget it, its listener and its memory

# A source silent this long inside a batch (or between batches of one send) is dropped by
# its target: a source bounds its own sends by its timeout; this bounds a target's threads.
IDLE_TIMEOUT = 120.0
_JOIN_MARGIN = 5.0  # seconds past its timeout a send waits for a sender thread to end
_ALIGN = 64  # each transfer's bytes start on a cache line in a snapshot

# The broadcast transport's holder of an arena a target receives into (reused while no
# tensor of it outlives set) and of a block a source writes into (reused once unread).
_Holder = weightsync._Member  # noqa: SLF001 - its rules, shared rather than copied

# A test hook (set in a test's own process only): called with each piece's snapshot bytes
# after its digest (it makes every piece a copy: it must not write the user's tensors).
CORRUPT: Callable[[memoryview], None] | None = None


class _Transfer(NamedTuple):
    """One transfer a target expects."""

    name: str
    offset: tuple[int, ...]  # of the box in the target's region
    shape: tuple[int, ...]
    nbytes: int


class _Version:
    """A target's staging for one version: its tensors and what arrived."""

    def __init__(self, version: int, tensors: dict[str, Any],
                 transfers: dict[int, _Transfer]) -> None:
        self.version = version
        self.tensors = tensors
        self.transfers = transfers
        self.staged: set[int] = set()
        self.failed: dict[int, str] = {}
        self.received = 0  # bytes staged


class _Member:
    """This rank's part in one sharded sync, in one generation of it: as a target, its
    listener and staging; as a source, its blocks for targets on its machine."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.listener: shardwire.Listener | None = None
        self.secret = b""
        self.lock = threading.Lock()  # the staging, between the receivers and the calls
        self.pending: _Version | None = None
        self.applied: int | None = None
        self.arena = _Holder(generation, IDLE_TIMEOUT)  # staging, reused
        # as a source: the block of every target on this machine, this process's mapping
        # of it; the buffer of the TCP targets' copies; the last send's sender threads
        self.block = _Holder(generation, 0)
        self.mapped: tuple[Any, mmap.mmap] | None = None  # (memfd.Block, its mapping)
        self.buffer: Any = None
        self.senders: list[threading.Thread] = []

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        with self.lock:
            self.pending = None
        self.arena.close()
        self.unmap()
        self.block.close()
        self.buffer = None

    def map_block(self, nbytes: int) -> memoryview:
        """The bytes of the block to snapshot ``nbytes`` into (the last one, if it fits and
        no target maps it any more), through a mapping of this process kept with it: its
        pages, once there, cost nothing to write again."""
        block = self.block.block_for(max(nbytes, 1))
        if self.mapped is None or self.mapped[0] is not block:
            self.unmap()
            mapping = mmap.mmap(block.fd, block.capacity)
            try:  # its pages made in one go, not one fault each
                mapping.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
            except OSError:  # before Linux 5.14
                pass
            self.mapped = (block, mapping)
        return memoryview(self.mapped[1])

    def unmap(self) -> None:
        mapped, self.mapped = self.mapped, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view left: it goes with it
                mapped[1].close()


class Syncs(weightsync.Syncs[_Member]):
    """This rank's sharded syncs, by id; a member is made by :meth:`join`."""

    def join(self, sync_id: str, generation: int) -> _Member:
        """The sync's member of ``generation``, made (replacing an older one) if need be;
        LookupError if this rank holds a newer one."""
        with self._lock:
            member = self._members.get(sync_id)
            if member is not None and member.generation == generation:
                return member
            if member is not None and member.generation > generation:
                raise LookupError(f"sharded weight sync {sync_id}: this rank is in "
                                  f"generation {member.generation}, not {generation}")
            old, member = member, _Member(generation)
            if old is not None:  # the weights it holds are still that version's
                member.applied = old.applied
            self._members[sync_id] = member
        if old is not None:
            old.close()
        return member


SYNCS = Syncs("sharded weight sync", "stage")


# -- what a rank holds and wants ------------------------------------------------------------


def blocks(obj: Any, sync_id: str, get: str) -> list[tuple[Any, ...]]:
    """What ``get()`` returns now, per name: ``(name, offset, shape, full, dtype,
    itemsize)`` of the block this rank holds (a whole tensor: offset zeros, shape = full;
    a :class:`~phalanx.world.syncplan.Shard` or a DTensor: its block of the full tensor)."""
    out = []
    for name, value in _state(obj, get).items():
        tensor, offset, full = _block_of(name, value, get)
        out.append((name, offset, tuple(tensor.shape), full, _dtype_name(tensor.dtype),
                    tensor.element_size()))
    return out


def wants(obj: Any, sync_id: str, want: str | None,
          names_full: Mapping[str, tuple[Sequence[int], str]]
          ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The names this target wants and, per name, ``(offset, shape)`` of the region of the
    full tensor it wants, or None for all of it. ``want`` None: every name, whole; else
    ``want()`` returns ``{name: px.Region or (offset, shape) or None}``; names it omits
    are not sent here."""
    if want is None:
        return dict.fromkeys(names_full)
    asked = _method(obj, want)()
    if not isinstance(asked, Mapping):
        raise TypeError(f"{want}() returned {type(asked).__name__}; a weight sync needs a "
                        "dict of name -> px.Region or None")
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
    for name, region in asked.items():
        if name not in names_full:
            known = ", ".join(sorted(map(str, names_full))[:10])
            raise KeyError(f"{want}() wants {name!r}, which no source holds (they hold "
                           f"{known}{', ...' if len(names_full) > 10 else ''})")
        if region is None:
            out[name] = None
            continue
        if isinstance(region, tuple) and len(region) == 2:
            offset, shape = region
        else:
            offset, shape = getattr(region, "offset", None), getattr(region, "shape", None)
        full = tuple(names_full[name][0])
        try:
            offset, shape = tuple(int(x) for x in offset), tuple(int(x) for x in shape)
        except TypeError:
            raise TypeError(f"{want}()[{name!r}] is {region!r}, not a px.Region") from None
        if not _within(offset, shape, full):
            raise ValueError(f"{want}()[{name!r}] wants {shape} at {offset}, which is not "
                             f"within the full shape {full}")
        out[name] = (offset, shape)
    return out


# -- the target ---------------------------------------------------------------------------


def listen(obj: Any, sync_id: str, generation: int, secret_hex: str,
           host: str | None = None) -> tuple[str, int, str | None]:
    """Serve this target's listener for ``generation`` (once: a second call returns the
    same) on ``host``, its node's address (None: see :func:`node_address`) -> ``(host,
    port, machine)``, ``machine`` the blocks it can map (None: none)."""
    from phalanx.wire import memfd

    secret = kvproto.check_secret(bytes.fromhex(secret_hex))
    member = SYNCS.join(sync_id, generation)
    with member.lock:
        if member.listener is None:
            member.secret = secret
            member.listener = shardwire.Listener(host or node_address(), secret,
                                                 functools.partial(_receive, member))
        elif member.secret != secret:
            raise ValueError(f"sharded weight sync {sync_id} generation {generation} "
                             "listens with another secret")
        address, port = member.listener.address
    return address, port, memfd.block_domain() if memfd.supported() else None


def node_address() -> str:
    """This rank's node's address when the controller did not say: node 0's is
    ``MASTER_ADDR``; another's, the address its host name resolves to."""
    if os.environ.get("PHALANX_NODE_RANK", os.environ.get("NODE_RANK")) == "0" and (
            os.environ.get("MASTER_ADDR")):
        return os.environ["MASTER_ADDR"]
    return socket.gethostbyname(socket.gethostname())


def expect(obj: Any, sync_id: str, generation: int, version: int,
           layout: Mapping[str, tuple[Sequence[int], str]],
           transfers: Sequence[tuple[int, str, Sequence[int], Sequence[int], int]]) -> None:
    """Arm the receiver for ``version``: staging tensors of ``layout`` (name -> the shape
    of its region and its dtype), and the ``transfers`` (tid, name, offset and shape of the
    box in the region, bytes) that fill them. Any version staged and not applied is
    dropped."""
    member = SYNCS.get(sync_id, generation)
    if member.listener is None:
        raise LookupError(f"sharded weight sync {sync_id} generation {generation} has no "
                          "listener on this rank: listen first")
    entries = [(name, _dtype(dtype), tuple(int(d) for d in shape))
               for name, (shape, dtype) in layout.items()]
    specs: dict[int, _Transfer] = {}
    for tid, name, offset, shape, nbytes in transfers:
        if name not in layout:
            raise ValueError(f"transfer {tid} is of {name!r}, which the layout lacks")
        region = tuple(layout[name][0])
        box_offset, box_shape = tuple(offset), tuple(shape)
        itemsize = _dtype(layout[name][1]).itemsize
        if not _within(box_offset, box_shape, region):
            raise ValueError(f"transfer {tid}: a box of {box_shape} at {box_offset} is not "
                             f"within {name!r}'s region {region}")
        if nbytes != math.prod(box_shape) * itemsize or tid in specs:
            raise ValueError(f"transfer {tid} of {name!r}: {nbytes} bytes for a box of "
                             f"{box_shape} (or a tid given twice)")
        specs[tid] = _Transfer(name, box_offset, box_shape, nbytes)
    with member.lock:
        member.pending = None  # before receiving(): its tensors are not held by us
        tensors, _ = member.arena.receiving(entries)
        member.pending = _Version(version, tensors, specs)


def apply(obj: Any, sync_id: str, generation: int, version: int,
          set_: str) -> tuple[int, float]:
    """``set({name: staged region})`` once every transfer of ``version`` arrived -> the
    version and the seconds ``set`` took (RuntimeError naming what is missing)."""
    member = SYNCS.get(sync_id, generation)
    loader = _method(obj, set_)
    with member.lock:
        pending = member.pending
        if pending is None or pending.version != version:
            have = "none" if pending is None else f"version {pending.version}"
            raise RuntimeError(f"sharded weight sync {sync_id}: version {version} is not "
                               f"staged on this rank (it stages {have})")
        missing = sorted(set(pending.transfers) - pending.staged)
        if missing:
            failed = [f"{tid}: {pending.failed[tid]}" for tid in missing
                      if tid in pending.failed]
            raise RuntimeError(
                f"sharded weight sync {sync_id}: version {version} is not fully staged: "
                f"{len(missing)} of {len(pending.transfers)} transfers missing"
                + (f" ({'; '.join(failed[:5])})" if failed else ""))
        member.pending, member.applied = None, None  # None while set runs
    state = pending.tensors
    del pending
    start = time.perf_counter()
    loader(state)
    took = time.perf_counter() - start
    member.applied = version
    return version, took


def version(obj: Any, sync_id: str) -> int | None:
    """The version this target applied last (None: none, or ``set`` runs or raised)."""
    try:
        return SYNCS.get(sync_id).applied
    except LookupError:
        return None


def close(obj: Any, sync_id: str) -> None:
    SYNCS.close(sync_id)


def _receive(member: _Member, sock: socket.socket, sealer: kvproto.Sealer,
             opener: kvproto.Opener, peer: str) -> None:
    """Serve one source's connection (a listener's thread): each batch staged, then
    acked; a source's block stays mapped between its batches, and is unmapped before the
    last one's ack (the source writes it again once no target maps it)."""
    maps = _BlockMaps()
    try:
        while True:
            deadline = shardwire.Deadline(IDLE_TIMEOUT, stall=True)
            body = shardwire.read_frame(sock, opener, deadline)
            if body is None:
                return
            batch = shardwire.decode_batch(body)
            staged, failed = _stage_batch(member, sock, batch, deadline, maps)
            if batch.last:
                maps.release()
            shardwire.send_frame(sock, sealer, shardwire.encode_ack(staged, failed),
                                 deadline)
    finally:
        maps.release()


def _stage_batch(member: _Member, sock: socket.socket, batch: shardwire.Batch,
                 deadline: shardwire.Deadline, maps: _BlockMaps
                 ) -> tuple[int, list[tuple[int, str]]]:
    """Put each transfer of ``batch`` into its place in the staging of its version ->
    bytes staged, and (tid, why) of each transfer that failed. A transfer that cannot be
    placed is read and dropped (TCP), so the stream stays in step."""
    with member.lock:
        pending = member.pending
    wrong = None
    if pending is None or pending.version != batch.version:
        have = "none" if pending is None else f"version {pending.version}"
        wrong = f"the target expects no version {batch.version} (it expects {have})"
    staged, failed = 0, []
    block = maps.view(batch) if wrong is None else None
    for entry in batch.entries:
        why = wrong
        spec = None if pending is None else pending.transfers.get(entry.tid)
        if why is None and spec is None:
            why = f"transfer {entry.tid} is not one the target expects"
        elif why is None and spec is not None and spec.nbytes != entry.nbytes:
            why = (f"transfer {entry.tid} is {spec.nbytes} bytes at the target, "
                   f"{entry.nbytes} at the source")
        if why is None and pending is not None and spec is not None:
            why = _place(pending, spec, entry, sock, block, deadline)
        elif batch.mode == shardwire.TCP:
            shardwire.drain(sock, entry.nbytes, deadline)
        if why is None:
            staged += entry.nbytes
        else:
            failed.append((entry.tid, why))
        if pending is not None and spec is not None:
            with member.lock:
                if why is None:
                    pending.staged.add(entry.tid)
                    pending.failed.pop(entry.tid, None)
                    pending.received += entry.nbytes
                else:
                    pending.staged.discard(entry.tid)
                    pending.failed[entry.tid] = why
    return staged, failed


def _place(pending: _Version, spec: _Transfer, entry: shardwire.Entry, sock: socket.socket,
           block: memoryview | None, deadline: shardwire.Deadline) -> str | None:
    """One transfer's bytes into its box of the staging tensor (from the socket, or from
    the source's block) -> None, or why it failed (its digest)."""
    import torch

    dst = pending.tensors[spec.name][_slices(spec.offset, spec.shape)]
    if not entry.nbytes:
        return None
    if block is not None:
        data = block[entry.offset:entry.offset + entry.nbytes]
        if len(data) != entry.nbytes:
            return f"transfer {entry.tid} runs past the source's block"
        if entry.digest and shardwire.digest(data) != entry.digest:
            return f"transfer {entry.tid}'s bytes do not match their digest"
        with _quiet():
            dst.copy_(torch.frombuffer(data, dtype=dst.dtype).view(spec.shape))
        return None
    if dst.is_contiguous():  # straight into the staging tensor's memory
        memory = _memory(dst)
        shardwire.recv_into(sock, memory, deadline)
    else:
        scratch = torch.empty(entry.nbytes, dtype=torch.uint8)
        memory = _memory(scratch)
        shardwire.recv_into(sock, memory, deadline)
    if entry.digest and shardwire.digest(memory) != entry.digest:
        return f"transfer {entry.tid}'s bytes do not match their digest"
    if not dst.is_contiguous():
        dst.copy_(scratch.view(dst.dtype).view(spec.shape))
    return None


class _BlockMaps:
    """The source's block a connection's shared batches name, mapped (its read lock held)
    from the first batch that names it until :meth:`release`: the source writes it again
    once every target that read it released it."""

    def __init__(self) -> None:
        self._where: tuple[int, int, str, int] | None = None
        self._mapping: Any = None
        self._view: memoryview | None = None

    def view(self, batch: shardwire.Batch) -> memoryview | None:
        """The bytes of the block ``batch`` names (None for a TCP batch)."""
        if batch.mode != shardwire.SHARED:
            return None
        if self._where != batch.where:
            from phalanx.rank import shared

            self.release()
            pid, fd, token, capacity = batch.where
            self._mapping = shared.map_block(pid, fd, token, capacity, True, locked=True)
            self._view, self._where = memoryview(self._mapping), batch.where
        return self._view

    def release(self) -> None:
        view, self._view, self._where = self._view, None, None
        if view is not None:
            view.release()
        self._mapping = None  # with the last reference, its read lock goes


# -- the source ---------------------------------------------------------------------------


class _Piece:
    """One distinct box of a local block this send hands out, snapshot once for every
    target that gets it: in the member's block (targets on this machine), or in a buffer
    or, where the box is contiguous in the tensor, the tensor's own memory (TCP)."""

    def __init__(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...],
                 nbytes: int, shared: bool) -> None:
        self.name, self.offset, self.shape, self.nbytes = name, offset, shape, nbytes
        self.shared = shared
        self.at = 0  # where it starts in the block or the buffer
        self.source: Any = None  # the box of the local tensor (kept: ``memory`` may be its)
        self.own = False  # sent from the tensor's own memory: nothing to copy
        self.memory: memoryview | None = None  # its bytes (TCP), once ready
        self.digest = b""
        self.rank = 0  # the earliest place any target sends it at: the copying order
        self.ready = threading.Event()  # its bytes (and digest) are there, or the copy failed


class _Outgoing:
    """What one send hands one target: its transfers, each a piece, in order."""

    def __init__(self, key: Any, host: str, port: int, shared: bool) -> None:
        self.key, self.host, self.port, self.shared = key, host, port, shared
        self.items: list[tuple[int, _Piece]] = []  # (tid, piece)
        self.where: tuple[int, int, str, int] = (0, 0, "", 0)


class _Snapshot:
    """One send's copying, as its senders see it: ``failed`` says why it stopped."""

    def __init__(self) -> None:
        self.failed: str | None = None


def send(obj: Any, sync_id: str, generation: int, version: int, get: str,
         sends: Sequence[tuple[Any, ...]], verify: bool, timeout: float,
         secret_hex: str) -> dict[str, Any]:
    """Snapshot every box of ``sends`` (``(tid, target key, host, port, machine, name,
    offset, shape, nbytes)``: the box of this rank's block of ``name``) and send it to
    every target that gets it, all targets at once, each within ``timeout`` ->
    ``{"acked": {key: bytes}, "errors": {key: why}, "via": {key: "shared" or "tcp"},
    "snapshot_s", "send_s"}`` (``snapshot_s``: the copying, which the sends overlap;
    ``send_s``: from the first sender's start to the last ack). A target that fails is
    reported, not raised."""
    from phalanx.wire import memfd

    secret = kvproto.check_secret(bytes.fromhex(secret_hex))
    member = SYNCS.join(sync_id, generation)
    start = time.perf_counter()
    state = _state(obj, get)
    here = memfd.block_domain() if memfd.supported() else None
    targets: dict[Any, _Outgoing] = {}
    pieces: dict[tuple[Any, ...], _Piece] = {}
    locals_: dict[str, Any] = {}
    for tid, key, host, port, machine, name, offset, shape, nbytes in sends:
        if name not in state:
            raise KeyError(f"{get}() returned no {name!r}, which this rank holds in the "
                           "sync's plan")
        if name not in locals_:
            locals_[name] = _block_of(name, state[name], get)[0]
        outgoing = targets.get(key)
        if outgoing is None:
            outgoing = targets[key] = _Outgoing(key, host, port,
                                                here is not None and machine == here)
        offset, shape = tuple(offset), tuple(shape)
        tensor = locals_[name]
        if not _within(offset, shape, tuple(tensor.shape)) or (
                nbytes != math.prod(shape) * tensor.element_size()):
            raise ValueError(f"transfer {tid}: a box of {shape} at {offset} ({nbytes} bytes) "
                             f"is not within this rank's {tuple(tensor.shape)} {name!r}")
        where = (name, offset, shape, outgoing.shared)
        piece = pieces.get(where)
        if piece is None:
            piece = pieces[where] = _Piece(name, offset, shape, nbytes, outgoing.shared)
            piece.source, piece.rank = tensor[_slices(offset, shape)], len(outgoing.items)
        piece.rank = min(piece.rank, len(outgoing.items))
        outgoing.items.append((tid, piece))
    del state
    order = sorted(pieces.values(), key=lambda p: p.rank)  # (stable: the plan's order)
    snapshot = _Snapshot()
    copies, mapping = _lay_out(member, order, verify)
    shared_where = ((os.getpid(), member.block.block.fd, member.block.block.token,
                     member.block.block.capacity) if mapping is not None else (0, 0, "", 0))
    for outgoing in targets.values():
        if outgoing.shared:
            outgoing.where = shared_where
    acked: dict[Any, int] = {}
    errors: dict[Any, str] = {}
    sending = time.perf_counter()
    threads = [threading.Thread(target=_send_to, daemon=True, name="phalanx-shardsync-send",
                                args=(outgoing, version, secret, timeout, snapshot, acked,
                                      errors))
               for outgoing in targets.values()]
    member.senders = threads
    for thread in threads:
        thread.start()  # each connects (its handshake) while the pieces are copied
    try:
        _copy(copies, mapping, verify)
    except BaseException as exc:
        snapshot.failed = f"this source could not copy what it sends: {exc}"
        raise
    finally:
        if mapping is not None:
            mapping.release()
        snapshot_s = time.perf_counter() - start
        for piece in order:  # (those copied are set already)
            piece.ready.set()
        if snapshot.failed is not None:
            _join(threads, 5.0)
    del locals_
    end = time.monotonic() + timeout + _JOIN_MARGIN
    _join(threads, end - time.monotonic())
    for key in targets:  # a thread stuck past every deadline (it should not be)
        if key not in acked and key not in errors:
            errors[key] = f"no answer within {timeout:g} s"
    via = {key: "shared" if outgoing.shared else "tcp" for key, outgoing in targets.items()}
    return {"acked": dict(acked), "errors": dict(errors), "via": via,
            "snapshot_s": snapshot_s, "send_s": time.perf_counter() - sending}


def _join(threads: list[threading.Thread], seconds: float) -> None:
    end = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))


def _lay_out(member: _Member, pieces: list[_Piece], verify: bool
             ) -> tuple[list[_Piece], memoryview | None]:
    """Place each piece: the shared ones in the member's block (one for every target on
    this machine, written again only once no target maps it), the TCP ones in the member's
    buffer (reused once no sender of the last send is left), or in the tensor's own memory
    where the box is contiguous there (ready now, unless its digest is to be taken) ->
    the pieces to copy, in order, and the block's mapping (None: no shared piece)."""
    import torch

    shared_total = tcp_total = 0
    copies = []
    for piece in pieces:
        box = piece.source
        if not piece.shared and CORRUPT is None and box.device.type == "cpu" and (
                box.is_contiguous()):
            piece.memory, piece.own = _memory(box), True  # (``box`` holds that memory)
            if verify:
                copies.append(piece)
            else:
                piece.ready.set()
            continue
        copies.append(piece)
        if piece.shared:
            shared_total = -(-shared_total // _ALIGN) * _ALIGN
            piece.at, shared_total = shared_total, shared_total + piece.nbytes
        else:
            tcp_total = -(-tcp_total // _ALIGN) * _ALIGN
            piece.at, tcp_total = tcp_total, tcp_total + piece.nbytes
    if tcp_total:
        buffer = member.buffer
        if buffer is None or not tcp_total <= buffer.numel() <= 2 * tcp_total or any(
                thread.is_alive() for thread in member.senders):
            buffer = member.buffer = torch.empty(tcp_total, dtype=torch.uint8)
        memory = _memory(buffer)
        for piece in copies:
            if not piece.shared and piece.memory is None:
                piece.memory = memory[piece.at:piece.at + piece.nbytes]
    mapping = member.map_block(shared_total) if any(p.shared for p in pieces) else None
    return copies, mapping


def _copy(pieces: list[_Piece], mapping: memoryview | None, verify: bool) -> None:
    """Copy each piece into its place, in order, each ready (its senders go) once it is
    there and its digest taken."""
    import torch

    for piece in pieces:
        if piece.shared:
            assert mapping is not None
            part = mapping[piece.at:piece.at + piece.nbytes]
        else:
            assert piece.memory is not None
            part = piece.memory
        try:
            if piece.nbytes and not piece.own:
                box = piece.source
                with _quiet():
                    torch.frombuffer(part, dtype=box.dtype).view(piece.shape).copy_(box)
            if verify:
                piece.digest = shardwire.digest(part)
            if CORRUPT is not None and piece.nbytes:
                CORRUPT(part)
        finally:
            if piece.shared:
                part.release()
        piece.ready.set()


def _send_to(outgoing: _Outgoing, version: int, secret: bytes, timeout: float,
             snapshot: _Snapshot, acked: dict[Any, int], errors: dict[Any, str]) -> None:
    """One target's transfers, each sent once its piece is ready (in batches of those
    ready together), and every batch acked, by the deadline (a sender thread); the outcome
    into ``acked`` or ``errors``."""
    key = outgoing.key
    deadline = shardwire.Deadline(timeout)
    where = f"{outgoing.host}:{outgoing.port}"
    try:
        sock, sealer, opener = shardwire.connect(outgoing.host, outgoing.port, secret,
                                                 deadline)
    except (OSError, HandshakeIncomplete) as exc:
        errors[key] = f"cannot reach its receiver at {where}: {_why(exc, deadline)}"
        return
    except Exception as exc:  # noqa: BLE001 - AuthenticationError, a refusal: reported
        errors[key] = f"its receiver at {where} failed the handshake: {exc}"
        return
    staged, sent, answered = 0, 0, 0
    failed: list[tuple[int, str]] = []
    try:
        mode = shardwire.SHARED if outgoing.shared else shardwire.TCP
        items, done = outgoing.items, 0
        while done < len(items):
            if not items[done][1].ready.wait(deadline.left()):
                raise TimeoutError(f"this source did not copy its bytes within {timeout:g} s")
            if snapshot.failed is not None:
                errors[key] = snapshot.failed
                return
            end = done + 1
            while end < len(items) and end - done < shardwire.MAX_TRANSFERS and (
                    items[end][1].ready.is_set()):
                end += 1
            batch = items[done:end]
            entries = [shardwire.Entry(tid, piece.nbytes, piece.at if outgoing.shared else 0,
                                       piece.digest) for tid, piece in batch]
            body = shardwire.encode_batch(shardwire.Batch(version, mode, outgoing.where,
                                                          entries, end == len(items)))
            shardwire.send_frame(sock, sealer, body, deadline)
            if not outgoing.shared:
                for _, piece in batch:
                    assert piece.memory is not None
                    shardwire.send_bytes(sock, piece.memory, deadline)
            done, sent = end, sent + 1
            # acks waiting are read now: a target never blocks on an ack nobody reads
            while answered < sent and streams.wait_readable([sock.fileno()], 0):
                answered += 1
                staged, failed = _acked(sock, opener, deadline, staged, failed)
        while answered < sent:
            answered += 1
            staged, failed = _acked(sock, opener, deadline, staged, failed)
        acked[key] = staged
        if failed:
            shown = "; ".join(why for _, why in failed[:3])
            more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
            errors[key] = f"{len(failed)} transfer(s) failed at the target: {shown}{more}"
    except (OSError, kvproto.ProtocolError) as exc:
        if staged:
            acked[key] = staged
        errors[key] = f"sending to {where} failed: {_why(exc, deadline)}"
    finally:
        streams.close_socket(sock)


def _acked(sock: socket.socket, opener: kvproto.Opener, deadline: shardwire.Deadline,
           staged: int, failed: list[tuple[int, str]]) -> tuple[int, list[tuple[int, str]]]:
    """The next ack read, added to ``staged`` and ``failed``."""
    reply = shardwire.read_frame(sock, opener, deadline)
    if reply is None:
        raise ConnectionError("it closed the connection before it acked")
    more, why = shardwire.decode_ack(reply)
    return staged + more, failed + why


def _why(exc: BaseException, deadline: shardwire.Deadline) -> str:
    if isinstance(exc, TimeoutError) or time.monotonic() >= deadline.at:
        return f"no answer within {deadline.seconds:g} s ({exc or type(exc).__name__})"
    return str(exc) or type(exc).__name__


_BUILTINS: dict[str, Callable[..., Any]] = {
    BLOCKS: blocks, WANTS: wants, LISTEN: listen, EXPECT: expect, SEND: send, APPLY: apply,
    VERSION: version, CLOSE: close,
}


def builtin(name: str, obj: Any) -> Callable[..., Any] | None:
    """The function the built-in call ``name`` runs on this rank, its object ``obj``
    bound (None: no such built-in)."""
    fn = _BUILTINS.get(name)
    return None if fn is None else functools.partial(fn, obj)


# -- tensors --------------------------------------------------------------------------------


def _state(obj: Any, get: str) -> Mapping[str, Any]:
    state = _method(obj, get)()
    if not isinstance(state, Mapping):
        raise TypeError(f"{get}() returned {type(state).__name__}; a weight sync needs a "
                        "dict of name -> torch.Tensor or px.Shard")
    if len(state) > weightsync.MAX_TENSORS:
        raise ValueError(f"{get}() returned {len(state)} tensors; a weight sync takes at "
                         f"most {weightsync.MAX_TENSORS}")
    return state


def _block_of(name: str, value: Any, get: str
              ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """``(tensor, offset, full)``: the dense tensor this rank holds of ``name`` and where
    it sits in the full one (a whole tensor, a Shard, or a DTensor's local shard)."""
    import torch

    from phalanx.world.syncplan import Shard

    if isinstance(value, Shard):
        tensor, offset, full = value.tensor, tuple(value.offset), tuple(value.full)
    else:
        dtensor = _dtensor_block(value)
        if dtensor is not None:
            tensor, offset, full = dtensor
        else:
            tensor = value
            offset, full = (), ()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{get}()[{name!r}] is {type(tensor).__name__}, not a torch.Tensor "
                        "or px.Shard of one")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"{get}()[{name!r}] is a {tensor.layout} tensor; a weight sync "
                        "moves dense (strided) tensors only")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if not full:
        offset, full = (0,) * tensor.dim(), tuple(tensor.shape)
    return tensor, offset, full


def _dtensor_block(value: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...]] | None:
    """A DTensor's local tensor, its offset in the global one and the global shape; None
    for anything else. A DTensor's module is imported by whoever made one: where it is not
    imported yet, ``value`` is none (importing torch.distributed costs a second or two)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or not isinstance(value, dtensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial

    if any(isinstance(p, Partial) for p in value.placements):
        raise ValueError("a DTensor with a Partial placement holds partial sums, not a "
                         "block of the tensor: redistribute it first")
    full = tuple(value.shape)
    _, offset = compute_local_shape_and_global_offset(full, value.device_mesh,
                                                      value.placements)
    return value.to_local(), tuple(int(o) for o in offset), full


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _within(offset: Sequence[int], shape: Sequence[int], outer: Sequence[int]) -> bool:
    """Whether the box ``shape`` at ``offset`` lies within a tensor of shape ``outer``."""
    return len(offset) == len(shape) == len(outer) and all(
        o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(offset, shape, outer, strict=True))


def _slices(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _memory(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview (no copy; the caller
    keeps the tensor alive while it uses the view)."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.frombuffer warns that a writable buffer is "not writable" (it is)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
