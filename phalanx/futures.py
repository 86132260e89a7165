"""Results of calls: one :class:`RankFuture` per rank, gathered by a :class:`GroupFuture`.

Futures hold no locks and no threads. They are completed by the group's dispatcher, and
waiting on one drives the dispatcher (see :mod:`phalanx.dispatch`): the thread that waits
does the receiving, which is what keeps a call's round trip close to a raw pipe's.

A group future *fails fast*: its first failing rank makes ``result()`` raise at once,
without waiting for the other ranks of that call.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from phalanx import wire
from phalanx.errors import CallTimeout, SerializationError

if TYPE_CHECKING:
    from phalanx.dispatch import Dispatcher

_PENDING, _OK, _FAILED = 0, 1, 2


class RankFuture:
    """The outcome of one call on one rank."""

    __slots__ = ("_dispatcher", "_error", "_parent", "_payload", "_state", "method", "rank")

    def __init__(
        self, rank: int, method: str, dispatcher: Dispatcher, parent: GroupFuture | None = None
    ) -> None:
        self.rank = rank
        self.method = method
        self._dispatcher = dispatcher
        self._state = _PENDING
        self._payload: Any = None
        self._error: BaseException | None = None
        self._parent = parent

    # -- completion (dispatcher side) -------------------------------------------------

    def _resolve(self, segments: list[Any]) -> None:
        if self._state:
            return
        self._payload = segments
        self._state = _OK
        if self._parent is not None:
            self._parent._rank_done(self)

    def _fail(self, error: BaseException) -> None:
        if self._state:
            return
        self._error = error
        self._state = _FAILED
        if self._parent is not None:
            self._parent._rank_done(self)

    # -- user side --------------------------------------------------------------------

    def done(self) -> bool:
        if not self._state:
            self._dispatcher.poll_now()
        return self._state != _PENDING

    def _wait(self, timeout: float | None) -> None:
        if not self._state and not self._dispatcher.wait(lambda: self._state != _PENDING, timeout):
            raise CallTimeout(self.method, timeout or 0.0, [self.rank])

    def result(self, timeout: float | None = None) -> Any:
        """The rank's return value; raises its error, or CallTimeout after ``timeout`` s."""
        if not self._state:
            self._wait(timeout)
        if self._state == _FAILED:
            raise self._error  # type: ignore[misc]
        return self._value()

    def _value(self) -> Any:
        payload = self._payload
        if type(payload) is list:  # still encoded: decode once
            try:
                payload = wire.loads(payload)
            except Exception as exc:
                raise SerializationError(
                    f"could not unpickle the result of {self.method}() from rank {self.rank}: "
                    f"{type(exc).__name__}: {exc}",
                    stage="unpickling the result",
                    rank=self.rank,
                ) from exc
            self._payload = _Decoded(payload)
            return payload
        return payload.value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<RankFuture rank={self.rank} {self.method}() {state}>"


class _Decoded:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class GroupFuture:
    """The outcome of one call on several ranks; results come back in rank order.

    ``result(timeout)`` returns the list of values or raises the first failure; iterating
    yields the per-rank futures as they complete; ``await future`` works in asyncio code.
    """

    def __init__(self, method: str, ranks: list[int], dispatcher: Dispatcher):
        self.method = method
        self._futures = [RankFuture(rank, method, dispatcher, self) for rank in ranks]
        self._dispatcher = dispatcher
        self._remaining = len(ranks)
        self._failed: RankFuture | None = None
        self._completed: list[RankFuture] = []
        self._cancelled = False
        # For synchronous calls the group defers the sends to the first wait (see
        # Dispatcher.wait); anything that looks at the future sends them first.
        self._kickoff: Callable[[], None] | None = None

    @property
    def ranks(self) -> list[int]:
        return [rf.rank for rf in self._futures]

    @property
    def futures(self) -> list[RankFuture]:
        """The per-rank futures, in rank order."""
        return list(self._futures)

    def _rank_done(self, rf: RankFuture) -> None:
        self._remaining -= 1
        self._completed.append(rf)
        if rf._state == _FAILED and self._failed is None:
            self._failed = rf

    def _settled(self) -> bool:
        return self._remaining == 0 or self._failed is not None or self._cancelled

    def _kick(self) -> None:
        kickoff, self._kickoff = self._kickoff, None
        if kickoff is not None:
            kickoff()

    def done(self) -> bool:
        """True once every rank answered, one failed, or the future was cancelled."""
        self._kick()
        if not self._settled():
            self._dispatcher.poll_now()
        return self._settled()

    def _wait(self, timeout: float | None) -> None:
        kickoff, self._kickoff = self._kickoff, None
        if kickoff is None and self._settled():
            return
        if not self._dispatcher.wait(self._settled, timeout, kickoff):
            pending = [rf.rank for rf in self._futures if not rf._state]
            raise CallTimeout(self.method, timeout or 0.0, pending)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's value in rank order; raises the first failure at once."""
        self._wait(timeout)
        if self._cancelled:
            raise concurrent.futures.CancelledError(f"{self.method}() was cancelled")
        if self._failed is not None:
            raise self._failed._error  # type: ignore[misc]
        return [rf._value() for rf in self._futures]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The first failure, or None once every rank succeeded."""
        self._wait(timeout)
        if self._cancelled:
            raise concurrent.futures.CancelledError(f"{self.method}() was cancelled")
        return None if self._failed is None else self._failed._error

    def cancel(self) -> bool:
        """Stop waiting for this call: later results are discarded.

        Workers that already started the call finish it (a running Python frame cannot be
        interrupted safely). Returns False if the call had already completed.
        """
        self._kick()
        if self._remaining == 0 or self._failed is not None:
            return False
        self._cancelled = True
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def __iter__(self) -> Iterator[RankFuture]:
        """Per-rank futures in completion order (waiting as needed), including failed ones."""
        self._kick()
        completed = self._completed
        for index in range(len(self._futures)):
            if index >= len(completed):
                self._dispatcher.wait(lambda n=index: len(completed) > n, None)
            yield completed[index]

    def __await__(self) -> Generator[Any, None, list[Any]]:
        import asyncio

        self._kick()
        loop = asyncio.get_running_loop()
        return (yield from loop.run_in_executor(None, self.result).__await__())

    def __len__(self) -> int:
        return len(self._futures)

    def __repr__(self) -> str:
        state = "done" if self._settled() else f"{self._remaining} pending"
        return f"<GroupFuture {self.method}() ranks={self.ranks} {state}>"
