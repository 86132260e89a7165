"""A node's connection to its agent, and the channels of the ranks it carries.

Part of the cluster backend (:mod:`phalanx.backends.cluster.backend`): :class:`Dialer` is how
the controller reaches an agent (its token and TLS), :class:`AgentLink` one connection to an
agent (requests, answers, and every rank's events: the
:class:`~phalanx.backends.base.Link` those ranks' channels share), :class:`AgentNode` a node
reached through it -- the agent itself, or in a tree (:mod:`phalanx.backends.cluster.tree`)
any node of its subtree -- and :class:`AgentRankChannel` the channel the group sees for each
rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import select
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from phalanx import config
from phalanx.backends.base import Channel, EventSink, Link, RankStart
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.errors import PhalanxError, ProcessFailure, printable
from phalanx.node.spawn import Burial
from phalanx.output.logs import LogPump, OutputTap
from phalanx.wire import framing, protocol, seal, streams

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 60.0  # seconds for an agent to answer a request that does not wait
CONNECT_RETRY = 0.5  # seconds between attempts to reach an agent that is not up yet


@dataclasses.dataclass(frozen=True)
class Dialer:
    """How this controller reaches an agent: the token it proves and the TLS it speaks.
    The backend makes one and hands it to whatever connects (quorum, tree, membership)."""

    secret: bytes = dataclasses.field(repr=False)
    tls: ssl.SSLContext | None = None

    def connect(self, host: str, port: int, timeout: float) -> agenttree.Joined:
        """An authenticated connection to the agent at ``host:port``, its WELCOME read
        (:func:`phalanx.backends.cluster.tree.connect_agent`: its errors)."""
        return agenttree.connect_agent(host, port, self.secret, self.tls, timeout,
                                       own="this controller")


def parse_host(entry: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; ValueError naming it."""
    host, sep, port = str(entry).rpartition(":")
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        number = 0
    if not sep or not host or not 0 < number < 65536:
        raise ValueError(f"hosts entries must be 'host:port', got {entry!r}")
    return host, number


class AgentNode:
    """A node of the cluster as the controller knows it: reached through ``link`` (its
    own connection, or its top agent's in a tree), named ``tree_id`` there (0: the agent
    the link reaches)."""

    def __init__(self, link: AgentLink, tree_id: int, host: str, port: int,
                 welcome: dict[str, Any]) -> None:
        self.link, self.tree_id = link, tree_id
        self.host, self.port, self.welcome = host, port, welcome
        self.index = -1  # the group's node index, once reserved
        self.same_host = False  # on the controller's machine
        self.code_path: str | None = None  # the shipped code there (sync)
        self.holding: set[int] = set()  # the put objects its agent holds (controller.shared)
        self.lost_reason: str | None = None
        self.label: str | None = None  # what else names it (Slurm's job and node)
        # with a label: what else may explain a rank killed by a signal there, asked as its
        # record is made (px.SlurmBackend: Slurm ending the job), or None when nothing does
        self.explain: Callable[[], str | None] | None = None

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def direct(self) -> bool:
        """Whether the controller's connection reaches this node's agent itself (flat, or
        a tree's top agent), not through the agents above it."""
        return (self.host, self.port) == (self.link.host, self.link.port)

    @property
    def where(self) -> str:
        also = "" if self.label is None else f"{self.label}, "
        return (f"node {self.index} ({also}agent at {self.name})" if self.index >= 0 else
                f"the agent at {self.name}" + ("" if self.label is None else
                                               f" ({self.label})"))

    def request(self, kind: int, *fields: Any, payload: Sequence[Any] = (),
                timeout: float = REQUEST_TIMEOUT) -> Any:
        """Ask this node's agent and wait for its answer; PhalanxError when it fails or the
        node is lost."""
        return self.link.request(kind, *fields, payload=payload, timeout=timeout, target=self)

    def __repr__(self) -> str:
        return f"<AgentNode {self.where}{' lost' if self.lost_reason else ''}>"


class AgentRankChannel(Channel):
    """One rank on an agent's node: its messages travel on the node's :class:`AgentLink`;
    its death (the agent's EXITED, or its node lost) is told by its
    :class:`~phalanx.node.spawn.Burial`, with the output this side read.

    The rank's output reaches the group's output pump through two pipes of this process,
    made when its first bytes come (at once where the pump also writes log files, which
    every rank has): a rank that prints nothing holds no descriptor here, so a controller
    can hold ten thousand ranks of agents."""

    def __init__(self, agent: AgentNode, start: RankStart, incarnation: int,
                 logs: LogPump) -> None:
        self.rank = start.rank
        self.ranks = (start.rank,)
        self.node = start.node
        self.agent = agent
        self.link: AgentLink = agent.link
        self.incarnation = incarnation
        self.pid: int | None = None
        self._exitcode: int | None = None
        self._reason: str | None = None
        self._told: str | None = None  # why its agent ended it, if it did (EXITED's reason)
        self._sink: EventSink | None = None
        self._early: list[list[Any]] = []
        self._lock = threading.Lock()
        self._burial = Burial(start.rank, lambda: self.exit_record(start.rank),
                              lambda event: self.deliver([event]))
        self._logs = logs
        # the output pipes' write ends by stream (None: not made yet; {}: closed)
        self._writers: dict[int, int] | None = None
        self._tap: OutputTap | None = None
        if logs.writes_files:
            self._open_output()

    def _open_output(self) -> dict[int, int]:
        """The rank's output pipes, made now and handed to the output pump (lock held, or
        in the constructor)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._writers = {agentwire.STDOUT: out_w, agentwire.STDERR: err_w}
        self._tap = self._logs.attach(self.rank, out_r, err_r)
        return self._writers

    # -- from the link's reader thread ------------------------------------------------

    def deliver(self, events: list[list[Any]]) -> None:
        sink = self.sink_for(events)
        if sink is not None:
            sink.post(self, events)

    @property
    def sink(self) -> EventSink | None:
        """The sink its events go to, once the group attached it."""
        return self._sink

    def sink_for(self, events: list[list[Any]]) -> EventSink | None:
        """The sink to post ``events`` to; None if they were kept until :meth:`attach`."""
        with self._lock:
            if self._sink is None:
                self._early.extend(events)
            return self._sink

    def output(self, stream: int, data: bytes | None) -> None:
        """Bytes the rank wrote (None: that stream ended), into the local output pump."""
        with self._lock:
            writers = self._writers
            if writers is None:
                if data is None:
                    return  # a stream that ended with no output: nothing to end here
                writers = self._open_output()
            fd = writers.get(stream)
            if fd is None:
                return
            if data is None:
                del writers[stream]
        if data is None:
            os.close(fd)
            return
        try:
            os.write(fd, data)
        except OSError:  # the pump stopped reading: the group is closing
            pass

    def exited(self, failure: dict[str, Any] | None, reason: str | None = None) -> None:
        """The agent reported the rank's end, or (``failure`` None) its node was lost:
        the first of them buries it."""
        with self._lock:
            if not self._burial.claim():
                return
            if failure is not None:
                self.pid = failure.get("pid") or self.pid
                self._exitcode = failure.get("exitcode")
                if failure.get("reason"):  # a rank that broke the protocol, say
                    self._told = printable(failure["reason"])
            self._reason = reason
        self._burial.tell_later(self._settle)

    def _settle(self) -> None:
        """A moment for the rank's last output (relayed by its agent, if it still can)."""
        if self._reason is not None:  # no more output will come: end the streams here
            for stream in list(self._writers or ()):
                self.output(stream, None)
        if self._tap is not None:
            self._tap.wait_closed(config.OUTPUT_WAIT)

    # -- the group's side -------------------------------------------------------------

    def attach(self, sink: EventSink) -> None:
        self.link.watch_with(sink)
        with self._lock:
            self._sink = sink
            early, self._early = self._early, []
        if early:
            sink.post(self, early)

    def receive(self, fd: int) -> list[list[Any]]:
        return []  # never watched: the link posts this rank's events

    def send(self, frame: list[Any]) -> None:
        self.link.send(frame)

    def signal(self, rank: int, sig: int) -> None:
        self.link.send(agentwire.request(agentwire.SIGNAL, 0, self.rank, int(sig),
                                         node=self.agent.tree_id))

    def stacks(self, rank: int, timeout: float) -> str:
        try:
            text: str = self.agent.request(agentwire.STACKS, self.rank, timeout,
                                           timeout=timeout + REQUEST_TIMEOUT)
            return text
        except PhalanxError as exc:
            return f"(no stack: {exc})"

    def exit_record(self, rank: int) -> ProcessFailure:
        tail = () if self._tap is None else self._tap.stderr_tail()
        failure = ProcessFailure(self.rank, self.node, self.pid, self._exitcode, tail,
                                 self._reason or self._told)
        label = self.agent.label
        if failure.reason is None and label is not None:
            # where else its node is named (a Slurm job's node: a signal there is most
            # often the job's end, scancel or its time limit, told before the node is lost)
            why = (self.agent.explain() if self.agent.explain is not None
                   and failure.signal is not None else None)
            failure = dataclasses.replace(failure, reason=(
                f"{failure.cause}, on {label}" if why is None else
                f"killed by {failure.signal}, on {label}: {why}"))
        return failure

    def close(self) -> None:
        with self._lock:
            self._burial.stop()
            writers = list((self._writers or {}).values())
            self._writers = {}
        for fd in writers:
            os.close(fd)
        self.link.forget(self)


class AgentLink(Link):
    """A connection to an agent: requests, and the events of the ranks of every node it
    reaches (the agent's own; in a tree, those of its whole subtree too). The
    :class:`~phalanx.backends.base.Link` their channels share.

    Until the group attaches the first of its ranks, a thread of the link reads it (the
    answers to the first requests); from then on the group's dispatcher watches its socket
    like any channel's and the link hands each rank's events to that rank's channel, with
    no thread in between. A request then waits through the dispatcher (``sink.wait``).
    """

    def __init__(self, joined: Any, writer: framing.BacklogWriter, max_frame: int,
                 on_lost: Callable[[list[AgentNode], str], None] | None = None) -> None:
        self.host, self.port = joined.host, joined.port
        self.where = f"the agent at {self.host}:{self.port}"
        self._conn = joined.connection(writer)
        self._conn.reader.limit = max_frame
        self.nodes: dict[int, AgentNode] = {}  # tree id -> the nodes reached through it
        self._on_lost = on_lost  # told first when nodes are lost (membership)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, list[Any]] = {}  # request id -> [Event, ok, value, node]
        self._channels: dict[int, AgentRankChannel] = {}  # rank -> its current channel
        self.lost_reason: str | None = None
        # when bytes last came from the agent: its own PING every second (from a thread of
        # its own), or anything else it sends -- only a running agent sends either
        self.heard = time.monotonic()
        self._sink: EventSink | None = None  # once the dispatcher watches the socket
        self._handing_over = False
        self._wake = streams.WakePipe()
        self._reader = threading.Thread(target=self._read, name=f"phalanx-agent-{self.host}",
                                        daemon=True)
        self._reader.start()

    # -- sending ----------------------------------------------------------------------

    def send(self, frame: list[Any]) -> None:
        try:
            self._conn.send(frame)
        except framing.ConnectionLost as exc:
            self.lose(f"its connection failed ({exc})")

    def request(self, kind: int, *fields: Any, payload: Sequence[Any] = (),
                timeout: float = REQUEST_TIMEOUT, target: AgentNode | None = None) -> Any:
        """Ask ``target``'s agent (default: this link's) and wait for its answer;
        PhalanxError when it fails or the node is lost."""
        request_id = next(self._ids)
        answer = threading.Event()
        waiter: list[Any] = [answer, False, None, target]  # [Event, ok, value, node]
        where = self.where if target is None else target.where
        with self._lock:
            # the link's own loss too: a node not yet in self.nodes when it went is lost
            lost = self.lost_reason or (target.lost_reason if target is not None else None)
            if lost is not None:
                raise PhalanxError(f"lost {where}: {lost}")
            self._replies[request_id] = waiter
            sink = self._sink
        self.send(agentwire.request(kind, request_id, *fields, payload=payload,
                                    node=0 if target is None else target.tree_id))
        answered = answer.is_set
        done = (sink.wait(answered, timeout) or answered()) if sink is not None else (
            answer.wait(timeout))
        if not done:
            with self._lock:
                self._replies.pop(request_id, None)
            raise PhalanxError(f"{where} did not answer within {timeout:g} s")
        if not waiter[1]:  # the agent's words
            raise PhalanxError(f"{where}: {printable(waiter[2])}")
        return waiter[2]

    # -- receiving --------------------------------------------------------------------

    def _read(self) -> None:
        """The reading thread, until the dispatcher takes the socket over."""
        poller = select.poll()
        poller.register(self._conn.read_fd, select.POLLIN)
        poller.register(self._wake.fd, select.POLLIN)
        reader = self._conn.reader
        try:
            while not self._handing_over:
                ready = [fd for fd, _ in poller.poll()]
                if self._handing_over:
                    return
                if self._conn.read_fd not in ready:
                    self._wake.drain()
                    continue
                frames = reader.recv_frames(block=False)
                self.heard = time.monotonic()
                self._route(frames, None)
        except seal.FrameRejected as exc:
            self.lose(f"its connection was tampered with ({exc})")
        except framing.FrameTooLarge as exc:
            self.lose(f"it sent {exc}")
        except framing.ConnectionLost as exc:
            self.lose(f"its connection ended ({exc})")
        except Exception as exc:  # a bug: the node is unusable, say so
            logger.exception("reading from %s failed", self.where)
            self.lose(f"reading from it failed: {type(exc).__name__}: {exc}")

    def watch_with(self, sink: EventSink) -> None:
        """Hand the socket to ``sink`` (the group's dispatcher): it reads from now on."""
        with self._lock:
            if self._sink is not None or self.lost_reason is not None:
                return
            self._handing_over = True
        self._wake.wake()
        self._reader.join()
        with self._lock:
            if self.lost_reason is not None:
                return
            self._sink = sink
        sink.watch(self._conn.read_fd, self)

    def receive(self, fd: int) -> list[list[Any]]:
        """The dispatcher's read (its thread): each rank's events go to its channel."""
        try:
            frames = self._conn.reader.recv_frames(block=False)
        except seal.FrameRejected as exc:
            self.lose(f"its connection was tampered with ({exc})")
            return []
        except framing.FrameTooLarge as exc:
            self.lose(f"it sent {exc}")
            return []
        except framing.ConnectionLost as exc:
            self.lose(f"its connection ended ({exc})")
            return []
        self.heard = time.monotonic()  # bytes came, whether a frame is complete or not
        if frames:
            self._route(frames, self._sink)
        return []

    def unread(self) -> bool:
        """Whether bytes from the agent wait unread (then it is not silent: this side is
        behind)."""
        pending = getattr(self._conn.stream, "pending", None)  # TLS: decrypted already
        try:
            if pending is not None and pending():
                return True
            poller = select.poll()
            poller.register(self._conn.read_fd, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed meanwhile: its loss is on its way
            return False

    def catch_up(self, timeout: float) -> None:
        """Read what waits from the agent now: through the group's dispatcher once it
        watches the socket (as a waiting thread would), at most ``timeout`` seconds; before,
        the link's own thread reads it anyway."""
        sink = self._sink
        if sink is None or self.lost_reason is not None:
            return
        before = self.heard
        sink.wait(lambda: self.heard != before or self.lost_reason is not None, timeout)

    def _route(self, frames: list[list[Any]], pumping: EventSink | None) -> None:
        """Sort a read: answers, output and deaths here; rank events to their channels,
        delivered at once when ``pumping`` (the dispatcher's own thread), else posted."""
        batches: dict[AgentRankChannel, list[list[Any]]] = {}
        for segs in frames:
            kind, call_id, rank = protocol.unpack_head(segs[0])
            if kind == protocol.RESULT or kind == protocol.YIELD or kind == protocol.HEARTBEAT:
                channel = self._channels.get(rank)
                if channel is not None:
                    batches.setdefault(channel, []).append(segs)
                continue
            if kind == agentwire.RESULTS:  # a subtree's results, gathered (a tree)
                if not self._results(call_id, segs, pumping, batches):
                    return  # malformed: the link is lost
                continue
            extra = protocol.parse(segs[0])[3]
            if kind == agentwire.REPLY:
                self._answer(call_id, *extra)
            elif kind == agentwire.OUTPUT or kind == agentwire.OUTPUT_END:
                channel = self._channels.get(rank)
                # an earlier launch's last output (its end above all) is not the new one's
                if channel is not None and channel.incarnation == call_id:
                    data = bytes(segs[1]) if kind == agentwire.OUTPUT else None
                    channel.output(extra[0], data)
            elif kind == protocol.EXITED:
                channel = self._channels.get(rank)
                if channel is not None and channel.incarnation == call_id:
                    channel.exited(extra[0])
            elif kind == agentwire.PING or kind == agentwire.WELCOME:
                pass
            elif kind == agentwire.LOST:  # the reasons an agent gives go to the log, escaped
                ids, reason = extra
                self.lose_nodes([self.nodes[i] for i in ids if i in self.nodes],
                                printable(reason))
            elif kind == agentwire.FAULT and call_id:  # one request refused: it alone fails
                self._answer(call_id, False, printable(extra[0]))
            elif kind == agentwire.FAULT:
                self.lose(printable(extra[0]))
                return
            else:
                channel = self._channels.get(rank)
                if channel is not None:
                    batches.setdefault(channel, []).append(segs)
        posts: dict[Any, list[tuple[Channel, list[list[Any]]]]] = {}
        for channel, events in batches.items():
            sink = channel.sink_for(events)
            if sink is None:
                continue
            if sink is pumping:
                sink.deliver(channel, events)
            else:
                posts.setdefault(sink, []).append((channel, events))
        for sink, items in posts.items():  # one wake-up for the whole read
            sink.post_all(items)

    def _results(self, call_id: int, segs: list[Any], pumping: EventSink | None,
                 batches: dict[AgentRankChannel, list[list[Any]]]) -> bool:
        """A RESULTS message (a subtree's results, gathered): read in one pass and, on the
        dispatcher's thread, resolved all together (the dispatcher checks each rank is one
        this link carries); else added to the read's batches as each rank's RESULT. False
        when it is malformed: the link is lost, as for any message an agent cannot send."""
        try:
            gathered = agentwire.read_results(segs)
        except Exception as exc:  # noqa: BLE001 - anything it raises: a malformed message
            self.lose(f"it sent a malformed RESULTS ({exc})")
            return False
        if pumping is not None:
            pumping.resolve_results(call_id, gathered, self, self._channels.get)
            return True
        channels = self._channels
        for i, rank in enumerate(gathered.ranks):
            channel = channels.get(rank)
            if channel is not None:
                head = protocol.pack_head(protocol.RESULT, call_id, rank)
                batches.setdefault(channel, []).append([head, *gathered.payload(i)])
        return True

    def _answer(self, request_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            waiter = self._replies.pop(request_id, None)
        if waiter is not None:
            waiter[1], waiter[2] = ok, value
            waiter[0].set()

    # -- ranks ------------------------------------------------------------------------

    def adopt(self, channel: AgentRankChannel) -> None:
        with self._lock:
            self._channels[channel.rank] = channel
            lost = channel.agent.lost_reason
        if lost is not None:
            channel.exited(None, f"lost {channel.agent.where}: {lost}")

    def ranks_of(self, agent: AgentNode) -> tuple[int, ...]:
        """The ranks running on ``agent``'s node now."""
        with self._lock:
            return tuple(sorted(r for r, c in self._channels.items() if c.agent is agent))

    def forget(self, channel: AgentRankChannel) -> None:
        with self._lock:
            if self._channels.get(channel.rank) is channel:
                del self._channels[channel.rank]

    def lose(self, reason: str) -> None:
        """The connection is gone: so is every node reached through it."""
        with self._lock:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            sink = self._sink
        self.lose_nodes(list(self.nodes.values()), reason, everything=True)
        if sink is not None:
            sink.unwatch(self._conn.read_fd, self)
        self._conn.close()

    def lose_nodes(self, nodes: list[AgentNode], reason: str, everything: bool = False) -> None:
        """``nodes`` are gone (or, in a tree, cut off): the requests pending on them fail,
        and every rank on them is dead -- after the membership listener heard of it."""
        with self._lock:
            nodes = [n for n in nodes if n.lost_reason is None]
            for agent in nodes:
                agent.lost_reason = reason
            gone = set(map(id, nodes))
            waiters = [w for w in self._replies.values() if everything or (
                w[3] is not None and id(w[3]) in gone)]
            for key in [k for k, w in self._replies.items() if w in waiters]:
                del self._replies[key]
            channels = [c for c in self._channels.values() if id(c.agent) in gone]
        if not nodes and not waiters:
            return
        for agent in nodes:
            logger.warning("lost %s: %s", agent.where, reason)
        if nodes and self._on_lost is not None:
            self._on_lost(nodes, reason)
        for waiter in waiters:
            waiter[1], waiter[2] = False, f"lost it: {reason}"
            waiter[0].set()
        for channel in channels:
            channel.exited(None, f"lost {channel.agent.where}: {reason}")

    def close(self) -> None:
        """End the connection: the agent stops whatever of ours still runs there."""
        with self._lock:
            self.lost_reason = self.lost_reason or "the group closed it"
            sink, self._sink = self._sink, None
            self._handing_over = True
        if sink is not None:
            sink.unwatch(self._conn.read_fd, self)
        self._wake.wake()
        self._conn.close()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        self._wake.close()
