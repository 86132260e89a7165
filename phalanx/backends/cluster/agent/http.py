"""The agent's plain-HTTP port: Kubernetes probes and Prometheus scrapes.

``phalanx agent`` runs on every node (or pod). Its control port is authenticated
(:mod:`phalanx.wire.handshake`); this second port is deliberately not, so it serves only what a
kubelet or a Prometheus server may read, and nothing that changes state::

    GET /health   200 application/json {"status": "ok"}
                  503 {"status": "unhealthy", "reason": "..."} when health() says
                      {"ok": False, "reason": ...}, raises, or returns something that is
                      not a dict
    GET /metrics  200 text/plain; version=0.0.4  AgentMetrics.render()
    other paths   404;  POST, PUT, DELETE, ...  405 (Allow: GET, HEAD)

What a stranger may read here, and why no more:

- ``/health`` says ok or not, and why not (a probe needs the first, whoever is paged the
  second). It does not say the agent's version (which would tell an attacker which
  release's bugs to try), how many controllers it serves, nor anything health() adds for
  the agent's own use: only ``status`` and ``reason`` leave this port.
- ``/metrics`` is the fixed table ``_METRICS``: counts and gauges of numbers, no labels, no
  names, addresses, versions or paths. A count tells an attacker no more than watching the
  traffic would (that the agent is busy, that refusals happen).

Design:

- :class:`AgentMetrics` is a fixed set of counters and gauges behind one lock, rendered in
  the Prometheus text format by hand: a dozen lines do not justify a dependency on every
  node, and the metric names are the agent's contract with dashboards, so they are listed
  here in one table (``_METRICS``) rather than created wherever they are first used.
- :class:`HealthServer` is a :class:`phalanx.wire.httpserve.BoundedServer` (the dashboard's
  too), every connection bounded (see there): a deadline for the whole request, not per
  read (``request_timeout``, ``config.AGENT_HTTP_REQUEST_TIMEOUT``); at most
  ``max_connections`` (``config.AGENT_HTTP_MAX_CONNECTIONS``) served at once, a quarter of
  them for one address, the oldest shut down to make room, so that however many strangers
  hold, a kubelet's probe (new, from an address of its own) is served; the header lines
  together bounded (431); a listen backlog of ``config.AGENT_HTTP_BACKLOG``, so probes are
  not refused in a burst. ``health()`` runs on the request's thread, so it must be quick.
- The socket is bound in the constructor, so a port that is taken fails where the agent
  starts, with the address in the message, not later on a background thread.
- Requests are logged at DEBUG only: probes arrive every few seconds on every node.

Binding is the caller's choice; the agent binds loopback unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from phalanx import config
from phalanx.output.prometheus import CONTENT_TYPE, number
from phalanx.wire.httpserve import BoundedHandler, BoundedServer, where

logger = logging.getLogger(__name__)

PREFIX = "phalanx_agent_"
METRICS_CONTENT_TYPE = CONTENT_TYPE
# Seconds a client has to send its request and to take the answer. A kubelet probe sends
# its request at once; the bound is for connections that never do.
REQUEST_TIMEOUT = config.AGENT_HTTP_REQUEST_TIMEOUT
MAX_CONNECTIONS = config.AGENT_HTTP_MAX_CONNECTIONS
# Only these fields of health() leave the port (see the module docstring).
_PUBLIC_HEALTH = ("status", "reason")
# How long close() may wait for the serving loop to notice (socketserver polls for its
# shutdown flag); ten idle wake-ups a second cost nothing measurable.
_POLL_INTERVAL = 0.1
_MAX_DRAINED_BODY = 64 * 1024  # a refused request's body is read up to this, then dropped

# name (without PREFIX), type, help. The order is the order of /metrics. No gauge may be
# named like a counter less its "_total": Prometheus clients and OpenMetrics name a counter's
# family without the suffix, so a gauge "controllers" would collide with "controllers_total".
_METRICS: tuple[tuple[str, str, str], ...] = (
    ("ranks_alive", "gauge", "Ranks running now."),
    ("controllers_connected", "gauge", "Controllers connected now."),
    ("controllers_total", "counter", "Controllers served since the agent started."),
    ("calls_total", "counter", "Call frames relayed to ranks."),
    ("received_bytes_total", "counter", "Bytes received on the control connections."),
    ("sent_bytes_total", "counter", "Bytes sent on the control connections."),
    ("restarts_total", "counter", "Ranks started again after their first start."),
    ("auth_failures_total", "counter", "Connections that failed authentication."),
    ("handshakes_evicted_total", "counter",
     "Control connections in their handshake shut down to make room for newer ones "
     "(the oldest of the address holding the most)."),
    ("accept_errors_total", "counter",
     "Times the control port could not take a connection (no descriptor or thread left)."),
)


class AgentMetrics:
    """Thread-safe counters and gauges of one agent, rendered as Prometheus text.

    Names are given without the ``phalanx_agent_`` prefix (``inc("calls_total")``).
    Counters only go up; gauges may be set, or moved either way with :meth:`inc`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds = {name: kind for name, kind, _ in _METRICS}
        self._values = dict.fromkeys(self._kinds, 0.0)

    def _kind(self, name: str) -> str:
        try:
            return self._kinds[name]
        except KeyError:
            raise KeyError(f"no agent metric named {name!r}; the metrics are "
                           f"{', '.join(self._kinds)}") from None

    def inc(self, name: str, value: float = 1) -> None:
        """Add ``value`` to metric ``name`` (a negative value only to a gauge)."""
        if self._kind(name) == "counter" and value < 0:
            raise ValueError(f"counter {name!r} cannot go down (inc by {value!r}); "
                             "use a gauge for a value that does")
        with self._lock:
            self._values[name] += value

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name`` to ``value``."""
        if self._kind(name) != "gauge":
            raise ValueError(f"{name!r} is a counter: it can only be increased with inc(), "
                             "not set")
        with self._lock:
            self._values[name] = float(value)

    def value(self, name: str) -> float:
        self._kind(name)
        with self._lock:
            return self._values[name]

    def render(self) -> str:
        """Every metric in the Prometheus text exposition format 0.0.4."""
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, kind, help_text in _METRICS:
            full = PREFIX + name
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}",
                      f"{full} {number(values[name])}"]
        return "\n".join(lines) + "\n"


def health_response(health: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The status code and JSON body of ``GET /health`` (pure apart from calling health):
    only the fields a stranger may read (see the module docstring)."""
    try:
        report = health()
    except Exception as exc:  # a broken check is an unhealthy agent, not a dead port
        logger.debug("agent health check raised", exc_info=True)
        return 503, {"status": "unhealthy",
                     "reason": f"the health check failed ({type(exc).__name__})"}
    if not isinstance(report, dict):
        return 503, {"status": "unhealthy",
                     "reason": f"health() returned {type(report).__name__}, not a dict"}
    if report.get("ok", True) is not False:
        return 200, {"status": "ok"}
    return 503, {"status": "unhealthy", "reason": str(report.get("reason", "not ok"))}


class _Handler(BoundedHandler):
    server: _Server
    log_to = logger

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            status, report = health_response(self.server.health)
            body = json.dumps(report, default=str).encode()
            self._reply(status, "application/json", body, send_body)
        elif path == "/metrics":
            body = self.server.metrics.render().encode()
            self._reply(200, METRICS_CONTENT_TYPE, body, send_body)
        else:
            self._reply(404, "text/plain; charset=utf-8",
                        b"not found: this port serves /health and /metrics\n", send_body)

    def _not_allowed(self) -> None:
        # Read a small body first: closing with unread data makes the kernel reset the
        # connection, and the client may lose the answer.
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= _MAX_DRAINED_BODY:
            self.rfile.read(int(length))
        self._reply(405, "text/plain; charset=utf-8",
                    b"method not allowed: this port only answers GET and HEAD\n", True,
                    extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def _reply(self, status: int, content_type: str, body: bytes, send_body: bool,
               extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)


class _Server(BoundedServer):
    def __init__(self, address: tuple[str, int], metrics: AgentMetrics,
                 health: Callable[[], dict[str, Any]], request_timeout: float,
                 max_connections: int) -> None:
        self.metrics = metrics
        self.health = health
        super().__init__(address, _Handler, request_timeout=request_timeout,
                         max_connections=max_connections, backlog=config.AGENT_HTTP_BACKLOG)


class HealthServer:
    """Serves /health and /metrics (see the module docstring) on ``host:port``.

    The socket is bound when the object is made (``port=0`` picks a free port, see
    :attr:`address`); :meth:`start` begins serving on a daemon thread; :meth:`close` stops.
    """

    def __init__(self, host: str, port: int, metrics: AgentMetrics,
                 health: Callable[[], dict[str, Any]], *,
                 request_timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        server = _Server((host, port), metrics, health, request_timeout, max_connections)
        server.open("agent health and metrics")
        self._server = server
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_name, self._server.server_port  # as bound

    @property
    def serving(self) -> int:
        """How many connections are being served now."""
        return self._server.serving

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this HealthServer is closed; make a new one")
            if self._thread is not None:
                raise RuntimeError("this HealthServer is already serving")
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": _POLL_INTERVAL},
                name="phalanx-agent-http", daemon=True)
            self._thread.start()
        logger.info("agent serving /health and /metrics on http://%s", where(*self.address))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # shutdown() waits for serve_forever to finish, so never call it unstarted.
            if self._thread is not None:
                self._server.shutdown()
                self._thread.join()
            self._server.server_close()
        logger.debug("agent http server on %s closed", where(*self.address))
