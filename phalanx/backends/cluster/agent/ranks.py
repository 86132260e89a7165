"""One controller's ranks on an agent's node: started, relayed, watched and stopped.

A :class:`Session` serves one authenticated controller connection. Its ranks are started
by the local backend's spawner (:class:`phalanx.node.spawn.RankSpawner`, with a node
supervisor of the session's own: environment before import, one keeper per rank, every
process a rank starts kept below it), and one thread relays between them and the
controller:

- a rank's frames go to the controller unchanged (the rank is in each header); a frame for
  several of this node's ranks (``rank = MANY``) arrived once and is handed to each;
- a rank speaks for itself alone: every frame up its pipe must name it, be of a kind a rank
  sends (READY, INIT_ERROR, RESULT, YIELD, ERROR, HEARTBEAT, RELEASED, COLLECTIVE), and
  answer only a call this session passed down to it and it has not answered yet (each
  rank's outstanding call ids: a set add as a call goes down, a removal as its RESULT or
  ERROR comes up). A rank that breaks this is ended (SIGKILL), nothing more of it goes up,
  and its EXITED says so (``rank 0 broke the protocol: it sent an answer as rank 1
  (ended by the agent)``): through an agent, whose ranks share one connection, the
  controller could not tell rank 0's forged answer from rank 1's;
- what a rank writes to stdout and stderr goes up as OUTPUT messages, then OUTPUT_END;
- its death (the keeper's status pipe) goes up as EXITED with the node side's failure
  record (:meth:`phalanx.node.spawn.NodeRank.failure`), after its last frames and, for a
  moment (``config.OUTPUT_WAIT``), its last output: its :class:`phalanx.node.spawn.Burial`,
  which the relay loop polls where a channel at the controller waits on a thread.

Put objects the controller sends (HOLD), and copies of kept results fetched from other
agents (COPY), are the session's :class:`NodeObjects`.

Nothing from the controller is acted on before it is checked: the frame's size and segment
count from its prefix (:class:`phalanx.wire.framing.FrameReader`), then its header and every
field (:func:`phalanx.backends.cluster.messages.check_request`). A count over its limit in
:mod:`phalanx.config` is refused with a FAULT naming the field, the value and the limit, and
the session goes on; a frame or message that cannot be read gets a FAULT saying what was
wrong, one warning in the log, and the session ends.

Requests that wait (STOP, STACKS, WAIT) run on short threads so the relay never stalls. A
controller whose connection ends, or that stays silent past ``heartbeat_timeout``, is gone:
every rank of its session is stopped, with everything those ranks started.

The session's sign of life (PING, every second) does not come from the relay: one thread
of the agent's process (:class:`Pulse`) sends it for every session, so that neither the
ranks' code nor a busy relay loop can delay it. Only a frozen agent (stopped, its machine
gone) or a cut link silences it: the controller (or, in a tree, the parent agent) judges
that silence by its ``node_timeout``. Every control connection also has TCP keepalive
(:func:`phalanx.wire.streams.keep_alive`).

In a tree (:mod:`phalanx.backends.cluster.tree`) the session's :class:`Branch` holds its
children's connections: a node's request for another node goes to the child whose subtree
holds it, a rank's message to the children whose subtrees hold its ranks (the payload once
per child, the header naming that subtree's ranks), and whatever a child sends comes up
unchanged -- results gathered for a moment, failures at once. A child lost (its connection
ended, or silent past the agent's ``node_timeout``) is reported up as LOST with every node of its
subtree; those below it see their upstream go and stop their ranks.

The session is made of parts, each with its own state: the spawner (starting ranks), the
branch (the tree), the node's objects (put); the relay loop here drives them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.cluster import codesync
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.agent.branch import GATHER_WINDOW, Branch, Relay
from phalanx.backends.cluster.agent.detached import DetachedBook, Detachment
from phalanx.backends.cluster.agent.devices import NodeDevices
from phalanx.backends.cluster.agent.share import NodeObjects
from phalanx.backends.cluster.agent.share import read as read_kept
from phalanx.errors import ProcessFailure
from phalanx.node import spawn as node
from phalanx.node.machine import pick_free_ports, visible_gpus
from phalanx.wire import framing, protocol, seal, streams

logger = logging.getLogger(__name__)

_READ = 1 << 16
_HEAD_SIZE = protocol.HEAD_SIZE
_unpack_head = protocol.unpack_head
_RESULT, _ERROR, _YIELD = protocol.RESULT, protocol.ERROR, protocol.YIELD
_READY = protocol.READY
# what else a rank may send up, none of it about a call
_SAYS = frozenset({protocol.READY, protocol.INIT_ERROR, protocol.HEARTBEAT, protocol.RELEASED,
                   protocol.COLLECTIVE})


class Pulse:
    """One thread that sends each session's sign of life (PING) up, every session's own
    interval: nothing a session's relay loop or its ranks do can delay it. Started with the
    first session, it ends when the last one does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[Session, float] = {}  # session -> when its next PING goes
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, session: Session) -> None:
        with self._lock:
            self._due[session] = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="phalanx-agent-pulse",
                                                daemon=True)
                self._thread.start()
        self._changed.set()

    def remove(self, session: Session) -> None:
        with self._lock:
            self._due.pop(session, None)
        self._changed.set()

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self._lock:
                if not self._due:
                    self._thread = None
                    return
                due = [s for s, when in self._due.items() if when <= now]
                for session in due:
                    self._due[session] = now + session.ping_interval
                wait = min(self._due.values()) - now
            for session in due:
                try:
                    session.ping()
                except Exception:  # a bug in one session must not silence the others
                    logger.exception("an agent session's PING failed")
            self._changed.wait(max(0.0, min(1.0, wait)))
            self._changed.clear()


PULSE = Pulse()  # the agent process's


class _Rank:
    """One running rank of the session: its process on this node, what the relay keeps of
    it (its output pipes, relayed here), the calls it was sent and has not answered, and
    its burial (EXITED naming its launch)."""

    def __init__(self, process: node.NodeRank) -> None:
        self.process = process
        self.rank, self.node, self.incarnation = process.rank, process.node, process.incarnation
        self.conn = process.conn
        stdout_fd, stderr_fd = process.take_output()
        self.outputs = {stdout_fd: agentwire.STDOUT, stderr_fd: agentwire.STDERR}
        # the calls passed down to it, not answered yet: id -> method
        self.calls: dict[int, str] = {}
        self.broke: str | None = None  # how it broke the protocol, once it did
        self.ready: list[Any] | None = None  # its READY, sent again to a controller attaching
        # the node side's record, no stderr: its controller has the output relayed to it
        self.burial = node.Burial(process.rank, self._record, message=lambda failure: (
            agentwire.exited(process.rank, process.incarnation, failure.as_dict())))
        self.counted = False  # in the agent's ranks_alive

    def _record(self) -> ProcessFailure:
        failure = self.process.failure()
        return failure if self.broke is None else dataclasses.replace(failure, reason=self.broke)


class Session:
    """The node side of one controller's group (run :meth:`serve` on a thread)."""

    def __init__(self, sock: socket.socket, *, heartbeat_timeout: float, max_frame: int,
                 counters: Callable[[str, float], None], cwd: str | None = None,
                 store: codesync.Store | None = None, secret: bytes | None = None,
                 auth: seal.FrameAuth | None = None,
                 node_timeout: float = config.DEFAULT_NODE_TIMEOUT,
                 devices: NodeDevices | None = None,
                 peer_tls: ssl.SSLContext | None = None,
                 max_held: int | None = None, book: DetachedBook | None = None,
                 peer: str = "") -> None:
        # its link's options were set as the agent took it (Agent._authenticate)
        self.address = sock.getsockname()[0]  # where the controller reached this node
        self._writer = framing.BacklogWriter("phalanx-agent-writer")
        # auth: the handshake's frame keys, which seal and check every frame from here on
        self._conn: framing.Connection | None = framing.Connection(
            streams.socket_stream(sock), self._writer, auth=auth)
        self._conn.reader.limit = max_frame
        self._conn.reader.max_segments = config.AGENT_MAX_FRAME_SEGMENTS
        self._heartbeat_timeout = heartbeat_timeout
        # a sign of life every second: whoever judges this node's silence may do so after two
        self.ping_interval = max(0.05, min(1.0, heartbeat_timeout / 5, node_timeout / 5))
        self._count = counters
        self._cwd = cwd or os.getcwd()
        self._store = store
        self._spawner = node.RankSpawner(self._writer)
        self._ranks: dict[int, _Rank] = {}
        self._by_fd: dict[int, tuple[str, Any]] = {}  # fd -> what it is, whose (rank, child)
        self._poller = select.poll()
        self._wake = streams.WakePipe()
        self._lock = threading.Lock()
        self._launched: list[tuple[int, _Rank]] = []  # from request threads, to register
        self._requests = 0  # requests running on threads of their own (lock held)
        self._closing = False
        self._outbox: list[Any] | None = None
        self._dying: list[_Rank] = []  # ended, their EXITED not sent yet
        self.ended = threading.Event()
        self.reason = ""
        self._branch = Branch(Relay(self._writer, self._lock, self._wake.wake,
                                    node_timeout, self._send, self._queue,
                                    self._watch_child, self._unwatch), secret, peer_tls)
        # peer_tls: how this agent reaches other agents (children, kept results' sources)
        self._objects = NodeObjects(self._lock, self._node_ranks, secret, self._writer,
                                    peer_tls, max_bytes=max_held)  # None: the default
        # the node's GPUs, one book for every controller the agent serves
        self._devices = devices if devices is not None else NodeDevices(visible_gpus())
        # a detached group's (phalanx.backends.cluster.agent.detached): the agent's book of
        # them, this session's record once its controller made it detachable, and a
        # controller taking it over (set by that controller's session, taken by the relay)
        self._book = book
        self._peer = peer  # the controller's address, as "host:port"
        self._detach: Detachment | None = None
        self._incoming: tuple[Any, ...] | None = None
        # (the connection, why) when a send to the controller failed on another thread
        self._link_failed: tuple[framing.Connection, str] | None = None
        self._handed_over = False  # this session's connection went to a waiting session
        self._heard = time.monotonic()  # when the controller was last heard

    @property
    def tree_id(self) -> int:
        """This node's id in a tree (0: none)."""
        return self._branch.tree_id

    # -- the relay loop ---------------------------------------------------------------

    def serve(self, welcome: dict[str, Any]) -> None:
        """Relay until the controller goes; then stop every rank. ``welcome`` is sent first."""
        self._send(agentwire.request(agentwire.WELCOME, 0, welcome))
        assert self._conn is not None  # (None only while a detached group waits)
        self._watch(self._conn.read_fd, "controller", None)
        self._watch(self._wake.fd, "wake", None)
        PULSE.add(self)  # this node's sign of life, from a thread of its own
        self._heard = time.monotonic()
        interval = self.ping_interval  # how often the children are judged and pinged
        next_check = self._heard + interval
        branch = self._branch
        try:
            while not self._closing:
                # what this pass sends the controller (a lost child's LOST too): one write
                self._outbox = []
                if self._incoming is not None:
                    self._adopt_controller()
                now = time.monotonic()
                detach = self._detach
                if detach is not None and detach.waiting():
                    if detach.expired(now):
                        self.reason = (f"no controller attached to detached group "
                                       f"{detach.name} within its {detach.timeout:g} s")
                        break
                    until = now + detach.remaining(now)
                else:
                    link_failed, self._link_failed = self._link_failed, None
                    failed = (link_failed[1] if link_failed is not None
                              and link_failed[0] is self._conn else None)  # (not an old one)
                    if failed is None and now - self._heard > self._heartbeat_timeout:
                        failed = f"the controller was silent for {now - self._heard:.0f} s"
                    if failed is not None:
                        if self._wait_detached(failed):
                            continue
                        self.reason = self.reason or failed
                        break
                    until = self._heard + self._heartbeat_timeout
                if now >= next_check:
                    next_check = now + interval
                    if branch.has_children:
                        branch.check_children(now)
                wait = min(next_check, until) - now
                if self._dying:
                    wait = min(wait, min(r.burial.deadline for r in self._dying) - now)
                if branch.gathering:
                    wait = min(wait, GATHER_WINDOW)
                if self._outbox:  # a lost child's LOST: up at once
                    wait = 0
                for fd, _ in self._poller.poll(max(0, int(wait * 1000)) + 1):
                    what, rank = self._by_fd.get(fd, ("gone", None))
                    if what == "controller":
                        self._heard = time.monotonic()
                        if not self._from_controller():
                            break
                        if self._handed_over:
                            break
                    elif what == "wake":
                        self._wake.drain()
                    elif what == "control":
                        self._from_rank(rank)
                    elif what == "output":
                        self._output(fd, rank)
                    elif what == "death":
                        self._died(rank)
                    elif what == "child":
                        branch.from_child(rank)
                if self._launched:
                    self._register_launched()
                if branch.adopting:
                    branch.register_children()
                if self._dying:
                    self._report_deaths()
                if branch.gathering:
                    branch.send_gathered()
                if self._outbox:
                    self._flush()
        except Exception:  # a bug must not leave the controller's ranks running
            logger.exception("an agent session failed")
            self.reason = self.reason or "the agent's session failed"
        finally:
            self._end()

    def _from_controller(self) -> bool:
        conn = self._conn
        if conn is None:  # pragma: no cover - its descriptor is watched only while it is set
            return True
        try:
            frames = conn.reader.recv_frames(block=False)
        except framing.FrameTooLarge as exc:  # say why before hanging up
            return self._refuse(str(exc))
        except framing.ConnectionLost as exc:
            if self._wait_detached(f"its connection ended ({exc})"):
                return True
            self.reason = self.reason or f"the controller's connection ended ({exc})"
            self._closing = True
            return False
        self._count("received_bytes_total",
                    sum(memoryview(s).nbytes for segs in frames for s in segs))
        branch = self._branch
        if branch.adopting:
            branch.register_children()
        for segs in frames:
            try:
                kind, call_id, ranks, extra = protocol.parse(segs[0])
            except Exception as exc:  # noqa: BLE001 - unpickling bad bytes raises anything
                return self._refuse(f"a malformed message header ({type(exc).__name__}: "
                                    f"{exc})")
            try:
                agentwire.check_request(kind, extra, segs[1:])
            except agentwire.Malformed as exc:
                return self._refuse(f"a malformed message ({exc})")
            except agentwire.OverLimit as exc:  # refused before any work; the session goes on
                logger.warning("refused a request of the controller: %s", exc)
                self._send(agentwire.fault(f"it refused a request: {exc}", call_id))
                continue
            if agentwire.is_node_message(kind):
                if ranks[0] and ranks[0] != branch.tree_id:
                    branch.route_down(ranks[0], kind, call_id, extra, segs)
                else:
                    self._request(kind, call_id, extra, segs[1:])
                continue
            if branch.routes_ranks:
                if kind == protocol.CALL:
                    branch.expect(call_id, ranks, extra[0])
                ranks = branch.hand_down(ranks, segs)
            call = kind == protocol.CALL or kind == protocol.CALL_STREAM
            if call:
                self._count("calls_total", len(ranks))
            # a rank reads a call or a shutdown for several ranks as its own: same bytes
            shared = len(ranks) == 1 or call or kind == protocol.SHUTDOWN
            same = framing.frame(list(segs)) if shared else None
            for rank in ranks:
                target = self._ranks.get(rank)
                if target is None or target.burial.claimed:
                    if branch.gathering:
                        branch.rank_gone((rank,))
                    continue  # its EXITED is on its way (or went)
                if call:  # before it can answer: the relay reads its answer after this
                    target.calls[call_id] = extra[0]
                frame = same if same is not None else framing.frame(
                    [protocol.header(kind, call_id, rank, *extra), *segs[1:]])
                target.conn.send(frame)  # (quiet: a dead rank's death comes by its status)
        return True

    def _refuse(self, what: str) -> bool:
        """The controller sent something the session cannot go on after: a FAULT says
        what, one line in the log (no traceback: it is the peer's fault, not a bug), and
        the session ends."""
        logger.warning("ending a controller's session: it sent %s", what)
        self.reason = f"the controller sent {what}"
        self._send(agentwire.fault(f"it refused {what}"))
        self._closing = True
        return False

    # -- ranks ------------------------------------------------------------------------

    def _from_rank(self, rank: _Rank) -> None:
        try:
            frames = rank.conn.reader.recv_frames(block=False)
        except framing.ConnectionLost as exc:
            if isinstance(exc, framing.FrameTooLarge):  # bytes that are no frame
                logger.warning("closing the control stream of rank %d: it sent %s",
                               rank.rank, exc)
            self._unwatch(rank.conn.read_fd)
            if not rank.burial.claimed:  # dying, or of no use: its exit status follows
                rank.process.stream_ended()  # (or came with the stream's end: read it now)
                self._died(rank)
            return
        self._up(rank, frames)

    def _up(self, rank: _Rank, frames: list[list[Any]]) -> None:
        """Messages of a rank of this node for the controller (a result the tree gathers
        is held a moment), each checked to be the rank's own to send (see the module
        docstring); the first that is not ends the rank, and drops what follows it."""
        if rank.broke is not None:
            return
        up = self._branch.up
        number, calls = rank.rank, rank.calls
        for segs in frames:
            first = segs[0]
            if len(first) < _HEAD_SIZE:
                self._broke(rank, f"it sent a malformed message header ({len(first)} bytes)")
                return
            head = _unpack_head(first)
            kind, call_id, sender = head
            if sender != number:
                what = "an answer" if kind in (_RESULT, _ERROR, _YIELD) else "a message"
                self._broke(rank, f"it sent {what} as rank {sender}" if sender != protocol.MANY
                            else f"it sent {what} as several ranks")
                return
            if kind == _RESULT or kind == _ERROR:
                if call_id not in calls:
                    self._broke(rank, f"it answered call {call_id}, which was not sent to it "
                                "or was answered already")
                    return
                del calls[call_id]
                detach = self._detach
                if detach is not None and detach.inherited and detach.orphaned(
                        number, rank.node, rank.process.pid, call_id, kind == _RESULT, segs):
                    continue  # a call of a controller that left: kept for the next one
            elif kind == _YIELD:
                if call_id not in calls:
                    self._broke(rank, f"it sent an item of call {call_id}, which was not sent "
                                "to it or was answered already")
                    return
            elif kind not in _SAYS:
                self._broke(rank, f"it sent a message of kind {kind}, which no rank sends")
                return
            elif kind == _READY:
                rank.ready = [bytes(s) for s in segs]
            up(segs, head)

    def _broke(self, rank: _Rank, why: str) -> None:
        """``rank`` broke the protocol: it is ended (SIGKILL), nothing more of it goes up,
        and its EXITED says why."""
        rank.broke = f"rank {rank.rank} broke the protocol: {why} (ended by the agent)"
        logger.warning("ending rank %d of a controller's group: it broke the protocol: %s",
                       rank.rank, why)
        self._unwatch(rank.conn.read_fd)
        if not rank.burial.claimed:  # its exit status follows on the status pipe
            rank.process.stream_ended()
            self._died(rank)

    def _queue(self, frame: list[Any]) -> None:
        """Send ``frame`` with the rest of this pass (relay thread only)."""
        if self._outbox is None:
            self._send(frame)
        else:
            self._outbox.extend(frame)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, None
        if outbox:
            if all(type(s) is bytes for s in outbox):
                outbox = [b"".join(outbox)]
            self._send(outbox)

    def _output(self, fd: int, rank: _Rank) -> None:
        try:
            data = os.read(fd, _READ)
        except OSError:
            data = b""
        stream = rank.outputs.get(fd, agentwire.STDOUT)
        if data:
            self._queue(agentwire.output(rank.rank, rank.incarnation, stream, data))
            return
        self._unwatch(fd)
        os.close(fd)
        rank.outputs.pop(fd, None)
        self._queue(agentwire.output_end(rank.rank, rank.incarnation, stream))

    def _died(self, rank: _Rank) -> None:
        """Its exit status is in (unless the pipe brought its pid): its last frames go up."""
        if rank.process.exitcode(0) is None or not rank.burial.claim():
            return
        if rank.process.death_fd is not None:
            self._unwatch(rank.process.death_fd)
        self._up(rank, rank.process.drain())  # what it sent before it ended
        self._dying.append(rank)

    def _report_deaths(self) -> None:
        """EXITED for each dying rank whose output ended, or whose moment passed."""
        now = time.monotonic()
        for rank in list(self._dying):
            if rank.outputs and now < rank.burial.deadline:
                continue
            self._dying.remove(rank)
            for fd in list(rank.outputs):
                self._unwatch(fd)
                os.close(fd)
            rank.outputs.clear()
            exited = rank.burial.exited()  # before its process is released
            self._forget(rank)
            if self._branch.gathering:
                self._branch.rank_gone((rank.rank,))
            self._queue(exited)

    # -- requests ---------------------------------------------------------------------

    def _request(self, kind: int, request_id: int, fields: tuple[Any, ...],
                 payload: list[Any]) -> None:
        if kind == agentwire.PING:
            return
        if kind == agentwire.SIGNAL:
            rank, sig = fields
            target = self._ranks.get(rank)
            if target is not None:
                target.process.signal(sig)
            return
        if kind == agentwire.DROP:
            self._objects.drop(*fields)
            return
        if kind == agentwire.ATTACH:  # on the relay's thread: the connection may move
            self._attach(request_id, *fields)
            return
        handlers: dict[int, Callable[..., Any]] = {
            agentwire.LAUNCH: self._launch, agentwire.STOP: self._stop,
            agentwire.STACKS: self._stacks, agentwire.PORTS: self._ports,
            agentwire.WAIT: self._wait, agentwire.SYNC: self._sync,
            agentwire.BLOBS: self._blobs, agentwire.TREE: self._tree,
            agentwire.ADOPT: self._branch.adopt, agentwire.HOLD: self._objects.hold,
            agentwire.COPY: self._objects.copy, agentwire.READ: read_kept,
            agentwire.DEVICES: self._hold_devices, agentwire.DETACH: self._detachable,
            agentwire.DESCRIBE: self._describe, agentwire.ORPHANS: self._orphans}
        handler = handlers.get(kind)
        if handler is None:
            self._send(agentwire.reply(request_id, False, f"unknown request kind {kind}"))
            return
        if kind == agentwire.HOLD:
            try:
                self._objects.check_room(fields[0])
            except agentwire.OverLimit as exc:
                logger.warning("refused a request of the controller: %s", exc)
                self._send(agentwire.fault(f"it refused a request: {exc}", request_id))
                return
        instant = kind in (agentwire.PORTS, agentwire.DEVICES, agentwire.DETACH,
                           agentwire.DESCRIBE, agentwire.ORPHANS)  # bounded, no waiting
        if not instant:  # on a thread of its own: as many as the limit allows
            with self._lock:
                if self._requests >= config.AGENT_MAX_REQUESTS:
                    busy = self._requests
                else:
                    busy, self._requests = 0, self._requests + 1
            if busy:
                why = (f"requests in progress: {busy}, the agent's limit "
                       "(phalanx.config.AGENT_MAX_REQUESTS)")
                logger.warning("refused a request of the controller: %s", why)
                self._send(agentwire.fault(f"it refused a request: {why}", request_id))
                return

        def run() -> None:
            try:
                value = handler(*fields, payload=payload)
            except Exception as exc:  # noqa: BLE001 - the controller gets the error's text
                self._send(agentwire.reply(request_id, False, f"{type(exc).__name__}: {exc}"))
            else:
                self._send(agentwire.reply(request_id, True, value))
            finally:
                if not instant:
                    with self._lock:
                        self._requests -= 1

        if instant:
            run()  # its count is bounded: config.AGENT_MAX_PORTS, AGENT_MAX_RANKS
        else:
            threading.Thread(target=run, name="phalanx-agent-request", daemon=True).start()

    def _launch(self, starts: list[tuple[Any, ...]], sys_path: list[str],
                options: dict[str, Any],
                cwd: str | None, payload: list[Any]) -> list[int]:
        options = dict(options)
        python = options.pop("python", None)  # python=: an interpreter of this node's
        started = [_Rank(process) for process in self._spawner.launch(
            starts, cwd or self._cwd, sys_path, options, payload, python=python)]
        pids = [r.process.pid or 0 for r in started]  # before the relay reads their pipes
        with self._lock:
            for rank in started:
                self._objects.share_with(rank)
            self._launched.extend((r.rank, r) for r in started)
        self._wake.wake()
        return pids

    def _register_launched(self) -> None:
        with self._lock:  # from _launched to _ranks at once: a HOLD meanwhile tells each once
            launched, self._launched = self._launched, []
            replaced = [self._ranks.get(number) for number, _ in launched]
            for number, rank in launched:
                self._ranks[number] = rank
        for previous, (_, rank) in zip(replaced, launched, strict=True):
            if previous is not None:
                self._count("restarts_total", 1)
                self._forget(previous)
            self._count("ranks_alive", 1)
            rank.counted = True
            self._watch(rank.conn.read_fd, "control", rank)
            for fd in rank.outputs:
                self._watch(fd, "output", rank)
            if rank.process.death_fd is not None:
                self._watch(rank.process.death_fd, "death", rank)

    def _stop(self, ranks: list[int], grace: float, force: bool, payload: list[Any]) -> None:
        wanted = set(ranks)  # up to config.AGENT_MAX_RANKS of them
        procs = [r.process.proc for n, r in list(self._ranks.items()) if n in wanted]
        node.stop_processes(procs, grace=grace, force=force)

    def _stacks(self, rank: int, timeout: float, payload: list[Any]) -> str:
        target = self._ranks.get(rank)
        if target is None or target.process.pid is None:
            return "(no stack: the rank is not running on this node)"
        return target.process.stacks(timeout)

    def _ports(self, count: int, payload: list[Any]) -> list[int]:
        return pick_free_ports(self.address, count)

    def _hold_devices(self, count: int, holder: str, payload: list[Any]) -> dict[str, Any]:
        answer = self._devices.take(self, count, holder, payload)  # (a pool's: shared)
        if "gpus" in answer and count:
            logger.info("GPUs %s of this node are held by %s", ", ".join(answer["gpus"]),
                        holder)
        return answer

    def _code(self) -> codesync.Store:
        if self._store is None:
            raise RuntimeError("this agent keeps no shipped code (it was started without a "
                               "store)")
        return self._store

    def _sync(self, version: str, listing: list[Any], payload: list[Any]) -> dict[str, Any]:
        tree = self._code().tree(version)
        if tree is not None:
            return {"path": str(tree), "missing": []}
        return {"path": None, "missing": self._code().missing(listing)}

    def _blobs(self, digests: list[str], payload: list[Any]) -> int:
        if len(digests) != len(payload):
            raise ValueError(f"{len(digests)} hashes for {len(payload)} files")
        for digest, data in zip(digests, payload, strict=True):
            self._code().put(digest, bytes(data))
        return len(digests)

    def _tree(self, version: str, listing: list[Any], payload: list[Any]) -> str:
        return str(self._code().build(version, [tuple(entry) for entry in listing]))

    def _wait(self, ranks: list[int], timeout: float, payload: list[Any]) -> None:
        wanted = set(ranks)
        node.wait_all_exit([r.process.proc for n, r in list(self._ranks.items()) if n in wanted],
                           timeout)

    # -- a detached group -------------------------------------------------------------

    def _detachable(self, name: str, timeout: float | None, payload: list[Any]) -> bool:
        """DETACH: the group outlives this controller for ``timeout`` s (None: no more)."""
        if timeout is None:
            if self._book is not None:
                self._book.leave(self)
            self._detach = None
            return True
        if self._book is None:
            raise RuntimeError("this agent keeps no detached groups")
        self._book.enter(name, self)
        spec = bytes(payload[0]) if payload else b""
        record = self._detach
        if record is not None and record.name == name:  # again, by a controller attached:
            record.timeout, record.spec = float(timeout), spec  # its orphans stay
        else:
            self._detach = Detachment(name, float(timeout), spec,
                                      holder=self._peer or "a controller")
        return True

    def _describe(self, name: str, payload: list[Any]) -> Any:
        """DESCRIBE: the detached group ``name`` of this node ("": every one of them)."""
        book = self._book
        if book is None:
            raise RuntimeError("this agent keeps no detached groups")
        names = book.names() if name == "" else [name]
        found = []
        for each in names:
            session = book.find(each)
            described = None if session is None else session.detached_description()
            if described is not None and described["name"] == each:
                found.append(described)
        if name and not found:
            others = ", ".join(book.names()) or "none"
            raise LookupError(f"no detached group named {name!r} on this node (detached "
                              f"here: {others})")
        return found if name == "" else found[0]

    def detached_description(self) -> dict[str, Any] | None:
        """This session's detached group, as DESCRIBE tells it (None: it has none), with
        the node's GPUs it holds (``gpus``: those its ranks were given, which the
        controller that attaches gives the ranks it starts again)."""
        record = self._detach
        return None if record is None else {**record.describe(
            sorted([*self._ranks, *self._branch.ranks_below()])),
            "gpus": self._devices.held(self)}

    def _orphans(self, take: bool, payload: list[Any]) -> list[Any]:
        """ORPHANS: the answers of calls whose controller left before they ended."""
        record = self._detach
        if record is None:
            return []
        found = [o.as_plain() for o in record.orphans]
        if take:
            record.orphans.clear()
        return found

    def _wait_detached(self, why: str) -> bool:
        """The controller left (``why``): a detached group with ranks running waits for
        another (True); anything else ends (False). The relay's thread."""
        record = self._detach
        if record is None or self._closing or not (self._branch.has_children or any(
                not r.burial.claimed for r in self._ranks.values())):
            return False
        conn, self._conn = self._conn, None
        if conn is not None:
            self._unwatch(conn.read_fd)
            conn.close()
        record.left, record.why_left = time.monotonic(), why
        record.inherited = {r.rank: dict(r.calls) for r in self._ranks.values() if r.calls}
        self._branch.inherit(record.keep)  # a tree's: its subtree's answers to them too
        logger.warning("the controller of detached group %s left (%s): its %d rank(s) run "
                       "on; another may attach within %g s", record.name, why,
                       len(self._ranks), record.timeout)
        return True

    def _attach(self, request_id: int, name: str, starts: list[Any], force: bool) -> None:
        """ATTACH (this connection's first word after WELCOME): hand this connection to
        the session of detached group ``name``, which answers it from then on."""
        book, conn = self._book, self._conn
        target = None if book is None else book.find(name)
        if target is self or (target is None and starts and self._detach is None):
            # ranks this connection drives already: a controller that attached through a
            # tree's top agent asks this node below it (or that top agent) for its ranks
            self._answer_attach(request_id, starts, name)
            return
        if target is None or conn is None:
            others = ", ".join(book.names()) if book is not None else ""
            self._send(agentwire.reply(request_id, False, (
                f"LookupError: no detached group named {name!r} on this node (detached "
                f"here: {others or 'none'})")))
            return
        deadline = time.monotonic() + 5.0
        while not conn.flush_some():  # what this session wrote goes before the other's
            if time.monotonic() > deadline:
                self._send(agentwire.reply(request_id, False, (
                    "RuntimeError: this controller does not read what the agent sends")))
                return
            time.sleep(0.001)
        refused = target.take_over(conn, request_id, starts, force, self._peer)
        if refused is not None:
            self._send(agentwire.reply(request_id, False, refused))
            return
        self._unwatch(conn.read_fd)
        self._handed_over = True
        self._closing = True

    def take_over(self, conn: framing.Connection, request_id: int, starts: list[Any],
                  force: bool, peer: str) -> str | None:
        """Another session's connection asks to drive this detached group; the reason it
        may not (text), or None: the relay takes the connection over on its next pass."""
        with self._lock:
            record = self._detach
            if self._closing or record is None:
                return f"RuntimeError: detached group {record.name if record else '?'} ended"
            if self._incoming is not None:
                return (f"RuntimeError: another controller is attaching to detached group "
                        f"{record.name} right now")
            if not record.waiting() and not force:
                return (f"RuntimeError: detached group {record.name} is held by the "
                        f"controller at {record.holder}; attach with force=True to take it "
                        "over (that controller's calls then fail)")
            self._incoming = (conn, request_id, starts, peer)
        self._wake.wake()
        return None

    def _adopt_controller(self) -> None:
        """Take the connection a controller attaching came by (the relay's thread)."""
        with self._lock:
            incoming, self._incoming = self._incoming, None
        if incoming is None or self._detach is None:
            return
        given, request_id, starts, peer = incoming
        record = self._detach
        old, self._conn = self._conn, None
        if old is not None:  # force=True: the old controller is told, and let go
            try:
                old.send(agentwire.fault(f"another controller ({peer}) took detached group "
                                         f"{record.name} over"))
                old.flush_some()
            except framing.ConnectionLost:
                pass
            self._unwatch(old.read_fd)
            old.close()
        conn = framing.Connection(given.stream, self._writer, reader=given.reader,
                                  auth=given.auth)
        self._conn = conn
        self._watch(conn.read_fd, "controller", None)
        self._heard = time.monotonic()
        record.left, record.holder = None, peer or "a controller"
        if not starts:  # a tree's top agent: first, the subtree the controller drives again
            self._send(agentwire.reply(request_id, True, self._branch.subtree()))
            logger.info("a controller from %s attached to detached group %s through this "
                        "node", peer, record.name)
            return
        self._answer_attach(request_id, starts, record.name)
        logger.info("a controller from %s attached to detached group %s (%d rank(s))",
                    peer, record.name, len(starts))

    def _answer_attach(self, request_id: int, starts: list[Any], name: str) -> None:
        """ATTACH's answer for this node's ``starts``: their pids, then each one's READY
        again, as a start would send (an error naming the ranks no longer running)."""
        gone = [start[0] for start in starts if start[0] not in self._ranks
                or self._ranks[start[0]].burial.claimed]
        if gone:
            self._send(agentwire.reply(request_id, False, (
                f"RuntimeError: rank(s) {gone} of detached group {name} are no longer "
                "running on this node")))
            return
        pids = []
        for number, _node, incarnation, _env in starts:
            rank = self._ranks[number]
            rank.incarnation = rank.process.incarnation = incarnation
            pids.append(rank.process.pid or 0)
        self._send(agentwire.reply(request_id, True, pids))
        for number, *_ in starts:
            ready = self._ranks[number].ready
            if ready is not None:
                self._send(framing.frame(list(ready)))

    # -- bookkeeping ------------------------------------------------------------------

    def ping(self) -> None:
        """This node's sign of life, up (the pulse's thread)."""
        if not self._closing:
            self._send(agentwire.ping())

    def _send(self, frame: list[Any]) -> None:
        conn = self._conn
        if conn is None:  # a detached group's, waiting: nobody to tell
            return
        try:
            conn.send(frame)
        except framing.ConnectionLost as exc:
            if self._detach is not None:  # the relay decides (on its thread) what follows
                self._link_failed = (conn, f"its connection failed ({exc})")
            else:
                self._closing = True
            self._wake.wake()
            return
        self._count("sent_bytes_total", sum(memoryview(s).nbytes for s in frame))

    def _watch(self, fd: int, what: str, rank: Any) -> None:
        self._by_fd[fd] = (what, rank)
        self._poller.register(fd, select.POLLIN)

    def _watch_child(self, fd: int, child: Any) -> None:
        self._watch(fd, "child", child)

    def _unwatch(self, fd: int) -> None:
        if self._by_fd.pop(fd, None) is not None:
            self._poller.unregister(fd)

    def _node_ranks(self) -> list[Any]:
        """Every rank of the node, those being launched included (lock held)."""
        return [*self._ranks.values(), *(rank for _, rank in self._launched)]

    def _forget(self, rank: _Rank) -> None:
        if rank.counted:
            rank.counted = False
            self._count("ranks_alive", -1)
        if rank in self._dying:
            self._dying.remove(rank)
        with self._lock:
            if self._ranks.get(rank.rank) is rank:
                del self._ranks[rank.rank]
        self._unwatch(rank.conn.read_fd)
        if rank.process.death_fd is not None:
            self._unwatch(rank.process.death_fd)
        for fd in list(rank.outputs):
            self._unwatch(fd)
            os.close(fd)
        rank.outputs.clear()
        rank.process.close()

    def close(self) -> None:
        """End the session from outside (the agent is stopping)."""
        self._closing = True
        self._wake.wake()

    def _end(self) -> None:
        """The controller is gone: stop every rank and everything they started."""
        PULSE.remove(self)
        if self._book is not None:
            self._book.leave(self)
        ranks = list(self._ranks.values())
        running = [r for r in ranks if r.process.proc.alive()]
        if running:  # not those that ended, their EXITED still on its way
            logger.warning("stopping %d rank(s) of a controller that went away: %s",
                           len(running), self.reason or "the session ended")
        node.stop_processes([r.process.proc for r in ranks], force=True)
        for rank in ranks:
            self._forget(rank)
        self._spawner.close()
        self._objects.close()
        for holder in self._devices.release(self):
            logger.info("the GPUs %s held are free again: its controller is gone", holder)
        self._branch.close()
        if self._conn is not None and not self._handed_over:  # (else: the stream moved)
            self._conn.close()
        self._writer.stop()
        self._wake.close()
        self.ended.set()
