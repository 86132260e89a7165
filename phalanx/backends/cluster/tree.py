"""Agents in a tree: how a controller reaches many nodes through a few connections.

With ``tree_threshold`` nodes or more (:class:`~phalanx.backends.cluster.backend.ClusterBackend`),
the controller does not connect to every agent. It splits the list of agents into at most
``fanout`` contiguous chunks (:func:`split`); the first agent of a chunk that answers is
the chunk's *head*, and the controller asks it to ADOPT the rest of its chunk, which it
splits and adopts the same way. Every agent thus holds at most ``fanout`` children, the
controller at most ``fanout`` connections, and each subtree is a contiguous run of the
list: the group's nodes (and ranks) in order. An agent that does not answer is passed
over (the next one of its chunk becomes the head) and reported missing.

Each node of a tree has an id (from 1, given by the controller): a request names the node
it is for in its header's rank field (:mod:`phalanx.backends.cluster.messages`), and an agent
hands it down to the child whose subtree holds that id. 0 means the agent the connection reaches.

:func:`connect_agent` (a connection, the token proved both ways, the agent's WELCOME; every
frame after the handshake sealed with its keys, :mod:`phalanx.wire.seal`) and
:func:`form` (the chunks' heads, each having adopted its chunk) serve the controller and
the agents alike.
"""

from __future__ import annotations

import dataclasses
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.errors import AuthenticationError, printable
from phalanx.wire import framing, handshake, protocol, seal, streams

Entry = tuple[int, str, int]  # (tree id, host, port)


def split(entries: Sequence[Any], fanout: int) -> list[list[Any]]:
    """``entries`` in at most ``fanout`` contiguous chunks whose sizes differ by one at
    most (the longer ones first)."""
    count = min(fanout, len(entries))
    if count <= 0:
        return []
    size, extra = divmod(len(entries), count)
    chunks, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(entries[start:end]))
        start = end
    return chunks


@dataclasses.dataclass
class Joined:
    """An agent connected and authenticated, its WELCOME read."""

    host: str
    port: int
    sock: socket.socket
    stream: streams.Stream
    reader: framing.VerifyingReader  # holds whatever arrived after the WELCOME
    welcome: dict[str, Any]
    auth: seal.FrameAuth  # the handshake's frame keys (and how many frames each way)

    def connection(self, writer: framing.BacklogWriter) -> framing.Connection:
        return framing.Connection(self.stream, writer, reader=self.reader, auth=self.auth)

    def close(self) -> None:
        self.sock.close()


def connect_agent(host: str, port: int, secret: bytes, tls: ssl.SSLContext | None,
                  timeout: float, own: str = "this agent") -> Joined:
    """Connect to the agent at ``host:port``, prove the token both ways, read its WELCOME;
    ``own`` names this side in errors (the controller, or an agent above it in a tree).

    OSError when it cannot be reached or does not finish the handshake (a frozen or
    restarting agent) or turns this side away (it serves its most sessions already: its
    FAULT says so), AuthenticationError when it does not prove the token or has a
    certificate this side does not trust, and its VersionMismatch when it runs another
    phalanx version.
    """
    timeout = max(0.1, timeout)
    sock = socket.create_connection((host, port), timeout=timeout)
    streams.tune_link(sock)  # no Nagle delay; a vanished peer is noticed on an idle link too
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise AuthenticationError(f"the agent at {host}:{port} has a certificate this "
                                      f"controller does not trust: {exc}") from None
        except (OSError, ssl.SSLError):
            sock.close()
            raise
    try:
        try:
            auth = handshake.connect(sock, secret,
                                     handshake.Hello(handshake.ROLE_CONTROL, 0, 0), timeout,
                                     peer=f"the agent at {host}:{port}", own=own)
        except handshake.HandshakeIncomplete as exc:
            raise OSError(f"the agent at {host}:{port}: {exc}") from None
        sock.settimeout(timeout)
        stream = streams.socket_stream(sock)
        if isinstance(stream, streams.TLSStream):
            stream.timeout = timeout
        reader = framing.VerifyingReader(framing.FrameReader(stream), auth,
                                         f" to the agent at {host}:{port}")
        reader.limit = 1 << 20
        frames: list[list[Any]] = []
        while not frames:
            frames = reader.recv_frames(block=True)
        kind, _, _, extra = protocol.parse(frames[0][0])
        if kind == agentwire.FAULT:  # it proved the token but serves no more (its cap)
            raise OSError(f"the agent at {host}:{port} turned {own} away: "
                          f"{printable(extra[0])}")
        if kind != agentwire.WELCOME:
            raise OSError(f"the agent at {host}:{port} did not introduce itself")
        if isinstance(stream, streams.TLSStream):
            stream.timeout = None
        sock.settimeout(None)
        reader.limit = None
        return Joined(host, port, sock, stream, reader, extra[0], auth)
    except seal.FrameRejected as exc:
        sock.close()
        raise OSError(f"the connection to the agent at {host}:{port} was tampered with: "
                      f"{exc}") from None
    except framing.FrameTooLarge as exc:
        sock.close()
        raise OSError(f"the agent at {host}:{port} sent {exc}") from None
    except framing.ConnectionLost:
        sock.close()
        raise OSError(f"the agent at {host}:{port} closed the connection") from None
    except BaseException:
        sock.close()
        raise


def adopt(joined: Joined, own_id: int, rest: Sequence[Entry], fanout: int,
          timeout: float) -> dict[str, Any]:
    """Ask the agent ``joined`` reaches to be node ``own_id`` and adopt ``rest`` (its
    chunk's other agents); its answer: ``{"nodes": [(id, welcome)], "missing": [(id,
    "host:port", why)]}`` for the subtree below it. OSError if it does not answer in time."""
    return _ask(joined, timeout, "adopting its part of the tree", agentwire.ADOPT, own_id,
                [list(e) for e in rest], fanout, timeout)


def attach(joined: Joined, own_id: int, name: str, force: bool,
           timeout: float) -> dict[str, Any]:
    """Take over the top agent ``joined`` reaches of detached group ``name``'s tree (its
    connection moves to the group's waiting session there) and learn the subtree below it,
    which it formed when the group started: the answer :func:`adopt` gives. OSError when it
    cannot, or was not node ``own_id`` of that tree (other hosts, order or fan-out)."""
    answer = _ask(joined, timeout, f"attaching to detached group {name}", agentwire.ATTACH,
                  name, [], force)
    if answer.get("tree_id") != own_id:
        raise OSError(f"the agent at {joined.host}:{joined.port} is node "
                      f"{answer.get('tree_id')} of detached group {name}'s tree, not node "
                      f"{own_id}: attach with the hosts (in the same order) and fanout the "
                      "group was started with")
    return answer


def _ask(joined: Joined, timeout: float, doing: str, kind: int,
         *fields: Any) -> dict[str, Any]:
    """Request 1 of a connection not yet a link, and its answer (OSError if it fails)."""
    joined.sock.settimeout(max(0.1, timeout) + 5.0)
    try:
        joined.sock.sendall(b"".join(framing.seal_frames(agentwire.request(
            kind, 1, *fields), joined.auth)))
        while True:
            for segs in joined.reader.recv_frames(block=True):
                kind, request_id, _, extra = protocol.parse(segs[0])
                if kind == agentwire.REPLY and request_id == 1:
                    ok, value = extra
                    if not ok:
                        raise OSError(f"the agent at {joined.host}:{joined.port} failed "
                                      f"{doing}: {printable(value)}")
                    answer: dict[str, Any] = value  # what its Branch.adopt returned
                    return answer
                if kind == agentwire.FAULT:
                    raise OSError(f"the agent at {joined.host}:{joined.port}: "
                                  f"{printable(extra[0])}")
    except seal.FrameRejected as exc:
        raise OSError(f"the connection to the agent at {joined.host}:{joined.port} was "
                      f"tampered with: {exc}") from None
    except framing.FrameTooLarge as exc:
        raise OSError(f"the agent at {joined.host}:{joined.port} sent {exc} while "
                      f"{doing}") from None
    except framing.ConnectionLost:
        raise OSError(f"the agent at {joined.host}:{joined.port} closed the connection "
                      f"while {doing}") from None
    finally:
        joined.sock.settimeout(None)


@dataclasses.dataclass
class Head:
    """A chunk's head, connected: its entry, connection, and the ids of its subtree."""

    entry: Entry
    joined: Joined
    ids: list[int]  # its own first, then its subtree's, in order


@dataclasses.dataclass
class Formation:
    heads: list[Head]
    nodes: dict[int, tuple[str, dict[str, Any]]]  # id -> ("host:port", welcome)
    missing: dict[int, tuple[str, str]]  # id -> ("host:port", why)
    refused: list[AuthenticationError]

    def close(self) -> None:
        for head in self.heads:
            head.joined.close()


def form(entries: Sequence[Entry], fanout: int, connect: Callable[[str, int, float], Joined],
         deadline: float, attaching: tuple[str, bool] | None = None,
         top: int | None = None) -> Formation:
    """Connect to one head per chunk of ``entries`` (in parallel) and have it adopt the
    rest of its chunk; who answered and who did not. Each attempt ends by ``deadline``
    (a ``time.monotonic()`` value). ``attaching`` (a detached group's name, and whether
    to force): the tree is that group's, formed already -- each chunk's first agent is
    attached to (:func:`attach`), and a chunk whose first agent does not answer is
    missing whole (its subtree went with it). ``top``: how many chunks here (default
    ``fanout``: the controller's own share is smaller), each head adopting with
    ``fanout``."""
    result = Formation([], {}, {}, [])
    lock = threading.Lock()

    def chunk_head(chunk: list[Entry]) -> None:
        for i, entry in enumerate(chunk):
            tree_id, host, port = entry
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise OSError("no time was left to reach it")
                joined = connect(host, port, min(config.CONNECT_TIMEOUT, remaining))
            except AuthenticationError as exc:
                with lock:
                    result.refused.append(exc)
                    result.missing[tree_id] = (f"{host}:{port}", str(exc))
                continue
            except OSError as exc:
                with lock:
                    for other_id, other_host, other_port in (
                            chunk[i:] if attaching is not None else [entry]):
                        result.missing[other_id] = (f"{other_host}:{other_port}", str(exc))
                if attaching is not None:
                    return
                continue
            rest = chunk[i + 1:]
            try:
                left = max(0.1, deadline - time.monotonic())
                answer = (adopt(joined, tree_id, rest, fanout, left) if attaching is None
                          else attach(joined, tree_id, *attaching, left))
            except OSError as exc:
                joined.close()
                with lock:
                    for other_id, other_host, other_port in chunk[i:]:
                        result.missing[other_id] = (f"{other_host}:{other_port}", str(exc))
                return
            with lock:
                result.nodes[tree_id] = (f"{host}:{port}", joined.welcome)
                ids = [tree_id]
                where = {e[0]: f"{e[1]}:{e[2]}" for e in rest}
                for node_id, welcome in answer["nodes"]:
                    result.nodes[node_id] = (where.get(node_id, "?"), welcome)
                    ids.append(node_id)
                for node_id, name, why in answer["missing"]:  # the agent's words
                    result.missing[node_id] = (printable(name), printable(why))
                result.heads.append(Head(entry, joined, ids))
            return

    threads = [threading.Thread(target=chunk_head, args=(chunk,), daemon=True,
                                name="phalanx-tree-form")
               for chunk in split(entries, top or fanout)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.heads.sort(key=lambda head: head.entry[0])
    return result
