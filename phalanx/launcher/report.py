"""What ``phalanx run`` says when a run fails: the root-cause failure, the report, the exit
status (pure).

The launcher exits as torchrun does: 0 when every rank finished, 1 when one failed, however
it failed (``--exit-code rank`` gives the first failing rank's own status instead: its
``sys.exit`` code, or 128+S for signal S). The report names the rank, its node and pid, how
it failed and its traceback either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.errors import (
    MembershipChanged,
    StartupError,
    WorkerDied,
    WorkerError,
    likely_cause,
)

FAILED = 1  # exit status for a failure without a code of its own (an exception)
EXIT_CODES = ("torchrun", "rank")  # what --exit-code may say


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first rank that failed, and how. ``status`` is the rank's own, as a shell gives
    it; ``seen`` the wall-clock time its launcher learnt of it (launchers on several nodes
    agree on the root cause by it)."""

    rank: int | None
    node: int | None
    pid: int | None
    status: int
    summary: str
    traceback: str | None = None
    stderr_tail: tuple[str, ...] = ()
    seen: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for the launchers' JSON messages."""
        data = dataclasses.asdict(self)
        data["stderr_tail"] = list(self.stderr_tail)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Failure:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"a failure record has unknown fields {sorted(unknown)}")
        return cls(**{**data, "stderr_tail": tuple(data.get("stderr_tail", ()))})


def signal_status(exitcode: int) -> int:
    """A process exit code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def shell_status(code: int) -> int:
    """The status the launcher exits with for a rank's ``sys.exit(code)``: what the OS would
    make of it (``-1`` -> 255), except that a failing code never becomes 0 (``256`` -> 1)."""
    if code == 0:
        return 0
    return code & 0xFF or FAILED


def failure_from(exc: BaseException) -> Failure:
    if isinstance(exc, WorkerError):
        message = getattr(exc, "message", "")
        summary = f"raised {exc.exc_type}" + (f": {message}" if message else "") + (
            f" while {exc.stage}" if exc.stage != "running the method" else ""
        )
        return Failure(exc.rank, exc.node, exc.pid, FAILED, summary, exc.traceback)
    if isinstance(exc, WorkerDied):
        status = FAILED if exc.exitcode is None else signal_status(exc.exitcode)
        return Failure(exc.rank, exc.node, exc.pid, status, likely_cause(exc.exitcode),
                       None, exc.stderr_tail)
    if isinstance(exc, MembershipChanged) and exc.removed:  # a node (agent) was lost
        node = exc.removed[0]
        return Failure(node.ranks[0] if node.ranks else None, node.node, None, FAILED,
                       f"its node left the group (the agent at {node.host}): "
                       f"{exc.reason or 'lost'}")
    if isinstance(exc, StartupError):
        first_line = str(exc).split("\n", 1)[0]  # the traceback follows in the report
        return Failure(exc.rank, None, None, FAILED, f"could not start: {first_line}",
                       exc.traceback)
    return Failure(None, None, None, FAILED, f"{type(exc).__name__}: {exc}")


def exit_status(failure: Failure, exit_code: str = "torchrun") -> int:
    """The launcher's exit status after ``failure``: torchrun's 1, or with ``exit_code=
    "rank"`` the rank's own status."""
    if exit_code not in EXIT_CODES:
        raise ValueError(f"exit_code must be one of {', '.join(EXIT_CODES)}, got {exit_code!r}")
    return failure.status if exit_code == "rank" else FAILED


def format_report(failure: Failure, attempts: int = 1, status: int | None = None,
                  whole: str = "the group") -> str:
    """The root-cause report printed when a run fails; ``status`` is the launcher's exit
    status (default: the rank's own); ``whole`` names what failed when no rank or node did."""
    rule = "=" * 72
    if failure.rank is None:
        who = whole if failure.node is None else f"node {failure.node}"
    else:
        where = ", ".join(
            part for part in (
                None if failure.node is None else f"node {failure.node}",
                None if failure.pid is None else f"pid {failure.pid}",
            ) if part
        )
        who = f"rank {failure.rank}" + (f" ({where})" if where else "")
    lines = [rule, "phalanx run failed" + (f" after {attempts} attempts" if attempts > 1 else ""),
             f"root cause: {who} {failure.summary}",
             f"exit status: {failure.status if status is None else status}"]
    if failure.traceback:
        lines += ["", failure.traceback.rstrip()]
    if failure.stderr_tail:
        lines += ["", "last lines of its stderr:", *("  " + line for line in failure.stderr_tail)]
    lines.append(rule)
    return "\n".join(lines)
