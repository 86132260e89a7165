"""What ``phalanx run`` does after an attempt: the restart policy, as a pure function (pure).

An *attempt* starts the group (every rank of the world, on one launcher or on a job's
several) and waits until every rank's program ended or one failed. When it is over, its
:class:`AttemptStatus` goes in and :func:`decide` gives the :class:`RestartDecision`::

    a signal to a launcher (SIGINT/SIGTERM)      -> STOP     exit 128+S, never restarted
    no failure, a node joined meanwhile (c10d)   -> REFORM   start again with the new world
    no failure                                   -> DONE     exit 0
    a failure, restarts left                     -> RESTART  the next attempt
    a failure, no restart left                   -> FAIL     report the root cause

in that order of precedence. A REFORM is not a restart: it spends nothing of
``--max-restarts``, as torchrun's re-rendezvous on a new member does not. One launcher
(:mod:`.single`) decides from its own attempt; in a job of several (``--nnodes``) node
0's host (:mod:`.jobhost`) decides from every node's reports, and the launchers follow it.

Which failure the report names is :func:`phalanx.launcher.roster.root_cause`'s choice;
what the launcher exits with is :func:`phalanx.launcher.report.exit_status`'s.

Nothing here reads a clock, a socket or a process: plain values in, an enum out.
"""

from __future__ import annotations

import dataclasses
import enum

from phalanx.launcher.report import Failure


class RestartDecision(enum.Enum):
    """What follows an attempt. DONE, FAIL and STOP end the run; RESTART and REFORM start
    another attempt (RESTART numbered one higher, REFORM with the same number)."""

    DONE = "done"  # every rank's program finished: exit 0
    RESTART = "restart"  # a failure, within --max-restarts: every rank starts again
    REFORM = "reform"  # a node joined (c10d below MAX): start again as the larger world
    FAIL = "fail"  # a failure and no restart left: the root-cause report, a failing status
    STOP = "stop"  # a launcher got SIGINT/SIGTERM: the run ends, whatever else happened


@dataclasses.dataclass(frozen=True)
class AttemptStatus:
    """How one attempt ended, as the deciding launcher saw it.

    ``attempt`` is its number, from 0 (torchrun's restart count); ``max_restarts`` the
    run's budget (``--max-restarts``). ``failures`` are the ranks' and launchers' failures
    the attempt saw, each with its rank, node and status (an exit code, or 128+N for
    signal N); empty when every program finished or was stopped as asked. ``signal`` is
    the signal that stopped a launcher (this one, or in a job any of them), None if none
    did. ``joined`` says a launcher joined the job during the attempt.
    """

    attempt: int
    max_restarts: int
    failures: tuple[Failure, ...] = ()
    signal: int | None = None
    joined: bool = False

    def __post_init__(self) -> None:
        if self.attempt < 0 or self.max_restarts < 0:
            raise ValueError(f"an attempt number and a restart budget are >= 0, got "
                             f"attempt={self.attempt}, max_restarts={self.max_restarts}")

    @property
    def restarts_left(self) -> int:
        """Restarts the budget still allows after this attempt."""
        return max(0, self.max_restarts - self.attempt)


def decide(status: AttemptStatus) -> RestartDecision:
    """The launcher's next step after the attempt ``status`` describes."""
    if status.signal is not None:
        return RestartDecision.STOP
    if not status.failures:
        return RestartDecision.REFORM if status.joined else RestartDecision.DONE
    if status.restarts_left > 0:
        return RestartDecision.RESTART
    return RestartDecision.FAIL
