"""Attribute-style calls: ``group.train.call(batch)`` reads as ``group.call("train", batch)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.controller.futures import GroupFuture
    from phalanx.controller.group import WorkerGroup


class MethodProxy:
    """``group.train.call(batch)`` reads as ``group.call("train", batch)``."""

    def __init__(self, group: WorkerGroup, method: str) -> None:
        self._group = group
        self._method = method

    def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._group.call(self._method, *args, **kwargs)

    def call_async(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._group.call_async(self._method, *args, **kwargs)

    def map(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._group.map(self._method, *args, **kwargs)

    def map_async(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._group.map_async(self._method, *args, **kwargs)

    def call_one(self, rank: int, *args: Any, **kwargs: Any) -> Any:
        return self._group.call_one(rank, self._method, *args, **kwargs)
