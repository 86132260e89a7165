"""A stranger whose TLS handshake fails costs a real controller nothing: the agent closes
the stranger's descriptor only once its admission has let go of it, so that number cannot
be handed to the controller's connection while the admission would still shut it down (to
make room, or at its deadline) as the stranger's.

The window is a connection's thread between its failed handshake and its release, which a
loaded machine can stretch at will; here the admission's first release waits until the
controller has connected, and the agent takes one connection in its handshake at a time, so
the controller's arrival shuts the stranger's entry down. The agent runs in this process
(its admission is the one under test), on 127.0.0.1 with a self-signed certificate made
with the openssl command. Every wait is bounded.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.agent.daemon import Agent
from phalanx.wire import handshake
from phalanx.wire.admission import Admission

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("making a test certificate needs the openssl command")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=phalanx-test",
                    "-addext", f"subjectAltName=IP:{HOST}"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class SlowFirstRelease(Admission):
    """An admission whose first release waits for ``go`` (a connection's thread kept off
    the CPU between its handshake's end and its release), noting for each release whether
    the descriptor admitted still was that connection's socket then."""

    def __init__(self, limit: int, per_peer: int, timeout: float) -> None:
        super().__init__(limit, per_peer, timeout)
        self.entered, self.go = threading.Event(), threading.Event()
        self.admitted: dict[socket.socket, tuple[int, int]] = {}
        self.intact: list[bool] = []

    def admit(self, sock: socket.socket, peer: str, *, share: int | None = None) -> str | None:
        self.admitted[sock] = (sock.fileno(), os.fstat(sock.fileno()).st_ino)
        return super().admit(sock, peer, share=share)

    def release(self, sock: socket.socket) -> None:
        fd, inode = self.admitted.get(sock, (-1, -1))
        try:
            self.intact.append(os.fstat(fd).st_ino == inode)
        except OSError:  # closed
            self.intact.append(False)
        if not self.entered.is_set():
            self.entered.set()
            self.go.wait(10)
        super().release(sock)


def test_a_failed_tls_handshake_keeps_its_descriptor_until_released(certificate, tmp_path):
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=cert)
    token = secrets.token_bytes(32)
    agent = Agent(HOST, 0, token, tls=server_tls, store=str(tmp_path / "store"),
                  handshake_timeout=10, max_unauthenticated=1)
    admission = SlowFirstRelease(1, 1, 10)
    agent._admission = admission  # one connection in its handshake at a time, as above
    port = agent.address[1]
    serving = threading.Thread(target=agent.serve_forever, daemon=True)
    serving.start()
    joined = None
    stranger = socket.create_connection((HOST, port), timeout=10)
    try:
        stranger.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not TLS: its handshake fails
        assert admission.entered.wait(10), "the stranger's connection was never released"
        # the stranger's thread is between its failed handshake and its release: the
        # controller's connection arrives, and shuts the stranger's entry down to get in
        joined = agenttree.connect_agent(HOST, port, handshake.stretch(token), client_tls, 10,
                                         own="this controller")
        assert joined.welcome["version"]
    finally:
        admission.go.set()
        stranger.close()
        if joined is not None:
            joined.close()
        agent.stop()
        serving.join(10)
    assert admission.intact[0], "the stranger's descriptor was closed before its release"
    assert all(admission.intact), admission.intact
