"""The node side of the Ray backend: what runs inside each rank's Ray actor.

The actor is generic (it imports no user code). The controller first asks it where it
landed (:meth:`RankActor.describe`) and for free ports on its node; then
:meth:`RankActor.serve` turns the actor into a phalanx rank for the rest of its life:

1. it connects three TCP streams back to the controller -- stdout, stderr, control -- each
   proving the group's secret (:mod:`phalanx.handshake`);
2. file descriptors 1 and 2 become the output streams, so everything the rank and its
   subprocesses print reaches the controller's output pump once, prefixed with the rank
   (Ray's own log forwarding then has nothing of it to repeat);
3. it sets the rank's environment (and cwd) and runs the ordinary worker loop
   (:func:`phalanx.worker.run`) over the control stream: INIT imports user code only then.

Calls therefore travel over phalanx's own channel at phalanx's speed; Ray places the
process, keeps it alive and reports how it died.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

from phalanx import handshake, streams, wire

CONNECT_TIMEOUT = 30.0  # seconds for the actor to reach the controller and prove the secret


def _connect(address: str, port: int, secret: bytes, hello: handshake.Hello) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    handshake.connect(sock, secret, hello, CONNECT_TIMEOUT)
    return sock


class RankActor:
    """One rank's process, placed by Ray in its placement-group bundle."""

    def describe(self) -> dict:
        """Where this actor runs: node address and id, pid, the GPUs Ray gave it."""
        import ray

        context = ray.get_runtime_context()
        try:
            gpus = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        except AttributeError:  # older Ray
            gpus = [str(g) for g in ray.get_gpu_ids()]
        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "gpus": gpus,
        }

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node now."""
        from phalanx.placement import pick_free_ports

        return pick_free_ports(host, count)

    def serve(
        self,
        address: str,
        port: int,
        secret: bytes,
        rank: int,
        incarnation: int,
        env: Mapping[str, str],
        cwd: str | None,
    ) -> int:
        """Be rank ``rank`` until SHUTDOWN, the controller's loss, or ``sys.exit``."""
        from phalanx import worker

        def hello(role: int) -> handshake.Hello:
            return handshake.Hello(role, rank, incarnation)

        out = _connect(address, port, secret, hello(handshake.ROLE_STDOUT))
        err = _connect(address, port, secret, hello(handshake.ROLE_STDERR))
        control = _connect(address, port, secret, hello(handshake.ROLE_CONTROL))
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        out.close()
        err.close()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                pass
        os.environ.update(env)
        if cwd:
            os.chdir(cwd)
        stream = streams.SocketStream(control)
        worker._watch_for_hangup(stream)  # the controller gone: this rank goes too
        conn = wire.Connection(stream, wire.BacklogWriter("phalanx-worker-writer"))
        runtime = worker.WorkerRuntime(conn)
        runtime.report_exit = True
        code = worker.run(conn, runtime)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.close()
        return code
