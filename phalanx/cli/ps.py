"""``phalanx ps``: the detached groups a controller may attach to (``px.attached``).

Without ``--hosts``: those this user's local agent keeps (the local backend's detached
groups); with ``--hosts`` (and ``--token-file`` or ``$PHALANX_TOKEN``): those of those
agents. One line per group: its name, its ranks, its agents, how old it is, and who holds
it (a controller's address) or how long it has waited for one and will wait still.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

DESCRIPTION = """\
List the detached groups (WorkerGroup(..., detached=True)) that a controller may take over
with px.attach(name, ...): by default those of this user's local agent; with --hosts, those
of the agents named there (their token from --token-file or $PHALANX_TOKEN).
"""


def add_parser(commands: Any) -> None:  # argparse's subparsers (a class with no public name)
    ps = commands.add_parser("ps", help="list the detached groups a controller may attach to",
                             description=DESCRIPTION)
    ps.add_argument("--hosts", metavar="H:P,...",
                    help="the agents to ask, as host:port (default: this user's local agent)")
    ps.add_argument("--token-file", metavar="FILE",
                    help="the agents' token (default: $PHALANX_TOKEN)")


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

    backend: Any = "local"
    if options.hosts:
        backend = px.ClusterBackend([h for h in options.hosts.split(",") if h],
                                    token_file=options.token_file)
    groups = px.attached(backend)
    if not groups:
        print("no detached group")
        return 0
    print(table(groups, time.time()))
    return 0
