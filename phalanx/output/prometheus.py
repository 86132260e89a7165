"""Prometheus' text exposition format (0.0.4), written: what the agents' and the
dashboard's ``/metrics`` serve (pure).

    out = Exposition()
    out.family("phalanx_calls_total", "counter", "Calls answered.")
    out.sample("phalanx_calls_total", {"group": "Policy"}, 12)
    out.text()
"""

from __future__ import annotations

import math
from collections.abc import Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Exposition:
    """Lines of the format, in the order written: a family's HELP and TYPE, then its
    samples."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        """Open the family ``name`` of ``kind`` (counter, gauge, histogram), described by
        ``text``."""
        self._lines.append(f"# HELP {name} {text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        """One sample of the family last opened (``name`` may carry a histogram's
        ``_bucket``, ``_sum`` or ``_count``)."""
        inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
        self._lines.append(f"{name}{{{inner}}} {number(value)}" if inner
                           else f"{name} {number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def escape(value: str) -> str:
    """A label's value, escaped as the format wants."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float) -> str:
    """A sample's value: integers without a point, infinities and NaN by their names."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))
