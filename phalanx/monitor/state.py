"""What a dashboard's page shows, as JSON-ready data: this controller's groups (their
ranks, their recent calls, their counts) and pools, read at the moment it is asked for.

Groups shut down while the dashboard watched stay on the page, marked closed, for as long
as something else keeps them alive (the dashboard holds them weakly).
"""

from __future__ import annotations

import os
import socket
import weakref
from typing import TYPE_CHECKING, Any

from phalanx.controller.group import live_groups
from phalanx.controller.observe import clock
from phalanx.controller.pool import live_pools
from phalanx.version import __version__

if TYPE_CHECKING:
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.observe import CallWatch
    from phalanx.controller.watch import RankHealth
    from phalanx.monitor.metrics import Metrics


class Groups:
    """The groups a dashboard shows: every live one, and those it saw that were shut down
    since (while anything else still holds them)."""

    def __init__(self) -> None:
        self._seen: weakref.WeakValueDictionary[int, WorkerGroup] = weakref.WeakValueDictionary()

    def now(self) -> list[WorkerGroup]:
        for group in live_groups():
            self._seen[id(group)] = group
        return sorted(self._seen.values(), key=lambda g: g.name)

    def named(self, name: str) -> WorkerGroup | None:
        return next((g for g in self.now() if g.name == name and not g.closed), None)


def health_of(group: WorkerGroup) -> list[RankHealth]:
    return [] if group.closed else group.health()


def snapshot(groups: Groups, metrics: Metrics) -> dict[str, Any]:
    """The page's data (see ``static/app.js`` for how it is drawn)."""
    shown = []
    for group in groups.now():
        health = health_of(group)
        with metrics.lock:
            counts = metrics.of(group.name)
            recent = list(counts.recent)
            tally = {"calls": counts.total_calls, "errors": counts.errors,
                     "deaths": counts.deaths}
        tally["restarts"] = sum(h.restarts for h in health)
        shown.append({
            "name": group.name, "backend": group.backend, "world_size": group.world_size,
            "closed": group.closed,
            "ranks": [_rank(h) for h in health],
            "calls": [_call(c) for c in recent],
            "counts": tally,
        })
    pools = [{"name": p.name, "backend": p.backend, "slots": p.slots,
              "free": p.slots - len(p.placed()),
              "groups": sorted({g for names in p.placed().values() for g in names})}
             for p in live_pools()]
    return {"time": clock(), "host": socket.gethostname(), "pid": os.getpid(),
            "version": __version__, "groups": shown, "pools": pools}


def stacks(groups: Groups, name: str, timeout: float) -> dict[str, Any] | None:
    """Every live rank's stacks of group ``name`` (None: no such open group)."""
    group = groups.named(name)
    if group is None:
        return None
    report = group.stacks("ready", timeout=timeout)
    return {"group": name, "stacks": {str(rank): text for rank, text in report.items()}}


def _rank(h: RankHealth) -> dict[str, Any]:
    return {"rank": h.rank, "state": h.state, "node": h.node, "pid": h.pid,
            "calls_in_flight": h.calls_in_flight,
            "last_seen": None if h.last_seen is None else round(h.last_seen, 3),
            "restarts": h.restarts,
            "exit": None if h.state != "dead" else {"cause": h.cause, "exitcode": h.exitcode}}


def _call(c: CallWatch) -> dict[str, Any]:
    return {"id": c.call_id, "method": c.method, "queued": c.queued, "sent": c.sent,
            "ranks": c.ranks, "done": {str(r): t for r, t in list(c.answered.items())},
            "errors": {str(r): e for r, e in list(c.errors.items())},
            "bytes_in": c.bytes_in, "bytes_out": c.bytes_out}
