"""The host of a multi-node ``phalanx run``: node 0's launcher keeps the job together.

With ``--nnodes N`` one launcher runs on each node. They meet here, at ``--master-addr:
--master-port`` (static rendezvous) or ``--rdzv-endpoint`` (c10d), over TCP with one JSON
object per line (no pickle: nothing a peer sends is executed). The host

- admits launchers to a :class:`~phalanx.launcher.roster.Roster` until an attempt can
  start, or fails the job after ``join_timeout`` naming who never came;
- starts an attempt: each member learns its node rank, the world's layout, the run id and
  the ranks' ``MASTER_ADDR:MASTER_PORT`` (a port free on the host, new each attempt, where
  rank 0's ``init_process_group`` hosts torch's store);
- at the first failure anywhere (a rank, a launcher gone, a launcher stopped by a signal)
  tells every other member to stop its ranks, waits for them, and picks the root cause;
- asks the restart policy (:mod:`phalanx.launcher.policy`) what follows: every node
  restarts together while ``--max-restarts`` allows (or starts again as a larger world
  when a node joined), and finally every member learns how the job ended, so each launcher
  prints the same root cause and exits with the same meaning.

Messages (``type``): member -> host ``join``, ``done``; host -> member ``start``, ``stop``,
``end``, ``refused``.

Each connection is read on a thread of its own, so their number is bounded: the job's most
nodes plus ``config.JOB_MAX_EXTRA_CONNECTIONS`` (launchers joining late, or again). One more
is refused as it is accepted -- a ``refused`` message naming the limit, then closed -- on
the accepting thread, with no thread of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import queue
import signal
import socket
import threading
import time
from typing import Any

from phalanx import config
from phalanx.errors import PhalanxError
from phalanx.launcher.policy import AttemptStatus, RestartDecision, decide
from phalanx.launcher.report import Failure
from phalanx.launcher.roster import Member, Roster, layout_counts, root_cause
from phalanx.node.machine import free_port
from phalanx.wire.streams import tune_link

logger = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20  # bytes in one line (a failure carries a traceback and stderr lines)
CLOSE_WAIT = 5.0  # seconds the host waits for members to take the end of the job


def describe(failure: Failure) -> str:
    """``rank 3 (node 1)``, or ``node 1`` for a launcher's own failure."""
    if failure.rank is None:
        return "the job" if failure.node is None else f"node {failure.node}"
    return f"rank {failure.rank} (node {failure.node})"


class JobError(PhalanxError):
    """The launchers could not form or keep the job (a join refused, a host gone)."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


class Lines:
    """Reads one JSON object per line from a socket; refuses lines over ``MAX_MESSAGE``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def read(self) -> dict[str, Any] | None:
        """The next message; None at the end of the connection."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_MESSAGE:
                raise JobError(f"a message over {MAX_MESSAGE} bytes")
            data = self._sock.recv(65536)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise JobError(f"not a launcher's message: {line[:80]!r}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise JobError(f"not a launcher's message: {line[:80]!r}")
        return message


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the host needs to run the job's attempts."""

    min_nodes: int
    max_nodes: int
    static: bool
    run_id: str
    max_restarts: int
    join_timeout: float
    last_call: float
    master_addr: str  # the ranks' MASTER_ADDR: this machine, as the other nodes reach it


class JobHost:
    """The job's host, on threads of node 0's launcher: ``start()``, then ``close()``."""

    def __init__(self, listener: socket.socket, spec: JobSpec, nonce: str) -> None:
        self._listener = listener
        self._spec = spec
        self._nonce = nonce  # the hosting launcher's own join says it: it becomes node 0
        self._roster = Roster(spec.min_nodes, spec.max_nodes, spec.static, spec.last_call)
        self._events: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._conns: dict[int, socket.socket] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._refused = 0  # connections turned away (past max_connections)

    @property
    def address(self) -> tuple[str, int]:
        address: tuple[str, int] = self._listener.getsockname()[:2]  # (IPv6: 4 fields)
        return address

    def start(self) -> None:
        for target, name in ((self._accept, "phalanx-job-accept"),
                             (self._serve, "phalanx-job-host")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float = CLOSE_WAIT + 1) -> None:
        """Stop serving (after the job's end went out, or at once if it never will)."""
        self._closing = True
        self._events.put(("close", -1, None))
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._threads[-1].join(timeout)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()

    # -- connections ----------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            with self._lock:
                served = len(self._conns)
                admitted = served < self.max_connections
                if admitted:
                    key = next(self._keys)
                    self._conns[key] = conn
            if not admitted:
                self._turn_away(conn, peer, served)
                continue
            tune_link(conn)
            thread = threading.Thread(target=self._read, args=(key, conn, f"{peer[0]}"),
                                      name="phalanx-job-member", daemon=True)
            thread.start()

    @property
    def max_connections(self) -> int:
        """The most connections served at once (each holds a reader thread)."""
        return self._spec.max_nodes + config.JOB_MAX_EXTRA_CONNECTIONS

    def _turn_away(self, conn: socket.socket, peer: tuple[Any, ...], served: int) -> None:
        """Refuse a connection past :attr:`max_connections`: say why, if its buffer takes
        it at once (nothing here waits on a peer), then close it."""
        reason = (f"the job's host serves {served} connections already, its limit (the "
                  f"job's most nodes, {self._spec.max_nodes}, plus "
                  f"{config.JOB_MAX_EXTRA_CONNECTIONS}: phalanx.config."
                  "JOB_MAX_EXTRA_CONNECTIONS)")
        self._refused += 1  # a flood logs once, not once a connection
        (logger.warning if self._refused == 1 else logger.debug)(
            "refused a connection from %s: %s", peer[0], reason)
        line = json.dumps({"type": "refused", "reason": reason}).encode() + b"\n"
        with contextlib.suppress(OSError):
            conn.send(line, socket.MSG_DONTWAIT)
            conn.shutdown(socket.SHUT_WR)
            # what it sent already is read (a join: one line), so that closing does not
            # reset the connection -- a reset can discard the refusal before it is read
            for _ in range(16):
                if not conn.recv(65536, socket.MSG_DONTWAIT):
                    break
        conn.close()

    def _read(self, key: int, conn: socket.socket, peer: str) -> None:
        lines = Lines(conn)
        reason = "its connection closed"
        # A launcher joins as soon as it connects: one that says nothing in time gives its
        # place (and thread) back rather than hold it for good.
        conn.settimeout(config.JOB_JOIN_WITHIN)
        try:
            while True:
                try:
                    message = lines.read()
                except TimeoutError:
                    reason = (f"it sent no join within {config.JOB_JOIN_WITHIN:g} s "
                              "(phalanx.config.JOB_JOIN_WITHIN)")
                    logger.debug("closing a connection from %s: %s", peer, reason)
                    break
                if message is None:
                    break
                conn.settimeout(None)  # a member: it speaks when its attempt ends
                self._events.put(("message", key, (peer, message)))
        except (OSError, JobError) as exc:
            reason = f"its connection failed: {exc}"
        self._events.put(("lost", key, reason))

    def _send(self, key: int, message: dict[str, Any]) -> None:
        with self._lock:
            conn = self._conns.get(key)
        if conn is None:
            return
        try:
            send_message(conn, message)
        except OSError as exc:  # its reader thread reports the loss
            logger.debug("cannot reach launcher %d: %s", key, exc)

    def _drop(self, key: int) -> None:
        with self._lock:
            conn = self._conns.pop(key, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    # -- the job --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._attempts()
        except Exception as exc:  # a bug here must not leave every launcher waiting
            logger.exception("the job's host failed")
            self._end(Failure(None, None, None, 1, f"failed: its host broke down: "
                              f"{type(exc).__name__}: {exc}", seen=time.time()), 0)

    def _attempts(self) -> None:
        spec = self._spec
        attempt, previous, notice = 0, None, None
        while not self._closing:
            members = self._gather(time.monotonic() + spec.join_timeout)
            if members is None:
                return
            self._begin(attempt, members, previous, notice)
            failures, stopped_by, grown = self._watch(attempt, members)
            cause = root_cause(failures)
            decision = decide(AttemptStatus(attempt, spec.max_restarts, tuple(failures),
                                            signal=stopped_by, joined=grown))
            if decision is RestartDecision.REFORM:  # the world with the newcomers, as torchrun
                previous, notice = None, (f"a node joined; restarting every node as "
                                          f"{len(self._roster)} nodes")
            elif decision is RestartDecision.RESTART:
                previous, notice, attempt = cause, None, attempt + 1
            else:  # DONE, FAIL or STOP
                self._end(cause, attempt + 1, stopped_by)
                return

    def _gather(self, deadline: float) -> list[Member] | None:
        """Wait until an attempt can start; None if the job ended meanwhile (timed out)."""
        roster = self._roster
        while not roster.ready(time.monotonic()):
            now = time.monotonic()
            if now >= deadline:
                waited = self._spec.join_timeout
                self._end(Failure(None, None, None, 1, f"could not start: "
                                  f"{roster.missing()} within {waited:g} s", seen=time.time()),
                          0)
                return None
            wait = deadline - now
            decision = roster.next_decision(now)
            if decision is not None:
                wait = min(wait, decision + 0.01)
            try:
                event = self._events.get(timeout=wait)
            except queue.Empty:
                continue
            if not self._handle_between_attempts(event):
                return None
        return roster.assign()

    def _handle_between_attempts(self, event: tuple[str, int, Any]) -> bool:
        kind, key, data = event
        if kind == "close":
            return False
        if kind == "lost":
            self._roster.leave(key)
            self._drop(key)
        elif kind == "message":
            peer, message = data
            if message["type"] == "join":
                self._join(key, peer, message)
        return True

    def _join(self, key: int, peer: str, message: dict[str, Any]) -> bool:
        """Admit a launcher to the next attempt; whether it was admitted."""
        spec = self._spec
        wanted = message.get("run_id")
        if wanted not in (None, spec.run_id):
            self._refuse(key, f"this job's run id is {spec.run_id!r}, not {wanted!r} "
                              "(--rdzv-id)")
            return False
        try:
            member = Member(key, int(message["node_rank"]) if spec.static else None,
                            int(message["nproc"]), str(message.get("where") or peer),
                            hosting=message.get("nonce") == self._nonce)
        except (KeyError, TypeError, ValueError):
            self._refuse(key, "a malformed join")
            return False
        reason = self._roster.join(member, time.monotonic())
        if reason is not None:
            self._refuse(key, reason)
        return reason is None

    def _refuse(self, key: int, reason: str) -> None:
        self._send(key, {"type": "refused", "reason": reason})
        self._drop(key)

    def _begin(self, attempt: int, members: list[Member], previous: Failure | None,
               notice: str | None = None) -> None:
        spec = self._spec
        try:
            master_port = free_port(spec.master_addr)
        except OSError:  # a name for this machine it cannot bind to: any interface
            master_port = free_port("")
        for node, member in enumerate(members):
            self._send(member.key, {
                "type": "start", "attempt": attempt, "node_rank": node,
                "counts": layout_counts(members), "master_addr": spec.master_addr,
                "master_port": master_port, "run_id": spec.run_id,
                "max_restarts": spec.max_restarts,
                "previous": None if previous is None else previous.to_dict(),
                "notice": notice,
            })
        logger.info("job %s attempt %d: %d nodes", spec.run_id, attempt, len(members))

    def _watch(self, attempt: int, members: list[Member],
               ) -> tuple[list[Failure], int | None, bool]:
        """Run one attempt to its end: every member reported, or was lost. The failures
        seen, the signal that stopped a launcher (no restart after that), and whether a node
        joined meanwhile (c10d below MAX nodes: the attempt stops to re-form the world)."""
        node_of = {m.key: node for node, m in enumerate(members)}
        pending = set(node_of)
        failures: list[Failure] = []
        stopped_by: int | None = None
        stopping = grown = False
        while pending:
            kind, key, data = self._events.get()
            if kind == "close":
                break
            if kind == "lost":
                self._roster.leave(key)
                self._drop(key)
                if key in pending:
                    pending.discard(key)
                    failures.append(Failure(None, node_of[key], None, 1,
                                            f"lost its launcher: {data}", seen=time.time()))
            elif kind == "message":
                peer, message = data
                if message["type"] == "join":  # for the next attempt, if there is one
                    grown = self._join(key, peer, message) or grown
                elif (message["type"] == "done" and message.get("attempt") == attempt
                      and key in pending):
                    pending.discard(key)
                    failure, number = self._outcome(node_of[key], message)
                    if failure is not None:
                        failures.append(failure)
                    if number is not None and stopped_by is None:
                        stopped_by = number
            if (failures or stopped_by is not None or grown) and not stopping:
                stopping = True
                cause = f"{describe(failures[-1])} failed" if failures else "a node joined"
                for other in pending:
                    self._send(other, {"type": "stop", "attempt": attempt, "cause": cause})
        return failures, stopped_by, grown

    @staticmethod
    def _outcome(node: int, message: dict[str, Any]) -> tuple[Failure | None, int | None]:
        """A member's report: its failure (None: its ranks finished, or were stopped as
        asked), and the signal that stopped its launcher."""
        number = message.get("signal")
        if isinstance(number, int):
            name = signal.Signals(number).name if number in signal.valid_signals() else number
            return Failure(None, node, None, 128 + number,
                           f"was stopped: its launcher got {name}", seen=time.time()), number
        data = message.get("failure")
        if message.get("stopped") or not isinstance(data, dict):
            return None, None
        try:
            return Failure.from_dict(data), None
        except (TypeError, ValueError):
            return Failure(None, node, None, 1, "failed (its report was unreadable)",
                           seen=time.time()), None

    def _end(self, cause: Failure | None, attempts: int, stopped_by: int | None = None) -> None:
        """Tell every member how the job ended, and wait (briefly) until they have it."""
        message = {"type": "end", "failure": None if cause is None else cause.to_dict(),
                   "attempts": attempts, "signal": stopped_by}
        with self._lock:
            keys = list(self._conns)
        for key in keys:
            self._send(key, message)
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_WAIT
        remaining = set(keys)
        while remaining and time.monotonic() < deadline:
            try:
                kind, key, _ = self._events.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if kind == "lost":
                remaining.discard(key)
            elif kind == "close":
                break
        self._closing = True
