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
- each connection has a thread of its own, so one misbehaving client delays no other;
- authenticated sessions are capped too (``--max-sessions``, by default
  ``config.AGENT_MAX_SESSIONS``): each holds threads (its own, its writer's) and
  descriptors for as long as its controller stays, so a controller past the cap is sent a
  FAULT naming the limit (its ``connect`` raises it as an OSError, which a ClusterBackend
  retries until its ``quorum_timeout``) and the connection is closed;
- connections still in their handshake are capped (:class:`Admission`): at most
  ``config.AGENT_MAX_UNAUTHENTICATED`` in all (fewer when the descriptor limit is low: a
  quarter of ``RLIMIT_NOFILE``, so that silent strangers never take the descriptors a
  group's ranks need) and ``config.AGENT_MAX_UNAUTHENTICATED_PER_PEER`` from one address;
  one more is closed unheard at once. Each has ``--handshake-timeout`` seconds in all, TLS
  included, then a watchdog shuts it down. The admission shuts a connection down by its
  descriptor's number, so nothing closes that descriptor before the admission released it:
  a failed TLS handshake (``wrap_socket`` closes the socket it fails on, when it runs the
  handshake itself) would otherwise hand the number to the next connection accepted, which
  a later eviction or deadline would then shut down instead;
- what a peer says (a version, a reason) reaches the log only through
  :func:`phalanx.errors.printable`: a stranger's newlines or terminal escapes cannot forge
  a line of the log; and ``phalanx agent`` writes every record's message so
  (:class:`LogLines`), whichever module logged a peer's text;
- the accept loop never dies: when accept() fails (no descriptor left: EMFILE, ENFILE) or
  no thread can start for a connection, it logs once, reports the reason in
  :meth:`Agent.health` (``/health`` answers 503 meanwhile), and backs off
  (``config.AGENT_ACCEPT_BACKOFF`` doubling to ``config.AGENT_ACCEPT_BACKOFF_MAX``) until a
  descriptor and a thread can be had again; then it logs that it recovered and accepts.

It outlives its controllers: when one goes (its connection ends, or it is silent past
``--heartbeat-timeout``) its ranks are stopped, with everything they started, and the agent
serves the next one. It sends each controller a sign of life every second from a thread of
its own (the controller loses the node after its ``node_timeout`` of silence); in a tree, a
child agent silent for ``--node-timeout`` is lost with its subtree. ``--http-port`` serves
``/health`` (for Kubernetes probes) and ``/metrics`` (Prometheus text) over plain HTTP.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.agent.detached import DetachedBook
from phalanx.backends.cluster.agent.devices import NodeDevices
from phalanx.backends.cluster.agent.ranks import Session
from phalanx.backends.cluster.token import read_token as read_token  # for the CLI
from phalanx.errors import AuthenticationError, printable
from phalanx.node.machine import visible_gpus
from phalanx.version import __version__
from phalanx.wire import framing, handshake, seal, streams
from phalanx.wire.admission import Admission
from phalanx.wire.memfd import block_domain, machine_id

logger = logging.getLogger(__name__)

DEFAULT_PORT = config.AGENT_PORT


# accept() failures that say nothing about the agent: the peer was gone before it was taken
_PEER_GONE = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)


class LogLines(logging.Formatter):
    """``phalanx agent``'s log: each record's message on a line of its own, whatever it
    holds (:func:`phalanx.errors.printable`: a controller's, a child agent's or a stranger's
    text reaches the log by many paths); a traceback after it stays as Python wrote it."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record), _LOG_LINE)


_LOG_LINE = 16384  # characters of one record's message in the agent's log


def unauthenticated_limit(nofile: int | None = None) -> int:
    """How many connections may be in their handshake at once: the configured cap, or a
    quarter of this process's descriptor limit if that is less (at least 4)."""
    return handshake.connection_cap(config.AGENT_MAX_UNAUTHENTICATED, nofile)


class Agent:
    """Listens for controllers; one :class:`Session` per authenticated connection."""

    session_class = Session  # what serves a controller (the scale benchmark's ranks in-process)

    def __init__(self, host: str, port: int, token: bytes, *,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 node_timeout: float = config.DEFAULT_NODE_TIMEOUT,
                 max_frame: int = 1 << 30,
                 handshake_timeout: float = config.AGENT_HANDSHAKE_TIMEOUT,
                 metrics: Any = None, tls: ssl.SSLContext | None = None,
                 peer_tls: ssl.SSLContext | None = None,
                 store: str | os.PathLike[str] | None = None,
                 max_unauthenticated: int | None = None,
                 max_unauthenticated_per_peer: int = config.AGENT_MAX_UNAUTHENTICATED_PER_PEER,
                 once: bool = False, max_held: int | None = None,
                 max_sessions: int = config.AGENT_MAX_SESSIONS) -> None:
        from phalanx.backends.cluster.codesync import Store, default_store

        if max_sessions < 1:
            raise ValueError(f"an agent serves at least one session, not max_sessions="
                             f"{max_sessions!r}")
        self._store = Store(store if store is not None else default_store())
        self._token = handshake.stretch(token)  # what the handshake proves (an offline
        # guess of the token costs scrypt); computed once, before the first controller
        self._tls = tls
        self._peer_tls = peer_tls  # to other agents: a tree's children, kept results' sources
        self._heartbeat_timeout = heartbeat_timeout
        self._node_timeout = node_timeout  # a child agent (a tree) silent this long is lost
        self._max_frame = max_frame
        self._max_held = max_held  # bytes of put objects one session holds (None: default)
        self._handshake_timeout = handshake_timeout
        self._metrics = metrics
        limit = unauthenticated_limit() if max_unauthenticated is None else max_unauthenticated
        self._admission = Admission(limit, min(limit, max_unauthenticated_per_peer),
                                    handshake_timeout)
        try:
            self._listener = socket.create_server((host, port),
                                                  backlog=config.AGENT_LISTEN_BACKLOG)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._sessions: set[Session] = set()
        self._detached = DetachedBook()  # groups that outlive their controller, by name
        self._devices = NodeDevices(visible_gpus())  # one book for every controller
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_error: str | None = None  # why the control port cannot accept now
        # once: serve one job, ending as its last connection does (an agent a scheduler
        # started for one controller: its group's connection, a pool's, ...)
        self._once = once
        self.served = threading.Event()  # set as the last of them ends
        self._sessions_started = 0
        self._max_sessions = max_sessions  # authenticated sessions served at once
        self._opening = 0  # sessions counted against that cap, not in _sessions yet

    def idle(self) -> bool:
        """Whether no controller has connected yet."""
        with self._lock:
            return self._sessions_started == 0

    @property
    def address(self) -> tuple[str, int]:
        address: tuple[str, int] = self._listener.getsockname()[:2]  # (IPv6: 4 fields)
        return address

    def health(self) -> dict[str, Any]:
        """``ok`` false, with the ``reason``, while stopping or while the control port cannot
        accept connections; how many controllers it serves."""
        with self._lock:
            sessions = len(self._sessions)
            accept_error = self._accept_error
        report: dict[str, Any] = {"ok": True, "controllers": sessions,
                                  "version": __version__, "gpus": list(self._devices.gpus),
                                  "gpus_held": self._devices.holders()}
        if self._stopping.is_set():
            report.update(ok=False, reason="the agent is stopping")
        elif accept_error is not None:
            report.update(ok=False, reason=f"the control port cannot accept connections: "
                                           f"{accept_error}")
        return report

    def serve_forever(self) -> None:
        """Accept controllers until :meth:`stop` (each on a thread of its own); never ends
        on an error of its own (see the module docstring)."""
        host, port = self.address
        logger.info("phalanx agent %s listening on %s:%d", __version__, host, port)
        watchdog = threading.Thread(target=self._expire_handshakes, daemon=True,
                                    name="phalanx-agent-handshakes")
        watchdog.start()
        while not self._stopping.is_set():
            try:
                failure = self._accept_one()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                failure = f"accept() failed: {exc.strerror or exc}"
            if failure is not None:
                self._weather(failure)

    def _weather(self, failure: str) -> None:
        """Report ``failure`` (once), then back off until a descriptor and a thread can be
        had again. (With no descriptor left accept() fails at once, whether a connection
        waits or not, so retrying accept itself would only spin; once it would not fail,
        a blocking accept waits for the next connection as usual.)"""
        started = time.monotonic()
        logger.warning("the control port cannot take a connection: %s; retrying (health "
                       "reports it until it can)", failure)
        with self._lock:
            self._accept_error = failure
        self._count("accept_errors_total", 1)
        backoff, attempts = config.AGENT_ACCEPT_BACKOFF, 1
        while not self._stopping.wait(backoff):
            backoff = min(backoff * 2, config.AGENT_ACCEPT_BACKOFF_MAX)
            missing = self._missing_resource()
            if missing is None:
                break
            attempts += 1
            self._count("accept_errors_total", 1)
            with self._lock:
                self._accept_error = missing
        with self._lock:
            self._accept_error = None
        if not self._stopping.is_set():
            logger.warning("the control port can take connections again (after %d failed "
                           "attempts over %.1f s)", attempts, time.monotonic() - started)

    def _missing_resource(self) -> str | None:
        """What a connection could not have now (a descriptor, a thread), or None."""
        try:
            os.close(os.dup(self._listener.fileno()))
        except OSError as exc:
            return f"accept() failed: {exc.strerror or exc}"
        # named as a connection's thread: the same start is what must work again
        probe = threading.Thread(target=lambda: None, daemon=True, name="phalanx-agent-conn")
        try:
            probe.start()
        except RuntimeError as exc:
            return f"no thread could start for a connection: {exc}"
        probe.join()
        return None

    def _accept_one(self) -> str | None:
        """Take one connection and start its thread; why that failed, if it did."""
        try:
            sock, peer = self._listener.accept()
        except OSError as exc:
            if exc.errno in _PEER_GONE:
                return None
            raise
        evicted = self._admission.admit(sock, peer[0])
        if evicted is not None:  # strangers cannot hold every slot: the newest is taken
            self._count("handshakes_evicted_total", 1)
            logger.info("took %s:%s: %s", peer[0], peer[1], evicted)
        try:
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name="phalanx-agent-conn").start()
        except RuntimeError as exc:  # "can't start new thread": out of memory or pids
            self._admission.release(sock)
            sock.close()
            return f"no thread could start for a connection: {exc}"
        return None

    def _expire_handshakes(self) -> None:
        interval = min(0.5, self._handshake_timeout / 4)
        while not self._stopping.wait(interval):
            self._admission.expire()

    def _serve(self, raw: socket.socket, peer: tuple[Any, ...]) -> None:
        try:
            sock, auth = self._authenticate(raw, peer)
        finally:
            # released before anything is closed: the watchdog shuts connections down by
            # their descriptor's number, which a closed one would hand to the next socket
            self._admission.release(raw)
        if auth is None:
            sock.close()  # the TLS wrapper, when there is one (the raw socket is detached)
            return
        self._run_session(sock, peer, auth)

    def _authenticate(self, raw: socket.socket,
                      peer: tuple[Any, ...]) -> tuple[socket.socket, seal.FrameAuth | None]:
        """The connection (TLS wrapped, if TLS) and, if its peer proved the token, the
        keys that authenticate every frame after the handshake (None: it did not)."""
        sock = raw
        try:
            streams.tune_link(raw)  # every frame of a session leaves at once
            if self._tls is not None:  # TLS first; the token is then proved inside it
                sock.settimeout(self._handshake_timeout)
                # the TLS handshake is run here, not by wrap_socket: that would close the
                # socket as it fails, while the admission still holds its descriptor's
                # number (see the module docstring); this way _serve closes it, after
                sock = self._tls.wrap_socket(sock, server_side=True,
                                             do_handshake_on_connect=False)
                sock.do_handshake()
            hello = handshake.accept(sock, self._token, self._handshake_timeout,
                                     peer=f"the controller at {peer[0]}:{peer[1]}",
                                     own="this agent")
        except (AuthenticationError, ssl.SSLError) as exc:
            # (a message naming what the peer claimed shows it escaped already: printable()
            # of printable text is that text; this is for any other)
            if raw not in self._admission:  # shut down to make room for a newer one
                logger.debug("dropped %s:%s to make room: %s", peer[0], peer[1], printable(exc))
                return sock, None
            self._count("auth_failures_total", 1)
            logger.warning("refused %s:%s: %s", peer[0], peer[1], printable(exc))
            return sock, None
        except OSError as exc:
            logger.info("connection from %s:%s failed: %s", peer[0], peer[1], printable(exc))
            return sock, None
        return sock, hello.auth

    def _run_session(self, sock: socket.socket, peer: tuple[Any, ...],
                     auth: seal.FrameAuth) -> None:
        with self._lock:  # a place under the cap, taken before the session costs anything
            serving = len(self._sessions) + self._opening
            if serving < self._max_sessions:
                self._opening += 1
        if serving >= self._max_sessions:
            self._turn_away(sock, peer, auth, serving)
            return
        try:
            session = self.session_class(sock, heartbeat_timeout=self._heartbeat_timeout,
                                         node_timeout=self._node_timeout,
                                         max_frame=self._max_frame, counters=self._count,
                                         store=self._store, secret=self._token, auth=auth,
                                         devices=self._devices, peer_tls=self._peer_tls,
                                         max_held=self._max_held, book=self._detached,
                                         peer=f"{peer[0]}:{peer[1]}")
        except BaseException:
            with self._lock:
                self._opening -= 1
            sock.close()
            raise
        with self._lock:
            self._opening -= 1
            if self._stopping.is_set() or self.served.is_set():
                sock.close()  # an agent for one job (once) ends with its last connection
                return
            self._sessions_started += 1
            self._sessions.add(session)
        self._count("controllers_connected", 1)
        self._count("controllers_total", 1)
        logger.info("serving a controller from %s:%s", peer[0], peer[1])
        try:
            session.serve({"host": socket.gethostname(), "address": session.address,
                           "gpus": list(self._devices.gpus), "machine": machine_id(),
                           "blocks": block_domain(),
                           "pid": os.getpid(), "version": __version__, "cwd": os.getcwd()})
        finally:
            with self._lock:
                self._sessions.discard(session)
                if self._once and not self._sessions:
                    self.served.set()
            self._count("controllers_connected", -1)
            logger.info("the controller from %s:%s is gone: %s", peer[0], peer[1],
                        printable(session.reason or "it closed the connection"))

    def _turn_away(self, sock: socket.socket, peer: tuple[Any, ...], auth: seal.FrameAuth,
                   serving: int) -> None:
        """A controller that proved the token, past the cap on sessions: a FAULT tells it
        why (sealed with the connection's keys, as every frame after the handshake), and the
        connection is closed."""
        logger.warning("refused a controller from %s:%s: this agent serves %d sessions "
                       "already, its limit (--max-sessions)", peer[0], peer[1], serving)
        why = (f"it serves {serving} sessions already, its limit (phalanx agent "
               f"--max-sessions; by default phalanx.config.AGENT_MAX_SESSIONS = "
               f"{config.AGENT_MAX_SESSIONS}): try again once one has ended")
        try:
            sock.settimeout(self._handshake_timeout)  # a FAULT fits a socket's buffer
            sock.sendall(b"".join(framing.seal_frames(agentwire.fault(why), auth)))
        except OSError as exc:
            logger.info("could not tell %s:%s why: %s", peer[0], peer[1], exc)
        finally:
            sock.close()

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


def peer_tls_context(ca: str) -> ssl.SSLContext:
    """How an agent that serves TLS reaches other agents (a tree's children, the source of
    a kept result): TLS too, trusting the certificates ``ca`` holds (by default the agent's
    own certificate, which agents that share one, as the manifest's do, then trust in each
    other). The chain is verified, not the name: agents dial each other by the address the
    controller gives (a pod's IP), which a certificate rarely names; the token is proved
    inside it as on every connection."""
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use {ca} as the agents' certificate authority: {exc}") from None
    context.check_hostname = False  # verify_mode stays CERT_REQUIRED
    return context


def run(host: str, port: int, token: bytes, *, http_port: int | None,
        heartbeat_timeout: float, max_frame: int, tls: ssl.SSLContext | None = None,
        peer_tls: ssl.SSLContext | None = None,
        store: str | None = None,
        handshake_timeout: float = config.AGENT_HANDSHAKE_TIMEOUT,
        node_timeout: float = config.DEFAULT_NODE_TIMEOUT, once: bool = False,
        idle_timeout: float | None = None,
        on_listening: Callable[[str, int], None] | None = None,
        max_held: int | None = None,
        max_sessions: int = config.AGENT_MAX_SESSIONS) -> int:
    """``phalanx agent``: serve until SIGINT or SIGTERM; the exit status.

    ``once``: serve one job and end as the last of its connections does (an agent started
    for one controller, whose groups and pools connect to it while it lives);
    ``idle_timeout``: end if no controller has connected this long (its controller died
    before it could). ``on_listening(host, port)`` is told the address once it listens
    (``phalanx agent --slurm`` publishes it to its controller)."""
    # The token is read: from here on no process this agent starts (its supervisors, their
    # ranks) inherits $PHALANX_TOKEN. (Ranks run as this user, so they could still read a
    # token file: see the README's agent section.)
    os.environ.pop(config.ENV_TOKEN, None)
    metrics = server = None
    try:
        from phalanx.backends.cluster.agent.http import AgentMetrics, HealthServer

        metrics = AgentMetrics()
        agent = Agent(host, port, token, heartbeat_timeout=heartbeat_timeout,
                      node_timeout=node_timeout, max_frame=max_frame,
                      handshake_timeout=handshake_timeout,
                      metrics=metrics, tls=tls, peer_tls=peer_tls, store=store, once=once,
                      max_held=max_held, max_sessions=max_sessions)
        if http_port is not None:
            server = HealthServer(host, http_port, metrics, agent.health)
    except (OSError, ValueError) as exc:  # ValueError: a --store that is not private
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
    if on_listening is not None:
        try:
            on_listening(*agent.address)
        except OSError as exc:
            logger.error("cannot publish this agent's address: %s", exc)
            stop.set()
    started = time.monotonic()
    why = "stopping: its controllers' ranks are being stopped"
    while not stop.wait(0.2):
        if agent.served.is_set():
            why = "ending: its controller's last connection is gone (--once)"
            break
        if (idle_timeout is not None and agent.idle()
                and time.monotonic() - started > idle_timeout):
            why = f"ending: no controller came within {idle_timeout:g} s (--idle-timeout)"
            break
    logger.warning("phalanx agent %s", why)
    agent.stop()
    if server is not None:
        server.close()
    return 0
