"""Plain-HTTP servers that strangers can reach, every connection bounded.

The agent's probe port (:mod:`phalanx.backends.cluster.agent.http`) and the dashboard
(:mod:`phalanx.monitor.server`) serve plain HTTP where anyone who reaches the address can
connect. :class:`BoundedServer` (a :class:`http.server.ThreadingHTTPServer` on daemon
threads, one a connection) and :class:`BoundedHandler` are what both hold against a
stranger who connects and then sends slowly, nothing, or too much:

- a deadline per connection, not per read: a client has ``request_timeout`` seconds from
  its connection being taken to its answer sent (or, on a server whose requests carry a
  secret, to its request proving it: :meth:`BoundedServer.proved`), then the serving loop
  shuts the connection down, however it trickles (one header line every few seconds kept a
  connection, and its thread, for as long as it liked when the timeout was per read);
- at most ``max_connections`` are held at once, a quarter of them for one address; one
  more is taken and the oldest connection of its address (at its share), or of the address
  holding the most, is shut down (:mod:`phalanx.wire.admission`): strangers hold a bounded
  number of threads, and however many they hold, a newcomer (a kubelet's probe, the
  dashboard's page) is served;
- a request's header lines together may take ``max_header_bytes``
  (``config.HTTP_MAX_HEADER_BYTES``); past that it is refused with 431 and closed. http.server's
  own limits stay: a request line over 64 KiB is refused with 414, a header line over 64 KiB
  or more than 100 of them with 431 -- but alone those let one request hold 6.4 MiB of
  headers, and a few dozen of them hundreds of MiB;
- a listen backlog of ``backlog``, so that a burst of real requests is not refused;
- when accept() fails for want of a descriptor, the loop waits a moment before it tries
  again instead of spinning on the still-readable listener;
- :meth:`BoundedServer.open` binds without the reverse DNS lookup http.server does (it can
  stall for seconds where there is no DNS), and a port that is taken fails there, naming
  the address.

Requests, timeouts and malformed requests are logged at DEBUG only: they are the clients'
business, and a port strangers reach must not let them fill the log.
"""

from __future__ import annotations

import errno
import http.client
import logging
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any

from phalanx import config
from phalanx.errors import printable
from phalanx.wire.admission import Admission

logger = logging.getLogger(__name__)

# accept() errors that mean "no resource now": wait this long before trying again
_ACCEPT_RETRY = 0.05
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# What socketserver hands a server per request: a stream server's connection, or (a
# datagram server's) the data and the socket it came on
_Request = socket.socket | tuple[bytes, socket.socket]


def connection_of(request: _Request) -> socket.socket:
    """The connection a request to a stream server is."""
    if not isinstance(request, socket.socket):  # pragma: no cover - a datagram server's
        raise TypeError(f"an HTTP server serves connections, not {type(request).__name__}")
    return request


def where(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server whose connections are bounded (see the module docstring).
    Made unbound: :meth:`open` binds and listens, then ``serve_forever`` serves (its
    ``poll_interval`` is how often the deadlines are looked at)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler], *,
                 request_timeout: float, max_connections: int,
                 max_header_bytes: int = config.HTTP_MAX_HEADER_BYTES,
                 backlog: int = 128) -> None:
        if not (isinstance(request_timeout, (int, float)) and request_timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds, "
                             f"not {request_timeout!r}")
        if not (isinstance(max_connections, int) and max_connections >= 1):
            raise ValueError(f"max_connections must be a positive integer, "
                             f"not {max_connections!r}")
        self.request_timeout = float(request_timeout)
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self.request_queue_size = backlog
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # the connections not answered (or proved) yet: each one's deadline, and room made
        # for the newest (the oldest of the address holding the most is shut down)
        self.admission = Admission(max_connections, max(1, max_connections // 4),
                                   self.request_timeout)
        super().__init__(address, handler, bind_and_activate=False)

    def open(self, what: str) -> None:
        """Bind and listen; a failure is an OSError naming ``what`` is served where, and
        why (closed: nothing is left bound)."""
        host, port = self.server_address[:2]
        try:
            self.server_bind()
            self.server_activate()
        except OSError as exc:
            self.server_close()
            hint = (": another process is listening there (choose another port, or 0 for "
                    "any free one)" if exc.errno == errno.EADDRINUSE else "")
            raise OSError(exc.errno, f"cannot serve {what} on {where(str(host), int(port))}: "
                                     f"{exc.strerror or exc}{hint}") from exc

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves socket.getfqdn(host), a reverse DNS lookup that
        # can stall for seconds where there is no DNS; nothing here needs that name.
        TCPServer.server_bind(self)
        host, port = self.socket.getsockname()[:2]  # what TCPServer keeps as server_address
        self.server_name, self.server_port = host, port

    @property
    def serving(self) -> int:
        """How many connections are held now (not answered or proved yet)."""
        return len(self.admission)

    def proved(self, connection: socket.socket) -> None:
        """``connection``'s request proved its secret: it is no longer a stranger's, so it
        is neither cut at the deadline nor shut down to make room for another."""
        self.admission.release(connection)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                # the listener stays readable: without a pause the loop would spin on it
                time.sleep(_ACCEPT_RETRY)
            raise

    def process_request(self, request: _Request, client_address: Any) -> None:
        connection = connection_of(request)
        peer = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        evicted = self.admission.admit(connection, peer)
        if evicted is not None:  # a newcomer is served however many strangers hold
            logger.debug("http %s: took a connection from %s: %s",
                         where(self.server_name, self.server_port), peer, evicted)
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread could start: the connection is not served
            self.shutdown_request(request)
            raise

    def close_request(self, request: _Request) -> None:
        # Released before it is closed: the admission shuts connections down by their
        # descriptor's number, which a closed one hands to the next socket.
        self.admission.release(connection_of(request))
        super().close_request(request)

    def service_actions(self) -> None:
        # Run by serve_forever every poll interval: the per-connection deadline.
        self.admission.expire()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints the traceback to stderr.
        logger.debug("http request from %s failed", client_address, exc_info=True)


class BoundedHandler(BaseHTTPRequestHandler):
    """The request handler of a :class:`BoundedServer`: each read bounded by the server's
    ``request_timeout``, the header lines together by its ``max_header_bytes``; log lines
    at DEBUG on ``log_to``."""

    server: BoundedServer
    log_to = logger

    def setup(self) -> None:
        # each read's limit (the connection's deadline is the server's); StreamRequestHandler
        # would set it the same way from a class-wide `timeout`
        self.request.settimeout(self.server.request_timeout)
        super().setup()

    def parse_request(self) -> bool:
        # http.client reads the header lines from self.rfile; over the bound, the
        # HTTPException _HeadBound raises is answered 431 by BaseHTTPRequestHandler itself
        rfile = self.rfile
        self.rfile = _HeadBound(rfile, self.server.max_header_bytes)  # type: ignore[assignment]
        try:
            return super().parse_request()
        finally:
            self.rfile = rfile

    def log_message(self, format: str, *args: Any) -> None:
        # The request line and what a client sent come from a stranger: escaped, so that
        # no newline or terminal escape of theirs reaches the log as it was sent.
        self.log_to.debug("http %s: %s", self.address_string(), printable(format % args))

    def log_error(self, format: str, *args: Any) -> None:
        # Timeouts and malformed requests are the client's business: DEBUG, like the rest.
        self.log_message(format, *args)


class _HeadBound:
    """A request's reader while its header lines are read: ``limit`` bytes of them in all,
    then an HTTPException (what http.server answers with 431). Reads no more than one byte
    past the limit, so a refused request has cost at most that."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw, self._left, self._limit = raw, limit, limit

    def readline(self, size: int = -1) -> bytes:
        want = self._left + 1 if size < 0 else min(size, self._left + 1)
        line: bytes = self._raw.readline(want)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.HTTPException(
                f"the request's header lines are over {self._limit} bytes")
        return line
