"""The local backend: ranks are processes on this machine, started for the controller by
its node supervisor (:mod:`phalanx.node.supervisor`).

``nodes > 1`` simulates several nodes (distinct ``NODE_RANK`` values) on one machine; they
split its GPUs between them. This is also the node side a cluster agent runs: what only
holds on this machine (the controller's environment and cwd, its visible GPUs, its free
ports) is decided here, not above the backend line.

Each rank has a :class:`LocalChannel`: its control pipes, and the status pipe from its
keeper, whose exit record is the death event. A death is finished on a short helper thread
(the exit status, a moment for the last stderr lines) and posted as EXITED, so the
dispatcher's pump never waits on it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from phalanx import config
from phalanx.backends.base import Backend, Boot, Channel, EventSink, Node, RankStart
from phalanx.errors import ProcessFailure
from phalanx.node import shm
from phalanx.node import spawn as node
from phalanx.node.machine import pick_free_ports, visible_gpus
from phalanx.node.stacks import StackFile
from phalanx.node.supervisor import SupervisedProcess, Supervisor
from phalanx.output.logs import LogPump, OutputOptions, OutputTap
from phalanx.wire import framing, protocol, streams
from phalanx.world.layout import Layout, merge_env, split_gpus

_LOOPBACK = "127.0.0.1"


class LocalChannel(Channel):
    """One local rank: its control pipes, its keeper's status pipe, its output tap."""

    def __init__(self, start: RankStart, proc: SupervisedProcess, conn: framing.Connection,
                 tap: OutputTap, stack_file: StackFile) -> None:
        self.rank = start.rank
        self.ranks = (start.rank,)
        self.node = start.node
        self.proc = proc
        self.conn = conn
        self._tap = tap
        self._stack_file = stack_file
        self._sink: EventSink | None = None
        self._watched: list[int] = []
        self._buried = False
        self._lock = threading.Lock()

    def attach(self, sink: EventSink) -> None:
        self._sink = sink
        self._watched = [self.conn.read_fd]
        if self.proc.death_fd is not None:
            self._watched.append(self.proc.death_fd)
        for fd in self._watched:
            sink.watch(fd, self)

    def receive(self, fd: int) -> list[list[Any]]:
        if fd == self.conn.read_fd:
            try:
                return self.conn.reader.recv_frames(block=False)
            except framing.ConnectionLost:
                self._unwatch(fd)
                if self.proc.death_fd is None:
                    self._bury_later()
                else:  # the stream ended but the process lives on: unusable, end it
                    self.proc.signal_tree(signal.SIGKILL)
                return []
        if self.proc.exitcode(0) is None:  # the status pipe brought the pid, not the end
            return []
        # the process has exited; everything it sent is in the pipe
        frames = self._drain()
        self._bury_later()
        return frames

    def _drain(self) -> list[list[Any]]:
        frames: list[list[Any]] = []
        for _ in range(10_000):
            try:
                more = self.conn.reader.recv_frames(block=False)
            except framing.ConnectionLost:
                break
            if not more:
                break
            frames += more
        return frames

    def _unwatch(self, fd: int) -> None:
        try:  # atomic: the pump (a death) and close() may both get here
            self._watched.remove(fd)
        except ValueError:
            return
        if self._sink is not None:
            self._sink.unwatch(fd, self)

    def _bury_later(self) -> None:
        with self._lock:
            if self._buried:
                return
            self._buried = True
        for fd in list(self._watched):
            self._unwatch(fd)
        threading.Thread(target=self._bury, name=f"phalanx-bury-{self.rank}", daemon=True).start()

    def _bury(self) -> None:
        code = self.proc.exitcode(config.EXIT_WAIT)
        if code is None:
            self.proc.signal_tree(signal.SIGKILL)
            code = self.proc.exitcode(5.0)
        self._tap.wait_closed(config.OUTPUT_WAIT)
        failure = ProcessFailure(self.rank, self.node, self.proc.pid, code,
                                 self._tap.stderr_tail())
        if self._sink is not None:
            self._sink.post(self, [protocol.exited_message(self.rank, failure.as_dict())])

    def send(self, frame: list[Any]) -> None:
        try:
            self.conn.send(frame)
        except framing.ConnectionLost:
            pass  # its death arrives as EXITED

    def signal(self, rank: int, sig: int) -> None:
        self.proc.signal_group(sig)

    def stacks(self, rank: int, timeout: float) -> str:
        return self._stack_file.take(self.proc.pid, timeout)

    def exit_record(self, rank: int) -> ProcessFailure:
        return ProcessFailure(self.rank, self.node, self.proc.pid, self.proc.exitcode(0),
                              self._tap.stderr_tail())

    def close(self) -> None:
        with self._lock:
            self._buried = True  # stopped on purpose: the group records it
        for fd in list(self._watched):
            self._unwatch(fd)
        self.conn.close()
        self.proc.release()
        self._stack_file.close()


def _alive(channel: Channel) -> bool:
    """Whether a rank's channel still has its process (to answer, or to unmap)."""
    return (isinstance(channel, LocalChannel) and not channel._buried
            and channel.proc.exitcode(0) is None)


class LocalBackend(Backend):
    name = "local"
    can_share = shm.supported()

    def __init__(self) -> None:
        self._gpus = visible_gpus()
        self._blocks: dict[int, tuple[shm.Block, shm.Layout]] = {}  # ref id -> its copy
        self._pool = shm.Pool(_alive)
        self._blocks_lock = threading.Lock()

    def _open(self, output: OutputOptions) -> None:
        self._writer = framing.BacklogWriter()
        self._logs = LogPump(output)
        self._supervisor = Supervisor()

    def gpus_per_node(self, nodes: int) -> int:
        """GPUs each simulated node gets (they split this machine's)."""
        return len(self._gpus) // nodes if nodes > 1 else len(self._gpus)

    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float) -> list[Node]:
        shares = (split_gpus(len(self._gpus), layout.nodes) if layout.nodes > 1
                  else (tuple(range(len(self._gpus))),))
        return [
            Node(index=n, address=_LOOPBACK, ranks=layout.counts[n],
                 gpus=tuple(self._gpus[i] for i in shares[n]))
            for n in range(layout.nodes)
        ]

    @property
    def supervisor_pid(self) -> int | None:
        """The node supervisor's pid, once the backend is open."""
        return self._supervisor.pid if self.opened else None

    def ports(self, node: Node, count: int) -> list[int]:
        return pick_free_ports(node.address, count)

    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        cwd = boot.cwd or os.getcwd()
        for start in ranks:
            env = merge_env(os.environ, start.env, None, None)
            channel = self._spawn(start, env, cwd)
            channels.append(channel)
            init = protocol.init_frame(start.rank, boot.sys_path, dict(boot.options),
                                       boot.payload)
            channel.send(init)

    def _spawn(self, start: RankStart, env: dict[str, str], cwd: str) -> LocalChannel:
        stack_file = StackFile()
        try:
            proc = self._supervisor.spawn(env, cwd, stacks_fd=stack_file.fd)
        except BaseException:
            stack_file.close()
            raise
        try:
            tap = self._logs.attach(start.rank, proc.stdout_fd, proc.stderr_fd)
        except BaseException:  # e.g. its log file vanished: it has no channel to stop it by
            node.stop_processes([proc], force=True)
            for fd in (proc.stdout_fd, proc.stderr_fd, proc.read_fd, proc.write_fd):
                os.close(fd)
            proc.release()
            stack_file.close()
            raise
        stream = streams.PipeStream(proc.read_fd, proc.write_fd, blocking_reads=False)
        return LocalChannel(start, proc, framing.Connection(stream, self._writer), tap, stack_file)

    # -- shared objects (phalanx.controller.shared): one block in this process for every node ------

    def share(self, obj: Any, channels: Sequence[Channel]) -> None:
        """Write the object into a block of this process (a pooled one, see
        :class:`phalanx.node.shm.Pool`) once; tell each rank where it is."""
        if not self.can_share:
            raise NotImplementedError("shared objects need Linux (memfd_create and /proc)")
        with self._blocks_lock:
            held = self._blocks.get(obj.id)
            if held is None:
                if obj.segments is None:
                    return  # freed meanwhile
                layout, size = shm.layout_of(obj.segments)
                block = self._pool.take(size)
                try:
                    block.write(obj.segments, layout)
                except BaseException:
                    block.close()
                    raise
                held = self._blocks[obj.id] = (block, layout)
                obj.segments = None  # the block is the copy now
            block, layout = held
            block.mapped_by.update(channels)
        location = block.location(layout, release=True, writable=obj.tensors)
        for channel in channels:
            channel.send(protocol.share_frame(channel.ranks[0], obj.id, obj.token, location))

    def unshare(self, obj: Any, channels: Sequence[Channel]) -> None:
        for channel in channels:
            channel.send(protocol.unshare_frame(channel.ranks[0], obj.id))
        with self._blocks_lock:
            held = self._blocks.pop(obj.id, None)
            if held is None:
                return
            # reused once each rank told of it let go of every view (RELEASED)
            self._pool.give_back(obj.id, held[0], set(channels) & held[0].mapped_by)
            closed = self._pool.trim()
        self._unmap(closed)

    def released(self, channel: Channel, ref_id: int) -> None:
        with self._blocks_lock:
            self._pool.released(ref_id, channel)
            closed = self._pool.trim()
        self._unmap(closed)

    def _unmap(self, blocks: list[shm.Block]) -> None:
        """Closed blocks: the ranks that mapped them let go of their mappings too."""
        for block in blocks:
            for channel in block.mapped_by:
                if _alive(channel):
                    channel.send(protocol.unmap_frame(channel.ranks[0], block.token))
            block.mapped_by.clear()

    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None:
        procs = [c.proc for c in channels if isinstance(c, LocalChannel)]
        node.stop_processes(procs, grace=grace, force=force)

    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        node.wait_all_exit([c.proc for c in channels if isinstance(c, LocalChannel)], timeout)

    def close(self) -> None:
        with self._blocks_lock:
            held, self._blocks = list(self._blocks.values()), {}
            self._pool.close()
        for block, _ in held:
            block.close()
        if self.opened:
            self._supervisor.close()
            self._logs.stop()
            self._writer.stop()
