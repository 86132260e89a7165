"""Results that stay on the ranks that made them: ``keep=True`` and :class:`ResultRef`.

``group.call("rollout", ..., keep=True)`` (and ``call_async``, ``map``, ``map_async``,
``call_one``, ``call_sharded``) leaves each rank's result where it was made
(:mod:`phalanx.rank.kept`: a memory block of the rank's process, on every backend)
and returns a :class:`~phalanx.controller.refs.ResultRef` per rank instead of the value
(an :class:`~phalanx.controller.refs.ObjectRef`, as ``put()``'s handles are). A handle
goes into any call of any group of this controller, anywhere in its arguments (as a
``put()`` handle does); the rank that receives it reads the value straight from the
producer -- a mapping of the producer's block on the same machine; on Ray, from another
machine, a Ray task on the producer's node and Ray's object store -- never through the
controller. ``ref.get()`` fetches the value here.

A kept result lives until its handle is freed (``ref.free()``, the last reference to it
dropped, or its group shut down); a call in flight that names it keeps it until the call
ends. A freed handle raises :class:`~phalanx.errors.ObjectFreed` before anything is sent;
one whose producing rank died raises :class:`~phalanx.errors.ObjectLost` naming the
group, the rank and why (and so does a call whose rank finds it gone).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.backends.held import NodeAddress
from phalanx.controller.futures import Call, GroupFuture
from phalanx.controller.refs import Record, RefState, ResultRef, check_usable
from phalanx.rank import kept as rankkept
from phalanx.rank import shared as rankshared

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.shared import Payload, SharedObjects

logger = logging.getLogger(__name__)


class KeptRecord(Record):
    """One rank's kept result, as the controller knows it."""

    __slots__ = ("call_id", "copies", "id", "location", "method", "nbytes", "rank", "rows",
                 "source")

    def __init__(self, id: int, rank: int, call_id: int, method: str, nbytes: int,
                 location: rankkept.KeptLocation, source: NodeAddress | None,
                 rows: int | None = None) -> None:
        super().__init__()
        self.id = id
        self.rank = rank
        # the call's id (keep=True), or the negative key of a px.keep() value in its result
        self.call_id = call_id
        self.method = method
        self.nbytes = nbytes
        self.rows = rows  # its first dimension, if it has one (phalanx.rank.rows)
        self.location = location  # where it is (a block of its rank)
        self.source = source  # its node, for nodes that copy it (KeptCopying.source_of)
        self.copies: list[SharedObjects] = []  # the groups whose nodes hold a copy

    @property
    def label(self) -> str:
        if self.call_id < 0:
            return f"a px.keep() value in the result of {self.method}()"
        return f"the result of {self.method}()"


class KeptResults:
    """A group's kept results: their handles' records, their release, their loss.

    The group's part behind ``keep=True``: :meth:`adopt` makes a handle of a rank's
    answer, :meth:`free` / :meth:`unhold` release, :meth:`lost` marks a dead rank's
    results, :meth:`close` ends them all with the group; for handles, the
    :class:`~phalanx.controller.refs.Keeper` interface and :meth:`get`.
    ``send(method, ranks, payloads)`` sends a built-in call (``@drop``, ``@fetch``);
    ``encode`` pickles its arguments; ``source(rank)`` says where other nodes fetch what
    ``rank`` keeps.
    """

    def __init__(self, label: str, send: Callable[..., GroupFuture],
                 encode: Callable[..., Payload],
                 source: Callable[[int], NodeAddress | None] = lambda rank: None) -> None:
        self.label = label  # the group, in messages ("group Producer")
        self._send = send
        self._encode = encode
        self._source = source
        self._ids = itertools.count(1)
        self._live: dict[int, set[KeptRecord]] = {}  # rank -> its results with a handle
        self._to_drop: dict[int, list[int]] = {}  # rank -> call ids, not yet told
        # re-entrant: a handle's finalizer may run (the GC) while this thread holds it
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._dropper: threading.Thread | None = None
        self._closed = False

    def adopt(self, rank: int, call_id: int, method: str, answer: tuple[Any, ...]
              ) -> ResultRef:
        nbytes, where, rows = answer
        location = rankkept.location_of(where)
        result = KeptRecord(next(self._ids), rank, call_id, method, nbytes, location,
                            self._source(rank), rows)
        with self._lock:
            if self._closed:
                result.move(RefState.RELEASED)
                result.why = f"{self.label} was shut down"
            else:
                self._live.setdefault(rank, set()).add(result)
        return ResultRef(self, result)

    # -- the Keeper interface ------------------------------------------------------------

    def describe(self, result: KeptRecord) -> str:
        return f"{result.label} on rank {result.rank} of {self.label}"

    def reduce(self, ref: ResultRef, consumer: SharedObjects) -> tuple[Any, ...]:
        result: KeptRecord = ref.record
        check_usable(result, ref)
        return rankkept.read, (result.location, self.describe(result),
                               consumer.copy_of(result))

    def to_ray(self, ref: ResultRef) -> Any:
        """A Ray ``ObjectRef`` of ``ref``'s value (see :meth:`ResultRef.to_ray`): a Ray
        task on the producer's node reads it there into Ray's store; it is read before
        this returns, so that the handle may be freed at once."""
        result: KeptRecord = ref.record
        check_usable(result, ref)
        location = result.location
        if location.ray_node is None:
            raise TypeError(f"{self.describe(result)} is kept by a rank that is no Ray "
                            "worker: only results kept on the Ray backend convert to a Ray "
                            "ObjectRef (pass the handle itself to phalanx calls, or .get() "
                            "the value)")
        import ray

        self.use([result])  # held until the task has read it, even if freed meanwhile
        try:
            converted = rankkept.ray_reader(location).remote(location, self.describe(result))
            ready, _ = ray.wait([converted], timeout=rankshared.RAY_GET_TIMEOUT,
                                fetch_local=False)
        finally:
            self.unhold([result])
        if not ready:
            raise TimeoutError(f"Ray did not read {self.describe(result)} on its node within "
                               f"{rankshared.RAY_GET_TIMEOUT:.0f} s")
        return converted

    def get(self, ref: ResultRef, timeout: float | None) -> Any:
        """The value of ``ref``, here (see :meth:`ResultRef.get`)."""
        result: KeptRecord = ref.record
        check_usable(result, ref)
        location = result.location
        if location.machine == rankkept.machine():
            return rankkept.read(location, self.describe(result))
        payload = self._encode((result.call_id,), {})  # see phalanx.rank.kept
        return self._send("@fetch", [result.rank], [payload], builtin=True).result(timeout)[0]

    # -- release ------------------------------------------------------------------------

    def use(self, results: list[KeptRecord]) -> list[KeptRecord]:
        """A call names ``results``: hold them until it ends (:meth:`unhold`)."""
        with self._lock:
            for result in results:
                result.users += 1
        return results

    def unhold(self, results: list[KeptRecord]) -> None:
        with self._lock:
            done = [result for result in results if result.unuse()]
        self._drop(done)

    def free(self, result: KeptRecord) -> None:
        with self._lock:
            if not result.free():
                return  # in use (dropped when the last call naming it ends), or gone
        self._drop([result])

    def _drop(self, results: list[KeptRecord]) -> None:
        """Tell the ranks to forget ``results`` (RELEASED now) -- from a thread of the
        table's own: a handle is freed from anywhere (a finalizer, the thread that ends
        calls)."""
        if not results:
            return
        with self._lock:
            for result in results:
                self._live.get(result.rank, set()).discard(result)
                if not self._closed:
                    self._to_drop.setdefault(result.rank, []).append(result.call_id)
            copied = [r for r in results if r.copies]
            if not self._to_drop:
                _release_copies(copied)
                return
            if self._dropper is None:
                self._dropper = threading.Thread(target=self._drop_loop, daemon=True,
                                                 name=f"phalanx-drop ({self.label})")
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
                    self._send("@drop", [rank], [self._encode((call_ids,), {})],
                               builtin=True)
                except Exception as exc:  # noqa: BLE001 - the rank is gone: so are they
                    logger.debug("could not drop kept results %s on rank %d: %s",
                                 call_ids, rank, exc)

    def lost(self, rank: int, why: str) -> None:
        """``rank`` died: its kept results went with it."""
        with self._lock:
            results = self._live.pop(rank, set())
            for result in results:
                if result.move(RefState.LOST):
                    result.why = why
        _release_copies(results)

    def close(self) -> None:
        """The group shuts down: every kept result goes with its rank (before the ranks
        stop, so that a handle says the group was shut down, not that its rank died)."""
        with self._lock:
            self._closed = True
            ended = [r for results in self._live.values() for r in results]
            for result in ended:
                if result.move(RefState.RELEASED):
                    result.why = f"{self.label} was shut down"
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


class KeptFuture(Call):
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

    def _rank_value(self, i: int) -> Any:
        ref = self._refs[i]
        if ref is None:
            answer = super()._rank_value(i)
            ref = self._refs[i] = self._kept.adopt(self._ranks[i], self._call_id,
                                                   self.method, answer)
        return ref

    def result(self, timeout: float | None = None) -> list[Any]:
        try:
            super().result(timeout)  # raises the first failure
        except BaseException:
            del self  # no cycle through the traceback (see GroupFuture.result)
            raise
        return [self._rank_value(i) for i in range(len(self._ranks))]

    def unhold(self, _: list[Any]) -> None:
        """Every rank is done: a handle for each that answered (unused ones free theirs)."""
        for i in range(len(self._ranks)):
            if self._rank_done(i) and self._rank_error(i) is None:
                try:
                    self._rank_value(i)
                except Exception:
                    logger.exception("the kept result of rank %d is unreadable",
                                     self._ranks[i])
