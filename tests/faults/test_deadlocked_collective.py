"""A deadlocked collective across two real torch ranks: rank 0 waits in ``all_reduce`` for a
rank 1 that never joins. phalanx must say where: the straggler warning, ``stacks()`` and
the ``CallTimeout`` all name the line of user code that waits."""

from __future__ import annotations

import logging
import os

import pytest

from tests import helpers


class Collective:
    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")

    def reduce_on(self, ranks: list[int]) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.ones(1)
        if int(os.environ["RANK"]) in ranks:
            dist.all_reduce(tensor)  # waits for every rank: a deadlock if one stays out
        return float(tensor.item())


@pytest.mark.timeout(90)
def test_a_collective_one_rank_never_joins_is_located_by_stacks_and_timeouts(caplog):
    helpers.requires("torch")
    import phalanx as px

    caplog.set_level(logging.WARNING, logger="phalanx")
    with px.WorkerGroup(Collective, procs_per_node=2, framework="torch", echo_output=False,
                        straggler_warning=1.0) as group:
        assert group.call("reduce_on", [0, 1], timeout=60) == [2.0, 2.0]
        future = group.call_async("reduce_on", [0])
        with pytest.raises(px.CallTimeout) as info:
            future.result(timeout=3)
        assert info.value.pending_ranks == [0]
        assert "in reduce_on" in info.value.stacks[0]
        assert f'File "{__file__}"' in str(info.value)  # where rank 0 waits

        stacks = group.stacks(ranks=[0])
        assert "in reduce_on" in stacks[0] and "all_reduce" in stacks[0]

        assert helpers.wait_until(
            lambda: any("still waiting for ranks [0]" in r.getMessage()
                        for r in caplog.records), 10), "no straggler warning for rank 0"
        warning = next(r.getMessage() for r in caplog.records
                       if "still waiting for ranks [0]" in r.getMessage())
        assert f'File "{__file__}"' in warning and "in reduce_on" in warning
        assert sum("still waiting" in r.getMessage() for r in caplog.records) == 1
