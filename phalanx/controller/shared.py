"""Objects stored once per node and handed to every rank: ``group.put()`` and ``ObjectRef``.

``ref = group.put(obj)`` pickles ``obj`` once and has the backend hold it on every node of
the group (:meth:`Backend.share <phalanx.backends.base.Backend.share>`): in shared memory
on this machine, in the agent of each cluster node, through Ray's object store into each
Ray node. A call whose arguments name ``ref`` (anywhere: nested in lists, dicts, objects)
sends only the small handle; each rank maps its node's copy the first time and keeps the
object until it is freed (:mod:`phalanx.node.shm`), numpy arrays and torch CPU tensors in it
as views of that memory rather than copies.

A call whose one set of arguments carries at least :data:`AUTO_SHARE_BYTES` of out-of-band
buffers (large numpy arrays, torch CPU tensors) goes the same way without any change to
the caller's code: its arguments are put for the length of the call.

This part is also the group's encoder (:meth:`SharedObjects.encode`): it pickles a call's
arguments, meeting every handle in them (:class:`~phalanx.controller.refs.ObjectRef`, put
here or kept by any group) and returning the ones it met with the pickle (an
:class:`Encoded`), so that the call holds them until it ends. A payload that met nothing
is the plain list of its segments: the usual call pays for nothing more.

A put object is freed by ``ref.free()``, when the last reference to its handle goes, or
when the group shuts down. A call in flight keeps what it names: freeing an object a
running call uses takes effect once that call has ended. Afterwards the handle raises
:class:`~phalanx.errors.ObjectFreed` wherever it is passed.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends.held import HeldObject, KeptCopy
from phalanx.backends.parts import lacking
from phalanx.controller.refs import (
    ObjectRef,
    Record,
    RefState,
    ResultRef,
    SliceRef,
    check_usable,
)
from phalanx.errors import ObjectFreed, ObjectLost, PhalanxError, SerializationError
from phalanx.rank import shared as shmrank
from phalanx.rank.kept import BlockLocation
from phalanx.wire import pickling

if TYPE_CHECKING:
    from phalanx.backends.base import Backend, Channel
    from phalanx.controller.futures import Call
    from phalanx.controller.kept import KeptRecord

logger = logging.getLogger(__name__)

AUTO_SHARE_BYTES = config.AUTO_SHARE_BYTES


def _token() -> str:
    """A held object's token: 16 random hex digits (as ``secrets.token_hex(8)``, without
    importing ``secrets``, ``hmac`` and ``random`` into every controller)."""
    return os.urandom(8).hex()


class Encoded(list[Any]):
    """A payload that met something on the way: its segments (the pickle and its buffers,
    as the list it is), the handles it names in the order met (:attr:`refs`), whether a
    torch tensor went out of band (:attr:`tensors`). Encoding returns a plain list when
    it met nothing (see :func:`met`)."""

    __slots__ = ("refs", "tensors")

    def __init__(self, segments: list[Any], refs: tuple[ObjectRef, ...] = (),
                 tensors: bool = False) -> None:
        super().__init__(segments)
        self.refs = refs
        self.tensors = tensors


Payload = list[Any]  # a payload's segments: a plain list, or an Encoded one


def met(payloads: Sequence[Payload]) -> tuple[ObjectRef, ...]:
    """The handles the payloads of one call name."""
    return tuple(r for p in payloads if type(p) is Encoded for r in p.refs)


class PutRecord(Record):
    """The controller's record of one put object: the backend's :class:`HeldObject`, and
    the other groups whose nodes hold a copy of it (their calls named its handle)."""

    __slots__ = ("held", "mirrors")

    def __init__(self, held: HeldObject) -> None:
        super().__init__()
        self.held = held
        self.mirrors: list[SharedObjects] = []

    @property
    def id(self) -> int:
        return self.held.id

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    @property
    def label(self) -> str:
        return self.held.label


def _nbytes(segments: Sequence[Any]) -> int:
    return sum(memoryview(s).nbytes for s in segments)


class SharedObjects:
    """A group's put objects and its encoder: what each holds, the calls that use them,
    their release.

    The group's part behind ``put()``: :meth:`put`, :meth:`encode` and :meth:`prepare`
    for a call's arguments, :meth:`unhold` when a call ends, :meth:`reach` for ranks just
    started, :meth:`close`; for handles, the :class:`~phalanx.controller.refs.Keeper`
    interface. ``poll()`` takes in what the ranks said (RELEASED: a block to reuse);
    ``channels()`` gives the live ranks' channels, each once.
    """

    def __init__(self, backend: Backend, poll: Callable[[], None],
                 channels: Callable[[], list[Channel]]) -> None:
        parts = backend.capabilities
        self._backend_name = backend.name
        self._holder = parts.objects  # None: this backend holds no objects
        self._copier = parts.kept_copies  # None: its nodes read kept results where they are
        self._channels = channels
        self._poll = poll
        self._objects: dict[int, PutRecord] = {}
        # another group's put object -> this group's copy of it (its calls named it)
        self._mirrors: dict[PutRecord, ObjectRef] = {}
        self._copies: dict[KeptRecord, KeptCopy] = {}  # a kept result -> its copy here
        self._copying: dict[int, threading.Lock] = {}  # copy id -> one fetch at a time
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False

    # -- encoding -----------------------------------------------------------------------

    def encode(self, value: Any) -> Payload:
        """Pickle ``value`` for a call: an :class:`Encoded` with the handles it names (a
        plain list of segments if it names none)."""
        plain = pickling.dumps_plain(value)  # the usual call: nothing in it to note
        if plain is not None:
            return plain
        encoded = self._encode(value, putting=False)
        return encoded if encoded.refs or encoded.tensors else list(encoded)

    def _encode(self, value: Any, putting: bool) -> Encoded:
        refs: list[ObjectRef] = []

        def meet(obj: Any) -> Any:
            if isinstance(obj, SliceRef):
                refs.extend(obj.refs)
                # one on rows of kept results is refused by put() once encoded; an empty
                # chunk of no handles (px.chunk([], n)) names none: it is put as its []
                return (type(None), ()) if putting and obj.refs else obj.reduce_for(self)
            if not isinstance(obj, ObjectRef):
                return NotImplemented
            refs.append(obj)
            if putting and isinstance(obj, ResultRef):
                return type(None), ()  # refused by put() once encoded
            return obj.reduce_for(self)

        segments, tensors = pickling.dumps_noting(value, meet)
        return Encoded(segments, tuple(refs), tensors)

    # -- put and free -----------------------------------------------------------------

    def put(self, value: Any) -> ObjectRef:
        """Store ``value`` on every node (see :meth:`WorkerGroup.put
        <phalanx.controller.group.WorkerGroup.put>`); NotImplementedError on a backend
        that cannot."""
        if self._holder is None:
            raise lacking(self._backend_name, "hold shared objects")
        try:
            encoded = self._encode(value, putting=True)
        except (ObjectFreed, ObjectLost):
            raise
        except Exception as exc:
            raise self._unpicklable(exc) from exc
        if any(isinstance(r, ResultRef) for r in encoded.refs):
            raise TypeError("a kept result's handle (ResultRef) cannot be put: pass it in "
                            "the calls that need it")
        ref = self._store(list(encoded), type(value).__name__, tensors=encoded.tensors)
        if encoded.refs:  # an object holding other put objects keeps them while it lives
            self._hold_for(ref, list(encoded.refs))
        return ref

    @staticmethod
    def _unpicklable(exc: BaseException) -> SerializationError:
        return SerializationError(
            f"could not pickle the object to put: {type(exc).__name__}: {exc}; nothing "
            "was stored", stage="pickling the object to put")

    def _store(self, segments: list[Any], label: str, private: bool = False,
               tensors: bool = False) -> ObjectRef:
        if self._closed:
            raise ObjectFreed("the group was shut down: nothing can be put any more")
        assert self._holder is not None  # put() and prepare() check
        held = HeldObject(next(self._ids), _token(), list(segments),
                          _nbytes(segments), label, private, tensors)
        self._poll()
        # Never under the lock: a node's answer may need the thread that ends calls.
        channels = self._channels()
        try:
            self._holder.share(held, channels)
        except BaseException:
            # One node refused (over its limit, gone): those that took it drop it again,
            # so that a failed put() holds nothing anywhere.
            try:
                self._holder.unshare(held, channels)
            except Exception:
                logger.exception("could not drop object %d after a failed put", held.id)
            raise
        record = PutRecord(held)
        with self._lock:
            self._objects[held.id] = record
        logger.debug("put object %d (%s, %d bytes)", held.id, label, held.nbytes)
        return ObjectRef(self, record)

    def _hold_for(self, ref: ObjectRef, inner: list[ObjectRef]) -> None:
        """Keep ``inner`` alive and in use as long as ``ref`` lives."""
        for owner, records in _by_owner(inner):
            owner.use(records)
            weakref.finalize(ref, owner.unhold_inner, records, inner).atexit = False

    def free(self, record: PutRecord) -> None:
        with self._lock:
            if not record.free():
                return  # in use: released when the last call using it ends
            self._objects.pop(record.id, None)
        self._release(record)

    def _release(self, record: PutRecord) -> None:
        """Have the backend drop it (outside the lock; the record is RELEASED already),
        and every other group its copy."""
        record.held.segments = None
        _drop_mirrors(record)
        if self._closed or self._holder is None:
            return
        try:
            self._holder.unshare(record.held, self._channels())
        except Exception:  # a node gone meanwhile: its copy went with it
            logger.exception("could not free shared object %d", record.id)

    # -- the Keeper interface ------------------------------------------------------------

    def describe(self, record: PutRecord) -> str:
        return f"put object {record.id} ({record.label})"

    def reduce(self, ref: ObjectRef, consumer: SharedObjects) -> tuple[Any, ...]:
        check_usable(ref.record, ref)
        if consumer is not self:  # another group's call: its nodes hold a copy
            return consumer.reduce(consumer.mirror_of(ref, self), consumer)
        held = ref.record.held
        return shmrank.resolve, ((held.id, held.token, True) if held.private else
                                 (held.id, held.token))

    # -- other groups' put objects ------------------------------------------------------

    def mirror_of(self, ref: ObjectRef, owner: SharedObjects) -> ObjectRef:
        """This group's copy of ``ref``, put by ``owner`` (another group of the same
        backend): made on first use from what ``owner``'s backend holds, freed when
        ``ref``'s object is. TypeError across backends; ObjectFreed once freed."""
        if owner._backend_name != self._backend_name:
            raise TypeError(f"{ref!r} was put by a group on the {owner._backend_name} "
                            f"backend; a call of a group on the {self._backend_name} backend "
                            "cannot name it (put it from this group)")
        record: PutRecord = ref.record
        with self._lock:
            mirror = self._mirrors.get(record)
        if mirror is not None:
            return mirror
        segments = owner.segments_of(record)
        if segments is None:
            raise ObjectFreed(f"{ref!r} was freed while another group's call named it")
        made = self._store(segments, record.label, private=record.held.private,
                           tensors=record.held.tensors)
        with self._lock:
            mirror = self._mirrors.setdefault(record, made)
        if mirror is not made:  # another call made one meanwhile
            made.free()
            return mirror
        if not owner.mirrored_by(record, self):  # freed meanwhile
            self.drop_mirror(record)
            raise ObjectFreed(f"{ref!r} was freed while another group's call named it")
        return mirror

    def segments_of(self, record: PutRecord) -> list[Any] | None:
        """The pickle and buffers of a put object of this group, as its backend holds
        them (None once freed)."""
        if self._holder is None or record.state is RefState.RELEASED:
            return None
        return self._holder.segments(record.held)

    def mirrored_by(self, record: PutRecord, consumer: SharedObjects) -> bool:
        """``consumer``'s nodes hold a copy of ``record``: dropped with it. False when it
        is gone already."""
        with self._lock:
            if record.state is RefState.RELEASED or record.state is RefState.LOST:
                return False
            record.mirrors.append(consumer)
        return True

    def drop_mirror(self, record: PutRecord) -> None:
        """Another group's put object ``record`` was freed: so is this group's copy."""
        with self._lock:
            mirror = self._mirrors.pop(record, None)
        if mirror is not None:
            mirror.free()

    # -- calls --------------------------------------------------------------------------

    def prepare(self, future: Call, payloads: list[Payload],
                refs: Sequence[ObjectRef], targets: Callable[[], list[Channel]]
                ) -> list[list[Any]]:
        """Before a call is sent, its payloads' segments: the kept results it names copied
        to those of its ``targets()`` nodes that are other machines than the producers',
        what its arguments name held until it ends, and its arguments put for the call
        if they are large (see AUTO_SHARE_BYTES)."""
        kept = [r for r in refs if isinstance(r, ResultRef)]
        if kept and self._copies:
            self._copy(kept, targets())
        segments = [list(p) if type(p) is Encoded else p for p in payloads]
        puts = [r.record for r in refs if r.owner is self]
        transient = None
        if (len(payloads) == 1 and len(segments[0]) > 1 and self._holder is not None
                and _nbytes(segments[0][1:]) >= AUTO_SHARE_BYTES):
            transient = self._store(segments[0], f"the arguments of {future.method}()",
                                    private=True, tensors=getattr(payloads[0], "tensors",
                                                                  False))
            segments = [list(self.encode(transient))]
            puts.append(transient.record)
        if puts:
            future.hold(self, self.use(puts))
        # results kept on ranks, other groups' put objects: held by their own tables
        for owner, records in _by_owner([r for r in refs if r.owner is not self]):
            future.hold(owner, owner.use(records))
        if transient is not None:
            transient.free()  # released once the call ends
        return segments

    def use(self, records: list[PutRecord]) -> list[PutRecord]:
        """A call (or an object holding them) names ``records``: held until
        :meth:`unhold`."""
        with self._lock:
            for record in records:
                record.users += 1
        return records

    def unhold(self, records: list[PutRecord]) -> None:
        """A call that named ``records`` ended (every rank answered or was lost)."""
        done = []
        with self._lock:
            for record in records:
                if record.unuse():
                    self._objects.pop(record.id, None)
                    done.append(record)
        for record in done:
            self._release(record)

    def unhold_inner(self, records: list[PutRecord], refs: list[ObjectRef]) -> None:
        self.unhold(records)  # ``refs`` kept alive until the holding object goes

    # -- kept results of other machines ---------------------------------------------------

    def copy_of(self, result: KeptRecord) -> tuple[int, str] | None:
        """What a handle on kept ``result`` is pickled with for this group's ranks: the id
        and token of the copy its nodes on other machines than the producer's hold
        (None: this backend's nodes read every kept result where it is)."""
        location = result.location
        if self._copier is None or result.source is None or not isinstance(
                location, BlockLocation):
            return None  # (on Ray, a task on the producer's node reads it: rank/kept.py)
        with self._lock:
            copy = self._copies.get(result)
            if copy is None:
                copy = self._copies[result] = KeptCopy(
                    next(self._ids), _token(), location, result.source)
                self._copying[copy.id] = threading.Lock()
                result.copies.append(self)
        return copy.id, copy.token

    def _copy(self, kept: Sequence[ObjectRef], targets: Sequence[Channel]) -> None:
        assert self._copier is not None  # only copy_of() makes copies
        for ref in {id(r.record): r for r in kept}.values():
            with self._lock:
                copy = self._copies.get(ref.record)
                lock = None if copy is None else self._copying.get(copy.id)
            if copy is None or lock is None:
                continue
            with lock:  # calls at once: one fetch per node
                try:
                    self._copier.copy_kept(copy, targets)
                except PhalanxError as exc:
                    raise ObjectLost(f"{ref.owner.describe(ref.record)} could not be "
                                     f"fetched from its node: {exc}") from None

    def drop_copy(self, result: KeptRecord) -> None:
        """``result`` was freed or lost: the nodes holding a copy of it drop it."""
        with self._lock:
            copy = self._copies.pop(result, None)
            if copy is not None:
                self._copying.pop(copy.id, None)
        if copy is not None and not self._closed and self._copier is not None:
            try:
                self._copier.release_copy(copy)
            except Exception:  # a node gone meanwhile: its copy went with it
                logger.exception("could not free the copy of a kept result")

    # -- ranks --------------------------------------------------------------------------

    def reach(self, channels: Sequence[Channel]) -> None:
        """Ranks just started: have their nodes hold every live object too."""
        if self._holder is None:
            return
        with self._lock:
            live = [r.held for r in self._objects.values()
                    if r.state is not RefState.RELEASED]
        for held in live:
            self._holder.share(held, channels)

    def close(self) -> None:
        """The group shuts down: every object is freed, its ranks stopping anyway."""
        with self._lock:
            self._closed = True
            self._copies.clear()  # they go with the ranks' nodes' sessions
            self._copying.clear()
            self._mirrors.clear()  # copies of other groups' objects: go with the nodes
            records, self._objects = list(self._objects.values()), {}
            for record in records:
                if record.move(RefState.RELEASED):
                    record.why = "its group was shut down"
                record.held.segments = None
                _drop_mirrors(record)
                if self._holder is None:
                    continue
                try:
                    self._holder.unshare(record.held, ())
                except Exception:  # pragma: no cover - logged: shutdown goes on
                    logger.exception("could not free shared object %d", record.id)

    def __len__(self) -> int:
        return len(self._objects)


def _by_owner(refs: Sequence[ObjectRef]) -> list[tuple[Any, list[Any]]]:
    """The records of ``refs``, grouped by the table that owns them."""
    owners: dict[int, tuple[Any, list[Any]]] = {}
    for ref in refs:
        owners.setdefault(id(ref.owner), (ref.owner, []))[1].append(ref.record)
    return list(owners.values())


def _drop_mirrors(record: PutRecord) -> None:
    """``record`` is released: the other groups holding a copy drop theirs."""
    mirrors, record.mirrors = record.mirrors, []
    for consumer in mirrors:
        consumer.drop_mirror(record)
