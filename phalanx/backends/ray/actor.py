"""The node side of the Ray backend: what runs inside each rank's Ray actor.

The actor is generic (it imports no user code) and supervises its rank the way a node
does locally: through a node supervisor of its own (:mod:`phalanx.node.supervisor`), started
with the actor. The controller asks the first actor of each node for free ports on it;
then :meth:`RankActor.serve`:

1. connects three streams back to the controller -- stdout, stderr, control -- each
   proving the group's secret (:mod:`phalanx.wire.handshake`): over TCP, or over a Unix socket
   when the controller runs on the same machine as the same user (a handshake cut short,
   as by a listener full of strangers, is tried again);
2. hands the rank's process its environment over the actor's own (Ray's
   ``CUDA_VISIBLE_DEVICES`` included), its control stream and its stdout/stderr: the rank
   talks to the controller directly, at phalanx's speed, and everything it and its
   subprocesses print reaches the controller's output pump once (Ray's log forwarding
   never sees it). Across the network every frame is sealed with its connection's keys
   (:mod:`phalanx.wire.seal`): the rank seals its control stream itself, and the output
   goes through a pipe to a thread here that seals it (:class:`SealedOutput`);
3. waits for it and returns its exit status, which is how the controller learns that a
   rank died of SIGSEGV or ``os._exit(3)`` -- Ray itself only says that a worker died.

The rank's process is started early, while the controller is still placing the other
actors (:class:`phalanx.node.spawn.PrestartedWorker`), under the supervisor, which is started
first on the same thread: by the time the rank is assigned its imports are done.

Process tree: actor -> supervisor -> keeper -> rank -> whatever the rank starts. The
keeper ends everything the rank left behind when the rank exits; the supervisor ends
everything below it when the actor dies (``ray.kill``, the controller's death, a lost
node: its parent is gone), and a keeper whose supervisor was SIGKILLed ends its rank's
tree itself. :meth:`stop` and :meth:`signal` run beside ``serve`` (a threaded actor) and
reach the rank's whole process tree, as on the local backend.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from phalanx import config
from phalanx.wire import handshake, seal

CONCURRENCY = 4  # serve, plus stop / signal / the relay's calls beside it
_RETRY_DELAY, _RETRY_DELAY_MAX = 0.05, 1.0  # seconds between tries of a cut-short handshake
OUTPUT_CHUNK = 65536  # the most output bytes a sealed frame carries (a pipe's capacity)


def _open(controller: tuple[str, int, str], timeout: float) -> socket.socket:
    """A connection to the controller's listener: its Unix socket (a path in a directory of
    the controller user's alone) when this actor can reach it -- the same machine, the same
    user --, else TCP."""
    address, port, local_path = controller
    if local_path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(local_path)
            return sock
        except OSError:  # another machine, another user (or no such socket)
            sock.close()
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise ConnectionError(
            f"could not connect back to the controller at {address}:{port} ({exc}); a "
            "controller the cluster cannot reach needs RayBackend(transport='ray')"
        ) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _connect(
    controller: tuple[str, int, str], secret: bytes, hello: handshake.Hello
) -> tuple[socket.socket, seal.FrameAuth]:
    """To the controller, with the keys of the frames that follow the handshake. A
    handshake cut short (the listener closed it unheard while full, or it was reset) is
    tried again, backing off, within ``config.CONNECT_TIMEOUT``; a wrong proof is not."""
    deadline = time.monotonic() + config.CONNECT_TIMEOUT
    delay = _RETRY_DELAY
    while True:
        sock = _open(controller, max(0.1, deadline - time.monotonic()))
        try:
            return sock, handshake.connect(sock, secret, hello,
                                           max(0.1, deadline - time.monotonic()))
        except (handshake.HandshakeIncomplete, OSError):
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise
        except BaseException:
            sock.close()
            raise
        time.sleep(delay)
        delay = min(delay * 2, _RETRY_DELAY_MAX)


def _control_stream(sock: socket.socket) -> tuple[int, ...]:
    """The rank's control stream: over a Unix socket the controller hands over a pair of
    pipes instead (read end, write end), which wake a sleeping reader once per message where
    a socket wakes it twice -- the local backend's speed for ranks on the controller's
    machine. Over TCP, the socket itself."""
    if sock.family != socket.AF_UNIX:
        return (sock.fileno(),)
    _, fds, _, _ = socket.recv_fds(sock, 1, 2)
    if len(fds) != 2:
        raise ConnectionError("the controller did not hand over the rank's pipes")
    return tuple(fds)


class SealedOutput:
    """One output stream of a rank across the network: the rank writes to a pipe, and a
    thread here sends what it reads as frames sealed with the connection's keys
    (:mod:`phalanx.wire.seal`), so that nothing else that reaches the controller's socket
    can pass for the rank's output (:class:`OutputUnsealer` checks them there). Ends, with
    the connection, when every writer of the pipe has closed it."""

    def __init__(self, sock: socket.socket, auth: seal.FrameAuth) -> None:
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.settimeout(None)
        self._auth = auth
        self._read_fd, self.write_fd = os.pipe()
        self._thread = threading.Thread(target=self._relay, name="phalanx-output", daemon=True)

    def start(self) -> None:
        """Once the rank holds the write end: this process's copy is closed."""
        os.close(self.write_fd)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _relay(self) -> None:
        from phalanx.wire import framing

        try:
            while data := os.read(self._read_fd, OUTPUT_CHUNK):
                self._sock.sendall(b"".join(framing.seal_frames(framing.frame([data]),
                                                                self._auth)))
        except OSError:  # the controller is gone: nobody reads this output any more
            pass
        finally:
            os.close(self._read_fd)
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


class OutputUnsealer:
    """The controller's side of a :class:`SealedOutput`: fed the bytes received, it returns
    the output in the frames that passed their tags (``b""`` while a frame is incomplete),
    and raises :class:`~phalanx.wire.streams.ConnectionLost` at the first that does not
    (or that is malformed or larger than a :class:`SealedOutput` makes one): the stream
    cannot be trusted from there on."""

    def __init__(self, auth: seal.FrameAuth) -> None:
        from phalanx.wire import framing

        self._data: bytes = b""
        self._pos = 0
        self._auth = auth
        self._reader = framing.FrameReader(self)  # type: ignore[arg-type]  # read_into: all
        self._reader.limit = OUTPUT_CHUNK + 64  # the data, its tag and their lengths
        self._reader.max_segments = 2

    def read_into(self, buf: Any, nbytes: int, block: bool) -> int:
        """The frame reader's stream: what :meth:`__call__` was fed."""
        n = min(nbytes, len(self._data) - self._pos)
        if n <= 0:
            raise BlockingIOError
        buf[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def __call__(self, data: bytes) -> bytes:
        self._data, self._pos = data, 0
        out = []
        while self._pos < len(data):
            before = self._pos
            for segments in self._reader.recv_frames(block=False):
                if not self._auth.check(segments):
                    raise seal.FrameRejected(
                        f"output frame {self._auth.received} failed authentication (forged, "
                        "altered or out of order: something else wrote to the connection)")
                out += segments[:-1]
            if self._pos == before:  # pragma: no cover - a reader that took nothing
                break
        self._data = b""
        return b"".join(out)


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
        import select

        open_ends = {end.fileno(): (i, end) for i, end in enumerate(self._ends)}
        while open_ends:
            ready, _, _ = select.select(list(open_ends), [], [])
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


class RankActor:
    """One rank's place in Ray: placed in its bundle, supervising the rank's process."""

    def __init__(self) -> None:
        from phalanx.node.stacks import StackFile

        self._proc: Any = None  # a phalanx.node.supervisor.SupervisedProcess
        self._stack_file = StackFile()  # the rank dumps its stacks here on request
        self._supervisor: Any = None  # a phalanx.node.supervisor.Supervisor
        self._spare: Any = None  # a phalanx.node.spawn.PrestartedWorker
        self._relay_ready = threading.Event()
        self._relay: Any = None
        # The supervisor, then the rank's interpreter under it, start now, beside the
        # constructor (which returns at once), while the controller is still placing the
        # other actors: by the time this rank is assigned its imports are done.
        self._spare_thread = threading.Thread(target=self._prestart, daemon=True)
        self._spare_thread.start()

    def _prestart(self) -> None:
        from phalanx.node import spawn as node
        from phalanx.node.supervisor import Supervisor

        try:
            self._supervisor = Supervisor()
            self._spare = node.PrestartedWorker(self._supervisor,
                                                {**os.environ, "PYTHONUNBUFFERED": "1"},
                                                stacks_fd=self._stack_file.fd)
        except OSError:  # serve() tries again, and fails with the reason
            self._spare = None

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node now."""
        from phalanx.node.machine import pick_free_ports

        return pick_free_ports(host, count)

    def serve(
        self,
        controller: tuple[str, int, str],
        secret: bytes,
        rank: int,
        incarnation: int,
        env: Mapping[str, str],
        cwd: str | None,
    ) -> dict:
        """Run rank ``rank`` until its process ends; its pid and exit status."""

        def hello(role: int) -> handshake.Hello:
            return handshake.Hello(role, rank, incarnation)

        connected = [_connect(controller, secret, hello(role)) for role in
                     (handshake.ROLE_STDOUT, handshake.ROLE_STDERR, handshake.ROLE_CONTROL)]
        sockets = [sock for sock, _ in connected]
        control = _control_stream(sockets[2])
        if len(control) == 1:  # the socket itself, across the network: the rank seals it
            env = {**env, config.ENV_FRAME_KEYS: connected[2][1].handover()}
        # the rank's stdout and stderr: over a Unix socket the sockets themselves, across
        # the network pipes to threads here that seal what it writes (SealedOutput)
        outputs = [sock.fileno() if sock.family == socket.AF_UNIX else SealedOutput(sock, auth)
                   for sock, auth in connected[:2]]
        try:
            proc = self._start_rank(env, cwd, control,
                                    *(o if isinstance(o, int) else o.write_fd for o in outputs))
        finally:
            for sock in sockets:
                sock.close()  # the rank holds its own copies (a SealedOutput its own)
            if len(control) == 2:
                for fd in control:
                    os.close(fd)
            for output in outputs:
                if isinstance(output, SealedOutput):
                    output.start()  # closes its copy of the pipe's write end
        served = self._supervise(proc)
        for output in outputs:  # its last words reach the controller before its status
            if isinstance(output, SealedOutput):
                output.join(config.CLEANUP_WAIT)
        return served

    def _start_rank(self, env: Mapping[str, str], cwd: str | None, control: tuple[int, ...],
                    out: int, err: int) -> Any:
        """The rank's process: the interpreter started early if it fits, else a new one
        (under the same supervisor)."""
        from phalanx.node import spawn as node
        from phalanx.node.supervisor import Supervisor

        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self._spare_thread.join()
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.alive() and spare.fits(full_env):
            proc = spare.assign(env, cwd, control, out, err)
        else:
            if spare is not None:
                spare.discard()
            if self._supervisor is None:
                self._supervisor = Supervisor()
            spec = "socket:{0}" if len(control) == 1 else "pipe:{0},{1}"
            proc = self._supervisor.spawn(node.worker_argv(), full_env, cwd,
                                          stacks_fd=self._stack_file.fd,
                                          stream=(spec, control), output=(out, err))
        self._proc = proc
        return proc

    def _supervise(self, proc: Any) -> dict:
        """Wait for the rank's process, and for its keeper to end what it left behind;
        its pid and exit status."""
        code = proc.exitcode(None)
        proc.wait_cleaned(config.CLEANUP_WAIT)
        proc.release()
        return {"pid": proc.pid, "exitcode": code}

    # -- relayed through Ray calls (the controller cannot be reached from here) -----------

    def serve_relayed(self, env: Mapping[str, str], cwd: str | None) -> dict:
        """As :meth:`serve`, for a controller this node cannot connect to (a Ray Client
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
        self._relay_ready.wait(config.CONNECT_TIMEOUT)
        self._relay.deliver(seq, data)

    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        """What the rank wrote since the last poll, as ``(stream, bytes)`` (0: control,
        1: stdout, 2: stderr), waiting up to ``timeout`` s for something; ``(-1, b"")``
        once every stream has ended."""
        self._relay_ready.wait(config.CONNECT_TIMEOUT)
        return self._relay.poll(timeout)

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
