"""``phalanx run``: run a script (or ``-m module``) on every rank, torchrun-style.

Each rank's worker runs the script as ``__main__`` with the framework's environment set.
The launcher waits for every rank, stops the whole group at the first failure, prints a
root-cause report (the first failing rank, its exit code or signal, its Python traceback)
and exits as torchrun does, with 1 (or that rank's own status, see
:mod:`phalanx.launcher.report`). SIGINT and SIGTERM are forwarded to every rank, followed
by SIGKILL after a grace period. ``max_restarts`` restarts the whole group after a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from phalanx import config
from phalanx.errors import PhalanxError, StartupError, WorkerDied
from phalanx.launcher.elastic import elastic_env, error_file, read_error_file
from phalanx.launcher.report import (
    FAILED,
    Failure,
    exit_status,
    failure_from,
    format_report,
    shell_status,
    signal_status,
)
from phalanx.output import console
from phalanx.world.layout import RESTART_VARS

if TYPE_CHECKING:
    from phalanx.launcher.multinode import JobRound

logger = logging.getLogger(__name__)

class ScriptRunner:
    """The worker object of ``phalanx run``: runs the user's program as ``__main__``."""

    def __init__(self, target: str, args: Sequence[str], is_module: bool,
                 no_python: bool = False, path: str | None = None) -> None:
        self.target = target
        self.args = list(args)
        self.is_module = is_module
        self.no_python = no_python
        # the script's absolute path as the launcher found it: a rank on another node (Ray)
        # does not start in the launcher's directory
        self.path = path

    def run(self) -> int:
        """Run the program; its exit status (``sys.exit(n)`` gives ``n``; an exception
        propagates to the controller with its traceback)."""
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torch's @record writes there, and makes no directories
            os.makedirs(os.path.dirname(error_file), exist_ok=True)
        if self.no_python:
            return self._run_command()
        import runpy

        from phalanx.rank.runtime import exit_code_of  # the rank's own process: already imported

        if self.is_module:
            sys.argv = [self.target, *self.args]  # runpy sets argv[0] to the module's file
            sys.path.insert(0, os.getcwd())
        else:
            path = self.path or os.path.abspath(self.target)
            sys.argv = [self.target, *self.args]
            sys.path.insert(0, os.path.dirname(path))
        try:
            if self.is_module:
                runpy.run_module(self.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(path, run_name="__main__")
            status = 0
        except SystemExit as exc:
            status = exit_code_of(exc.code)
        _join_program_threads()  # as the interpreter would before exiting
        sys.stdout.flush()
        sys.stderr.flush()
        return status


    def _run_command(self) -> int:
        """``--no-python``: the target is a command (a shell script, a binary) run as this
        rank's child, in its process group, so forwarded signals reach it; its status as
        a shell gives it (128 + N when signal N ended it)."""
        import subprocess

        sys.stdout.flush()
        sys.stderr.flush()
        code = subprocess.run([self.target, *self.args], check=False).returncode
        return signal_status(code)


def _join_program_threads() -> None:
    """Wait for the non-daemon threads the program started (phalanx's own are daemons), as
    the interpreter does at exit: first its thread-exit hooks, which tell idle
    ``concurrent.futures`` pool threads to finish, then a join of what still runs."""
    for hook in list(getattr(threading, "_threading_atexits", ())):
        try:
            hook()
        except Exception:
            logger.exception("a thread-exit hook failed")
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()


@dataclasses.dataclass(frozen=True)
class RunOptions:
    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False
    nodes: int = 1
    procs_per_node: int | str = 1
    framework: str | None = None
    gpus_per_worker: int = 0
    max_restarts: int = 0
    log_dir: str | None = None
    ranks: tuple[int, ...] | None = None  # shown ranks
    local_ranks: tuple[int, ...] | None = None  # shown local ranks (torchrun's filter)
    collapse: bool = True
    grace: float = 10.0  # seconds between forwarding SIGINT/SIGTERM and SIGKILL
    start_timeout: float | None = None
    role: str = "default"  # torchrun's --role: ROLE_NAME
    run_id: str | None = None  # TORCHELASTIC_RUN_ID (None: a fresh one)
    no_python: bool = False  # the target is a command, not a Python program
    master_addr: str | None = None  # torchrun's --master-addr / --master-port (None: chosen)
    master_port: int | None = None
    backend: str = "local"  # or "ray": every rank of a Ray cluster, from this terminal
    address: str | None = None  # the Ray cluster's (None: RAY_ADDRESS, or a local Ray)
    exit_code: str = "torchrun"  # or "rank": exit with the failing rank's own status
    hosts: tuple[str, ...] | None = None  # the cluster backend's agents
    token_file: str | None = None  # their token (None: $PHALANX_TOKEN)
    sync: str | None = None  # the directory shipped to the agents (the script is in it)
    dns: str | None = None  # the agents behind a DNS name (instead of hosts)
    agent_port: int | None = None
    nameserver: str | None = None
    job: Any = None  # a multinode.JobOptions: one launcher per node (None: this one only)


class BadOptions(ValueError):
    """The group refused the launcher's options before anything started."""


class _Signals:
    """Forwards SIGINT/SIGTERM to the ranks still running the program; SIGKILL to every rank
    after ``grace`` seconds, or at once on a second signal. A signal while a group starts
    interrupts the start (which stops what it had started).

    The handler runs on the main thread between any two bytecodes, so it never raises: it
    reads the group's rank table, sends signals, and writes its notice straight to file
    descriptor 2 (the console lock may be held by the output thread). During a start, when
    there is no group yet, it kills the worker processes this process started: the start
    then fails as it does when a worker dies, stopping everything it started.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.received: int | None = None
        self.group: Any = None
        self.running: set[int] = set()  # ranks whose program has not finished
        self.starting = False
        self.stopped = False  # told to stop by the job (another node failed)
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, frame: object) -> None:
        first = self.received is None
        self.received = self.received or signum
        self._forward(signum, first, f"got {signal.Signals(signum).name}, forwarded it to "
                                     "the running ranks")

    def stop(self, why: str) -> None:
        """Another node's failure ends this attempt: stop this node's ranks as a first
        SIGTERM would (callable from any thread)."""
        first = not self.stopped
        self.stopped = True
        self._forward(signal.SIGTERM, first, f"{why}; sent SIGTERM to this node's ranks")

    def _forward(self, signum: int, first: bool, notice: str) -> None:
        if self.starting:
            _kill_children()  # the start sees its workers die and stops what it started
            return
        group = self.group
        if group is None:
            return
        if not first:
            self._kill(group)
            return
        try:
            group.send_signal(signum, workers=sorted(self.running))
        except PhalanxError:
            return
        _say(f"phalanx run: {notice} (SIGKILL in {self.grace:g} s)")
        self._timer = threading.Timer(self.grace, self._kill, args=(group,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _kill(group: Any) -> None:
        try:
            group.send_signal(signal.SIGKILL, workers="ready")
        except PhalanxError:
            pass


def _kill_children() -> None:
    """SIGKILL this process's phalanx workers (and their process groups): children of the
    node supervisor's keepers, on the local backend."""
    import psutil

    from phalanx.node.spawn import is_worker_command

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            if not is_worker_command(child.cmdline()):
                continue
        except psutil.Error:
            continue
        try:
            os.killpg(child.pid, signal.SIGKILL)  # each worker leads its own process group
        except OSError:
            try:
                child.kill()
            except psutil.Error:
                pass


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def _backend(options: RunOptions) -> Any:
    if options.backend == "ray":
        from phalanx.backends.ray.backend import RayBackend

        return RayBackend(address=options.address)
    if options.backend == "cluster":
        from phalanx.backends.cluster.backend import ClusterBackend

        if options.dns is not None:
            return ClusterBackend(dns=options.dns, port=options.agent_port or config.AGENT_PORT,
                                  nameserver=options.nameserver, quorum=options.nodes,
                                  token_file=options.token_file, sync=options.sync)
        return ClusterBackend(list(options.hosts or ()), token_file=options.token_file,
                              sync=options.sync)
    from phalanx.backends.local import LocalBackend

    return LocalBackend()


def path_in_tree(target: str, root: str) -> str | None:
    """``target``'s path relative to the directory ``root``; None if it lies outside."""
    inside = os.path.relpath(os.path.abspath(target), os.path.abspath(root))
    return None if inside == os.pardir or inside.startswith(os.pardir + os.sep) else inside


def _program(options: RunOptions) -> tuple:
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


def _start(options: RunOptions, restart: int, signals: _Signals, run: _Run,
           job: JobRound | None = None) -> Any:
    """The group for one attempt (of this node's ranks, in a ``job`` of several
    launchers); None if a signal or the job stopped its start."""
    from phalanx.controller.group import WorkerGroup
    from phalanx.node.placement import place
    from phalanx.world.frameworks import WorldPart

    env = {name: str(restart) for name in RESTART_VARS}
    if signals.received is not None or signals.stopped:
        return None
    signals.starting = True
    try:
        backend = _backend(options)
        if job is None:
            layout = place(options.framework, options.nodes, options.procs_per_node,
                           options.gpus_per_worker, backend.gpus_per_node(options.nodes)).layout
            mine = range(layout.world_size)
        else:
            layout = job.part.world
            mine = layout.ranks_of(job.part.node)
        if "OMP_NUM_THREADS" not in os.environ and layout.world_size > 1:  # as torchrun
            env["OMP_NUM_THREADS"] = "1"
        common, per_rank = elastic_env(
            layout, run_id=run.run_id, max_restarts=options.max_restarts, restart=restart,
            role=options.role, error_dir=run.attempt_dir(restart))
        env.update(common)
        outside = sorted(r for r in options.ranks or () if r >= layout.world_size)
        if outside:
            raise ValueError(f"--ranks names ranks {outside} outside "
                             f"0..{layout.world_size - 1}")
        shown = [r - mine.start for r in mine if options.ranks is None or r in options.ranks]
        if options.local_ranks is not None:
            shown = [r - mine.start for r in mine
                     if layout.local_rank_of(r) in options.local_ranks and r - mine.start in shown]
        return WorkerGroup(
            ScriptRunner,
            args=_program(options),
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
        )
    except (ValueError, TypeError) as exc:
        raise BadOptions(str(exc)) from exc
    finally:
        signals.starting = False


def _attempt(options: RunOptions, restart: int, signals: _Signals,
             run: _Run, job: JobRound | None = None) -> Failure | None:
    """Run one attempt; how it failed (ranks and nodes as the world numbers them), or
    None if it succeeded or a signal or the job stopped it."""
    failure = _run_group(options, restart, signals, run, job)
    if failure is None:
        return None
    if job is not None and failure.rank is not None:  # the world's rank and node
        failure = dataclasses.replace(failure, rank=job.part.first_rank + failure.rank,
                                      node=job.part.node)
    failure = dataclasses.replace(failure, seen=time.time())
    return _with_error_file(failure, run.attempt_dir(restart))


def _run_group(options: RunOptions, restart: int, signals: _Signals, run: _Run,
               job: JobRound | None) -> Failure | None:
    try:
        group = _start(options, restart, signals, run, job)
    except StartupError as exc:
        return None if signals.received is not None else failure_from(exc)
    if group is None:
        return None
    failure = None
    try:
        ranks = [0] if group.single_controller else list(range(group.world_size))
        signals.running = set(ranks)
        signals.group = group  # from here a signal is forwarded to the running ranks
        if signals.received is not None or signals.stopped:  # before the group was known
            return None
        for rank_future in group.call_async("run", workers=ranks):
            signals.running.discard(rank_future.rank)
            failure = _outcome(group, rank_future)
            if failure is not None:
                break
    except PhalanxError as exc:  # a rank died before the program was sent to it
        failure = failure_from(exc)
    finally:
        signals.group = None
        # a finished program's rank may still be running threads and atexit handlers
        group.shutdown(timeout=config.DEFAULT_SHUTDOWN_TIMEOUT if failure is None else 2.0)
    return failure


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


class _Run:
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

    def attempt_dir(self, restart: int) -> str:
        return os.path.join(self.root, f"attempt_{restart}")

    def close(self) -> None:
        """Remove the error files' directory if temporary, or if no rank wrote one."""
        import shutil

        if self._temporary or not any(files for _, _, files in os.walk(self.root)):
            shutil.rmtree(self.root, ignore_errors=True)


def _outcome(group: Any, rank_future: Any) -> Failure | None:
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


def run(options: RunOptions) -> int:
    """Run the program on every rank; returns the exit status for the launcher."""
    if options.job is not None:  # one launcher per node: this node's ranks, in the job
        from phalanx.launcher.multinode import run_node

        return run_node(options)
    attempts = options.max_restarts + 1
    run_state = _Run(options.run_id, options.log_dir)
    with _Signals(options.grace) as signals, contextlib.closing(run_state):
        for attempt in range(attempts):
            failure = _attempt(options, attempt, signals, run_state)
            if signals.received is not None:
                console.notice(f"phalanx run: stopped by {signal.Signals(signals.received).name}")
                return 128 + signals.received
            if failure is None:
                return 0
            if attempt + 1 < attempts:
                who = "the group" if failure.rank is None else f"rank {failure.rank}"
                console.notice(
                    f"phalanx run: {who} {failure.summary} (exit status {failure.status}); "
                    f"restarting the group (restart {attempt + 1} of {options.max_restarts})"
                )
                continue
            status = exit_status(failure, options.exit_code)
            console.notice(format_report(failure, attempts, status))
            return status
    return FAILED  # pragma: no cover - the loop always returns
