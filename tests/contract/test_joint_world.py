"""``px.rendezvous(*groups)``: one world over two groups' ranks, with a real gloo broadcast
from a trainer group (which keeps its own torch world for itself) to a generator group, on
every backend with the same test code: through ``px.joint_store`` (the store that answers
only the world's members), and through torch's own ``TCPStore`` from the same dict, as code
written before ``px.joint_store`` does."""

from __future__ import annotations

import pytest

import phalanx as px
from phalanx import GroupClosed, WorkerGroup

torch = pytest.importorskip("torch", reason="the joint world is torch's: pip install torch")


class Member:
    """Joins a joint world beside any world of its own, as the README's recipe does."""

    def __init__(self, value: float = 0.0, own_world: bool = False) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if own_world:  # the group's own world (framework="torch" set its rendezvous)
            dist.init_process_group("gloo")
        self.weights = torch.full((1000,), value)

    def join(self, world: dict, how: str = "joint_store") -> tuple[int, int]:
        from datetime import timedelta

        import torch.distributed as dist

        rank, size = int(world["RANK"]), int(world["WORLD_SIZE"])
        if how == "joint_store":
            store = px.joint_store(world, timeout=30)
        else:  # torch's TCPStore: every interface, no secret
            store = dist.TCPStore(world["MASTER_ADDR"], int(world["MASTER_PORT"]), size,
                                  is_master=rank == 0, timeout=timedelta(seconds=30))
        self.joint = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=30))
        self.store = store
        return rank, size

    def broadcast(self) -> float:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0  # the first trainer
        self.joint.broadcast([self.weights], options).wait()
        return float(self.weights.sum())

    def own_world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 0


@pytest.mark.parametrize("how", ["joint_store", "tcpstore"])
def test_two_groups_form_one_world_and_broadcast_weights(backend, how):
    with WorkerGroup(Member, args=(3.0, True), procs_per_node=2, framework="torch",
                     backend=backend, echo_output=False) as trainers, \
            WorkerGroup(Member, procs_per_node=2, backend=backend,
                        echo_output=False) as generators:
        worlds = px.rendezvous(trainers, generators)
        assert [[w["RANK"] for w in ws] for ws in worlds] == [["0", "1"], ["2", "3"]]
        assert {w["WORLD_SIZE"] for ws in worlds for w in ws} == {"4"}
        assert len({(w["MASTER_ADDR"], w["MASTER_PORT"], w["STORE_SECRET"])
                    for ws in worlds for w in ws}) == 1
        joined = [trainers.map_async("join", worlds[0], [how] * 2),
                  generators.map_async("join", worlds[1], [how] * 2)]
        assert [f.result(timeout=60) for f in joined] == [[(0, 4), (1, 4)], [(2, 4), (3, 4)]]
        sent = [trainers.call_async("broadcast"), generators.call_async("broadcast")]
        assert [f.result(timeout=60) for f in sent] == [[3000.0] * 2, [3000.0] * 2]
        assert trainers.call("own_world") == [2, 2]  # the trainers' own world is untouched
        again = px.rendezvous(generators)[0]
        assert again[1]["WORLD_SIZE"] == "2"
        assert again[1]["STORE_SECRET"] != worlds[0][0]["STORE_SECRET"]  # each world its own
    with pytest.raises(GroupClosed):
        px.rendezvous(trainers)


def test_bad_rendezvous_arguments_are_refused():
    with pytest.raises(TypeError, match="at least one WorkerGroup"):
        px.rendezvous()
    with pytest.raises(TypeError, match="argument 0"):
        px.rendezvous("group")
