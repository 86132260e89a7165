"""Trust under load: what proving the token costs, and whether strangers that hold every
unauthenticated slot lock real peers out. Real processes, over loopback only.

    python -m bench.trust [--json PATH] [--quick]

One ``phalanx agent`` runs on 127.0.0.6 (a private token file, ``--handshake-timeout 30``,
``--http-port``), as bench.cluster starts its agents. Measured:

- ``stretch_once_ms``: the one-off scrypt of the token (``handshake.stretch``, once per
  process); ``handshake_ms``: the median of ~30 real controller handshakes with the agent
  (``tree.connect_agent(...)``, timed until it returns; each closed after);
- ``offline_guess_s``: one offline guess of a token (``stretch.__wrapped__`` of a candidate,
  scrypt at 32 MiB), ``guesses_per_core_hour`` = 3600 / that, and the guess's memory:
  nominal (scrypt's 128 r N bytes) and measured (peak RSS growth of a fresh interpreter);
- agent lock-out: a real 2-rank ``px.WorkerGroup`` on the agent, started until it has
  answered one call (then shut down, not timed), quiet and while 4 strangers (one process,
  4 threads, each bound to its own source address 127.0.1.1-4) keep twice their address's
  share of the agent's unauthenticated slots open, silently, re-opening each connection as
  soon as the agent shuts it; and the handshake of ``handshake_ms`` under the same attack;
- slowloris on the HTTP port: 4 strangers (127.0.2.1-4) hold 16 half-sent requests each,
  re-opened as soon as closed, while 50 ``/health`` probes from 127.0.0.1 (2 s timeout, 50
  ms apart) are counted;
- the same slowloris on a ``px.dashboard()`` of this process (on 127.0.0.1): 50
  ``/api/state`` requests with the token (in its header) are counted, and the threads this
  process gained while the strangers held theirs;
- the Ray group's listener (``phalanx.backends.ray.channel.Listener``, without Ray; only
  if ``import ray`` works): 12 simulated ranks connect back at once through the actors'
  own ``actor._connect`` (TCP, which retries within ``config.CONNECT_TIMEOUT``), quiet and
  while strangers from 127.0.1.1-4 keep twice their share of its slots open.

The strangers run in a process of their own, so that their threads do not take this
process's GIL from the controller being measured (the machine's CPUs they do share, as a
real attacker's would). Every wait is bounded; agents, strangers, the listener and their
sockets are gone at the end. Prints a table and writes JSON (default
bench/results/trust.json). About 20 s on 2 cores; ``--quick`` does fewer repetitions.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import logging
import os
import secrets
import select
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import fmt, write_json
from bench.util import (
    Errors,
    Row,
    clock,
    compile_sources,
    descendants,
    describe,
    machine_info,
    median,
    new_descendants,
    reap,
    settle,
    still_running,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "bench" / "results" / "trust.json"
NAME = "phalanx"  # the one contender of every Row (bench.report's JSON schema)

AGENT_HOST = "127.0.0.6"  # bench.cluster uses 127.0.0.2-5
OWN_SOURCE = "127.0.0.1"  # the controller, the probes and the simulated ranks
CONTROL_STRANGERS = ("127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4")
HTTP_STRANGERS = ("127.0.2.1", "127.0.2.2", "127.0.2.3", "127.0.2.4")
AGENT_HANDSHAKE_TIMEOUT = 30.0
HALF_REQUEST = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # never finished
DASHBOARD_HALF_REQUEST = b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # never finished
HTTP_HOLD = 16  # half-sent requests each HTTP stranger holds
SURPLUS = 2  # control-port and Ray strangers each hold this many times their address's share
GUESS = b"sunshine-dragon-2024"
RANKS = 12
PROBES, PROBE_TIMEOUT, PROBE_GAP = 50, 2.0, 0.05


class Trivial:
    """The group's workers (importable by the agent's ranks: bench.trust, not __main__)."""

    def ping(self) -> str:
        return "pong"


@dataclasses.dataclass(frozen=True)
class Plan:
    handshakes: int
    guesses: int
    starts: int  # group starts, quiet and attacked, each
    probes: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        return cls(10, 3, 2, 20) if quick else cls(30, 5, 3, PROBES)


# -- the strangers: a process of 4 threads, each from a source address of its own ---------


def _hold(target: tuple[str, int], source: str, hold: int, payload: bytes,
          stop: threading.Event, stats: dict[str, int], full: threading.Event) -> None:
    """Keep ``hold`` connections from ``source`` to ``target`` open (``payload`` sent on
    each, then silence), re-opening each as soon as the other side shuts it, until ``stop``."""
    sel = selectors.DefaultSelector()
    socks: set[socket.socket] = set()
    no_port = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux: port picked at connect
    try:
        while not stop.is_set():
            while len(socks) < hold and not stop.is_set():
                sock = socket.socket()
                try:
                    sock.setsockopt(socket.IPPROTO_IP, no_port, 1)
                    sock.bind((source, 0))
                    sock.settimeout(1.0)
                    sock.connect(target)
                    if payload:
                        sock.sendall(payload)
                    sock.setblocking(False)
                    sel.register(sock, selectors.EVENT_READ)
                except OSError:
                    sock.close()
                    stats["failed"] += 1
                    stop.wait(0.05)
                    break
                socks.add(sock)
                stats["opened"] += 1
            if len(socks) >= hold:
                full.set()
            stats["held"] = len(socks)
            for key, _ in sel.select(0.05) if socks else ():
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # shut by the other side: open another at once
                    sel.unregister(sock)
                    sock.close()
                    socks.discard(sock)
                    stats["closed"] += 1
    finally:
        for sock in socks:
            sock.close()
        sel.close()


def _strangers_main(spec: str) -> int:
    """The strangers' process: starts one thread per source; prints one JSON line once each
    holds its count (or after 10 s), another with the counts when its stdin closes."""
    conf = json.loads(spec)
    target = (conf["host"], conf["port"])
    payload = bytes.fromhex(conf["payload"])
    stop = threading.Event()
    stats = [{"opened": 0, "closed": 0, "failed": 0, "held": 0} for _ in conf["sources"]]
    fulls = [threading.Event() for _ in conf["sources"]]
    threads = [threading.Thread(target=_hold, args=(target, src, conf["hold"], payload, stop,
                                                    s, f), daemon=True)
               for src, s, f in zip(conf["sources"], stats, fulls, strict=True)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    for f in fulls:
        f.wait(max(0.0, deadline - time.monotonic()))
    t_full = time.monotonic()
    print(json.dumps({"full": all(f.is_set() for f in fulls),
                      "held": sum(s["held"] for s in stats),
                      "opened": sum(s["opened"] for s in stats)}), flush=True)
    sys.stdin.read()  # until the benchmark closes it
    elapsed = time.monotonic() - t_full
    stop.set()
    for thread in threads:
        thread.join(5)
    total = {k: sum(s[k] for s in stats) for k in ("opened", "closed", "failed")}
    print(json.dumps({**total, "seconds": elapsed, "per_source": stats,
                      "alive_threads": sum(t.is_alive() for t in threads)}), flush=True)
    return 0


class Strangers:
    """``with Strangers(host, port, sources, hold, payload) as s:`` -- the strangers'
    process holds its connections while the block runs; ``s.report`` after it."""

    def __init__(self, host: str, port: int, sources: tuple[str, ...], hold: int,
                 payload: bytes = b"") -> None:
        self.spec = json.dumps({"host": host, "port": port, "sources": list(sources),
                                "hold": hold, "payload": payload.hex()})
        self.report: dict[str, Any] = {"sources": list(sources), "hold_each": hold}

    def __enter__(self) -> Strangers:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.trust", "--strangers", self.spec], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        line = self.proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if not line:
            self.__exit__()
            raise RuntimeError("the strangers did not start")
        self.report["at_start"] = json.loads(line)
        time.sleep(0.5)  # the agent accepts what is queued; the churn settles
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            out, _ = self.proc.communicate(timeout=15)  # closes stdin: they stop
            last = out.strip().splitlines()
            if last:
                self.report["at_end"] = json.loads(last[-1])
                seconds = self.report["at_end"]["seconds"]
                if seconds > 0:
                    self.report["reopened_per_s"] = self.report["at_end"]["closed"] / seconds
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the agent ------------------------------------------------------------------------------


class Agent:
    """One ``phalanx agent`` on AGENT_HOST with a private token file and an HTTP port."""

    def __enter__(self) -> Agent:
        self.directory = tempfile.mkdtemp(prefix="phalanx-trust-")
        self.token_file = os.path.join(self.directory, "token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        self.port, self.http_port = _free_port(AGENT_HOST), _free_port(AGENT_HOST)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", AGENT_HOST,
             "--port", str(self.port), "--http-port", str(self.http_port),
             "--token-file", self.token_file,
             "--handshake-timeout", str(AGENT_HANDSHAKE_TIMEOUT)],
            env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while self.metrics() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError("the agent did not start")
            time.sleep(0.1)
        return self

    @property
    def address(self) -> str:
        return f"{AGENT_HOST}:{self.port}"

    def metrics(self) -> dict[str, float] | None:
        """The agent's /metrics (without the prefix), or None when it does not answer."""
        try:
            url = f"http://{AGENT_HOST}:{self.http_port}/metrics"
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            return None
        found = {}
        for line in text.splitlines():
            if line.startswith("phalanx_agent_"):
                name, _, value = line.partition(" ")
                found[name.removeprefix("phalanx_agent_")] = float(value)
        return found

    def __exit__(self, *exc_info: object) -> None:
        self.proc.terminate()
        reap([self.proc])
        os.unlink(self.token_file)
        os.rmdir(self.directory)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# -- the measures ---------------------------------------------------------------------------


def _row(key: str, label: str, unit: str, better: str, values: list[float],
         agg: str = "median", **extra: Any) -> Row:
    return Row(key, label, unit, better, raw={NAME: list(values)} if values else {},
               agg=agg, extra=extra)


def measure_stretch(token: bytes) -> tuple[bytes, Row]:
    from phalanx.wire import handshake

    t0 = clock()
    secret = handshake.stretch(token)
    return secret, _row("stretch_once_ms", "token stretch, once a process (scrypt)", "ms",
                        "lower", [(clock() - t0) * 1e3])


def measure_offline_guess(plan: Plan) -> list[Row]:
    from phalanx.wire import handshake

    guess = handshake.stretch.__wrapped__
    times = []
    for i in range(plan.guesses):
        t0 = clock()
        guess(GUESS + str(i).encode())
        times.append(clock() - t0)
    per = median(times)
    params = getattr(handshake, "_SCRYPT", {})
    nominal = 128 * params["r"] * params["n"] / 2**20 if params else None
    # VmHWM, this process's peak RSS in KiB (ru_maxrss would start at the parent's peak)
    code = ("import re; from phalanx.wire import handshake as h\n"
            "def peak():\n"
            "    with open('/proc/self/status') as f:\n"
            "        return int(re.search(r'VmHWM:\\s+(\\d+)', f.read()).group(1))\n"
            f"a = peak(); h.stretch.__wrapped__({GUESS!r}); print(a, peak())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    peak = (int(out[1]) - int(out[0])) / 1024
    return [
        _row("offline_guess_s", "one offline guess of a token", "s", "higher", times,
             scrypt=params),
        _row("guesses_per_core_hour", "offline guesses a core makes an hour", "guesses",
             "lower", [3600 / per] if per else []),
        _row("guess_memory_mib", "one guess's memory, nominal (128 r N)", "MiB", "higher",
             [nominal] if nominal is not None else []),
        _row("guess_peak_rss_mib", "one guess's memory, measured (peak RSS growth)", "MiB",
             "higher", [peak]),
    ]


def _handshakes(host: str, port: int, secret: bytes, tries: int,
                budget: float) -> tuple[list[float], list[str]]:
    """Milliseconds of each real controller handshake that worked, and why others failed;
    no new one after ``budget`` seconds."""
    from phalanx.backends.cluster.tree import connect_agent

    times, failures = [], []
    stop = clock() + budget
    for _ in range(tries):
        if clock() > stop:
            failures.append("not tried: out of time")
            continue
        t0 = clock()
        try:
            joined = connect_agent(host, port, secret, None, 5.0)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        times.append((clock() - t0) * 1e3)
        joined.close()
    return times, failures


def measure_handshake(agent: Agent, secret: bytes, plan: Plan) -> list[Row]:
    settle()
    times, failures = _handshakes(AGENT_HOST, agent.port, secret, plan.handshakes, 30.0)
    return [_row("handshake_ms", f"controller handshake with the agent ({plan.handshakes}x)",
                 "ms", "lower", times, failures=failures)]


def _group_starts(agent: Agent, count: int, budget: float) -> tuple[list[float], dict]:
    """Seconds of each real 2-rank group start until its first call's answer (then shut
    down, that timed apart); no new one after ``budget`` seconds."""
    import phalanx as px
    from bench import trust  # the class by its importable name, also when run as __main__

    starts, shutdowns, failures = [], [], []
    stop = clock() + budget
    for _ in range(count):
        if clock() > stop:
            failures.append("not tried: out of time")
            continue
        settle()
        group = None
        t0 = clock()
        try:
            group = px.WorkerGroup(
                trust.Trivial, procs_per_node=2, start_timeout=20, echo_output=False,
                backend=px.ClusterBackend([agent.address], token_file=agent.token_file))
            answer = group.call("ping")
            if answer != ["pong", "pong"]:
                raise RuntimeError(f"wrong answer {answer!r}")
            starts.append(clock() - t0)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            if group is not None:
                t1 = clock()
                group.shutdown()
                shutdowns.append(clock() - t1)
    return starts, {"shutdown_s": shutdowns, "failures": failures}


def measure_lockout(agent: Agent, secret: bytes, plan: Plan, errors: Errors) -> list[Row]:
    from phalanx import config

    share = config.AGENT_MAX_UNAUTHENTICATED_PER_PEER
    _group_starts(agent, 1, 30.0)  # warm-up, not counted: the agent's first ranks are slower
    quiet, quiet_extra = _group_starts(agent, plan.starts, 60.0)
    before = agent.metrics() or {}
    with Strangers(AGENT_HOST, agent.port, CONTROL_STRANGERS, SURPLUS * share) as strangers:
        attacked, attacked_extra = _group_starts(agent, plan.starts, 60.0)
        settle()
        hs, hs_failures = _handshakes(AGENT_HOST, agent.port, secret, plan.handshakes, 30.0)
    after = agent.metrics() or {}
    attack = {**strangers.report, "agent_limit": config.AGENT_MAX_UNAUTHENTICATED,
              "agent_share": share, "evicted": after.get("handshakes_evicted_total", 0)
              - before.get("handshakes_evicted_total", 0)}
    quiet_s, attacked_s = median(quiet), median(attacked)
    if not attacked:
        errors.record("lockout", NAME, RuntimeError(
            "no group started under attack: " + "; ".join(attacked_extra["failures"])))
    return [
        _row("group_start_quiet_s", "2-rank group start to first answer, quiet", "s",
             "lower", quiet, **quiet_extra),
        _row("group_start_attacked_s", "the same, strangers hold every slot", "s", "lower",
             attacked, **attacked_extra, attack=attack),
        _row("group_start_attacked_over_quiet", "group start: attacked / quiet", "x", "lower",
             [attacked_s / quiet_s] if quiet_s and attacked_s else []),
        _row("handshake_attacked_ms", f"controller handshake under attack "
             f"({plan.handshakes}x)", "ms", "lower", hs, failures=hs_failures),
    ]


def _probes(host: str, port: int, path: str, headers: dict[str, str],
            plan: Plan) -> tuple[int, int, list[float], list[str]]:
    """``plan.probes`` GETs of ``path`` from OWN_SOURCE: how many were answered, how many
    with 200, the answered ones' milliseconds, and why the others were not."""
    answered, ok, latencies, failures = 0, 0, [], []
    stop = clock() + 40
    for i in range(plan.probes):
        if clock() > stop:
            failures.append("not sent: out of time")
            continue
        if i:
            time.sleep(PROBE_GAP)
        conn = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT,
                                          source_address=(OWN_SOURCE, 0))
        t0 = clock()
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            response.read()
            answered += 1
            ok += response.status == 200
            latencies.append((clock() - t0) * 1e3)
        except (OSError, http.client.HTTPException) as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            conn.close()
    return answered, ok, latencies, failures


def measure_slowloris(agent: Agent, plan: Plan) -> list[Row]:
    with Strangers(AGENT_HOST, agent.http_port, HTTP_STRANGERS, HTTP_HOLD,
                   HALF_REQUEST) as strangers:
        answered, ok, latencies, failures = _probes(AGENT_HOST, agent.http_port, "/health",
                                                    {}, plan)
    return [
        _row("probes_answered", f"/health probes answered under slowloris (of "
             f"{plan.probes})", "probes", "higher", [answered], ok_200=ok,
             failures=failures, attack=strangers.report),
        _row("probe_ms", "/health probe under slowloris, answered ones", "ms", "lower",
             latencies),
    ]


def measure_dashboard_slowloris(plan: Plan) -> list[Row]:
    import phalanx as px
    from phalanx import config

    with px.dashboard() as board:
        token = {"X-Phalanx-Token": board.token}
        settle()
        before = threading.active_count()
        with Strangers(board.host, board.port, HTTP_STRANGERS, HTTP_HOLD,
                       DASHBOARD_HALF_REQUEST) as strangers:
            held = threading.active_count() - before
            answered, ok, latencies, failures = _probes(board.host, board.port, "/api/state",
                                                        token, plan)
    attack = {**strangers.report, "dashboard_limit": config.DASHBOARD_MAX_CONNECTIONS}
    return [
        _row("dashboard_probes_answered", f"dashboard /api/state answered under slowloris "
             f"(of {plan.probes})", "requests", "higher", [answered], ok_200=ok,
             failures=failures, attack=attack),
        _row("dashboard_probe_ms", "dashboard /api/state under slowloris, answered ones",
             "ms", "lower", latencies),
        _row("dashboard_threads_held", f"threads the controller gained while "
             f"{len(HTTP_STRANGERS)}x{HTTP_HOLD} half-sent requests were held", "threads",
             "lower", [held], cap=config.DASHBOARD_MAX_CONNECTIONS),
    ]


def _rank_connects(port: int, secret: bytes) -> tuple[list[float], list[str]]:
    """Milliseconds of each of RANKS simulated ranks' connect-back (all at once, as a
    group's actors do), and why those that failed did."""
    from phalanx.backends.ray.actor import _connect
    from phalanx.wire import handshake

    times: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one(rank: int) -> None:
        t0 = clock()
        try:
            sock, _ = _connect((OWN_SOURCE, port, ""), secret,
                               handshake.Hello(handshake.ROLE_CONTROL, rank, 1))
        except Exception as exc:
            with lock:
                failures.append(f"after {clock() - t0:.1f} s: {type(exc).__name__}: "
                                f"{exc}"[:200])
            return
        elapsed = (clock() - t0) * 1e3
        sock.close()
        with lock:
            times.append(elapsed)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    from phalanx import config

    deadline = time.monotonic() + config.CONNECT_TIMEOUT + 10
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    with lock:
        return list(times), failures + [f"{stuck} still connecting at the deadline"] * bool(stuck)


def measure_ray_listener(errors: Errors) -> list[Row]:
    try:
        import ray  # noqa: F401  (only whether it imports)
    except Exception as exc:
        print(f"  (Ray listener skipped: import ray failed: {exc})", flush=True)
        return []
    from phalanx.backends.ray.channel import MAX_HANDSHAKES_PER_PEER, Listener

    secret = secrets.token_bytes(32)
    arrived: list[int] = []

    def took(hello: Any, sock: socket.socket) -> None:
        arrived.append(hello.rank)
        sock.close()

    listener = Listener(OWN_SOURCE, secret, took)
    try:
        share = getattr(listener, "per_peer", MAX_HANDSHAKES_PER_PEER)
        settle()
        quiet, quiet_failures = _rank_connects(listener.port, secret)
        with Strangers(OWN_SOURCE, listener.port, CONTROL_STRANGERS,
                       SURPLUS * share) as strangers:
            attacked, attacked_failures = _rank_connects(listener.port, secret)
    finally:
        listener.close()
    attack = {**strangers.report, "listener_limit": getattr(listener, "limit", None),
              "listener_share": share}
    if len(attacked) < RANKS:
        errors.record("ray", NAME, RuntimeError(
            f"{RANKS - len(attacked)} of {RANKS} ranks could not connect back under attack"))
    return [
        _row("rank_connect_quiet_ms", f"Ray rank connect-back, {RANKS} at once, quiet", "ms",
             "lower", quiet, failures=quiet_failures),
        _row("ranks_connected_quiet", f"ranks connected, quiet (of {RANKS})", "ranks",
             "higher", [len(quiet)]),
        _row("rank_connect_attacked_ms", "Ray rank connect-back, strangers hold every slot",
             "ms", "lower", attacked, failures=attacked_failures, attack=attack),
        _row("rank_connect_attacked_max_ms", "the same, slowest rank that connected", "ms",
             "lower", attacked, agg="max"),
        _row("ranks_connected_attacked", f"ranks connected under attack (of {RANKS})",
             "ranks", "higher", [len(attacked)]),
    ]


# -- the table ------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = ["measure", "what", "value", "unit", "n", "range"]
    body = []
    for row in rows:
        values = row.raw.get(NAME, [])
        spread = f"{fmt(min(values))}..{fmt(max(values))}" if len(values) > 1 else ""
        unit = f"{row.unit} ({row.better} better)"
        body.append([row.key, row.label, fmt(row.value(NAME)), unit, str(len(values)), spread])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        left = {0, 1, 3}
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(head), "-" * len(line(head)), *(line(cells) for cells in body)])


def attack_notes(rows: list[Row]) -> list[str]:
    """One line per attack: who held what, how fast they re-opened, what the far side shut."""
    notes = []
    for row in rows:
        attack = row.extra.get("attack")
        if not attack or "at_end" not in attack:
            continue
        sources = attack["sources"]
        far = (f", the agent evicted {fmt(attack['evicted'])}" if "evicted" in attack else "")
        notes.append(f"  {row.key}: {len(sources)} strangers ({sources[0]}..) x "
                     f"{attack['hold_each']} connections, {fmt(attack.get('reopened_per_s'))} "
                     f"re-opened/s{far}")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trust",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--strangers", help=argparse.SUPPRESS)  # the strangers' process
    args = parser.parse_args(argv)
    if args.strangers:
        return _strangers_main(args.strangers)
    logging.getLogger("phalanx").setLevel(logging.ERROR)  # the refusals are the point
    from phalanx.backends.cluster.token import read_token

    plan = Plan.make(args.quick)
    compile_sources()  # the agent's ranks would otherwise compile phalanx (see bench.util)
    errors = Errors()
    rows: list[Row] = []
    machine = machine_info()
    before = set(descendants())
    t_run = clock()

    def section(name: str, fn: Callable[[], list[Row]]) -> None:
        print(f"  {name} ...", flush=True)
        rows.extend(errors.attempt(name, NAME, fn) or [])

    section("offline guess", lambda: measure_offline_guess(plan))
    with Agent() as agent:
        secret, stretched = measure_stretch(read_token(agent.token_file))
        rows.append(stretched)
        section("handshake", lambda: measure_handshake(agent, secret, plan))
        section("agent lock-out", lambda: measure_lockout(agent, secret, plan, errors))
        section("slowloris", lambda: measure_slowloris(agent, plan))
    section("dashboard slowloris", lambda: measure_dashboard_slowloris(plan))
    section("ray listener", lambda: measure_ray_listener(errors))
    left = still_running(new_descendants(before))
    rows.append(_row("leftover_processes", "processes of this run alive at its end",
                     "processes", "lower", [len(left)], which=describe(left)))
    if left:
        errors.record("cleanup", NAME, RuntimeError(f"{len(left)} processes left: "
                                                    + "; ".join(describe(left))))
    order = ["stretch_once_ms", "handshake_ms"]
    rows.sort(key=lambda r: order.index(r.key) if r.key in order else len(order))
    seconds = clock() - t_run
    payload: dict[str, Any] = {
        "benchmark": "trust", "quick": args.quick, "plan": dataclasses.asdict(plan),
        "seconds": seconds,
        "summary": {row.key: row.value(NAME) for row in rows},
        "errors": errors.items, "machine": machine,
    }
    write_json(args.json, payload, rows)
    print(table(rows))
    for note in attack_notes(rows):
        print(note)
    print(f"({seconds:.0f} s)  JSON: {args.json}")
    return 1 if errors.items else 0


if __name__ == "__main__":
    sys.exit(main())
