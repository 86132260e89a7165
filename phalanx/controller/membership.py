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
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.meshcalls import Mesh
    from phalanx.controller.ranks import RankTable
    from phalanx.controller.startup import Starter
    from phalanx.controller.state import Gate

logger = logging.getLogger(__name__)


class Membership:
    """Following the backend's nodes for one group (see the module docstring).

    Interface: :meth:`on_change` (subscribe), :attr:`changed` (a change is waiting for a
    resize), :meth:`resize` and :meth:`relayout`, :meth:`stop`. It listens from its
    construction on, before the backend opens.
    """

    def __init__(self, *, backend: Backend, dispatcher: Dispatcher, table: RankTable,
                 starter: Starter, mesh: Mesh, gate: Gate) -> None:
        self._backend = backend
        self._dispatcher = dispatcher
        self._table = table
        self._starter = starter
        self._mesh = mesh
        self._gate = gate
        self._callbacks: list[Callable[[MembershipEvent], Any]] = []
        self._queue: queue.SimpleQueue[MembershipEvent | None] | None = None
        self._changed = False
        backend.on_membership = self._event

    @property
    def changed(self) -> bool:
        """Whether the nodes changed since the group started, or last resized."""
        return self._changed

    def on_change(self, callback: Callable[[MembershipEvent], Any]) -> None:
        """See :meth:`WorkerGroup.on_membership_change
        <phalanx.controller.group.WorkerGroup.on_membership_change>`."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._gate.check()
        self._callbacks.append(callback)
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._notify, args=(self._queue,),
                             daemon=True, name="phalanx-membership").start()

    def _event(self, event: MembershipEvent) -> None:
        """From the backend (any thread): fail the running calls, then tell subscribers."""
        if self._gate.closed:
            return
        self._changed = True
        self._dispatcher.call_soon(lambda: self._fail_running(event))
        if self._queue is not None:
            self._queue.put(event)

    def _fail_running(self, event: MembershipEvent) -> None:
        """The dispatcher's thread: every running call not made on "ready" or "any"
        fails; then the ranks of removed nodes are dead (the account of how their
        processes ended, if one comes, is added then)."""
        entries = self._table.entries
        for entry in entries:
            if entry is None or not entry.pending:
                continue
            for future in entry.take_pending(lambda f: not f.tolerant):
                future.fail_rank(entry.rank, MembershipChanged(
                    event.added, event.removed, future.method, event.reason))
        for node in event.removed:
            for rank in node.ranks:
                entry = entries[rank] if rank < len(entries) else None
                if entry is not None and entry.alive and entry.node == node.node:
                    self._dispatcher.bury(entry, ProcessFailure(
                        rank, entry.node, entry.pid, None,
                        reason=f"its node left the group: {node}: {event.reason}"))

    def _notify(self, events: queue.SimpleQueue[MembershipEvent | None]) -> None:
        while True:
            event = events.get()
            if event is None:
                return
            for callback in list(self._callbacks):
                try:
                    callback(event)
                except Exception:
                    logger.exception("the membership callback %r failed", callback)

    def stop(self) -> None:
        """The group shuts down: no more events, and the notifying thread ends."""
        self._backend.on_membership = None
        if self._queue is not None:
            self._queue.put(None)

    def resize(self, timeout: float | None) -> int:
        """See :meth:`WorkerGroup.resize <phalanx.controller.group.WorkerGroup.resize>`."""
        self._gate.check()
        timeout = check_seconds(timeout, allow_zero=False)
        with self._gate.operation("resize"):
            return self._resize(timeout)

    def _resize(self, timeout: float | None) -> int:
        changing = self._backend.capabilities.changing
        nodes = None if changing is None else changing.available_nodes()
        layout = self._starter.layout
        if nodes is None or (not self._changed and nodes == layout.nodes):
            return layout.world_size
        self.relayout(nodes, timeout)
        return self._starter.layout.world_size

    def relayout(self, nodes: int, timeout: float | None) -> None:
        """Stop every rank, then start the layout for ``nodes`` nodes."""
        if nodes < 1:
            raise PhalanxError("resize(): no node is left to run the group on")
        current = self._starter.layout
        counts = current.counts
        if len(set(counts)) > 1 and nodes != len(counts):
            raise ValueError(f"cannot resize the uneven layout procs_per_node={list(counts)} "
                             f"to {nodes} nodes")
        layout = Layout.of([counts[0]] * nodes)
        if self._mesh.sharding is not None and layout.world_size != current.world_size:
            raise ValueError(f"the group's mesh has {current.world_size} ranks; it "
                             f"cannot resize to {layout.world_size}")
        check_layout(self._starter.framework, layout)
        self._starter.retire(self._table.known(), grace=config.DEFAULT_TERM_GRACE)
        self._changed = False
        self._table.reset(layout.world_size)
        self._mesh.resized(layout.world_size)
        self._starter.reserve(layout)
        self._starter.start(list(range(layout.world_size)), timeout=timeout)
        logger.info("resized group %s from %d to %d ranks on %d nodes", self._starter.name,
                    current.world_size, layout.world_size, nodes)
