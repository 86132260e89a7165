"""The results table, the issue's targets (PASS/FAIL) and the JSON file."""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.util import Errors, Row

BASE, SUBJECT = "pipe_pool", "phalanx"
RAY_BASE, RAY_SUBJECT = "ray", "phalanx-ray"
RATIOS = [(SUBJECT, BASE), (RAY_SUBJECT, RAY_BASE)]  # table columns, when both were run


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    key: str  # the Row it reads
    measure: str  # "ratio": subject / base; "value": subject's own value
    op: str  # "<=", "<", ">=", "=="
    limit: float
    subject: str = SUBJECT
    base: str = BASE

    def contenders(self) -> list[str]:
        return [self.subject, self.base] if self.measure == "ratio" else [self.subject]


TARGETS = [
    Target("W2@4 fan-out latency <= 1.1x pipe_pool", "W2.noop.4", "ratio", "<=", 1.1),
    Target("W3 pipelined throughput >= 0.9x pipe_pool", "W3.pipelined", "ratio", ">=", 0.9),
    Target("W2@4 controller CPU per call <= 1.1x pipe_pool", "W2.cpu.4", "ratio", "<=", 1.1),
    Target("W3 controller CPU per call <= 1.1x pipe_pool", "W3.cpu", "ratio", "<=", 1.1),
    Target("W5 death detection <= 1.5x pipe_pool", "W5.kill", "ratio", "<=", 1.5),
    Target("W5 death detection < 200 ms", "W5.kill", "value", "<", 200.0),
    Target("W1@4 startup <= 2x pipe_pool", "W1.startup.4", "ratio", "<=", 2.0),
    Target("W1@16 startup <= 2x pipe_pool", "W1.startup.16", "ratio", "<=", 2.0),
    Target("W1@4 fresh process <= 2x pipe_pool", "W1.cold.4", "ratio", "<=", 2.0),
    Target("W1@16 fresh process <= 2x pipe_pool", "W1.cold.16", "ratio", "<=", 2.0),
    Target("W6 processes left after shutdown == 0", "W6.leftover", "value", "==", 0.0),
    Target("W4 broadcast not slower than pipe_pool", "W4.seconds", "ratio", "<=", 1.0),
    Target("W4 put: 64 MiB to 4 workers <= 0.04 s", "W4.put.seconds", "value", "<=", 0.04),
    Target("W4 put faster than Ray's object store", "W4.put.seconds", "ratio", "<", 1.0,
           SUBJECT, RAY_BASE),
    Target("W4 plain call <= 2x put", "W4.call_over_put", "value", "<=", 2.0),
    Target("W7 call_sharded <= 1.2x plain call (2x2 mesh)", "W7.ratio", "value", "<=", 1.2),
    Target("W8 phalanx run >= 3x faster than torchrun", "W8.ratio", "value", "<=", 1 / 3),
    Target("W8 two launchers not slower than two torchruns", "W8.nodes.ratio", "value", "<=",
           1.0),
    Target("W9 cluster fan-out <= 2.5x local, 2 agents x 2", "W9.noop.2x2.ratio", "value",
           "<=", 2.5),
    Target("W9 cluster fan-out <= 2.5x local, 4 agents x 2", "W9.noop.4x2.ratio", "value",
           "<=", 2.5),
    Target("W9 64 MiB broadcast: <= 65 MiB per node (2x2)", "W9.bytes.2x2", "value", "<=",
           65.0),
    Target("W9 64 MiB broadcast: <= 65 MiB per node (4x2)", "W9.bytes.4x2", "value", "<=",
           65.0),
    Target(
        "W2@4 phalanx-ray latency <= 0.1x raw ray actors",
        "W2.noop.4",
        "ratio",
        "<=",
        0.1,
        RAY_SUBJECT,
        RAY_BASE,
    ),
    Target(
        "W3 phalanx-ray throughput >= 10x raw ray actors",
        "W3.pipelined",
        "ratio",
        ">=",
        10.0,
        RAY_SUBJECT,
        RAY_BASE,
    ),
    Target(
        "W1@4 phalanx-ray startup <= 1.2x raw ray actors",
        "W1.startup.4",
        "ratio",
        "<=",
        1.2,
        RAY_SUBJECT,
        RAY_BASE,
    ),
    Target("W4 phalanx-ray broadcast (plain call) <= raw ray actors", "W4.seconds", "ratio",
           "<=", 1.0, RAY_SUBJECT, RAY_BASE),
    Target("W5 phalanx-ray death detection <= raw ray actors", "W5.kill", "ratio", "<=", 1.0,
           RAY_SUBJECT, RAY_BASE),
    Target("W1@16 phalanx-ray startup <= raw ray actors", "W1.startup.16", "ratio", "<=", 1.0,
           RAY_SUBJECT, RAY_BASE),
    Target("W5 phalanx-ray death detection <= 50 ms", "W5.kill", "value", "<=", 50.0, RAY_SUBJECT),
    # --observed: what watching calls costs (tracing off is plain "phalanx")
    Target("W2@4 traced <= 1.1x untraced", "W2.noop.4", "ratio", "<=", 1.1, "phalanx+trace",
           SUBJECT),
    Target("W2@4 under a dashboard <= 1.1x without", "W2.noop.4", "ratio", "<=", 1.1,
           "phalanx+dashboard", SUBJECT),
]
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, "==": operator.eq}


def ratio(row: Row, subject: str = SUBJECT, base: str = BASE) -> float | None:
    top, bottom = row.value(subject), row.value(base)
    if top is None or bottom is None or bottom == 0:
        return None
    return top / bottom


def evaluate(rows: Sequence[Row], contenders: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every target's verdict: SKIP where its row or (with ``contenders``, the names that
    were run) one of its contenders is missing, N/A where they ran but gave no value."""
    by_key = {row.key: row for row in rows}
    results = []
    for target in TARGETS:
        row = by_key.get(target.key)
        run = contenders is None or all(c in contenders for c in target.contenders())
        measured = None
        if row is not None and run:
            if target.measure == "ratio":
                measured = ratio(row, target.subject, target.base)
            else:
                measured = row.value(target.subject)
        if row is None or not run:
            verdict = "SKIP"
        elif measured is None:
            verdict = "N/A"
        else:
            verdict = "PASS" if _OPS[target.op](measured, target.limit) else "FAIL"
        results.append({**dataclasses.asdict(target), "measured": measured, "verdict": verdict})
    return results


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1000:
        return str(int(value))
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table(rows: Sequence[Row], contenders: Sequence[str], errors: Errors) -> str:
    failed = {(e["workload"].split("@")[0], e["contender"]) for e in errors.items}
    # phalanx / pipe_pool stays the last column; phalanx-ray / ray before it, when both ran
    pairs = [(s, b) for s, b in reversed(RATIOS) if s in contenders and b in contenders]
    pairs = pairs or [(SUBJECT, BASE)]
    head = ["workload", "unit", *contenders, *(f"{s} / {b}" for s, b in pairs)]
    body = []
    for row in rows:
        cells = [row.label, f"{row.unit} ({row.better} better)"]
        for name in contenders:
            value = row.value(name)
            broken = (row.key.split(".")[0], name) in failed
            cells.append("ERR" if value is None and broken else fmt(value))
        for s, b in pairs:
            r = ratio(row, s, b)
            cells.append("-" if r is None else f"{r:.2f}x")
        body.append(cells)
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        first = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        rest = [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(first + rest)

    rule = "-" * len(line(head))
    return "\n".join([line(head), rule, *(line(cells) for cells in body)])


def targets_text(results: Sequence[dict[str, Any]]) -> str:
    width = max((len(t["name"]) for t in results), default=0)
    lines = []
    for t in results:
        measured = t["measured"]
        if measured is None:
            shown = "not measured"
        elif t["measure"] == "ratio":
            shown = f"measured {measured:.2f}x"
        else:
            shown = f"measured {fmt(measured)}"
        lines.append(f"  {t['verdict']:<4}  {t['name']:<{width}} {shown}")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any], rows: Sequence[Row]) -> None:
    payload = dict(payload)
    payload["rows"] = [
        {
            "key": row.key,
            "label": row.label,
            "unit": row.unit,
            "better": row.better,
            "aggregate": row.agg,
            "values": {name: row.value(name) for name in row.raw},
            "raw": row.raw,
            "ratio_phalanx_over_pipe_pool": ratio(row),
            "ratio_phalanx_ray_over_ray": ratio(row, RAY_SUBJECT, RAY_BASE),
            **({"extra": row.extra} if row.extra else {}),
        }
        for row in rows
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
