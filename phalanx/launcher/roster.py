"""Which launchers form a multi-node ``phalanx run``, and who caused its failure (pure).

With ``--nnodes N`` (or ``MIN:MAX``) one launcher runs on each node and they meet at node
0's launcher, which keeps the :class:`Roster`: who has joined, whether an attempt can start,
which node rank each member gets, and whom a timed-out join is still waiting for.

- **static** rendezvous: every launcher says its ``--node-rank``; an attempt starts once ranks
  ``0 .. N-1`` are all there.
- **c10d** rendezvous: node ranks follow the order of joining (the hosting launcher is node
  0); an attempt starts with ``MAX`` nodes, or with ``MIN`` once the last call has passed
  since the ``MIN``-th joined.

Nothing here reads a clock or a socket: callers pass ``now``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from phalanx.launcher.report import Failure


@dataclasses.dataclass(frozen=True)
class Member:
    """One launcher that asked to join: its connection's key, the node rank it asked for
    (static only), its ranks per node, and where it is (for messages)."""

    key: int
    node_rank: int | None
    nproc: int
    where: str
    hosting: bool = False  # the launcher that also runs the host (always node 0 for c10d)


class Roster:
    """The members of a job between attempts, and the rules for starting one."""

    def __init__(self, min_nodes: int, max_nodes: int, static: bool,
                 last_call: float = 30.0) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= MIN <= MAX nodes, got {min_nodes}:{max_nodes}")
        if static and min_nodes != max_nodes:
            raise ValueError(f"a static rendezvous needs a fixed number of nodes, got "
                             f"{min_nodes}:{max_nodes} (use --rdzv-backend c10d)")
        self.min_nodes, self.max_nodes, self.static = min_nodes, max_nodes, static
        self.last_call = last_call
        self._members: dict[int, Member] = {}  # in joining order
        self._quorum_since: float | None = None  # when MIN members were first there

    def join(self, member: Member, now: float) -> str | None:
        """Admit ``member`` to the next attempt; the reason it is refused, or None."""
        if member.nproc < 1:
            return f"--nproc-per-node must be at least 1, got {member.nproc}"
        if self.static:
            rank = member.node_rank
            if rank is None or not 0 <= rank < self.max_nodes:
                return (f"--node-rank {rank} is outside 0..{self.max_nodes - 1} "
                        f"(--nnodes {self.max_nodes})")
            taken = next((m for m in self._members.values() if m.node_rank == rank), None)
            if taken is not None:
                return f"node rank {rank} has already joined (from {taken.where})"
        elif len(self._members) >= self.max_nodes:
            return f"the job already has its {self.max_nodes} nodes (--nnodes max)"
        self._members[member.key] = member
        if len(self._members) >= self.min_nodes and self._quorum_since is None:
            self._quorum_since = now
        return None

    def leave(self, key: int) -> Member | None:
        member = self._members.pop(key, None)
        if len(self._members) < self.min_nodes:
            self._quorum_since = None
        return member

    def __len__(self) -> int:
        return len(self._members)

    def members(self) -> list[Member]:
        return list(self._members.values())

    def ready(self, now: float) -> bool:
        """Whether the next attempt can start now."""
        count = len(self._members)
        if self.static:
            return count == self.max_nodes
        if count >= self.max_nodes:
            return True
        return self._quorum_since is not None and now - self._quorum_since >= self.last_call

    def next_decision(self, now: float) -> float | None:
        """Seconds until :meth:`ready` may change without anyone joining (None: only a join
        changes it)."""
        if self.static or self._quorum_since is None:
            return None
        return max(0.0, self._quorum_since + self.last_call - now)

    def assign(self) -> list[Member]:
        """The attempt's members in node-rank order."""
        members = self.members()
        if self.static:
            return sorted(members, key=_static_rank)
        return sorted(members, key=lambda m: not m.hosting)  # stable: joining order after it

    def missing(self) -> str:
        """Whom the job is still waiting for, for a timed-out join."""
        members = self.members()
        joined = ", ".join(f"node {m.node_rank} from {m.where}" if self.static else m.where
                           for m in self.assign()) or "none"
        if self.static:
            present = {m.node_rank for m in members}
            absent = [r for r in range(self.max_nodes) if r not in present]
            return (f"node rank{'s' if len(absent) > 1 else ''} "
                    f"{', '.join(map(str, absent))} never joined (joined: {joined})")
        short = self.min_nodes - len(members)
        return (f"{short} more node{'s' if short > 1 else ''} needed for the minimum of "
                f"{self.min_nodes} (joined: {joined})")


def _static_rank(member: Member) -> int:
    """The node rank a member of a static job asked for (:meth:`Roster.join` admits none
    without one)."""
    if member.node_rank is None:  # pragma: no cover - refused by join()
        raise ValueError(f"the launcher from {member.where} has no node rank")
    return member.node_rank


def layout_counts(members: Sequence[Member]) -> list[int]:
    """Ranks per node, in node-rank order."""
    return [m.nproc for m in members]


def root_cause(failures: Iterable[Failure]) -> Failure | None:
    """The failure the job is reported by: the one seen first; among failures seen at the
    same moment, a rank's own before a launcher's, then the lowest rank."""
    return min(failures, key=lambda f: (f.seen, f.rank is None, f.rank or 0), default=None)
