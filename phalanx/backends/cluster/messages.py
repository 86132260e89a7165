"""The messages between a controller and a node agent, besides the ranks' own.

One authenticated connection per node (:mod:`phalanx.wire.handshake`) carries, as
:mod:`phalanx.wire.framing` frames with :mod:`phalanx.wire.protocol` headers:

- the ranks' messages, unchanged: INIT, CALL (once per node with ``rank = MANY`` when the
  same payload goes to several of its ranks), SHUTDOWN one way; READY, RESULT, ERROR,
  HEARTBEAT... and EXITED the other;
- the node's own, below, whose ``call_id`` is a request id the reply carries back::

    controller -> agent  LAUNCH    (starts, sys_path, options, cwd)  payload (target, ...)
                         STOP      (ranks, grace, force)
                         SIGNAL    (rank, signal)                    no reply
                         STACKS    (rank, timeout)
                         PORTS     (count,)
                         WAIT      (ranks, timeout)
                         PING                                        no reply
                         SYNC      (version, listing)                which files it lacks
                         BLOBS     (hashes,)                         payload: their contents
                         TREE      (version, listing)                the code's path there
                         ADOPT     (id, entries, fanout, timeout)    be tree node id; adopt
                                                                     these agents (see
                                                                     phalanx.backends.cluster.tree)
                         HOLD      (id, token, writable)             payload: a put object's
                                                                     pickle and buffers, to
                                                                     hold for the node's ranks
                                                                     (phalanx.backends.cluster.agent.share)
                         DROP      (id,)                             it was freed; no reply
    agent -> controller  WELCOME   (node facts: host, gpus, machine, pid, version)
                         REPLY     (ok, value)                       to a request id
                         OUTPUT    (stream,)                         payload: bytes, rank
                         OUTPUT_END (stream,)                        the rank's stream ended
                         FAULT     (reason,)                         why it drops the
                                                                     connection (last)
                         LOST      (ids, reason)                     nodes of its subtree
                                                                     it lost (a tree)
                         RESULTS   (counts,), rank = MANY            a call's results of
                                                                     several ranks, in rank
                                                                     order: payload, each
                                                                     rank's segments in turn
                         PING                                        no reply

A node's own message names, in the header's rank field, the tree node it is for (0: the
agent the connection reaches): an agent of a tree hands it to the child whose subtree
holds that node, and the answer comes back up unchanged.

An EXITED from an agent carries the rank's launch (its incarnation) as ``call_id``, so a
death reported late is never taken for that of the rank started after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phalanx.wire import framing, protocol

LAUNCH = 64
STOP = 65
SIGNAL = 66
STACKS = 67
PORTS = 68
WAIT = 69
PING = 70
SYNC = 71
BLOBS = 72
TREE = 73
ADOPT = 74
HOLD = 75
DROP = 76
WELCOME = 80
REPLY = 81
OUTPUT = 82
OUTPUT_END = 83
FAULT = 84
LOST = 85
RESULTS = 86

STDOUT, STDERR = 1, 2


def request(kind: int, request_id: int, *fields: Any, payload: Sequence[Any] = (),
            node: int = 0) -> list[Any]:
    """A request to the agent (or a message with plain fields, ``request_id`` 0); ``node``:
    the tree node it is for (0: the agent the connection reaches)."""
    return framing.frame([protocol.header(kind, request_id, node, *fields), *payload])


def reply(request_id: int, ok: bool, value: Any) -> list[Any]:
    """The agent's answer to request ``request_id``: a value, or (not ok) an error text."""
    return framing.frame([protocol.header(REPLY, request_id, 0, ok, value)])


def output(rank: int, stream: int, data: bytes) -> list[Any]:
    return framing.frame([protocol.header(OUTPUT, 0, rank, stream), data])


def output_end(rank: int, stream: int) -> list[Any]:
    return framing.frame([protocol.header(OUTPUT_END, 0, rank, stream)])


def ping() -> list[Any]:
    return framing.frame([protocol.header(PING, 0, 0)])


def exited(rank: int, incarnation: int, failure: dict[str, Any]) -> list[Any]:
    """The agent's report that a rank's process ended (an EXITED naming its launch)."""
    return framing.frame([protocol.header(protocol.EXITED, incarnation, rank, failure)])


def lost(ids: Sequence[int], reason: str) -> list[Any]:
    """An agent's report that the nodes ``ids`` of its subtree are unreachable."""
    return framing.frame([protocol.header(LOST, 0, 0, list(ids), reason)])


def is_node_message(kind: int) -> bool:
    """Whether a message kind is the node's own (not a rank's)."""
    return kind >= LAUNCH
