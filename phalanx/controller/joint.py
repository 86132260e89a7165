"""``px.rendezvous(*groups)``: one joint world over the ranks of several groups.

Frameworks that move weights from training ranks to generation ranks over a collective
(NeMo-RL, verl, OpenRLHF) each build that process group by hand. phalanx knows every
group's ranks and nodes, so it can hand out the world: the first group's ranks come
first, then the second's, and so on; the rendezvous is a port free now on the first
group's node 0. Each rank's dict is passed to it in a call (so no rank's environment
changes and the groups' own worlds stay as they are), and the rank turns it into the
world's store with :func:`px.joint_store <phalanx.rank.joint.joint_store>`::

    store = px.joint_store(world)
    dist.init_process_group("nccl", store=store, rank=int(world["RANK"]),
                            world_size=int(world["WORLD_SIZE"]))

That store is served by rank 0 on ``MASTER_ADDR`` alone and answers only a rank that proves
``STORE_SECRET``: 32 random bytes made here for this world, which reach the ranks inside
the calls' arguments, over phalanx's authenticated links. The dict's other keys are what
``init_process_group(init_method=f"tcp://{MASTER_ADDR}:{MASTER_PORT}", rank=RANK,
world_size=WORLD_SIZE)`` needs, as before; but that path is torch's ``TCPStore``, which
listens on every interface and answers anyone who connects.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from phalanx.errors import GroupClosed
from phalanx.rank.joint import SECRET_KEY

if TYPE_CHECKING:
    from phalanx.controller.group import WorkerGroup


def rendezvous(*groups: WorkerGroup) -> list[list[dict[str, str]]]:
    """Per group, one dict per rank: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, that
    rank's ``RANK`` in the joint world of all the groups' ranks (the first group's first),
    and ``STORE_SECRET``, this world's own, which :func:`px.joint_store
    <phalanx.rank.joint.joint_store>` proves (pass the dicts to the ranks in calls; anyone
    who reads one can join the world). TypeError / ValueError / GroupClosed naming the
    group that cannot take part."""
    from phalanx.controller.group import WorkerGroup

    if not groups:
        raise TypeError("rendezvous() needs at least one WorkerGroup")
    for i, group in enumerate(groups):
        if not isinstance(group, WorkerGroup):
            raise TypeError(f"rendezvous() takes WorkerGroups; argument {i} is {group!r}")
        if group.closed:
            raise GroupClosed(f"rendezvous(): group {group.name} (argument {i}) was shut "
                              "down")
    if len({id(g) for g in groups}) != len(groups):
        twice = next(g for g in groups if sum(h is g for h in groups) > 1)
        raise ValueError(f"rendezvous(): group {twice.name} is given twice; each takes part "
                         "once")
    address, port = groups[0].free_port()
    world = sum(g.world_size for g in groups)
    secret = secrets.token_hex(32)
    out, first = [], 0
    for group in groups:
        out.append([{"MASTER_ADDR": address, "MASTER_PORT": str(port),
                     "WORLD_SIZE": str(world), "RANK": str(first + rank),
                     SECRET_KEY: secret}
                    for rank in range(group.world_size)])
        first += group.world_size
    return out
