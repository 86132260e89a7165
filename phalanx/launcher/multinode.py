"""``phalanx run --nnodes N``: one launcher per node, forming one world, as torchrun does.

Every launcher runs its own node's ranks (with the world's ``RANK``, ``WORLD_SIZE``,
``NODE_RANK``, ``GROUP_RANK``) and shows their output under their world ranks. Node 0's
launcher also hosts the job (:mod:`phalanx.launcher.jobhost`); each launcher, node 0's included,
joins it as a :class:`JobMember` and follows it: start an attempt, stop at another node's
failure, restart together, end. So a failure on any node stops every node's ranks within
moments, and every launcher prints the same root cause (rank and node) and exits non-zero.
Each attempt runs on every node as on a single launcher
(:func:`~phalanx.launcher.attempt.run_attempt`, with this node's
:class:`~phalanx.launcher.attempt.JobAttempt`); what follows it is the host's decision, by
the same restart policy (:mod:`phalanx.launcher.policy`).

Which launcher hosts: with ``--rdzv-backend static`` the one with ``--node-rank 0``, at
``--master-addr:--master-port`` (or ``--rdzv-endpoint``); with ``c10d`` the first to bind
``--rdzv-endpoint`` on its own machine (node ranks then follow the order of joining).
"""

from __future__ import annotations

import errno
import queue
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from phalanx.launcher.attempt import JobAttempt, RunFiles, run_attempt
from phalanx.launcher.jobhost import (
    JobError,
    JobHost,
    JobSpec,
    Lines,
    describe,
    send_message,
)
from phalanx.launcher.options import BadOptions, JobOptions, RunOptions
from phalanx.launcher.report import FAILED, Failure, exit_status, format_report
from phalanx.launcher.signals import SignalForwarder
from phalanx.output import console
from phalanx.wire.streams import tune_link
from phalanx.world.frameworks import WorldPart
from phalanx.world.layout import Layout

CONNECT_RETRY = 0.2  # seconds between tries to reach a host not listening yet
EXTRA_WAIT = 30.0  # seconds a member waits beyond the join timeout for the host's word


def host_socket(job: JobOptions) -> socket.socket | None:
    """A listening socket if this launcher hosts the job, else None (another one does)."""
    static_host = job.static and job.node_rank == 0
    if job.static and not static_host:
        return None
    host, port = job.endpoint
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            listener.bind((host, port))
        except OSError as exc:
            elsewhere = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            if not (static_host and elsewhere):
                raise
            listener.bind(("", port))  # a name this machine cannot bind to: all interfaces
        listener.listen(64)
    except OSError as exc:
        listener.close()
        if static_host:
            raise JobError(f"node 0 cannot host the job at {host}:{port}: {exc} "
                           "(--master-addr/--master-port)") from None
        return None  # c10d: the endpoint is taken (another launcher hosts) or elsewhere
    return listener


class JobMember:
    """This launcher's connection to the job's host. ``next()`` returns the host's next
    ``start`` or ``end``; a ``stop`` calls ``on_stop`` from the reader thread at once."""

    def __init__(self, address: tuple[str, int], join: dict[str, Any], deadline: float,
                 on_stop: Callable[[int, str], None]) -> None:
        self.address = address
        self._on_stop = on_stop
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._sock = self._connect(deadline)
        tune_link(self._sock)
        send_message(self._sock, {"type": "join", **join})
        self._lost = "its connection closed"
        self._reader = threading.Thread(target=self._read, name="phalanx-job-member",
                                        daemon=True)
        self._reader.start()

    def _connect(self, deadline: float) -> socket.socket:
        host, port = self.address
        while True:
            try:
                return socket.create_connection(self.address, timeout=5.0)
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise JobError(f"no launcher hosts the job at {host}:{port} ({exc}); "
                                   "is node 0's launcher running?") from None
            time.sleep(CONNECT_RETRY)

    def _read(self) -> None:
        self._sock.settimeout(None)
        lines = Lines(self._sock)
        try:
            while True:
                message = lines.read()
                if message is None:
                    break
                if message["type"] == "stop":
                    self._on_stop(message.get("attempt", -1), str(message.get("cause")))
                    continue
                self._messages.put(message)
                if message["type"] in ("end", "refused"):
                    return
        except (OSError, JobError) as exc:
            self._lost = f"its connection failed: {exc}"
        self._messages.put(None)
        self._on_stop(-1, f"lost the job's host: {self._lost}")

    def next(self, deadline: float | None, interrupted: Callable[[], bool]) -> dict[str, Any]:
        """The host's next ``start``/``end``. Raises JobError when the host is gone, refused
        this launcher, or did not answer by ``deadline``; returns early (``{"type":
        "interrupted"}``) when ``interrupted()`` turns true (a signal)."""
        host, port = self.address
        while True:
            if interrupted():
                return {"type": "interrupted"}
            wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if wait <= 0:
                raise JobError(f"the job's host at {host}:{port} did not start a round in time")
            try:
                message = self._messages.get(timeout=wait)
            except queue.Empty:
                continue
            if message is None:
                raise JobError(f"lost the job's host (node 0's launcher at {host}:{port}): "
                               f"{self._lost}")
            if message["type"] == "refused":
                raise JobError(f"the job at {host}:{port} refused this launcher: "
                               f"{message.get('reason')}")
            return message

    def report(self, message: dict[str, Any]) -> None:
        try:
            send_message(self._sock, message)
        except OSError:
            pass  # the reader sees the loss

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def run_node(options: RunOptions) -> int:
    """This launcher's part of the job ``options.job``; the exit status."""
    job = options.job
    if job is None:
        raise BadOptions("a launcher of a job needs the job's options (RunOptions.job)")
    listener = host_socket(job)
    nonce = secrets.token_hex(16)
    host = None
    address = job.endpoint
    if listener is not None:
        bound = listener.getsockname()
        address = ("127.0.0.1" if bound[0] == "0.0.0.0" else bound[0], bound[1])
        host = JobHost(listener, JobSpec(
            job.min_nodes, job.max_nodes, job.static, options.run_id or uuid.uuid4().hex,
            options.max_restarts, job.join_timeout, job.last_call, job.endpoint[0]), nonce)
        host.start()
    try:
        with SignalForwarder(options.grace) as signals:
            current: dict[str, Any] = {"attempt": -1, "stop_seen": None}

            def on_stop(attempt: int, why: str) -> None:
                if attempt in (-1, current["attempt"]):
                    if current["stop_seen"] is None:
                        current["stop_seen"] = time.time()
                    signals.stop(why)

            member = JobMember(address, {
                "run_id": options.run_id, "node_rank": job.node_rank,
                "nproc": options.procs_per_node, "where": socket.gethostname(),
                "nonce": nonce if host is not None else None,
            }, time.monotonic() + job.join_timeout, on_stop)
            try:
                return _follow(options, job, member, signals, current)
            finally:
                member.close()
    finally:
        if host is not None:
            host.close()


def _follow(options: RunOptions, job: JobOptions, member: JobMember, signals: SignalForwarder,
            current: dict[str, Any]) -> int:
    """Run the attempts the host starts until it ends the job (whether the job restarts
    is the host's decision, by :mod:`.policy`, from every node's report)."""
    files: RunFiles | None = None
    try:
        while True:
            deadline = time.monotonic() + job.join_timeout + EXTRA_WAIT
            try:
                message = member.next(deadline, lambda: signals.received is not None)
            except JobError as exc:
                console.notice(f"phalanx run: {exc}")
                return 128 + signals.received if signals.received else FAILED
            if message["type"] == "interrupted":  # a signal between attempts ends the job
                if current["attempt"] < 0:  # not in the job yet: leaving is enough
                    return 128 + (signals.received or signal.SIGTERM)
                member.report({"type": "done", "attempt": current["attempt"],
                               "signal": signals.received})
                return _stopped_by_signal(member, signals)
            if message["type"] == "end":
                return _ended(options, message, signals)
            share = _job_attempt(message)
            if files is None:
                files = RunFiles(message["run_id"], options.log_dir)
            if message.get("previous") is not None and share.attempt > 0:
                _restart_notice(Failure.from_dict(message["previous"]), share.attempt,
                                int(message.get("max_restarts", options.max_restarts)))
            elif message.get("notice") and current["attempt"] >= 0:
                console.notice(f"phalanx run: {message['notice']}")
            current["attempt"], current["stop_seen"] = share.attempt, None
            signals.new_attempt()
            failure = run_attempt(options, share.attempt, signals, files, share)
            stop_seen = current["stop_seen"]
            member.report({  # a failure after the host's stop is its consequence
                "type": "done", "attempt": share.attempt,
                "failure": None if failure is None else failure.to_dict(),
                "stopped": stop_seen is not None and (failure is None
                                                      or failure.seen >= stop_seen),
                "signal": signals.received,
            })
            if signals.received is not None:
                return _stopped_by_signal(member, signals)
    finally:
        if files is not None:
            files.close()


def _stopped_by_signal(member: JobMember, signals: SignalForwarder) -> int:
    """This launcher got SIGINT/SIGTERM: the host ends the job; wait (briefly) for that."""
    received = signals.received or signal.SIGTERM
    try:
        member.next(time.monotonic() + 10.0, lambda: False)
    except JobError:
        pass
    console.notice(f"phalanx run: stopped by {signal.Signals(received).name}")
    return 128 + received


def _job_attempt(message: dict[str, Any]) -> JobAttempt:
    """This launcher's share of the attempt a host's ``start`` begins."""
    try:
        world = Layout.of([int(c) for c in message["counts"]])
        return JobAttempt(WorldPart(world, int(message["node_rank"])),
                        str(message["master_addr"]), int(message["master_port"]),
                        int(message["attempt"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise JobError(f"a malformed start from the job's host: {exc}") from None


def _restart_notice(failure: Failure, attempt: int, max_restarts: int) -> None:
    console.notice(f"phalanx run: {describe(failure)} {failure.summary}; restarting every node "
                   f"(restart {attempt} of {max_restarts})")


def _ended(options: RunOptions, message: dict[str, Any], signals: SignalForwarder) -> int:
    """How the host ended the job: 0, or the root cause's report and a failing status."""
    if signals.received is not None:
        console.notice(f"phalanx run: stopped by {signal.Signals(signals.received).name}")
        return 128 + signals.received
    data = message.get("failure")
    if data is None:
        return 0
    failure = Failure.from_dict(data)
    status = failure.status if failure.rank is None and message.get("signal") else (
        exit_status(failure, options.exit_code))
    console.notice(format_report(failure, int(message.get("attempts") or 1), status,
                                 whole="the job"))
    return status


