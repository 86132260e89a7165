"""Every frame after the handshake is authenticated: a relay that forwards the handshake's
bytes and then writes frames of its own, or alters one, gets nothing run and nothing
believed.

A :class:`Relay` (a TCP proxy thread on 127.0.0.1) stands between a controller and a real
``phalanx agent`` of this test's own (127.0.0.7). It counts the handshake's bytes each way,
then forwards, injects a frame whose header's extra fields are a pickle that would create
a marker file, or flips one byte of a marked payload. The agent's log is kept to check that
it says why it closed the connection.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest

import phalanx as px
from phalanx.backends.cluster import messages as agentwire
from phalanx.wire import framing, protocol
from tests import helpers
from tests.agentcluster import free_port, listening, terminate

START_TIMEOUT = 20.0
AGENT_HOST = "127.0.0.7"
PATTERN = b"FLIPME"
# connector -> acceptor: magic, nonce, version field, hello, its proof (HMAC-SHA256)
_VERSION_FIELD = 1 + len(px.__version__.encode())
UP_HANDSHAKE = 8 + 32 + _VERSION_FIELD + 9 + 32
# acceptor -> connector: nonce, ACCEPTED, version field, proof
DOWN_HANDSHAKE = 32 + 1 + _VERSION_FIELD + 32


class Marker:
    """Unpickling it creates ``path``: what the injected header would do if read."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def forged_frame(kind: int, marker: str) -> bytes:
    """A frame whose header's extra fields are a pickle that creates ``marker``, with a
    tag-sized last segment (a guess: the relay holds no key)."""
    head = protocol.pack_head(kind, 1, 0) + pickle.dumps((Marker(marker),))
    return b"".join(bytes(s) for s in framing.frame([head, secrets.token_bytes(16)]))


class Relay:
    """A TCP proxy to ``target`` that forwards the handshake untouched, then does what
    its mode says: ``inject_down`` / ``inject_up`` write ``frame`` toward the agent / the
    controller once the handshake is through; ``flip_down`` / ``flip_up`` (once
    ``armed``) flip one byte of the first :data:`PATTERN` seen that way."""

    def __init__(self, target: tuple[str, int], mode: str = "pass",
                 frame: bytes = b"") -> None:
        self.target, self.mode, self.frame = target, mode, frame
        self.armed = threading.Event()
        self.flipped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            for src, dst, way in ((client, server, "down"), (server, client, "up")):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        handshake = UP_HANDSHAKE if way == "down" else DOWN_HANDSHAKE
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if seen < handshake <= seen + len(data):
                    cut = handshake - seen
                    dst.sendall(data[:cut])
                    if self.mode == f"inject_{way}":
                        dst.sendall(self.frame)
                    data = data[cut:]
                    seen = handshake
                seen += len(data)
                if (self.mode == f"flip_{way}" and self.armed.is_set()
                        and not self.flipped.is_set() and (at := data.find(PATTERN)) >= 0):
                    data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
                    self.flipped.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for sock in self._socks:
            sock.close()


class Echo:
    def echo(self, data: bytes) -> bytes:
        return data

    def pattern(self, size: int) -> bytes:
        return PATTERN * size


@pytest.fixture
def agent(tmp_path):
    """A ``phalanx agent`` on 127.0.0.7: (its address, its token, its log's path)."""
    token = secrets.token_urlsafe(32)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    log = tmp_path / "agent.log"
    port = free_port(AGENT_HOST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(helpers.REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", AGENT_HOST, "--port",
             str(port), "--token-file", str(token_file), "--no-http",
             "--heartbeat-timeout", "10"],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(AGENT_HOST, port),
                                  START_TIMEOUT, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        yield (AGENT_HOST, port), token, log
    finally:
        terminate([proc])


def group_through(relay: Relay, token: str, **kwargs) -> px.WorkerGroup:
    backend = px.ClusterBackend([relay.address], token=token, quorum_timeout=3.0,
                                heartbeat_timeout=5.0)
    return px.WorkerGroup(Echo, procs_per_node=1, backend=backend, echo_output=False,
                          **kwargs)


def test_a_group_through_a_relay_that_alters_nothing_works(agent):
    target, token, _ = agent
    relay = Relay(target)
    try:
        with group_through(relay, token) as group:
            data = secrets.token_bytes(100_000)
            assert group.call("echo", data) == [data]
            assert group.call("pattern", 10) == [PATTERN * 10]
    finally:
        relay.close()


def test_a_frame_injected_toward_the_agent_runs_nothing_there(agent, tmp_path):
    target, token, log = agent
    marker = tmp_path / "agent-ran-it"
    relay = Relay(target, "inject_down", forged_frame(agentwire.LAUNCH, str(marker)))
    start = time.monotonic()
    try:
        # the node is lost as the group reserves it (a ValueError: no agent is left)
        with pytest.raises((px.PhalanxError, ValueError)):
            group_through(relay, token)
    finally:
        relay.close()
    assert time.monotonic() - start < 30
    time.sleep(0.5)  # what the agent would run, had it unpickled the header
    assert not marker.exists(), "the agent unpickled an injected header"
    assert helpers.wait_until(lambda: b"failed authentication" in log.read_bytes(), 5.0,
                              interval=0.05), log.read_text()


def test_a_frame_injected_toward_the_controller_runs_nothing_there(agent, tmp_path):
    target, token, _ = agent
    marker = tmp_path / "controller-ran-it"
    relay = Relay(target, "inject_up", forged_frame(agentwire.WELCOME, str(marker)))
    try:
        with pytest.raises(px.PhalanxError) as info:
            group_through(relay, token)
    finally:
        relay.close()
    assert not marker.exists(), "the controller unpickled an injected header"
    assert "tampered with" in str(info.value), str(info.value)


@pytest.mark.parametrize("way", ["down", "up"])
def test_a_byte_flipped_after_the_handshake_fails_the_call(agent, way):
    """Down: in a call's argument, toward the agent; up: in its result, toward the
    controller. The call fails; it never returns what the relay altered."""
    target, token, _ = agent
    relay = Relay(target, f"flip_{way}")
    try:
        with group_through(relay, token) as group:
            assert group.call("pattern", 2) == [PATTERN * 2]
            relay.armed.set()
            with pytest.raises(px.PhalanxError):
                if way == "down":
                    group.call("echo", PATTERN * 1000, timeout=20)
                else:
                    group.call("pattern", 1000, timeout=20)
            assert relay.flipped.is_set()
    finally:
        relay.close()


def test_a_ray_rank_connected_back_over_tcp_seals_its_control_stream(request, monkeypatch):
    """Ranks on other machines than the controller connect back over TCP (here: the Unix
    socket taken away): the rank's process seals and checks every frame with the keys of
    its actor's handshake, and the controller's side of the stream does too."""
    pytest.importorskip("ray")
    request.getfixturevalue("ray_cluster")
    from phalanx.backends.ray import backend as raybackend
    from phalanx.backends.ray import channel as raychannel

    listen, adopt = raybackend.RayBackend._listen, raychannel.RayChannel._adopt
    keyed = []

    def tcp_only(self, host):
        listen(self, host)
        self._local_name = ""  # as if every rank ran on another machine

    def adopting(self, stream, auth=None):
        keyed.append(auth is not None)
        adopt(self, stream, auth)

    monkeypatch.setattr(raybackend.RayBackend, "_listen", tcp_only)
    monkeypatch.setattr(raychannel.RayChannel, "_adopt", adopting)
    with px.WorkerGroup(Echo, procs_per_node=2, backend="ray", echo_output=False) as group:
        data = secrets.token_bytes(1 << 20)
        assert group.call("echo", data) == [data, data]
    assert keyed == [True, True]
