"""``phalanx ps``: the detached groups a controller may attach to (``px.attached``).

Without ``--hosts``: those this user's local agent keeps (the local backend's detached
groups); with ``--hosts`` (and ``--token-file`` or ``$PHALANX_TOKEN``): those of those
agents; with ``--slurm-job`` (and ``--state-dir``), those of a Slurm job's agents; with
``--ray`` (and ``--namespace``), those a Ray cluster's agents keep. One line per group:
its name, its ranks, its agents, how old it is, and who holds it (a controller's address)
or how long it has waited for one and will wait still.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DESCRIPTION = """\
List the detached groups (WorkerGroup(..., detached=True)) that a controller may take over
with px.attach(name, ...): by default those of this user's local agent; with --hosts, those
of the agents named there (their token from --token-file or $PHALANX_TOKEN); with
--slurm-job, those of that Slurm job's agents; with --ray, those of a Ray cluster.
"""


def add_parser(commands: Any) -> None:  # argparse's subparsers (a class with no public name)
    ps = commands.add_parser("ps", help="list the detached groups a controller may attach to",
                             description=DESCRIPTION)
    ps.add_argument("--hosts", metavar="H:P,...",
                    help="the agents to ask, as host:port (default: this user's local agent)")
    ps.add_argument("--token-file", metavar="FILE",
                    help="the agents' token (default: $PHALANX_TOKEN)")
    ps.add_argument("--slurm-job", metavar="JOBID",
                    help="a Slurm job's agents (px.SlurmBackend(job=JOBID))")
    ps.add_argument("--state-dir", metavar="DIR",
                    help="with --slurm-job: the state_dir its backend was given")
    ps.add_argument("--ray", metavar="ADDRESS",
                    help="a Ray cluster's detached groups ('auto', or host:port)")
    ps.add_argument("--namespace", metavar="NS",
                    help="with --ray: the backend's namespace (default: phalanx's)")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def table(groups: list[dict[str, Any]], now: float) -> str:
    """The groups as ``phalanx ps`` prints them."""
    head = ("NAME", "RANKS", "AGENTS", "AGE", "HELD BY")
    rows = []
    for group in groups:
        if group["holder"]:
            held = group["holder"]
        else:
            left = max(0.0, group["timeout"] - group["waiting_for"])
            held = f"nobody for {_age(group['waiting_for'])} ({_age(left)} left)"
        rows.append((group["name"], str(len(group["ranks"])), ",".join(group["hosts"]),
                     _age(max(0.0, now - group["since"])), held))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in [head, *rows])


def main(options: argparse.Namespace) -> int:
    import phalanx as px

    chosen = [flag for flag, given in (("--hosts", options.hosts),
                                       ("--slurm-job", options.slurm_job),
                                       ("--ray", options.ray)) if given]
    if len(chosen) > 1:
        raise SystemExit(f"phalanx ps: {' and '.join(chosen)} name two backends: give one")
    if options.state_dir and not options.slurm_job:
        raise SystemExit("phalanx ps: --state-dir goes with --slurm-job")
    if options.namespace and not options.ray:
        raise SystemExit("phalanx ps: --namespace goes with --ray")
    backend: Any = "local"
    try:
        if options.hosts:
            backend = px.ClusterBackend([h for h in options.hosts.split(",") if h],
                                        token_file=options.token_file)
        elif options.slurm_job:
            backend = px.SlurmBackend(job=options.slurm_job, state_dir=options.state_dir)
        elif options.ray:
            backend = px.RayBackend(address=options.ray, namespace=options.namespace)
        groups = px.attached(backend)
    except (px.PhalanxError, LookupError, ValueError) as exc:  # a job or cluster not there
        print(f"phalanx ps: {exc}", file=sys.stderr)
        return 1
    if not groups:
        print("no detached group")
        return 0
    print(table(groups, time.time()))
    return 0
