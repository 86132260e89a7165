"""Shared memory is never left behind (local backend, Linux): not after ``shutdown()``, not
after a rank dies holding a mapping, not after the controller is SIGKILLed with objects
still put, and not under a long run of puts (freed blocks are reused, a few at most kept).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import pytest

from phalanx import config
from tests import helpers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="shared objects need Linux (memfd_create, /proc)")

MIB = 1 << 20


class Reader:
    def total(self, array) -> float:
        return float(array.sum())

    def keep(self, array) -> None:
        self.kept = array  # a view of the object, kept past the call

    def forget(self) -> None:
        self.kept = None

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def backend() -> str:
    return "local"


def _blocks(*pids: int) -> set[str]:
    return set().union(*(helpers.shared_memory_blocks(p) for p in pids))


@pytest.fixture
def mine():
    """The blocks this process holds that the test's groups made (not earlier tests')."""
    before = _blocks(os.getpid())
    return lambda: _blocks(os.getpid()) - before


def test_shutdown_leaves_no_block_held_or_mapped(make_group, mine):
    group = make_group(Reader, procs_per_node=2)
    refs = [group.put(np.ones(MIB)) for _ in range(2)]
    assert group.call("total", refs[0]) == [float(MIB)] * 2
    pids = [group.call_one(r, "pid") for r in range(2)]
    made = mine()
    assert len(made) == 2
    assert all(_blocks(p) <= made and _blocks(p) for p in pids)  # they mapped one
    refs[1].free()
    group.shutdown()
    assert not mine()
    assert helpers.wait_dead(pids)


def test_a_block_is_reused_only_once_no_rank_holds_a_view(make_group, mine):
    group = make_group(Reader, procs_per_node=2)
    first = group.put(np.ones(MIB))
    group.call("keep", first)  # each rank keeps the array past the call
    first.free()
    second = group.put(np.full(MIB, 2.0))
    assert len(mine()) == 2  # the first block is still in use
    assert group.call("total", second) == [2.0 * MIB] * 2
    group.call("forget")  # the views go: the ranks say so (RELEASED)
    second.free()
    group.call("pid")  # a round trip: what the ranks said before it has been read
    third = group.put(np.full(MIB, 3.0))
    assert len(mine()) == 2  # a block was reused, none added
    assert group.call("total", third) == [3.0 * MIB] * 2


def test_a_rank_that_dies_holding_a_mapping_does_not_hold_its_block(make_group, ranks, mine):
    group = make_group(Reader, procs_per_node=2)
    ref = group.put(np.ones(4 * MIB))
    group.call("keep", ref)
    ranks.kill(group, 1)
    group.call("forget", workers=[0])
    ref.free()
    group.call("pid", workers=[0])
    # rank 1 cannot answer any more: its mapping went with it, and the block is reused
    again = group.put(np.ones(4 * MIB))
    assert len(mine()) == 1
    group.restart()
    assert group.call("total", again) == [4.0 * MIB] * 2


def test_a_controller_killed_with_objects_put_leaves_nothing(tmp_path):
    before = helpers.shmem_bytes()
    script = helpers.write_script(tmp_path, """
        import json, time
        import numpy as np
        import phalanx as px
        from tests.faults.test_shared_memory import Reader

        group = px.WorkerGroup(Reader, procs_per_node=2, echo_output=False)
        refs = [group.put(np.ones(8 << 20)) for _ in range(2)]
        group.call("total", refs[0])
        print(json.dumps({"pids": [group.call_one(r, "pid") for r in range(2)]}), flush=True)
        time.sleep(600)
    """)
    with helpers.running_script(script) as controller:
        info = json.loads(controller.stdout.readline())
        names = _blocks(controller.pid)
        assert len(names) == 2 and all(_blocks(p) for p in info["pids"])
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        assert helpers.wait_dead(info["pids"], timeout=10)
    for name in names:
        assert not helpers.shared_memory_holders(name), f"block {name} outlived its controller"
    # 128 MiB were put; the machine's shared memory is back where it was (within noise)
    assert helpers.wait_until(lambda: helpers.shmem_bytes() < before + 32 * MIB, 5.0)


def test_a_hundred_puts_of_64_mib_freed_as_they_go_keep_memory_bounded(make_group, mine):
    group = make_group(Reader, procs_per_node=2)
    before = helpers.shmem_bytes()
    array = np.ones(8 * MIB)  # 64 MiB
    seen: set[str] = set()
    peak = 0
    for _ in range(100):
        ref = group.put(array)
        assert group.call("total", ref) == [8.0 * MIB] * 2
        seen |= mine()
        peak = max(peak, helpers.shmem_bytes() - before)
        ref.free()
    assert len(seen) <= config.SHARE_POOL_BLOCKS, f"{len(seen)} blocks for 100 puts"
    assert peak < (config.SHARE_POOL_BLOCKS + 1) * 66 * MIB, f"grew by {peak / MIB:.0f} MiB"
    assert len(group._shared) == 0
    group.shutdown()
    assert not mine()
    assert helpers.wait_until(lambda: helpers.shmem_bytes() < before + 32 * MIB, 5.0)
