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

A source (:func:`send`) calls ``get`` and *snapshots* every box it sends before it sends
any (an optimizer step once ``send`` returned, or while it sends, changes nothing sent):

- to a target on another machine, into a buffer of that target's, sent over TCP straight
  from its memory; the target receives straight into its staging tensor's memory where
  the box is contiguous there, else into a buffer it then copies from;
- to a target on the same machine (``machine_id`` equal: :func:`phalanx.wire.memfd.block_domain`),
  into a memory block of the source's (:class:`phalanx.wire.memfd.Block`, the shared
  transport's, kept per target and written again once that target no longer maps it); only
  a frame naming the block crosses the socket, and the target maps it, copies into staging
  and unmaps it before it acks.

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

# Test hooks (set in a test's own process only): called once a send's snapshot is taken,
# before any byte leaves; called with each transfer's snapshot bytes after its digest.
# The broadcast transport's holder of an arena a target receives into (reused while no
# tensor of it outlives set) and of a block a source writes into (reused once unread).
_Holder = weightsync._Member  # noqa: SLF001 - its rules, shared rather than copied

AFTER_SNAPSHOT: Callable[[], None] | None = None
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
        self.blocks: dict[Any, _Holder] = {}  # target key -> its block's holder

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        with self.lock:
            self.pending = None
        self.arena.close()
        for holder in self.blocks.values():
            holder.close()
        self.blocks = {}


class Syncs:
    """This rank's sharded syncs, by id (calls on a thread pool may come at once)."""

    def __init__(self) -> None:
        self._members: dict[str, _Member] = {}
        self._lock = threading.Lock()

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
            self._members[sync_id] = member
        if old is not None:
            old.close()
        return member

    def get(self, sync_id: str, generation: int | None = None) -> _Member:
        """The sync's member (of ``generation``, unless None); LookupError if this rank
        holds none, or another generation."""
        with self._lock:
            member = self._members.get(sync_id)
        if member is None or (generation is not None and member.generation != generation):
            held = "none" if member is None else f"generation {member.generation}"
            raise LookupError(
                f"this rank holds no generation {generation} of sharded weight sync "
                f"{sync_id} (it holds {held}): its process started after the sync last "
                "formed; the next stage forms it again")
        return member

    def close(self, sync_id: str) -> None:
        with self._lock:
            member = self._members.pop(sync_id, None)
        if member is not None:
            member.close()

    def __len__(self) -> int:
        return len(self._members)


SYNCS = Syncs()


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
    acked."""
    while True:
        deadline = shardwire.Deadline(IDLE_TIMEOUT, stall=True)
        body = shardwire.read_frame(sock, opener, deadline)
        if body is None:
            return
        batch = shardwire.decode_batch(body)
        staged, failed = _stage_batch(member, sock, batch, deadline)
        shardwire.send_frame(sock, sealer, shardwire.encode_ack(staged, failed), deadline)


def _stage_batch(member: _Member, sock: socket.socket, batch: shardwire.Batch,
                 deadline: shardwire.Deadline) -> tuple[int, list[tuple[int, str]]]:
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
    with _mapped(batch, wrong is None) as block:
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


@contextlib.contextmanager
def _mapped(batch: shardwire.Batch, wanted: bool) -> Iterator[memoryview | None]:
    """The source's block a shared batch names, mapped (and its read lock held) while the
    batch is placed, then unmapped: the source may write it again once every target that
    read it acked. None for a TCP batch."""
    if batch.mode != shardwire.SHARED or not wanted:
        yield None
        return
    from phalanx.rank import shared

    pid, fd, token, capacity = batch.where
    mapping = shared.map_block(pid, fd, token, capacity, True, locked=True)
    view = memoryview(mapping)
    try:
        yield view
    finally:
        view.release()
        del mapping  # with the last reference, its read lock goes


# -- the source ---------------------------------------------------------------------------


class _Outgoing:
    """What one send hands one target: its transfers' snapshot, in a buffer or a block."""

    def __init__(self, key: Any, host: str, port: int, shared: bool) -> None:
        self.key, self.host, self.port, self.shared = key, host, port, shared
        self.entries: list[shardwire.Entry] = []
        self.where: tuple[int, int, str, int] = (0, 0, "", 0)
        self.parts: list[memoryview] = []  # each transfer's snapshot (TCP), in order
        self.keep: Any = None  # the buffer that backs ``parts``


def send(obj: Any, sync_id: str, generation: int, version: int, get: str,
         sends: Sequence[tuple[Any, ...]], verify: bool, timeout: float,
         secret_hex: str) -> dict[str, Any]:
    """Snapshot every box of ``sends`` (``(tid, target key, host, port, machine, name,
    offset, shape, nbytes)``: the box of this rank's block of ``name``), then send to every
    target at once, each within ``timeout`` -> ``{"acked": {key: bytes}, "errors": {key:
    why}, "via": {key: "shared" or "tcp"}, "snapshot_s", "send_s"}``. A target that fails
    is reported, not raised."""
    from phalanx.wire import memfd

    secret = kvproto.check_secret(bytes.fromhex(secret_hex))
    member = SYNCS.join(sync_id, generation)
    start = time.perf_counter()
    state = _state(obj, get)
    here = memfd.block_domain() if memfd.supported() else None
    targets: dict[Any, _Outgoing] = {}
    boxes: dict[Any, list[tuple[int, str, tuple[int, ...], tuple[int, ...], int]]] = {}
    locals_: dict[str, Any] = {}
    for tid, key, host, port, machine, name, offset, shape, nbytes in sends:
        if name not in state:
            raise KeyError(f"{get}() returned no {name!r}, which this rank holds in the "
                           "sync's plan")
        if name not in locals_:
            locals_[name] = _block_of(name, state[name], get)[0]
        if key not in targets:
            targets[key] = _Outgoing(key, host, port, here is not None and machine == here)
            boxes[key] = []
        boxes[key].append((tid, name, tuple(offset), tuple(shape), nbytes))
    for key, outgoing in targets.items():
        _snapshot(member, outgoing, boxes[key], locals_, verify)
    del state, locals_
    snapshot_s = time.perf_counter() - start
    if AFTER_SNAPSHOT is not None:
        AFTER_SNAPSHOT()
    start = time.perf_counter()
    acked: dict[Any, int] = {}
    errors: dict[Any, str] = {}
    threads = [threading.Thread(target=_send_to, daemon=True, name="phalanx-shardsync-send",
                                args=(outgoing, version, secret, timeout, acked, errors))
               for outgoing in targets.values()]
    for thread in threads:
        thread.start()
    end = time.monotonic() + timeout + _JOIN_MARGIN
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    for key in targets:  # a thread stuck past every deadline (it should not be)
        if key not in acked and key not in errors:
            errors[key] = f"no answer within {timeout:g} s"
    via = {key: "shared" if outgoing.shared else "tcp" for key, outgoing in targets.items()}
    return {"acked": dict(acked), "errors": dict(errors), "via": via,
            "snapshot_s": snapshot_s, "send_s": time.perf_counter() - start}


def _snapshot(member: _Member, outgoing: _Outgoing,
              boxes: list[tuple[int, str, tuple[int, ...], tuple[int, ...], int]],
              locals_: dict[str, Any], verify: bool) -> None:
    """Copy ``boxes`` of the local blocks into ``outgoing``'s snapshot: a block of this
    rank for a target on its machine, else one buffer (each box at a cache line)."""
    import mmap

    import torch

    offsets, total = [], 0
    for tid, name, offset, shape, nbytes in boxes:
        tensor = locals_[name]
        if not _within(offset, shape, tuple(tensor.shape)) or (
                nbytes != math.prod(shape) * tensor.element_size()):
            raise ValueError(f"transfer {tid}: a box of {shape} at {offset} ({nbytes} bytes) "
                             f"is not within this rank's {tuple(tensor.shape)} {name!r}")
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += nbytes
    mapping: mmap.mmap | None = None
    if outgoing.shared:
        holder = member.blocks.get(outgoing.key)
        if holder is None:
            holder = member.blocks[outgoing.key] = _Holder(member.generation, 0)
        block = holder.block_for(max(total, 1))
        mapping = mmap.mmap(block.fd, block.capacity)
        outgoing.where = (os.getpid(), block.fd, block.token, block.capacity)
        memory = memoryview(mapping)
    else:
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        outgoing.keep, memory = buffer, _memory(buffer)
    try:
        for (tid, name, offset, shape, nbytes), at in zip(boxes, offsets, strict=True):
            part = memory[at:at + nbytes]
            if nbytes:
                source = locals_[name][_slices(offset, shape)]
                with _quiet():
                    torch.frombuffer(part, dtype=source.dtype).view(shape).copy_(source)
            outgoing.entries.append(shardwire.Entry(
                tid, nbytes, at if outgoing.shared else 0,
                shardwire.digest(part) if verify else b""))
            if CORRUPT is not None and nbytes:
                CORRUPT(part)
            if outgoing.shared:
                part.release()
            else:
                outgoing.parts.append(part)
    finally:
        if mapping is not None:
            memory.release()
            mapping.close()


def _send_to(outgoing: _Outgoing, version: int, secret: bytes, timeout: float,
             acked: dict[Any, int], errors: dict[Any, str]) -> None:
    """One target's batch, sent and acked by the deadline (a sender thread); the outcome
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
    try:
        mode = shardwire.SHARED if outgoing.shared else shardwire.TCP
        body = shardwire.encode_batch(shardwire.Batch(version, mode, outgoing.where,
                                                      outgoing.entries))
        shardwire.send_frame(sock, sealer, body, deadline)
        for part in outgoing.parts:  # (none in shared mode)
            shardwire.send_bytes(sock, part, deadline)
        reply = shardwire.read_frame(sock, opener, deadline)
        if reply is None:
            raise ConnectionError("it closed the connection before it acked")
        staged, failed = shardwire.decode_ack(reply)
        acked[key] = staged
        if failed:
            shown = "; ".join(why for _, why in failed[:3])
            more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
            errors[key] = f"{len(failed)} transfer(s) failed at the target: {shown}{more}"
    except (OSError, kvproto.ProtocolError) as exc:
        errors[key] = f"sending to {where} failed: {_why(exc, deadline)}"
    finally:
        streams.close_socket(sock)


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
