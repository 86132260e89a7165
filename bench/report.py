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


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    key: str  # the Row it reads
    measure: str  # "ratio": phalanx / pipe_pool; "value": phalanx's own value
    op: str  # "<=", "<", ">=", "=="
    limit: float


TARGETS = [
    Target("W2@4 fan-out latency <= 1.3x pipe_pool", "W2.noop.4", "ratio", "<=", 1.3),
    Target("W3 pipelined throughput >= 0.7x pipe_pool", "W3.pipelined", "ratio", ">=", 0.7),
    Target("W5 death detection <= 3x pipe_pool", "W5.kill", "ratio", "<=", 3.0),
    Target("W5 death detection < 200 ms", "W5.kill", "value", "<", 200.0),
    Target("W1@4 startup <= 2x pipe_pool", "W1.startup.4", "ratio", "<=", 2.0),
    Target("W6 processes left after shutdown == 0", "W6.leftover", "value", "==", 0.0),
    Target("W4 broadcast not slower than pipe_pool", "W4.seconds", "ratio", "<=", 1.0),
    Target("W7 call_sharded <= 1.2x plain call (2x2 mesh)", "W7.ratio", "value", "<=", 1.2),
    Target("W8 phalanx run not slower than torchrun", "W8.ratio", "value", "<=", 1.0),
]
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, "==": operator.eq}


def ratio(row: Row) -> float | None:
    subject, base = row.value(SUBJECT), row.value(BASE)
    if subject is None or base is None or base == 0:
        return None
    return subject / base


def evaluate(rows: Sequence[Row]) -> list[dict[str, Any]]:
    by_key = {row.key: row for row in rows}
    results = []
    for target in TARGETS:
        row = by_key.get(target.key)
        measured = None
        if row is not None:
            measured = ratio(row) if target.measure == "ratio" else row.value(SUBJECT)
        if row is None:
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
    head = ["workload", "unit", *contenders, f"{SUBJECT} / {BASE}"]
    body = []
    for row in rows:
        cells = [row.label, f"{row.unit} ({row.better} better)"]
        for name in contenders:
            value = row.value(name)
            broken = (row.key.split(".")[0], name) in failed
            cells.append("ERR" if value is None and broken else fmt(value))
        r = ratio(row)
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
    lines = []
    for t in results:
        measured = t["measured"]
        if measured is None:
            shown = "not measured"
        elif t["measure"] == "ratio":
            shown = f"measured {measured:.2f}x"
        else:
            shown = f"measured {fmt(measured)}"
        lines.append(f"  {t['verdict']:<4}  {t['name']:<44} {shown}")
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
            **({"extra": row.extra} if row.extra else {}),
        }
        for row in rows
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
