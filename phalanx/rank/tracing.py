"""When this rank ran the calls a trace asked about (``group.trace()``).

A call with the ``TRACED`` flag (:mod:`phalanx.wire.protocol`) runs as any other; the runtime then
records, on this process's wall clock, when the rank began it (took its frame up) and when
its answer went out, and whether that answer was an error. Nothing crosses to the
controller until the trace ends: its built-in ``@trace`` call (:func:`take`) hands over
the spans of its calls, keeping those another trace still open needs, so a traced call's
answer is exactly an untraced one's.

A rank keeps at most :data:`LIMIT` spans between two takes; later ones are counted, not
kept (the trace says how many it lost).
"""

from __future__ import annotations

import os
import time

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


def take(since: int = 0, keep_from: int | None = None) -> dict[str, object]:
    """The spans of calls ``since`` on (by call id), and how many were not kept (the
    built-in ``@trace``); spans of calls before ``keep_from`` are forgotten (None: all),
    the rest stay for another trace still open."""
    global _spans, _lost
    spans, lost = _spans, _lost
    _spans = [] if keep_from is None else [s for s in spans if s[0] >= keep_from]
    _lost = 0
    return {"pid": os.getpid(), "spans": [s for s in spans if s[0] >= since], "lost": lost,
            "now": clock()}
