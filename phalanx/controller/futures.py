"""Results of calls: a :class:`GroupFuture` per call, with a :class:`RankFuture` view per rank.

Futures hold no threads, and no lock of their own. They are completed by the group's
dispatcher, and waiting on one drives the dispatcher (see :mod:`phalanx.controller.dispatch`): the
thread that waits does the receiving, which is what keeps a call's round trip close to a raw
pipe's.

A group future *fails fast*: its first failing rank makes ``result()`` raise at once,
without waiting for the other ranks of that call.

Futures fit the ecosystem: ``add_done_callback``; ``as_concurrent()`` gives a
``concurrent.futures.Future`` for ``concurrent.futures.wait``/``as_completed``; ``await``
needs no thread. While callbacks are pending and no thread waits, the group's watchdog
thread drives the dispatcher, so results still arrive; callbacks run on whichever thread
received the completing message, and must not block. That thread may not be the one adding
a callback: adding one and taking them to run are made atomic by one module-wide lock, which
a call without callbacks never takes.

Per-rank state lives in flat lists inside the group future (a call in flight costs two
small objects, not one per rank): pipelining tens of thousands of calls stays cheap for the
allocator and the garbage collector. Results are unpickled on first access. The answers of
a run of ranks that came together (an agent tree's gathered ones,
:class:`~phalanx.wire.protocol.Gathered`) resolve the run at once: its places hold one
shared :class:`_Span` until a value is read, and reading them all decodes each run in one
pass -- one unpickling for a run whose ranks all answered with the same bytes and an
immutable value (``None``, a number, a text), so a call to thousands of ranks returning
``None`` costs the controller no per-rank work at all beyond the result list.

Every future has two sides. The *user side* is the public class a caller holds
(:class:`GroupFuture`, :class:`StreamFuture`): ``result()``, ``done()``, iteration,
``await``. The *completion side* is how the rest of the controller completes a call, and
lives on the internal subclasses the sender makes (:class:`Call`, :class:`StreamCall`),
never on the public classes: the dispatcher resolves or fails each rank as its answer (or
its death) is known and hands a streamed call its items, a membership change fails the
calls it breaks, the watchdog asks which ranks are late (all through the
:class:`Completion` protocol); the sender holds a deferred call's sends until its first
wait (:meth:`Call.defer`) and :mod:`phalanx.controller.shared` makes it hold the put
objects its arguments name (:meth:`Call.hold`). :class:`RankFuture` is a view into its
group future, the one other class that reads the group future's private per-rank state.

A streamed call (``call_stream``) is a :class:`StreamFuture`: its ranks send items as
their generator yields them, and a RESULT ends each rank's stream.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import pickle
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from phalanx import config
from phalanx.errors import CallTimeout, SerializationError
from phalanx.options import check_seconds
from phalanx.rank.kept import ADOPTING

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.ranks import Cohort
    from phalanx.wire.protocol import Gathered

_loads = pickle.loads
logger = logging.getLogger(__name__)


# A place still waiting for its rank's answer. A plain object, which the cyclic collector
# does not track: a one-rank call's places, a tuple of it, go untracked too (see __init__).
_PENDING = object()
# a place whose value was decoded (GroupFuture._out holds it) and its answer let go
_DECODED = object()
_ONE_PENDING = (_PENDING,)  # a one-rank call's places before its answer (never written)
# what one decoding of the same bytes may give every rank of a run: immutable values
_ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes))
# Held while a done-callback is added and while a settled future takes its callbacks to
# run, with the dispatcher's watch of the future that goes with either: the two may happen
# on different threads at once (see the module docstring).
_CALLBACKS_LOCK = threading.Lock()


class _Span:
    """The answers of a run of a call's ranks that came together (places ``lo`` to
    ``lo + len(gathered)``): what each of those places holds until it is decoded."""

    __slots__ = ("gathered", "lo")

    def __init__(self, gathered: Gathered, lo: int) -> None:
        self.gathered = gathered
        self.lo = lo

    def payload(self, i: int) -> list[Any]:
        """The answer of the call's place ``i`` (one of the run's)."""
        return self.gathered.payload(i - self.lo)

    def decode(self) -> list[Any]:
        """Every value of the run, in order, in one pass."""
        gathered = self.gathered
        count = len(gathered)
        same = gathered.uniform()
        if same is not None:  # every rank answered with these bytes
            value = _loads(same)
            if type(value) in _ATOMS:
                return [value] * count
            return [value, *[_loads(same) for _ in range(count - 1)]]
        if gathered.plain:
            return [_loads(p) for p in gathered.pickles()]
        return [_decode(p) for p in map(gathered.payload, range(count))]


def _decode(answer: Any) -> Any:
    """One answer's value, in whichever form it came: its pickle alone (bytes, or a
    memoryview of a large one) or its segments (a pickle and its buffers)."""
    if type(answer) not in _SEGMENTS:
        return _loads(answer)
    if len(answer) == 1:
        return _loads(answer[0])
    return _loads(answer[0], buffers=answer[1:])


# In the pickle of an answer that holds px.keep() parts: the function they unpickle by
# (phalanx.rank.kept.piece). A one-rank answer is searched for it before its quick decode,
# a failed call's answers to free their parts. With find(): `part in pickle` tries the part
# as an int first, and makes and clears a TypeError each time (0.1 us, on every such call).
_KEPT_PART = b"piece"
# the types an answer's segments come as; any other answer is one pickle alone (bytes, or
# a memoryview of a large one)
_SEGMENTS = (tuple, list)
_PICKLES_ONLY = {bytes}  # the types of a call's answers when each is one pickle alone
_POSITIONS_FROM = 8  # calls on more ranks than this find a rank's entry through a dict


class Completion(Protocol):
    """The completion side of a call's future (see the module docstring): what an entry's
    ``pending`` table holds, and what the dispatcher, a membership change and the
    watchdog use to complete a call or look at it."""

    method: str  # the method called (for the errors that name it)

    @property
    def tolerant(self) -> bool:
        """Made on workers="ready" / "any": a membership change does not fail it."""

    def resolve_rank(self, rank: int, segments: Sequence[Any]) -> None:
        """``rank`` answered: ``segments`` are its encoded value, a pickle and its buffers
        (a tuple or list), or the pickle alone (bytes or a memoryview: nearly every
        answer, kept as it came, in no container for the collector to track)."""

    def fail_rank(self, rank: int, error: BaseException) -> None:
        """``rank`` failed with ``error`` (the first failure fails the whole call)."""

    def yield_rank(self, rank: int, segments: list[Any]) -> None:
        """``rank`` streamed an item (``segments``); only a streamed call keeps it."""

    def late_ranks(self) -> list[int]:
        """The ranks that have not answered yet."""

    def cancelled(self) -> bool:
        """Whether the caller cancelled the call."""

    def __len__(self) -> int:
        """The number of ranks called."""


class GroupFuture:
    """The outcome of one call on several ranks; results come back in rank order.

    ``result(timeout)`` returns the list of values or raises the first failure; iterating
    yields the per-rank futures as they complete; ``await future`` works in asyncio code.
    """

    __slots__ = (
        "_callbacks",
        "_cancelled",
        "_decoded",
        "_dispatcher",
        "_errors",
        "_failed",
        "_fanned",
        "_holds",
        "_kept",
        "_kickoff",
        "_out",
        "_positions",
        "_ranks",
        "_remaining",
        "_spans",
        "_tolerant",
        "_values",
        "method",
    )

    def __init__(self, method: str, ranks: list[int], dispatcher: Dispatcher,
                 tolerant: bool = False, kept: Any = None) -> None:
        self.method = method
        self._ranks = ranks  # never mutated (it may be shared with the group)
        self._dispatcher = dispatcher
        # each place's answer as it came: a RESULT's segments (or its pickle alone, as
        # bytes), a _Span, None (failed); a one-rank call's, once answered, a tuple (never
        # written again), as is its _out once decoded: the collector stops tracking a
        # tuple of untracked objects, and a loop of pipelined calls keeps thousands of
        # futures
        count = len(ranks)
        self._values: list[Any] | tuple[Any, ...] = (
            _ONE_PENDING if count == 1 else [_PENDING] * count)
        self._decoded = 0  # bit i set once _out[i] holds the decoded value
        self._out: list[Any] | tuple[Any, ...] | None = None  # the decoded values
        self._spans: list[_Span] | None = None  # the runs of answers that came together
        self._errors: dict[int, BaseException] | None = None
        self._remaining = count
        self._failed = -1  # index of the first failed rank
        self._cancelled = False
        # a rank's place, for calls on more than _POSITIONS_FROM ranks: made when first
        # needed (a cohort's call shares the cohort's)
        self._positions: dict[int, int] | None = None
        # (cohort, call id) while the call is registered on a cohort (phalanx.controller.ranks)
        self._fanned: tuple[Cohort, int] | None = None
        # For synchronous calls the group defers the sends to the first wait (see
        # Dispatcher.wait); anything that looks at the future sends them first.
        self._kickoff: Callable[[], None] | None = None
        self._callbacks: list[Callable[[GroupFuture], Any]] | None = None
        # [(owner, objects)]: what the call's arguments name, held until it ends
        self._holds: list[tuple[Any, list[Any]]] | None = None
        # made on workers="ready" / "any": a change of the group's nodes does not fail it
        self._tolerant = tolerant
        # the group's KeptResults: what makes handles of px.keep() values in the results
        self._kept = kept

    def _index(self, rank: int) -> int:
        positions = self._positions
        if positions is None:
            ranks = self._ranks
            if len(ranks) <= _POSITIONS_FROM:
                return ranks.index(rank)
            positions = self._positions = {r: i for i, r in enumerate(ranks)}
        return positions[rank]

    def _settle(self) -> None:
        """Run the done-callbacks, once; once every rank is done, let go of what the
        call's arguments held, and give a failed call's kept parts their handles."""
        if self._remaining == 0:
            fanned = self._fanned
            if fanned is not None:  # no rank owes it an answer: off its cohort
                self._fanned = None
                fanned[0].done(fanned[1])
            if self._failed >= 0:
                self._adopt_survivors()
            if self._holds is not None:
                holds, self._holds = self._holds, None
                for owner, objects in holds:
                    owner.unhold(objects)
        if self._callbacks is not None:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        """Run the done-callbacks added so far, each once, whichever thread calls this."""
        with _CALLBACKS_LOCK:
            callbacks, self._callbacks = self._callbacks, None
            if callbacks is None:  # another thread took them
                return
            self._dispatcher.watch_future(self, False)
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("a done-callback of %s() raised", self.method)

    # -- state ------------------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    @property
    def futures(self) -> list[RankFuture]:
        """The per-rank futures, in rank order."""
        return [RankFuture(self, i) for i in range(len(self._ranks))]

    def _adopt_survivors(self) -> None:
        """A failed call's ranks are all done: the ``px.keep()`` parts of the answers of
        those that succeeded get their handles now (their values decoded), so that they
        are freed with the future. Nobody reads those answers through ``result()``, and a
        part without a handle would stay on its rank until the group closes."""
        for i, value in enumerate(self._values):
            if self._decoded >> i & 1 or value is None or value is _PENDING:
                continue
            pickled = (value.payload(i)[0] if type(value) is _Span
                       else value[0] if type(value) in _SEGMENTS else value)
            if (pickled if isinstance(pickled, bytes) else bytes(pickled)).find(_KEPT_PART) < 0:
                continue
            try:
                self._rank_value(i)
            except SerializationError as exc:
                logger.warning("%s", exc)

    def _late_ranks(self) -> list[int]:
        """The ranks that have not answered yet."""
        return [r for r, v in zip(self._ranks, self._values, strict=True) if v is _PENDING]

    def _settled(self) -> bool:
        return self._remaining == 0 or self._failed >= 0 or self._cancelled

    # -- one rank's outcome (what a RankFuture shows), by its position i in ranks --------

    def _rank_at(self, i: int) -> int:
        return self._ranks[i]

    def _rank_done(self, i: int) -> bool:
        """Whether the rank at ``i`` answered or failed (as known now)."""
        return self._values[i] is not _PENDING

    def _rank_done_now(self, i: int) -> bool:
        """:meth:`_rank_done`, once the call's sends are made and the answers already in
        are taken."""
        self._kick()
        if not self._rank_done(i):
            self._dispatcher.poll_now()
        return self._rank_done(i)

    def _rank_error(self, i: int) -> BaseException | None:
        return None if self._errors is None else self._errors.get(i)

    def _rank_value(self, i: int) -> Any:
        """The decoded value of a rank that succeeded (decoded once, on first access)."""
        if self._decoded >> i & 1:
            return self._out[i]  # type: ignore[index]
        payload = self._values[i]
        if type(payload) is _Span:
            payload = payload.payload(i)
        adopting, previous = ADOPTING, ADOPTING.future
        adopting.future = self
        try:
            value = _decode(payload)
        except Exception as exc:
            raise SerializationError(
                f"could not unpickle the result of {self.method}() from rank "
                f"{self._ranks[i]}: {type(exc).__name__}: {exc}",
                stage="unpickling the result",
                rank=self._ranks[i],
            ) from exc
        finally:
            adopting.future = previous
        if self._out is None:
            self._out = [None] * len(self._values)
        cast("list[Any]", self._out)[i] = value  # (a tuple only once all are decoded)
        self._decoded |= 1 << i
        return value

    def _kick(self) -> None:
        kickoff, self._kickoff = self._kickoff, None
        if kickoff is not None:
            kickoff()

    def _wait_for(self, is_done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until ``is_done()`` (the call's sends made first), receiving meanwhile;
        CallTimeout naming the late ranks after ``timeout`` s."""
        if timeout is not None and not (type(timeout) is float and timeout >= 0):
            check_seconds(timeout)
        kickoff, self._kickoff = self._kickoff, None
        if kickoff is None and is_done():
            return
        if not self._dispatcher.wait(is_done, timeout, kickoff):
            pending = self._late_ranks()
            # where the late ranks are, unless the caller polls with short timeouts
            stacks = (self._dispatcher.stacks_of(pending)
                      if timeout is not None and timeout >= config.STACKS_ON_TIMEOUT else None)
            raise CallTimeout(self.method, timeout or 0.0, pending, stacks,
                              group=self.group_name)

    # -- user side --------------------------------------------------------------------

    def done(self) -> bool:
        """True once every rank answered, one failed, or the future was cancelled."""
        self._kick()
        if not self._settled():
            self._dispatcher.poll_now()
        return self._settled()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's value in rank order; raises the first failure at once."""
        if timeout is not None:
            check_seconds(timeout)
        if self._kickoff is not None or not (self._remaining == 0 or self._failed >= 0):
            if timeout is None and self._kickoff is None:  # _wait_for's one step, here
                self._dispatcher.wait(self._settled, None)  # (no deadline: no timeout)
            else:
                self._wait_for(self._settled, timeout)
        if self._cancelled:
            raise concurrent.futures.CancelledError(f"{self.method}() was cancelled")
        if self._failed >= 0:
            error = self._errors[self._failed]  # type: ignore[index]
            # The error keeps this frame in its traceback and the future keeps the error:
            # without `self` in the frame that is no cycle, and a failed call's results
            # (and the kept values they name) go when the caller lets go of both, not at
            # the cyclic collector's next run.
            del self
            raise error
        if self._decoded == 0:  # first access: decode every value in one pass
            values = self._values
            if len(values) == 1:  # one rank's plain pickle, the pipelined call's
                only = values[0]
                if type(only) is bytes and only.find(_KEPT_PART) < 0:  # no px.keep() part
                    try:
                        value = _loads(only)
                    except Exception:  # noqa: BLE001 - redone below, naming the rank
                        pass
                    else:  # (see __init__: a tuple, and the answer's bytes go)
                        self._values = self._out = (value,)
                        self._decoded = 1
                        return [value]
            adopting, previous = ADOPTING, ADOPTING.future
            adopting.future = self
            try:
                out = self._decode_all()
            except Exception:  # noqa: BLE001 - redone value by value to name the rank
                return [self._rank_value(i) for i in range(len(self._values))]
            finally:
                adopting.future = previous
            count = len(out)
            self._out = out
            self._decoded = (1 << count) - 1
            self._values = [_DECODED] * count  # the answers' bytes go
            return list(out)
        decoded = self._out
        if decoded is not None and self._decoded == (1 << len(decoded)) - 1:
            return list(decoded)
        return [self._rank_value(i) for i in range(len(self._values))]

    def _decode_all(self) -> list[Any]:
        """Every place's value (all answered), in one pass; each run that came together
        decoded as one (:meth:`_Span.decode`)."""
        values = self._values
        spans = self._spans
        if spans is None:
            if {*map(type, values)} == _PICKLES_ONLY:  # each answer one pickle: no loop here
                return list(map(_loads, values))
            return [_decode(p) for p in values]
        out = list(values)
        covered = 0
        for span in spans:
            run = span.decode()
            out[span.lo:span.lo + len(run)] = run
            covered += len(run)
        if covered != len(values):  # some came on their own
            for i, p in enumerate(values):
                if p is not None and type(p) is not _Span:
                    out[i] = _decode(p)
        return out

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The first failure, or None once every rank succeeded."""
        if timeout is not None:
            check_seconds(timeout)
        self._wait_for(self._settled, timeout)
        if self._cancelled:
            raise concurrent.futures.CancelledError(f"{self.method}() was cancelled")
        return None if self._failed < 0 else self._errors[self._failed]  # type: ignore[index]

    def cancel(self) -> bool:
        """Stop waiting for this call: later results are discarded.

        Workers that already started the call finish it (a running Python frame cannot be
        interrupted safely). Returns False if the call had already completed.
        """
        self._kick()
        if self._remaining == 0 or self._failed >= 0:
            return False
        self._cancelled = True
        if self._callbacks is not None:  # the rest of settling waits for the last rank
            self._run_callbacks()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def __iter__(self) -> Iterator[RankFuture]:
        """Per-rank futures as they complete (those already complete first, in rank order),
        failed ones included; waits as needed."""
        self._kick()
        left = list(range(len(self._ranks)))
        while left:
            ready = [i for i in left if self._values[i] is not _PENDING]
            if not ready:
                self._dispatcher.wait(lambda: any(self._rank_done(i) for i in left), None)
                continue
            for i in ready:
                left.remove(i)
                yield RankFuture(self, i)

    def add_done_callback(self, fn: Callable[[GroupFuture], Any]) -> None:
        """Call ``fn(future)`` once the future is done (every rank answered, one failed, or
        it was cancelled); at once if it already is. Results arrive even if no thread
        waits (see the module docstring)."""
        self._kick()
        if self._settled():
            fn(self)
            return
        with _CALLBACKS_LOCK:
            callbacks = self._callbacks
            if callbacks is None:
                self._callbacks = [fn]
                self._dispatcher.watch_future(self, True)
            else:
                callbacks.append(fn)
        if self._settled():
            # completed meanwhile on a thread that may have looked for callbacks before
            # ``fn`` was in: whichever thread takes them first runs them
            self._run_callbacks()

    def as_concurrent(self) -> concurrent.futures.Future[list[Any]]:
        """A ``concurrent.futures.Future`` that completes with this one (for
        ``concurrent.futures.wait`` and ``as_completed``); cancelling it cancels this."""
        return _bridge(self)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return _await(self)

    def __len__(self) -> int:
        return len(self._ranks)

    @property
    def group_name(self) -> str | None:
        """The name of the group the call runs on."""
        return self._dispatcher.group_name

    def __repr__(self) -> str:
        state = "done" if self._settled() else f"{self._remaining} pending"
        return (f"<GroupFuture {self.method}() on {_group_text(self.group_name)} "
                f"ranks={self._ranks} {state}>")


class RankFuture:
    """The outcome of one call on one rank (a view into its :class:`GroupFuture`)."""

    __slots__ = ("_group", "_i", "rank")

    def __init__(self, group: GroupFuture, index: int) -> None:
        self._group = group
        self._i = index
        self.rank = group._rank_at(index)  # noqa: SLF001 - its group future's view

    @property
    def method(self) -> str:
        return self._group.method

    def done(self) -> bool:
        return self._group._rank_done_now(self._i)  # noqa: SLF001 - its group future's view

    def _wait(self, timeout: float | None) -> None:
        group, i = self._group, self._i
        try:
            group._wait_for(lambda: group._rank_done(i), timeout)  # noqa: SLF001 - its group future's view
        except CallTimeout as exc:
            stacks = {self.rank: exc.stacks[self.rank]} if self.rank in exc.stacks else None
            raise CallTimeout(group.method, timeout or 0.0, [self.rank], stacks,
                              group=group.group_name) from None

    def result(self, timeout: float | None = None) -> Any:
        """The rank's return value; raises its error, or CallTimeout after ``timeout`` s."""
        if timeout is not None:
            check_seconds(timeout)
        self._wait(timeout)
        error = self._group._rank_error(self._i)  # noqa: SLF001 - its group future's view
        if error is not None:
            del self  # no cycle through the traceback (see GroupFuture.result)
            raise error
        return self._group._rank_value(self._i)  # noqa: SLF001 - its group future's view

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._group._rank_error(self._i)  # noqa: SLF001 - its group future's view

    def __repr__(self) -> str:
        group = self._group
        if not group._rank_done(self._i):  # noqa: SLF001 - its group future's view
            state = "pending"
        else:
            state = "failed" if group._rank_error(self._i) is not None else "done"  # noqa: SLF001 - its group future's view
        return (f"<RankFuture {group.method}() on rank {self.rank} of "
                f"{_group_text(group.group_name)} {state}>")


class StreamFuture(GroupFuture):
    """A streamed call: iterate it for ``(rank, item)`` pairs in arrival order.

    ``timeout`` (given to ``call_stream``) bounds the wait for each next item.
    ``result()`` drains the stream and returns every rank's items, in rank order.
    Errors and deaths behave as for any call: the first failing rank raises from the
    iterator at once (fail fast), a dead rank raises :class:`~phalanx.errors.WorkerDied`.
    """

    __slots__ = ("_items", "timeout")

    def __init__(self, method: str, ranks: list[int], dispatcher: Dispatcher,
                 tolerant: bool = False, timeout: float | None = None,
                 kept: Any = None) -> None:
        super().__init__(method, ranks, dispatcher, tolerant, kept)
        self._items: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self.timeout = timeout

    def _has_news(self) -> bool:
        return bool(self._items) or self._remaining == 0 or self._failed >= 0

    def __iter__(self) -> Iterator[tuple[int, Any]]:  # type: ignore[override]
        self._kick()
        while True:
            if self._items:
                rank, segments = self._items.popleft()
                yield rank, self._decode_item(segments, rank)
                continue
            if self._failed >= 0:
                raise self._errors[self._failed]  # type: ignore[index]
            if self._remaining == 0 or self._cancelled:
                return
            if not self._dispatcher.wait(self._has_news, self.timeout):
                raise CallTimeout(self.method, self.timeout or 0.0, self._late_ranks(),
                                  group=self.group_name)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's streamed items (a list per rank, in rank order)."""
        if timeout is not None:
            self.timeout = timeout
        items: dict[int, list[Any]] = {rank: [] for rank in self._ranks}
        for rank, item in self:
            items[rank].append(item)
        return [items[rank] for rank in self._ranks]


    def _decode_item(self, segments: list[Any], rank: int) -> Any:
        adopting, previous = ADOPTING, ADOPTING.future
        adopting.future = self
        try:
            return _loads(segments[0], buffers=segments[1:])
        except Exception as exc:
            raise SerializationError(
                f"could not unpickle an item streamed by {self.method}() on rank {rank}: "
                f"{type(exc).__name__}: {exc}",
                stage="unpickling a streamed item",
                rank=rank,
            ) from exc
        finally:
            adopting.future = previous


class Call(GroupFuture):
    """A call's future as the controller completes it: the :class:`GroupFuture` a caller
    holds, with its completion side (see the module docstring and :class:`Completion`).
    Internal: the sender makes it; user code sees the public class's methods only."""

    __slots__ = ()

    @property
    def tolerant(self) -> bool:
        """Made on workers="ready" / "any": a change of the group's nodes does not fail it."""
        return self._tolerant

    def defer(self, send: Callable[[], None]) -> None:
        """Have ``send()`` (the call's sends) run at the future's first wait, as late as
        possible (see :meth:`Dispatcher.wait <phalanx.controller.dispatch.Dispatcher.wait>`);
        anything else that looks at the future runs it first."""
        self._kickoff = send

    def hold(self, owner: Any, objects: list[Any]) -> None:
        """Keep ``objects`` (put objects, kept results the arguments name) in use until
        every rank is done; then ``owner.unhold(objects)``."""
        if self._holds is None:
            self._holds = []
        self._holds.append((owner, objects))

    def resolve_rank(self, rank: int, segments: Sequence[Any]) -> None:
        """``rank`` answered with ``segments`` (decoded on first access)."""
        values = self._values
        if len(values) == 1:
            if values[0] is not _PENDING:
                return
            self._values = (segments,)  # (see __init__)
        else:
            positions = self._positions
            if positions is not None:
                i = positions[rank]
            elif len(self._ranks) <= _POSITIONS_FROM:  # _index, inlined: once per answer
                i = self._ranks.index(rank)
            else:
                i = self._index(rank)
            if values[i] is not _PENDING:
                return
            values[i] = segments  # type: ignore[index]  # a list: more than one place
        self._remaining -= 1
        if self._remaining == 0 and (self._callbacks is not None or self._holds is not None
                                     or self._failed >= 0 or self._fanned is not None):
            self._settle()

    def resolve_span(self, lo: int, gathered: Gathered) -> bool:
        """The ranks at places ``lo`` to ``lo + len(gathered)`` answered, together
        (decoded on first access, in one pass); False, and nothing done, unless every one
        of them was still waited for (then each is resolved on its own)."""
        count = len(gathered)
        values = self._values
        hi = lo + count
        if self._decoded == 0:  # nothing decoded: the places hold no user object to compare
            if values[lo:hi].count(_PENDING) != count:
                return False
        elif not all(values[i] is _PENDING for i in range(lo, hi)):
            return False
        span = _Span(gathered, lo)
        self._put(lo, span, count)
        if self._spans is None:
            self._spans = [span]
        else:
            self._spans.append(span)
        self._remaining -= count
        if self._remaining == 0 and (self._callbacks is not None or self._holds is not None
                                     or self._failed >= 0 or self._fanned is not None):
            self._settle()
        return True

    def waits_on(self, i: int) -> bool:
        """Whether the rank at place ``i`` has neither answered nor failed."""
        return self._values[i] is _PENDING

    def fan_out(self, cohort: Cohort, call_id: int) -> None:
        """The call is registered once on ``cohort``, whose ranks are its own, in order:
        it takes the cohort's places, and leaves it when every rank is done."""
        self._positions = cohort.positions
        self._fanned = (cohort, call_id)

    def _put(self, lo: int, value: Any, count: int = 1) -> None:
        """Places ``lo`` to ``lo + count`` hold ``value`` now (a one-rank call's places
        are a tuple)."""
        values = self._values
        if isinstance(values, tuple):
            self._values = (*values[:lo], *(value,) * count, *values[lo + count:])
        else:
            values[lo:lo + count] = [value] * count

    def fail_rank(self, rank: int, error: BaseException) -> None:
        """``rank`` failed: the call fails with ``error`` unless another rank failed first."""
        i = self._index(rank)
        if self._values[i] is not _PENDING:
            return
        if self._errors is None:
            self._errors = {}
        self._errors[i] = error
        self._put(i, None)
        self._remaining -= 1
        if self._failed < 0:
            self._failed = i
            if self._callbacks is not None:
                self._settle()
        if self._remaining == 0 and (self._holds is not None or self._failed >= 0):
            self._settle()

    def yield_rank(self, rank: int, segments: list[Any]) -> None:
        """An item streamed by ``rank``: a call that is not streamed has none to keep."""

    def late_ranks(self) -> list[int]:
        """The ranks that have not answered yet."""
        return self._late_ranks()

    def adopt_piece(self, rank: int, key: int, answer: tuple[Any, ...]) -> Any:
        """A handle on a ``px.keep()`` value of ``rank``'s result, as it is decoded (see
        :func:`phalanx.rank.kept.piece`)."""
        if self._kept is None:
            raise TypeError(f"the result of {self.method}() holds a px.keep() value, which "
                            "this call cannot take")
        return self._kept.adopt(rank, key, self.method, answer)


class StreamCall(Call, StreamFuture):
    """A streamed call's future as the controller completes it (see :class:`Call`)."""

    __slots__ = ()

    def yield_rank(self, rank: int, segments: list[Any]) -> None:
        """An item streamed by ``rank``, kept until the iterator takes it."""
        if not self._cancelled:
            self._items.append((rank, segments))


class ShardedFuture:
    """The outcome of ``call_sharded``: called on ``called_ranks``, results kept from
    ``result_ranks`` (one per data shard when the output is replicated elsewhere)."""

    def __init__(self, future: GroupFuture, result_ranks: list[int], keep: list[int]) -> None:
        self._future = future
        self.called_ranks = future.ranks
        self.result_ranks = list(result_ranks)
        self._keep = keep  # positions of result_ranks among called_ranks

    def result(self, timeout: float | None = None) -> list[Any]:
        """The kept ranks' values, in rank order; raises the first failure at once."""
        values = self._future.result(timeout)
        return [values[i] for i in self._keep]

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    @property
    def futures(self) -> list[RankFuture]:
        """Per-rank futures of every called rank (dummy calls included), in rank order."""
        return self._future.futures

    def add_done_callback(self, fn: Callable[[ShardedFuture], Any]) -> None:
        """Call ``fn(future)`` once this call is done (see
        :meth:`GroupFuture.add_done_callback`)."""
        self._future.add_done_callback(lambda _: fn(self))

    def as_concurrent(self) -> concurrent.futures.Future[list[Any]]:
        """A ``concurrent.futures.Future`` that completes with this one."""
        return _bridge(self)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return _await(self)

    def __repr__(self) -> str:
        return (f"<ShardedFuture {self._future.method}() on "
                f"{_group_text(self._future.group_name)} called={self.called_ranks} "
                f"results from={self.result_ranks}>")


def _group_text(name: str | None) -> str:
    return "a group" if name is None else f"group {name}"


def _bridge(future: GroupFuture | ShardedFuture) -> concurrent.futures.Future[list[Any]]:
    bridge: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()

    def done(_: Any) -> None:
        if future.cancelled():
            bridge.cancel()
            return
        if not bridge.set_running_or_notify_cancel():
            return
        try:
            bridge.set_result(future.result())
        except BaseException as exc:  # noqa: BLE001 - handed to the bridge's waiters
            bridge.set_exception(exc)

    bridge.add_done_callback(lambda b: b.cancelled() and future.cancel())
    future.add_done_callback(done)
    return bridge


def _await(future: GroupFuture | ShardedFuture) -> Generator[Any, None, list[Any]]:
    """``await future`` on the running event loop, with no thread parked per awaiter."""
    import asyncio  # loaded already where anything awaits: not with every controller

    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def wake(_: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle)

    future.add_done_callback(wake)
    try:
        yield from waiter.__await__()
    except asyncio.CancelledError:
        future.cancel()
        raise
    return future.result()
