"""The call forms, once: ``call``, ``call_async``, ``map``, ``map_async``, ``call_stream``
and ``call_sharded`` on a selection of a group's ranks (the :class:`CallPath` part).

A :class:`~phalanx.controller.group.WorkerGroup` and every
:class:`~phalanx.controller.slices.GroupSlice` of it call through the same part: the
group with its whole mesh and the user's ``workers=``, a slice with its own ranks and the
narrowed mesh of its coordinates. Checks run in the order that keeps the error a user
sees the most useful one, and all before anything is sent: the group open, the method
known, the selection, then the arguments (their pickles, a ``map()`` list's length, a
sharded argument's shape).

The path holds the bound methods of the parts a call goes through (the gate's check, the
method check, the rank table's selection, the sender's encode and send), so a call costs
no more hops than when they were the group's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.futures import ShardedFuture
from phalanx.controller.meshcalls import Mesh, map_payloads
from phalanx.options import check_seconds

if TYPE_CHECKING:
    from phalanx.controller.calls import Sender
    from phalanx.controller.futures import GroupFuture, StreamFuture
    from phalanx.controller.lifecycle import Gate
    from phalanx.controller.methods import MethodNames
    from phalanx.controller.ranks import RankTable
    from phalanx.world.selection import Workers


class CallPath:
    """One group's calls, on any selection of its ranks.

    Interface: :meth:`call`, :meth:`call_async`, :meth:`map`, :meth:`map_async`,
    :meth:`call_stream`, :meth:`call_sharded` (each with ``workers`` and a ``mesh`` to
    read ``rank0_only_axes`` against), :meth:`check_open`, :attr:`methods`.
    """

    def __init__(self, gate: Gate, methods: MethodNames, table: RankTable, mesh: Mesh,
                 sender: Sender) -> None:
        self.methods = methods
        self.mesh = mesh  # the group's whole mesh
        self.check_open: Callable[[], None] = gate.check
        self._check_method: Callable[[str], None] = methods.check
        self._select_ranks: Callable[[Workers], list[int]] = table.select
        self._checked: Callable[[list[int]], list[int]] = table.checked
        self._encode = sender.encode
        self._send = sender.send

    def _select(self, workers: Workers, rank0_only_axes: Sequence[str] | None,
                mesh: Mesh | None) -> list[int]:
        self.check_open()
        ranks = self._select_ranks(workers)
        if rank0_only_axes:
            ranks = (mesh or self.mesh).rank0_only(ranks, rank0_only_axes)
        return ranks

    # The group passes its arguments by position: on the hot path, keywords cost ~0.1 us.

    def call_async(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   workers: Workers = "all", rank0_only_axes: Sequence[str] | None = None,
                   keep: bool = False, mesh: Mesh | None = None) -> GroupFuture:
        """The same arguments (pickled once) to every selected rank."""
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes, mesh)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], workers=workers, keep=keep)

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             workers: Workers = "all", timeout: float | None = None,
             rank0_only_axes: Sequence[str] | None = None, keep: bool = False,
             mesh: Mesh | None = None) -> list[Any]:
        """:meth:`call_async`, waited for; its sends made at the wait (see Sender.send)."""
        if timeout is not None:
            check_seconds(timeout)
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes, mesh)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], defer=True, workers=workers,
                          keep=keep).result(timeout)

    def map_async(self, method: str, arg_lists: tuple[Sequence[Any], ...],
                  kwarg_lists: dict[str, Sequence[Any]], *, workers: Workers = "all",
                  rank0_only_axes: Sequence[str] | None = None,
                  common_kwargs: Mapping[str, Any] | None = None, keep: bool = False,
                  mesh: Mesh | None = None, defer: bool = False) -> GroupFuture:
        """One item of each list per selected rank, in rank order."""
        self._check_method(method)
        ranks = self._select(workers, rank0_only_axes, mesh)
        payloads = map_payloads(self._encode, ranks, arg_lists, common_kwargs, kwarg_lists)
        return self._send(method, ranks, payloads, defer=defer, workers=workers, keep=keep)

    def map(self, method: str, arg_lists: tuple[Sequence[Any], ...],
            kwarg_lists: dict[str, Sequence[Any]], *, workers: Workers = "all",
            timeout: float | None = None, rank0_only_axes: Sequence[str] | None = None,
            common_kwargs: Mapping[str, Any] | None = None, keep: bool = False,
            mesh: Mesh | None = None) -> list[Any]:
        if timeout is not None:
            check_seconds(timeout)
        return self.map_async(method, arg_lists, kwarg_lists, workers=workers,
                              rank0_only_axes=rank0_only_axes, common_kwargs=common_kwargs,
                              keep=keep, mesh=mesh, defer=True).result(timeout)

    def call_stream(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    workers: Workers = "all", timeout: float | None = None
                    ) -> StreamFuture:
        """A generator method on the selected ranks: ``(rank, item)`` pairs as they come;
        ``timeout`` bounds the wait for each next item."""
        self._check_method(method)
        ranks = self._select(workers, None, None)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], stream=True, workers=workers,
                          timeout=timeout)

    def call_sharded(self, mesh: Mesh, method: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any], *, in_sharded_axes: Sequence[str],
                     replicate_on_axes: Sequence[str], output_is_replicated: Sequence[str],
                     dummy_calls_to_free_axes: bool,
                     common_kwargs: Mapping[str, Any] | None, keep: bool) -> ShardedFuture:
        """Each called rank its slice of nested-list data over ``mesh`` (the group's, or a
        slice's); the future keeps one result per data shard."""
        self.check_open()
        mesh.require("call_sharded")
        self._check_method(method)
        plan, kept = mesh.plan(in_sharded_axes, replicate_on_axes, output_is_replicated,
                               dummy_calls_to_free_axes)
        ranks, payloads = Mesh.payloads(plan, args, kwargs, common_kwargs, self._checked,
                                        self._encode)
        future = self._send(method, ranks, payloads, keep=keep)
        return ShardedFuture(future, plan.result_ranks, kept)
