"""``px.dashboard()`` with strangers about: other users and other web servers of this machine
(its other ports), pages of other origins, a name rebound to 127.0.0.1, and clients that
send slowly, nothing, or too much.

- the token is taken from a request header only: no answer sets a cookie, and a token in a
  cookie or in the query of an API request is not taken; the page's URL carries it in its
  fragment, and the older ``/?token=`` form is redirected there;
- a ``Host`` that names neither an address nor this machine (DNS rebinding) is refused with
  421, a request whose ``Origin`` is another's with 403;
- the stacks (which make every rank act) are not dumped by a GET;
- half-sent requests hold a bounded number of threads, and a request is still answered
  while they are held; a request that trickles one header every half second is cut at the
  deadline (``config.DASHBOARD_REQUEST_TIMEOUT``, short here), not per read;
- a request's header lines are bounded in all: 25 requests stuffed with headers are each
  refused with 431 and add a few MiB at most (each held 6 MiB before).

(In a real browser, a page of another port of 127.0.0.1: tests/browser/
test_dashboard_strangers.py.) The dashboard runs in this process, as a user's does in
theirs: its threads and memory are this process's.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time

import psutil
import pytest

import phalanx as px
from phalanx import config
from tests import helpers
from tests.browser.targets import Worker

MIB = 1 << 20


@pytest.fixture(scope="module")
def group():
    with helpers.long_lived_group(Worker, nodes=1, procs_per_node=2,
                                  echo_output=False) as group:
        yield group


@pytest.fixture
def board():
    with px.dashboard() as board:
        yield board


def ask(board, path: str, method: str = "GET", headers: dict[str, str] | None = None,
        token: bool = True) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request to the dashboard, its token in the header unless ``token`` is False:
    its status, headers and body."""
    conn = http.client.HTTPConnection(board.host, board.port, timeout=30)
    try:
        sent = dict(headers or {})
        if token:
            sent.setdefault("Authorization", f"Bearer {board.token}")
        conn.request(method, path, headers=sent)
        reply = conn.getresponse()
        return reply.status, reply.headers, reply.read()
    finally:
        conn.close()


# -- the token: a header's, never a cookie's or a URL's --------------------------------------


def test_no_answer_sets_a_cookie_and_a_cookie_or_a_query_token_is_not_taken(board):
    for path in ("/", f"/?token={board.token}", "/static/app.js", "/api/state", "/metrics"):
        status, headers, _ = ask(board, path)
        assert status in (200, 303), (path, status)
        assert headers.get_all("Set-Cookie") is None, (path, headers.get_all("Set-Cookie"))
    cookie = {"Cookie": f"phalanx_dashboard={board.token}"}
    for path in ("/api/state", "/metrics"):
        assert ask(board, path, headers=cookie, token=False)[0] == 401, path
        status, _, body = ask(board, f"{path}?token={board.token}", token=False)
        assert status == 401 and b"header" in body, (path, status, body)
    assert ask(board, "/api/state", headers={"X-Phalanx-Token": board.token},
               token=False)[0] == 200


def test_the_url_carries_the_token_in_its_fragment_and_the_query_form_is_redirected(board):
    assert board.url == f"http://127.0.0.1:{board.port}/#token={board.token}"
    status, headers, _ = ask(board, f"/?token={board.token}", token=False)
    assert status == 303 and headers["Location"] == f"./#token={board.token}"
    assert ask(board, "/?token=wrong", token=False)[0] == 403


# -- Host and Origin ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example"])
def test_a_host_that_names_another_is_refused_421(board, name):
    host = {"Host": name.format(port=board.port)}
    for path in ("/", "/api/state", "/metrics"):
        status, _, body = ask(board, path, headers=host)
        assert status == 421, (path, status)
        assert b"does not answer to the name" in body
    assert ask(board, "/api/stacks?group=x", "POST", headers=host)[0] == 421


@pytest.mark.parametrize("name", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:9000",
                                  "[::1]:{port}"])
def test_the_dashboards_own_names_are_served(board, name):
    assert ask(board, "/api/state", headers={"Host": name.format(port=board.port)})[0] == 200


def test_a_request_from_another_origin_is_refused_even_with_the_token(board):
    other = {"Origin": f"http://127.0.0.1:{board.port + 1}"}
    assert ask(board, "/api/stacks?group=x", "POST", headers=other)[0] == 403
    assert ask(board, "/api/state", headers=other)[0] == 403
    # a preflight is granted nothing: no Access-Control-* header, ever
    status, headers, _ = ask(board, "/api/stacks", "OPTIONS", token=False, headers={
        **other, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-phalanx-token"})
    assert status >= 400 and not [h for h in headers if h.lower().startswith("access-control")]
    same = {"Origin": f"http://127.0.0.1:{board.port}"}
    assert ask(board, "/api/state", headers=same)[0] == 200


# -- the stacks: a POST ---------------------------------------------------------------------


def test_a_get_does_not_dump_the_stacks_a_post_does(board, group):
    status, headers, body = ask(board, f"/api/stacks?group={group.name}")
    assert status == 405 and headers["Allow"] == "POST", (status, body)
    assert b"stacks\"" not in body and b"File" not in body
    status, _, body = ask(board, f"/api/stacks?group={group.name}", "POST")
    assert status == 200
    assert sorted(json.loads(body)["stacks"]) == ["0", "1"]


# -- strangers that send slowly, nothing, or too much ------------------------------------------


def half_sent(board, count: int) -> list[socket.socket]:
    """``count`` connections to the dashboard, each with a request it never finishes."""
    held = []
    for _ in range(count):
        sock = socket.create_connection((board.host, board.port), timeout=5)
        try:
            sock.sendall(b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:  # shut already, to make room for the next
            pass
        held.append(sock)
    return held


def test_half_sent_requests_hold_a_bounded_number_of_threads_and_a_request_is_answered(
        monkeypatch):
    cap = 16
    monkeypatch.setattr(config, "DASHBOARD_MAX_CONNECTIONS", cap)
    monkeypatch.setattr(config, "DASHBOARD_REQUEST_TIMEOUT", 60.0)  # not what ends them here
    with px.dashboard() as board:
        assert ask(board, "/api/state")[0] == 200
        before = threading.active_count()
        held = half_sent(board, 200)
        try:
            # the connections shut down to make room end their threads (they read EOF)
            settled = helpers.wait_until(lambda: threading.active_count() - before <= cap, 10)
            grown = threading.active_count() - before
            print(f"\n200 half-sent requests: {grown} more threads (cap {cap})")
            assert settled, f"{grown} more threads for 200 half-sent requests (cap {cap})"
            started = time.monotonic()
            assert ask(board, "/api/state")[0] == 200
            assert time.monotonic() - started < 5
        finally:
            for sock in held:
                sock.close()


def test_a_request_that_trickles_is_cut_at_the_deadline_not_per_read(monkeypatch):
    deadline = 1.5
    monkeypatch.setattr(config, "DASHBOARD_REQUEST_TIMEOUT", deadline)
    with px.dashboard() as board, socket.create_connection((board.host, board.port)) as slow:
        slow.sendall(b"GET /api/state HTTP/1.1\r\n")
        started = time.monotonic()
        cut = None
        for i in range(20):  # one header line every 0.5 s: 10 s of it at most
            try:
                slow.sendall(f"X-Slow-{i}: 1\r\n".encode())
            except OSError:
                cut = time.monotonic() - started
                break
            readable, _, _ = select.select([slow], [], [], 0.5)
            if readable:
                try:
                    data = slow.recv(1024)
                except OSError:
                    data = b""
                assert data == b"", f"the trickling request was answered: {data[:80]!r}"
                cut = time.monotonic() - started
                break
        print(f"\na header every 0.5 s: cut after {cut} s (deadline {deadline} s)")
        # the deadline, plus the serving loop's look every 0.2 s and a loaded machine's delay
        assert cut is not None and cut < deadline + 2.0, cut
        assert ask(board, "/api/state")[0] == 200


def test_header_stuffed_requests_are_refused_431_and_hold_little_memory(monkeypatch):
    # room for all 25 at once: none is shut down to make room for the next, so each one
    # shows what its own headers cost
    monkeypatch.setattr(config, "DASHBOARD_MAX_CONNECTIONS", 128)
    line = b"X-Stuffing: " + b"a" * (60 * 1024) + b"\r\n"  # under http.server's 64 KiB a line
    with px.dashboard() as board:
        me = psutil.Process()
        assert ask(board, "/api/state")[0] == 200
        before = me.memory_info().rss
        held = []
        try:
            for _ in range(25):
                sock = socket.create_connection((board.host, board.port), timeout=5)
                held.append(sock)
                try:
                    sock.sendall(b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    for _ in range(99):  # 6 MiB of headers, never ended; http.server took 100
                        if select.select([sock], [], [], 0)[0]:
                            break  # answered
                        sock.sendall(line)
                except OSError:  # refused and closed while we sent
                    pass
            grown = (me.memory_info().rss - before) / MIB
            answers = [_first_line(sock, time.monotonic() + 10) for sock in held]
        finally:
            for sock in held:
                sock.close()
        print(f"\n25 header-stuffed requests: {grown:.1f} MiB more, answers {set(answers)}")
        assert all(a.startswith(b"HTTP/1.0 431") for a in answers), answers
        # 25 x 32 KiB is under 1 MiB; the rest is threads and the allocator. Unbounded, each
        # request held its 6 MiB: about 150 MiB.
        assert grown < 40, f"{grown:.1f} MiB for 25 refused requests"
        assert ask(board, "/api/state")[0] == 200


def _first_line(sock: socket.socket, deadline: float) -> bytes:
    """The first line of what the server answered on ``sock`` (b"" if it closed without
    one, b"<no answer>" past ``deadline``)."""
    data = b""
    while b"\r\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return data or b"<no answer>"
        try:
            chunk = sock.recv(4096)
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_a_strangers_request_line_is_logged_escaped(board, caplog):
    """What a client sends reaches the log with its control characters escaped: a request
    line carrying a terminal escape and a line break cannot forge a line of the log."""
    forged = "/\x1b[2Jx\rphalanx: serving a controller from 10.6.6.6"
    with caplog.at_level("DEBUG"), socket.create_connection((board.host, board.port),
                                                            timeout=10) as sock:
        sock.sendall(f"GET {forged} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode("latin-1"))
        sock.settimeout(10)
        while sock.recv(65536):  # the answer, to its end: the line was logged by then
            pass
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in text and "\r" not in text, text
    assert "\\x1b[2Jx\\rphalanx: serving" in text, text
