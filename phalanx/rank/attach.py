"""How a rank process gets its control stream: the forms of ``PHALANX_FD``.

``pipe:R,W`` (the local backend's pair of pipes), ``socket:FD`` (a connected socket), or
``handoff:FD``: a process started ahead of its rank (:class:`phalanx.node.spawn.
PrestartedWorker`) waits on that Unix socket for the rank's assignment -- its environment,
working directory, and the connected control, stdout and stderr streams.
"""

from __future__ import annotations

import os
import struct
import sys

from phalanx import config
from phalanx.wire import streams

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket


def open_stream(spec: str) -> streams.Stream:
    """``pipe:R,W`` (local backend), ``socket:FD`` (a connected socket), or ``handoff:FD``
    (started ahead of time: wait on that Unix socket for the rank's assignment)."""
    kind, _, fds = spec.partition(":")
    numbers = [int(fd) for fd in fds.split(",")]
    for fd in numbers:
        os.set_inheritable(fd, False)  # not for the user's subprocesses
    if kind == "pipe":
        return streams.PipeStream(numbers[0], numbers[1], blocking_reads=True)
    import socket  # not for the pipes of a local rank: several ms of its start

    if kind == "socket":
        return streams.SocketStream(socket.socket(fileno=numbers[0]))
    if kind == "handoff":
        return _take_assignment(socket.socket(fileno=numbers[0]))
    raise ValueError(f"{config.ENV_FD}={spec!r}: expected pipe:R,W, socket:FD or handoff:FD")


def _take_assignment(sock: socket.socket) -> streams.Stream:
    """Become a rank: receive its environment, cwd and connected sockets (control, stdout,
    stderr) from the node side that started this process early (see
    :class:`phalanx.node.spawn.PrestartedWorker`). Its end closing first means: not needed,
    exit."""
    import json  # only a process started ahead of its rank reads an assignment
    import socket

    head, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    if not head:
        os._exit(0)
    size = struct.unpack_from("<I", head)[0]
    data = bytearray(head[4:])
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            os._exit(0)
        data += more
    sock.close()
    assignment = json.loads(data)
    count = assignment["control"]  # 1: a socket; 2: pipes (read end, write end)
    control, (out, err) = fds[:count], fds[count:]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.environ.update(assignment["env"])
    if assignment.get("cwd"):
        os.chdir(assignment["cwd"])
    for fd in control:
        os.set_inheritable(fd, False)
    if count == 2:
        return streams.PipeStream(control[0], control[1], blocking_reads=True)
    return streams.SocketStream(socket.socket(fileno=control[0]))
