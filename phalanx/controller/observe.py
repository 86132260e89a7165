"""Watching a group's calls as they happen: what a trace (:mod:`phalanx.controller.trace`)
and a dashboard (:mod:`phalanx.monitor`) see.

An *observer* is told of every call a group sends while it watches (``started``), of each
call once every rank it went to answered or failed (``finished``), and of every death of
one of its ranks (``died``). A group with no observer pays nothing: its sender checks an
empty tuple. A watched call's sender puts a :class:`CallWatch` in the ranks' pending
tables in place of the call's future: it implements the future's completion side
(:class:`~phalanx.controller.futures.Completion`), stamps each rank's answer with the
time it arrived and its size, and hands everything on to the future unchanged.

Every time here is the controller's wall clock (``time.time()``), which the ranks' own
spans are comparable with (:mod:`phalanx.rank.tracing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from phalanx.controller.futures import Completion
    from phalanx.controller.ranks import RankEntry

clock = time.time

# Observers of every group, those made later too (a dashboard's); a group takes them on as
# it is made.
EVERY_GROUP: list[Observer] = []


def nbytes(segments: Sequence[Any]) -> int:
    """The size of a payload's segments (a pickle and its buffers, or the pickle alone:
    bytes), in bytes."""
    if type(segments) is bytes:
        return len(segments)
    if isinstance(segments, memoryview):  # a large pickle alone
        return segments.nbytes
    if len(segments) == 1 and type(segments[0]) is bytes:  # the usual: one small pickle
        return len(segments[0])
    total = 0
    for segment in segments:
        total += segment.nbytes if type(segment) is memoryview else len(segment)
    return total


class Observer(Protocol):
    """What watches a group's calls (a trace, a dashboard's metrics)."""

    def started(self, call: CallWatch) -> None:
        """``call`` was sent, or will be at its future's first wait (``call.sent`` tells)."""

    def finished(self, call: CallWatch) -> None:
        """Every rank ``call`` went to answered or failed."""

    def died(self, group: str, entry: RankEntry) -> None:
        """A rank of ``group`` died (``entry.failure`` says how)."""


class _Done:
    """What a finished watch hands on to: nothing is left to complete."""

    method = ""
    tolerant = True

    def resolve_rank(self, rank: int, segments: Sequence[Any]) -> None:
        pass

    def fail_rank(self, rank: int, error: BaseException) -> None:
        pass

    def yield_rank(self, rank: int, segments: list[Any]) -> None:
        pass

    def late_ranks(self) -> list[int]:
        return []

    def cancelled(self) -> bool:
        return False

    def __len__(self) -> int:
        return 0


_DONE = _Done()


class CallWatch:
    """One watched call: when it was made, sent, and answered by each rank.

    Read freely (observers do, from any thread): ``group``, ``call_id``, ``method`` (as the
    user named it), ``ranks``, ``queued`` (when the call was made), ``sent`` (when its
    frames went out; None until then), ``answered`` (rank -> when its answer arrived),
    ``errors`` (rank -> the text of its failure), ``bytes_in`` (the payload each rank was
    sent), ``bytes_out`` (every answer's size, streamed items included), ``items`` (items
    streamed back) and ``traced`` (its ranks record when they ran it).
    """

    __slots__ = ("_future", "_observers", "_remaining", "answered", "bytes_in", "bytes_out",
                 "call_id", "errors", "group", "items", "method", "queued", "ranks", "sent",
                 "tolerant", "traced")

    def __init__(self, future: Completion, group: str, call_id: int, ranks: list[int],
                 bytes_in: int, observers: tuple[Observer, ...], traced: bool) -> None:
        self._future = future
        self._observers = observers
        self._remaining = len(ranks)
        self.group = group
        self.call_id = call_id
        self.method = future.method
        self.tolerant = future.tolerant
        self.ranks = ranks
        self.queued = clock()
        self.sent: float | None = None
        self.answered: dict[int, float] = {}
        self.errors: dict[int, str] = {}
        self.bytes_in = bytes_in
        self.bytes_out = 0
        self.items = 0
        self.traced = traced
        for observer in observers:
            observer.started(self)

    def sending(self, send: Callable[[], None]) -> Callable[[], None]:
        """``send`` (the call's sends), stamping when they run."""
        def stamped() -> None:
            self.sent = clock()
            send()
        return stamped

    @property
    def done(self) -> bool:
        return self._remaining == 0

    # -- the completion side, handed on to the future ------------------------------------

    def resolve_rank(self, rank: int, segments: Sequence[Any]) -> None:
        future = self._future
        if rank in self.answered:  # late news of a rank already counted: handed on only
            future.resolve_rank(rank, segments)
            return
        self.bytes_out += nbytes(segments)
        last = self._answer(rank)
        future.resolve_rank(rank, segments)
        if last:
            self._finish()

    def fail_rank(self, rank: int, error: BaseException) -> None:
        future = self._future
        if rank in self.answered:
            future.fail_rank(rank, error)
            return
        self.errors[rank] = f"{type(error).__name__}: {error}"
        last = self._answer(rank)
        future.fail_rank(rank, error)
        if last:
            self._finish()

    def yield_rank(self, rank: int, segments: list[Any]) -> None:
        self.items += 1
        self.bytes_out += nbytes(segments)
        self._future.yield_rank(rank, segments)

    def late_ranks(self) -> list[int]:
        return self._future.late_ranks()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def __len__(self) -> int:
        return len(self._future)

    def _answer(self, rank: int) -> bool:
        """Stamp ``rank``'s first answer (or failure); True when it was the call's last."""
        self.answered[rank] = clock()
        self._remaining -= 1
        return self._remaining == 0

    def _finish(self) -> None:
        """Every rank is done (and the future told): tell the observers, and let go of the
        future (an observer may keep the watch: not the call's results)."""
        self._future = _DONE
        observers, self._observers = self._observers, ()
        for observer in observers:
            observer.finished(self)

    def __repr__(self) -> str:
        return f"<CallWatch {self.group} {self.method}() call {self.call_id}>"
