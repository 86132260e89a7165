"""The launcher's boundary: what a front end calls to ``phalanx run`` a program.

:func:`run` takes the frozen :class:`RunOptions` and returns the exit status; it picks the
kind of launcher once, here, above both, so neither imports the other:

- one launcher for every rank (:mod:`.single`), when ``RunOptions.job`` is None;
- one launcher per node of a job (:mod:`.multinode`), with ``RunOptions.job``
  (:class:`JobOptions`: torchrun's ``--nnodes``/rendezvous flags).

Both repeat :func:`~phalanx.launcher.attempt.run_attempt` under a
:class:`~phalanx.launcher.signals.SignalForwarder` and decide what follows each attempt by
:func:`~phalanx.launcher.policy.decide`. :class:`BadOptions` (a ``ValueError``) means the
group refused the options before anything started.
"""

from __future__ import annotations

from phalanx.launcher.multinode import run_node
from phalanx.launcher.options import BadOptions, JobOptions, RunOptions
from phalanx.launcher.program import path_in_tree
from phalanx.launcher.single import run_single

__all__ = ["BadOptions", "JobOptions", "RunOptions", "path_in_tree", "run"]


def run(options: RunOptions) -> int:
    """Run the program on every rank (of this node, in a job of several launchers); the
    status the launcher exits with."""
    if options.job is not None:
        return run_node(options)
    return run_single(options)
