"""The call forms' one path: ``call``, ``call_async``, ``map``, ``map_async``,
``call_stream`` and ``call_sharded`` on a selection of a group's ranks, with a frozen
options record (the :class:`CallPath` part; :mod:`.callforms` declares the forms users
call, once, for a group, its slices and its options views).

A group and every slice or view of it call through the same part, each with its
:class:`~phalanx.controller.callforms.Scope`: the group with its whole mesh and the
options' ``workers=``, a slice with its own ranks and the narrowed mesh of its coordinates.
Checks run in the order that keeps the error a user sees the most useful one, and all
before anything is sent: the group open, the method known, the selection, then the
arguments (their pickles, a ``map()`` list's length, a sharded argument's shape).

The path holds the bound methods of the parts a call goes through (the gate's check, the
method check, the rank table's selection, the sender's encode and send), so a call costs
no more hops than when they were the group's own; the first two run only where a read of
the gate's ``shut`` and the known method names says the call will fail.

A loop of ``call_async(method, workers=[rank])`` (the pipelined call) goes by a
:class:`Route`: its ranks, checked once, are used again while no rank died and none was
placed since (the dispatcher's and the rank table's change counters), and the gate is open.
Anything else takes the whole path, which makes the route current again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.controller.futures import ShardedFuture
from phalanx.controller.meshcalls import Mesh, map_payloads

if TYPE_CHECKING:
    from phalanx.controller.callforms import Scope
    from phalanx.controller.calls import Sender
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import GroupFuture, StreamFuture
    from phalanx.controller.methods import MethodNames
    from phalanx.controller.ranks import RankTable
    from phalanx.controller.state import Gate
    from phalanx.world.calloptions import CallOptions
    from phalanx.world.selection import Workers


class Route:
    """One options record's ``call_async`` of one method, made again and again: the ranks
    it selected, with the deaths and table version they were checked at (``None`` until
    a call went the whole path). Made by :meth:`CallPath.route`, kept by the caller."""

    __slots__ = ("checked", "options")

    def __init__(self, options: CallOptions) -> None:
        self.options = options
        # (ranks, deaths, version): replaced whole, never changed in place (a thread that
        # reads it sees one selection and the counters it was made at)
        self.checked: tuple[list[int], int, int] | None = None


class CallPath:
    """One group's calls, on any selection of its ranks.

    Interface: :meth:`call`, :meth:`call_async`, :meth:`call_routed`, :meth:`route`,
    :meth:`map`, :meth:`map_async`, :meth:`call_stream`, :meth:`call_sharded` (each with
    the call's options and its scope), :meth:`check_open`, :attr:`methods`.
    """

    def __init__(self, gate: Gate, methods: MethodNames, table: RankTable,
                 sender: Sender, dispatcher: Dispatcher) -> None:
        self.methods = methods
        self._gate = gate
        self._table = table
        self._dispatcher = dispatcher
        self.check_open: Callable[[], None] = gate.check
        self._check_method: Callable[[str], None] = methods.check
        self._select_ranks: Callable[[Workers], list[int]] = table.select
        self._checked: Callable[[list[int]], list[int]] = table.checked
        self._encode = sender.encode
        self._send = sender.send
        self._send_plain = sender.send_plain

    def _select(self, method: str, options: CallOptions, scope: Scope,
                only: list[int] | None = None) -> tuple[list[int], Workers]:
        """The checks every form makes first (see the module docstring): the ranks to
        call, and the selection they came from."""
        if self._gate.shut:  # (each check a call only where it fails)
            self.check_open()
        if method not in self.methods.known:
            self._check_method(method)
        # (none of these is ever empty: a slice's ranks, a form's own, the options')
        workers = only or scope.workers or options.workers
        ranks = self._select_ranks(workers)
        if options.rank0_only_axes and only is None:
            ranks = scope.mesh.rank0_only(ranks, options.rank0_only_axes)
        return ranks, workers

    def call_async(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   options: CallOptions, scope: Scope) -> GroupFuture:
        """The same arguments (pickled once) to every selected rank."""
        ranks, workers = self._select(method, options, scope)
        payload = self._encode(args, kwargs)
        return self._send_plain(method, ranks, payload, workers, options.keep)

    @staticmethod
    def route(options: CallOptions, scope: Scope) -> Route | None:
        """A :class:`Route` for ``call_async`` with ``options`` on ``scope``: None unless
        its ranks are the options' list of ranks alone (not "ready" or "any", whose ranks
        change with more than deaths; not narrowed by ``rank0_only_axes`` or a slice)."""
        if (type(options.workers) is not tuple or options.rank0_only_axes
                or scope.workers is not None):
            return None
        return Route(options)

    def call_routed(self, route: Route, method: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any], scope: Scope) -> GroupFuture:
        """:meth:`call_async` with the route's options, by its checked ranks where no rank
        died or was placed since and the group is open (the checks' outcome is the same)."""
        options = route.options
        checked = route.checked
        if (checked is not None and not self._gate.shut
                and checked[1] == self._dispatcher.deaths
                and checked[2] == self._table.version):
            ranks = checked[0]
        else:  # the whole path's checks (its selection is the options' own: no slice)
            # the counters first: a rank that dies while it is selected makes it stale
            deaths, version = self._dispatcher.deaths, self._table.version
            ranks = self._select(method, options, scope)[0]
            if method in self.methods.known:  # (a name let through before any rank was
                route.checked = (ranks, deaths, version)  # ready: checked again next time)
        return self._send_plain(method, ranks, self._encode(args, kwargs), options.workers,
                                options.keep)

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             options: CallOptions, scope: Scope, only: list[int] | None = None) -> list[Any]:
        """:meth:`call_async`, waited for; ``only``: these ranks, not the options'
        selection (``call_one``)."""
        ranks, workers = self._select(method, options, scope, only)
        payload = self._encode(args, kwargs)
        return self._send_plain(method, ranks, payload, workers,
                                options.keep).result(options.timeout)

    def map_async(self, method: str, arg_lists: tuple[Sequence[Any], ...],
                  kwarg_lists: dict[str, Sequence[Any]], options: CallOptions,
                  scope: Scope) -> GroupFuture:
        """One item of each list per selected rank, in rank order."""
        ranks, workers = self._select(method, options, scope)
        payloads = map_payloads(self._encode, ranks, arg_lists, options.common_kwargs,
                                kwarg_lists)
        return self._send(method, ranks, payloads,  # type: ignore[no-any-return]
                          workers=workers, keep=options.keep)

    def map(self, method: str, arg_lists: tuple[Sequence[Any], ...],
            kwarg_lists: dict[str, Sequence[Any]], options: CallOptions,
            scope: Scope) -> list[Any]:
        return self.map_async(method, arg_lists, kwarg_lists, options,
                              scope).result(options.timeout)

    def call_stream(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    options: CallOptions, scope: Scope) -> StreamFuture:
        """A generator method on the selected ranks: ``(rank, item)`` pairs as they come;
        the options' ``timeout`` bounds the wait for each next item."""
        ranks, workers = self._select(method, options, scope)
        payload = self._encode(args, kwargs)
        return self._send(method, ranks, [payload], stream=True,  # type: ignore[no-any-return]
                          workers=workers, timeout=options.timeout)

    def call_sharded(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     options: CallOptions, scope: Scope) -> ShardedFuture:
        """Each called rank its slice of nested-list data over the scope's mesh (the
        group's, or a slice's); the future keeps one result per data shard."""
        self.check_open()
        mesh = scope.mesh
        mesh.require("call_sharded")
        self._check_method(method)
        plan, kept = mesh.plan(options.in_sharded_axes, options.replicate_on_axes,
                               options.output_is_replicated, options.dummy_calls_to_free_axes)
        ranks, payloads = Mesh.payloads(plan, args, kwargs, options.common_kwargs,
                                        self._checked, self._encode)
        future = self._send(method, ranks, payloads, keep=options.keep)
        return ShardedFuture(future, plan.result_ranks, kept)
