"""A running group's ranks replaced (``recreate`` with re-admission, ``restart``,
``reload``) and stopped (the teardown behind ``shutdown``).

Each operation holds the group's operation lock for its whole length, in state REPLACING
(see :mod:`phalanx.controller.state`): two of them never interleave, and none runs once the
group is closing. Replacing ranks goes through the starter (:mod:`phalanx.controller.startup`):
the old ranks are retired, then the fresh ones started, and nothing answers calls on them
in between. A restart after the backend's nodes changed is a resize
(:mod:`phalanx.controller.membership`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phalanx import config
from phalanx.controller.ranks import channels_of
from phalanx.errors import GroupClosed, PhalanxError, StartupError
from phalanx.options import check_seconds
from phalanx.wire import protocol
from phalanx.world.selection import select_ranks

if TYPE_CHECKING:
    from phalanx.backends import Backend
    from phalanx.controller.calls import Sender
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.membership import Membership
    from phalanx.controller.methods import MethodNames
    from phalanx.controller.ranks import RankEntry, RankTable
    from phalanx.controller.shared import SharedObjects
    from phalanx.controller.startup import Starter
    from phalanx.controller.state import Gate
    from phalanx.controller.watchdog import Watchdog

logger = logging.getLogger(__name__)

# The longest a teardown waits for idle ranks to exit on their own, in seconds: what
# ``shutdown(timeout=None)`` (or a huge timeout) hands the backend, whose waits take a
# finite number (Ray's turns it into integer milliseconds, a lock's stops at
# threading.TIMEOUT_MAX). A year is as long as it takes.
_LONGEST_EXIT_WAIT = 365 * 24 * 3600.0


class Lifecycle:
    """Replacing and stopping one group's rank processes (see the module docstring).

    Interface: :meth:`recreate`, :meth:`restart`, :meth:`reload` and :meth:`teardown`; the
    group's methods of the same names document them.
    """

    def __init__(
        self,
        *,
        gate: Gate,
        backend: Backend,
        dispatcher: Dispatcher,
        table: RankTable,
        starter: Starter,
        membership: Membership,
        methods: MethodNames,
        sender: Sender,
        shared: SharedObjects,
        watchdog: Watchdog,
    ) -> None:
        self._gate = gate
        self._backend = backend
        self._dispatcher = dispatcher
        self._table = table
        self._starter = starter
        self._membership = membership
        self._methods = methods
        self._sender = sender
        self._shared = shared
        self._watchdog = watchdog

    def recreate(self, ranks: int | Sequence[int], *, timeout: float | None,
                 readmit: str | None) -> None:
        """See :meth:`WorkerGroup.recreate <phalanx.controller.group.WorkerGroup.recreate>`."""
        with self._gate.operation("recreate"):  # GroupClosed first, if it is closed
            self._recreate(ranks, timeout, readmit)

    def _recreate(self, ranks: int | Sequence[int], timeout: float | None,
                  readmit: str | None) -> None:
        timeout = check_seconds(timeout, allow_zero=False)
        given = timeout is not None
        if timeout is None:
            timeout = self._starter.start_timeout
        if readmit is not None:
            if not isinstance(readmit, str):
                raise TypeError(f"readmit must be a method name, got {readmit!r}")
            self._methods.check(readmit)
        fresh = select_ranks([ranks] if isinstance(ranks, int) else ranks,
                             [True] * len(self._table))
        if not fresh:
            raise ValueError("recreate() needs at least one rank")
        old = [s for s in (self._table.entries[r] for r in fresh) if s is not None]
        if old:
            self._starter.retire(old, grace=config.DEFAULT_TERM_GRACE)
        if readmit is not None:
            self._starter.new_launch()  # a new rendezvous: the old one may still be held
            self._starter.mark_readmitted(fresh)
        self._starter.start(fresh, timeout=timeout,
                            limit="recreate(timeout=)" if given else None)
        if readmit is not None:
            self._readmit(readmit, timeout)
        logger.info("recreated ranks %s of group %s%s", fresh, self._starter.name,
                    f" (re-admitted by {readmit}())" if readmit else "")

    def _readmit(self, method: str, timeout: float) -> None:
        rendezvous = self._starter.rendezvous()
        alive = [s.rank for s in self._table.live()]
        future = self._sender.send(method, alive, [self._sender.encode((rendezvous,), {})])
        try:
            future.result(timeout)
        except PhalanxError as exc:
            raise StartupError(
                f"re-admission failed: {method}() on ranks {alive} of group "
                f"{self._starter.name} did not complete within {timeout:g} s: {exc}",
                group=self._starter.name,
            ) from exc

    def reload(self) -> str | None:
        """See :meth:`WorkerGroup.reload <phalanx.controller.group.WorkerGroup.reload>`."""
        with self._gate.operation("reload"):
            code = self._backend.capabilities.code
            version = None if code is None else code.reload_code()
            self.restart()
            return version

    def restart(self) -> None:
        """See :meth:`WorkerGroup.restart <phalanx.controller.group.WorkerGroup.restart>`."""
        with self._gate.operation("restart"):
            self._restart()

    def _restart(self) -> None:
        if self._membership.changed:
            changing = self._backend.capabilities.changing
            self._membership.relayout((changing.available_nodes() if changing is not None
                                       else 0) or self._starter.layout.nodes, None)
            return
        self._starter.retire(self._table.known(), grace=config.DEFAULT_TERM_GRACE)
        self._starter.new_launch()
        world_size = self._starter.layout.world_size
        self._starter.start(list(range(world_size)))
        logger.info("restarted %d workers of group %s", world_size, self._starter.name)

    def release(self, why: str) -> str:
        """Recreate every rank on a new rendezvous to free ranks stuck in a collective
        (``why``: what is stuck, for the log); returns what was done. See
        :mod:`phalanx.controller.collectivewatch`."""
        with self._gate.operation("release"):
            entries = self._table.known()
            logger.info("group %s: recreating every rank to release a stuck collective: %s",
                        self._starter.name, why)
            self._starter.retire(entries, grace=0.0, force=True)  # stuck: nothing to wait for
            self._starter.new_launch()
            world_size = self._starter.layout.world_size
            self._starter.start(list(range(world_size)))
        return (f"released: every rank of group {self._starter.name} (0-{world_size - 1}) "
                "was recreated on a new rendezvous, the constructors forming the world "
                "again (gloo cannot abort a collective in flight)")

    def stop_ranks(self, entries: Sequence[RankEntry] | None = None, grace: float = 0.0,
                   force: bool = True) -> None:
        """Stop ``entries``' processes (None: every rank the group knows) within ``grace``
        s, SIGTERM then SIGKILL (``force``: SIGKILL at once), and record their ends."""
        if entries is None:
            entries = self._table.known()
        self._backend.stop(channels_of(entries), grace=grace, force=force)
        for entry in entries:
            entry.exited(None)

    def teardown(self, deadline: float, force: bool) -> None:
        """Stop every part and every rank process by ``deadline`` (a
        ``time.monotonic()`` value; inf: no limit), see
        :meth:`WorkerGroup.shutdown <phalanx.controller.group.WorkerGroup.shutdown>`."""
        entries = self._table.known()
        self._membership.stop()
        self._watchdog.stop()
        # Idle workers are asked to exit and given until the deadline (atexit handlers,
        # framework cleanup); workers still busy with a call would only finish work whose
        # result nobody can receive any more, so they are terminated at once.
        idle = [s for s in entries if s.alive and not s.pending]
        if not force:
            for entry in idle:
                entry.channel.send(protocol.shutdown_frame(entry.rank))
            remaining = min(max(0.0, deadline - time.monotonic()), _LONGEST_EXIT_WAIT)
            self._backend.wait_exited(channels_of(idle), remaining)
        self._dispatcher.close(
            lambda method, rank: GroupClosed(
                f"group {self._starter.name} was shut down while {method}() was pending "
                f"on rank {rank}"
            ),
            entries,
        )
        grace = min(config.DEFAULT_TERM_GRACE, max(0.0, deadline - time.monotonic()))
        self.stop_ranks(entries, grace, force)
        self._shared.close()
        self._dispatcher.release()
        self._backend.close()
        logger.info("shut down %d workers of group %s", len(self._table), self._starter.name)
