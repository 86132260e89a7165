"""Shared-memory blocks, the node side's holder of them (with and without a pool), and a
rank's side, in one process (a rank maps a block through /proc/<pid>/fd, here this
process's own)."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx import config
from phalanx.node import shm
from phalanx.rank import faults
from phalanx.rank import shared as shmrank
from phalanx.wire import pickling

pytestmark = pytest.mark.skipif(not shm.supported(),
                                reason="shared objects need Linux (memfd_create, /proc)")


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=20))
def test_layout_places_parts_aligned_in_order_without_overlap(sizes):
    parts = [b"x" * n for n in sizes]
    layout, total = shm.extents_of(parts)
    assert [n for _, n in layout] == sizes
    end = 0
    for offset, length in layout:
        assert offset % 64 == 0 and offset >= end
        end = offset + length
    assert total == max(end, 1)


def _share(value, release=False, writable=False):
    """``value`` written into a block of this process, and a rank's view of where it is."""
    segments = pickling.dumps(value)
    block, layout = shm.Block.holding(segments)
    shares = shmrank.RankShares()
    released = []
    shares.notify = released.append
    shares.add(1, "tok", block.location(layout, release=release, writable=writable))
    return block, shares, released


def test_a_rank_gets_the_object_with_read_only_arrays_and_keeps_it():
    array = np.arange(1000.0)
    block, shares, _ = _share({"a": array, "n": 3})
    try:
        got = shares.resolve(1, "tok")
        assert got["n"] == 3 and np.array_equal(got["a"], array)
        assert not got["a"].flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            got["a"][0] = 1
        assert shares.resolve(1, "tok") is got  # unpickled once
    finally:
        block.close()


def test_a_call_s_own_arguments_are_writable_copies_on_write():
    array = np.zeros(10_000)
    block, shares, _ = _share(array)
    try:
        mine = shares.resolve(1, "tok", private=True)
        mine[0] = 5.0
        other = shares.resolve(1, "tok", private=True)  # another call: a fresh view
        assert other[0] == 0.0 and mine[0] == 5.0
    finally:
        block.close()


def test_a_wrong_token_or_a_closed_block_is_a_clear_error():
    block, shares, _ = _share([1, 2])
    with pytest.raises(shmrank.NotShared, match="not on this rank's node"):
        shares.resolve(1, "other")
    with pytest.raises(shmrank.NotShared, match="not on this rank's node"):
        shares.resolve(2, "tok")
    block.close()
    with pytest.raises(shmrank.NotShared, match="no longer holds it"):
        shares.resolve(1, "tok")


def test_released_is_said_only_once_no_view_is_left():
    block, shares, released = _share(np.ones(1000), release=True)
    try:
        kept = shares.resolve(1, "tok")
        part = kept[10:20]
        del kept
        shares.drop(1)
        assert released == []  # a slice still views the block
        del part
        gc.collect()
        shares.poll()
        assert released == [1]
    finally:
        block.close()


def test_an_object_never_used_is_released_at_once():
    block, shares, released = _share(np.ones(10), release=True)
    shares.drop(1)
    assert released == [1]
    block.close()


def test_torch_tensors_travel_out_of_band_and_rebuild():
    torch = pytest.importorskip("torch", reason="needs torch (pip install 'phalanx[torch]')")
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    segments = pickling.dumps([tensor, torch.zeros(0), torch.ones(2, requires_grad=True)])
    assert len(segments) == 2  # the bf16 tensor's bytes travel beside the pickle
    back = pickling.loads([bytes(segments[0])] + [bytearray(s) for s in segments[1:]])
    assert torch.equal(back[0], tensor) and back[0].dtype == torch.bfloat16
    assert back[1].shape == (0,) and back[2].requires_grad
    block, shares, _ = _share(tensor, writable=True)
    try:
        view = shares.resolve(1, "tok")
        view[0, 0] = 100  # a copy-on-write page: the block keeps its value
        assert shares.resolve(1, "tok", private=True)[0, 0] == 0
    finally:
        block.close()


class _Rank:
    def __init__(self):
        self.alive = True


def test_the_pool_reuses_a_block_once_every_rank_released_it():
    pool = shm.Pool(alive=lambda rank: rank.alive)
    a, b = _Rank(), _Rank()
    first = pool.take(3 << 20)
    pool.give_back(1, first, {a, b})
    assert pool.take(3 << 20) is not first  # still viewed by a and b
    pool.released(1, a)
    pool.released(1, b)
    assert pool.take(3 << 20) is first
    pool.close()


def test_the_pool_does_not_wait_for_ranks_that_died():
    pool = shm.Pool(alive=lambda rank: rank.alive)
    a = _Rank()
    block = pool.take(1 << 20)
    pool.give_back(1, block, {a})
    a.alive = False
    assert pool.take(1 << 20) is block
    pool.close()


def test_the_pool_keeps_few_idle_blocks_and_none_much_larger_than_asked():
    pool = shm.Pool(alive=lambda rank: True)
    blocks = [pool.take(1 << 20) for _ in range(config.SHARE_POOL_BLOCKS + 2)]
    for i, block in enumerate(blocks):
        pool.give_back(i, block, set())
    closed = pool.trim()
    assert len(closed) == 2 and all(b.fd == -1 for b in closed)
    assert pool.take(64 << 20) not in blocks  # a 2 MiB block is too small
    small = pool.take(1)
    assert small in blocks and small.capacity < 64 << 20
    pool.close()


def test_a_holder_without_a_pool_gives_each_object_a_block_of_its_own():
    holder = shm.Holder()
    segments = pickling.dumps(np.arange(100.0))
    try:
        where = holder.hold(1, "tok", segments, writable=True)
        assert holder.where(1) == where and holder.objects() == [(1, "tok", where)]
        _, _, _, _, capacity, release, writable = where
        assert capacity == shm.extents_of(segments)[1] and not release and writable
        shares = shmrank.RankShares()
        shares.add(1, "tok", where)
        assert np.array_equal(shares.resolve(1, "tok"), np.arange(100.0))
        again = holder.hold(1, "tok", pickling.dumps("other"))  # a copy replaces the old
        assert holder.objects() == [(1, "tok", again)] and again[2] != where[2]
        assert holder.drop(1, ["a reader"]) == []  # closed at once, nothing to unmap
        assert holder.where(1) is None and holder.drop(1) == []
    finally:
        holder.close()


def test_a_pooled_holder_reuses_a_block_once_its_readers_released_it():
    readers = {"a": True, "b": True}
    holder = shm.Holder(shm.Pool(alive=lambda reader: readers[reader]))
    try:
        first = holder.hold(1, "t1", [b"x" * 100])
        assert first[5]  # its readers must say RELEASED
        holder.told(1, ["a", "b"])
        assert holder.drop(1, ["a", "b"]) == []
        second = holder.hold(2, "t2", [b"y" * 100])
        assert second[2] != first[2]  # the first block is still viewed
        holder.told(2, ["a"])
        holder.released(1, "a")
        readers["b"] = False  # a reader that died cannot answer: not waited for
        assert holder.drop(2, ["a"]) == []
        holder.released(2, "a")
        third = holder.hold(3, "t3", [b"z" * 100])
        assert third[2] in (first[2], second[2])  # a block came back from the pool
    finally:
        holder.close()


def test_a_calls_arguments_in_a_reused_block_are_the_new_ones_however_the_rank_wrote():
    """A rank keeps its copy-on-write mapping of a pooled block once no view of the
    arguments in it is left, and maps the block's next arguments through it: what it wrote
    is gone, the holder's new bytes are there, pages it never wrote included."""
    holder = shm.Holder(shm.Pool(alive=lambda reader: True))
    shares = shmrank.RankShares()
    released = []
    shares.notify = released.append
    size = 1 << 20
    try:
        names = set()
        mapped = []
        for call in range(1, 5):
            sent = np.full(size // 8, float(call))
            where = holder.hold(call, f"t{call}", pickling.dumps(sent))
            names.add(where[2])
            holder.told(call, ["rank"])
            shares.add(call, f"t{call}", where)
            got = shares.resolve(call, f"t{call}", private=True)
            assert np.array_equal(got, sent) and got.flags.writeable
            mapped.append(shares._private[call][1])
            got[::4096] = -1.0  # this rank's own pages now: one in eight
            assert got[0] == -1.0 and sent[0] == float(call)  # never the holder's
            del got
            shares.drop(call)  # UNSHARE: no view left, RELEASED
            assert released[-1] == call
            assert holder.drop(call, ["rank"]) == []
            holder.released(call, "rank")
        assert len(names) == 1  # one block, reused call after call
        assert all(m is mapped[0] for m in mapped)  # and one mapping of it
    finally:
        holder.close()


def test_a_forked_process_drops_its_own_written_pages_not_by_its_parents_pagemap(tmp_path):
    """The pagemap descriptor is the memory of the process that opened it: a process
    forked after its parent opened one (a rank forked from a process that ran calls) reads
    its own pages, and its writes are dropped."""
    import mmap
    import signal
    import time

    page = mmap.PAGESIZE
    path = tmp_path / "block"
    path.write_bytes(bytes(4 * page))
    with open(path, "rb") as f:
        parents = mmap.mmap(f.fileno(), 4 * page, flags=mmap.MAP_PRIVATE)
        assert shmrank.forget_writes(parents)  # the parent's descriptor is open now
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if its write is gone
            status = 1
            try:
                block = mmap.mmap(f.fileno(), 4 * page, flags=mmap.MAP_PRIVATE)
                block[page] = 7  # this process's own page now
                status = 0 if shmrank.forget_writes(block) and block[page] == 0 else 2
            finally:
                os._exit(status)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked process did not end within 30 s")
        time.sleep(0.01)
    parents.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child's written page stayed its own"


def test_a_pooled_holder_names_the_readers_of_each_block_it_closes():
    holder = shm.Holder(shm.Pool(alive=lambda reader: True))
    unmapped = []
    try:
        for ref_id in range(config.SHARE_POOL_BLOCKS + 1):  # distinct blocks, all pooled
            holder.hold(ref_id, "t", [b"x" * 10])
            holder.told(ref_id, [f"reader {ref_id}"])
        for ref_id in range(config.SHARE_POOL_BLOCKS + 1):
            unmapped += holder.drop(ref_id, [])  # none to wait for: idle at once
        assert len(unmapped) == 1
        name, readers = unmapped[0]
        assert readers == {"reader 0"} and isinstance(name, str)
    finally:
        holder.close()


def test_fault_arguments_are_checked():
    assert faults.argument_for("exit", signal=9, code=3, message=None) == 3
    assert faults.argument_for("raise", signal=9, code=1, message="m") == "m"
    with pytest.raises(ValueError, match="fault kind"):
        faults.argument_for("boom", signal=9, code=1, message=None)
    with pytest.raises(ValueError, match="exit code"):
        faults.argument_for("exit", signal=9, code=-1, message=None)
    with pytest.raises(ValueError, match="signal"):
        faults.argument_for("signal", signal=0, code=1, message=None)


def test_a_put_handle_cannot_be_pickled_outside_its_group_s_calls():
    from phalanx.backends.held import HeldObject
    from phalanx.controller.refs import ObjectRef
    from phalanx.controller.shared import PutRecord

    class Owner:
        def free(self, record):
            pass

    ref = ObjectRef(Owner(), PutRecord(HeldObject(1, "t", None, 10, "list")))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WorkerGroup that put it"):
        pickle.dumps(ref)
    assert "ObjectRef 1: list, 10 B" in repr(ref)


def test_only_a_process_that_sees_this_ones_processes_and_files_maps_its_blocks():
    """What decides whether a Ray rank on this machine maps the controller's blocks: the
    same pid and mount namespaces (``/proc/<pid>/fd/<n>`` names the block there as here)."""
    import shutil
    import subprocess

    from phalanx.backends.ownblocks import maps_blocks_of_here

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert maps_blocks_of_here(child.pid)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert not maps_blocks_of_here(child.pid)  # gone
    unshare = shutil.which("unshare")
    if unshare is None:
        return
    # a process in a mount namespace of its own (where the kernel lets this user make one)
    apart = subprocess.Popen([unshare, "--mount", "--", "sleep", "30"],
                             stderr=subprocess.DEVNULL)
    try:
        if _in_a_namespace_of_its_own(apart, "mnt"):
            assert not maps_blocks_of_here(apart.pid)
    finally:
        apart.kill()
        apart.wait(timeout=10)


def _in_a_namespace_of_its_own(proc, ns: str) -> bool:
    """Whether ``proc`` runs ``sleep`` in a namespace of kind ``ns`` other than this
    process's (within 10 s; False where it could not make one)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if (os.readlink(f"/proc/{proc.pid}/exe").endswith("sleep")
                    and os.readlink(f"/proc/{proc.pid}/ns/{ns}")
                    != os.readlink(f"/proc/self/ns/{ns}")):
                return True
        except OSError:
            pass
        time.sleep(0.01)
    return False
