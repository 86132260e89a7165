"""px.SlurmBackend on a real Slurm: from ``SlurmBackend(nodes=2)`` to 4 ranks ready, and
from ``scancel`` to the failed call.

    python -m bench.slurm [--json PATH] [--repeat N]

Starts the test suite's Slurm (tests/slurmcluster.py: a slurmctld and two slurmds on this
machine, nodes at 127.0.0.2 and 127.0.0.3), then N times: a 2-node x 2-rank group on a
fresh ``SlurmBackend(nodes=2)``, timed until its constructor returns (every rank has
started and answered READY), in parts -- ``submit`` (sbatch's answer), ``queue`` (until
Slurm runs the job: its scheduler's own pass), ``srun_agents`` (srun starting one agent per
node until both publish their address), ``ranks`` (connecting to the agents and starting
the 4 ranks); then a call of 60 s is made, the job scancelled, and the time until the
call raises measured. Prints a table (medians) and writes JSON (default
bench/results/slurm.json). About a minute. Needs Slurm's packages (scripts/setup-slurm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class Sleeper:
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def job(self) -> str:
        return os.environ["SLURM_JOB_ID"]


def once() -> dict[str, float]:
    import phalanx as px

    began = time.monotonic()
    group = px.WorkerGroup(Sleeper, nodes=2, procs_per_node=2,
                           backend=px.SlurmBackend(nodes=2, node_timeout=5))
    ready = time.monotonic() - began
    try:
        timings = dict(group._backend.job.timings)
        job = group.call("job", timeout=60)[0]
        pending = group.call_async("sleep", 60)
        cancelled = time.monotonic()
        subprocess.run(["scancel", job], check=True, timeout=30)
        try:
            pending.result(timeout=60)
            failed = float("nan")
        except px.PhalanxError:
            failed = time.monotonic() - cancelled
    finally:
        group.shutdown()
    return {"ready_total": ready, "submit": timings["submit"],
            "queue": timings["queued"] - timings["submit"], "srun_agents": timings["agents"],
            "ranks": ready - timings["queued"] - timings["agents"],
            "scancel_to_failed_call": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "slurm.json")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from tests import slurmcluster

    reason = slurmcluster.available()
    if reason is not None:
        print(f"bench.slurm: no Slurm here: {reason}", file=sys.stderr)
        return 1
    cluster = slurmcluster.start()
    os.environ.update(cluster.env)
    runs = []
    try:
        for _ in range(args.repeat):
            runs.append(once())
            time.sleep(1.0)  # the nodes idle again before the next job
    finally:
        slurmcluster.stop(cluster)
    keys = list(runs[0])
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"{'SlurmBackend(nodes=2), 2x2 ranks':<36} {'median s':>9}  runs")
    for key in keys:
        print(f"  {key:<34} {medians[key]:>9.3f}  "
              + " ".join(f"{r[key]:.3f}" for r in runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "slurm", "median": medians, "runs": runs},
                                    indent=2) + "\n")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
