"""A running group's nodes changing under it: membership events, and ``resize()``.

A backend whose nodes can change while a group runs (the cluster backend: agents lost, or
joining and leaving a DNS name) tells the group of each change as a
:class:`~phalanx.errors.MembershipEvent`, before the ranks of a removed node are reported
dead. The group then

- fails every running call with :class:`~phalanx.errors.MembershipChanged`, except those
  made with ``workers="ready"`` or ``"any"``, which carry on with the ranks still there
  (a rank of a removed node fails them only if they were waiting on it);
- hands the event to every ``on_membership_change`` callback, on a thread of its own, in
  order;
- admits the nodes added since, and drops those removed, at the next :meth:`resize` (or
  ``restart()``), which starts every rank again on the nodes there are then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.errors import MembershipChanged, MembershipEvent, PhalanxError, ProcessFailure
from phalanx.options import check_seconds
from phalanx.world.frameworks import check_layout
from phalanx.world.layout import Layout

if TYPE_CHECKING:
    from phalanx.backends import Backend
    from phalanx.controller.dispatch import Dispatcher, Slot

logger = logging.getLogger(__name__)


class Membership:
    """Mixin of :class:`~phalanx.controller.group.WorkerGroup`: following the backend's nodes."""

    _backend: Backend
    _dispatcher: Dispatcher
    _slots: list[Slot | None]
    _layout: Layout
    _placement: Any
    _sharding: Any
    _closed: bool
    _check_open: Callable[[], None]
    _retire: Callable[..., None]
    _reserve: Callable[[], None]
    _start_ranks: Callable[..., None]

    def _follow_membership(self) -> None:
        """Listen to the backend's membership changes (before it opens)."""
        self._membership_callbacks: list[Callable[[MembershipEvent], Any]] = []
        self._membership_queue: queue.SimpleQueue[MembershipEvent | None] | None = None
        self._membership_changed = False
        self._backend.on_membership = self._membership_event

    def on_membership_change(self, callback: Callable[[MembershipEvent], Any]) -> None:
        """Call ``callback(event)`` for every change of the group's nodes from now on: a
        :class:`~phalanx.errors.MembershipEvent` naming the nodes ``added`` (admitted by
        :meth:`resize`) and ``removed`` (with the ranks they ran). Callbacks run in order
        on a thread of the group's, never on the caller's; one that raises is logged."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._check_open()
        self._membership_callbacks.append(callback)
        if self._membership_queue is None:
            self._membership_queue = queue.SimpleQueue()
            threading.Thread(target=self._notify, args=(self._membership_queue,),
                             daemon=True, name="phalanx-membership").start()

    def _membership_event(self, event: MembershipEvent) -> None:
        """From the backend (any thread): fail the running calls, then tell subscribers."""
        if self._closed:
            return
        self._membership_changed = True
        self._dispatcher.call_soon(lambda: self._fail_running(event))
        if self._membership_queue is not None:
            self._membership_queue.put(event)

    def _fail_running(self, event: MembershipEvent) -> None:
        """The dispatcher's thread: every running call not made on "ready" or "any"
        fails; then the ranks of removed nodes are dead (the account of how their
        processes ended, if one comes, is added then)."""
        for slot in self._slots:
            if slot is None or not slot.pending:
                continue
            for call_id, future in list(slot.pending.items()):
                if not future.tolerant:
                    del slot.pending[call_id]
                    future._fail_rank(slot.rank, MembershipChanged(
                        event.added, event.removed, future.method, event.reason))
        for node in event.removed:
            for rank in node.ranks:
                slot = self._slots[rank] if rank < len(self._slots) else None
                if slot is not None and slot.alive and slot.node == node.node:
                    self._dispatcher.bury(slot, ProcessFailure(
                        rank, slot.node, slot.pid, None,
                        reason=f"its node left the group: {node}: {event.reason}"))

    def _notify(self, events: queue.SimpleQueue[MembershipEvent | None]) -> None:
        while True:
            event = events.get()
            if event is None:
                return
            for callback in list(self._membership_callbacks):
                try:
                    callback(event)
                except Exception:
                    logger.exception("the membership callback %r failed", callback)

    def _stop_membership(self) -> None:
        self._backend.on_membership = None
        if self._membership_queue is not None:
            self._membership_queue.put(None)

    def resize(self, timeout: float | None = None) -> int:
        """Take in the nodes added since the group started (or last resized) and drop those
        removed, then start every rank again on them (each node keeps ``procs_per_node``
        ranks; pending calls fail). Returns the new world size; ranks must be ready within
        ``timeout`` (default: the group's ``start_timeout``). With nothing changed it does
        nothing. Backends whose nodes cannot change (local, Ray) never change it."""
        self._check_open()
        timeout = check_seconds(timeout, allow_zero=False)
        nodes = self._backend.available_nodes()
        if nodes is None or (not self._membership_changed and nodes == self._layout.nodes):
            return self._layout.world_size
        self._relayout(nodes, timeout)
        return self._layout.world_size

    def _relayout(self, nodes: int, timeout: float | None) -> None:
        """Stop every rank, then start the layout for ``nodes`` nodes."""
        if nodes < 1:
            raise PhalanxError("resize(): no node is left to run the group on")
        counts = self._layout.counts
        if len(set(counts)) > 1 and nodes != len(counts):
            raise ValueError(f"cannot resize the uneven layout procs_per_node={list(counts)} "
                             f"to {nodes} nodes")
        layout = Layout.of([counts[0]] * nodes)
        if self._sharding is not None and layout.world_size != self._layout.world_size:
            raise ValueError(f"the group's mesh has {self._layout.world_size} ranks; it "
                             f"cannot resize to {layout.world_size}")
        check_layout(self._placement.framework, layout)
        self._retire([s for s in self._slots if s is not None],
                     grace=config.DEFAULT_TERM_GRACE)
        self._membership_changed = False
        before = self._layout.world_size
        self._layout = layout
        self._resized(layout.world_size)
        self._reserve()
        self._start_ranks(list(range(layout.world_size)), timeout=timeout)
        logger.info("resized from %d to %d ranks on %d nodes", before, layout.world_size,
                    nodes)

    def _resized(self, world_size: int) -> None:
        """The bookkeeping that depends on the world's size."""
        self._slots = [None] * world_size
        self._all_ranks = list(range(world_size))
        self._dp_leaders = list(range(world_size))
        self._deaths_seen = -1
