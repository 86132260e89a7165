"""The worker object's methods, as the ranks report them, and attribute-style calls:
``group.train.call(batch)`` reads as ``group.call("train", batch)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.controller.futures import GroupFuture
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.slices import GroupSlice


class MethodNames:
    """The public methods of a group's worker object, learnt from its first ready rank.

    Interface: :meth:`learn` (at start-up), :meth:`check` (before every call), ``name in
    methods`` and :meth:`names`.
    """

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name  # what the messages call the worker object
        self._names: list[str] | None = None
        self._set: frozenset[str] = frozenset()

    def learn(self, names: list[str]) -> None:
        """The methods a ready rank reported (only the first report counts)."""
        if self._names is None:
            self._names = list(names)
            self._set = frozenset(names)

    def names(self) -> list[str]:
        """Every method's name (none before a rank was ready)."""
        return list(self._names or [])

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def check(self, method: str) -> None:
        """TypeError unless ``method`` is a name; AttributeError, naming the methods there
        are, if the worker object has no such public method. Private names pass (the
        worker answers for them)."""
        if method in self._set:
            return
        if not isinstance(method, str):
            raise TypeError(f"method must be a name (str), got {method!r}")
        if self._names is not None and not method.startswith("_"):
            raise AttributeError(
                f"{self.target_name} has no method {method!r}; "
                f"available: {', '.join(self._names) or 'none'}"
            )


class MethodProxy:
    """``group.train.call(batch)`` reads as ``group.call("train", batch)``."""

    def __init__(self, group: WorkerGroup | GroupSlice, method: str) -> None:
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
