"""W13: results re-cut between groups of different sizes, as an RL loop's generators and
trainers rarely number the same.

A 2-rank producer group makes a 64 MiB float32 array per rank (16 Mi rows, each
producer's its own value); a 3-rank consumer group sums them, consumer *i* the *i*-th
third of their rows (one consumer's third spans both producers). Four ways:

- **chunk**: ``refs = producers.call("make", r, keep=True)``, ``consumers.map("consume",
  px.chunk(refs, 3))``: each consumer reads its rows straight from the producers;
- **controller**: ``values = producers.call("make", r)``, joined and split into thirds
  here (``numpy.array_split``), ``consumers.map("consume", thirds)``;
- **ray**: raw Ray actors, the producers' ``make.remote()`` refs handed to each consumer
  with its row ranges, read with ``ray.get`` inside the actor, sliced and joined there;
- **phalanx-ray**: chunk, ``backend="ray"``.

One warm-up round each, then 10 rounds (4 with ``--quick``), the ways alternating round
by round in changing order; the sums are checked. Reported: the median round time and the
controller's RSS growth (after ``gc.collect()``, summed over each way's own rounds).

    python -m bench.rechunk [--quick] [--json PATH] [--no-ray]

Phase 1 measures the local backend with no Ray process running; phase 2 then starts a Ray
of its own (``ray.init(address="local")``) for the two Ray columns, as ``bench.run`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.util import (
    Row,
    alternate_rounds,
    compile_sources,
    machine_info,
    median,
    run_reported,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "rechunk.json"
MiB = 1 << 20
ROWS = 64 * MiB // 4  # one producer's float32 rows
PRODUCERS, CONSUMERS = 2, 3
WAYS = ("chunk", "controller", "ray", "phalanx-ray")


def _value(rank: int, round_: int) -> float:
    return float(rank * 1000 + round_ + 1)


def _thirds() -> list[list[tuple[int, int, int]]]:
    """Each consumer's rows, as ``(producer, start, stop)`` spans (what px.chunk cuts)."""
    total = PRODUCERS * ROWS
    spans, first = [], 0
    for i in range(CONSUMERS):
        size = total // CONSUMERS + (i < total % CONSUMERS)
        mine = []
        for producer in range(PRODUCERS):
            lo, hi = max(first, producer * ROWS), min(first + size, (producer + 1) * ROWS)
            if lo < hi:
                mine.append((producer, lo - producer * ROWS, hi - producer * ROWS))
        spans.append(mine)
        first += size
    return spans


def _want(round_: int) -> list[float]:
    return [sum((stop - start) * _value(p, round_) for p, start, stop in spans)
            for spans in _thirds()]


class Producer:
    def __init__(self, rank: int | None = None) -> None:
        import os

        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank

    def make(self, round_: int) -> Any:
        import numpy as np

        return np.full(ROWS, _value(self.rank, round_), dtype=np.float32)

    def ready(self) -> bool:
        return True


class Consumer:
    def consume(self, rows: Any) -> float:
        import numpy as np

        return float(np.sum(rows, dtype=np.float64))

    def consume_refs(self, refs: list[Any], spans: list[tuple[int, int, int]]) -> float:
        """Ray's way: the producers' refs (nested, so Ray leaves them refs), read here."""
        import numpy as np
        import ray

        arrays = ray.get(refs)
        parts = [arrays[p][start:stop] for p, start, stop in spans]
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return float(np.sum(rows, dtype=np.float64))

    def ready(self) -> bool:
        return True


def _rounds(ways: dict[str, Callable[[int], list[float]]], rounds: int,
            out: dict[str, dict[str, Any]]) -> None:
    alternate_rounds(ways, rounds, out, _check)


def _check(name: str, got: list[float], round_: int) -> None:
    if got != _want(round_):
        raise AssertionError(f"W13 {name}: consumers summed {got}, expected {_want(round_)}")


def _by_chunks(producers: Any, consumers: Any) -> Callable[[int], list[float]]:
    import phalanx as px

    def chunked(round_: int) -> list[float]:
        refs = producers.call("make", round_, keep=True)
        sums = consumers.map("consume", px.chunk(refs, CONSUMERS))
        for ref in refs:
            ref.free()
        return sums

    return chunked


def _local(rounds: int, out: dict[str, dict[str, Any]]) -> None:
    import numpy as np

    import phalanx as px
    from bench.rechunk import Consumer, Producer

    with px.WorkerGroup(Producer, procs_per_node=PRODUCERS, echo_output=False) as producers, \
            px.WorkerGroup(Consumer, procs_per_node=CONSUMERS,
                           echo_output=False) as consumers:

        def controller(round_: int) -> list[float]:
            values = producers.call("make", round_)
            thirds = np.array_split(np.concatenate(values), CONSUMERS)
            del values
            return consumers.map("consume", thirds)

        _rounds({"chunk": _by_chunks(producers, consumers), "controller": controller},
                rounds, out)


def _ray(rounds: int, out: dict[str, dict[str, Any]]) -> None:
    import ray

    import phalanx as px
    from bench.rechunk import Consumer, Producer

    actors_p = [ray.remote(Producer).remote(rank) for rank in range(PRODUCERS)]
    actors_c = [ray.remote(Consumer).remote() for _ in range(CONSUMERS)]
    ray.get([a.ready.remote() for a in actors_p + actors_c])
    spans = _thirds()
    try:
        with px.WorkerGroup(Producer, procs_per_node=PRODUCERS, backend="ray",
                            echo_output=False) as producers, \
                px.WorkerGroup(Consumer, procs_per_node=CONSUMERS, backend="ray",
                               echo_output=False) as consumers:

            def raw(round_: int) -> list[float]:
                refs = [p.make.remote(round_) for p in actors_p]
                sums = ray.get([c.consume_refs.remote(refs, mine)
                                for c, mine in zip(actors_c, spans, strict=True)])
                del refs
                return sums

            _rounds({"ray": raw, "phalanx-ray": _by_chunks(producers, consumers)}, rounds,
                    out)
    finally:
        for actor in actors_p + actors_c:
            ray.kill(actor)


def main(argv: list[str] | None = None) -> int:
    compile_sources()
    parser = argparse.ArgumentParser(prog="python -m bench.rechunk",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args(argv)
    rounds = 4 if args.quick else 10
    info = machine_info()
    results: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    notes: list[str] = []

    def attempt(where: str, fn: Callable[[], None]) -> None:
        run_reported(errors, where, fn)

    print("W13 on the local backend ...", file=sys.stderr, flush=True)
    attempt("W13 local", lambda: _local(rounds, results))
    if args.no_ray:
        notes.append("ray and phalanx-ray skipped: --no-ray")
    else:
        try:
            import ray
        except ImportError:
            notes.append("ray and phalanx-ray skipped: ray is not installed")
        else:
            print("W13 on Ray ...", file=sys.stderr, flush=True)
            ray.init(address="local", num_cpus=8, include_dashboard=False,
                     log_to_driver=False)
            try:
                attempt("W13 ray", lambda: _ray(rounds, results))
            finally:
                ray.shutdown()

    rows = [Row("W13.round_s", "W13 round, 2 x 64 MiB to 3 consumers", "s", "lower"),
            Row("W13.rss_mib", "W13 controller RSS growth", "MiB", "lower")]
    for name, rec in results.items():
        rows[0].raw[name] = rec["round_s"]
        rows[1].raw[name] = [sum(rec["rss_delta_mib"])]
    columns = [w for w in WAYS if w in results]
    width = max(len(r.label) for r in rows)
    print("W13: 2 producers x 64 MiB re-chunked to 3 consumers (median over rounds)")
    print(f"{'':<{width}}  {'unit':<5}  " + "  ".join(f"{c:>12}" for c in columns))
    for row in rows:
        cells = [row.value(c) for c in columns]
        print(f"{row.label:<{width}}  {row.unit:<5}  " + "  ".join(
            f"{'-':>12}" if v is None else f"{v:>12.3f}" for v in cells))
    medians = {name: median(rec["round_s"]) for name, rec in results.items()}
    if "chunk" in medians and "controller" in medians:
        print(f"chunk / controller: {medians['chunk'] / medians['controller']:.2f}x")
    if "phalanx-ray" in medians and "ray" in medians:
        print(f"phalanx-ray / ray: {medians['phalanx-ray'] / medians['ray']:.2f}x")
    for note in notes:
        print(f"note: {note}")
    for error in errors:
        print(f"error: {error}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": info, "rounds": rounds, "results": results, "medians_s": medians,
        "notes": notes, "errors": errors}, indent=2))
    print(f"JSON: {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
