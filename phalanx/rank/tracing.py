"""When this rank ran the calls a trace asked about (``group.trace()``).

A call whose method name starts with :data:`TRACED` runs as any other; the runtime then
records, on this process's wall clock, when the rank began it (took its frame up) and when
its answer went out, and whether that answer was an error. Nothing crosses to the
controller until the trace ends: its built-in ``@trace`` call (:func:`take`) hands over
every span recorded since the last, so a traced call's answer is exactly an untraced one's.

A rank keeps at most :data:`LIMIT` spans between two takes; later ones are counted, not
kept (the trace says how many it lost).
"""

from __future__ import annotations

import os
import time

TRACED = "%"  # a call's method name starts with it: record when this rank ran it
LIMIT = 1_000_000  # spans kept between two takes

_spans: list[tuple[int, float, float, bool]] = []  # (call id, began, answered, failed)
_lost = 0
clock = time.time  # wall clock: comparable with the controller's (same machine: equal)


def record(call_id: int, began: float, answered: float, failed: bool) -> None:
    """The call ``call_id`` was begun at ``began`` and answered at ``answered``."""
    global _lost
    if len(_spans) < LIMIT:
        _spans.append((call_id, began, answered, failed))
    else:
        _lost += 1


def take() -> dict[str, object]:
    """Every span recorded since the last take, and how many were not kept (``@trace``)."""
    global _spans, _lost
    spans, lost = _spans, _lost
    _spans, _lost = [], 0
    return {"pid": os.getpid(), "spans": spans, "lost": lost, "now": clock()}
