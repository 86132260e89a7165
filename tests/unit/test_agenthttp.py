"""The agent's probe and metrics port: AgentMetrics alone, and HealthServer over real sockets
on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
import time

import pytest

from phalanx.backends.cluster.agent.http import METRICS_CONTENT_TYPE, AgentMetrics, HealthServer
from tests import helpers

GAUGES = ["ranks_alive", "controllers_connected"]
COUNTERS = ["controllers_total", "calls_total", "received_bytes_total", "sent_bytes_total",
            "restarts_total", "auth_failures_total", "handshakes_evicted_total",
            "accept_errors_total"]


@pytest.fixture
def serve():
    """Start HealthServers on a free loopback port; each is closed when the test ends."""
    servers: list[HealthServer] = []

    def make(health=lambda: {}, metrics=None, **kwargs) -> HealthServer:
        server = HealthServer("127.0.0.1", 0, metrics or AgentMetrics(), health, **kwargs)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.close()


def request(server: HealthServer, path: str, method: str = "GET", body: bytes | None = None):
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def parse_exposition(text: str) -> dict[str, dict]:
    """{name: {"help": ..., "type": ..., "value": float}} from Prometheus text."""
    assert text.endswith("\n")
    metrics: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[len("# HELP "):].split(" ", 1)
            metrics.setdefault(name, {})["help"] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            metrics.setdefault(name, {})["type"] = kind
        else:
            name, value = line.split(" ")
            assert "value" not in metrics.setdefault(name, {}), f"two samples of {name}"
            metrics[name]["value"] = float(value)
    return metrics


# -- /health ----------------------------------------------------------------------------


def test_health_ok_shows_a_stranger_only_the_status(serve):
    # what health() adds for the agent's own use (its version, its controllers) stays in
    server = serve(lambda: {"ok": True, "version": "1.2.3", "controllers": 2, "node": "n0"})
    status, headers, body = request(server, "/health")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": "ok"}


def test_health_503_when_health_reports_not_ok(serve):
    server = serve(lambda: {"ok": False, "reason": "no controller", "version": "1.2.3"})
    status, _, body = request(server, "/health")
    assert status == 503
    assert json.loads(body) == {"status": "unhealthy", "reason": "no controller"}


def test_health_503_when_health_raises(serve):
    def broken() -> dict:
        raise RuntimeError("supervisor gone")

    status, _, body = request(serve(broken), "/health")
    assert status == 503
    report = json.loads(body)
    assert report["status"] == "unhealthy"
    # the exception's type, not its text (which could quote anything)
    assert "RuntimeError" in report["reason"] and "supervisor gone" not in report["reason"]


def test_health_503_when_health_returns_no_dict(serve):
    status, _, body = request(serve(lambda: None), "/health")
    assert status == 503
    assert json.loads(body)["status"] == "unhealthy"


def test_health_ignores_query_and_head_has_no_body(serve):
    server = serve(lambda: {"ranks": 1})
    assert request(server, "/health?verbose=1")[0] == 200
    status, headers, body = request(server, "/health", method="HEAD")
    assert status == 200
    assert int(headers["Content-Length"]) > 0
    assert body == b""


# -- /metrics ---------------------------------------------------------------------------


def test_metrics_lists_every_metric_with_help_type_and_value(serve):
    metrics = AgentMetrics()
    metrics.set("ranks_alive", 8)
    metrics.inc("controllers_connected")
    for i, name in enumerate(COUNTERS):
        metrics.inc(name, i + 1)
    metrics.inc("received_bytes_total", 0.5)
    status, headers, body = request(serve(metrics=metrics), "/metrics")
    assert status == 200
    assert headers["Content-Type"] == METRICS_CONTENT_TYPE
    parsed = parse_exposition(body.decode())
    expected = {"ranks_alive": 8, "controllers_connected": 1,
                **{name: i + 1 for i, name in enumerate(COUNTERS)}}
    expected["received_bytes_total"] += 0.5
    assert set(parsed) == {"phalanx_agent_" + name for name in expected}
    for name, value in expected.items():
        entry = parsed["phalanx_agent_" + name]
        assert entry["help"]
        assert entry["type"] == ("gauge" if name in GAUGES else "counter")
        assert entry["value"] == value, name


def test_no_gauge_shares_a_family_name_with_a_counter():
    # Parsers name a counter's family without "_total"; a gauge of that name would merge
    # with it (prometheus_client reads "controllers" and "controllers_total" as one name).
    families = [name.removesuffix("_total") for name in COUNTERS] + GAUGES
    assert len(set(families)) == len(families)
    rendered = parse_exposition(AgentMetrics().render())
    assert set(rendered) == {"phalanx_agent_" + name for name in GAUGES + COUNTERS}


def test_metrics_parse_with_prometheus_client():
    parser = pytest.importorskip("prometheus_client.parser")
    metrics = AgentMetrics()
    metrics.set("ranks_alive", 3)
    metrics.inc("calls_total", 7)
    families = {f.name: f for f in parser.text_string_to_metric_families(metrics.render())}
    assert len(families) == len(GAUGES) + len(COUNTERS)
    # The parser names a counter's family without its "_total" suffix.
    assert families["phalanx_agent_ranks_alive"].type == "gauge"
    assert families["phalanx_agent_ranks_alive"].samples[0].value == 3
    assert families["phalanx_agent_calls"].type == "counter"
    assert families["phalanx_agent_calls"].samples[0].value == 7


# -- other requests ---------------------------------------------------------------------


def test_unknown_path_is_404(serve):
    server = serve()
    assert request(server, "/")[0] == 404
    assert request(server, "/healthz")[0] == 404


def test_other_methods_are_405(serve):
    server = serve()
    status, headers, _ = request(server, "/health", method="POST", body=b"{}")
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    assert request(server, "/metrics", method="DELETE")[0] == 405


def test_silent_client_does_not_block_another_request(serve):
    server = serve(request_timeout=30)
    silent = socket.create_connection(server.address)
    try:
        started = time.monotonic()
        assert request(server, "/health")[0] == 200
        assert time.monotonic() - started < 2
    finally:
        silent.close()


def test_silent_client_is_dropped_after_the_request_timeout(serve):
    server = serve(request_timeout=0.2)
    with socket.create_connection(server.address) as silent:
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 3


def test_a_trickling_client_is_cut_at_the_request_deadline(serve):
    # one header byte every 0.3 s: each read is well within the deadline, the request never
    # is; the server must close the connection at the deadline, not serve it at the end
    server = serve(request_timeout=1.0)
    with socket.create_connection(server.address) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        cut = None
        for _ in range(40):  # 12 s of trickling at most
            try:
                slow.sendall(b"X")
            except OSError:
                cut = time.monotonic() - started
                break
            readable, _, _ = select.select([slow], [], [], 0.3)
            if readable:
                try:
                    data = slow.recv(1024)
                except OSError:
                    data = b""
                assert data == b"", f"the trickling client was answered: {data[:80]!r}"
                cut = time.monotonic() - started
                break
        print(f"trickling client cut after {cut} s")
        assert cut is not None and cut < 2.5, cut


def test_the_connection_cap_holds_and_the_newest_is_served(serve):
    server = serve(request_timeout=30, max_connections=4)
    held = []
    for _ in range(6):  # more than the cap, all from this address: its oldest are shut
        sock = socket.create_connection(server.address)
        sock.settimeout(5)
        held.append(sock)
    try:
        time.sleep(0.3)
        for sock in held[:2]:
            try:
                assert sock.recv(1024) == b""  # shut down to make room
            except ConnectionResetError:
                pass
        assert server.serving <= 4 and threading.active_count() < 40
    finally:
        for sock in held:
            sock.close()
    assert helpers.wait_until(lambda: _status(server) == 200, 5)


def test_a_probe_is_answered_however_many_half_sent_requests_strangers_hold(serve):
    """The slowloris: strangers from four addresses hold every connection with half-sent
    requests, re-opening each as soon as it is shut; probes from another address are all
    answered."""
    server = serve(request_timeout=5, max_connections=32)
    host, port = server.address
    stop = threading.Event()

    def hold(source: str) -> None:
        socks: list[socket.socket] = []
        try:
            while not stop.is_set():
                while len(socks) < 16 and not stop.is_set():
                    sock = socket.socket()
                    sock.bind((source, 0))
                    sock.settimeout(2)
                    try:
                        sock.connect((host, port))
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends
                    except OSError:
                        sock.close()
                        break
                    socks.append(sock)
                ready, _, _ = select.select(socks, [], [], 0.05)
                for sock in ready:
                    socks.remove(sock)
                    sock.close()
        finally:
            for sock in socks:
                sock.close()

    threads = [threading.Thread(target=hold, args=(f"127.0.2.{i}",), daemon=True)
               for i in range(1, 5)]
    for thread in threads:
        thread.start()
    answered = 0
    try:
        time.sleep(0.5)  # every connection held
        for _ in range(25):
            answered += _status(server) == 200
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    print(f"\n{answered} of 25 probes answered while strangers held every connection")
    assert answered == 25


def test_max_connections_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="max_connections"):
            HealthServer("127.0.0.1", 0, AgentMetrics(), dict, max_connections=bad)


def _status(server: HealthServer) -> int | None:
    try:
        return request(server, "/health")[0]
    except OSError:
        return None


def test_oversized_request_line_is_refused(serve):
    server = serve()
    with socket.create_connection(server.address) as conn:
        conn.settimeout(5)
        conn.sendall(b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n")
        try:
            answer = conn.recv(1024)
        except ConnectionResetError:  # the server closed with our excess unread
            answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.0 414")
    assert request(server, "/health")[0] == 200


def test_requests_are_not_logged_at_info(serve, caplog):
    server = serve()
    with caplog.at_level(logging.DEBUG, logger="phalanx.backends.cluster.agent.http"):
        request(server, "/health")
        request(server, "/nowhere")
    noisy = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert noisy == []
    assert any("/health" in r.getMessage() for r in caplog.records)


# -- binding and lifecycle --------------------------------------------------------------


def test_port_zero_reports_the_chosen_port(serve):
    server = serve()
    host, port = server.address
    assert host == "127.0.0.1"
    assert port > 0


def test_port_in_use_raises_oserror_naming_the_address(serve):
    taken = serve()
    host, port = taken.address
    with pytest.raises(OSError, match=f"{host}:{port}.*in use"):
        HealthServer(host, port, AgentMetrics(), dict)


def test_close_is_idempotent_and_needs_no_start():
    unstarted = HealthServer("127.0.0.1", 0, AgentMetrics(), dict)
    unstarted.close()
    unstarted.close()
    with pytest.raises(RuntimeError, match="closed"):
        unstarted.start()

    server = HealthServer("127.0.0.1", 0, AgentMetrics(), dict)
    server.start()
    address = server.address
    server.close()
    server.close()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1).close()


# -- AgentMetrics -----------------------------------------------------------------------


def test_unknown_metric_name_raises_keyerror_listing_the_names():
    metrics = AgentMetrics()
    for call in (lambda: metrics.inc("calls"), lambda: metrics.set("calls", 1),
                 lambda: metrics.value("calls")):
        with pytest.raises(KeyError, match="calls_total"):
            call()


def test_set_on_a_counter_raises_valueerror():
    metrics = AgentMetrics()
    with pytest.raises(ValueError, match="counter"):
        metrics.set("calls_total", 3)
    metrics.set("ranks_alive", 3)
    assert metrics.value("ranks_alive") == 3


def test_counters_only_go_up_gauges_both_ways():
    metrics = AgentMetrics()
    with pytest.raises(ValueError, match="cannot go down"):
        metrics.inc("restarts_total", -1)
    metrics.inc("controllers_connected", 2)
    metrics.inc("controllers_connected", -1)
    assert metrics.value("controllers_connected") == 1


def test_concurrent_inc_adds_up_exactly():
    metrics = AgentMetrics()
    threads_n, per_thread = 8, 5_000
    barrier = threading.Barrier(threads_n)

    def work() -> None:
        barrier.wait()
        for _ in range(per_thread):
            metrics.inc("calls_total")
            metrics.inc("sent_bytes_total", 3)

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert metrics.value("calls_total") == threads_n * per_thread
    assert metrics.value("sent_bytes_total") == 3 * threads_n * per_thread
