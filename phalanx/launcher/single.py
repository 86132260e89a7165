"""``phalanx run`` with one launcher: this process drives every rank of the world.

The ranks may be local processes, a Ray cluster's actors or phalanx agents' processes on
other machines (``--backend``); what makes this the single launcher is that no other
launcher takes part (for one launcher per node, ``--nnodes N``, see :mod:`.multinode`).

The launcher runs attempts (:func:`~phalanx.launcher.attempt.run_attempt`) and after each
asks the restart policy (:mod:`.policy`) what follows:

- DONE: every rank finished; exit 0;
- RESTART: a rank failed within ``--max-restarts``; a one-line notice, and the whole group
  starts again (``TORCHELASTIC_RESTART_COUNT`` one higher);
- FAIL: a rank failed with no restart left; a root-cause report (the first failing rank,
  its exit code or signal, its Python traceback) and exit as torchrun does, with 1 (or
  that rank's own status, see :mod:`phalanx.launcher.report`);
- STOP: the launcher got SIGINT/SIGTERM, which it forwarded to every rank (SIGKILL after
  a grace period, :mod:`.signals`); exit 128+S.
"""

from __future__ import annotations

import contextlib
import signal

from phalanx.launcher.attempt import RunFiles, run_attempt
from phalanx.launcher.options import RunOptions
from phalanx.launcher.policy import AttemptStatus, RestartDecision, decide
from phalanx.launcher.report import exit_status, format_report
from phalanx.launcher.signals import SignalForwarder
from phalanx.output import console


def run_single(options: RunOptions) -> int:
    """Run the program on every rank from this launcher alone; the exit status."""
    files = RunFiles(options.run_id, options.log_dir)
    with SignalForwarder(options.grace) as signals, contextlib.closing(files):
        attempt = 0
        while True:
            failure = run_attempt(options, attempt, signals, files)
            status = AttemptStatus(attempt, options.max_restarts,
                                   failures=() if failure is None else (failure,),
                                   signal=signals.received)
            decision = decide(status)
            # STOP comes with the signal that stopped the launcher (decide() says so)
            if decision is RestartDecision.STOP and status.signal is not None:
                name = signal.Signals(status.signal).name
                console.notice(f"phalanx run: stopped by {name}")
                return 128 + status.signal
            if failure is None:  # DONE (REFORM needs a job of several launchers)
                return 0
            if decision is RestartDecision.RESTART:
                who = "the group" if failure.rank is None else f"rank {failure.rank}"
                console.notice(
                    f"phalanx run: {who} {failure.summary} (exit status {failure.status}); "
                    f"restarting the group (restart {attempt + 1} of {options.max_restarts})"
                )
                attempt += 1
                continue
            code = exit_status(failure, options.exit_code)  # FAIL
            console.notice(format_report(failure, attempt + 1, code))
            return code
