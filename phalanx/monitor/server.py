"""``px.dashboard()``: a live page of this controller's groups and pools, and ``/metrics``.

A small HTTP server on a thread of its own (the standard library's, one thread per
request) serves:

- ``/``: the page (``static/index.html``, with ``static/app.js`` and ``static/style.css``;
  every asset is phalanx's own, nothing from the network), which reads ``/api/state``
  every second;
- ``/api/state``: the groups, their ranks and recent calls, the pools
  (:mod:`phalanx.monitor.state`), as JSON;
- ``/api/stacks?group=NAME``: every live rank's Python stacks of that group;
- ``/metrics``: the counts in Prometheus' text format (:mod:`phalanx.monitor.metrics`).

Every request must carry the dashboard's token, a random secret made when it starts: as
``?token=`` (the URL :attr:`Dashboard.url` gives), as ``Authorization: Bearer <token>``
(Prometheus' ``authorization`` setting), or as the cookie the page's first answer sets. A
request without it is refused with 401, one with a wrong token with 403. The server binds
the loopback address unless told another (anyone who can reach the port and knows the
token sees the stacks of the ranks).

While it is open the dashboard watches every group, those made later too (its
:class:`~phalanx.monitor.metrics.Metrics` is an observer of their calls: the cost of a
watched call, a few microseconds, is paid only while a dashboard is open).
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import secrets
import threading
import urllib.parse
from importlib import resources
from typing import Any

from phalanx import config
from phalanx.controller.group import live_groups
from phalanx.controller.internals import internals
from phalanx.controller.observe import EVERY_GROUP
from phalanx.errors import PhalanxError
from phalanx.monitor import state
from phalanx.monitor.metrics import Metrics
from phalanx.output import prometheus

logger = logging.getLogger(__name__)

COOKIE = "phalanx_dashboard"
_ASSETS = {"index.html": "text/html; charset=utf-8",
           "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}
_LOOPBACK = ("127.", "::1", "localhost")


class Dashboard:
    """A running dashboard (see the module docstring): :attr:`url` to open (it carries
    the token), :meth:`close` (or leave the ``with`` block) to stop it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if not isinstance(host, str) or not host:
            raise ValueError(f"dashboard host must be an address such as '127.0.0.1', got "
                             f"{host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"dashboard port must be 0 (any free port) to 65535, got "
                             f"{port!r}")
        self.token = secrets.token_urlsafe(24)
        self.metrics = Metrics()
        self.groups = state.Groups()
        static = resources.files("phalanx.monitor").joinpath("static")  # one name a call: 3.10
        self._assets = {name: static.joinpath(name).read_bytes() for name in _ASSETS}
        handler = type("Handler", (_Handler,), {"dashboard": self})
        self._server = _Server((host, port), handler)
        self.host = host
        self.port = self._server.server_address[1]
        if not host.startswith(_LOOPBACK):
            logger.warning("the dashboard listens on %s:%d: whoever can reach it there and "
                           "has its URL sees every rank's stacks", host, self.port)
        EVERY_GROUP.append(self.metrics)
        for group in live_groups():
            internals(group).watch_calls(self.metrics)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="phalanx-dashboard", daemon=True)
        self._thread.start()
        self._closed = False
        logger.info("dashboard at %s", self.url)

    @property
    def url(self) -> str:
        """The page's address, with the token."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/?token={self.token}"

    @property
    def metrics_url(self) -> str:
        """``/metrics``' address, with the token."""
        return self.url.replace("/?", "/metrics?", 1)

    def close(self) -> None:
        """Stop serving and watching (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.metrics in EVERY_GROUP:
            EVERY_GROUP.remove(self.metrics)
        for group in live_groups():
            internals(group).watch_calls(self.metrics, on=False)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Dashboard http://{self.host}:{self.port}/ {'closed' if self._closed else 'open'}>"

    # -- what the handler asks ------------------------------------------------------------

    def allowed(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def state(self) -> dict[str, Any]:
        return state.snapshot(self.groups, self.metrics)

    def stacks(self, group: str) -> dict[str, Any] | None:
        return state.stacks(self.groups, group, config.STACKS_TIMEOUT)

    def metrics_text(self) -> str:
        return self.metrics.render((g.name, state.health_of(g)) for g in self.groups.now()
                                   if not g.closed)

    def asset(self, name: str) -> bytes | None:
        return self._assets.get(name)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("dashboard: a request from %s failed", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    dashboard: Dashboard
    server_version = "phalanx-dashboard"
    sys_version = ""
    timeout = 30.0  # s a client may take to send its request

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("dashboard: " + format, *args)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        given = self._token(query)
        if given is None:
            self._send(401, b"this dashboard needs its token: open the URL it printed "
                       b"(?token=...)\n", "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Bearer realm="phalanx"'})
            return
        board = self.dashboard
        if not board.allowed(given):
            self._send(403, b"wrong token for this dashboard\n", "text/plain; charset=utf-8")
            return
        path = url.path
        try:
            if path in ("/", "/index.html"):
                # the cookie lets the page's assets through without the token in their URLs
                cookie = (f"{COOKIE}={board.token}; Path=/; HttpOnly; SameSite=Strict")
                self._send(200, board.asset("index.html") or b"", _ASSETS["index.html"],
                           {"Set-Cookie": cookie})
            elif path.startswith("/static/") and board.asset(path[8:]) is not None:
                self._send(200, board.asset(path[8:]) or b"", _ASSETS[path[8:]])
            elif path == "/api/state":
                self._json(200, board.state())
            elif path == "/api/stacks":
                name = (query.get("group") or [""])[0]
                stacks = board.stacks(name)
                if stacks is None:
                    self._json(404, {"error": f"no open group named {name!r}"})
                else:
                    self._json(200, stacks)
            elif path == "/metrics":
                self._send(200, board.metrics_text().encode(), prometheus.CONTENT_TYPE)
            else:
                self._json(404, {"error": f"nothing at {path}"})
        except PhalanxError as exc:
            self._json(503, {"error": f"{type(exc).__name__}: {exc}"})

    def _token(self, query: dict[str, list[str]]) -> str | None:
        if "token" in query:
            return query["token"][0]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[7:].strip()
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return value
        return None

    def _json(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body, separators=(",", ":")).encode(),
                   "application/json")

    def _send(self, status: int, body: bytes, kind: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the token is in the URL
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; style-src 'self'; img-src 'self' data:")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def dashboard(host: str = "127.0.0.1", port: int = 0) -> Dashboard:
    """Serve a live page of this controller's groups and pools, and ``/metrics``::

        with px.dashboard() as board:
            print(board.url)   # open it; the URL carries the token
            train()

    ``host``: where it listens (loopback unless told otherwise); ``port`` 0 takes a free
    one. See :mod:`phalanx.monitor.server`."""
    return Dashboard(host, port)
