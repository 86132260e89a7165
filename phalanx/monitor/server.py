"""``px.dashboard()``: a live page of this controller's groups and pools, and ``/metrics``.

A small HTTP server on a thread of its own (the standard library's, one thread per
connection, every connection bounded: :mod:`phalanx.wire.httpserve`) serves:

- ``GET /``: the page (``static/index.html``, with ``static/app.js`` and ``static/style.css``;
  every asset is phalanx's own, nothing from the network), which reads ``/api/state``
  every second;
- ``GET /api/state``: the groups, their ranks and recent calls, the pools
  (:mod:`phalanx.monitor.state`), as JSON;
- ``POST /api/stacks?group=NAME``: every live rank's Python stacks of that group (a POST:
  it makes every rank of the group act; a GET is refused with 405);
- ``GET /metrics``: the counts in Prometheus' text format (:mod:`phalanx.monitor.metrics`).

The token: a random secret made when the dashboard starts. The API (``/api/...`` and
``/metrics``) takes it from a request header only: ``X-Phalanx-Token: <token>`` (what the
page sends) or ``Authorization: Bearer <token>`` (Prometheus' ``authorization`` setting,
``curl -H``). A request without it is refused with 401, one with a wrong token with 403.
Never from a cookie: a browser sends a cookie to every port of the host that set it
(cookies do not separate ports), so any other web server on the machine -- a notebook, a
development server, a stranger's -- received it, and a page there could make requests
that carried it. Never from a URL's query either: a URL ends up in logs, histories and
scrape configurations.

The page itself, and its assets, hold nothing secret (they are the files of the wheel), so
they are served without the token. The page's URL carries the token in its fragment,
:attr:`Dashboard.url` = ``http://127.0.0.1:PORT/#token=...``: a browser never sends a
fragment to a server (nor in a Referer); the page's script reads it and sends it in the
header on each request it makes. A URL of the older form, ``/?token=...``, is answered
(when its token is right) with a redirect to the fragment form.

What a page elsewhere can do -- another site, or another port of this host, which is
another origin -- is nothing: it does not know the token, and it could not send it anyway,
since setting ``X-Phalanx-Token`` or ``Authorization`` on a request to another origin needs
a CORS preflight that this server never grants (it sends no ``Access-Control-*`` header and
refuses OPTIONS). What acts is not a GET (which an ``<img>`` or a link can send), and a
request whose ``Origin`` is not the dashboard's own is refused with 403.

The ``Host`` header must name the dashboard by an address or as this machine: an IP
address, ``localhost``, the host it was told to bind, or this machine's name; any other
name is refused with 421 before anything else is looked at. That is DNS rebinding's
defence: a page of a name an attacker controls, made to resolve to this machine, is of
the same origin as whatever answers there -- and its requests name it in ``Host``. The
port in ``Host`` is not compared: a tunnel (``ssh -L 9000:127.0.0.1:PORT``) changes it,
and rebinding needs a name of the attacker's, not a port.

Connections that have not shown the token are strangers' and bounded
(:class:`~phalanx.wire.httpserve.BoundedServer`): ``config.DASHBOARD_REQUEST_TIMEOUT``
seconds for the whole request (not per read), at most ``config.DASHBOARD_MAX_CONNECTIONS``
held at once (a quarter of them from one address; the oldest is shut down to make room for
a newcomer), header lines of ``config.HTTP_MAX_HEADER_BYTES`` together at most (431), a
body of 64 KiB at most (413). A request that shows the right token is released from them
(its answer, a group's stacks, may take seconds). Each stacks request is logged at INFO.

The server binds the loopback address unless told another (anyone who can reach the port
and knows the token sees the stacks of the ranks). While it is open the dashboard watches
every group, those made later too (its :class:`~phalanx.monitor.metrics.Metrics` is an
observer of their calls: the cost of a watched call, a few microseconds, is paid only while
a dashboard is open).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import secrets
import socket
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
from phalanx.wire.httpserve import BoundedHandler, BoundedServer, where

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Phalanx-Token"  # what the page sends its token in
_ASSETS = {"index.html": "text/html; charset=utf-8",
           "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}
_PAGE = ("/", "/index.html")
_API = {"/api/state": "GET", "/api/stacks": "POST", "/metrics": "GET"}  # path -> its method
_MAX_BODY = 64 * 1024  # bytes of a request's body (read, then dropped: the API takes none)
_LOOPBACK = ("127.", "::1", "localhost")
_POLL_INTERVAL = 0.2  # s between looks at the strangers' deadlines (and for shutdown)
_TOKEN_IN_URL = re.compile(r"(token=)[^&#\s\"]*")
_NEEDS_TOKEN = (f"this dashboard's API needs its token in a header ({TOKEN_HEADER}: <token>, "
                f"or Authorization: Bearer <token>): open the page by the URL it printed "
                f"(http://HOST:PORT/#token=...)")


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
        # the names a request's Host may give (IP addresses and localhost besides)
        machine = socket.gethostname().lower()
        self._names = frozenset({host.lower().strip("[]"), machine, machine.split(".")[0]})
        handler = type("Handler", (_Handler,), {"dashboard": self})
        self._server = BoundedServer((host, port), handler,
                                     request_timeout=config.DASHBOARD_REQUEST_TIMEOUT,
                                     max_connections=config.DASHBOARD_MAX_CONNECTIONS,
                                     backlog=config.DASHBOARD_BACKLOG)
        self._server.open("the dashboard")
        self.host = host
        self.port = self._server.server_port
        if not host.startswith(_LOOPBACK):
            logger.warning("the dashboard listens on %s: whoever can reach it there and "
                           "has its URL sees every rank's stacks", where(host, self.port))
        EVERY_GROUP.append(self.metrics)
        for group in live_groups():
            internals(group).watch_calls(self.metrics)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": _POLL_INTERVAL},
                                        name="phalanx-dashboard", daemon=True)
        self._thread.start()
        self._closed = False
        logger.info("dashboard at %s", self.url)

    @property
    def url(self) -> str:
        """The page's address, the token in its fragment (which a browser never sends)."""
        return f"http://{where(self.host, self.port)}/#token={self.token}"

    @property
    def metrics_url(self) -> str:
        """``/metrics``' address; scrape it with the token as a bearer token
        (``Authorization: Bearer <token>``)."""
        return f"http://{where(self.host, self.port)}/metrics"

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
        return (f"<Dashboard http://{where(self.host, self.port)}/ "
                f"{'closed' if self._closed else 'open'}>")

    # -- what the handler asks ------------------------------------------------------------

    def allowed(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def serves(self, host_header: str | None) -> bool:
        """Whether a request's ``Host`` names this dashboard (see the module docstring):
        an IP address, localhost, the host it binds or this machine; none given is a client
        that is not a browser (every browser sends one)."""
        if not host_header:
            return host_header is None
        try:
            name = urllib.parse.urlsplit(f"//{host_header}").hostname
        except ValueError:  # a bracket without its pair
            return False
        if not name:
            return False
        if name == "localhost" or name.endswith(".localhost") or name in self._names:
            return True
        try:
            ipaddress.ip_address(name.partition("%")[0])  # an IPv6 address may name a zone
        except ValueError:
            return False
        return True

    def state(self) -> dict[str, Any]:
        return state.snapshot(self.groups, self.metrics)

    def stacks(self, group: str) -> dict[str, Any] | None:
        return state.stacks(self.groups, group, config.STACKS_TIMEOUT)

    def metrics_text(self) -> str:
        return self.metrics.render((g.name, state.health_of(g)) for g in self.groups.now()
                                   if not g.closed)

    def asset(self, name: str) -> bytes | None:
        return self._assets.get(name)


class _Handler(BoundedHandler):
    dashboard: Dashboard
    server_version = "phalanx-dashboard"
    sys_version = ""
    log_to = logger

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    # every other method gets the same checks, then 405 (a CORS preflight's OPTIONS too:
    # this server grants none)
    do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        # the request line of a first load carries the token (?token=...)
        super().log_message(format, *(_TOKEN_IN_URL.sub(r"\1...", a) if isinstance(a, str)
                                      else a for a in args))

    def _serve(self) -> None:
        method, board = self.command, self.dashboard
        if not self._drain_body():
            return
        host = self.headers.get("Host")
        if not board.serves(host):
            self._json(421, {"error": f"this dashboard does not answer to the name {host!r}: "
                                      f"open it by its address, as px.dashboard() printed it"})
            return
        origin = self.headers.get("Origin")
        if origin is not None and origin.lower() != f"http://{host}".lower():
            self._json(403, {"error": f"requests from another origin ({origin}) are refused"})
            return
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        asset = path[len("/static/"):] if path.startswith("/static/") else None
        if path in _PAGE or (asset is not None and asset in _ASSETS):
            if method != "GET":
                self._json(405, {"error": f"{method} {path}: only GET"}, {"Allow": "GET"})
            elif path in _PAGE and "token" in urllib.parse.parse_qs(url.query):
                self._first_load(urllib.parse.parse_qs(url.query)["token"][0])
            else:
                name = asset or "index.html"
                self._send(200, board.asset(name) or b"", _ASSETS[name])
            return
        given = self._token()
        if given is None:
            moved = (" (a token in the URL is not taken: it goes in the header)"
                     if "token=" in url.query else "")
            self._json(401, {"error": _NEEDS_TOKEN + moved},
                       {"WWW-Authenticate": 'Bearer realm="phalanx"'})
            return
        if not board.allowed(given):
            self._json(403, {"error": "wrong token for this dashboard"})
            return
        self.server.proved(self.connection)  # no longer a stranger's: no deadline, no eviction
        wanted = _API.get(path)
        if wanted is None:
            self._json(404, {"error": f"nothing at {path}"})
        elif method != wanted:
            self._json(405, {"error": f"{method} {path}: only {wanted}"}, {"Allow": wanted})
        else:
            self._api(path, urllib.parse.parse_qs(url.query))

    def _api(self, path: str, query: dict[str, list[str]]) -> None:
        board = self.dashboard
        try:
            if path == "/api/state":
                self._json(200, board.state())
            elif path == "/api/stacks":
                name = (query.get("group") or [""])[0]
                logger.info("dashboard: %s asked for the stacks of group %r",
                            self.client_address[0], name)
                stacks = board.stacks(name)
                if stacks is None:
                    self._json(404, {"error": f"no open group named {name!r}"})
                else:
                    self._json(200, stacks)
            else:
                self._send(200, board.metrics_text().encode(), prometheus.CONTENT_TYPE)
        except PhalanxError as exc:
            self._json(503, {"error": f"{type(exc).__name__}: {exc}"})

    def _first_load(self, given: str) -> None:
        """``/?token=...``, the older form of the page's URL: to the fragment form, which
        keeps the token out of every later request line."""
        if not self.dashboard.allowed(given):
            self._json(403, {"error": "wrong token for this dashboard"})
            return
        self._send(303, b"", "text/plain; charset=utf-8",
                   {"Location": f"./#token={urllib.parse.quote(given, safe='')}"})

    def _drain_body(self) -> bool:
        """Read a request's body (none of the routes takes one): closing with unread data
        resets the connection, and the client may lose the answer. False: refused (413)."""
        length = self.headers.get("Content-Length")
        if length is None:
            return True
        if not length.isdigit() or int(length) > _MAX_BODY:
            self.close_connection = True
            self._json(413, {"error": f"a request body of at most {_MAX_BODY} bytes, not "
                                      f"{length!r}"})
            return False
        self.rfile.read(int(length))
        return True

    def _token(self) -> str | None:
        given = self.headers.get(TOKEN_HEADER)
        if given is not None:
            return given.strip()
        scheme, _, credentials = self.headers.get("Authorization", "").partition(" ")
        return credentials.strip() if scheme.lower() == "bearer" else None

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body, separators=(",", ":")).encode(),
                   "application/json", headers)

    def _send(self, status: int, body: bytes, kind: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        # no other origin may frame the page, nor embed an answer (an <img>, a no-cors fetch)
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; style-src 'self'; img-src 'self' data:; "
                         "frame-ancestors 'none'")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def dashboard(host: str = "127.0.0.1", port: int = 0) -> Dashboard:
    """Serve a live page of this controller's groups and pools, and ``/metrics``::

        with px.dashboard() as board:
            print(board.url)   # open it: the URL carries the token (after its #)
            train()

    ``host``: where it listens (loopback unless told otherwise); ``port`` 0 takes a free
    one. ``/metrics`` takes the token as a bearer token (``Authorization: Bearer``,
    ``board.token``). See :mod:`phalanx.monitor.server`."""
    return Dashboard(host, port)
