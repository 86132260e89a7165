"""The Ray backend's channels: one rank's control stream, output, side stream (to its
warden: :class:`SideStream`) and Ray's account of its actor (:class:`RayChannel`), and the
same for ranks whose streams must travel as Ray calls (``RelayChannel``, in
:mod:`phalanx.backends.ray.relay`); and the :class:`Listener` the actors connect back to.
See :mod:`phalanx.backends.ray.backend`.

A channel uses three things of its backend, handed to it as :class:`ChannelServices`: the
``ray`` module (to reach the rank's actor), the thread that writes every control stream,
and the pump that shows the ranks' output.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.base import Channel, EventSink, RankStart
from phalanx.backends.ray.exits import ExitWatch
from phalanx.errors import AuthenticationError, ProcessFailure
from phalanx.node.spawn import Burial
from phalanx.node.warden import SideStream
from phalanx.output.logs import LogPump, OutputTap
from phalanx.rank.kept import machine as blocks_of_here
from phalanx.wire import framing, handshake, protocol, seal, streams
from phalanx.wire.admission import Admission

logger = logging.getLogger(__name__)

_HEAD_SIZE = protocol.HEAD_SIZE
_CAUSE_POLL = 0.05  # seconds between two looks at a dead rank's warden (_await_cause)
_EXIT_LOOK = 0.002  # seconds between two looks for other news while its process is awaited


# A rank's account when this process left Ray (the user's ray.shutdown()) while it ran.
RAY_SHUT_DOWN = ("Ray was shut down in the controller (ray.shutdown()) while the group ran: "
                 "its actors ended with it")


@dataclasses.dataclass(frozen=True)
class ChannelServices:
    """What the channels of one opened :class:`~phalanx.backends.ray.backend.RayBackend`
    share: ``ray`` (the module, connected), the ``writer`` thread of every control stream
    and the ``logs`` pump of the ranks' stdout and stderr."""

    ray: Any
    writer: framing.BacklogWriter
    logs: LogPump


@dataclasses.dataclass
class Bundle:
    """One rank's place in the placement group (its bundle), and its actor now."""

    index: int  # the placement-group bundle (a node's bundle holds all its ranks)
    node_id: str = ""
    actor: Any = None
    incarnation: int = 0
    used: bool = False  # its actor has served (or been launched): the next needs a new one


def ray_exit_code(exc: BaseException) -> int | None:
    """The exit code of an actor's worker process when Ray's error gives one (``sys.exit``
    outside a rank's calls: "exits with an exit code 5"); None otherwise."""
    import re

    found = re.search(r"exits? with an exit code (-?\d+)", str(exc))
    return int(found.group(1)) if found else None


def hand_over_pipes(sock: socket.socket) -> tuple[int, int]:
    """For a rank connected over a Unix socket (same machine): make its control pipes, send
    the rank's ends through the socket, close it; the controller's ends (read, write)."""
    to_rank_r, to_rank_w = os.pipe()
    from_rank_r, from_rank_w = os.pipe()
    try:
        socket.send_fds(sock, [b"p"], [to_rank_r, from_rank_w])
    finally:
        os.close(to_rank_r)
        os.close(from_rank_w)
        sock.close()
    return from_rank_r, to_rank_w


# Ray's account of an actor whose process ended (it cannot tell how): where the exit
# status is known, that is the account to give
_RAY_SAW_A_WORKER_DIE = "Ray: the actor is dead because its worker process has died"


class RayChannel(Channel):
    """One rank on Ray: its control stream (once the actor connected), its output tap,
    and what Ray says about its actor."""

    def __init__(self, services: ChannelServices, start: RankStart, bundle: Bundle) -> None:
        self.rank = start.rank
        self.ranks = (start.rank,)
        self.node = start.node
        self.incarnation = bundle.incarnation
        self.actor = bundle.actor
        self.pid: int | None = None  # the rank's process (READY says it; so does serve)
        self.serve_ref: Any = None
        self.ray_worker = True  # the rank runs in its actor's Ray worker (not framework="ray")
        # on the controller's machine, seeing its processes and files: the rank maps put
        # objects from the controller's own blocks (phalanx.backends.ownblocks); never a
        # rank made to stand for another machine (its own PHALANX_BLOCK_DOMAIN)
        self.maps_own_blocks = False
        self.blocks_here = start.env.get(config.ENV_BLOCK_DOMAIN) in (None, blocks_of_here())
        self._services = services
        self._lock = threading.Lock()
        self._conn: framing.Connection | None = None
        self._queued: list[list[Any]] = []
        self._sink: EventSink | None = None
        self._outputs: dict[int, int] = {}  # role -> socket fd, until both are in
        self._decoders: dict[int, Any] = {}  # role -> its OutputUnsealer (across the network)
        self._tap: OutputTap | None = None
        self._exitcode: int | None = None
        self._reason: str | None = None
        self._corrupt: str | None = None  # why this side cut the control stream, if it did
        self._reason_known = threading.Event()
        self._side: SideStream | None = None  # to the rank's warden, once connected
        self._side_ready = threading.Event()
        self._status_known = threading.Event()  # the warden said how the rank ended
        self._how = ""  # how the warden knows it (phalanx.node.warden: "returned", ...)
        self._on_purpose = False  # the backend stops it: Ray's account of that is no news
        # the rank's process, on this machine, watched from here (exits.ExitWatch)
        self._exits: ExitWatch | None = None
        self._news = threading.Event()  # set on each account (and close): a settle looks
        self._closed = False
        # its death, told once (a later account again): the record's sources change under
        # this channel's lock, and so does the burial's state
        self._burial = Burial(self.rank, lambda: self.exit_record(self.rank), self._post,
                              lock=self._lock)

    # -- connections (the acceptor thread) ---------------------------------------------

    def connected(self, role: int, sock: socket.socket,
                  auth: seal.FrameAuth | None = None) -> None:
        """A connection of the rank's actor, its handshake done: its output streams, or
        its control stream; ``auth``: the keys every frame on it is sealed with (across the
        network the output travels sealed too: :class:`~phalanx.backends.ray.actor.
        SealedOutput`; over a Unix socket, of this user's alone, as it was written)."""
        with self._lock:
            if self._closed:
                sock.close()
                return
            if role == handshake.ROLE_SIDE:
                self._side = SideStream(sock, auth if sock.family != socket.AF_UNIX else None,
                                        self._services.writer, self.warden_reports,
                                        f"phalanx-side-{self.rank}")
                self._side_ready.set()
                return
            if role != handshake.ROLE_CONTROL:
                if auth is not None and sock.family != socket.AF_UNIX:
                    from phalanx.backends.ray.sealed import OutputUnsealer

                    self._decoders[role] = OutputUnsealer(auth)
                self._outputs[role] = sock.detach()
                if len(self._outputs) == 2:
                    self._tap = self._services.logs.attach(
                        self.rank, self._outputs[handshake.ROLE_STDOUT],
                        self._outputs[handshake.ROLE_STDERR],
                        (self._decoders.get(handshake.ROLE_STDOUT),
                         self._decoders.get(handshake.ROLE_STDERR)))
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._adopt(streams.SocketStream(sock), auth)

    def connected_pipes(self, read_fd: int, write_fd: int,
                        exits: ExitWatch | None = None) -> None:
        """The control stream of a rank on this machine: a pair of pipes; ``exits``: its
        process watched from here (its exit status as soon as it ended, see
        :meth:`_look_at_exit`)."""
        with self._lock:
            if not self._closed:
                self._exits = exits
                self._adopt(streams.PipeStream(read_fd, write_fd, blocking_reads=False))
                return
        os.close(read_fd)
        os.close(write_fd)
        if exits is not None:
            exits.close()

    def _adopt(self, stream: streams.Stream, auth: seal.FrameAuth | None = None) -> None:
        """Take ``stream`` as the control stream (lock held): flush what was queued.
        ``auth``: the keys of a stream across the network (a pipe or a socketpair of this
        process has none)."""
        conn = framing.Connection(stream, self._services.writer, auth=auth)
        self._conn = conn
        for frame in self._queued:
            conn.send(frame)
        self._queued = []
        if self._sink is not None:
            self._sink.watch(conn.read_fd, self)

    def alive(self) -> bool:
        """Whether the rank is still there (to answer, or to unmap)."""
        return not self._closed and not self._burial.claimed

    def attach(self, sink: EventSink) -> None:
        with self._lock:
            self._sink = sink
            if self._conn is not None and not self._burial.claimed:
                sink.watch(self._conn.read_fd, self)

    # -- events ------------------------------------------------------------------------

    def dying(self, rank: int) -> bool:
        return self._burial.claimed  # EXITED waits for the account of it (_await_cause)

    def receive(self, fd: int) -> list[list[Any]]:
        conn = self._conn
        if conn is None:
            return []
        try:
            frames = conn.reader.recv_frames(block=False)
        except framing.FrameTooLarge as exc:  # bytes that are no frame: this rank's alone
            self._stream_corrupt(f"it sent {exc}")
            return []
        except framing.ConnectionLost:
            return self._stream_ended()
        for segs in frames:
            if len(segs[0]) < _HEAD_SIZE:
                self._stream_corrupt(f"it sent a malformed message header ({len(segs[0])} "
                                     "bytes)")
                return []
        return frames

    def _stream_corrupt(self, why: str) -> None:
        """The rank's control stream carried something that is no message: it cannot go
        on. The rank is buried (its calls fail naming it), with why, and the stream is cut
        so that the rank sees its end."""
        logger.warning("closing the control stream of rank %d: %s", self.rank, why)
        with self._lock:
            self._corrupt = f"its control stream was closed: {why}"
            conn = self._conn
        # buried at once: that is how it ended for the group (its process may live on, so
        # no exit status is coming to wait for)
        self._bury_later(wait_for_reason=False)
        if conn is not None:
            sock = getattr(conn.stream, "sock", None)
            if sock is not None:  # (pipes end with the channel's close)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def ray_reports(self, reason: str | None, served: dict[str, Any] | None = None,
                    exitcode: int | None = None) -> None:
        """How the rank ended (watcher thread): ``served`` is what the actor's ``serve``
        returned (the rank's pid and exit status); ``reason`` Ray's account when the
        actor itself died, with the ``exitcode`` Ray gives (if it does and nothing better
        is known)."""
        with self._lock:
            if self._on_purpose and self._burial.told:
                return  # its actor ended by the backend (ray.kill) after its death was told
            before = self._told_fields()
            if served is not None:
                self.pid = served.get("pid", self.pid)
                self._exitcode = served.get("exitcode")
            elif self._exitcode is None:
                self._exitcode = exitcode
            self._reason = reason
            # a later account replaces the record kept for the (already dead) rank, if it
            # changes it (Ray's "its worker died" after the exit status says nothing new)
            late = (self._burial.told and not self._closed
                    and self._told_fields() != before)
            never_connected = self._conn is None
        self._reason_known.set()
        self._news.set()
        if never_connected:
            self._bury_later(wait_for_reason=False)
        elif late:
            self._burial.tell()

    def warden_reports(self, pid: int, status: int | None, how: str) -> None:
        """How the rank's actor ended, as its warden saw it (side stream's thread): the
        exit status where it is known (``how``: ``returned``, ``note`` -- ``os._exit`` or
        a fatal signal the rank sent itself --, ``kernel`` or ``delivered``)."""
        with self._lock:
            changed = status is not None and self._exitcode != status
            self._how = how
            if status is not None:
                self._exitcode = status
                if self.ray_worker:  # else the actor's pid, not the rank's (its child)
                    self.pid = pid
            late = changed and self._burial.told and not self._closed
        self._status_known.set()
        self._news.set()
        if late:
            self._burial.tell()

    def stopped_on_purpose(self) -> None:
        """The backend stops the rank: the group records its end, so no EXITED is posted."""
        with self._lock:
            self._on_purpose = True
        self._burial.stop()

    def wait_ended(self, deadline: float) -> bool:
        """Wait until ``deadline`` (``time.monotonic()``) at most for the rank to have
        ended on its own: its warden told how (its actor's last note), or Ray (its actor
        is gone), or the channel closed. A rank whose warden never connected, or is gone,
        is waited for until its control stream ends."""
        while True:
            self._news.clear()
            with self._lock:
                if self._closed or self._reason_known.is_set() or \
                        self._status_known.is_set():
                    return True
                side = self._side
                stream_ended = self._burial.claimed
            if (side is None or side.ended) and stream_ended:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # the stream's end and a warden going away wake nothing: looked at again soon
            self._news.wait(min(left, _CAUSE_POLL))

    def _stream_ended(self) -> list[list[Any]]:
        """The control stream ended (the pumping thread): the rank's EXITED at once if its
        process, watched from here, is dying of a signal (the kernel has its status as
        its descriptors close: :mod:`phalanx.backends.ray.exits`) and its last output is
        in -- the record is complete, no account could add to it but Ray's, which
        replaces it when it comes --; else from a helper thread, once the record is
        complete (:meth:`_bury_later`)."""
        tap = self._tap
        if self._exits is None or tap is None or self._look_at_exit() is not None:
            self._bury_later()
            return []
        with self._lock:
            killed = self._exitcode is not None and self._exitcode < 0
        if not killed or not (tap.wait_closed(0) or tap.drained()
                              or tap.wait_closed(config.OUTPUT_PEEK)):
            self._bury_later()
            return []
        if not self._claim():
            return []
        with self._lock:
            self._name_ray_shutdown()
        return [self._burial.exited()]

    def _claim(self) -> bool:
        """The first sign of its death: its control stream is not watched any more."""
        if not self._burial.claim():
            return False
        with self._lock:
            if self._conn is not None and self._sink is not None:
                self._sink.unwatch(self._conn.read_fd, self)
        return True

    def _bury_later(self, wait_for_reason: bool = True) -> None:
        """The first sign of its death buries it: EXITED from a helper thread, once the
        record is complete (``wait_for_reason``: once Ray, and the warden, said how it
        ended) or a moment has passed."""
        if not self._claim():
            return
        self._burial.tell_later(lambda: self._settle(wait_for_reason))

    def _settle(self, wait_for_reason: bool) -> None:
        if wait_for_reason:
            self._await_cause()
        if self._tap is not None:
            self._tap.wait_closed(config.OUTPUT_WAIT)
        with self._lock:
            self._name_ray_shutdown()

    def _name_ray_shutdown(self) -> None:
        """(lock held) Ray's shutdown is why, if this process left Ray before the rank's
        end was told and Ray said nothing: ``ray.shutdown()`` disconnects this process
        before it ends the job's actors (whichever signal they get), and the watcher may
        not have looked yet."""
        if self._reason is None and not self._services.ray.is_initialized():
            self._reason = RAY_SHUT_DOWN

    def _await_cause(self) -> None:
        """Wait until how the rank ended is known, or nothing is left that could tell,
        ``config.RAY_CAUSE_WAIT`` s at most. Not a fixed moment: on a loaded node the
        accounts take seconds, and a death told without them has no exit status. Each
        account wakes the wait; between them it looks every ``_CAUSE_POLL`` s whether the
        warden is still there to give one. A rank whose process this one watches
        (:meth:`_look_at_exit`) is waited for on its pidfd first, for
        ``config.RAY_REASON_WAIT`` s at most, looking for the other accounts every
        ``_EXIT_LOOK`` s: a rank whose stream ended while its actor lives on (its own
        ``sys.exit``) is told by them."""
        start = time.monotonic()
        deadline = start + config.RAY_CAUSE_WAIT
        while True:
            self._news.clear()  # before looking: an account after the look wakes the wait
            now = time.monotonic()
            exits = self._look_at_exit()
            if self._cause_settled(now - start):
                return
            if now >= deadline:
                logger.debug("rank %d: no full account of its end after %.1f s; told as "
                             "known", self.rank, now - start)
                return
            if exits is not None and now - start < config.RAY_REASON_WAIT:
                exits.ended(min(deadline - now, _EXIT_LOOK))
            else:
                self._news.wait(min(deadline - now, _CAUSE_POLL))

    def _look_at_exit(self) -> ExitWatch | None:
        """Take the exit status of the rank's process, watched from here, once it is
        ending or ended (:mod:`phalanx.backends.ray.exits`): the kernel's word, before its
        warden's or Ray's. The watch while the process still runs; None once there is
        none (its end seen, not on this machine, or the channel closed)."""
        exits = self._exits
        if exits is None:
            return None
        status = exits.status()
        if status is None and not exits.ended():
            return exits
        with self._lock:
            if self._exits is not exits:  # closed meanwhile: close() closed it
                return None
            self._exits = None
            if status is not None and self._exitcode is None:
                self._exitcode = status
                self.pid = exits.pid
        exits.close()
        return None

    def _cause_settled(self, waited: float) -> bool:
        """Whether the record of the rank's end is as complete as it will get: its exit
        status is known (from its pidfd, the warden, or a relayed actor's return) and
        either the rank ended on its own (the warden's ``returned``: its actor lives on,
        Ray has nothing to say), or it is a signal's (Ray's account, when it comes, then
        replaces the record: a ``kill -9`` fails the rank's calls without waiting for Ray
        to learn of it, and Ray's memory monitor is named a moment later), or Ray has
        given its account, or has had ``config.RAY_REASON_WAIT`` s to (an exit code Ray
        may explain: its ``ray.kill()`` ends the worker with code 1); or, with no exit
        status, Ray has given its account and the warden cannot (it never connected, it
        is gone, or it reported no status)."""
        with self._lock:
            if self._closed:
                return True
            status = self._exitcode
            side = self._side
            how = self._how
        reason = self._reason_known.is_set()
        if status is not None:
            # "returned": the actor ended its rank and lives on; Ray has nothing to add
            return reason or status < 0 or how == "returned" or \
                waited >= config.RAY_REASON_WAIT
        warden_done = side is None or side.ended or self._status_known.is_set()
        return reason and warden_done

    def _post(self, event: list[Any]) -> None:
        if self._sink is not None:
            self._sink.post(self, [event])

    # -- control -----------------------------------------------------------------------

    def send(self, frame: list[Any]) -> None:
        with self._lock:
            conn = self._conn
            if conn is None:
                if not self._burial.claimed:
                    self._queued.append(frame)
                return
        try:
            conn.send(frame)
        except framing.ConnectionLost:
            pass  # its death arrives as EXITED

    def _side_stream(self, timeout: float) -> SideStream | None:
        """The side stream, waited for up to ``timeout`` s (the rank's actor connects it
        as it starts the rank); None if the rank has none (not started, or gone)."""
        if (not self._side_ready.is_set() and self.serve_ref is not None
                and not self._burial.claimed):
            self._side_ready.wait(timeout)
        return self._side

    def signal(self, rank: int, sig: int) -> None:
        """Through the rank's warden, beside it on its node (any node)."""
        side = self._side_stream(config.RAY_SIGNAL_TIMEOUT)
        answer = None
        if side is not None:
            from phalanx.node import warden

            answer = side.request(warden.SIGNAL, int(sig), config.RAY_SIGNAL_TIMEOUT)
        if answer is None:  # the warden is gone: so is the rank
            logger.debug("signal %s to rank %d not delivered", sig, self.rank)

    def stacks(self, rank: int, timeout: float) -> str:
        """Taken by the rank's warden, on the rank's node."""
        side = self._side_stream(config.RAY_SIGNAL_TIMEOUT)
        if side is None:
            return "(no stack: the rank's actor has not started it)"
        from phalanx.node import warden

        answer = side.request(warden.STACKS, float(timeout),
                              timeout + config.RAY_SIGNAL_TIMEOUT)
        if answer is None:
            return "(no stack: the rank's warden did not answer; its actor may be gone)"
        return str(answer)

    def begin_stop(self, grace: float) -> int | None:
        """Ask the warden to stop the rank's process tree (SIGTERM, ``grace`` s, SIGKILL);
        the request's id for :meth:`end_stop`, None if there is no warden to ask."""
        side = self._side
        if side is None:
            return None
        from phalanx.node import warden

        return side.ask(warden.STOP, float(grace))

    def end_stop(self, request: int | None, deadline: float) -> None:
        """Wait, until ``deadline`` at most, for the stop :meth:`begin_stop` asked for."""
        side = self._side
        if side is not None and request is not None:
            side.answer(request, deadline)

    def _told_fields(self) -> tuple[int | None, int | None, str | None]:
        """What of the record the accounts give: pid, exit status and Ray's reason as
        told (lock held)."""
        return self.pid, self._exitcode, self._told_reason()

    def _told_reason(self) -> str | None:
        reason = self._reason
        if self._exitcode is not None and reason is not None and reason.startswith(
                _RAY_SAW_A_WORKER_DIE):  # the exit status says more than Ray's "it died"
            return None
        return reason

    def exit_record(self, rank: int) -> ProcessFailure:
        reason = self._told_reason()
        if self._corrupt is not None:
            reason = self._corrupt if reason is None else f"{self._corrupt}; {reason}"
        elif reason is None and self._exitcode is None:
            reason = "its control connection closed; Ray had not said why yet"
        tail = self._tap.stderr_tail() if self._tap is not None else ()
        return ProcessFailure(self.rank, self.node, self.pid, self._exitcode, tail, reason)

    def close(self) -> None:
        self._burial.stop()  # before the lock: the burial's lock is this channel's
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            outputs, self._outputs = self._outputs, {}
            side, self._side = self._side, None
            exits, self._exits = self._exits, None
        self._news.set()  # a settle under way ends
        if exits is not None:
            exits.close()
        if side is not None:
            side.close()
        if conn is not None:
            if self._sink is not None:
                self._sink.unwatch(conn.read_fd, self)
            conn.close()
        if self._tap is None:
            for fd in outputs.values():
                os.close(fd)


# Connections still in their handshake (each holds a thread and a descriptor until its peer
# proves the secret or its deadline passes): at most this many in all (fewer under a low
# descriptor limit: a quarter of it) and from one address; one more is taken and an older one
# shut down (an actor whose handshake was cut so tries again, within its connect timeout).
MAX_HANDSHAKES = 128
MAX_HANDSHAKES_PER_PEER = 32
ACCEPT_BACKOFF, ACCEPT_BACKOFF_MAX = 0.05, 1.0  # after accept() failed (EMFILE, ...)
_PEER_GONE = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)  # accept(): the peer was gone
_LOCAL_PEER = "this machine"  # the peer of every Unix-socket connection (this user's alone)
_SOCKET_DIR_BASE_MAX = 80  # characters: a Unix socket's path has at most 107
_DIR_PREFIX = "phalanx-listen-"


def _remove_stale_dirs(base: str) -> None:
    """Remove the private directories of this user's listeners that nobody listens on any
    more (a controller SIGKILLed cannot remove its own): their socket refuses to connect."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        where = os.path.join(base, name)
        try:
            if os.lstat(where).st_uid != os.getuid():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(os.path.join(where, "s"))
        except ConnectionRefusedError:  # a socket file no process listens on
            shutil.rmtree(where, ignore_errors=True)
        except OSError:  # listening (or full), not ours, or half made: leave it
            continue


class Listener:
    """Where the actors of one group connect back: TCP on ``host``, and a Unix socket for
    actors on this machine (it lets the controller hand them pipes, which cost less per
    call than TCP) at a path in a directory of this user's alone (mode 0700, removed by
    :meth:`close`): another local user cannot connect to it, and an actor that cannot reach
    it (another machine, another user, another file system) uses TCP.

    One thread accepts; each connection's handshake (:func:`phalanx.wire.handshake.accept`,
    ``timeout`` s in all) runs on a thread of its own, so a peer that stalls delays no
    other. At most ``limit`` connections are in their handshake at once, ``per_peer`` from
    one address; one more is taken and the oldest of its address, or of the address holding
    the most, is shut down (:mod:`phalanx.wire.admission`), so strangers holding every slot
    cannot lock a rank out (the Unix socket's, this user's own, are never shut down for a
    stranger's). A TCP connection has keepalive and a user timeout
    (:func:`phalanx.wire.streams.keep_alive`): a link cut without a FIN is noticed.
    Whatever goes wrong with one connection (a wrong proof, garbage, a reset, a timeout) ends
    that connection alone, logged once; an accept() that fails (no descriptor left) is logged
    once and retried, backing off, until it works again. ``arrived(hello, sock)`` takes each
    connection whose peer proved the secret (on that connection's thread)."""

    def __init__(self, host: str, secret: bytes,
                 arrived: Callable[[handshake.Hello, socket.socket], None], *,
                 timeout: float = config.HANDSHAKE_TIMEOUT, limit: int | None = None,
                 per_peer: int = MAX_HANDSHAKES_PER_PEER) -> None:
        self.host = host
        self.limit = handshake.connection_cap(MAX_HANDSHAKES) if limit is None else limit
        self.per_peer = min(self.limit, per_peer)
        self._secret = secret
        self._arrived = arrived
        self._timeout = timeout
        self._lock = threading.Lock()
        # the connections in their handshake; the local ones are this user's own
        self._admission = Admission(self.limit, self.per_peer, timeout,
                                    spared=frozenset((_LOCAL_PEER,)))
        self._evicting = False  # an eviction was logged at warning since the last quiet moment
        self._stopping = threading.Event()
        tcp = socket.create_server((host, 0), backlog=128)
        tcp.setblocking(False)
        self.port: int = tcp.getsockname()[1]
        self._sockets = [tcp]
        self.local_path = ""
        self._dir = ""
        self._open_local()
        self._thread = threading.Thread(target=self._accept_loop, name="phalanx-ray-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def in_handshake(self) -> int:
        return len(self._admission)

    def _open_local(self) -> None:
        base = tempfile.gettempdir()
        if len(base) > _SOCKET_DIR_BASE_MAX:
            base = "/tmp"
        _remove_stale_dirs(base)
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._dir = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=base)  # mode 0700
            path = os.path.join(self._dir, "s")
            local.bind(path)
            local.listen(128)
            local.setblocking(False)
        except OSError as exc:  # TCP for everyone
            logger.debug("no Unix socket for the Ray group's local ranks: %s", exc)
            local.close()
            self._remove_dir()
            return
        self._sockets.append(local)
        self.local_path = path

    def _remove_dir(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def close(self) -> None:
        """Stop accepting (bounded: the acceptor wakes within a moment); remove the Unix
        socket's directory. Connections in their handshake end by their deadline."""
        self._stopping.set()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's poll
            except OSError:
                pass
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
        self._remove_dir()

    # -- the acceptor thread -------------------------------------------------------------

    def _accept_loop(self) -> None:
        failing: tuple[float, int] | None = None  # since when accept() fails, how often
        backoff = ACCEPT_BACKOFF
        while not self._stopping.is_set():
            try:
                listeners = {sock.fileno(): sock for sock in self._sockets}
                ready = [listeners[fd] for fd in streams.wait_readable(list(listeners), 0.5)]
            except (OSError, ValueError):  # closed (its number is -1): we are stopping
                if self._stopping.is_set():
                    return
                logger.exception("the Ray group's listener could not wait for connections")
                self._stopping.wait(ACCEPT_BACKOFF_MAX)
                continue
            failure = None
            for listener in ready:
                failure = self._accept_one(listener) or failure
            if failure is None:
                if failing is not None:
                    logger.warning("the Ray group's listener takes connections again (after "
                                   "%d failed attempts over %.1f s)", failing[1],
                                   time.monotonic() - failing[0])
                    failing, backoff = None, ACCEPT_BACKOFF
                continue
            if failing is None:
                logger.warning("the Ray group's listener cannot take a connection: %s; "
                               "retrying", failure)
                failing = (time.monotonic(), 0)
            failing = (failing[0], failing[1] + 1)
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, ACCEPT_BACKOFF_MAX)

    def _accept_one(self, listener: socket.socket) -> str | None:
        """Take one connection and start its handshake's thread; why that failed, if it
        did."""
        try:
            sock, address = listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            if self._stopping.is_set() or exc.errno in _PEER_GONE:
                return None
            return f"accept() failed: {exc.strerror or exc}"
        peer = address[0] if sock.family != socket.AF_UNIX else _LOCAL_PEER
        evicted = self._admission.admit(sock, peer,
                                        share=self.limit if peer == _LOCAL_PEER else None)
        if evicted is not None:
            self._note_eviction(peer, evicted)
        elif len(self._admission) <= 1:
            self._evicting = False  # a quiet moment: the next eviction is a warning again
        try:
            sock.setblocking(True)
            if sock.family != socket.AF_UNIX:
                streams.tune_link(sock)
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True,
                             name="phalanx-ray-handshake").start()
        except (RuntimeError, OSError) as exc:  # "can't start new thread"
            self._admission.release(sock)
            sock.close()
            return f"no thread could start for a connection: {exc}"
        return None

    def _note_eviction(self, peer: str, evicted: str) -> None:
        with self._lock:
            first, self._evicting = not self._evicting, True
        if first:
            logger.warning("the Ray group's listener took a connection from %s: %s (more "
                           "such are logged at debug level)", peer, evicted)
        else:
            logger.debug("took a connection from %s: %s", peer, evicted)

    # -- one connection's thread ---------------------------------------------------------

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            try:
                hello = handshake.accept(sock, self._secret, self._timeout,
                                         peer=f"a rank's Ray actor (from {peer})",
                                         own="this controller")
            finally:
                self._admission.release(sock)
            self._arrived(hello, sock)
        except handshake.HandshakeIncomplete as exc:  # a timeout, a reset, a stranger
            logger.debug("a connection from %s to the Ray group's listener ended: %s",
                         peer, exc)
            sock.close()
        except AuthenticationError as exc:  # a wrong proof, garbage, another version
            logger.warning("refused a connection from %s to the Ray group's listener: %s",
                           peer, exc)
            sock.close()
        except OSError as exc:  # a reset while we wrote
            logger.debug("a connection from %s to the Ray group's listener failed: %s",
                         peer, exc)
            sock.close()
        except Exception:  # one connection's failure is its own
            logger.warning("a connection from %s to the Ray group's listener failed",
                           peer, exc_info=True)
            sock.close()
