"""The Ray backend's connect-back listener (``phalanx.backends.ray.channel.Listener``) with
strangers about: anyone who can reach the controller's TCP port, and other users of its
machine.

- silent strangers (6, each holding a connection in its handshake) delay no rank: a group
  starts, and a rank is recreated, while every one of them still waits for its deadline;
- a connection reset after the greeting, or half-way through the handshake, and garbage,
  end that connection alone: the accept thread lives on and ``recreate()`` works;
- connections in their handshake are capped, in all and per peer address; one more is
  closed unheard, and an accept() that fails (EMFILE) is retried, logged once;
- the TCP listener binds the address the cluster knows the driver's Ray node by (127.0.0.2
  in the shared test cluster, whose nodes live on 127.0.0.2-4), not the host's outward one;
- the Unix socket for ranks on this machine is a path in a directory of the owner's alone
  (0700, removed at shutdown): another user (nobody, when the tests run as root) cannot
  connect to it;
- a rank's output across the network travels as frames sealed with its connection's keys
  (``sealed.SealedOutput``, checked by ``sealed.OutputUnsealer`` in the controller's output
  pump): bytes injected into the connection end that stream, and no line of theirs is
  shown or logged.

The listener's own cases need no Ray; those with a group use the shared Ray cluster
(tests/raycluster.py). Every wait is bounded.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import select
import socket
import stat
import struct
import threading
import time

import pytest

import phalanx as px
from phalanx import config
from phalanx.backends.ray.channel import Listener
from phalanx.backends.ray.sealed import OutputUnsealer, SealedOutput
from phalanx.output.logs import LogPump, OutputOptions, log_path
from phalanx.wire import framing, handshake, seal
from tests import helpers
from tests.workers import Probe

SECRET = b"s" * 32
STRANGERS = 6
NOBODY = 65534


def greet(sock: socket.socket, stage: str, secret: bytes = SECRET, rank: int = 0,
          incarnation: int = 1) -> None:
    """Go through the handshake as a rank would, as far as ``stage``: ``greeting`` (part of
    the magic and nonce sent), ``nonces`` (the listener's nonce read), ``proofs`` (who it is
    and half of its proof sent: the reset comes as the listener waits for the rest)."""
    opening = handshake.MAGIC + os.urandom(32)
    if stage == "greeting":
        sock.sendall(opening[:len(handshake.MAGIC) + 5])
        return
    sock.sendall(opening)
    theirs = _recv_exactly(sock, 32)
    if stage == "nonces":
        return
    version = px.__version__.encode()
    hello = bytes([len(version)]) + version + struct.pack("<BII", handshake.ROLE_CONTROL,
                                                          rank, incarnation)
    proof = hmac.new(secret, b"connector|" + opening + theirs + hello, hashlib.sha256)
    sock.sendall(hello + proof.digest()[:16])


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other side ends ``sock`` within ``within`` seconds (EOF or a reset)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(4096):
                return True
        except OSError:
            return True
    return False


class Arrivals:
    """The listener's ``arrived``: records each authenticated hello, closes the socket."""

    def __init__(self) -> None:
        self.hellos: list[handshake.Hello] = []
        self.cond = threading.Condition()

    def __call__(self, hello: handshake.Hello, sock: socket.socket) -> None:
        sock.close()
        with self.cond:
            self.hellos.append(hello)
            self.cond.notify_all()

    def wait(self, count: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.hellos) >= count, timeout)


@pytest.fixture
def arrivals():
    return Arrivals()


@pytest.fixture
def listener(arrivals):
    made: list[Listener] = []

    def make(**kwargs) -> Listener:
        made.append(Listener("127.0.0.1", SECRET, arrivals, **kwargs))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.fixture
def held():
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def connect_rank(where: tuple | str, rank: int = 0, timeout: float = 5.0) -> float:
    """A real actor's handshake; how long it took."""
    started = time.monotonic()
    if isinstance(where, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(where)
    else:
        sock = socket.create_connection(where, timeout=timeout)
    with sock:
        handshake.connect(sock, SECRET, handshake.Hello(handshake.ROLE_CONTROL, rank, 1),
                          timeout)
    return time.monotonic() - started


def silent(address: tuple, count: int, held: list, source: str | None = None) -> None:
    for _ in range(count):
        held.append(socket.create_connection(
            address, timeout=5, source_address=(source, 0) if source else None))


# -- the listener alone ------------------------------------------------------------------


def test_silent_strangers_delay_no_rank(listener, arrivals, held):
    ours = listener(timeout=30.0)
    silent(("127.0.0.1", ours.port), STRANGERS, held)
    assert _wait(lambda: ours.in_handshake == STRANGERS, 5)
    took = [connect_rank(("127.0.0.1", ours.port), rank) for rank in range(3)]
    took.append(connect_rank(ours.local_path, 3))
    assert arrivals.wait(4, 5)
    assert max(took) < 1.0, took
    assert ours.in_handshake == STRANGERS  # all of them still waiting for their deadline


def test_a_silent_stranger_is_dropped_at_its_deadline(listener, held):
    ours = listener(timeout=0.5)
    silent(("127.0.0.1", ours.port), 1, held)
    started = time.monotonic()
    assert closed_by_peer(held[0], 5)
    assert time.monotonic() - started < 3
    assert _wait(lambda: ours.in_handshake == 0, 2)


@pytest.mark.parametrize("how", ["greeting-then-reset", "nonces-then-reset",
                                 "proofs-then-reset", "garbage", "eof"])
def test_one_connection_failing_ends_it_alone(listener, arrivals, how, caplog):
    ours = listener()
    with caplog.at_level(logging.DEBUG, logger="phalanx.backends.ray.channel"):
        for _ in range(3):  # more than once: the accept thread lived through the first
            sock = socket.create_connection(("127.0.0.1", ours.port), timeout=5)
            if how == "garbage":
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert closed_by_peer(sock, 5)
                sock.close()
                continue
            if how == "eof":
                sock.close()
                continue
            greet(sock, {"greeting-then-reset": "greeting", "nonces-then-reset": "nonces",
                         "proofs-then-reset": "proofs"}[how])
            reset(sock)
        assert _wait(lambda: ours.in_handshake == 0, 5)
        assert connect_rank(("127.0.0.1", ours.port)) < 1.0
        assert arrivals.wait(1, 5)
    assert ours._thread.is_alive()
    failures = [r for r in caplog.records if "listener" in r.getMessage()
                and r.levelno >= logging.DEBUG and "closed" not in r.getMessage()]
    assert len(failures) <= 3, [r.getMessage() for r in failures]  # once each, at most


def test_handshakes_are_capped_in_all_and_per_peer_the_oldest_making_room(listener, held):
    ours = listener(timeout=30.0, limit=4, per_peer=2)
    address = ("127.0.0.1", ours.port)
    silent(address, 2, held, source="127.0.0.1")
    assert _wait(lambda: ours.in_handshake == 2, 5)
    silent(address, 1, held, source="127.0.0.1")  # a third from the same address: its
    assert closed_by_peer(held[0], 5)  # oldest makes room
    silent(address, 2, held, source="127.0.0.9")  # another address gets in
    assert _wait(lambda: ours.in_handshake == 4, 5)
    silent(address, 1, held, source="127.0.0.10")  # past the cap in all: the oldest of
    assert closed_by_peer(held[1], 5)  # the address holding the most makes room
    assert ours.in_handshake == 4
    assert connect_rank(address) < 1.0  # a rank is never locked out


def _retrying(address: tuple, rank: int) -> float:
    """A rank's connect-back as an actor makes it: a handshake cut short is tried again
    (as ``phalanx.backends.ray.actor`` does); how long it took in all."""
    started = time.monotonic()
    for _ in range(20):
        try:
            connect_rank(address, rank)
            break
        except (OSError, handshake.HandshakeIncomplete):
            time.sleep(0.01)
    return time.monotonic() - started


def test_strangers_holding_every_slot_lock_no_rank_out(listener, arrivals, held):
    """Strangers from four addresses fill every slot and re-open what is shut: twelve
    ranks connecting back at once all get through within a second or two."""
    ours = listener(timeout=30.0, limit=16, per_peer=4)
    address = ("127.0.0.1", ours.port)
    stop = threading.Event()

    def hold(source: str) -> None:
        mine: list[socket.socket] = []
        try:
            while not stop.is_set():
                while len(mine) < 8 and not stop.is_set():
                    try:
                        mine.append(socket.create_connection(address, timeout=2,
                                                             source_address=(source, 0)))
                    except OSError:
                        break
                ready, _, _ = select.select(mine, [], [], 0.02)
                for sock in ready:
                    mine.remove(sock)
                    sock.close()
        finally:
            for sock in mine:
                sock.close()

    threads = [threading.Thread(target=hold, args=(f"127.0.3.{i}",), daemon=True)
               for i in range(1, 5)]
    for thread in threads:
        thread.start()
    try:
        assert _wait(lambda: ours.in_handshake == 16, 5)
        took: list[float] = []
        ranks = [threading.Thread(target=lambda r=r: took.append(_retrying(address, r)))
                 for r in range(12)]
        for rank in ranks:
            rank.start()
        for rank in ranks:
            rank.join(30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert len(took) == 12 and max(took) < 2.0, took
    assert arrivals.wait(12, 5)


class _FailingAccept:
    """A listening socket whose accept() fails with EMFILE a few times first."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock = sock
        self.failures = failures

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_failing_accept_is_retried_and_logged_once(listener, arrivals, caplog):
    ours = listener()
    failing = _FailingAccept(ours._sockets[0], failures=5)
    ours._sockets[0] = failing
    time.sleep(0.7)  # the acceptor's current wait (0.5 s at most) ends: it waits on ours next
    with caplog.at_level(logging.WARNING, logger="phalanx.backends.ray.channel"):
        assert connect_rank(("127.0.0.1", ours.port), timeout=10) < 8
        assert arrivals.wait(1, 5)
        # the acceptor says so once its accept returned, which the handshake's thread
        # (what arrivals sees) may beat on a loaded machine
        assert helpers.wait_until(lambda: any("takes connections again" in r.getMessage()
                                              for r in caplog.records), 5)
    assert failing.failures == 0 and ours._thread.is_alive()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot take a connection" in m for m in messages) == 1, messages
    assert sum("takes connections again" in m for m in messages) == 1, messages
    ours._sockets[0] = failing._sock


def test_the_local_socket_is_in_a_directory_of_ours_alone(listener):
    ours = listener()
    directory = os.path.dirname(ours.local_path)
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert stat.S_ISSOCK(os.stat(ours.local_path).st_mode)
    assert not ours.local_path.startswith("\0")  # not the abstract namespace
    ours.close()
    assert not os.path.exists(directory)


def test_a_killed_controllers_directory_is_removed_by_the_next_listener(listener):
    live = listener()
    base = os.path.dirname(os.path.dirname(live.local_path))
    stale = os.path.join(base, "phalanx-listen-stale-test")
    os.mkdir(stale, 0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(os.path.join(stale, "s"))  # bound, then closed: what a SIGKILL leaves
    listener()
    assert not os.path.exists(stale)
    assert os.path.exists(live.local_path)  # a listener still serving keeps its own


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root; the "
                    "directory's mode is checked by the test above")
def test_another_user_cannot_connect_to_the_local_socket(listener):
    ours = listener()
    pid = os.fork()  # a child that becomes nobody and tries (no interpreter to start)
    if pid == 0:
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(ours.local_path)
            code = 0
        except PermissionError:
            code = 13
        except BaseException:
            code = 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child trying the socket as another user did not end")
    assert os.waitstatus_to_exitcode(done[1]) == 13  # EACCES: connected would be 0
    assert connect_rank(ours.local_path) < 1.0  # while we still can


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


class _FakeRay:
    """What ``session.driver_address`` asks of Ray: the driver's node, the node table, and
    Ray's guess at this host's address (here its outward one, which must not win)."""

    def __init__(self, nodes: list[dict]) -> None:
        self._nodes = nodes
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: "10.1.2.3")})

    def get_runtime_context(self):
        return type("ctx", (), {"get_node_id": staticmethod(lambda: "driver")})()

    def nodes(self) -> list[dict]:
        return self._nodes


def test_the_listener_binds_the_drivers_ray_node_address():
    from phalanx.backends.ray import session

    table = [{"NodeID": "other", "NodeManagerAddress": "127.0.0.3"},
             {"NodeID": "driver", "NodeManagerAddress": "127.0.0.1"}]
    assert session.driver_address(_FakeRay(table)) == "127.0.0.1"
    assert session.driver_address(_FakeRay(table[:1])) == "10.1.2.3"  # not in the table


# -- a rank's output across the network ------------------------------------------------------


def keys() -> tuple[seal.FrameAuth, seal.FrameAuth]:
    """The two ends' frame keys of one handshake: the actor's, the controller's."""
    transcript = os.urandom(64)
    return (seal.derive(SECRET, transcript, connector=True),
            seal.derive(SECRET, transcript, connector=False))


def sealed(data: bytes, auth: seal.FrameAuth) -> bytes:
    return b"".join(framing.seal_frames(framing.frame([data]), auth))


def test_sealed_output_round_trips_in_any_pieces():
    actor, controller = keys()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        output = SealedOutput(ours, actor)
        rank_end = os.dup(output.write_fd)  # what the rank would hold
        output.start()
        ours.close()  # the actor's own copy (the relay holds its own)
        written = b"hello\n" + b"x" * 200_000 + b"\nbye\n"
        with os.fdopen(rank_end, "wb") as rank:
            for i in range(0, len(written), 5000):
                rank.write(written[i:i + 5000])
                rank.flush()
        received = b""
        theirs.settimeout(5)
        while chunk := theirs.recv(65536):
            received += chunk
        output.join(5)
    assert written not in received  # not as it was written
    unseal = OutputUnsealer(controller)
    got = b"".join(unseal(received[i:i + 777]) for i in range(0, len(received), 777))
    assert got == written


@pytest.mark.parametrize("injected", ["raw text", "a forged frame", "a replayed frame"])
def test_bytes_injected_into_sealed_output_end_it(injected):
    actor, controller = keys()
    first = sealed(b"rank says hi\n", actor)
    bad = {"raw text": b"spoofed line\n",
           "a forged frame": sealed(b"spoofed line\n", seal.derive(b"x" * 32, b"t", True)),
           "a replayed frame": first}[injected]
    unseal = OutputUnsealer(controller)
    assert unseal(first) == b"rank says hi\n"
    with pytest.raises(Exception) as info:
        unseal(bad)
    assert "spoofed" not in str(info.value)


def test_the_output_pump_shows_no_injected_line(tmp_path, caplog):
    actor, controller = keys()
    pump = LogPump(OutputOptions(echo=False, log_dir=tmp_path))
    out_r, out_w = socket.socketpair()
    err_r, err_w = socket.socketpair()
    try:
        tap = pump.attach(0, out_r.detach(), err_r.detach(),
                          (OutputUnsealer(controller), None))
        out_w.sendall(sealed(b"the rank's own line\n", actor))
        time.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="phalanx.output.logs"):
            out_w.sendall(b"[rank 0] spoofed line\n" + sealed(b"after\n", actor))
            out_w.close()
            err_w.close()
            assert tap.wait_closed(5)
    finally:
        pump.stop(5)
    shown = log_path(tmp_path, 0, "stdout").read_bytes()
    assert shown == b"the rank's own line\n"
    assert any("stdout ends here" in r.getMessage() for r in caplog.records)


# -- with a group on the shared Ray cluster -------------------------------------------------


class Crowded(px.RayBackend):
    """A Ray backend whose listener strangers connect to (and stay silent) as soon as it
    listens, before any rank connects; ``tcp_only``: the ranks use TCP too (on the test
    cluster every node is on this machine, so they would all take the Unix socket). A group
    makes its own copy of the backend it is given: this one is ``group._backend``."""

    strangers = 0
    tcp_only = False

    def _listen(self, host: str) -> None:
        super()._listen(host)
        if self.tcp_only:
            self._local_name = ""
        self.held: list[socket.socket] = []
        silent((self._host, self._port), self.strangers, self.held)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for sock in getattr(self, "held", ()):
                sock.close()


def crowded(strangers: int = 0, tcp_only: bool = False) -> Crowded:
    return type("Crowded", (Crowded,), {"strangers": strangers, "tcp_only": tcp_only})()


@pytest.fixture
def on_ray(ray_cluster, monkeypatch):
    pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")
    # strangers that outlast the group's start and a recreate: none of them may delay it
    monkeypatch.setattr(config, "HANDSHAKE_TIMEOUT", 60.0)
    return ray_cluster


@pytest.mark.parametrize("tcp_only", [False, True], ids=["local", "tcp"])
def test_silent_strangers_delay_neither_start_nor_recreate(on_ray, tcp_only):
    import ray

    started = time.monotonic()
    with px.WorkerGroup(Probe, procs_per_node=2, backend=crowded(STRANGERS, tcp_only),
                        echo_output=False, start_timeout=50) as group:
        backend = group._backend
        start_took = time.monotonic() - started
        old = group.call_one(1, "pid")
        started = time.monotonic()
        group.recreate(1, timeout=50)
        recreate_took = time.monotonic() - started
        assert group.call_one(1, "pid") != old
        # every stranger is still in its handshake: the ranks got past them all
        assert backend._listener.in_handshake == STRANGERS
        # and the address bound is the driver's Ray node's, as the cluster knows it
        node_id = ray.get_runtime_context().get_node_id()
        ours = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        assert backend._host == ours == "127.0.0.2"
        assert backend._listener._sockets[0].getsockname()[:2] == (ours, backend._port)
    print(f"\n{STRANGERS} silent strangers: start {start_took:.2f} s, "
          f"recreate {recreate_took:.2f} s")


@pytest.mark.parametrize("how", ["greeting-then-reset", "proofs-then-reset"])
def test_a_reset_handshake_leaves_recreate_working(on_ray, how):
    with px.WorkerGroup(Probe, procs_per_node=2, backend=crowded(tcp_only=True),
                        echo_output=False, start_timeout=50) as group:
        backend = group._backend
        for _ in range(2):
            sock = socket.create_connection((backend._host, backend._port), timeout=5)
            greet(sock, how.removesuffix("-then-reset"), secret=backend._secret, rank=1,
                  incarnation=99)
            reset(sock)
        assert _wait(lambda: backend._listener.in_handshake == 0, 5)
        assert backend._listener._thread.is_alive()
        old = group.call_one(1, "pid")
        group.recreate(1, timeout=50)
        assert group.call_one(1, "pid") != old
        assert group.call("pid")[0] == group.call_one(0, "pid")


def test_output_across_the_network_arrives_sealed_and_whole(on_ray, tmp_path):
    with px.WorkerGroup(Probe, procs_per_node=2, backend=crowded(tcp_only=True),
                        echo_output=False, log_dir=tmp_path, start_timeout=50) as group:
        channels = list(group._backend._channels.values())
        assert all(len(c._decoders) == 2 for c in channels)  # both streams: sealed
        group.call("say", "on stdout")
        group.call("say", "on stderr", True)
        group.call("say_long_lines", 100_000, 3)
    for rank in range(2):
        out = log_path(tmp_path, rank, "stdout").read_text()
        err = log_path(tmp_path, rank, "stderr").read_text()
        assert out.splitlines() == ["on stdout"] + [str(rank) * 100_000] * 3
        assert "on stderr" in err.splitlines()
