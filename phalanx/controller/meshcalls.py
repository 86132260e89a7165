"""Calls that follow a group's mesh: the :class:`Mesh` part (the mesh, data-parallel
leaders, ``call_sharded``'s plans and slices) and ``map()``'s payloads.

The rules themselves are the pure functions of :mod:`phalanx.world.sharding`; this module
applies them to a group's calls. A plan depends only on the mesh and the call's options,
so each is made once and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from phalanx.world.layout import Layout
    from phalanx.world.sharding import Coordinates, NamedSharding, ShardedPlan

# phalanx.world.sharding (and numpy with it) is imported by the methods that need a mesh,
# never with this module: a group without one, the usual kind, does not pay for numpy.


P = TypeVar("P")  # a payload, as the group's encoder makes it


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
    encode: Callable[..., P],
    ranks: list[int],
    arg_lists: tuple[Sequence[Any], ...],
    common_kwargs: Mapping[str, Any] | None,
    kwarg_lists: Mapping[str, Sequence[Any]],
) -> list[P]:
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


def _describe(layout: Layout) -> str:
    counts = layout.counts
    per_node = counts[0] if len(set(counts)) == 1 else list(counts)
    return f"of {layout.nodes} node(s) x {per_node} rank(s)"


def _names(axes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(axes, str):
        raise TypeError(f"axes must be a list of axis names, got the string {axes!r}")
    return tuple(axes)


class Mesh:
    """A group's mesh (``mesh=``; None: every rank is its own data-parallel replica).

    Interface: :attr:`sharding`, :attr:`dp_axis`, :attr:`dp_size`, :meth:`dp_leader`,
    :meth:`require`, :meth:`rank0_only`, :meth:`plan` and :meth:`payloads` for ``call_sharded``,
    :meth:`sliced` for a slice's mesh, and :meth:`resized` when a resize changes the
    world's size (only without a mesh).

    Checked at construction, before anything starts: ``tied_axes`` (ranks differing only
    along them must share a node of ``layout``) and ``dp_leaders`` (one rank per
    data-parallel replica, each of its replica; default: coordinate 0 on every other axis).
    """

    def __init__(self, mesh: NamedSharding | Mapping[str, int] | None, dp_axis: str,
                 world_size: int, *, layout: Layout | None = None,
                 tied_axes: Sequence[str] | None = None,
                 dp_leaders: Sequence[int] | None = None) -> None:
        self.sharding: NamedSharding | None = None
        self._dp_axis = dp_axis
        self._dp_leaders = list(range(world_size))
        self._plans: dict[tuple[Any, ...], tuple[ShardedPlan, list[int]]] = {}  # by call options
        if mesh is None:
            if tied_axes or isinstance(tied_axes, str):
                self.require("tied_axes")
            if dp_leaders is not None:
                self.require("dp_leaders")
            return
        from phalanx.world import sharding as sh

        self.sharding = sharding = sh.sharding_for(mesh, world_size)
        if tied_axes is not None:
            sh.tied_groups(sharding, tied_axes)  # the axes' names, even with no layout
            if layout is not None:
                sh.check_tied(sharding, tied_axes, layout.node_of, _describe(layout))
        if dp_leaders is None:
            self._dp_leaders = sh.dp_leaders(sharding, dp_axis)
        else:
            self._dp_leaders = sh.check_dp_leaders(sharding, dp_axis, dp_leaders)

    def sliced(self, coords: Mapping[str, Coordinates]) -> Mesh:
        """The mesh of the ranks at ``coords`` (see :func:`~phalanx.world.sharding.slice_sharding`),
        with plans of its own; its data-parallel leaders follow the default rule."""
        from phalanx.world import sharding as sh

        sub = sh.slice_sharding(self.require("slice()"), coords)
        part = Mesh(None, self._dp_axis, 0)
        part.sharding = sub
        part._dp_leaders = sh.dp_leaders(sub, self._dp_axis)
        return part

    def resized(self, world_size: int) -> None:
        """The world has ``world_size`` ranks now (a mesh keeps its size)."""
        if self.sharding is None:
            self._dp_leaders = list(range(world_size))

    def require(self, what: str) -> NamedSharding:
        """The mesh, or ValueError saying that ``what`` needs one."""
        if self.sharding is None:
            raise ValueError(f"{what} needs a group created with mesh=... (this one has none)")
        return self.sharding

    @property
    def dp_axis(self) -> str:
        """The name of the data-parallel axis (``dp_axis=``)."""
        return self._dp_axis

    @property
    def dp_size(self) -> int:
        return len(self._dp_leaders)

    def dp_leader(self, shard: int) -> int:
        if not isinstance(shard, int) or not 0 <= shard < len(self._dp_leaders):
            raise IndexError(f"dp shard {shard!r} is out of range 0..{self.dp_size - 1}")
        return self._dp_leaders[shard]

    def rank0_only(self, ranks: list[int], axes: Sequence[str]) -> list[int]:
        """``ranks`` less those not at coordinate 0 on ``axes``."""
        from phalanx.world import sharding as sh

        return sh.rank0_only(self.require("rank0_only_axes"), ranks, axes)

    def plan(
        self,
        in_sharded_axes: Sequence[str],
        replicate_on_axes: Sequence[str],
        output_is_replicated: Sequence[str],
        dummy_calls_to_free_axes: bool,
    ) -> tuple[ShardedPlan, list[int]]:
        """``call_sharded``'s plan for these options, and the positions of its result
        ranks among its called ranks."""
        mesh = self.require("call_sharded")
        options = (
            _names(in_sharded_axes), _names(replicate_on_axes), _names(output_is_replicated),
            bool(dummy_calls_to_free_axes),
        )
        cached = self._plans.get(options)
        if cached is None:  # plans depend only on the mesh and the options: keep them
            from phalanx.world import sharding as sh

            plan = sh.plan_sharded_call(mesh, *options)
            position = {rank: i for i, rank in enumerate(plan.called_ranks)}
            cached = (plan, [position[r] for r in plan.result_ranks])
            if len(self._plans) < 64:
                self._plans[options] = cached
        return cached

    @staticmethod
    def payloads(
        plan: ShardedPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        common_kwargs: Mapping[str, Any] | None,
        live: Callable[[list[int]], list[int]],
        encode: Callable[..., P],
    ) -> tuple[list[int], list[P]]:
        """The ranks ``plan`` calls (``live`` checks they are alive) and each one's payload:
        its slice of every argument (checked against the plan's sharded axes) and the
        common keywords, one pickle per distinct slice."""
        from phalanx.world import sharding as sh

        axes, sizes = plan.sharded_axes, plan.sharded_sizes
        for i, value in enumerate(args):
            sh.check_nested(value, axes, sizes, f"argument {i}")
        for key, value in kwargs.items():
            sh.check_nested(value, axes, sizes, f"keyword {key!r}")
        common = merge_common_kwargs(common_kwargs, kwargs)
        ranks = live(plan.called_ranks)
        paths = plan.paths
        encoded: dict[Any, P] = {}  # one pickle per distinct slice
        payloads = []
        for rank in ranks:
            path = paths[rank]
            payload = encoded.get(path)
            if payload is None:
                if path is None:  # a dummy call: None for every data argument
                    sliced_args: tuple[Any, ...] = (None,) * len(args)
                    sliced_kwargs = dict.fromkeys(kwargs)
                else:
                    sliced_args = tuple([_take(v, path) for v in args]) if args else ()
                    sliced_kwargs = {k: _take(v, path) for k, v in kwargs.items()}
                if common:
                    sliced_kwargs.update(common)
                payload = encoded[path] = encode(sliced_args, sliced_kwargs, rank)
            payloads.append(payload)
        return ranks, payloads
