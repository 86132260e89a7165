"""On Ray a rank runs inside its actor's worker process: Ray inside a rank is Ray inside an
actor (its actor id, its node, the driver's job, the bundle's GPUs, the group's placement
group, ObjectRefs in arguments, nested tasks in the group's placement group), user methods
run on the main thread, output is prefixed once, and a rank's child dies with its SIGKILLed
actor (the other no-orphan cases: tests/backends/test_ray_backend.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

import phalanx as px
from tests import helpers, raycluster

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")


@pytest.fixture(autouse=True)
def cluster(ray_cluster):
    yield ray_cluster
    assert raycluster.leftovers() == []


class InActor:
    """What a rank sees of Ray."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def ray_view(self) -> dict:
        import threading

        import ray
        from ray.util import get_current_placement_group

        context = ray.get_runtime_context()
        pg = get_current_placement_group()
        return {
            "initialized": ray.is_initialized(),
            "actor_id": context.get_actor_id(),
            "node_id": context.get_node_id(),
            "job_id": context.get_job_id(),
            "pg": pg.id.hex() if pg is not None else None,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node_rank": int(os.environ["NODE_RANK"]),
            "main_thread": threading.current_thread() is threading.main_thread(),
            "pid": os.getpid(),
        }

    def pid(self) -> int:
        return os.getpid()

    def get(self, refs: dict) -> object:
        import ray

        return ray.get(refs["ref"], timeout=30)

    def put(self, value: object) -> dict:
        import ray

        return {"ref": ray.put(value)}

    def nested_task_in_group(self) -> dict:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_cpus=0)
        def where() -> str | None:
            pg = ray.util.get_current_placement_group()
            return pg.id.hex() if pg is not None else None

        pg = get_current_placement_group()
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg)
        return {"mine": pg.id.hex(),
                "task": ray.get(where.options(scheduling_strategy=strategy).remote(),
                                timeout=60)}

    def handle_signal(self) -> bool:
        got = []
        previous = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        return bool(got)

    def start_child(self) -> int:
        child = subprocess.Popen(["sleep", "1004"])
        self.children.append(child)
        return child.pid

    def say(self, text: str) -> None:
        print(text, flush=True)
        subprocess.run(["echo", f"{text} (from a subprocess)"], check=True, timeout=10)


def test_ray_inside_a_rank_is_ray_inside_its_actor():
    backend = px.RayBackend(resources_per_worker={"GPU": 1, "CPU": 1})
    with px.WorkerGroup(InActor, procs_per_node=[2, 1], backend=backend,
                        echo_output=False) as group:
        views = group.call("ray_view")
        actors = [b.actor for b in group._backend._bundles]
        pg = group._backend._pg
    assert all(v["initialized"] and v["main_thread"] for v in views)
    ids = [v["actor_id"] for v in views]
    assert len(set(ids)) == 3 and ids == [a._actor_id.hex() for a in actors]
    assert {v["job_id"] for v in views} == {ray.get_runtime_context().get_job_id()}
    assert {v["pg"] for v in views} == {pg.id.hex()}
    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    nodes_by_rank = {v["node_rank"]: set() for v in views}
    for v in views:
        nodes_by_rank[v["node_rank"]].add(v["node_id"])
    assert all(len(n) == 1 for n in nodes_by_rank.values())  # one Ray node per NODE_RANK
    assert nodes_by_rank[0] != nodes_by_rank[1]
    assert {v["node_id"] for v in views} <= set(table.values())
    for v in views:
        assert len(v["gpu_ids"]) == 1
        assert v["cuda"] is not None and v["cuda"].split(",") == v["gpu_ids"]


class BuiltWithRay(InActor):
    """Keeps what Ray said while the user's constructor ran."""

    def __init__(self) -> None:
        super().__init__()
        self.built = self.ray_view()

    def built_view(self) -> dict:
        return self.built


def test_the_constructor_sees_ray_as_the_methods_do():
    # Node 0 (the controller's machine): each actor starts its rank in its own constructor.
    # Node 1 (another address): its first actor is made ahead, to pick the node's ports,
    # and starts its rank when the serve call comes. Users see no difference.
    backend = px.RayBackend(resources_per_worker={"GPU": 1, "CPU": 1})
    with px.WorkerGroup(BuiltWithRay, procs_per_node=[2, 1], backend=backend,
                        echo_output=False) as group:
        built = group.call("built_view", timeout=30)
        now = group.call("ray_view", timeout=30)
    assert built == now
    assert all(v["actor_id"] and v["pg"] and len(v["gpu_ids"]) == 1 for v in built)


def test_a_sigint_as_soon_as_the_group_is_ready_ends_the_idle_rank():
    # The rank is ready once its constructor ran, which may be before Ray delivers the
    # actor's serve call: a SIGINT for it waits for that call, then ends the idle rank with
    # KeyboardInterrupt's exit status, as on every backend, not Ray's task loop.
    with px.WorkerGroup(InActor, procs_per_node=2, backend="ray", echo_output=False) as group:
        group.send_signal(signal.SIGINT, workers=[0])
        assert helpers.wait_until(lambda: not group.health()[0].alive, 30, interval=0.05)
        assert group.health()[0].exitcode == 128 + signal.SIGINT
        assert group.call("pid", workers=[1], timeout=30)[0] > 0


def test_an_object_ref_in_the_arguments_and_a_nested_task_in_the_group():
    ref = ray.put({"weights": [1, 2, 3]})
    with px.WorkerGroup(InActor, procs_per_node=2, backend="ray", echo_output=False) as group:
        assert group.call("get", {"ref": ref}, timeout=60) == [{"weights": [1, 2, 3]}] * 2
        returned = group.map("put", ["a", "b"], timeout=60)  # owned by the ranks' actors
        assert ray.get([r["ref"] for r in returned], timeout=60) == ["a", "b"]
        placed = group.call("nested_task_in_group", timeout=90)
    assert all(p["task"] == p["mine"] for p in placed)


def test_user_methods_run_on_the_main_thread_and_may_set_signal_handlers():
    with px.WorkerGroup(InActor, procs_per_node=1, backend="ray", echo_output=False) as group:
        assert group.call("handle_signal", timeout=30) == [True]


def test_output_is_prefixed_once(capfd):
    words = ["alpha", "beta"]  # distinct per rank: identical lines are shown collapsed
    with px.WorkerGroup(InActor, procs_per_node=2, backend="ray") as group:
        group.map("say", words, timeout=30)
        time.sleep(1.0)  # Ray's log forwarding, if it saw the line, would show it by now
    out = capfd.readouterr()
    text = out.out + out.err
    for rank, word in enumerate(words):
        assert text.count(f"[rank {rank}] {word}\n") == 1, text
        assert text.count(f"[rank {rank}] {word} (from a subprocess)\n") == 1, text
        assert text.count(word) == 2, text


def _gone(pid: int, within: float) -> bool:
    def dead() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return helpers.wait_until(dead, within, interval=0.02)


def test_a_ranks_child_dies_with_its_sigkilled_actor():
    with px.WorkerGroup(InActor, procs_per_node=2, backend="ray", echo_output=False) as group:
        children = group.call("start_child", timeout=30)
        pids = group.call("pid")
        try:
            os.kill(pids[1], signal.SIGKILL)  # what Ray's OOM killer does to a worker
            assert _gone(children[1], 3.0), "rank 1's child outlived its SIGKILLed actor"
            assert not _gone(children[0], 0.2)
            with pytest.raises(px.WorkerDied) as died:
                group.call("pid", timeout=30)
            assert died.value.rank == 1  # its signal is known only if Ray had not reaped it
        finally:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class RayCode:
    """Methods written for Ray actors: values in, ObjectRefs nested as refs."""

    def make(self, n: int):
        import numpy as np

        return np.arange(n, dtype=np.float64)

    def total(self, x, scale=1.0) -> tuple[str, float]:
        import numpy as np

        return type(x).__name__, float(np.asarray(x).sum()) * float(np.asarray(scale).sum())

    def nested(self, box: dict) -> tuple[str, float]:
        import ray

        return type(box["ref"]).__name__, float(ray.get(box["ref"], timeout=60).sum())


def test_a_kept_handle_converts_to_a_ray_object_ref_and_ray_refs_arrive_as_values():
    import numpy as np

    @ray.remote(num_cpus=0)
    class Plain:
        def total(self, x) -> float:
            return float(x.sum())

    with px.WorkerGroup(RayCode, procs_per_node=2, backend="ray", echo_output=False) as group:
        refs = group.call("make", 100, keep=True, timeout=60)
        converted = refs[1].to_ray()
        assert isinstance(converted, ray.ObjectRef)
        np.testing.assert_array_equal(ray.get(converted, timeout=60), np.arange(100.0))
        plain = Plain.remote()  # raw Ray code takes it as any ObjectRef
        try:
            assert ray.get(plain.total.remote(converted), timeout=60) == 4950.0
        finally:
            ray.kill(plain)
        # back: an ObjectRef argument reaches the method as its value, as on a Ray actor;
        # nested in a container it stays a ref, as Ray leaves it
        assert group.call("total", converted, timeout=60) == [("ndarray", 4950.0)] * 2
        assert group.call("total", converted, scale=ray.put(np.full(2, 0.5)),
                          timeout=60) == [("ndarray", 4950.0)] * 2
        assert group.call("nested", {"ref": converted}, timeout=60) == [
            ("ObjectRef", 4950.0)] * 2
        refs[1].free()  # the converted ref lives on as Ray's references do
        assert float(ray.get(converted, timeout=60).sum()) == 4950.0
    with px.WorkerGroup(RayCode, backend="local", echo_output=False) as local:
        ref = local.call_one(0, "make", 3, keep=True)
        with pytest.raises(TypeError, match="only results kept on the Ray backend"):
            ref.to_ray()
