"""``phalanx agent``: the daemon on every node (or Kubernetes pod) of a cluster backend.

A controller's :class:`~phalanx.backends.cluster.backend.ClusterBackend` connects to each node's
agent and starts, drives and stops that node's ranks through it
(:mod:`phalanx.backends.cluster.agent.ranks`), over one connection per node. Safe by default:

- it listens on loopback unless told otherwise (``--host``);
- no request is served before the peer proves the shared token with a mutual HMAC
  challenge (:mod:`phalanx.wire.handshake`, constant-time comparisons): a stranger is dropped
  after reading the 8-byte magic, a peer with the wrong token within the handshake's few
  dozen bytes, and nothing is unpickled before that;
- a controller of another phalanx version is refused at the handshake's first exchange,
  the log naming both versions and the side to upgrade;
- after it, frames over ``--max-frame-mib`` are refused (the connection ends, with the
  reason in the log) instead of being allocated;
- each connection has a thread of its own, so one misbehaving client delays no other.

It outlives its controllers: when one goes (its connection ends, or it is silent past
``--heartbeat-timeout``) its ranks are stopped, with everything they started, and the agent
serves the next one. ``--http-port`` serves ``/health`` (for Kubernetes probes) and
``/metrics`` (Prometheus text) over plain HTTP.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import threading
from typing import Any

from phalanx import __version__, config
from phalanx.backends.cluster.agent.ranks import Session
from phalanx.backends.cluster.token import read_token as read_token  # for the CLI
from phalanx.errors import AuthenticationError
from phalanx.node.machine import machine_id, visible_gpus
from phalanx.wire import handshake

logger = logging.getLogger(__name__)

DEFAULT_PORT = config.AGENT_PORT


class Agent:
    """Listens for controllers; one :class:`Session` per authenticated connection."""

    session_class = Session  # what serves a controller (the scale benchmark's ranks in-process)

    def __init__(self, host: str, port: int, token: bytes, *,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 max_frame: int = 1 << 30, handshake_timeout: float = 5.0,
                 metrics: Any = None, tls: ssl.SSLContext | None = None,
                 store: str | os.PathLike[str] | None = None) -> None:
        from phalanx.backends.cluster.codesync import Store, default_store

        self._store = Store(store if store is not None else default_store())
        self._token = token
        self._tls = tls
        self._heartbeat_timeout = heartbeat_timeout
        self._max_frame = max_frame
        self._handshake_timeout = handshake_timeout
        self._metrics = metrics
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._sessions: set[Session] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def health(self) -> dict[str, Any]:
        with self._lock:
            sessions = len(self._sessions)
        return {"ok": not self._stopping.is_set(), "controllers": sessions,
                "version": __version__}

    def serve_forever(self) -> None:
        """Accept controllers until :meth:`stop` (each on a thread of its own)."""
        host, port = self.address
        logger.info("phalanx agent %s listening on %s:%d", __version__, host, port)
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                break
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name="phalanx-agent-conn").start()

    def _serve(self, sock: socket.socket, peer: tuple) -> None:
        try:
            if self._tls is not None:  # TLS first; the token is then proved inside it
                sock.settimeout(self._handshake_timeout)
                sock = self._tls.wrap_socket(sock, server_side=True)
            handshake.accept(sock, self._token, self._handshake_timeout,
                             peer=f"the controller at {peer[0]}:{peer[1]}", own="this agent")
        except (AuthenticationError, ssl.SSLError) as exc:
            self._count("auth_failures_total", 1)
            logger.warning("refused %s:%s: %s", peer[0], peer[1], exc)
            sock.close()
            return
        except OSError as exc:
            logger.info("connection from %s:%s failed: %s", peer[0], peer[1], exc)
            sock.close()
            return
        session = self.session_class(sock, heartbeat_timeout=self._heartbeat_timeout,
                          max_frame=self._max_frame, counters=self._count, store=self._store,
                          secret=self._token)
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return
            self._sessions.add(session)
        self._count("controllers_connected", 1)
        self._count("controllers_total", 1)
        logger.info("serving a controller from %s:%s", peer[0], peer[1])
        try:
            session.serve({"host": socket.gethostname(), "address": session.address,
                           "gpus": list(visible_gpus()), "machine": machine_id(),
                           "pid": os.getpid(), "version": __version__, "cwd": os.getcwd()})
        finally:
            with self._lock:
                self._sessions.discard(session)
            self._count("controllers_connected", -1)
            logger.info("the controller from %s:%s is gone: %s", peer[0], peer[1],
                        session.reason or "it closed the connection")

    def _count(self, name: str, value: float) -> None:
        if self._metrics is not None:
            self._metrics.inc(name, value)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, end every session (stopping their ranks) and wait for that."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        for session in sessions:
            session.ended.wait(timeout)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The agent's TLS: its certificate chain and key (ValueError if they cannot be used)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use --tls-cert {cert} / --tls-key {key}: {exc}") from None
    return context


def run(host: str, port: int, token: bytes, *, http_port: int | None,
        heartbeat_timeout: float, max_frame: int, tls: ssl.SSLContext | None = None,
        store: str | None = None) -> int:
    """``phalanx agent``: serve until SIGINT or SIGTERM; the exit status."""
    metrics = server = None
    try:
        from phalanx.backends.cluster.agent.http import AgentMetrics, HealthServer

        metrics = AgentMetrics()
        agent = Agent(host, port, token, heartbeat_timeout=heartbeat_timeout,
                      max_frame=max_frame, metrics=metrics, tls=tls, store=store)
        if http_port is not None:
            server = HealthServer(host, http_port, metrics, agent.health)
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where is it stuck? kill -USR1
    if server is not None:
        server.start()
    thread = threading.Thread(target=agent.serve_forever, name="phalanx-agent", daemon=True)
    thread.start()
    where = f"{agent.address[0]}:{agent.address[1]}"
    extra = "" if server is None else f", health and metrics on http://{host}:" \
                                      f"{server.address[1]}/health"
    logger.warning("phalanx agent listening on %s%s", where, extra)
    while not stop.wait(1.0):
        pass
    logger.warning("phalanx agent stopping: its controllers' ranks are being stopped")
    agent.stop()
    if server is not None:
        server.close()
    return 0
