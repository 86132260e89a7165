"""A running group's ranks replaced (``recreate`` with restore and re-admission,
``restart``, ``reload``) and stopped (the teardown behind ``shutdown``).

Each operation holds the group's operation lock for its whole length, in state REPLACING
(see :mod:`phalanx.controller.state`): two of them never interleave, and none runs once the
group is closing. Replacing ranks goes through the starter (:mod:`phalanx.controller.startup`):
the old ranks are retired, then the fresh ones started, and nothing answers calls on them
in between. A restart after the backend's nodes changed is a resize
(:mod:`phalanx.controller.membership`).

A recreate checks every argument before it stops anything. Its steps, each bounded by its
``timeout``: retire the old ranks; start the fresh ones; restore them (``restore_from``):
``get()`` runs on each peer with its result kept there (``keep=True``,
:mod:`phalanx.controller.kept`), then ``set(handle)`` on the fresh rank, which reads the
state straight from its peer -- no checkpoint, and the controller never sees the bytes;
then re-admit every live rank into a new collective world (``readmit``), told which ranks
are fresh and whether they were restored. A restore that fails stops the fresh ranks, as
a start that fails does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx import config
from phalanx.controller.ranks import channels_of
from phalanx.dumps import innermost_user_frames
from phalanx.errors import GroupClosed, PhalanxError, StartupError
from phalanx.options import check_seconds
from phalanx.wire import protocol
from phalanx.world.selection import select_ranks

if TYPE_CHECKING:
    from phalanx.backends import Backend
    from phalanx.backends.parts import Detaching
    from phalanx.controller.calls import Sender
    from phalanx.controller.dispatch import Dispatcher
    from phalanx.controller.futures import GroupFuture
    from phalanx.controller.membership import Membership
    from phalanx.controller.meshcalls import Mesh
    from phalanx.controller.methods import MethodNames
    from phalanx.controller.ranks import RankEntry, RankTable
    from phalanx.controller.refs import ResultRef
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

# What a re-admission's rendezvous adds for the readmit method: the fresh ranks ("1",
# "0,2"), and "1" when they were restored from peers ("0": they hold fresh state).
FRESH_RANKS_ENV = "PHALANX_FRESH_RANKS"
RESTORED_ENV = "PHALANX_RESTORED"

RestoreFrom = int | Mapping[int, int] | str  # restore_from=: a peer, {fresh: peer}, "peers"


class Restore(NamedTuple):
    """A recreate's restore, checked: each fresh rank's peer, the methods to call."""

    peers: dict[int, int]  # fresh rank -> the live rank it gets its state from
    getter: str  # get=: returns a rank's state (on the peer)
    setter: str  # set=: loads it (on the fresh rank)


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
                 readmit: str | None, restore_from: RestoreFrom | None = None,
                 get: str | None = None, set: str | None = None,
                 mesh: Mesh | None = None) -> None:
        """See :meth:`WorkerGroup.recreate <phalanx.controller.group.WorkerGroup.recreate>`
        (``mesh``: the group's, where ``restore_from="peers"`` looks for replicas)."""
        with self._gate.operation("recreate"):  # GroupClosed first, if it is closed
            self._recreate(ranks, timeout, readmit, restore_from, get, set, mesh)

    def _recreate(self, ranks: int | Sequence[int], timeout: float | None,
                  readmit: str | None, restore_from: RestoreFrom | None,
                  getter: str | None, setter: str | None, mesh: Mesh | None) -> None:
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
        restore = self._restore_plan(fresh, restore_from, getter, setter, mesh)
        if (readmit is not None and 0 in fresh and restore is None
                and len(fresh) < len(self._table)):
            logger.warning(
                "recreate(): rank 0 of group %s is fresh and not restored (no restore_from=): "
                "a DDP re-wrap in %s() (or any broadcast from rank 0) will overwrite every "
                "rank with rank 0's fresh state; pass restore_from=\"peers\" with get= and "
                "set= to give it a peer's state first", self._starter.name, readmit)
        old = [s for s in (self._table.entries[r] for r in fresh) if s is not None]
        if old:
            self._starter.retire(old, grace=config.DEFAULT_TERM_GRACE)
        if readmit is not None:
            self._starter.new_launch()  # a new rendezvous: the old one may still be held
            self._starter.mark_readmitted(fresh)
        # A torch world takes no rank back by itself: a fresh rank that joins it in its
        # constructor waits there for peers that joined long ago, until the timeout.
        hint = (self._no_readmit_hint
                if readmit is None and self._starter.framework.name == "torch" else None)
        self._starter.start(fresh, timeout=timeout,
                            limit="recreate(timeout=)" if given else None, explain_late=hint)
        if restore is not None:
            self._restore(restore, timeout)
        if readmit is not None:
            self._readmit(readmit, timeout, fresh, restore is not None)
        logger.info("recreated ranks %s of group %s%s%s", fresh, self._starter.name,
                    "" if restore is None else
                    f" (restored from ranks {[restore.peers[r] for r in fresh]})",
                    f" (re-admitted by {readmit}())" if readmit else "")

    # -- restoring fresh ranks from their peers -------------------------------------------

    def _restore_plan(self, fresh: list[int], restore_from: RestoreFrom | None,
                      getter: str | None, setter: str | None,
                      mesh: Mesh | None) -> Restore | None:
        """The restore asked for (None: none), every argument checked."""
        if restore_from is None:
            if getter is not None or setter is not None:
                raise TypeError("get= and set= name the methods restore_from= uses: pass "
                                "restore_from= (a peer rank, {fresh rank: peer rank} or "
                                "\"peers\") too, or neither")
            return None
        if getter is None or setter is None:
            raise TypeError(f"restore_from={restore_from!r} needs get= and set=: the names of "
                            "the methods that return a rank's state (get) and load it on "
                            "the fresh rank (set)")
        for what, name in (("get", getter), ("set", setter)):
            if not isinstance(name, str):
                raise TypeError(f"{what} must be a method name, got {name!r}")
            self._methods.check(name)
        self._dispatcher.poll_now()  # deaths that already happened count
        size = len(self._table)
        if isinstance(restore_from, str):
            if restore_from != "peers":
                raise ValueError(f"restore_from must be a rank, a dict {{fresh rank: peer "
                                 f"rank}} or \"peers\", got {restore_from!r}")
            return Restore({rank: self._peer_of(rank, fresh, mesh) for rank in fresh},
                           getter, setter)
        if isinstance(restore_from, Mapping):
            wrong = [r for r in restore_from if r not in fresh]
            if wrong:
                raise ValueError(f"restore_from names ranks {wrong}, which are not recreated "
                                 f"(the fresh ranks: {fresh})")
            missing = [r for r in fresh if r not in restore_from]
            if missing:
                raise ValueError(f"restore_from names no peer for fresh ranks {missing}")
            peers = {rank: restore_from[rank] for rank in fresh}
        elif isinstance(restore_from, int) and not isinstance(restore_from, bool):
            peers = dict.fromkeys(fresh, restore_from)
        else:
            raise TypeError(f"restore_from must be a rank, a dict {{fresh rank: peer rank}} "
                            f"or \"peers\", got {restore_from!r}")
        for rank, peer in peers.items():
            if isinstance(peer, bool) or not isinstance(peer, int):
                raise TypeError(f"restore_from: the peer of rank {rank} must be a rank "
                                f"number, got {peer!r}")
            if not 0 <= peer < size:
                raise ValueError(f"restore_from: peer rank {peer} is outside 0..{size - 1}")
            if peer in fresh:
                raise ValueError(f"restore_from: peer rank {peer} is recreated too (the fresh "
                                 f"ranks: {fresh}); a peer keeps the state its fresh rank "
                                 "gets")
            if not self._alive(peer):
                raise ValueError(f"restore_from: peer rank {peer} of group "
                                 f"{self._starter.name} is not alive")
        return Restore(peers, getter, setter)

    def _alive(self, rank: int) -> bool:
        entry = self._table.entries[rank]
        return entry is not None and entry.alive

    def _peer_of(self, rank: int, fresh: list[int], mesh: Mesh | None) -> int:
        """The peer ``restore_from="peers"`` picks for ``rank``: a live rank not recreated
        that holds what it held -- with a mesh, one at its coordinates on every axis but
        the data-parallel one (its place in another replica); without, any (each rank is
        a replica) -- preferring one on its node, then the lowest."""
        if mesh is None or mesh.sharding is None:
            candidates = list(range(len(self._table)))
            where = ""
        else:
            sharding = mesh.sharding
            coords = sharding.get_worker_coords(rank)
            same = {axis: at for axis, at in coords.items() if axis != mesh.dp_axis}
            candidates = sharding.get_ranks_by_coord(**same)
            where = (f" at its coordinates {same} in another data-parallel replica "
                     f"(axis {mesh.dp_axis!r})")
        usable = [r for r in candidates if r not in fresh and self._alive(r)]
        if not usable:
            raise ValueError(f"restore_from=\"peers\": no live rank of group "
                             f"{self._starter.name} that is not recreated holds rank {rank}'s "
                             f"state{where}; name its peer: restore_from={{{rank}: peer}}")
        node_of = self._starter.layout.node_of
        return min(usable, key=lambda r: (node_of(r) != node_of(rank), r))

    def _restore(self, restore: Restore, timeout: float) -> None:
        """Each fresh rank gets its peer's state: ``getter()`` on every peer at once, kept
        there, then ``setter(handle)`` on every fresh rank at once; the handles freed. A
        failure stops the fresh ranks and raises StartupError naming both ranks."""
        peers, getter, setter = restore
        by_peer: dict[int, list[int]] = {}
        for rank, peer in peers.items():
            by_peer.setdefault(peer, []).append(rank)
        refs: dict[int, ResultRef] = {}
        try:
            got = {peer: self._send_one(getter, peer, (), keep=True) for peer in by_peer}
            deadline = time.monotonic() + timeout
            for peer, future in got.items():
                try:
                    refs[peer] = future.result(max(0.0, deadline - time.monotonic()))[0]
                except PhalanxError as exc:
                    raise self._restore_error(by_peer[peer], peer, f"{getter}() on rank "
                                              f"{peer}", exc) from exc
            loads: dict[int, GroupFuture] = {}
            for rank, peer in peers.items():
                try:
                    loads[rank] = self._send_one(setter, rank, (refs[peer],))
                except PhalanxError as exc:
                    raise self._restore_error([rank], peer, f"{setter}() on rank {rank}",
                                              exc) from exc
            deadline = time.monotonic() + timeout
            for rank, future in loads.items():
                try:
                    future.result(max(0.0, deadline - time.monotonic()))
                except PhalanxError as exc:
                    raise self._restore_error([rank], peers[rank], f"{setter}() on rank "
                                              f"{rank}", exc) from exc
        except BaseException:
            entries = [s for s in (self._table.entries[r] for r in peers) if s is not None]
            self._starter.retire(entries, grace=0.0, force=True)  # no half-restored rank
            raise
        finally:
            for ref in refs.values():
                ref.free()

    def _send_one(self, method: str, rank: int, args: tuple[Any, ...],
                  keep: bool = False) -> GroupFuture:
        """``method(*args)`` on ``rank`` (the path of ``call_one``), its future."""
        payload = self._sender.encode(args, {}, rank)
        future: GroupFuture = self._sender.send(method, [rank], [payload], keep=keep)
        return future

    def _restore_error(self, ranks: list[int], peer: int, what: str,
                       exc: PhalanxError) -> StartupError:
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        return StartupError(
            f"restoring {which} of group {self._starter.name} from rank {peer} failed: "
            f"{what}: {type(exc).__name__}: {exc}; the fresh ranks were stopped",
            rank=ranks[0], group=self._starter.name)

    # -- re-admission -----------------------------------------------------------------

    def _no_readmit_hint(self, late: list[int]) -> str:
        """What a torch rank recreated without ``readmit`` that timed out is told, with its
        stacks (taken while it still waits)."""
        stacks = self._dispatcher.stacks_of(late)
        text = ("\n\nA torch world does not take a fresh rank back by itself: a constructor "
                "that joins it (init_process_group) waits for peers that joined long ago. "
                "Pass readmit= (a method every live rank runs with a new rendezvous, e.g. "
                "destroy_process_group(), os.environ.update(rendezvous), "
                "init_process_group()) and restore_from= with get= and set= (the fresh rank "
                "gets a peer's state first); see WorkerGroup.recreate.")
        for rank in late:
            stack = stacks.get(rank)
            if not stack:
                continue
            where = innermost_user_frames(stack)
            text += (f"\n\nrank {rank}" + (f" waits at {'; '.join(where)}" if where else "")
                     + f"; its stack when the start timed out:\n{stack.rstrip()}")
        return text

    def _readmit(self, method: str, timeout: float, fresh: list[int],
                 restored: bool) -> None:
        rendezvous = {**self._starter.rendezvous(),
                      FRESH_RANKS_ENV: ",".join(map(str, fresh)),
                      RESTORED_ENV: "1" if restored else "0"}
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

    def leave(self, detaching: Detaching) -> None:
        """Let go of every rank without stopping one (``group.detach()``): the calls
        pending here fail, the nodes keep the ranks for the next controller."""
        entries = self._table.known()
        self._membership.stop()
        self._watchdog.stop()
        name = self._starter.name
        self._dispatcher.close(
            lambda method, rank: GroupClosed(
                f"group {name} was detached while {method}() was pending on rank {rank}; "
                "the controller that attaches finds its answer in group.orphaned()"),
            entries,
        )
        self._shared.close()
        self._dispatcher.release()
        detaching.leave()
        logger.info("left %d workers of detached group %s running", len(entries), name)

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
        # the backend's last words before the dispatcher lets go of the connections: an
        # agent's answer that the group's GPUs are free is read through it (released
        # first, every group holding GPUs waited 5 s for an answer nobody read)
        self._backend.close()
        self._dispatcher.release()
        logger.info("shut down %d workers of group %s", len(self._table), self._starter.name)
