"""The contenders behind one interface, each driving one group of ``Bench`` workers.

Every contender holds at most one running group at a time: ``start(n)`` returns once the
constructor has returned on every worker, ``stop()`` once every worker process is gone.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil

import phalanx
from bench.pipe_pool import PipePool
from bench.util import clock
from bench.workloads import Bench

SETTLE_S = 0.05  # how long a call runs before its worker is killed (W5)
DEATH_TIMEOUT_S = 60.0  # W5 gives up on a contender that never reports the death


class Contender:
    name = "abstract"
    only: tuple[str, ...] | None = None  # the workloads it runs (None: all)

    def start(self, n: int) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def noop(self) -> None:
        """One no-op call fanned out to every worker, waiting for all replies."""
        raise NotImplementedError

    def pipelined(self, count: int) -> None:
        """``count`` no-op calls to worker 0, as many in flight as the contender allows."""
        raise NotImplementedError

    def array_sum(self, array: Any) -> list[float]:
        """``array`` sent to every worker, which returns its sum."""
        raise NotImplementedError

    puts = False  # whether it can store an object once for every worker (array_sum_put)

    def array_sum_put(self, array: Any) -> list[float]:
        """As :meth:`array_sum`, the array stored once (put), the call naming it, and
        freed afterwards: all of it timed."""
        raise NotImplementedError

    def kill_latency(self) -> float:
        """SIGKILL worker 0 inside a call; seconds from the kill until the caller's call
        raises. Worker 0 is replaced afterwards (not timed)."""
        raise NotImplementedError


class PhalanxContender(Contender):
    name = "phalanx"
    backend = "local"

    def __init__(self) -> None:
        self.group: phalanx.WorkerGroup | None = None

    def start(self, n: int) -> None:
        self.group = phalanx.WorkerGroup(
            Bench, procs_per_node=n, echo_output=False, backend=self.backend
        )

    def stop(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()

    def running(self) -> bool:
        return self.group is not None

    def pids(self) -> list[int]:
        assert self.group is not None
        return [h.pid for h in self.group.health() if h.pid is not None]

    def noop(self) -> None:
        self.group.call("noop")  # type: ignore[union-attr]

    def pipelined(self, count: int) -> None:
        group = self.group
        assert group is not None
        futures = [group.call_async("noop", workers=[0]) for _ in range(count)]
        for future in futures:
            future.result()

    def array_sum(self, array: Any) -> list[float]:
        return self.group.call("array_sum", array)  # type: ignore[union-attr]

    puts = True

    def array_sum_put(self, array: Any) -> list[float]:
        group = self.group
        assert group is not None
        ref = group.put(array)
        try:
            return group.call("array_sum", ref)
        finally:
            ref.free()

    def kill_latency(self) -> float:
        group = self.group
        assert group is not None
        pid = group.call_one(0, "pid")
        future = group.call_async("sleep", 10, workers=[0])
        time.sleep(SETTLE_S)
        t0 = clock()
        os.kill(pid, signal.SIGKILL)
        try:
            future.result(timeout=DEATH_TIMEOUT_S)
        except phalanx.WorkerDied:
            elapsed = clock() - t0
        else:
            raise RuntimeError("the call returned although its worker was killed")
        group.recreate(0)
        return elapsed


class PhalanxRayContender(PhalanxContender):
    """phalanx on its Ray backend (a placement group, one actor per rank, the rank running
    in its actor's worker process); ``ray.init`` has been called by the runner, so the
    group joins that Ray. W5 kills the rank's process (``call_one(0, "pid")``): its
    actor's."""

    name = "phalanx-ray"
    backend = "ray"

    def stop(self) -> None:
        """Shut the group down and wait until its ranks (their actors' processes) are gone."""
        group, self.group = self.group, None
        if group is None:
            return
        procs = []
        for health in group.health():
            try:
                procs.append(psutil.Process(health.pid))  # type: ignore[arg-type]  # its actor
            except (psutil.Error, ValueError, TypeError):
                pass
        group.shutdown()
        _, alive = psutil.wait_procs([p for p in procs if p is not None], timeout=30)
        if alive:
            raise RuntimeError(f"processes {[p.pid for p in alive]} outlived shutdown()")


class PhalanxTracedContender(PhalanxContender):
    """phalanx with ``group.trace()`` open for the group's whole life: every call watched
    by the controller and its span recorded by the rank (``--observed``)."""

    name = "phalanx+trace"
    only = ("W2", "W3")

    def start(self, n: int) -> None:
        super().start(n)
        assert self.group is not None
        self.trace = self.group.trace().start()

    def stop(self) -> None:
        trace = getattr(self, "trace", None)
        if trace is not None and self.group is not None:
            trace.stop()  # the ranks hand their spans over: as a trace's end would
            self.trace = None
        super().stop()


class PhalanxDashboardContender(PhalanxContender):
    """phalanx with ``px.dashboard()`` open: its metrics watch every call of its group
    (``--observed``). A dashboard watches every group of its process; here it is made to
    let go of the other contenders' groups, which must stay unwatched."""

    name = "phalanx+dashboard"
    only = ("W2", "W3")

    def start(self, n: int) -> None:
        self.board = phalanx.dashboard()
        super().start(n)
        from phalanx.controller.group import live_groups
        from phalanx.controller.internals import internals
        from phalanx.controller.observe import EVERY_GROUP

        EVERY_GROUP.remove(self.board.metrics)  # groups started later: not watched
        for group in live_groups():
            if group is not self.group:
                internals(group).watch_calls(self.board.metrics, on=False)

    def stop(self) -> None:
        super().stop()
        board = getattr(self, "board", None)
        if board is not None:
            board.close()
            self.board = None


class PipePoolContender(Contender):
    name = "pipe_pool"

    def __init__(self) -> None:
        self.pool: PipePool | None = None

    def start(self, n: int) -> None:
        self.pool = PipePool(Bench, n)

    def stop(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def running(self) -> bool:
        return self.pool is not None

    def pids(self) -> list[int]:
        return self.pool.pids()  # type: ignore[union-attr]

    def noop(self) -> None:
        self.pool.call("noop")  # type: ignore[union-attr]

    def pipelined(self, count: int) -> None:
        self.pool.pipelined("noop", count)  # type: ignore[union-attr]

    def array_sum(self, array: Any) -> list[float]:
        return self.pool.call("array_sum", array)  # type: ignore[union-attr]

    def kill_latency(self) -> float:
        pool = self.pool
        assert pool is not None
        pid = pool.pids()[0]
        pool.submit(0, "sleep", 10)  # call_watching, split so that the kill can go between
        time.sleep(SETTLE_S)
        t0 = clock()
        os.kill(pid, signal.SIGKILL)
        try:
            pool.watch(0)
        except EOFError:
            elapsed = clock() - t0
        else:
            raise RuntimeError("the call returned although its worker was killed")
        pool.restart(0)
        return elapsed


class RayContender(Contender):
    """Ray actors of ``Bench``; ``ray.init`` has been called by the runner."""

    name = "ray"

    def __init__(self) -> None:
        import ray

        self.ray = ray
        self.actor_class = ray.remote(Bench)
        self.actors: list[Any] = []
        self._pids: list[int] = []

    def _new_actors(self, n: int) -> tuple[list[Any], list[int]]:
        actors = [self.actor_class.remote() for _ in range(n)]
        # The constructor has returned on an actor once it answers a method call.
        return actors, self.ray.get([a.pid.remote() for a in actors])

    def start(self, n: int) -> None:
        self.actors, self._pids = self._new_actors(n)

    def stop(self) -> None:
        """Kill the actors and wait until their processes are gone (``ray.kill`` is async)."""
        procs = []
        for pid in self._pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors, self._pids = [], []
        _, alive = psutil.wait_procs(procs, timeout=30)
        if alive:
            raise RuntimeError(f"ray actor processes {[p.pid for p in alive]} outlived ray.kill")

    def running(self) -> bool:
        return bool(self.actors)

    def pids(self) -> list[int]:
        return list(self._pids)

    def noop(self) -> None:
        self.ray.get([a.noop.remote() for a in self.actors])

    def pipelined(self, count: int) -> None:
        actor = self.actors[0]
        self.ray.get([actor.noop.remote() for _ in range(count)])

    def array_sum(self, array: Any) -> list[float]:
        ref = self.ray.put(array)  # once; every actor reads it from the object store
        return self.ray.get([a.array_sum.remote(ref) for a in self.actors])

    puts = True
    array_sum_put = array_sum  # Ray's one way: the object store

    def kill_latency(self) -> float:
        ray = self.ray
        actor, pid = self.actors[0], self._pids[0]
        ref = actor.sleep.remote(10)
        time.sleep(SETTLE_S)
        t0 = clock()
        os.kill(pid, signal.SIGKILL)
        try:
            ray.get(ref, timeout=DEATH_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            elapsed = clock() - t0
        else:
            raise RuntimeError("the call returned although its actor was killed")
        ray.kill(actor)
        try:
            psutil.Process(pid).wait(10)
        except psutil.Error:
            pass
        (self.actors[0],), (self._pids[0],) = self._new_actors(1)
        return elapsed


RAY_NAMES = ("ray", "phalanx-ray")  # contenders that need Ray up (phase 2)


OBSERVED = ("phalanx+trace", "phalanx+dashboard")


def make_contenders(with_ray: bool, observed: bool = False) -> list[Contender]:
    """Phase 1: phalanx and pipe_pool (``observed``: also phalanx traced and phalanx under
    a dashboard, on W2 and W3); phase 2 (``with_ray``, Ray up): ray and phalanx-ray."""
    if with_ray:
        return [RayContender(), PhalanxRayContender()]
    extra: list[Contender] = ([PhalanxTracedContender(), PhalanxDashboardContender()]
                              if observed else [])
    return [PhalanxContender(), PipePoolContender(), *extra]
