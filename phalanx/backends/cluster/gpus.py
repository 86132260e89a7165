"""GPUs held on agents' nodes, as the controller asks for them (DEVICES requests).

Each agent keeps the book of its node's GPUs for every controller it serves
(:mod:`phalanx.backends.cluster.agent.devices`). A group that asks ``gpus_per_worker``, or a
pool that reserves GPUs, takes its ranks' devices from the book of each of its nodes before
any rank starts, under a holder name that says which controller holds them; a node whose
GPUs another holder has refuses, and the group or pool fails at once with
:class:`~phalanx.errors.DevicesTaken` naming the node, the holders and what is free. Asking
for none gives them back; an agent whose controller goes away frees what it held -- but
for a detached group's: its sessions hold its GPUs on while it waits, and the controller
that attaches takes them over instead of holding any (``ClusterBackend._attached_gpus``:
each node's session says which it holds, the ids the group's ranks run on).

A pool holds its GPUs with a key of its own (:class:`PoolHold`), and each group placed on
it shares that hold from its own connection to the node (:func:`share`): the GPUs stay held
while the pool or one of those groups does. A detached pool's groups keep their nodes past
the controller, and so, through their sessions on the agents, the GPUs they run on.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from collections.abc import Sequence

from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.link import AgentNode
from phalanx.errors import DevicesTaken, PhalanxError

GIVE_BACK_TIMEOUT = 5.0  # seconds an agent has to answer that a holder's GPUs are free


def holder_name(holder: str) -> str:
    """``holder`` (a pool or group of this controller) as the agents' books name it: with
    the controller's host and pid, so two controllers' "pool-1" are two holders."""
    return f"{holder} of the controller on {socket.gethostname()} (pid {os.getpid()})"


@dataclasses.dataclass(frozen=True)
class PoolHold:
    """A pool's GPUs on its nodes: the holder name the agents' books give them, and the
    key a session shows to share them (this controller's secret)."""

    name: str
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def new(cls, holder: str) -> PoolHold:
        return cls(holder_name(holder), secrets.token_bytes(32))


def hold(agents: Sequence[AgentNode], counts: Sequence[int], holder: str,
         sharing: PoolHold | None = None) -> list[tuple[str, ...]]:
    """``counts[n]`` GPUs of ``agents[n]``'s node for ``holder`` -> each node's ids
    (``sharing``: a pool's, under its name, which the sessions of its groups may share).
    DevicesTaken naming the node when one refuses; what the others took is given back."""
    taken: list[AgentNode] = []
    out: list[tuple[str, ...]] = []
    payload = [] if sharing is None else [agentwire.DEVICES_SHARED, sharing.key]
    try:
        for agent, count in zip(agents, counts, strict=True):
            answer = agent.request(agentwire.DEVICES, count, holder, payload=payload)
            if "refused" in answer:
                raise DevicesTaken(f"{agent.where}: {answer['refused']}")
            taken.append(agent)
            out.append(tuple(answer["gpus"]))
    except BaseException:
        give_back(taken, holder)
        raise
    return out


def share(agents: Sequence[AgentNode], pool: PoolHold) -> tuple[str, list[AgentNode]]:
    """The GPUs ``pool`` holds on each of ``agents``' nodes are held by this connection
    too (a group placed on the pool), until it gives them back or ends -> (the holder's
    name, the agents), what :func:`give_back` takes. DevicesTaken naming the node when one
    refuses (the pool was closed); the shares taken are given back."""
    joined: list[AgentNode] = []
    try:
        for agent in agents:
            answer = agent.request(agentwire.DEVICES, 0, pool.name,
                                   payload=[agentwire.DEVICES_SHARE, pool.key])
            if "refused" in answer:
                raise DevicesTaken(f"{agent.where}: {answer['refused']}")
            joined.append(agent)
    except BaseException:
        give_back(joined, pool.name)
        raise
    return pool.name, list(agents)


def give_back(agents: Sequence[AgentNode], holder: str) -> None:
    """Tell each agent that ``holder``'s GPUs are free (an agent lost, or slow to answer,
    frees them itself once the connection ends)."""
    for agent in agents:
        if agent.lost_reason is not None:
            continue
        try:
            agent.request(agentwire.DEVICES, 0, holder, timeout=GIVE_BACK_TIMEOUT)
        except PhalanxError:
            pass
