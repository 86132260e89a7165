"""Calls that follow a group's mesh: ``call_sharded``, data-parallel leaders, the mesh.

Mixed into :class:`~phalanx.controller.group.WorkerGroup`; the rules themselves are the pure
functions of :mod:`phalanx.world.sharding`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.futures import ShardedFuture
from phalanx.world import sharding as sh

if TYPE_CHECKING:
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import GroupFuture
    from phalanx.world.sharding import NamedSharding, ShardedPlan


def merge_common_kwargs(
    common_kwargs: Mapping[str, Any] | None, per_rank: Mapping[str, Any]
) -> dict[str, Any]:
    if not common_kwargs:
        return {}
    common = dict(common_kwargs or {})
    clash = sorted(set(common) & set(per_rank))
    if clash:
        raise ValueError(f"keywords {clash} are given both per rank and in common_kwargs")
    return common


def map_payloads(
    encode: Callable[..., list[Any]],
    ranks: list[int],
    arg_lists: tuple[Sequence[Any], ...],
    common_kwargs: Mapping[str, Any] | None,
    kwarg_lists: dict[str, Sequence[Any]],
) -> list[list[Any]]:
    """``map()``'s payload for each of ``ranks``: item i of every list (checked to hold
    one item per rank), with the common keywords."""
    common = merge_common_kwargs(common_kwargs, kwarg_lists)
    n = len(ranks)
    named = [(f"argument {i}", v) for i, v in enumerate(arg_lists)]
    named += [(f"keyword {k!r}", v) for k, v in kwarg_lists.items()]
    for label, values in named:
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"map(): {label} must be a list with one item per rank, "
                            f"got {type(values).__name__}")
        if len(values) != n:
            raise ValueError(
                f"map(): {label} has {len(values)} items but {n} ranks are selected"
            )
    return [
        encode(
            tuple(a[i] for a in arg_lists),
            {**{k: v[i] for k, v in kwarg_lists.items()}, **common},
            ranks[i],
        )
        for i in range(n)
    ]


def _take(value: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        value = value[i]
    return value


def _names(axes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(axes, str):
        raise TypeError(f"axes must be a list of axis names, got the string {axes!r}")
    return tuple(axes)


class MeshCalls:
    """The mesh-aware part of a worker group's API."""

    _sharding: NamedSharding | None
    _dp_leaders: list[int]
    _plans: dict[tuple, tuple[ShardedPlan, list[int]]]  # call_sharded plans by options
    _dispatcher: Dispatcher
    _deaths_seen: int

    # Provided by WorkerGroup.
    def _check_open(self) -> None: ...
    def _check_method(self, method: str) -> None: ...
    def _live_ranks(self, workers: Any) -> list[int]: ...
    def _encode(self, args: tuple, kwargs: dict, rank: int | None = None) -> list[Any]: ...
    def _send(
        self, method: str, ranks: list[int], payloads: list[list[Any]], *, defer: bool = False
    ) -> GroupFuture: ...

    @property
    def sharding(self) -> NamedSharding | None:
        """The group's mesh (``mesh=`` at construction), or None."""
        return self._sharding

    def _require_mesh(self, what: str) -> NamedSharding:
        if self._sharding is None:
            raise ValueError(f"{what} needs a group created with mesh=... (this one has none)")
        return self._sharding

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (every rank is one without a mesh)."""
        return len(self._dp_leaders)

    def dp_leader(self, shard: int) -> int:
        """The rank that leads data-parallel replica ``shard``."""
        if not isinstance(shard, int) or not 0 <= shard < len(self._dp_leaders):
            raise IndexError(f"dp shard {shard!r} is out of range 0..{self.dp_size - 1}")
        return self._dp_leaders[shard]

    def call_sharded(
        self,
        method: str,
        *args: Any,
        in_sharded_axes: Sequence[str] = (),
        replicate_on_axes: Sequence[str] = (),
        output_is_replicated: Sequence[str] = (),
        dummy_calls_to_free_axes: bool = False,
        common_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ShardedFuture:
        """Send each rank its slice of nested-list data (NeMo-RL's sharded-data rules; see
        :mod:`phalanx.world.sharding`); the future's result holds one value per kept rank."""
        self._check_open()
        mesh = self._require_mesh("call_sharded")
        self._check_method(method)
        options = (
            _names(in_sharded_axes), _names(replicate_on_axes), _names(output_is_replicated),
            bool(dummy_calls_to_free_axes),
        )
        cached = self._plans.get(options)
        if cached is None:  # plans depend only on the mesh and the options: keep them
            plan = sh.plan_sharded_call(mesh, *options)
            position = {rank: i for i, rank in enumerate(plan.called_ranks)}
            cached = (plan, [position[r] for r in plan.result_ranks])
            if len(self._plans) < 64:
                self._plans[options] = cached
        plan, keep = cached
        axes, sizes = plan.sharded_axes, plan.sharded_sizes
        for i, value in enumerate(args):
            sh.check_nested(value, axes, sizes, f"argument {i}")
        for key, value in kwargs.items():
            sh.check_nested(value, axes, sizes, f"keyword {key!r}")
        common = merge_common_kwargs(common_kwargs, kwargs)
        ranks = plan.called_ranks
        if self._dispatcher.deaths != self._deaths_seen:  # some rank may be dead: check
            ranks = self._live_ranks(ranks)
        paths = plan.paths
        encoded: dict[Any, list[Any]] = {}  # one pickle per distinct slice
        payloads = []
        for rank in ranks:
            path = paths[rank]
            payload = encoded.get(path)
            if payload is None:
                if path is None:  # a dummy call: None for every data argument
                    sliced_args: tuple = (None,) * len(args)
                    sliced_kwargs = dict.fromkeys(kwargs)
                else:
                    sliced_args = tuple([_take(v, path) for v in args]) if args else ()
                    sliced_kwargs = {k: _take(v, path) for k, v in kwargs.items()}
                if common:
                    sliced_kwargs.update(common)
                payload = encoded[path] = self._encode(sliced_args, sliced_kwargs, rank)
            payloads.append(payload)
        future = self._send(method, ranks, payloads)
        return ShardedFuture(future, plan.result_ranks, keep)

