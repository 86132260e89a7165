"""Three ``phalanx agent`` daemons on this machine, on loopback addresses, for the cluster
backend's tests: each node has an address of its own (127.0.0.2-4), as pods would, and a
memory domain of its own (``PHALANX_BLOCK_DOMAIN``): a rank of one node never maps another
node's blocks, so kept results cross between them as between machines, through the agents.

They share one token (in a file only this user can read) and are started once per test
run. While a group uses them, the ranks are the agents' descendants; once a test module's
groups are closed, no agent may have any child left (:func:`leftovers`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from tests.helpers import REPO, wait_until

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
START_TIMEOUT = 30.0
running: Agents | None = None  # the session's agents, once started


class Agents:
    """The running agents: their ``hosts`` entries, token and processes."""

    def __init__(self, procs: list[subprocess.Popen], hosts: list[str], token: str,
                 token_file: str) -> None:
        self.procs, self.hosts, self.token, self.token_file = procs, hosts, token, token_file

    def backend(self, **kwargs):
        import phalanx as px

        return px.ClusterBackend(self.hosts, token_file=self.token_file, **kwargs)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_agent(host: str, port: int, token_file: str, *extra: str,
                store: str | None = None, domain: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    if domain is not None:  # the node stands for a machine of its own (see the docstring)
        env["PHALANX_BLOCK_DOMAIN"] = domain
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx", "agent", "--host", host, "--port", str(port),
         "--token-file", token_file, "--no-http", "--heartbeat-timeout", "10",
         *(["--store", store] if store else []), *extra],
        env=env, cwd=REPO, stdin=subprocess.DEVNULL)


def listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start(addresses: tuple[str, ...] = ADDRESSES) -> Agents:
    token = secrets.token_urlsafe(32)
    fd, token_file = tempfile.mkstemp(prefix="phalanx-token-")
    with os.fdopen(fd, "w") as f:
        f.write(token)
    ports = [free_port(host) for host in addresses]
    store = os.path.join(os.path.dirname(token_file), f"phalanx-store-{os.getpid()}")
    procs = [start_agent(host, port, token_file, store=store, domain=f"node-{host}")
             for host, port in zip(addresses, ports, strict=True)]
    hosts = [f"{host}:{port}" for host, port in zip(addresses, ports, strict=True)]
    deadline = time.monotonic() + START_TIMEOUT
    for host, port in zip(addresses, ports, strict=True):
        while not listening(host, port):
            if time.monotonic() > deadline:
                stop(Agents(procs, hosts, token, token_file))
                raise RuntimeError(f"the agent on {host}:{port} did not start")
            time.sleep(0.05)
    global running
    running = Agents(procs, hosts, token, token_file)
    return running


def leftovers(agents: Agents, timeout: float = 5.0) -> list[str]:
    """What the agents still run (sessions of closed groups): described, after ``timeout``."""
    import psutil

    def children() -> list[psutil.Process]:
        found = []
        for proc in agents.procs:
            try:
                found += psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                pass
        return found

    if wait_until(lambda: not children(), timeout, interval=0.05):
        return []
    described = []
    for child in children():
        try:
            described.append(f"pid {child.pid}: {' '.join(child.cmdline())}")
        except psutil.Error:
            pass
    return described


def terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every agent still running (each stops what it runs), wait, SIGKILL laggards."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop(agents: Agents) -> None:
    global running
    running = None
    terminate(agents.procs)
    os.unlink(agents.token_file)
    shutil.rmtree(os.path.join(os.path.dirname(agents.token_file),
                               f"phalanx-store-{os.getpid()}"), ignore_errors=True)
