"""The cluster backend: ranks run on nodes (hosts, Kubernetes pods) served by ``phalanx agent``.

``ClusterBackend(hosts=["10.0.0.5:32300", ...], token=...)`` connects to every listed
agent, proving the shared token both ways (:mod:`phalanx.handshake`), and waits until
``quorum`` of them (default: all) have answered -- past ``quorum_timeout`` it raises
:class:`~phalanx.errors.QuorumTimeout` naming who answered and who did not, and never goes
on with fewer. Node ``i`` of the group is the ``i``-th agent that answered, in the order
the hosts were listed.

One connection per node (an :class:`AgentLink`) carries every rank of that node: a call
whose payload is the same for several of them crosses it once (``rank = MANY``; the agent
hands it to each), and their replies, output and deaths come back over it
(:mod:`phalanx.agentwire`). Each rank still has a channel of its own
(:class:`AgentRankChannel`), so the group sees them exactly as local ranks. A node lost --
its agent killed, its connection cut, or silent past ``heartbeat_timeout`` -- fails every
call pending on its ranks at once, naming the node and the agent.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

from phalanx import agentwire, config, handshake, protocol, streams, wire
from phalanx.backends.base import Backend, Boot, Channel, EventSink, Node, RankStart
from phalanx.errors import AuthenticationError, PhalanxError, ProcessFailure, QuorumTimeout
from phalanx.frameworks import Layout
from phalanx.logs import LogPump, OutputOptions, OutputTap

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 60.0  # seconds for an agent to answer a request that does not wait
CONNECT_RETRY = 0.5  # seconds between attempts to reach an agent that is not up yet


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


class AgentRankChannel(Channel):
    """One rank on an agent's node: its messages travel on the node's :class:`AgentLink`."""

    def __init__(self, link: AgentLink, start: RankStart, incarnation: int,
                 logs: LogPump) -> None:
        self.rank = start.rank
        self.ranks = (start.rank,)
        self.node = start.node
        self.link = link
        self.incarnation = incarnation
        self.pid: int | None = None
        self._exitcode: int | None = None
        self._reason: str | None = None
        self._sink: EventSink | None = None
        self._early: list[list[Any]] = []
        self._lock = threading.Lock()
        self._buried = self._closed = False
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self._writers = {agentwire.STDOUT: self._out_w, agentwire.STDERR: self._err_w}
        self._tap: OutputTap = logs.attach(start.rank, out_r, err_r)

    # -- from the link's reader thread ------------------------------------------------

    def deliver(self, events: list[list[Any]]) -> None:
        sink = self.sink_for(events)
        if sink is not None:
            sink.post(self, events)

    def sink_for(self, events: list[list[Any]]) -> EventSink | None:
        """The sink to post ``events`` to; None if they were kept until :meth:`attach`."""
        with self._lock:
            if self._sink is None:
                self._early.extend(events)
            return self._sink

    def output(self, stream: int, data: bytes | None) -> None:
        """Bytes the rank wrote (None: that stream ended), into the local output pump."""
        with self._lock:
            fd = self._writers.get(stream)
            if fd is None:
                return
            if data is None:
                del self._writers[stream]
        if data is None:
            os.close(fd)
            return
        try:
            os.write(fd, data)
        except OSError:  # the pump stopped reading: the group is closing
            pass

    def exited(self, failure: dict[str, Any] | None, reason: str | None = None) -> None:
        """The agent reported the rank's end, or (``failure`` None) its node was lost."""
        with self._lock:
            if self._buried:
                return
            self._buried = True
            if failure is not None:
                self.pid = failure.get("pid") or self.pid
                self._exitcode = failure.get("exitcode")
            self._reason = reason
        threading.Thread(target=self._bury, name=f"phalanx-bury-{self.rank}",
                         daemon=True).start()

    def _bury(self) -> None:
        if self._reason is not None:  # no more output will come: end the streams here
            for stream in list(self._writers):
                self.output(stream, None)
        self._tap.wait_closed(config.OUTPUT_WAIT)
        event = protocol.exited_message(self.rank, self.exit_record(self.rank).as_dict())
        self.deliver([event])

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
        self.link.send(agentwire.request(agentwire.SIGNAL, 0, self.rank, int(sig)))

    def stacks(self, rank: int, timeout: float) -> str:
        try:
            return self.link.request(agentwire.STACKS, self.rank, timeout,
                                     timeout=timeout + REQUEST_TIMEOUT)
        except PhalanxError as exc:
            return f"(no stack: {exc})"

    def exit_record(self, rank: int) -> ProcessFailure:
        return ProcessFailure(self.rank, self.node, self.pid, self._exitcode,
                              self._tap.stderr_tail(), self._reason)

    def close(self) -> None:
        with self._lock:
            self._closed = self._buried = True
            writers, self._writers = list(self._writers.values()), {}
        for fd in writers:
            os.close(fd)
        self.link.forget(self)


class AgentLink(Channel):
    """The connection to one node's agent: requests, and the node's ranks' events.

    Until the group attaches the first of its ranks, a thread of the link reads it (the
    answers to the first requests); from then on the group's dispatcher watches its socket
    like any channel's and the link hands each rank's events to that rank's channel, with
    no thread in between. A request then waits through the dispatcher (``sink.wait``).
    """

    ranks: tuple[int, ...] = ()

    def __init__(self, index: int, host: str, port: int, sock: socket.socket,
                 welcome: dict[str, Any], writer: wire.BacklogWriter, max_frame: int) -> None:
        self.index, self.host, self.port = index, host, port
        self.node = index
        self.welcome = welcome
        self.where = f"node {index} (agent at {host}:{port})"
        self._conn = wire.Connection(streams.socket_stream(sock), writer)
        self._conn.reader.limit = max_frame
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, list[Any]] = {}  # request id -> [Event, ok, value]
        self._channels: dict[int, AgentRankChannel] = {}  # rank -> its current channel
        self.lost_reason: str | None = None
        self.heard = time.monotonic()
        self._sink: EventSink | None = None  # once the dispatcher watches the socket
        self._handing_over = False
        self._wake = streams.WakePipe()
        self._reader = threading.Thread(target=self._read, name=f"phalanx-agent-{index}",
                                        daemon=True)
        self._reader.start()

    # -- sending ----------------------------------------------------------------------

    def send(self, frame: list[Any]) -> None:
        try:
            self._conn.send(frame)
        except wire.ConnectionLost as exc:
            self.lose(f"its connection failed ({exc})")

    def request(self, kind: int, *fields: Any, payload: Sequence[Any] = (),
                timeout: float = REQUEST_TIMEOUT) -> Any:
        """Ask the agent and wait for its answer; PhalanxError when it fails or is lost."""
        request_id = next(self._ids)
        waiter = [threading.Event(), False, None]
        with self._lock:
            if self.lost_reason is not None:
                raise PhalanxError(f"lost {self.where}: {self.lost_reason}")
            self._replies[request_id] = waiter
            sink = self._sink
        self.send(agentwire.request(kind, request_id, *fields, payload=payload))
        answered = waiter[0].is_set
        done = (sink.wait(answered, timeout) or answered()) if sink is not None else (
            waiter[0].wait(timeout))
        if not done:
            with self._lock:
                self._replies.pop(request_id, None)
            raise PhalanxError(f"{self.where} did not answer within {timeout:g} s")
        if not waiter[1]:
            raise PhalanxError(f"{self.where}: {waiter[2]}")
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
        except wire.FrameTooLarge as exc:
            self.lose(f"it sent {exc}")
        except wire.ConnectionLost as exc:
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

    def attach(self, sink: EventSink) -> None:
        self.watch_with(sink)

    def receive(self, fd: int) -> list[list[Any]]:
        """The dispatcher's read (its thread): each rank's events go to its channel."""
        try:
            frames = self._conn.reader.recv_frames(block=False)
        except wire.FrameTooLarge as exc:
            self.lose(f"it sent {exc}")
            return []
        except wire.ConnectionLost as exc:
            self.lose(f"its connection ended ({exc})")
            return []
        if frames:
            self.heard = time.monotonic()
            self._route(frames, self._sink)
        return []

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
            _, _, _, extra = protocol.parse(segs[0])
            if kind == agentwire.REPLY:
                self._answer(call_id, *extra)
            elif kind == agentwire.OUTPUT or kind == agentwire.OUTPUT_END:
                channel = self._channels.get(rank)
                if channel is not None:
                    data = bytes(segs[1]) if kind == agentwire.OUTPUT else None
                    channel.output(extra[0], data)
            elif kind == protocol.EXITED:
                channel = self._channels.get(rank)
                if channel is not None and channel.incarnation == call_id:
                    channel.exited(extra[0])
            elif kind == agentwire.PING or kind == agentwire.WELCOME:
                pass
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
            lost = self.lost_reason
        if lost is not None:
            channel.exited(None, f"lost {self.where}: {lost}")

    def forget(self, channel: AgentRankChannel) -> None:
        with self._lock:
            if self._channels.get(channel.rank) is channel:
                del self._channels[channel.rank]

    def lose(self, reason: str) -> None:
        """The node is gone: every pending request fails, every rank on it is dead."""
        with self._lock:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            waiters, self._replies = list(self._replies.values()), {}
            channels = list(self._channels.values())
            sink = self._sink
        logger.warning("lost %s: %s", self.where, reason)
        for waiter in waiters:
            waiter[1], waiter[2] = False, f"lost it: {reason}"
            waiter[0].set()
        for channel in channels:
            channel.exited(None, f"lost {self.where}: {reason}")
        if sink is not None:
            sink.unwatch(self._conn.read_fd)
        self._conn.close()

    # -- the Channel interface a link needs no part of ----------------------------------

    def signal(self, rank: int, sig: int) -> None:  # pragma: no cover - links have no rank
        raise NotImplementedError

    def exit_record(self, rank: int) -> ProcessFailure:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """End the connection: the agent stops whatever of ours still runs there."""
        with self._lock:
            self.lost_reason = self.lost_reason or "the group closed it"
            sink, self._sink = self._sink, None
            self._handing_over = True
        if sink is not None:
            sink.unwatch(self._conn.read_fd)
        self._wake.wake()
        self._conn.close()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        self._wake.close()


class ClusterBackend(Backend):
    """Ranks on nodes served by ``phalanx agent`` (see the module's docstring).

    ``hosts``: ``"host:port"`` of each agent. ``token`` (or ``token_file``, or
    ``$PHALANX_TOKEN``): the shared secret the agents were started with. ``quorum``: how
    many agents must answer before the group starts (default: all); ``quorum_timeout``:
    how long to wait for them. ``heartbeat_timeout``: a node silent this long is lost.
    ``max_frame``: the largest frame accepted from an agent.
    """

    name = "cluster"
    shared_links = True

    def __init__(self, hosts: Sequence[str], token: str | bytes | None = None, *,
                 token_file: str | None = None, quorum: int | None = None,
                 quorum_timeout: float = 300.0,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 max_frame: int = 1 << 30, tls: bool | str | ssl.SSLContext | None = None,
                 ) -> None:
        if isinstance(hosts, str) or not hosts:
            raise ValueError(f"hosts must be a non-empty list of 'host:port', got {hosts!r}")
        self.hosts = [f"{h}:{p}" for h, p in map(parse_host, hosts)]
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"hosts lists an agent twice: {self.hosts}")
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        from phalanx.agent import MIN_TOKEN, TOKEN_ENV, read_token

        self.token = token
        self.token_file = token_file
        if token is not None:
            secret = (token.encode() if isinstance(token, str) else bytes(token)).strip()
            if len(secret) < MIN_TOKEN:
                raise ValueError(f"token= holds {len(secret)} bytes; the agents' token has "
                                 f"at least {MIN_TOKEN}")
            self._secret = secret
        elif token_file is not None or os.environ.get(TOKEN_ENV):
            self._secret = read_token(token_file)
        else:
            raise ValueError(f"ClusterBackend needs the agents' token: token=..., "
                             f"token_file=... or ${TOKEN_ENV}")
        if quorum is not None and not (isinstance(quorum, int) and 1 <= quorum <= len(hosts)):
            raise ValueError(f"quorum must be an integer in 1..{len(hosts)}, got {quorum!r}")
        self.quorum = quorum
        if not quorum_timeout > 0:
            raise ValueError(f"quorum_timeout must be > 0 seconds, got {quorum_timeout!r}")
        self.quorum_timeout = quorum_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.max_frame = max_frame
        self.tls = tls
        self._tls = _tls_context(tls)
        self._links: list[AgentLink] = []
        self._incarnations = itertools.count(1)
        self._stopping = threading.Event()

    def __repr__(self) -> str:
        parts = [repr(self.hosts)]
        if self.token is not None:
            parts.append("token=<hidden>")
        elif self.token_file is not None:
            parts.append(f"token_file={self.token_file!r}")
        if self.quorum is not None:
            parts.append(f"quorum={self.quorum}")
        return f"px.ClusterBackend({', '.join(parts)})"

    def __str__(self) -> str:
        return self.name

    def settings(self) -> dict[str, Any]:
        return {"hosts": list(self.hosts), "token": self.token, "token_file": self.token_file,
                "quorum": self.quorum, "quorum_timeout": self.quorum_timeout,
                "heartbeat_timeout": self.heartbeat_timeout, "max_frame": self.max_frame,
                "tls": self.tls}

    # -- connecting -------------------------------------------------------------------

    def _open(self, output: OutputOptions) -> None:
        self._writer = wire.BacklogWriter("phalanx-cluster-writer")
        self._logs = LogPump(output)
        try:
            self._links = self._connect_quorum()
        except BaseException:
            self.close()
            raise
        machine = _machine()
        for link in self._links:
            link.same_host = link.welcome.get("machine") == machine  # type: ignore[attr-defined]
        threading.Thread(target=self._heartbeats, name="phalanx-cluster-heartbeat",
                         daemon=True).start()

    def _connect_quorum(self) -> list[AgentLink]:
        wanted = self.quorum or len(self.hosts)
        deadline = time.monotonic() + self.quorum_timeout
        answered: dict[int, tuple[socket.socket, dict[str, Any]]] = {}
        errors: dict[int, str] = {}
        failure: list[BaseException] = []
        done = threading.Condition()

        def connect(index: int) -> None:
            host, port = parse_host(self.hosts[index])
            while not self._stopping.is_set():
                try:
                    result = self._connect_one(host, port, deadline)
                except AuthenticationError as exc:
                    with done:
                        failure.append(AuthenticationError(f"agent {host}:{port}: {exc}"))
                        done.notify_all()
                    return
                except OSError as exc:
                    with done:
                        errors[index] = str(exc)
                    if time.monotonic() + CONNECT_RETRY >= deadline:
                        return
                    time.sleep(CONNECT_RETRY)
                    continue
                with done:
                    if len(answered) >= wanted:  # the quorum was reached without it
                        result[0].close()
                    else:
                        answered[index] = result
                    done.notify_all()
                return

        threads = [threading.Thread(target=connect, args=(i,), daemon=True,
                                    name="phalanx-cluster-connect")
                   for i in range(len(self.hosts))]
        for thread in threads:
            thread.start()
        with done:
            while len(answered) < wanted and not failure:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                done.wait(remaining)
            enough = len(answered) >= wanted
            self._stopping.set()  # the others stop trying
        for thread in threads:
            thread.join(config.CONNECT_TIMEOUT + 1)
        self._stopping.clear()
        if failure or not enough:
            for sock, _ in answered.values():
                sock.close()
            if failure:
                raise failure[0]
            names = [self.hosts[i] for i in sorted(answered)]
            missing = {self.hosts[i]: errors.get(i, "no answer") for i in
                       range(len(self.hosts)) if i not in answered}
            raise QuorumTimeout(wanted, names, missing, self.quorum_timeout)
        return [AgentLink(node, *parse_host(self.hosts[i]), *answered[i], self._writer,
                          self.max_frame) for node, i in enumerate(sorted(answered))]

    def _connect_one(self, host: str, port: int,
                     deadline: float) -> tuple[socket.socket, dict[str, Any]]:
        timeout = max(0.1, min(config.CONNECT_TIMEOUT, deadline - time.monotonic()))
        sock = socket.create_connection((host, port), timeout=timeout)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=host)
            except ssl.SSLCertVerificationError as exc:
                sock.close()
                raise AuthenticationError(f"the agent at {host}:{port} has a certificate "
                                          f"this controller does not trust: {exc}") from None
            except (OSError, ssl.SSLError):
                sock.close()
                raise
        try:
            try:
                handshake.connect(sock, self._secret,
                                  handshake.Hello(handshake.ROLE_CONTROL, 0, 0), timeout,
                                  peer=f"the agent at {host}:{port}")
            except handshake.HandshakeIncomplete as exc:  # a frozen or restarting agent
                raise OSError(f"the agent at {host}:{port}: {exc}") from None
            sock.settimeout(timeout)
            stream = streams.socket_stream(sock)
            if isinstance(stream, streams.TLSStream):
                stream.timeout = timeout
            reader = wire.FrameReader(stream)
            reader.limit = 1 << 20
            frames: list[list[Any]] = []
            while not frames:
                frames = reader.recv_frames(block=True)
            if isinstance(stream, streams.TLSStream):
                stream.timeout = None
            kind, _, _, extra = protocol.parse(frames[0][0])
            if kind != agentwire.WELCOME:
                raise OSError(f"the agent at {host}:{port} did not introduce itself")
            sock.settimeout(None)
            return sock, extra[0]
        except (OSError, wire.ConnectionLost) as exc:
            sock.close()
            if isinstance(exc, OSError):
                raise
            raise OSError(f"the agent at {host}:{port} closed the connection") from None
        except BaseException:
            sock.close()
            raise

    def _heartbeats(self) -> None:
        interval = max(0.05, min(5.0, self.heartbeat_timeout / 5))
        while not self._stopping.wait(interval):
            now = time.monotonic()
            for link in self._links:
                if link.lost_reason is not None:
                    continue
                if now - link.heard > self.heartbeat_timeout:
                    link.lose(f"it was silent for {now - link.heard:.0f} s")
                else:
                    link.send(agentwire.ping())

    # -- nodes ------------------------------------------------------------------------

    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float) -> list[Node]:
        if layout.nodes > len(self._links):
            raise ValueError(f"nodes={layout.nodes} but {len(self._links)} agents answered "
                             f"({', '.join(self.hosts)})")
        return [Node(index=n, address=link.welcome.get("address") or link.host,
                     ranks=layout.counts[n], gpus=tuple(link.welcome.get("gpus") or ()),
                     same_host=link.same_host)  # type: ignore[attr-defined]
                for n, link in enumerate(self._links[:layout.nodes])]

    def ports(self, node: Node, count: int) -> list[int]:
        return list(self._links[node.index].request(agentwire.PORTS, count))

    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        link = self._links[node.index]
        starts = []
        for start in ranks:
            channel = AgentRankChannel(link, start, next(self._incarnations), self._logs)
            channels.append(channel)
            starts.append((start.rank, start.node, channel.incarnation, dict(start.env)))
        for channel in channels:
            link.adopt(channel)  # type: ignore[arg-type]
        same = node.same_host
        pids = link.request(agentwire.LAUNCH, starts, list(boot.sys_path) if same else [],
                            dict(boot.options), (boot.cwd or os.getcwd()) if same else None,
                            payload=boot.payload)
        for channel, pid in zip(channels, pids, strict=False):
            channel.pid = pid or None  # type: ignore[attr-defined]

    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None:
        for link, ranks in _by_link(channels).items():
            try:
                link.request(agentwire.STOP, ranks, grace, force,
                             timeout=grace + config.CLEANUP_WAIT + REQUEST_TIMEOUT)
            except PhalanxError as exc:
                logger.debug("stopping ranks %s: %s", ranks, exc)

    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        for link, ranks in _by_link(channels).items():
            try:
                link.request(agentwire.WAIT, ranks, timeout, timeout=timeout + REQUEST_TIMEOUT)
            except PhalanxError:
                pass

    def close(self) -> None:
        self._stopping.set()
        for link in self._links:
            link.close()
        if self.opened:
            self._logs.stop()
            self._writer.stop()


def _tls_context(tls: bool | str | ssl.SSLContext | None) -> ssl.SSLContext | None:
    """``tls``: None/False (plain TCP), True (the system's CAs), a CA file, or a context."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, (str, os.PathLike)):
        try:
            return ssl.create_default_context(cafile=os.fspath(tls))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls={tls!r}: cannot load the CA certificates: {exc}") from None
    raise TypeError(f"tls must be True, a CA file or an ssl.SSLContext, got {tls!r}")


def _by_link(channels: Sequence[Channel]) -> dict[AgentLink, list[int]]:
    groups: dict[AgentLink, list[int]] = {}
    for channel in channels:
        if isinstance(channel, AgentRankChannel):
            groups.setdefault(channel.link, []).append(channel.rank)
    return groups


def _machine() -> str:
    from phalanx.agent import machine_id

    return machine_id()
