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
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

from phalanx import agentwire, codesync, config, dnsquery, handshake, protocol, streams, wire
from phalanx.backends.agentlink import (
    CONNECT_RETRY,
    REQUEST_TIMEOUT,
    AgentLink,
    AgentRankChannel,
    parse_host,
)
from phalanx.backends.base import Backend, Boot, Channel, Node, RankStart
from phalanx.errors import AuthenticationError, PhalanxError, QuorumTimeout
from phalanx.frameworks import Layout
from phalanx.logs import LogPump, OutputOptions

logger = logging.getLogger(__name__)


class ClusterBackend(Backend):
    """Ranks on nodes served by ``phalanx agent`` (see the module's docstring).

    ``hosts``: ``"host:port"`` of each agent; or ``dns``: a name whose A/AAAA records are
    the agents (a Kubernetes headless Service), all on ``port``, resolved by the system or
    by ``nameserver="host:port"``, and waited for until ``quorum`` of them (default: one)
    are listed. ``token`` (or ``token_file``, or ``$PHALANX_TOKEN``): the shared secret the
    agents were started with. ``quorum``: how many agents must answer before the group
    starts (default: all listed); ``quorum_timeout``: how long to wait for them.
    ``heartbeat_timeout``: a node silent this long is lost. ``max_frame``: the largest frame
    accepted from an agent. ``tls``: True, a CA file or an ``ssl.SSLContext``. ``sync``: a
    directory shipped to every node before ranks start (``group.reload()`` re-ships it).
    """

    name = "cluster"
    shared_links = True

    def __init__(self, hosts: Sequence[str] | None = None, token: str | bytes | None = None,
                 *, dns: str | None = None, port: int = config.AGENT_PORT,
                 nameserver: str | None = None,
                 token_file: str | None = None, quorum: int | None = None,
                 quorum_timeout: float = 300.0,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 max_frame: int = 1 << 30, tls: bool | str | ssl.SSLContext | None = None,
                 sync: str | os.PathLike[str] | None = None) -> None:
        if (hosts is None) == (dns is None):
            raise ValueError("give the agents as hosts=['host:port', ...] or dns='name' "
                             "(one of the two)")
        self.dns, self.port, self.nameserver = dns, port, nameserver
        self.hosts: list[str] = []
        if dns is not None:
            dnsquery.build_query(dns, dnsquery.A, 0)  # a ValueError for a malformed name
            parse_host(f"agents:{port}")  # a ValueError naming a bad port
            if nameserver is not None:
                parse_host(nameserver)
        elif isinstance(hosts, str) or not hosts:
            raise ValueError(f"hosts must be a non-empty list of 'host:port', got {hosts!r}")
        else:
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
        most = len(self.hosts) if dns is None else 1 << 20
        if quorum is not None and not (isinstance(quorum, int) and 1 <= quorum <= most):
            raise ValueError(f"quorum must be an integer in 1..{len(self.hosts)}, got "
                             f"{quorum!r}" if dns is None else
                             f"quorum must be a positive integer, got {quorum!r}")
        self.quorum = quorum
        if not quorum_timeout > 0:
            raise ValueError(f"quorum_timeout must be > 0 seconds, got {quorum_timeout!r}")
        self.quorum_timeout = quorum_timeout
        if not (isinstance(heartbeat_timeout, (int, float)) and heartbeat_timeout >= 2):
            raise ValueError(f"heartbeat_timeout must be at least 2 seconds (agents send a "
                             f"sign of life every second), got {heartbeat_timeout!r}")
        self.heartbeat_timeout = heartbeat_timeout
        self.max_frame = max_frame
        self.tls = tls
        self._tls = _tls_context(tls)
        if sync is not None and not os.path.isdir(sync):
            raise ValueError(f"sync={os.fspath(sync)!r} is not a directory")
        self.sync = sync
        self.code_version: str | None = None  # of the code the nodes run (with sync)
        self._links: list[AgentLink] = []
        self._incarnations = itertools.count(1)
        self._stopping = threading.Event()

    def __repr__(self) -> str:
        parts = [repr(self.hosts)] if self.dns is None else [
            f"dns={self.dns!r}", f"port={self.port}"] + (
            [f"nameserver={self.nameserver!r}"] if self.nameserver else [])
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
        where = ({"hosts": list(self.hosts)} if self.dns is None else
                 {"dns": self.dns, "port": self.port, "nameserver": self.nameserver})
        return {**where, "token": self.token, "token_file": self.token_file,
                "quorum": self.quorum, "quorum_timeout": self.quorum_timeout,
                "heartbeat_timeout": self.heartbeat_timeout, "max_frame": self.max_frame,
                "tls": self.tls, "sync": self.sync}

    # -- connecting -------------------------------------------------------------------

    def _open(self, output: OutputOptions) -> None:
        self._writer = wire.BacklogWriter("phalanx-cluster-writer")
        self._logs = LogPump(output)
        try:
            deadline = time.monotonic() + self.quorum_timeout
            if self.dns is not None:
                self.hosts = self._resolve_quorum(deadline)
            self._links = self._connect_quorum(deadline)
        except BaseException:
            self.close()
            raise
        machine = _machine()
        for link in self._links:
            link.same_host = link.welcome.get("machine") == machine  # type: ignore[attr-defined]
        if self.sync is not None:
            try:
                self.reload_code()
            except BaseException:
                self.close()
                raise
        threading.Thread(target=self._heartbeats, name="phalanx-cluster-heartbeat",
                         daemon=True).start()

    def _resolve_quorum(self, deadline: float) -> list[str]:
        """The agents the DNS name lists, once at least ``quorum`` of them (default: one)
        do; QuorumTimeout naming the name and what it resolved to otherwise."""
        wanted = self.quorum or 1
        found: list[str] = []
        problem = "no address"
        while True:
            try:
                found = dnsquery.resolve(self.dns, self.nameserver)  # type: ignore[arg-type]
                problem = f"{len(found)} address(es): {', '.join(found) or 'none'}"
            except dnsquery.DNSError as exc:
                problem = str(exc)
            if len(found) >= wanted or time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if len(found) < wanted:
            raise QuorumTimeout(wanted, [], {f"{self.dns} (DNS)": problem}, self.quorum_timeout)
        return [f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}" for a in found]

    def _connect_quorum(self, deadline: float) -> list[AgentLink]:
        wanted = self.quorum or len(self.hosts)
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
        same, code = node.same_host, link.code_path
        if code is not None:  # the shipped code first, and the ranks run in it
            for start in starts:
                start[3][codesync.ENV_VERSION] = self.code_version
        sys_path = ([code] if code else []) + (list(boot.sys_path) if same else [])
        cwd = code or ((boot.cwd or os.getcwd()) if same else None)
        pids = link.request(agentwire.LAUNCH, starts, sys_path, dict(boot.options), cwd,
                            payload=boot.payload)
        for channel, pid in zip(channels, pids, strict=False):
            channel.pid = pid or None  # type: ignore[attr-defined]

    def reload_code(self) -> str | None:
        """Ship the ``sync`` directory to every node (only the files a node lacks); the
        code's version, or None without ``sync``. Ranks started from now on run it."""
        if self.sync is None:
            return None
        version, listing = codesync.scan(self.sync)
        errors: list[BaseException] = []

        def ship(link: AgentLink) -> None:
            try:
                link.code_path = _ship(link, self.sync, version, listing)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, naming the node
                errors.append(exc)

        threads = [threading.Thread(target=ship, args=(link,), daemon=True,
                                    name="phalanx-cluster-sync") for link in self._links]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        self.code_version = version
        return version

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


SHIP_CHUNK = 64 << 20  # bytes of files per BLOBS request


def _ship(link: AgentLink, root: Any, version: str, listing: list[codesync.Entry]) -> str:
    """The path of ``version`` on ``link``'s node, sending the files it lacks first."""
    answer = link.request(agentwire.SYNC, version, listing)
    if answer["path"] is not None:
        return answer["path"]
    batch: list[tuple[str, bytes]] = []
    size = 0
    for digest, data in [*codesync.read_blobs(root, listing, answer["missing"]), ("", b"")]:
        if (size + len(data) > SHIP_CHUNK or not digest) and batch:
            link.request(agentwire.BLOBS, [d for d, _ in batch],
                         payload=[b for _, b in batch], timeout=REQUEST_TIMEOUT * 5)
            batch, size = [], 0
        if digest:
            batch.append((digest, data))
            size += len(data)
    return link.request(agentwire.TREE, version, listing, timeout=REQUEST_TIMEOUT * 5)


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
