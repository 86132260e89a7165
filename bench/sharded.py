"""W7: the dispatch overhead of ``call_sharded`` on a 2x2 mesh, next to a plain ``call``.

phalanx only (neither the pipe pool nor plain Ray actors have named sharding). Both calls
reach the same four ranks: the plain call sends one payload to all of them; the sharded
one sends each data-parallel pair its own slice (pickled once per slice, replicated along
tp) and keeps one result per dp shard. Batches of each alternate; medians are compared.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from statistics import median

from bench.contenders import Contender
from bench.util import Errors, Row, settle

MESH = {"dp": 2, "tp": 2}


def w7_sharded(contenders: Sequence[Contender], plan: object, errors: Errors) -> list[Row]:
    if not any(c.name == "phalanx" for c in contenders):
        return []
    quick = getattr(plan, "quick", False)
    batches, calls = (5, 200) if quick else (9, 400)
    plain = Row("W7.call", "W7 plain call, 4 ranks (2x2 mesh)", "us/call", "lower")
    sharded = Row("W7.sharded", "W7 call_sharded, 2x2 mesh (dp shards, tp replicas)",
                  "us/call", "lower")
    ratio = Row("W7.ratio", "W7 call_sharded / plain call", "x", "lower")
    errors.attempt("W7", "phalanx", lambda: _measure(batches, calls, plain, sharded))
    if plain.raw.get("phalanx") and sharded.raw.get("phalanx"):
        ratio.add("phalanx", median(sharded.raw["phalanx"]) / median(plain.raw["phalanx"]))
    return [plain, sharded, ratio]


def _measure(batches: int, calls: int, plain: Row, sharded: Row) -> None:
    from bench.workloads import Bench
    from phalanx import WorkerGroup

    item, shards = b"x" * 64, [b"a" * 64, b"b" * 64]

    def run_plain() -> None:
        group.call("take", data=item)

    def run_sharded() -> None:
        group.call_sharded(
            "take", data=shards, in_sharded_axes=["dp"], replicate_on_axes=["tp"],
            output_is_replicated=["tp"],
        ).result()

    with WorkerGroup(Bench, procs_per_node=4, mesh=MESH, echo_output=False) as group:
        for _ in range(100):
            run_plain()
            run_sharded()
        for batch in range(batches):
            order = [(plain, run_plain), (sharded, run_sharded)]
            for row, fn in order if batch % 2 == 0 else order[::-1]:
                settle()
                started = time.perf_counter()
                for _ in range(calls):
                    fn()
                row.add("phalanx", (time.perf_counter() - started) / calls * 1e6)
