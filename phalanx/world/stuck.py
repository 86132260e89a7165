"""Which collectives a group's ranks wait in, and who they wait for: pure logic.

Each rank reports the collectives its threads are inside (:mod:`phalanx.rank.collectives`):
the process group's name, the collective's sequence number on that group, the operation,
a signature of its arguments, the members (global ranks), when it entered, and its own
global rank. :func:`gather` puts the reports of ranks in the *same* collective (same
process group, same sequence number) together as one :class:`Waiting`, and names

- ``absent``: the members that are not in it (they never entered it, are in another one,
  or are gone) -- the ones the others wait for;
- ``odd``: ranks in it whose operation or signature differs from the most common one
  (another collective at the same number, a mismatched shape or dtype: it cannot complete
  either).

Global ranks are mapped to the group's ranks by the offset the reports show (a group that
is one part of a bigger world starts at its first rank); members outside the group are
not judged. Deciding *when* a collective is stuck, and what to do, is the controller's
(:mod:`phalanx.controller.collectivewatch`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Inside:
    """One rank inside one collective, as it reported it."""

    rank: int  # the group's rank
    group: str  # the process group's name
    seq: int  # the collective's number on that process group
    op: str
    members: tuple[int, ...]  # global ranks
    signature: str
    entered: float  # wall clock, the rank's
    me: int  # the rank's global rank

    @property
    def call(self) -> str:
        """The operation and its signature: what every member must enter alike."""
        return f"{self.op} {self.signature}".rstrip()

    @classmethod
    def parse(cls, rank: int, fields: Sequence[Any]) -> Inside:
        """From the plain fields a rank sent (``ValueError`` when they are not that)."""
        if not isinstance(fields, (list, tuple)):
            raise ValueError(f"{type(fields).__name__}, not a list of fields")
        if len(fields) != 7:
            raise ValueError(f"{len(fields)} fields, not 7")
        group, seq, op, members, signature, entered, me = fields
        if not (isinstance(group, str) and _integer(seq) and isinstance(op, str)
                and isinstance(members, list) and all(_integer(m) for m in members)
                and isinstance(signature, str) and isinstance(entered, (int, float))
                and not isinstance(entered, bool) and _integer(me)):
            raise ValueError("a field of the wrong type")
        return cls(rank, group, seq, op, tuple(members), signature, float(entered), me)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Waiting:
    """Ranks of a group inside the same collective, and who is missing from it."""

    group: str
    seq: int
    op: str
    inside: dict[int, Inside]  # the group's rank -> its report
    members: tuple[int, ...]  # the group's ranks that belong to it
    absent: tuple[int, ...]  # members not in it
    odd: dict[int, str]  # ranks in it with another operation or signature -> theirs
    common: str  # the most common operation and signature

    @property
    def key(self) -> tuple[str, int]:
        return self.group, self.seq

    @property
    def since(self) -> float:
        """When the first rank entered it (the ranks' wall clock)."""
        return min(report.entered for report in self.inside.values())

    @property
    def complete(self) -> bool:
        """Every member is in it, with one signature: nothing to wait for but the work."""
        return not self.absent and not self.odd


def offset_of(reports: Iterable[Inside]) -> int:
    """Global rank minus the group's rank, as most reports show it (0 when none do)."""
    seen = collections.Counter(report.me - report.rank for report in reports)
    return seen.most_common(1)[0][0] if seen else 0


def gather(reports: Iterable[Inside], world_size: int) -> list[Waiting]:
    """The collectives that ``reports`` (every rank's, of a group of ``world_size``) are
    in, each with its absent and odd members; in the order of their keys."""
    reports = list(reports)
    offset = offset_of(reports)
    by_key: dict[tuple[str, int], dict[int, Inside]] = {}
    for report in reports:
        by_key.setdefault((report.group, report.seq), {})[report.rank] = report
    out = []
    for (group, seq), inside in sorted(by_key.items()):
        first = next(iter(inside.values()))
        members = tuple(sorted({m - offset for m in first.members
                                if 0 <= m - offset < world_size}))
        absent = tuple(r for r in members if r not in inside)
        signatures = collections.Counter(report.call for report in inside.values())
        # the most common call is taken as the right one (a tie: the greater, so that
        # every rank's report names the same odd ones)
        common = max(signatures, key=lambda s: (signatures[s], s))
        odd = {rank: report.call for rank, report in inside.items() if report.call != common}
        op = next(r.op for r in inside.values() if r.call == common)
        out.append(Waiting(group, seq, op, inside, members, absent, odd, common))
    return out


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 3]`` -> "0, 1, 3"; a long run -> "0-7"."""
    ranks = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return ", ".join(parts)
