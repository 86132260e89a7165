"""One attempt of ``phalanx run``: start the group, run the program on every rank, wait.

:func:`run_attempt` is the one step both kinds of launcher repeat: :mod:`.single` (one
launcher for every rank) for each of its attempts, :mod:`.multinode` (one launcher per
node) for each attempt the job's host starts, with this node's :class:`JobAttempt`. An
attempt

1. starts a :class:`~phalanx.controller.group.WorkerGroup` of :class:`.ScriptRunner`
   ranks with torchrun's variables (:mod:`.elastic`) and ``TORCHELASTIC_RESTART_COUNT``
   set to the attempt's number, while the :class:`.SignalForwarder` knows a start is on;
2. calls ``run`` on every rank, and stops at the first rank whose program failed;
3. shuts the group down, and returns that :class:`~phalanx.launcher.report.Failure`, in
   the world's numbers, with what the rank's ``@record`` wrote (None: every program
   finished, or a signal or the job stopped the attempt).

What follows an attempt is the policy's decision (:mod:`.policy`), not this module's.
:class:`RunFiles` is what a run keeps across its attempts: its id and the directory the
ranks' error files go to.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from phalanx import config
from phalanx.backends import Backend, create_backend
from phalanx.controller import names
from phalanx.controller.group import WorkerGroup
from phalanx.errors import PhalanxError, StartupError, WorkerDied
from phalanx.launcher.elastic import elastic_env, error_file, read_error_file
from phalanx.launcher.options import BadOptions, RunOptions
from phalanx.launcher.program import ScriptRunner, path_in_tree
from phalanx.launcher.report import Failure, failure_from, shell_status
from phalanx.launcher.signals import SignalForwarder
from phalanx.world.frameworks import WorldPart
from phalanx.world.layout import RESTART_VARS
from phalanx.world.placement import place


@dataclasses.dataclass(frozen=True)
class JobAttempt:
    """One attempt of a job of several launchers, as its host started it for this one:
    this node's part of the world, and where rank 0 hosts torch's store."""

    part: WorldPart
    master_addr: str
    master_port: int
    attempt: int


class RunFiles:
    """What one ``phalanx run`` keeps across its attempts: the run id, and the directory the
    ranks' error files go to, as torchrun lays them out: ``<run id>/attempt_<n>/<rank>/
    error.json`` under ``--log-dir`` (kept if a rank wrote one), else in a temporary
    directory removed at the end."""

    def __init__(self, run_id: str | None, log_dir: str | None) -> None:
        import tempfile
        import uuid

        self.run_id = run_id or uuid.uuid4().hex
        if log_dir is not None:
            self.root, self._temporary = os.path.join(log_dir, self.run_id), False
        else:
            self.root, self._temporary = tempfile.mkdtemp(prefix="phalanx-run-"), True

    def attempt_dir(self, attempt: int) -> str:
        """Where attempt number ``attempt``'s ranks write their error files."""
        return os.path.join(self.root, f"attempt_{attempt}")

    def close(self) -> None:
        """Remove the error files' directory if temporary, or if no rank wrote one."""
        import shutil

        if self._temporary or not any(files for _, _, files in os.walk(self.root)):
            shutil.rmtree(self.root, ignore_errors=True)


def run_attempt(options: RunOptions, attempt: int, signals: SignalForwarder,
                files: RunFiles, job: JobAttempt | None = None) -> Failure | None:
    """Run attempt number ``attempt`` (of this node's ranks, in a ``job`` of several
    launchers); how it failed (ranks and nodes as the world numbers them), or None if it
    succeeded or a signal or the job stopped it. Raises :class:`.BadOptions` when the
    group refuses the options before anything starts."""
    failure = _run_group(options, attempt, signals, files, job)
    if failure is None:
        return None
    if job is not None and failure.rank is not None:  # the world's rank and node
        failure = dataclasses.replace(failure, rank=job.part.first_rank + failure.rank,
                                      node=job.part.node)
    failure = dataclasses.replace(failure, seen=time.time())
    return _with_error_file(failure, files.attempt_dir(attempt))


def _run_group(options: RunOptions, attempt: int, signals: SignalForwarder, files: RunFiles,
               job: JobAttempt | None) -> Failure | None:
    try:
        group = _start_group(options, attempt, signals, files, job)
    except StartupError as exc:
        return None if signals.received is not None else failure_from(exc)
    if group is None:
        return None
    failure = None
    try:
        ranks = [0] if group.single_controller else list(range(group.world_size))
        signals.watch(group, ranks)  # from here a signal is forwarded to the running ranks
        if signals.interrupted:  # it came before the group was known
            return None
        for rank_future in group.call_async("run", workers=ranks):
            signals.finished(rank_future.rank)
            failure = _rank_outcome(group, rank_future)
            if failure is not None:
                break
    except PhalanxError as exc:  # a rank died before the program was sent to it
        failure = failure_from(exc)
    finally:
        signals.unwatch()
        # a finished program's rank may still be running threads and atexit handlers
        group.shutdown(timeout=config.DEFAULT_SHUTDOWN_TIMEOUT if failure is None else 2.0)
    return failure


def _start_group(options: RunOptions, attempt: int, signals: SignalForwarder,
                 files: RunFiles, job: JobAttempt | None) -> Any:
    """The group for one attempt; None if a signal or the job stopped its start."""
    env = {name: str(attempt) for name in RESTART_VARS}
    if signals.interrupted:
        return None
    try:
        with signals.starting():
            backend = _backend(options)
            if job is None:
                layout = place(options.framework, options.nodes, options.procs_per_node,
                               options.gpus_per_worker,
                               backend.gpus_per_node(options.nodes)).layout
                mine = range(layout.world_size)
            else:
                layout = job.part.world
                mine = layout.ranks_of(job.part.node)
            if "OMP_NUM_THREADS" not in os.environ and layout.world_size > 1:  # as torchrun
                env["OMP_NUM_THREADS"] = "1"
            common, per_rank = elastic_env(
                layout, run_id=files.run_id, max_restarts=options.max_restarts,
                attempt=attempt, role=options.role, error_dir=files.attempt_dir(attempt))
            env.update(common)
            outside = sorted(r for r in options.ranks or () if r >= layout.world_size)
            if outside:
                raise ValueError(f"--ranks names ranks {outside} outside "
                                 f"0..{layout.world_size - 1}")
            shown = [r - mine.start for r in mine
                     if options.ranks is None or r in options.ranks]
            if options.local_ranks is not None:
                shown = [r - mine.start for r in mine
                         if layout.local_rank_of(r) in options.local_ranks
                         and r - mine.start in shown]
            return WorkerGroup(
                ScriptRunner,
                args=_runner_args(options),
                nodes=options.nodes if job is None else 1,
                procs_per_node=options.procs_per_node if job is None else len(mine),
                framework=options.framework,
                gpus_per_worker=options.gpus_per_worker,
                env=env,
                rank_env={r - mine.start: per_rank[r] for r in mine},
                collapse_output=options.collapse,
                log_ranks=None if len(shown) == len(mine) else shown,
                log_dir=options.log_dir,
                start_timeout=options.start_timeout,
                master_addr=options.master_addr if job is None else job.master_addr,
                master_port=options.master_port if job is None else job.master_port,
                part_of=None if job is None else WorldPart(job.part.world, job.part.node),
                backend=backend,
                name=names.name_from(_program_name(options)),
            )
    except (ValueError, TypeError) as exc:
        raise BadOptions(str(exc)) from exc


def _program_name(options: RunOptions) -> str:
    """What the run's group is called: the module, the script's or the command's name."""
    if options.is_module:
        return options.target
    return os.path.splitext(os.path.basename(options.target))[0]


def _backend(options: RunOptions) -> Backend:
    """A fresh backend for each attempt, the one ``--backend`` names, built by
    :func:`phalanx.backends.create_backend` (which imports it only when chosen: Ray is
    heavy) with what the run's options say of it."""
    return create_backend(options.backend, **_backend_settings(options))


def _backend_settings(options: RunOptions) -> dict[str, Any]:
    """The backend's constructor keywords from the run's options."""
    if options.backend == "ray":
        return {"address": options.address}
    if options.backend == "cluster":
        common = {"token_file": options.token_file, "sync": options.sync}
        if options.dns is not None:
            return {**common, "dns": options.dns,
                    "port": options.agent_port or config.AGENT_PORT,
                    "nameserver": options.nameserver, "quorum": options.nodes}
        return {**common, "hosts": list(options.hosts or ())}
    return {}


def _runner_args(options: RunOptions) -> tuple[str | None, tuple[str, ...], bool, bool, str | None]:
    """ScriptRunner's arguments: the script by its absolute path here, or, when it is
    shipped (``sync``), by its path inside the shipped tree, where each rank runs (a
    ``--no-python`` command outside the tree is left as given: found on the ranks' PATH)."""
    if options.is_module:
        return (options.target, options.args, True, options.no_python, None)
    if options.sync is not None:
        inside = path_in_tree(options.target, options.sync)
        if inside is not None or not options.no_python:
            return (inside, options.args, False, options.no_python, None)
        return (options.target, options.args, False, True, None)
    return (options.target, options.args, False, options.no_python,
            os.path.abspath(options.target))


def _with_error_file(failure: Failure, attempt_dir: str) -> Failure:
    """The failure, with what the rank's ``@record`` wrote (torch.distributed.elastic's
    error file) when the report has no traceback of its own."""
    if failure.rank is None or failure.traceback:
        return failure
    record = read_error_file(error_file(attempt_dir, failure.rank))
    if record is None:
        return failure
    message, stack = record
    return dataclasses.replace(failure, summary=f"{failure.summary}; it recorded: {message}",
                               traceback=stack)


def _rank_outcome(group: Any, rank_future: Any) -> Failure | None:
    """None when the rank's program succeeded, else how it failed."""
    error = rank_future.exception()
    if isinstance(error, WorkerDied) and error.exitcode == 0:
        return None  # os._exit(0): the program ended, successfully
    if error is not None:
        return failure_from(error)
    status = rank_future.result()
    if status == 0:
        return None
    health = group.health()[rank_future.rank]
    return Failure(health.rank, health.node, health.pid, shell_status(status),
                   f"exited with code {status}")
