"""A running group's ranks replaced (``recreate`` with re-admission, ``restart``) and
stopped (``shutdown``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

from phalanx import config
from phalanx.errors import GroupClosed, PhalanxError, StartupError
from phalanx.options import check_seconds
from phalanx.wire import protocol
from phalanx.world.selection import select_ranks

if TYPE_CHECKING:
    from phalanx.backends import Backend, RankStart
    from phalanx.controller.dispatch import Dispatcher, Slot
    from phalanx.controller.futures import GroupFuture
    from phalanx.world.layout import Layout

logger = logging.getLogger(__name__)

READMIT_ENV = "PHALANX_READMIT"  # "1" in the environment of a rank started to be re-admitted


def channels_of(slots: Sequence[Slot]) -> list:
    """The distinct channels of ``slots`` (a node channel may carry several of them)."""
    return list({id(s.channel): s.channel for s in slots}.values())


class Lifecycle:
    """Mixin of :class:`~phalanx.controller.group.WorkerGroup`: replacing and stopping rank
    processes."""

    _slots: list[Slot | None]
    _starts: list[RankStart]
    _layout: Layout
    _backend: Backend
    _dispatcher: Dispatcher
    _start_timeout: float
    _check_open: Callable[[], None]
    _check_method: Callable[[str], None]
    _new_launch: Callable[[], None]
    _start_ranks: Callable[..., None]
    _send: Callable[..., GroupFuture]
    _unregister: Callable[[], None]
    _closed: bool
    _membership_changed: bool
    _relayout: Callable[[int, float | None], None]
    _stop_membership: Callable[[], None]
    _watchdog: Any
    _target_name: str
    world_size: int

    def recreate(
        self,
        ranks: int | Sequence[int],
        *,
        timeout: float | None = None,
        readmit: str | None = None,
    ) -> None:
        """Start a fresh process for each of ``ranks`` (stopping the old one if it still
        runs), with the same constructor arguments.

        The fresh ranks must be ready within ``timeout`` seconds (default: the group's
        ``start_timeout``), else :class:`StartupError` (and they are stopped): a rank whose
        constructor waits for peers that will not come fails then, not minutes later.

        ``readmit`` re-forms a collective group (torch.distributed, ...) around the fresh
        ranks. They start on a new rendezvous (fresh ``MASTER_PORT``), with
        ``PHALANX_READMIT=1`` in their environment: their constructor should not join a
        collective group then. Once they are up, the method named by ``readmit`` is called
        on every live rank at once, fresh ones included, with the new rendezvous (a dict
        of the variables every rank shares, e.g. ``MASTER_ADDR``, ``MASTER_PORT``,
        ``WORLD_SIZE``), within ``timeout`` too; it should leave the old group and join the
        new one, e.g. ``dist.destroy_process_group(); os.environ.update(rendezvous);
        dist.init_process_group("gloo")``.
        """
        self._check_open()
        timeout = check_seconds(timeout, allow_zero=False)
        given = timeout is not None
        if timeout is None:
            timeout = self._start_timeout
        if readmit is not None:
            if not isinstance(readmit, str):
                raise TypeError(f"readmit must be a method name, got {readmit!r}")
            self._check_method(readmit)
        fresh = select_ranks([ranks] if isinstance(ranks, int) else ranks,
                             [True] * self.world_size)
        if not fresh:
            raise ValueError("recreate() needs at least one rank")
        old = [s for s in (self._slots[r] for r in fresh) if s is not None]
        if old:
            self._retire(old, grace=config.DEFAULT_TERM_GRACE)
        if readmit is not None:
            self._new_launch()  # a new rendezvous: the old one may still be held
            for rank in fresh:
                start = self._starts[rank]
                self._starts[rank] = type(start)(
                    rank=start.rank, node=start.node, local_rank=start.local_rank,
                    env={**start.env, READMIT_ENV: "1"})
        self._start_ranks(fresh, timeout=timeout,
                          limit="recreate(timeout=)" if given else None)
        if readmit is not None:
            self._readmit(readmit, timeout)
        logger.info("recreated ranks %s%s", fresh, f" (re-admitted by {readmit}())"
                    if readmit else "")

    def rendezvous(self) -> dict[str, str]:
        """The variables every rank got with the same value (``MASTER_ADDR``,
        ``MASTER_PORT``, ``WORLD_SIZE``, ...): the group's current rendezvous."""
        envs = [dict(start.env) for start in self._starts]
        shared = envs[0]
        for env in envs[1:]:
            shared = {k: v for k, v in shared.items() if env.get(k) == v}
        shared.pop(READMIT_ENV, None)
        return shared

    def _readmit(self, method: str, timeout: float) -> None:
        rendezvous = self.rendezvous()
        alive = [r for r, s in enumerate(self._slots) if s is not None and s.alive]
        future = self._send(method, alive, [self._encode((rendezvous,), {})])  # type: ignore[attr-defined]
        try:
            future.result(timeout)
        except PhalanxError as exc:
            raise StartupError(
                f"re-admission failed: {method}() on ranks {alive} did not complete within "
                f"{timeout:g} s: {exc}",
            ) from exc

    def reload(self) -> str | None:
        """Ship the code again and restart every rank in place (same nodes, same layout).

        With ``ClusterBackend(sync=...)`` only the files that changed cross to each node,
        and every rank then runs the new version (``health()`` shows it; returned here).
        On the other backends the ranks start again from the code as it is on disk now:
        locally a restart; on Ray the same placement group. Pending calls fail.
        """
        self._check_open()
        version = self._backend.reload_code()
        self.restart()
        return version

    def restart(self) -> None:
        """Replace every worker process, keeping the layout and the nodes (pending calls
        fail). If the backend's nodes changed since (see ``resize()``), the group starts on
        the nodes there are now."""
        self._check_open()
        if self._membership_changed:
            self._relayout(self._backend.available_nodes() or self._layout.nodes, None)
            return
        self._retire([s for s in self._slots if s is not None], grace=config.DEFAULT_TERM_GRACE)
        self._new_launch()
        self._start_ranks(list(range(self.world_size)))
        logger.info("restarted %d workers", self.world_size)

    def _retire(self, slots: list[Slot], *, grace: float, force: bool = False) -> None:
        for slot in slots:
            self._dispatcher.remove(slot)
        self._backend.stop(channels_of(slots), grace=grace, force=force)
        for slot in slots:
            if slot.alive or slot.pending:
                self._dispatcher.bury(slot, slot.channel.exit_record(slot.rank))

    # -- shutdown ---------------------------------------------------------------------

    def shutdown(
        self,
        cleanup: str | None = None,
        timeout: float = config.DEFAULT_SHUTDOWN_TIMEOUT,
        force: bool = False,
    ) -> None:
        """Stop every worker: optional ``cleanup`` method on all live ranks, a graceful exit
        within ``timeout``, then SIGTERM and SIGKILL of each worker's process tree.

        Idle workers exit on their own (running their atexit handlers); workers still busy
        with a call are terminated at once, since its result could not be delivered.

        Idempotent. Pending calls end with :class:`GroupClosed`. On return no process the
        group started is alive.
        """
        if self._closed:
            return
        check_seconds(timeout, "shutdown timeout")
        deadline = time.monotonic() + timeout
        try:
            if cleanup is not None and not force:
                try:
                    self.call(cleanup, workers="ready", timeout=timeout)
                except PhalanxError as exc:
                    logger.warning("cleanup method %r failed: %s", cleanup, exc)
        finally:
            self._teardown(deadline, force)

    def _teardown(self, deadline: float, force: bool) -> None:
        slots = [s for s in self._slots if s is not None]
        self._closed = True
        self._unregister()
        self._stop_membership()
        if self._watchdog is not None:
            self._watchdog.stop()
        # Idle workers are asked to exit and given until the deadline (atexit handlers,
        # framework cleanup); workers still busy with a call would only finish work whose
        # result nobody can receive any more, so they are terminated at once.
        idle = [s for s in slots if s.alive and not s.pending]
        if not force:
            for slot in idle:
                slot.channel.send(protocol.shutdown_frame(slot.rank))
            remaining = max(0.0, deadline - time.monotonic())
            self._backend.wait_exited(channels_of(idle), remaining)
        self._dispatcher.close(
            lambda method, rank: GroupClosed(
                f"the group was shut down while {method}() was pending on rank {rank}"
            ),
            slots,
        )
        grace = min(config.DEFAULT_TERM_GRACE, max(0.0, deadline - time.monotonic()))
        self._backend.stop(channels_of(slots), grace=grace, force=force)
        for slot in slots:
            slot.alive = False
        self._shared.close()
        self._dispatcher.release()
        self._backend.close()
        logger.info("shut down %d workers of %s", self.world_size, self._target_name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
