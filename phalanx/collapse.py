"""Collapsing identical output lines from several ranks into one: pure logic, no I/O.

Ranks running the same code print the same lines at about the same time. A line is held for
a short ``window``; the same text arriving from other ranks meanwhile joins it, and it comes
out once, prefixed with every rank that wrote it (``[ranks 0-3] epoch 1``). Lines come out in
the order they were first written, so each rank's own lines keep their order; a line that
every rank of the group has written leaves at once instead of waiting out its window.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0,2,5-7``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    parts = []
    start = previous = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return "ranks " + ",".join(parts)


@dataclasses.dataclass
class Line:
    """One line to show: its text, whether it went to stderr, and who wrote it."""

    text: str
    stderr: bool
    ranks: list[int]
    deadline: float
    seq: int

    @property
    def prefix(self) -> str:
        return f"[{format_ranks(self.ranks)}]"


class LineCollapser:
    """Holds lines for ``window`` seconds so that identical ones from other ranks can join.

    ``add`` and ``due`` return the lines ready to show, in order; ``next_deadline`` says
    when to call ``due`` again. ``world`` is how many ranks may write (a line all of them
    wrote is complete). With ``window == 0`` nothing is held.
    """

    def __init__(self, window: float, world: int) -> None:
        self.window = window
        self.world = world
        self._queue: collections.deque[Line] = collections.deque()
        self._by_text: dict[tuple[str, bool], list[Line]] = {}
        self._last_seq: dict[int, int] = {}  # per rank: the latest line it joined
        self._seq = 0

    def add(self, rank: int, text: str, stderr: bool, now: float) -> list[Line]:
        if self.window <= 0:
            self._seq += 1
            return [Line(text, stderr, [rank], now, self._seq)]
        key = (text, stderr)
        after = self._last_seq.get(rank, 0)
        # Join the oldest held copy of this text that this rank has not joined yet and that
        # comes after the rank's previous line (so its lines keep their order).
        for line in self._by_text.get(key, ()):
            if line.seq > after and rank not in line.ranks:
                line.ranks.append(rank)
                self._last_seq[rank] = line.seq
                return self._release(now)
        self._seq += 1
        line = Line(text, stderr, [rank], now + self.window, self._seq)
        self._queue.append(line)
        self._by_text.setdefault(key, []).append(line)
        self._last_seq[rank] = line.seq
        return self._release(now)

    def due(self, now: float) -> list[Line]:
        return self._release(now)

    def flush(self) -> list[Line]:
        """Everything still held (at the end of output)."""
        return self._release(float("inf"))

    def next_deadline(self) -> float | None:
        return self._queue[0].deadline if self._queue else None

    def _release(self, now: float) -> list[Line]:
        out = []
        queue = self._queue
        while queue and (queue[0].deadline <= now or len(queue[0].ranks) >= self.world):
            line = queue.popleft()
            held = self._by_text[(line.text, line.stderr)]
            held.remove(line)
            if not held:
                del self._by_text[(line.text, line.stderr)]
            line.ranks.sort()
            out.append(line)
        return out
