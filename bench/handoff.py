"""W11 and W12: one group's results handed to another group's ranks.

- **W11**, results between groups: a 2-rank producer group makes a 64 MiB float32 array
  per rank, a 2-rank consumer group sums them (consumer *i* the array of producer *1 - i*,
  the sum checked); 10 rounds, the median round time and the controller's RSS growth,
  four ways: ``keep=True`` handles, the values through the controller, raw Ray actors
  passing ``ObjectRef``s, and phalanx on Ray with ``keep=True``;
- **W11 soak**: 1,000 handoffs of 64 MiB by handles (500 rounds of the 2 ranks, each
  handle freed after its round), then what is still held once the ranks closed the
  blocks they keep for reuse (``POOL_IDLE``): the controller's, producers' and consumers'
  RSS growth, the machine's shared memory (``Shmem`` in
  ``/proc/meminfo``: where memory blocks live) and the results the producers still keep;
- **W12**, weights from trainers to generators: 1 GiB of a torch state dict (16 float32
  tensors of 64 MiB) from trainer rank 0 to the 2 generator ranks, five ways: a gloo
  broadcast written by hand in the joint world of ``px.rendezvous`` (received in place),
  a ``keep=True`` handle, ``put()`` of the weights fetched to the controller, and
  ``px.weight_sync`` -- as it chooses on one machine (shared memory), and made to use its
  gloo broadcast (``transport="broadcast"``); but for the hand-written broadcast, each
  generator copies the weights into its own tensors, and ends with the trainer's (a
  checksum).

    python -m bench.handoff [--quick] [--json PATH] [--only W11,W12] [--no-ray]
                            [--soak HANDOFFS]

Phase 1 measures the local backend with no Ray process running; phase 2 then starts a
Ray of its own (``ray.init(address="local")``) and measures raw Ray actors, phalanx-ray
and the local backend's handles again ("handles, Ray up"), interleaved with each other
round by round, as ``bench.run`` does: the targets against Ray compare ways timed side
by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.util import (
    Row,
    alternate_rounds,
    clock,
    compile_sources,
    machine_info,
    rss_mib,
    run_reported,
    settle,
    trial_order,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "handoff.json"
MiB = 1 << 20
ARRAY_BYTES = 64 * MiB  # W11: one producer rank's result
TENSORS, TENSOR_BYTES = 16, 64 * MiB  # W12: 1 GiB of weights
# "handles, Ray up": the local backend's handles again, in phase 2's rounds, alternating
# with raw Ray's: the comparison with Ray made under the same conditions, round by round
W11_WAYS = ("handles", "controller", "handles, Ray up", "ray", "phalanx-ray")
W12_WAYS = ("gloo broadcast", "handles", "put", "weight_sync", "weight_sync gloo")


# -- worker classes (importable by the ranks and by Ray's workers) ------------------------


def _value(rank: int, round_: int) -> float:
    return float(rank * 1000 + round_ + 1)


class Producer:
    def __init__(self, rank: int | None = None) -> None:
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank

    def make(self, round_: int) -> Any:
        import numpy as np

        return np.full(ARRAY_BYTES // 4, _value(self.rank, round_), dtype=np.float32)

    def pid(self) -> int:
        return os.getpid()

    def rss(self) -> int:
        return psutil.Process().memory_info().rss

    def kept(self) -> int:
        from phalanx.rank.kept import KEPT

        return len(KEPT)


class Consumer:
    def consume(self, array: Any) -> float:
        import numpy as np

        return float(np.sum(array, dtype=np.float64))

    def pid(self) -> int:
        return os.getpid()

    def rss(self) -> int:
        return psutil.Process().memory_info().rss


def _checksum(weights: dict[str, Any]) -> float:
    import torch

    return sum((i + 1) * float(t.sum(dtype=torch.float64)) for i, t in
               enumerate(weights.values()))


class Weights:
    """A trainer (``fill=True``: seeded weights, the same on every trainer) or a generator
    (zeros, loaded into)."""

    def __init__(self, fill: bool = False) -> None:
        import torch

        torch.set_num_threads(1)
        n = TENSOR_BYTES // 4
        if fill:
            gen = torch.Generator().manual_seed(0)
            self.weights = {f"layer{i}.weight": torch.rand(n, generator=gen)
                            for i in range(TENSORS)}
        else:
            self.weights = {f"layer{i}.weight": torch.zeros(n) for i in range(TENSORS)}

    def state(self) -> dict[str, Any]:
        return self.weights

    def load(self, state: dict[str, Any]) -> None:
        import warnings

        with warnings.catch_warnings():  # tensors on read-only shared pages: copied here
            warnings.simplefilter("ignore")
            for name, tensor in state.items():
                self.weights[name].copy_(tensor)

    def reset(self) -> None:
        for tensor in self.weights.values():
            tensor.zero_()

    def checksum(self) -> float:
        return _checksum(self.weights)

    def join(self, world: dict[str, str]) -> int:
        from datetime import timedelta

        import torch.distributed as dist

        import phalanx as px

        rank, size = int(world["RANK"]), int(world["WORLD_SIZE"])
        store = px.joint_store(world, timeout=120)  # answers only the world's own ranks
        self.store = store  # the process group needs it alive
        self.joint = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=600))
        return rank

    def broadcast(self) -> None:
        """Every tensor from the joint world's rank 0 (trainer 0) to everyone, in place."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in self.weights.values():
            self.joint.broadcast([tensor], options).wait()


# -- helpers ------------------------------------------------------------------------------


def _check_sums(got: list[float], round_: int) -> None:
    want = [ARRAY_BYTES // 4 * _value(1 - i, round_) for i in range(2)]
    if got != want:
        raise AssertionError(f"W11 consumers summed {got}, expected {want}")


def _rounds(ways: dict[str, Callable[[int], list[float]]], rounds: int,
            out: dict[str, dict[str, Any]]) -> None:
    """W11's ways alternating (:func:`bench.util.alternate_rounds`); each way's RSS
    growth is the sum of the controller's RSS changes across its own rounds."""
    alternate_rounds(ways, rounds, out, lambda _, sums, round_: _check_sums(sums, round_))


# -- W11 ----------------------------------------------------------------------------------


def _w11_local(rounds: int, out: dict[str, dict[str, Any]]) -> None:
    import phalanx as px
    from bench.handoff import Consumer, Producer

    with px.WorkerGroup(Producer, procs_per_node=2, echo_output=False) as producers, \
            px.WorkerGroup(Consumer, procs_per_node=2, echo_output=False) as consumers:

        def controller(round_: int) -> list[float]:
            values = producers.call("make", round_)
            return consumers.map("consume", values[::-1])

        _rounds({"handles": _by_handles(producers, consumers), "controller": controller},
                rounds, out)


def _by_handles(producers: Any, consumers: Any) -> Callable[[int], list[float]]:
    """W11's handle way on any backend: kept results, each consumer given the other's."""

    def handles(round_: int) -> list[float]:
        refs = producers.call("make", round_, keep=True)
        sums = consumers.map("consume", refs[::-1])
        for ref in refs:
            ref.free()
        return sums

    return handles


def _shmem_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _w11_soak(handoffs: int, out: dict[str, float]) -> None:
    """``handoffs`` results of 64 MiB from producers to consumers by handles; what is held
    afterwards, against after a warm-up of 10 rounds (into ``out``)."""
    import phalanx as px
    from bench.handoff import Consumer, Producer
    from phalanx.rank.kept import POOL_IDLE

    with px.WorkerGroup(Producer, procs_per_node=2, echo_output=False) as producers, \
            px.WorkerGroup(Consumer, procs_per_node=2, echo_output=False) as consumers:
        handles = _by_handles(producers, consumers)

        def held() -> list[float]:
            settle()
            return [rss_mib(), sum(producers.call("rss")) / MiB,
                    sum(consumers.call("rss")) / MiB, _shmem_mib()]

        for round_ in range(10):
            _check_sums(handles(round_), round_)
        before = held()
        began = clock()
        for round_ in range(handoffs // 2):
            _check_sums(handles(round_), round_)
        out["seconds"] = clock() - began
        time.sleep(POOL_IDLE + 1)  # the ranks close the blocks they pooled for reuse
        after = held()
        for key, was, now in zip(("controller_rss", "producers_rss", "consumers_rss",
                                  "shmem"), before, after, strict=True):
            out[f"{key}_growth_mib"] = now - was
        out["kept_after"] = sum(producers.call("kept"))
        out["handoffs"] = handoffs // 2 * 2


def _w11_ray(rounds: int, out: dict[str, dict[str, Any]]) -> None:
    import ray

    import phalanx as px
    from bench.handoff import Consumer, Producer

    producer_cls, consumer_cls = ray.remote(Producer), ray.remote(Consumer)
    actors_p = [producer_cls.remote(rank) for rank in range(2)]
    actors_c = [consumer_cls.remote() for _ in range(2)]
    ray.get([a.pid.remote() for a in actors_p + actors_c])
    try:
        with px.WorkerGroup(Producer, procs_per_node=2, backend="ray",
                            echo_output=False) as producers, \
                px.WorkerGroup(Consumer, procs_per_node=2, backend="ray",
                               echo_output=False) as consumers, \
                px.WorkerGroup(Producer, procs_per_node=2, echo_output=False) as local_p, \
                px.WorkerGroup(Consumer, procs_per_node=2, echo_output=False) as local_c:

            def raw(round_: int) -> list[float]:
                refs = [p.make.remote(round_) for p in actors_p]
                pairs = zip(actors_c, refs[::-1], strict=True)
                sums = ray.get([c.consume.remote(ref) for c, ref in pairs])
                del refs
                return sums

            _rounds({"ray": raw, "phalanx-ray": _by_handles(producers, consumers),
                     "handles, Ray up": _by_handles(local_p, local_c)}, rounds, out)
    finally:
        for actor in actors_p + actors_c:
            ray.kill(actor)


# -- W12 ----------------------------------------------------------------------------------


def _w12(trials: int, out: dict[str, list[float]]) -> None:
    import phalanx as px
    from bench.handoff import Weights

    with px.WorkerGroup(Weights, args=(True,), procs_per_node=2,
                        echo_output=False) as trainers, \
            px.WorkerGroup(Weights, procs_per_node=2, echo_output=False) as generators:
        want = trainers.call_one(0, "checksum")
        worlds = px.rendezvous(trainers, generators)  # the joint world, built once, untimed
        joined = [trainers.map_async("join", worlds[0]), generators.map_async("join", worlds[1])]
        for future in joined:
            future.result(timeout=300)

        def broadcast() -> None:
            sent = [trainers.call_async("broadcast"), generators.call_async("broadcast")]
            for future in sent:
                future.result(timeout=600)

        def handles() -> None:
            ref = trainers.call_one(0, "state", keep=True)
            generators.call("load", ref)
            ref.free()

        def put() -> None:
            w = trainers.call_one(0, "state")
            ref = generators.put(w)
            generators.call("load", ref)
            ref.free()
            del w

        synced = px.weight_sync(trainers, generators, src_rank=0)
        synced_gloo = px.weight_sync(trainers, generators, src_rank=0, transport="broadcast")

        def weight_sync() -> None:
            synced.push("state", "load")

        def weight_sync_gloo() -> None:
            synced_gloo.push("state", "load")

        ways = {"gloo broadcast": broadcast, "handles": handles, "put": put,
                "weight_sync": weight_sync, "weight_sync gloo": weight_sync_gloo}
        for trial in range(-1, trials):  # trial -1: a warm-up of each way, untimed
            for name in trial_order(list(ways), max(trial, 0)):
                generators.call("reset")
                settle()
                began = clock()
                ways[name]()
                took = clock() - began
                got = generators.call("checksum")
                if not all(math.isclose(g, want, rel_tol=1e-12) for g in got):
                    raise AssertionError(f"W12 {name}: generators' checksums {got}, "
                                         f"the trainer's {want}")
                if trial >= 0:
                    out.setdefault(name, []).append(took)
                print(f"  W12 {name}: {took:.3f} s{' (warm-up)' if trial < 0 else ''}",
                      file=sys.stderr, flush=True)
        synced.close()
        synced_gloo.close()


# -- report -------------------------------------------------------------------------------


def _table(title: str, rows: list[Row], columns: list[str]) -> None:
    width = max(len(r.label) for r in rows)
    cw = max(12, *(len(c) for c in columns))
    print(title)
    print(f"{'':<{width}}  {'unit':<8}  " + "  ".join(f"{c:>{cw}}" for c in columns))
    for row in rows:
        cells = [row.value(c) for c in columns]
        print(f"{row.label:<{width}}  {row.unit:<8}  " + "  ".join(
            f"{'-':>{cw}}" if v is None else f"{v:>{cw}.3f}" for v in cells))


def _target(text: str, ok: bool | None, measured: float | None = None,
            measure: str = "ratio") -> dict[str, Any]:
    """A goal's verdict, printed; ``measured``: the figure it judged (a ratio, or with
    ``measure="value"`` a quantity)."""
    verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    shown = "" if measured is None else (f"  measured {measured:.2f}x" if measure == "ratio"
                                         else f"  measured {measured:.3g}")
    print(f"  {verdict}  {text}{shown}")
    return {"target": text, "result": verdict, "measured": measured, "measure": measure}


def _over(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or bottom is None or bottom == 0 else top / bottom


def main(argv: list[str] | None = None) -> int:
    compile_sources()
    parser = argparse.ArgumentParser(prog="python -m bench.handoff",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--only", default="W11,W12")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--soak", type=int, default=None, metavar="HANDOFFS",
                        help="handoffs of the W11 soak (default 1000; 0 skips it; --quick: 0)")
    args = parser.parse_args(argv)
    soak = (0 if args.quick else 1000) if args.soak is None else args.soak
    only = set(args.only.split(","))
    rounds, trials = (4, 1) if args.quick else (10, 3)
    info = machine_info()
    notes: list[str] = []
    errors: list[str] = []
    w11: dict[str, dict[str, Any]] = {}
    w12: dict[str, list[float]] = {}
    w11_soak: dict[str, float] = {}

    def attempt(where: str, fn: Callable[[], None]) -> None:
        run_reported(errors, where, fn)

    if "W11" in only:
        print("W11 on the local backend ...", file=sys.stderr, flush=True)
        attempt("W11 local", lambda: _w11_local(rounds, w11))
        if soak:
            print(f"W11 soak: {soak} handoffs ...", file=sys.stderr, flush=True)
            attempt("W11 soak", lambda: _w11_soak(soak, w11_soak))
    if "W12" in only:
        try:
            import torch  # noqa: F401
        except ImportError:
            notes.append("W12 skipped: torch is not installed")
        else:
            print("W12 ...", file=sys.stderr, flush=True)
            attempt("W12", lambda: _w12(trials, w12))
    if "W11" in only:
        ray = None
        if args.no_ray:
            notes.append("W11 ray and phalanx-ray skipped: --no-ray")
        else:
            try:
                import ray
            except ImportError:
                notes.append("W11 ray and phalanx-ray skipped: ray is not installed")
        if ray is not None:
            print("W11 on Ray ...", file=sys.stderr, flush=True)
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
            try:
                attempt("W11 ray", lambda: _w11_ray(rounds, w11))
            finally:
                ray.shutdown()

    rows11 = [Row("W11.round", f"W11 round, {ARRAY_BYTES // MiB} MiB x 2 ranks", "s", "lower",
                  raw={k: v["round_s"] for k, v in w11.items()}),
              Row("W11.rss", f"W11 controller RSS growth, {rounds} rounds", "MiB", "lower",
                  raw={k: [sum(v["rss_delta_mib"])] for k, v in w11.items()})]
    size_gb = TENSORS * TENSOR_BYTES / 1e9
    rows12 = [Row("W12.time", f"W12 {TENSORS * TENSOR_BYTES // MiB} MiB to 2 generators", "s",
                  "lower", raw=dict(w12)),
              Row("W12.rate", "W12 effective rate (size x 2 / time)", "GB/s", "higher",
                  raw={k: [2 * size_gb / t for t in v] for k, v in w12.items()})]
    targets = []
    if w11:
        _table(f"W11 (median over {rounds} rounds)", rows11, list(W11_WAYS))
    if w11_soak:
        print(f"\nW11 soak: {w11_soak['handoffs']:.0f} handoffs of {ARRAY_BYTES // MiB} MiB by "
              f"handles in {w11_soak['seconds']:.1f} s; held afterwards (growth, MiB): "
              f"controller RSS {w11_soak['controller_rss_growth_mib']:+.1f}, producers' RSS "
              f"{w11_soak['producers_rss_growth_mib']:+.1f}, consumers' RSS "
              f"{w11_soak['consumers_rss_growth_mib']:+.1f}, shared memory "
              f"{w11_soak['shmem_growth_mib']:+.1f}; results still kept: "
              f"{w11_soak['kept_after']:.0f}")
    if w12:
        print()
        _table(f"W12 (median over {trials} trials)", rows12, list(W12_WAYS))
    print("\nTargets")
    if "W11" in only:
        t, r = rows11[0], rows11[1]
        h, c, y = t.value("handles"), t.value("controller"), t.value("ray")
        beside, on_ray = t.value("handles, Ray up"), t.value("phalanx-ray")
        targets.append(_target("W11: handles >= 1.2x faster than Ray's object refs (timed "
                               "alternately with them)",
                               None if beside is None or y is None else y >= 1.2 * beside,
                               _over(y, beside)))
        targets.append(_target("W11: phalanx-ray's handles >= 1.2x faster than Ray's object "
                               "refs", None if on_ray is None or y is None
                               else y >= 1.2 * on_ray, _over(y, on_ray)))
        targets.append(_target("W11: handles >= 3x faster than through the controller",
                               None if h is None or c is None else c >= 3 * h, _over(c, h)))
        growth = r.value("handles")
        targets.append(_target("W11: controller RSS growth with handles < 16 MiB",
                               None if growth is None else growth < 16, growth, "value"))
        if w11_soak:
            left = max(w11_soak[k] for k in w11_soak if k.endswith("_growth_mib"))
            targets.append(_target(f"W11 soak: {w11_soak['handoffs']:.0f} handoffs leave no "
                                   "memory held (every growth < 64 MiB, nothing kept)",
                                   left < ARRAY_BYTES / MiB and w11_soak["kept_after"] == 0))
    if "W12" in only:
        t12 = rows12[0]
        mine = t12.value("weight_sync")
        others = [v for v in (t12.value(w) for w in W12_WAYS[:3]) if v is not None]
        targets.append(_target("W12: weight_sync at least as fast as the best other way",
                               None if mine is None or not others else mine <= min(others)))
    for note in notes:
        print(f"note: {note}")
    for error in errors:
        print(f"error: {error}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "finished_unix_time": time.time(), "rounds": rounds, "trials": trials,
        "machine": info, "load_avg_at_end": os.getloadavg(),
        "rows": [{"key": row.key, "label": row.label, "unit": row.unit,
                  "values": {n: row.value(n) for n in row.raw}, "raw": row.raw}
                 for row in rows11 + rows12],
        "w11_raw": w11, "w11_soak": w11_soak, "targets": targets, "notes": notes, "errors": errors,
    }, indent=1))
    print(f"JSON: {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
