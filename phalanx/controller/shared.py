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

A put object is freed by ``ref.free()``, when the last reference to its handle goes, or
when the group shuts down. A call in flight keeps what it names: freeing an object a
running call uses takes effect once that call has ended. Afterwards the handle raises
:class:`~phalanx.errors.ObjectFreed` wherever it is passed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.errors import ObjectFreed, ObjectLost, PhalanxError, SerializationError
from phalanx.rank import shared as shmrank
from phalanx.wire import pickling

if TYPE_CHECKING:
    from phalanx.backends.base import Backend, Channel
    from phalanx.controller.futures import GroupFuture

logger = logging.getLogger(__name__)

AUTO_SHARE_BYTES = config.AUTO_SHARE_BYTES


class _Capture(threading.local):
    """Per thread: the SharedObjects encoding a call now, and the handles it named."""

    def __init__(self) -> None:
        self.owner: SharedObjects | None = None
        self.refs: list[ObjectRef] = []
        self.kept: list[Any] = []  # ResultRefs (phalanx.controller.kept) it named


_capture = CAPTURE = _Capture()  # CAPTURE.refs: whether a call has anything to hold


@dataclasses.dataclass(eq=False)
class SharedObject:
    """What a backend holds for one put object."""

    id: int
    token: str  # names its blocks, so a rank never maps anything else by mistake
    segments: list[Any] | None  # the pickle and its buffers; None once no backend needs them
    nbytes: int
    label: str  # what it is, for messages ("ndarray", "the arguments of step()")
    private: bool = False  # a call's own arguments: each rank gets writable copies
    tensors: bool = False  # holds torch tensors (their views are writable copies)
    users: int = 0  # calls in flight that name it
    freed: bool = False  # no new call may name it
    released: bool = False  # the backend no longer holds it


@dataclasses.dataclass(eq=False)
class KeptCopy:
    """A result kept on another group's rank, as this group's nodes of other machines
    than the producer's hold it (``Backend.copy_kept``): a put object's id and token."""

    id: int
    token: str
    location: tuple  # where the producer keeps it (phalanx.rank.kept)
    source: tuple  # its producer's node, as the backend reaches it (Backend.source_of)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ObjectRef:
    """A handle on an object stored once per node by :meth:`WorkerGroup.put`.

    Pass it anywhere in a call's arguments; each rank receives the object. ``free()``
    releases it (so does dropping the last reference, and the group's shutdown).
    """

    __slots__ = ("__weakref__", "_finalizer", "_obj", "_owner")

    def __init__(self, owner: SharedObjects, obj: SharedObject) -> None:
        self._owner = owner
        self._obj = obj
        self._finalizer = weakref.finalize(self, owner.free, obj)
        self._finalizer.atexit = False  # the group's shutdown frees what is left

    @property
    def id(self) -> int:
        return self._obj.id

    @property
    def nbytes(self) -> int:
        """The size of its pickle and buffers: what each node holds."""
        return self._obj.nbytes

    @property
    def freed(self) -> bool:
        return self._obj.freed

    def free(self) -> None:
        """Release the object on every node (once the calls in flight that use it end).
        Idempotent."""
        self._finalizer()

    def __reduce__(self) -> tuple:
        owner = _capture.owner
        if owner is not self._owner:
            raise TypeError(
                f"{self!r} can only be passed in the arguments of calls of the WorkerGroup "
                "that put it" + ("" if owner is None else " (this is another group's call)"))
        if self._obj.freed:
            raise ObjectFreed(f"{self!r} was freed; put the object again to use it")
        _capture.refs.append(self)
        obj = self._obj
        return shmrank.resolve, ((obj.id, obj.token, True) if obj.private else
                                 (obj.id, obj.token))

    def __copy__(self) -> ObjectRef:
        return self

    def __deepcopy__(self, memo: dict) -> ObjectRef:
        return self

    def __repr__(self) -> str:
        state = ", freed" if self._obj.freed else ""
        return f"<ObjectRef {self._obj.id}: {self._obj.label}, {_size(self._obj.nbytes)}{state}>"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _nbytes(segments: Sequence[Any]) -> int:
    return sum(memoryview(s).nbytes for s in segments)


class SharedObjects:
    """A group's put objects: what each holds, the calls that use them, their release.

    The group's part behind ``put()``: :meth:`put`, :meth:`encode` / :meth:`prepare` for
    a call's arguments, :meth:`unhold` when a call ends, :meth:`reach` for ranks just
    started, :meth:`close`. ``poll()`` takes in what the ranks said (RELEASED: a block to
    reuse); ``channels()`` gives the live ranks' channels, each once.
    """

    def __init__(self, backend: Backend, poll: Callable[[], None],
                 channels: Callable[[], list[Channel]]) -> None:
        self._backend = backend
        self._channels = channels
        self._poll = poll
        self._objects: dict[int, SharedObject] = {}
        self._copies: dict[Any, KeptCopy] = {}  # a KeptResult -> its copy on these nodes
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False

    # -- put and free -----------------------------------------------------------------

    def put(self, value: Any) -> ObjectRef:
        """Store ``value`` on every node (see :meth:`WorkerGroup.put
        <phalanx.controller.group.WorkerGroup.put>`); NotImplementedError on a backend
        that cannot."""
        if not self._backend.can_share:
            raise NotImplementedError(
                f"the {self._backend.name} backend cannot hold shared objects")
        pickling.pickled.tensors = False
        try:
            segments = self.encode(value)
        except ObjectFreed:
            raise
        except Exception as exc:
            raise SerializationError(
                f"could not pickle the object to put: {type(exc).__name__}: {exc}; nothing "
                "was stored", stage="pickling the object to put") from exc
        if _capture.kept:
            _capture.kept = []
            raise TypeError("a kept result's handle (ResultRef) cannot be put: pass it in "
                            "the calls that need it")
        refs = self.taken()
        ref = self._store(segments, type(value).__name__)
        if refs:  # an object holding other put objects keeps them while it lives
            self._hold_for(ref, refs)
        return ref

    def encode(self, value: Any) -> list[Any]:
        """Pickle ``value`` for a call or a put, noting the handles it names (taken())."""
        plain = pickling.dumps_plain(value)  # the usual call: nothing in it to note
        if plain is not None:
            return plain
        _capture.owner = self
        try:
            return pickling.dumps(value)
        finally:
            _capture.owner = None

    def taken(self) -> list[ObjectRef]:
        """The handles named by what was encoded since the last taken()."""
        refs = _capture.refs
        if not refs:
            return []
        _capture.refs = []
        return refs

    def _store(self, segments: list[Any], label: str, private: bool = False) -> ObjectRef:
        if self._closed:
            raise ObjectFreed("the group was shut down: nothing can be put any more")
        obj = SharedObject(next(self._ids), secrets.token_hex(8), list(segments),
                           _nbytes(segments), label, private,
                           pickling.pickled.tensors)
        self._poll()
        # Never under the lock: a node's answer may need the thread that ends calls.
        self._backend.share(obj, self._channels())
        with self._lock:
            self._objects[obj.id] = obj
        logger.debug("put object %d (%s, %d bytes)", obj.id, label, obj.nbytes)
        return ObjectRef(self, obj)

    def _hold_for(self, ref: ObjectRef, inner: list[ObjectRef]) -> None:
        """Keep ``inner`` alive and in use as long as ``ref`` lives."""
        objs = [r._obj for r in inner]
        with self._lock:
            for obj in objs:
                obj.users += 1
        weakref.finalize(ref, self._unhold, objs, inner).atexit = False

    def free(self, obj: SharedObject) -> None:
        with self._lock:
            if obj.freed:
                return
            obj.freed = True
            if obj.users:
                return  # released when the last call using it ends
            self._objects.pop(obj.id, None)
            obj.released = True
        self._release(obj)

    def _release(self, obj: SharedObject) -> None:
        """Have the backend drop it (outside the lock; ``obj.released`` already set)."""
        obj.segments = None
        if self._closed:
            return
        try:
            self._backend.unshare(obj, self._channels())
        except Exception:  # a node gone meanwhile: its copy went with it
            logger.exception("could not free shared object %d", obj.id)

    # -- calls --------------------------------------------------------------------------

    def prepare(self, future: GroupFuture, payloads: list[list[Any]],
                targets: Sequence[Channel] = ()) -> list[list[Any]]:
        """Before a call to ``targets`` is sent: copy the kept results it names to those
        of their nodes that are other machines than the producers', hold what its
        arguments name until it ends, and put its arguments for the call if they are
        large (see AUTO_SHARE_BYTES)."""
        refs = self.taken()
        if _capture.kept and self._copies:
            try:
                self._copy(_capture.kept, targets)
            except BaseException:
                _capture.kept = []
                raise
        transient = None
        if (len(payloads) == 1 and len(payloads[0]) > 1 and self._backend.can_share
                and _nbytes(payloads[0][1:]) >= AUTO_SHARE_BYTES):
            transient = self._store(payloads[0], f"the arguments of {future.method}()",
                                    private=True)
            payloads = [self.encode(transient)]
            refs += self.taken()
        if refs:
            objs = [r._obj for r in refs]
            with self._lock:
                for obj in objs:
                    obj.users += 1
            future.hold(self, objs)
        if _capture.kept:  # results kept on ranks: held by their own groups' tables
            kept, _capture.kept = _capture.kept, []
            for owner in {id(r._owner): r._owner for r in kept}.values():
                future.hold(owner, owner.use([r for r in kept if r._owner is owner]))
        if transient is not None:
            transient.free()  # released once the call ends
        return payloads

    # -- kept results of other machines ---------------------------------------------------

    def copy_of(self, result: Any) -> tuple[int, str] | None:
        """What a handle on kept ``result`` is pickled with for this group's ranks: the id
        and token of the copy its nodes on other machines than the producer's hold
        (None: this backend's nodes read every kept result where it is)."""
        if not self._backend.copies_kept or result.source is None:
            return None
        with self._lock:
            copy = self._copies.get(result)
            if copy is None:
                copy = self._copies[result] = KeptCopy(next(self._ids), secrets.token_hex(8),
                                                       result.location, result.source)
                result.copies.append(self)
        return copy.id, copy.token

    def _copy(self, kept: list[Any], targets: Sequence[Channel]) -> None:
        for ref in {id(r._result): r for r in kept}.values():
            copy = self._copies.get(ref._result)
            if copy is None:
                continue
            with copy.lock:  # calls at once: one fetch per node
                try:
                    self._backend.copy_kept(copy, targets)
                except PhalanxError as exc:
                    raise ObjectLost(f"{ref._owner.describe(ref._result)} could not be "
                                     f"fetched from its node: {exc}") from None

    def drop_copy(self, result: Any) -> None:
        """``result`` was freed or lost: the nodes holding a copy of it drop it."""
        with self._lock:
            copy = self._copies.pop(result, None)
        if copy is not None and not self._closed:
            try:
                self._backend.release_copy(copy)
            except Exception:  # a node gone meanwhile: its copy went with it
                logger.exception("could not free the copy of a kept result")

    def unhold(self, objs: list[SharedObject]) -> None:
        """A call that named ``objs`` ended (every rank answered or was lost)."""
        done = []
        with self._lock:
            for obj in objs:
                obj.users -= 1
                if obj.users == 0 and obj.freed and not obj.released:
                    obj.released = True
                    self._objects.pop(obj.id, None)
                    done.append(obj)
        for obj in done:
            self._release(obj)

    def _unhold(self, objs: list[SharedObject], refs: list[ObjectRef]) -> None:
        self.unhold(objs)

    # -- ranks --------------------------------------------------------------------------

    def reach(self, channels: Sequence[Channel]) -> None:
        """Ranks just started: have their nodes hold every live object too."""
        with self._lock:
            live = [o for o in self._objects.values() if not o.released]
        for obj in live:
            self._backend.share(obj, channels)

    def close(self) -> None:
        """The group shuts down: every object is freed, its ranks stopping anyway."""
        with self._lock:
            self._closed = True
            self._copies.clear()  # they go with the ranks' nodes' sessions
            objects, self._objects = list(self._objects.values()), {}
            for obj in objects:
                obj.freed = obj.released = True
                obj.segments = None
                try:
                    self._backend.unshare(obj, ())
                except Exception:  # pragma: no cover - logged: shutdown goes on
                    logger.exception("could not free shared object %d", obj.id)

    def __len__(self) -> int:
        return len(self._objects)

