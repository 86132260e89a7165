"""The local backend: ranks are processes on this machine, started for the controller by
the node side's one spawner (:class:`phalanx.node.spawn.RankSpawner`, under the node
supervisor of :mod:`phalanx.node.supervisor`), as a cluster agent starts its node's.

``nodes > 1`` simulates several nodes (distinct ``NODE_RANK`` values) on one machine; they
split its GPUs between them. What only holds on this machine (the controller's environment
and cwd, its visible GPUs, its free ports) is decided here, not above the backend line.

Each rank has a :class:`LocalChannel`: its control pipes, and the status pipe from its
keeper, whose exit record is the death event. When that record arrives the rank's last
frames are read and, if its output pipes have closed already (the usual case: they close
with the process, before its keeper hears of the exit), EXITED goes out in the same pass
-- no thread, no wait: a SIGKILLed rank's pending calls fail ~1.5 ms after the kill, most
of it the kernel tearing the process down. Otherwise the death is finished on a short
helper thread (a moment for the last stderr lines) and posted, so the dispatcher's pump
never waits on it. Both are the node side's one routine for a dead rank
(:class:`phalanx.node.spawn.Burial`).

Put objects are held once, in this process, for every simulated node
(:class:`phalanx.backends.ownblocks.OwnBlocks`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.backends.base import Backend, Boot, Channel, EventSink, Node, RankStart
from phalanx.backends.held import HeldObject
from phalanx.backends.ownblocks import OwnBlocks
from phalanx.backends.parts import Capabilities
from phalanx.errors import ProcessFailure
from phalanx.node import shm
from phalanx.node import spawn as node
from phalanx.node.machine import pick_free_ports, visible_gpus
from phalanx.output.logs import LogPump, OutputOptions, OutputTap
from phalanx.wire import framing
from phalanx.world.devices import DeviceBook
from phalanx.world.layout import Layout, split_gpus

if TYPE_CHECKING:
    from phalanx.world.pools import PoolSlot

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"
# This machine's GPUs, as pools and groups of this controller hold them: one book for the
# process, since every local group and pool shares the machine's devices.
_DEVICES = DeviceBook()
_DEVICES_LOCK = threading.Lock()


class LocalChannel(Channel):
    """One local rank: its process on this node (control pipes, the keeper's status pipe,
    its stack file), the tap on its output, and its :class:`~phalanx.node.spawn.Burial`
    (EXITED with the node side's record and the last lines of its stderr)."""

    def __init__(self, start: RankStart, process: node.NodeRank, tap: OutputTap) -> None:
        self.rank = start.rank
        self.ranks = (start.rank,)
        self.node = start.node
        self.process = process
        self._tap = tap
        self._sink: EventSink | None = None
        self._watched: list[int] = []
        self._burial = node.Burial(start.rank, lambda: self.exit_record(start.rank),
                                   self._post)

    def alive(self) -> bool:
        """Whether its process is still there (to answer, or to unmap)."""
        return not self._burial.claimed and self.process.exitcode(0) is None

    def attach(self, sink: EventSink) -> None:
        self._sink = sink
        self._watched = [self.process.conn.read_fd]
        if self.process.death_fd is not None:
            self._watched.append(self.process.death_fd)
        conn = self.process.conn
        for fd in self._watched:
            sink.watch(fd, self, conn.recv_ready if fd == conn.read_fd else None)

    def receive(self, fd: int) -> list[list[Any]]:
        process = self.process
        if fd == process.conn.read_fd:
            try:
                return process.conn.reader.recv_frames(block=False)
            except framing.ConnectionLost as exc:
                if isinstance(exc, framing.FrameTooLarge):  # bytes that are no frame
                    logger.warning("closing the control stream of rank %d: it sent %s",
                                   self.rank, exc)
                self._unwatch(fd)
                if process.death_fd is None:
                    if self._claim():
                        self._burial.tell_later(self._settle)
                    return []
                # Dying, or of no use: killed, and its exit status follows on the status
                # pipe -- or was there already and was read just now, which the pipe's
                # next event (the end of the keeper's cleanup) would announce only later.
                process.stream_ended()
        if process.exitcode(0) is None:  # the status pipe brought the pid, not the end
            return []
        return process.drain() + self._died()

    def _died(self) -> list[list[Any]]:
        """Its process has exited: EXITED now if its last output is in, else posted from
        a helper thread once it is."""
        if not self._claim():
            return []
        tap = self._tap
        if tap.wait_closed(0) or tap.drained() or tap.wait_closed(config.OUTPUT_PEEK):
            return [self._burial.exited()]
        self._burial.tell_later(self._settle)
        return []

    def _claim(self) -> bool:
        """The first sign of its death: nothing of it is watched any more."""
        if not self._burial.claim():
            return False
        for fd in list(self._watched):
            self._unwatch(fd)
        return True

    def _settle(self) -> None:
        """What completes its record, a moment at most: its exit status, its last output."""
        self.process.reap()
        self._tap.wait_closed(config.OUTPUT_WAIT)

    def _post(self, event: list[Any]) -> None:
        if self._sink is not None:
            self._sink.post(self, [event])

    def _unwatch(self, fd: int) -> None:
        try:  # atomic: the pump (a death) and close() may both get here
            self._watched.remove(fd)
        except ValueError:
            return
        if self._sink is not None:
            self._sink.unwatch(fd, self)

    def send(self, frame: list[Any]) -> None:
        self.process.conn.send(frame)  # quiet: a lost rank's death arrives as EXITED

    def sender(self) -> Callable[[list[Any]], None]:
        return self.process.conn.sender()  # (no hop: the hot path of every call)

    def signal(self, rank: int, sig: int) -> None:
        self.process.signal(sig)

    def stacks(self, rank: int, timeout: float) -> str:
        return self.process.stacks(timeout)

    def exit_record(self, rank: int) -> ProcessFailure:
        return self.process.failure(self._tap.stderr_tail())

    def close(self) -> None:
        self._burial.stop()  # stopped on purpose: the group records it
        for fd in list(self._watched):
            self._unwatch(fd)
        self.process.close()


def _alive(channel: Any) -> bool:
    """Whether a rank's channel still has its process (the pool's question: can it still
    say RELEASED?)."""
    return isinstance(channel, LocalChannel) and channel.alive()


class LocalBackend(Backend):
    name = "local"

    def __init__(self) -> None:
        self._gpus = visible_gpus()
        self._node_gpus: list[tuple[str, ...]] | None = None  # on a pool: each node's
        self._holder: str | None = None  # its group's name in the book of devices
        self._objects = OwnBlocks(_alive)  # every simulated node's copies

    def place_on(self, node_gpus: list[tuple[str, ...]]) -> None:
        """Run the group on a pool's slots: node n gets ``node_gpus[n]`` (before
        :meth:`reserve`)."""
        self._node_gpus = node_gpus

    @property
    def capabilities(self) -> Capabilities:
        """It holds put objects (where this machine has memfd and /proc) and reserves
        pools' slots (this machine's GPUs)."""
        return Capabilities(objects=self if shm.supported() else None, slots=self)

    def _open(self, output: OutputOptions) -> None:
        # each part's release registered as it is made: an open that fails part way
        # (out of descriptors, say) gives back what it had made
        with contextlib.ExitStack() as undo:
            self._writer = framing.BacklogWriter()
            undo.callback(self._writer.stop)
            self._logs = LogPump(output)
            undo.callback(self._logs.stop)
            self._spawner = node.RankSpawner(self._writer)
            undo.callback(self._spawner.close)
            self._spawner.open()  # the supervisor boots while the group prepares its launch
            undo.pop_all()

    def gpus_per_node(self, nodes: int) -> int:
        """GPUs each simulated node gets (they split this machine's)."""
        return len(self._gpus) // nodes if nodes > 1 else len(self._gpus)

    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float,
                 holder: str) -> list[Node]:
        if self._node_gpus is not None:  # placed on a pool's slots: the pool holds them
            return [Node(index=n, address=_LOOPBACK, ranks=layout.counts[n], gpus=gpus)
                    for n, gpus in enumerate(self._node_gpus)]
        shares = (split_gpus(len(self._gpus), layout.nodes) if layout.nodes > 1
                  else (tuple(range(len(self._gpus))),))
        gpus = [tuple(self._gpus[i] for i in share) for share in shares]
        enough = all(layout.counts[n] * gpus_per_worker <= len(gpus[n])
                     for n in range(layout.nodes))  # else the placement check names it
        if gpus_per_worker and enough:  # each node's ranks hold theirs in this book
            with _DEVICES_LOCK:
                if self._holder is not None:  # reserving again: what it held goes first
                    _DEVICES.give_back(self._holder)
                self._holder = holder
                try:
                    gpus = [_DEVICES.take(layout.counts[n] * gpus_per_worker, holder, gpus[n])
                            for n in range(layout.nodes)]
                except BaseException:
                    _DEVICES.give_back(holder)  # the nodes that had theirs
                    self._holder = None
                    raise
        return [Node(index=n, address=_LOOPBACK, ranks=layout.counts[n], gpus=gpus[n])
                for n in range(layout.nodes)]

    def _give_back_devices(self) -> None:
        """The GPUs this backend's group held are free again (caller holds the lock)."""
        if self._holder is not None:
            _DEVICES.give_back(self._holder)

    def reserve_slots(self, counts: Sequence[int], *, gpus: int,
                      resources: Mapping[str, float], timeout: float,
                      holder: str = "a pool") -> LocalSlots:
        """This machine's GPUs, ``gpus`` for each slot in order (the simulated nodes share
        them), held in its book by ``holder``; ValueError when there are not enough,
        DevicesTaken when others hold them."""
        if resources:
            raise ValueError(f"resources_per_proc={dict(resources)} means Ray resources: the "
                             "local backend has none (give GPUs as gpus_per_proc=)")
        total = sum(counts)
        if gpus and gpus * total > len(self._gpus):
            raise ValueError(
                f"a pool of {total} slots x {gpus} GPU(s) needs {gpus * total} GPUs; this "
                f"machine offers {len(self._gpus)} ({', '.join(self._gpus) or 'none'}"
                f"{', from CUDA_VISIBLE_DEVICES' if 'CUDA_VISIBLE_DEVICES' in os.environ else ''})")
        with _DEVICES_LOCK:
            taken = _DEVICES.take(gpus * total, holder, self._gpus)
        return LocalSlots([taken[k * gpus:(k + 1) * gpus] for k in range(total)], gpus,
                          holder if taken else None)

    @property
    def supervisor_pid(self) -> int | None:
        """The node supervisor's pid, once the backend is open."""
        return self._spawner.supervisor_pid if self.opened else None

    def ports(self, node: Node, count: int) -> list[int]:
        return pick_free_ports(node.address, count)

    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        started = self._spawner.launch(
            [(start.rank, start.node, 0, start.env) for start in ranks],
            boot.cwd or os.getcwd(), boot.sys_path, boot.options, boot.payload,
            python=boot.python)
        for i, (start, process) in enumerate(zip(ranks, started, strict=True)):
            try:
                tap = self._attach_output(start.rank, process)
            except BaseException:  # e.g. its log file vanished: these have no channel yet
                _stop_and_close(started[i:])
                raise
            channels.append(LocalChannel(start, process, tap))

    def _attach_output(self, rank: int, process: node.NodeRank) -> OutputTap:
        stdout_fd, stderr_fd = process.take_output()
        try:
            return self._logs.attach(rank, stdout_fd, stderr_fd)
        except BaseException:  # the pump did not take them
            os.close(stdout_fd)
            os.close(stderr_fd)
            raise

    # -- held objects (ObjectHolding): one copy in this process for every node --------------

    def share(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        self._objects.share(obj, channels)

    def unshare(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        self._objects.unshare(obj, channels)

    def released(self, channel: Channel, ref_id: int) -> None:
        self._objects.released(channel, ref_id)

    def segments(self, obj: HeldObject) -> list[Any] | None:
        return obj.segments if obj.segments is not None else self._objects.parts(obj.id)

    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None:
        node.stop_processes(_procs(channels), grace=grace, force=force)

    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        node.wait_all_exit(_procs(channels), timeout)

    def close(self) -> None:
        with _DEVICES_LOCK:
            self._give_back_devices()
            self._holder = None
        self._objects.close()
        if self.opened:
            self._spawner.close()
            self._logs.stop()
            self._writer.stop()


def _procs(channels: Sequence[Channel]) -> list[Any]:
    return [c.process.proc for c in channels if isinstance(c, LocalChannel)]


def _stop_and_close(processes: Sequence[node.NodeRank]) -> None:
    node.stop_processes([p.proc for p in processes], force=True)
    for process in processes:
        process.close()


class LocalSlots:
    """A resource pool's slots on this machine: each slot's GPU ids."""

    def __init__(self, gpus: list[tuple[str, ...]], per_slot: int,
                 holder: str | None = None) -> None:
        self.gpus = gpus
        self.gpus_per_worker = per_slot
        self._holder = holder  # the pool, in this machine's book of devices

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> LocalBackend:
        backend = LocalBackend()
        per_node: dict[int, list[str]] = {}
        for slot in slots:
            per_node.setdefault(slot.node, []).extend(self.gpus[slot.index])
        backend.place_on([tuple(ids) for ids in per_node.values()])
        return backend

    def release(self) -> None:
        if self._holder is not None:  # idempotent: the book forgets a holder once
            with _DEVICES_LOCK:
                _DEVICES.give_back(self._holder)
            self._holder = None
