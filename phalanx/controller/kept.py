"""Results that stay on the ranks that made them: ``keep=True`` and :class:`ResultRef`.

``group.call("rollout", ..., keep=True)`` (and ``call_async``, ``map``, ``map_async``,
``call_one``, ``call_sharded``) leaves each rank's result where it was made
(:mod:`phalanx.rank.kept`: a memory block of the rank's process, or Ray's object store)
and returns a :class:`ResultRef` per rank instead of the value. A handle goes into any
call of any group of this controller, anywhere in its arguments (as a ``put()`` handle
does); the rank that receives it reads the value straight from the producer -- a mapping
of the producer's block on the same machine, Ray's object store on Ray -- never through
the controller. ``ref.get()`` fetches the value here.

A kept result lives until its handle is freed (``ref.free()``, the last reference to it
dropped, or its group shut down); a call in flight that names it keeps it until the call
ends. A freed handle raises :class:`~phalanx.errors.ObjectFreed` before anything is sent;
one whose producing rank died raises :class:`~phalanx.errors.ObjectLost` naming the
group, the rank and why (and so does a call whose rank finds it gone).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.controller.futures import GroupFuture
from phalanx.controller.shared import CAPTURE, _size
from phalanx.errors import ObjectFreed, ObjectLost
from phalanx.rank import kept as rankkept

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class KeptResult:
    """One rank's kept result, as the controller knows it."""

    rank: int
    call_id: int
    method: str
    nbytes: int
    location: tuple  # where it is (phalanx.rank.kept: a block, or Ray's object store)
    users: int = 0  # calls in flight that name it
    freed: bool = False
    dropped: bool = False  # the rank was told to forget it (or is gone)
    lost: str | None = None  # why it is gone, once its rank died
    source: tuple | None = None  # its node, for nodes that copy it (Backend.source_of)
    copies: list[Any] = dataclasses.field(default_factory=list)  # SharedObjects copying it


class ResultRef:
    """A handle on a result kept on the rank that made it (``keep=True``).

    Pass it in any call of any group: the rank reads the value from the producer
    directly. ``get()`` fetches it here; ``free()`` releases it (so does dropping the
    last reference, and the producing group's shutdown).
    """

    __slots__ = ("__weakref__", "_finalizer", "_owner", "_result")

    def __init__(self, owner: KeptResults, result: KeptResult) -> None:
        self._owner = owner
        self._result = result
        self._finalizer = weakref.finalize(self, owner.free, result)
        self._finalizer.atexit = False

    @property
    def nbytes(self) -> int:
        """The size of the value's pickle and buffers, as kept."""
        return self._result.nbytes

    @property
    def rank(self) -> int:
        return self._result.rank

    @property
    def freed(self) -> bool:
        return self._result.freed

    def get(self, timeout: float | None = None) -> Any:
        """The value, fetched to the controller (arrays read-only views where the producer
        is on this machine or on Ray; otherwise asked of the producing rank)."""
        self._owner.check(self._result, self)
        location = self._result.location
        if location[0] == rankkept.shared.RAY_LOCATION or location[0] == rankkept.machine():
            return rankkept.read(location, self._owner.describe(self._result))
        return self._owner.fetch(self._result, timeout)

    def free(self) -> None:
        """Release the value on its rank (once the calls in flight that name it end).
        Idempotent."""
        self._finalizer()

    def __reduce__(self) -> tuple:
        if CAPTURE.owner is None:
            raise TypeError(f"{self!r} can only be passed in the arguments of a group's calls")
        self._owner.check(self._result, self)
        CAPTURE.kept.append(self)
        result = self._result
        return rankkept.read, (result.location, self._owner.describe(result),
                               CAPTURE.owner.copy_of(result))

    def __copy__(self) -> ResultRef:
        return self

    def __deepcopy__(self, memo: dict) -> ResultRef:
        return self

    def __repr__(self) -> str:
        r = self._result
        state = ", freed" if r.freed else f", lost: {r.lost}" if r.lost else ""
        return f"<ResultRef {self._owner.describe(r)}: {_size(r.nbytes)}{state}>"


class KeptResults:
    """A group's kept results: their handles' records, their release, their loss.

    The group's part behind ``keep=True``: :meth:`adopt` makes a handle of a rank's
    answer, :meth:`free` / :meth:`unhold` release, :meth:`lost` marks a dead rank's
    results, :meth:`close` ends them all with the group. ``send(method, ranks, payloads)``
    sends a built-in call (``@drop``, ``@fetch``); ``encode`` pickles its arguments.
    """

    def __init__(self, label: str, send: Callable[..., GroupFuture],
                 encode: Callable[..., list[Any]],
                 source: Callable[[int], tuple | None] = lambda rank: None) -> None:
        self.label = label  # the group, in messages
        self._send = send
        self._encode = encode
        self._source = source  # a rank -> its node, as other nodes fetch from it
        self._live: dict[int, set[KeptResult]] = {}  # rank -> its results with a handle
        self._to_drop: dict[int, list[int]] = {}  # rank -> call ids, not yet told
        # re-entrant: a handle's finalizer may run (the GC) while this thread holds it
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._dropper: threading.Thread | None = None
        self._closed = False

    def adopt(self, rank: int, call_id: int, method: str, answer: tuple) -> ResultRef:
        nbytes, location = answer
        location = tuple(location)
        source = None if location[0] == rankkept.shared.RAY_LOCATION else self._source(rank)
        result = KeptResult(rank, call_id, method, nbytes, location, source=source)
        with self._lock:
            if self._closed:
                result.freed = result.dropped = True
            else:
                self._live.setdefault(rank, set()).add(result)
        return ResultRef(self, result)

    def describe(self, result: KeptResult) -> str:
        return f"the result of {result.method}() on rank {result.rank} of {self.label}"

    def check(self, result: KeptResult, ref: ResultRef) -> None:
        """ObjectFreed / ObjectLost unless the result can still be read."""
        if result.lost is not None:
            raise ObjectLost(f"{self.describe(result)} is lost: {result.lost}")
        if result.freed:
            raise ObjectFreed(f"{ref!r} was freed; keep the result again to use it")

    def fetch(self, result: KeptResult, timeout: float | None) -> Any:
        payload = self._encode((result.call_id,), {})  # see phalanx.rank.kept
        return self._send("@fetch", [result.rank], [payload]).result(timeout)[0]

    # -- release ------------------------------------------------------------------------

    def use(self, refs: list[ResultRef]) -> list[KeptResult]:
        """A call names ``refs``: hold them until it ends (:meth:`unhold`)."""
        results = [ref._result for ref in refs]
        with self._lock:
            for result in results:
                result.users += 1
        return results

    def unhold(self, results: list[KeptResult]) -> None:
        done = []
        with self._lock:
            for result in results:
                result.users -= 1
                if result.users == 0 and result.freed and not result.dropped:
                    done.append(result)
        self._drop(done)

    def free(self, result: KeptResult) -> None:
        with self._lock:
            if result.freed:
                return
            result.freed = True
            if result.users:
                return  # dropped when the last call naming it ends
        self._drop([result])

    def _drop(self, results: list[KeptResult]) -> None:
        """Tell the ranks to forget ``results`` -- from a thread of the table's own: a
        handle is freed from anywhere (a finalizer, the thread that ends calls)."""
        with self._lock:
            for result in results:
                if result.dropped:
                    continue
                result.dropped = True
                self._live.get(result.rank, set()).discard(result)
                if not self._closed and result.lost is None:
                    self._to_drop.setdefault(result.rank, []).append(result.call_id)
            copied = [r for r in results if r.copies]
            if not self._to_drop:
                _release_copies(copied)
                return
            if self._dropper is None:
                self._dropper = threading.Thread(target=self._drop_loop, daemon=True,
                                                 name=f"phalanx-drop-{self.label}")
                self._dropper.start()
        self._wake.set()
        _release_copies(copied)

    def _drop_loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                batch, self._to_drop = self._to_drop, {}
                closed = self._closed
            if closed:
                return
            for rank, call_ids in batch.items():
                try:
                    self._send("@drop", [rank], [self._encode((call_ids,), {})])
                except Exception as exc:  # noqa: BLE001 - the rank is gone: so are they
                    logger.debug("could not drop kept results %s on rank %d: %s",
                                 call_ids, rank, exc)

    def lost(self, rank: int, why: str) -> None:
        """``rank`` died: its kept results went with it."""
        with self._lock:
            results = self._live.pop(rank, set())
            for result in results:
                result.lost = why
                result.dropped = True
        _release_copies(results)

    def close(self) -> None:
        """The group shuts down: every kept result goes with its rank."""
        with self._lock:
            self._closed = True
            ended = [r for results in self._live.values() for r in results]
            for result in ended:
                result.freed = result.dropped = True
            self._live.clear()
            self._to_drop.clear()
        self._wake.set()  # the dropper ends
        _release_copies(ended)

    def __len__(self) -> int:
        return sum(len(r) for r in self._live.values())


def _release_copies(results: Any) -> None:
    """Results gone: the groups whose nodes copied them drop their copies."""
    for result in results:
        copies, result.copies = result.copies, []
        for consumer in copies:
            consumer.drop_copy(result)


class KeptFuture(GroupFuture):
    """A ``keep=True`` call's future: each rank's value is a :class:`ResultRef`. Every
    result kept gets its handle once the call is done, so that the results of a call that
    failed on another rank are freed too (with their unused handles)."""

    __slots__ = ("_call_id", "_kept", "_refs")

    def __init__(self, method: str, ranks: list[int], dispatcher: Dispatcher,
                 tolerant: bool, kept: KeptResults, call_id: int) -> None:
        super().__init__(method, ranks, dispatcher, tolerant)
        self._kept = kept
        self._call_id = call_id
        self._refs: list[ResultRef | None] = [None] * len(ranks)
        self.hold(self, [])  # once every rank is done: unhold() makes the handles

    def _value(self, i: int) -> Any:
        ref = self._refs[i]
        if ref is None:
            answer = super()._value(i)
            ref = self._refs[i] = self._kept.adopt(self._ranks[i], self._call_id,
                                                   self.method, answer)
        return ref

    def result(self, timeout: float | None = None) -> list[Any]:
        super().result(timeout)  # raises the first failure
        return [self._value(i) for i in range(len(self._ranks))]

    def unhold(self, _: list[Any]) -> None:
        """Every rank is done: a handle for each that answered (unused ones free theirs)."""
        for i in range(len(self._ranks)):
            if self._is_done(i) and self._error(i) is None:
                try:
                    self._value(i)
                except Exception:
                    logger.exception("the kept result of rank %d is unreadable",
                                     self._ranks[i])
