"""Collapsing identical output lines from several ranks into one: pure logic, no I/O.

Ranks running the same code print the same lines at about the same time. A line is held for
a short ``window``; the same text arriving from other ranks meanwhile joins it, and it comes
out once, prefixed with every rank that wrote it (``[ranks 0-3] epoch 1``). Lines come out in
the order they were first written, so each rank's own lines keep their order; a line that
every rank of the group has written leaves at once instead of waiting out its window.

One collapser serves one group: lines of two groups never join, whatever their text. While
several groups run, the prefix says the group too (:func:`line_prefix`: ``[Policy ranks 0-3]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

MAX_HELD = 64  # lines held at most; a faster burst is shown sooner (bounds the work per line)


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


def line_prefix(ranks: Iterable[int], group: str | None = None) -> str:
    """What a line shown for ``ranks`` starts with: ``[rank 3]``, ``[ranks 0-3]``; with the
    name of the group, for when several run: ``[Policy rank 3]``, ``[Policy ranks 0-3]``.
    (A group's name holds no space or bracket: the first word is always the group.)"""
    if group is None:
        return f"[{format_ranks(ranks)}]"
    return f"[{group} {format_ranks(ranks)}]"


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
        """``[ranks 0-3]``; the log pump adds the group's name while several run."""
        return line_prefix(self.ranks)


class LineCollapser:
    """Holds lines for ``window`` seconds so that identical ones from other ranks can join.

    ``add`` and ``due`` return the lines ready to show, in order; ``next_deadline`` says
    when to call ``due`` again. ``world`` is how many ranks may write (a line all of them
    wrote is complete). With ``window == 0`` nothing is held; at most ``MAX_HELD`` lines
    are, the oldest leaving early during a burst.

    Order: held lines leave in queue order. A rank joining a held line must not see it
    shown before its own earlier lines, so the line moves behind the rank's latest held
    line -- allowed only if no rank already in it has a line in between (whose order that
    move would break); otherwise the rank starts a new line.
    """

    def __init__(self, window: float, world: int) -> None:
        self.window = window
        self.world = world
        self._queue: list[Line] = []
        self._seq = 0

    def add(self, rank: int, text: str, stderr: bool, now: float) -> list[Line]:
        self._seq += 1
        if self.window <= 0:
            return [Line(text, stderr, [rank], now, self._seq)]
        queue = self._queue
        last = max((i for i, line in enumerate(queue) if rank in line.ranks), default=-1)
        for i, line in enumerate(queue):
            if line.text != text or line.stderr != stderr or rank in line.ranks:
                continue
            if i > last:  # after the rank's own held lines already
                line.ranks.append(rank)
                return self._release(now)
            members = set(line.ranks)
            if any(members.intersection(queue[k].ranks) for k in range(i + 1, last + 1)):
                continue  # moving it would reorder another rank's lines
            del queue[i]
            queue.insert(last, line)  # right behind the rank's latest line
            line.ranks.append(rank)
            return self._release(now)
        queue.append(Line(text, stderr, [rank], now + self.window, self._seq))
        return self._release(now)

    def due(self, now: float) -> list[Line]:
        return self._release(now)

    def flush(self) -> list[Line]:
        """Everything still held (at the end of output)."""
        return self._release(float("inf"))

    def next_deadline(self) -> float | None:
        return min((line.deadline for line in self._queue), default=None)

    def _release(self, now: float) -> list[Line]:
        queue = self._queue
        n = 0
        excess = len(queue) - MAX_HELD
        while n < len(queue) and (
            n < excess or queue[n].deadline <= now or len(queue[n].ranks) >= self.world
        ):
            n += 1
        out, self._queue = queue[:n], queue[n:]
        for line in out:
            line.ranks.sort()
        return out
