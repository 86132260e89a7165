"""A slice of a group: ``group.slice(dp=1)``, a view with the group's call API restricted
to the ranks at some coordinates of its mesh (:class:`GroupSlice`).

A slice holds no machinery of its own. Its rank list and its mesh (with ``call_sharded``'s
plans, made once per call options as the group's are) are computed when it is made; every
call goes through the group's own :class:`~phalanx.controller.callpath.CallPath` with that
rank list as ``workers=``, so a slice costs no more per call than the group, and fails as
the group does (``GroupClosed`` once it is shut down, ``WorkerDied`` for a dead rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.methods import MethodProxy

if TYPE_CHECKING:
    from phalanx.controller.callpath import CallPath
    from phalanx.controller.futures import GroupFuture, ShardedFuture, StreamFuture
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.meshcalls import Mesh
    from phalanx.world.sharding import Coordinates, NamedSharding


class GroupSlice:
    """The ranks of ``group`` at some coordinates of its mesh (made by ``group.slice``).

    Ranks keep their group numbers: :attr:`ranks` lists them in order, :meth:`call_one`
    takes one of them, and :attr:`sharding` holds them on the axes the slice kept (an int
    coordinate removes its axis, a range or list keeps it, narrowed). ``call``,
    ``call_async``, ``map``, ``map_async``, ``call_one``, ``call_stream`` and
    ``call_sharded`` (over the kept axes) work as on the group; ``slice.train.call(...)``
    too. ``rank0_only_axes`` names axes of the slice.
    """

    def __init__(self, group: WorkerGroup, calls: CallPath, mesh: Mesh) -> None:
        calls.check_open()
        self._group = group
        self._calls = calls
        self._mesh = mesh
        self._sharding: NamedSharding = mesh.require("slice()")
        self._ranks: list[int] = self._sharding.ranks
        self._members = frozenset(self._ranks)
        # The whole mesh: the group's own selection, which a call on it takes the short way.
        whole = self._ranks == list(range(group.world_size))
        self._workers: str | list[int] = "all" if whole else self._ranks

    # -- what it holds ----------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        """The group's ranks in this slice, in order."""
        return list(self._ranks)

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    size = world_size

    @property
    def mesh(self) -> dict[str, int]:
        """The slice's axes and their sizes (``{}`` when every axis was given an int)."""
        return self._sharding.shape

    @property
    def sharding(self) -> NamedSharding:
        """The slice's axes, holding the group's ranks."""
        return self._sharding

    @property
    def group(self) -> WorkerGroup:
        return self._group

    def slice(self, **coords: Coordinates) -> GroupSlice:
        """A slice of this slice, by coordinates of its own axes."""
        return GroupSlice(self._group, self._calls, self._mesh.sliced(coords))

    # -- calls: the group's, on these ranks -------------------------------------------

    def _pick(self, rank0_only_axes: Sequence[str] | None) -> str | list[int]:
        if rank0_only_axes:
            return self._mesh.rank0_only(self._ranks, rank0_only_axes)
        return self._workers

    def call(self, method: str, *args: Any, timeout: float | None = None,
             rank0_only_axes: Sequence[str] | None = None, keep: bool = False,
             **kwargs: Any) -> list[Any]:
        """``group.call`` on the slice's ranks; results in rank order."""
        return self._calls.call(method, args, kwargs, workers=self._pick(rank0_only_axes),
                                timeout=timeout, keep=keep)

    def call_async(self, method: str, *args: Any,
                   rank0_only_axes: Sequence[str] | None = None, keep: bool = False,
                   **kwargs: Any) -> GroupFuture:
        """``group.call_async`` on the slice's ranks."""
        return self._calls.call_async(method, args, kwargs,
                                      workers=self._pick(rank0_only_axes), keep=keep)

    def call_one(self, rank: int, method: str, *args: Any, timeout: float | None = None,
                 keep: bool = False, **kwargs: Any) -> Any:
        """Call ``method`` on ``rank`` (a group rank of this slice) and return its value."""
        if rank not in self._members:
            raise ValueError(f"rank {rank!r} is not in this slice (its ranks are {self._ranks})")
        return self._calls.call(method, args, kwargs, workers=[rank], timeout=timeout,
                                keep=keep)[0]

    def map(self, method: str, *arg_lists: Sequence[Any], timeout: float | None = None,
            rank0_only_axes: Sequence[str] | None = None,
            common_kwargs: Mapping[str, Any] | None = None, keep: bool = False,
            **kwarg_lists: Sequence[Any]) -> list[Any]:
        """``group.map`` with one item per rank of the slice; results in rank order."""
        return self._calls.map(method, arg_lists, kwarg_lists,
                               workers=self._pick(rank0_only_axes), timeout=timeout,
                               common_kwargs=common_kwargs, keep=keep)

    def map_async(self, method: str, *arg_lists: Sequence[Any],
                  rank0_only_axes: Sequence[str] | None = None,
                  common_kwargs: Mapping[str, Any] | None = None, keep: bool = False,
                  **kwarg_lists: Sequence[Any]) -> GroupFuture:
        """``group.map_async`` with one item per rank of the slice."""
        return self._calls.map_async(method, arg_lists, kwarg_lists,
                                     workers=self._pick(rank0_only_axes),
                                     common_kwargs=common_kwargs, keep=keep)

    def call_stream(self, method: str, *args: Any, timeout: float | None = None,
                    **kwargs: Any) -> StreamFuture:
        """``group.call_stream`` on the slice's ranks: ``(rank, item)`` pairs."""
        return self._calls.call_stream(method, args, kwargs, workers=self._workers,
                                       timeout=timeout)

    def call_sharded(
        self,
        method: str,
        *args: Any,
        in_sharded_axes: Sequence[str] = (),
        replicate_on_axes: Sequence[str] = (),
        output_is_replicated: Sequence[str] = (),
        dummy_calls_to_free_axes: bool = False,
        common_kwargs: Mapping[str, Any] | None = None,
        keep: bool = False,
        **kwargs: Any,
    ) -> ShardedFuture:
        """``group.call_sharded`` over the slice's axes (data nested along those of
        ``in_sharded_axes``, which must be axes of the slice)."""
        return self._calls.call_sharded(
            self._mesh, method, args, kwargs, in_sharded_axes=in_sharded_axes,
            replicate_on_axes=replicate_on_axes, output_is_replicated=output_is_replicated,
            dummy_calls_to_free_axes=dummy_calls_to_free_axes, common_kwargs=common_kwargs,
            keep=keep)

    def __getattr__(self, name: str) -> MethodProxy:
        calls = self.__dict__.get("_calls")
        if calls is not None and not name.startswith("_") and name in calls.methods:
            return MethodProxy(self, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<GroupSlice of group {self._group.name} ranks={self._ranks} mesh={self.mesh}>"
