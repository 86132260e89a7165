"""The Ray backend's relay transport, both ends: for a controller the cluster cannot
connect back to (a Ray Client driver, or ``RayBackend(transport="ray")``), each rank's
streams travel as Ray calls through its actor. Same messages, Ray's speed.

:class:`RelayedRankActor` is the rank's actor, a threaded one (the relay's calls run beside
``serve_relayed``) that starts the rank as a child process under a node supervisor of its
own (:mod:`phalanx.node.supervisor`) and holds its streams (:class:`_Relay`);
:class:`RelayChannel` is the controller's side, whose two threads move the bytes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from phalanx import config
from phalanx.backends.base import RankStart
from phalanx.backends.ray.channel import Bundle, ChannelServices, RayChannel
from phalanx.wire import streams

logger = logging.getLogger(__name__)

RELAY_CONCURRENCY = 4  # the RelayedRankActor: serve_relayed, plus stop / signal / the relay's


class _Relay:
    """The actor's ends of a relayed rank's streams, and what they wrote meanwhile."""

    def __init__(self, ends: list[socket.socket]) -> None:
        self._ends = ends
        self._outbox: list[tuple[int, bytes]] = []
        self._cond = threading.Condition()
        self._ended = False
        self._next = 0
        self._early: dict[int, bytes] = {}
        self._in_lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._read, name="phalanx-relay", daemon=True).start()

    def _read(self) -> None:
        open_ends = {end.fileno(): (i, end) for i, end in enumerate(self._ends)}
        while open_ends:
            ready = streams.wait_readable(list(open_ends), None)
            for fd in ready:
                index, end = open_ends[fd]
                try:
                    data = end.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    del open_ends[fd]
                    continue
                with self._cond:
                    self._outbox.append((index, data))
                    self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def deliver(self, seq: int, data: bytes) -> None:
        with self._in_lock:
            self._early[seq] = data
            while self._next in self._early:
                chunk = self._early.pop(self._next)
                self._next += 1
                try:
                    self._ends[0].sendall(chunk)
                except OSError:  # the rank is gone; its death is reported by serve
                    pass

    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        with self._cond:
            if not self._outbox and not self._ended:
                self._cond.wait(timeout)
            out, self._outbox = self._outbox, []
            if not out and self._ended:
                return [(-1, b"")]
            return out


class RelayedRankActor:
    """One rank's place in Ray when its streams travel as Ray calls (``transport="ray"``, a
    Ray Client driver): a threaded actor supervising the rank's process, which it starts
    under a node supervisor of its own. Process tree: actor -> supervisor -> keeper -> rank
    -> whatever the rank starts; the keeper ends what the rank left when it exits, the
    supervisor everything below it when the actor dies. :meth:`stop`, :meth:`signal` and
    the relay's calls run beside ``serve_relayed``."""

    def __init__(self) -> None:
        from phalanx.node.stacks import StackFile

        self._proc: Any = None  # a phalanx.node.supervisor.SupervisedProcess
        self._stack_file = StackFile()  # the rank dumps its stacks here on request
        self._spawner: Any = None  # a phalanx.node.spawn.RankSpawner
        self._spare: Any = None  # a phalanx.node.spawn.PrestartedWorker
        self._relay_ready = threading.Event()
        self._relay: _Relay | None = None
        # The supervisor, then the rank's interpreter under it, start now, beside the
        # constructor (which returns at once), while the controller is still placing the
        # other actors: by the time this rank is assigned its imports are done.
        self._spare_thread = threading.Thread(target=self._prestart, daemon=True)
        self._spare_thread.start()

    def _prestart(self) -> None:
        from phalanx.node import spawn as node

        try:
            self._spawner = node.RankSpawner()
            self._spare = self._spawner.prestart({**os.environ, "PYTHONUNBUFFERED": "1"},
                                                 stacks_fd=self._stack_file.fd)
        except OSError:  # serve_relayed() tries again, and fails with the reason
            self._spare = None

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node now."""
        from phalanx.node.machine import pick_free_ports

        return pick_free_ports(host, count)

    def _start_rank(self, env: Mapping[str, str], cwd: str | None, control: tuple[int, ...],
                    out: int, err: int) -> Any:
        """The rank's process: the interpreter started early if it fits, else a new one
        (under the same supervisor)."""
        from phalanx.node import spawn as node

        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self._spare_thread.join()
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.alive() and spare.fits(full_env):
            proc = spare.assign(env, cwd, control, out, err)
        else:
            if spare is not None:
                spare.discard()
            if self._spawner is None:
                self._spawner = node.RankSpawner()
            proc = self._spawner.start_on(full_env, cwd, control, (out, err),
                                          stacks_fd=self._stack_file.fd)
        self._proc = proc
        return proc

    def _supervise(self, proc: Any) -> dict[str, Any]:
        """Wait for the rank's process, and for its keeper to end what it left behind;
        its pid and exit status."""
        code = proc.exitcode(None)
        proc.wait_cleaned(config.CLEANUP_WAIT)
        proc.release()
        return {"pid": proc.pid, "exitcode": code}

    def serve_relayed(self, env: Mapping[str, str], cwd: str | None) -> dict[str, Any]:
        """Run the rank for a controller this node cannot connect to (a Ray Client
        driver): the rank's streams end here, and the controller moves their bytes with
        :meth:`deliver` and :meth:`poll`. Same messages, Ray's speed."""
        pairs = [socket.socketpair() for _ in range(3)]  # control, stdout, stderr
        self._relay = _Relay([mine for mine, _ in pairs])
        self._relay_ready.set()
        try:
            proc = self._start_rank(env, cwd, (pairs[0][1].fileno(),), pairs[1][1].fileno(),
                                    pairs[2][1].fileno())
        finally:
            for _, theirs in pairs:
                theirs.close()
        self._relay.start()
        return self._supervise(proc)

    def deliver(self, seq: int, data: bytes) -> None:
        """Bytes from the controller for the rank's control stream, in ``seq`` order
        (Ray may run two calls of a threaded actor out of order)."""
        self._ready_relay().deliver(seq, data)

    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        """What the rank wrote since the last poll, as ``(stream, bytes)`` (0: control,
        1: stdout, 2: stderr), waiting up to ``timeout`` s for something; ``(-1, b"")``
        once every stream has ended."""
        return self._ready_relay().poll(timeout)

    def _ready_relay(self) -> _Relay:
        """The relay :meth:`serve_relayed` makes, once it has (it runs beside them)."""
        self._relay_ready.wait(config.CONNECT_TIMEOUT)
        if self._relay is None:
            raise RuntimeError(f"no relay: serve_relayed() did not start within "
                               f"{config.CONNECT_TIMEOUT:g} s")
        return self._relay

    def stop(self, grace: float) -> None:
        """SIGTERM the rank's process tree, SIGKILL after ``grace`` s, reap."""
        from phalanx.node import spawn as node

        if self._proc is not None:
            node.stop_processes([self._proc], grace=grace, force=grace <= 0)

    def stacks(self, timeout: float) -> str:
        """Every thread's stack of the rank's process (see :mod:`phalanx.node.stacks`)."""
        if self._proc is None:
            return "(no stack: the rank's process has not started)"
        return self._stack_file.take(self._proc.pid, timeout)

    def signal(self, sig: int) -> None:
        """Deliver ``sig`` to the rank's process group, as a terminal would."""
        if self._proc is not None:
            self._proc.signal_group(sig)


class RelayChannel(RayChannel):
    """A rank whose streams the controller cannot receive directly (a Ray Client driver):
    its actor holds them, and two threads here move their bytes with Ray calls. The
    control stream still ends in a local socket watched by the dispatcher, so every
    message, death and record is handled exactly as for a direct rank."""

    _POLL = 0.5  # seconds a poll call waits on the actor for something to carry

    def __init__(self, services: ChannelServices, start: RankStart, bundle: Bundle) -> None:
        super().__init__(services, start, bundle)
        self.ray_worker = False  # a child of its actor: it reads put objects from the node
        mine, self._far = socket.socketpair()
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self._tap = services.logs.attach(self.rank, out_r, err_r)
        with self._lock:
            self._adopt(streams.SocketStream(mine))

    def signal(self, rank: int, sig: int) -> None:
        """Through the actor, which runs beside the rank on its node (any node)."""
        try:
            self._services.ray.get(self.actor.signal.remote(int(sig)),
                                   timeout=config.RAY_SIGNAL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the actor is gone: so is the rank
            logger.debug("signal %s to rank %d not delivered: %s", sig, self.rank, exc)

    def stacks(self, rank: int, timeout: float) -> str:
        """Taken by the actor, on the rank's node."""
        try:
            text: str = self._services.ray.get(self.actor.stacks.remote(timeout),
                                               timeout=timeout + config.RAY_SIGNAL_TIMEOUT)
            return text
        except Exception as exc:  # noqa: BLE001 - the actor is gone, or too slow to answer
            return f"(no stack: its Ray actor did not answer: {type(exc).__name__}: {exc})"

    def start_relay(self) -> None:
        for target, name in ((self._downstream, "down"), (self._upstream, "up")):
            threading.Thread(target=target, name=f"phalanx-relay-{name}-{self.rank}",
                             daemon=True).start()

    def _downstream(self) -> None:
        """Controller -> rank: what the group sent, in order."""
        seq = 0
        while True:
            try:
                data = self._far.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            self.actor.deliver.remote(seq, data)
            seq += 1

    def _upstream(self) -> None:
        """Rank -> controller: its messages and output, until its streams end."""
        ray = self._services.ray
        try:
            while not self._closed:
                try:
                    items = ray.get(self.actor.poll.remote(self._POLL), timeout=60)
                except Exception as exc:  # noqa: BLE001 - the actor is gone: so is the rank
                    logger.debug("relay of rank %d ends: %s", self.rank, exc)
                    return
                for stream, data in items:
                    if stream < 0:
                        return
                    if stream == 0:
                        self._far.sendall(data)
                    else:
                        os.write(self._out_w if stream == 1 else self._err_w, data)
        except OSError:
            return
        finally:
            for fd in (self._out_w, self._err_w):
                os.close(fd)
            # the dispatcher sees the control stream end (the downstream thread's pending
            # recv would keep a merely closed socket open)
            streams.close_socket(self._far)
