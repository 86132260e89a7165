"""The worker object's methods, as the ranks report them (with the names of their
parameters, which a call's option keywords must not clash with), and attribute-style
calls: ``group.train.call(batch)`` reads as ``group.call("train", batch)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.controller.callforms import CallForms
    from phalanx.controller.futures import GroupFuture, ShardedFuture, StreamFuture


class MethodNames:
    """The public methods of a group's worker object, learnt from its first ready rank.

    Interface: :meth:`learn` (at start-up), :meth:`check` (before every call), ``name in
    methods``, :meth:`names` and :meth:`parameters`.
    """

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name  # what the messages call the worker object
        self._names: list[str] | None = None
        # the names checked: a call tests ``method in known`` before :meth:`check`
        self.known: frozenset[str] = frozenset()
        self._parameters: Mapping[str, Sequence[str]] = {}

    def learn(self, methods: Mapping[str, Sequence[str]]) -> None:
        """The methods a ready rank reported, each with the names its parameters can be
        given by (only the first report counts)."""
        if self._names is None:
            self._names = list(methods)
            self.known = frozenset(methods)
            self._parameters = dict(methods)

    def parameters(self, method: str) -> Sequence[str] | None:
        """The names ``method``'s parameters can be passed by (None: not known)."""
        return self._parameters.get(method)

    def names(self) -> list[str]:
        """Every method's name (none before a rank was ready)."""
        return list(self._names or [])

    def __contains__(self, name: object) -> bool:
        return name in self.known

    def check(self, method: str) -> None:
        """TypeError unless ``method`` is a name; AttributeError, naming the methods there
        are, if the worker object has no such public method. Private names pass (the
        worker answers for them)."""
        if method in self.known:
            return
        if not isinstance(method, str):
            raise TypeError(f"method must be a name (str), got {method!r}")
        if self._names is not None and not method.startswith("_"):
            raise AttributeError(
                f"{self.target_name} has no method {method!r}; "
                f"available: {', '.join(self._names) or 'none'}"
            )


class MethodProxy:
    """``group.train.call(batch)`` reads as ``group.call("train", batch)``: each form of
    the group, slice or options view it came from, with the method named."""

    def __init__(self, forms: CallForms, method: str) -> None:
        self._forms = forms
        self._method = method

    def call(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._forms.call(self._method, *args, **kwargs)

    def call_async(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._forms.call_async(self._method, *args, **kwargs)

    def map(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._forms.map(self._method, *args, **kwargs)

    def map_async(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._forms.map_async(self._method, *args, **kwargs)

    def call_one(self, rank: int, *args: Any, **kwargs: Any) -> Any:
        return self._forms.call_one(rank, self._method, *args, **kwargs)

    def call_stream(self, *args: Any, **kwargs: Any) -> StreamFuture:
        return self._forms.call_stream(self._method, *args, **kwargs)

    def call_sharded(self, *args: Any, **kwargs: Any) -> ShardedFuture:
        return self._forms.call_sharded(self._method, *args, **kwargs)
