"""The rank's side of the collective watch (:mod:`phalanx.rank.collectives`): once armed,
``torch.distributed``'s blocking collectives say which one this rank is inside, and which
one each process group completed last.

Arming patches ``torch.distributed`` for the whole process, so every scenario runs in a
fresh interpreter (a real gloo world on a file store, the loopback interface) and prints
what it saw as one JSON line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from tests import helpers

pytestmark = helpers.needs("torch")

TIMEOUT = 120  # seconds a scenario may take: importing torch and a gloo world, with room

PRELUDE = """
import json, sys, threading, time
from datetime import timedelta

from phalanx.rank import collectives

STORE = sys.argv[1]


def world(rank=0, size=1):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(STORE, size), rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))


def marked(fn):
    return bool(getattr(fn, collectives._MARK, False))
"""


def _env() -> dict[str, str]:
    env = helpers.script_env()
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over loopback only
    return env


def _command(script: str, store: Path) -> list[str]:
    return [sys.executable, "-c", PRELUDE + textwrap.dedent(script), str(store)]


def run(script: str, tmp_path: Path) -> dict[str, Any]:
    """Run a scenario in a fresh interpreter; the JSON it printed last."""
    done = subprocess.run(_command(script, tmp_path / "store"), cwd=helpers.REPO, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    [out] = helpers.json_lines(done.stdout)
    return out


def test_armed_before_the_import_the_collectives_are_tracked_once_it_happens(tmp_path):
    out = run("""
        collectives.arm()
        assert "torch.distributed" not in sys.modules
        import torch
        import torch.distributed as dist

        out = {"wrapped": [op for op in collectives.TRACKED
                           for module in (dist, dist.distributed_c10d)
                           if hasattr(module, op) and not marked(getattr(module, op))],
               "marked": [marked(dist.all_reduce), marked(dist.distributed_c10d.all_reduce)],
               "hook_left": any(isinstance(h, collectives._Hook) for h in sys.meta_path)}
        world()
        out["before"] = [collectives.changed(), collectives.report()]
        x = torch.ones(4, 2)
        dist.all_reduce(x)
        out["changed"] = collectives.changed()
        out["first"] = collectives.report()
        out["changed_after_report"] = collectives.changed()
        dist.all_reduce(x)
        out["second"] = collectives.report()
        out["sum"] = x.tolist()
        dist.destroy_process_group()
        print(json.dumps(out))
    """, tmp_path)
    assert out["wrapped"] == []  # every tracked collective there is, in both modules
    assert out["marked"] == [True, True]
    assert out["hook_left"] is False  # the import hook is gone once it did its work
    assert out["before"] == [False, [[], []]]  # starting a world is no collective
    assert out["changed"] is True and out["changed_after_report"] is False
    inside, last = out["first"]
    assert inside == []
    [[group, seq, op, entered, left]] = last
    assert (group, seq, op) == ("0", 1, "all_reduce")
    assert entered <= left
    assert abs(time.time() - entered) < TIMEOUT  # the wall clock: hosts are compared
    inside, [[group, seq, op, _, _]] = out["second"]
    assert (inside, group, seq, op) == ([], "0", 2, "all_reduce")
    assert out["sum"] == [[1.0, 1.0]] * 4  # the collective still did its work


def test_armed_after_the_import_it_wraps_at_once_and_only_once(tmp_path):
    out = run("""
        import torch
        import torch.distributed as dist

        out = {"before_arm": marked(dist.all_reduce)}
        collectives.arm()
        out["after_arm"] = [marked(dist.all_reduce), marked(dist.distributed_c10d.barrier)]
        collectives.arm()  # again, and install again: nothing is wrapped twice
        collectives.install(dist)
        world()
        dist.all_reduce(torch.ones(2))
        dist.barrier()
        out["report"] = collectives.report()
        dist.destroy_process_group()
        print(json.dumps(out))
    """, tmp_path)
    assert out["before_arm"] is False
    assert out["after_arm"] == [True, True]
    assert [done[:3] for done in out["report"][1]] == [["0", 2, "barrier"]]


def test_an_asynchronous_collective_is_not_tracked_and_still_works(tmp_path):
    out = run("""
        collectives.arm()
        import torch
        import torch.distributed as dist

        world()
        x = torch.full((3,), 2.0)
        dist.all_reduce(x)
        collectives.report()
        work = dist.all_reduce(x, async_op=True)
        work.wait(timeout=timedelta(seconds=30))
        out = {"changed": collectives.changed(), "report": collectives.report(),
               "sum": x.tolist()}
        dist.destroy_process_group()
        print(json.dumps(out))
    """, tmp_path)
    assert out["changed"] is False
    assert [done[:3] for done in out["report"][1]] == [["0", 1, "all_reduce"]]
    assert out["sum"] == [2.0, 2.0, 2.0]


def test_a_collective_run_inside_another_is_counted_once_with_the_outer(tmp_path):
    out = run("""
        collectives.arm()
        import torch.distributed as dist

        world()
        gathered = [None]
        dist.all_gather_object(gathered, {"a": 1})  # all_gather, and more, inside it
        listed = [{"b": 2}]
        dist.broadcast_object_list(listed, src=0)
        out = {"report": collectives.report(), "seq": collectives._seq}
        dist.destroy_process_group()
        print(json.dumps(out))
    """, tmp_path)
    assert out["seq"] == {"0": 2}
    assert [done[:3] for done in out["report"][1]] == [["0", 2, "broadcast_object_list"]]
    assert out["report"][0] == []


def test_a_subgroup_is_counted_apart_from_the_default_group(tmp_path):
    out = run("""
        collectives.arm()
        import torch
        import torch.distributed as dist

        world()
        sub = dist.new_group([0])
        x = torch.ones(2)
        dist.all_reduce(x)
        dist.all_reduce(x, group=sub)
        dist.broadcast(x, 0, group=sub)
        dist.all_reduce(x)
        out = {"report": collectives.report(), "names": [dist.group.WORLD.group_name,
                                                         sub.group_name]}
        dist.destroy_process_group()
        print(json.dumps(out))
    """, tmp_path)
    world_name, sub_name = out["names"]
    assert world_name != sub_name
    inside, last = out["report"]
    assert inside == []
    assert sorted(done[:3] for done in last) == sorted(
        [[world_name, 2, "all_reduce"], [sub_name, 2, "broadcast"]])


RANK0 = """
    collectives.arm()
    import torch
    import torch.distributed as dist

    world(0, 2)
    seen = {}  # seq -> [inside, last] as first seen
    stop = threading.Event()

    def watch():  # the heartbeat's view while the main thread waits for rank 1
        while not stop.is_set():
            inside, last = collectives.report()
            for entry in inside:
                seen.setdefault(entry[1], [entry, last])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.time()
    dist.barrier()
    dist.all_reduce(torch.zeros(4, 2, dtype=torch.float32))
    dist.all_gather([torch.zeros(3, dtype=torch.int64) for _ in range(2)],
                    torch.zeros(3, dtype=torch.int64))
    stop.set()
    watcher.join(30)
    print(json.dumps({"seen": [seen[seq] for seq in sorted(seen)], "began": began,
                      "after": collectives.report()}))
    dist.destroy_process_group()
"""

RANK1 = """
    import torch
    import torch.distributed as dist

    world(1, 2)
    # rank 0 waits in each collective meanwhile (its watcher looks every 0.02 s)
    time.sleep(1.5)
    dist.barrier()
    time.sleep(1.5)
    dist.all_reduce(torch.zeros(4, 2, dtype=torch.float32))
    time.sleep(1.5)
    dist.all_gather([torch.zeros(3, dtype=torch.int64) for _ in range(2)],
                    torch.zeros(3, dtype=torch.int64))
    dist.destroy_process_group()
"""


def test_a_rank_waiting_in_a_collective_reports_it_inside_with_its_signature(tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen(_command(script, store), cwd=helpers.REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for script in (RANK0, RANK1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    [out] = helpers.json_lines(outputs[0][0])
    [barrier, all_reduce, all_gather] = out["seen"]
    [[group, seq, op, members, signature, entered, me], last] = barrier
    assert (group, seq, op, members, signature, me) == ("0", 1, "barrier", [0, 1], "", 0)
    assert entered >= out["began"]
    assert last == []  # nothing completed yet
    [entry, last] = all_reduce
    assert entry[:5] == ["0", 2, "all_reduce", [0, 1], "(4, 2) torch.float32"]
    assert [done[:3] for done in last] == [["0", 1, "barrier"]]
    [entry, _] = all_gather
    assert entry[:5] == ["0", 3, "all_gather", [0, 1], "2 x (3,) torch.int64"]
    # out of them once rank 1 came
    assert out["after"][0] == []
    assert [done[:3] for done in out["after"][1]] == [["0", 3, "all_gather"]]
