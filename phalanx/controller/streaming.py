"""Streaming results: a worker method that is a generator (sync or async) sends each item
as it is produced; ``call_stream`` iterates ``(rank, item)`` pairs as they arrive.

Errors and deaths behave as for any call: the first failing rank raises from the iterator
at once (fail fast), a dead rank raises :class:`~phalanx.errors.WorkerDied`.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from phalanx.controller.futures import _PENDING, GroupFuture
from phalanx.errors import CallTimeout, SerializationError

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.world.selection import Workers


class StreamFuture(GroupFuture):
    """A streamed call: iterate it for ``(rank, item)`` pairs in arrival order.

    ``timeout`` (given to ``call_stream``) bounds the wait for each next item.
    ``result()`` drains the stream and returns every rank's items, in rank order.
    """

    __slots__ = ("_items", "timeout")

    def __init__(self, method: str, ranks: list[int], dispatcher: Dispatcher) -> None:
        super().__init__(method, ranks, dispatcher)
        self._items: collections.deque = collections.deque()
        self.timeout: float | None = None

    def _yield_rank(self, rank: int, segments: list[Any]) -> None:
        if not self._cancelled:
            self._items.append((rank, segments))

    def _has_news(self) -> bool:
        return bool(self._items) or self._remaining == 0 or self._failed >= 0

    def __iter__(self) -> Iterator[tuple[int, Any]]:  # type: ignore[override]
        self._kick()
        while True:
            if self._items:
                rank, segments = self._items.popleft()
                yield rank, _decode(segments, self.method, rank)
                continue
            if self._failed >= 0:
                raise self._errors[self._failed]  # type: ignore[index]
            if self._remaining == 0 or self._cancelled:
                return
            if not self._dispatcher.wait(self._has_news, self.timeout):
                values = zip(self._ranks, self._values, strict=True)
                pending = [rank for rank, value in values if value is _PENDING]
                raise CallTimeout(self.method, self.timeout or 0.0, pending)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's streamed items (a list per rank, in rank order)."""
        if timeout is not None:
            self.timeout = timeout
        items: dict[int, list[Any]] = {rank: [] for rank in self._ranks}
        for rank, item in self:
            items[rank].append(item)
        return [items[rank] for rank in self._ranks]


def _decode(segments: list[Any], method: str, rank: int) -> Any:
    try:
        return pickle.loads(segments[0], buffers=segments[1:])
    except Exception as exc:
        raise SerializationError(
            f"could not unpickle an item streamed by {method}() on rank {rank}: "
            f"{type(exc).__name__}: {exc}",
            stage="unpickling a streamed item",
            rank=rank,
        ) from exc


class StreamCalls:
    """The streaming part of a worker group's API (mixed into WorkerGroup)."""

    def _check_method(self, method: str) -> None: ...
    def _live_ranks(self, workers: Any) -> list[int]: ...
    def _encode(self, args: tuple, kwargs: dict, rank: int | None = None) -> list[Any]: ...
    def _send(self, *args: Any, **kwargs: Any) -> GroupFuture: ...

    def call_stream(
        self,
        method: str,
        *args: Any,
        workers: Workers = "all",
        timeout: float | None = None,
        **kwargs: Any,
    ) -> StreamFuture:
        """Call a generator method on the selected ranks and iterate ``(rank, item)`` pairs
        as they arrive. A method that is not a generator streams its value as one item.
        ``timeout`` bounds the wait for each next item (CallTimeout)."""
        self._check_method(method)
        ranks = self._live_ranks(workers)
        payload = self._encode(args, kwargs)
        future = self._send(method, ranks, [payload], stream=True, workers=workers)
        future.timeout = timeout  # type: ignore[attr-defined]
        return future  # type: ignore[return-value]
