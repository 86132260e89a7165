"""Starting a node's ranks, holding them, burying them, stopping them.

One way ranks start, for the local backend and for a cluster agent alike
(:class:`RankSpawner`): a fresh interpreter (this one, or the group's ``python=``, which
imports phalanx from its own environment) running :mod:`phalanx.rank.runtime`, started by
the node's supervisor (:mod:`phalanx.node.supervisor`), which the spawner starts when it
opens (the local backend: it boots while the group prepares) or with the first rank (an
agent). Each rank gets

- a pair of control pipes (a pipe wakes a sleeping reader once per message where a socket
  wakes it twice), wrapped in a :class:`~phalanx.wire.framing.Connection` on this side;
- pipes for its stdout and stderr, which the caller takes (:meth:`NodeRank.take_output`):
  the local backend hands them to its output pump, an agent relays them to its controller;
- a file to dump its stacks into (:class:`~phalanx.node.stacks.StackFile`);
- its environment layered over this node's own (:func:`~phalanx.world.layout.merge_env`)
  before the interpreter starts, and INIT as its first message.

A started rank is a :class:`NodeRank`. Its death is one routine on every node side:
the keeper's status pipe turns readable with the exit status (:meth:`NodeRank.exitcode`),
what the rank sent before it died is read (:meth:`NodeRank.drain`), then its failure
record (:meth:`NodeRank.failure`: exit code or signal, and the last lines of its stderr
where this side read them) goes to the controller. A control stream that ends first
means the rank is dying or of no use: :meth:`NodeRank.stream_ended` SIGKILLs it, and the
status follows. :class:`Burial` is that routine's other half, shared with the channels
at the controller: a death claimed once, its record completed for a moment, its EXITED
told once.

A Ray rank actor whose rank runs apart from it starts the rank as its own child
(:meth:`RankSpawner.start_child`: its process group, its output); the relay's actor
starts its rank under a supervisor of its own, ahead of time (:class:`PrestartedWorker`).
:func:`stop_processes` stops any of them with escalation.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from phalanx import config
from phalanx.errors import ProcessFailure
from phalanx.node.keeper import APPLIED_LATER, READ_AT_START
from phalanx.node.machine import require_interpreter, without_own_install
from phalanx.node.stacks import StackFile
from phalanx.node.supervisor import SupervisedProcess, Supervisor
from phalanx.wire import framing, protocol, streams
from phalanx.world.layout import merge_env

logger = logging.getLogger(__name__)

# The worker must find phalanx even when the controller imported it from a path of its own
# (sys.path edits, a notebook's cwd): put the package's parent first, then run the worker.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); from phalanx.rank.runtime import main; main()"
)
# Another interpreter (``python=``) imports phalanx from its own environment: nothing is put
# on its path, and the cwd ``-c`` puts first is left out until phalanx is imported. One that
# cannot import it says so on stderr, naming itself (the rank's failure record shows it).
_OWN_BOOT = (
    "import sys\n"
    "cwd = sys.path.pop(0) if sys.path and sys.path[0] == '' else None\n"
    "try:\n"
    "    from phalanx.rank.runtime import main\n"
    "except ImportError as exc:\n"
    "    sys.stderr.write(f'phalanx: the interpreter {sys.executable} (python=) cannot run a '\n"
    "                     f'rank: {type(exc).__name__}: {exc}; install phalanx into its '\n"
    "                     'environment\\n')\n"
    "    sys.exit(1)\n"
    "if cwd is not None:\n"
    "    sys.path.insert(0, cwd)\n"
    "main()\n"
)
_DRAIN_READS = 10_000  # a dead rank's pipe holds at most its capacity: far fewer reads


def worker_argv(python: str | None = None) -> list[str]:
    """The command line of a worker interpreter: this one, or ``python`` (``python=``)."""
    if python is not None:
        return [python, "-c", _OWN_BOOT]
    return [sys.executable, "-c", _WORKER_BOOT.format(root=_PACKAGE_ROOT)]


def is_worker_command(cmdline: list[str]) -> bool:
    """Whether a process command line is that of a phalanx worker started by this module."""
    return len(cmdline) == 3 and cmdline[1] == "-c" and "from phalanx.rank.runtime import main" in (
        cmdline[2]
    )


def _is_supervisor_command(cmdline: list[str]) -> bool:
    """``python -S -c BOOT SOCKET_FD CONTROLLER_PID`` (phalanx.node.supervisor)."""
    return (len(cmdline) >= 4 and cmdline[-4] == "-c"
            and "from phalanx.node.keeper import main" in cmdline[-3])


def is_worker(cmdlines: list[list[str]]) -> bool:
    """Whether a process is a phalanx worker, from its command line, its parent's and its
    grandparent's (``cmdlines``, in that order): a fresh interpreter running the rank
    runtime, or a rank forked from preloaded modules, which keeps the command line of the
    supervisor it was forked from (below a keeper, below the supervisor: three alike; a
    keeper has two)."""
    if cmdlines and is_worker_command(cmdlines[0]):
        return True
    return len(cmdlines) >= 3 and all(_is_supervisor_command(c) for c in cmdlines[:3])


# --------------------------------------------------------------------------- a node's ranks


class NodeRank:
    """One rank's process on this node, as the node side that started it holds it: the
    supervised process (its status pipe is the death event), the control connection, the
    stack file, and the output pipes until the caller takes them."""

    def __init__(self, rank: int, node: int, incarnation: int, proc: SupervisedProcess,
                 conn: framing.Connection, stack_file: StackFile) -> None:
        self.rank, self.node, self.incarnation = rank, node, incarnation
        self.proc = proc
        self.conn = conn
        self._stack_file = stack_file
        self._output: tuple[int, int] | None = (proc.stdout_fd, proc.stderr_fd)

    @property
    def pid(self) -> int | None:
        """Its pid (None if it could not be started); waits for the keeper to report it."""
        return self.proc.pid

    @property
    def death_fd(self) -> int | None:
        """Readable when the keeper reports something (the pid, then the exit status, then
        the end of its cleanup); None once released."""
        return self.proc.death_fd

    def take_output(self) -> tuple[int, int]:
        """Its stdout and stderr read ends: the taker reads them and closes them."""
        output, self._output = self._output, None
        if output is None:
            raise RuntimeError(f"the output of rank {self.rank} was taken already")
        return output

    def send(self, frame: list[Any]) -> None:
        """Queue a frame for it; a rank that is gone is reported by its status pipe (its
        connection is quiet: a frame for a lost rank is dropped)."""
        self.conn.send(frame)

    # -- its death --------------------------------------------------------------------

    def exitcode(self, timeout: float | None = 0.0) -> int | None:
        """Its exit code (negative: the signal that killed it); None while it runs."""
        return self.proc.exitcode(timeout)

    def stream_ended(self) -> None:
        """Its control stream ended: it is dying, or of no use any more. SIGKILL it unless
        it is known to have exited; its exit status follows on the status pipe, or is
        known now if it has exited already (:meth:`SupervisedProcess.look_for_exit`)."""
        self.proc.kill()
        self.proc.look_for_exit()

    def reap(self) -> int | None:
        """Its exit code, waiting up to ``config.EXIT_WAIT`` for it to exit on its own,
        then SIGKILLing its whole tree."""
        code = self.proc.exitcode(config.EXIT_WAIT)
        if code is None:
            self.proc.signal_tree(signal.SIGKILL)
            code = self.proc.exitcode(5.0)
        return code

    def drain(self) -> list[list[Any]]:
        """What it sent before it ended (once its exit status is in, all of it is in the
        pipe)."""
        frames: list[list[Any]] = []
        for _ in range(_DRAIN_READS):
            try:
                more = self.conn.reader.recv_frames(block=False)
            except framing.ConnectionLost:
                break
            if not more:
                break
            frames += more
        return frames

    def failure(self, stderr_tail: Sequence[str] = ()) -> ProcessFailure:
        """How it ended, as known now: the record behind ``WorkerDied``, built here for
        every node side. ``stderr_tail``: its last lines of stderr, where this side read
        them (an agent sends none: its controller read the output it relayed)."""
        return ProcessFailure(self.rank, self.node, self.proc.pid, self.proc.exitcode(0),
                              tuple(stderr_tail))

    # -- reaching it ------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """``sig`` to its process group, as a terminal would send it."""
        self.proc.signal_group(sig)

    def stacks(self, timeout: float) -> str:
        """Its threads' stacks now (see :mod:`phalanx.node.stacks`)."""
        return self._stack_file.take(self.proc.pid, timeout)

    def close(self) -> None:
        """Release its descriptors (the process is stopped by :func:`stop_processes`)."""
        self.conn.close()
        output, self._output = self._output, None
        for fd in output or ():
            os.close(fd)
        self.proc.release()
        self._stack_file.close()


# --------------------------------------------------------------------------- a rank's burial


class BurialState(enum.Enum):
    """Where a rank's burial is (:class:`Burial`). The legal moves::

        ALIVE   -> CLAIMED   a first sign of its death claimed it (claim()), or it is
                             stopped on purpose (stop(): nothing will be told)
        CLAIMED -> TOLD      its EXITED event went out (exited())
        TOLD    -> TOLD      told again, with an account that came after (tell())
    """

    ALIVE = "alive"
    CLAIMED = "claimed"
    TOLD = "told"


class Burial:
    """One rank's death, told once: the one routine for a rank that died, used by every
    channel at the controller (the local backend's, Ray's, an agent link's) and by an
    agent's node side.

    A death shows itself in several ways, often more than one for the same death: the
    keeper's exit status, the control stream's end, Ray's or the warden's account, the
    rank's node lost. The first claims the burial (:meth:`claim`); the others find it
    claimed. A rank stopped on purpose is claimed by :meth:`stop`, and nothing is told: the
    group records that end itself.

    The claimer completes the record with what its side still waits for, a moment at most
    (the rank's last output lines, ``config.OUTPUT_WAIT``; on Ray also the cause Ray gives
    and the warden's exit status), then the EXITED event with the failure record
    (``record()`` as known then, made into the side's ``message``) goes out once
    (:meth:`exited`). Where that wait happens is where the sides differ:

    - nowhere, when the record is complete already (a local rank's output pipes close with
      its process, before its keeper hears of the exit): the claimer's pass returns the
      event with what it read -- a SIGKILLed rank's calls fail ~1.5 ms after the kill;
    - on a short helper thread (:meth:`tell_later`), which waits (``settle``), then posts
      it (``post``): the dispatcher's pump never waits on a death;
    - in a loop with no thread to spare (an agent's relay), which sends it once the record
      is complete or :attr:`deadline` has passed.

    An account that comes after the event went out (Ray's cause, the warden's status) is
    told again (:meth:`tell`); the controller merges it into the record it kept. With the
    owner's ``lock`` (when the record's sources change under it), such an account is
    either in the event :meth:`exited` builds or finds the burial :attr:`told`.

    Its state is a :class:`BurialState`: ALIVE -> CLAIMED (:meth:`claim`, or :meth:`stop`)
    -> TOLD (:meth:`exited`). A stop once claimed changes nothing: the event still goes
    out.
    """

    def __init__(self, rank: int, record: Callable[[], ProcessFailure],
                 post: Callable[[list[Any]], None] | None = None, *,
                 message: Callable[[ProcessFailure], list[Any]] | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.rank = rank
        self._record = record
        self._post = post
        self._message = message or (
            lambda failure: protocol.exited_message(rank, failure.as_dict()))
        self._lock = lock or threading.Lock()
        self._state = BurialState.ALIVE
        self.deadline = math.inf  # once claimed: the longest the record waits for output

    @property
    def state(self) -> BurialState:
        return self._state

    @property
    def claimed(self) -> bool:
        """Whether the rank is dead or stopped, as far as this side knows (no lock: the
        state only ever moves on from ALIVE)."""
        return self._state is not BurialState.ALIVE

    @property
    def told(self) -> bool:
        """Whether its EXITED event went out."""
        return self._state is BurialState.TOLD

    def claim(self) -> bool:
        """Whether this sign of death is the first: the caller then buries the rank.
        False once claimed, or stopped."""
        with self._lock:
            if self._state is not BurialState.ALIVE:
                return False
            self._state = BurialState.CLAIMED
            self.deadline = time.monotonic() + config.OUTPUT_WAIT
        return True

    def stop(self) -> None:
        """The rank is stopped on purpose: the group records its end, and no later sign of
        death claims it."""
        with self._lock:
            if self._state is BurialState.ALIVE:
                self._state = BurialState.CLAIMED

    def exited(self) -> list[Any]:
        """The EXITED event of the record as known now; the burial is told."""
        with self._lock:
            self._state = BurialState.TOLD
            return self._message(self._record())

    def tell(self) -> None:
        """Post the EXITED event now (again, for an account that came after it)."""
        if self._post is None:
            raise RuntimeError(f"the burial of rank {self.rank} has nowhere to post")
        self._post(self.exited())

    def tell_later(self, settle: Callable[[], object] | None = None) -> None:
        """On a short helper thread: ``settle()`` (the wait, a moment at most, for what
        completes the record), then :meth:`tell`."""
        threading.Thread(target=self._bury, args=(settle,), name=f"phalanx-bury-{self.rank}",
                         daemon=True).start()

    def _bury(self, settle: Callable[[], object] | None) -> None:
        if settle is not None:
            settle()
        self.tell()


class RankSpawner:
    """Starts a node's ranks under its supervisor: the one spawner of the local backend
    and of a cluster agent's session (:meth:`launch`), and of the rank a Ray actor runs
    apart from itself, as its own child (:meth:`start_child`). Thread-safe."""

    def __init__(self, writer: framing.BacklogWriter | None = None) -> None:
        # what writes to every rank's control pipe (launch); None for a spawner whose
        # ranks' streams the caller made (start_on) or hands over (prestart)
        self._writer = writer
        self._supervisor: Supervisor | None = None
        self._lock = threading.Lock()

    def open(self) -> None:
        """Start the supervisor now, not with the first rank (it then boots while the
        caller prepares the launch)."""
        self._started()

    @property
    def supervisor_pid(self) -> int | None:
        """The node supervisor's pid, once it runs."""
        return None if self._supervisor is None else self._supervisor.pid

    def launch(self, starts: Iterable[tuple[int, int, int, Mapping[str, str]]],
               cwd: str, sys_path: Sequence[str], options: Mapping[str, Any],
               payload: list[Any], python: str | None = None) -> list[NodeRank]:
        """Start ranks ``(rank, node, incarnation, env)`` in ``cwd`` and send each its INIT
        (``sys_path``, ``options`` and the pickled target ``payload``); ``env`` holds
        phalanx's and the user's variables, layered here over this node's environment.
        ``python``: the interpreter they run (``python=``; None: this one), checked here
        first (ValueError naming it before any rank starts); ``sys_path`` then loses what
        belongs to this Python's installation. If one cannot be started, those started
        already are stopped and released before the error propagates."""
        if python is not None:
            require_interpreter(python, f"{socket.gethostname()} (the ranks' node)")
            sys_path = without_own_install(sys_path)
        supervisor = self._started()
        init_options = dict(options)
        started: list[NodeRank] = []
        try:
            # This node's environment, less what is kept from user code: an agent started
            # with $PHALANX_TOKEN must not hand the cluster's token to every rank it runs.
            inherited = {key: value for key, value in os.environ.items()
                         if key not in config.WITHHELD_FROM_RANKS}
            for rank, node, incarnation, env in starts:
                started.append(self._start(supervisor, rank, node, incarnation,
                                           merge_env(inherited, env, None, None), cwd, python))
                started[-1].send(protocol.init_frame(rank, sys_path, init_options, payload))
        except BaseException:
            stop_processes([r.proc for r in started], force=True)
            for r in started:
                r.close()
            raise
        return started

    @staticmethod
    def start_child(env: Mapping[str, str], cwd: str | None,
                    stream: tuple[str, Sequence[int]], *, stacks_fd: int,
                    frame_keys: str | None = None) -> subprocess.Popen[bytes]:
        """A rank as a plain child of this process, under no supervisor: the rank of a Ray
        actor that runs apart from it (``framework="ray"``: a process connected to the
        actor's Ray cannot join a Ray of its own). The caller waits for it
        (``Popen.wait``: a negative code is the signal that killed it); OSError if it
        cannot start.

        ``env`` is layered over this process's environment (the actor's: Ray's variables
        for its worker and bundle stay). ``stream`` is the control stream handed over, a
        spec and its descriptors as :meth:`Supervisor.spawn` takes them (``"pipe:{0},{1}"``,
        ``"socket:{0}"``), with the socket's ``frame_keys`` across a network; ``stacks_fd``
        the file it dumps its stacks into (the warden's too).

        The rest it shares with its starter, on purpose: fds 1 and 2 (the actor pointed
        them at the rank's output streams already), and its process group (Ray kills a
        dead worker's group at once, so the rank goes with its actor; whatever else is
        left below the actor, a subreaper, its warden ends). No stdin.
        """
        fds = tuple(stream[1])
        full_env = {**os.environ, **env, config.ENV_FD: stream[0].format(*fds),
                    config.ENV_STACKS_FD: str(stacks_fd)}
        if frame_keys is not None:
            full_env[config.ENV_FRAME_KEYS] = frame_keys
        return subprocess.Popen(worker_argv(), env=full_env, cwd=cwd or None,
                                pass_fds=(*fds, stacks_fd), stdin=subprocess.DEVNULL)

    def start_on(self, env: Mapping[str, str], cwd: str | None, control: Sequence[int],
                 output: tuple[int, int], *, stacks_fd: int) -> SupervisedProcess:
        """Start one rank under this node's supervisor on streams the caller made (the
        relay's socket pairs): its control stream ``control`` (one socket, or a pipe pair:
        read end, write end) and its stdout and stderr ``output``; ``env`` is its whole
        environment. The caller keeps its copies of the descriptors."""
        spec = "socket:{0}" if len(control) == 1 else "pipe:{0},{1}"
        return self._started().spawn(worker_argv(), env, cwd, stacks_fd=stacks_fd,
                                     stream=(spec, tuple(control)), output=output)

    def prestart(self, env: Mapping[str, str], *, stacks_fd: int | None = None
                 ) -> PrestartedWorker:
        """A worker interpreter started now under this node's supervisor, before its rank
        is known (see :class:`PrestartedWorker`)."""
        return PrestartedWorker(self._started(), env, stacks_fd=stacks_fd)

    def _started(self) -> Supervisor:
        with self._lock:
            if self._supervisor is None:
                self._supervisor = Supervisor()
            return self._supervisor

    def _start(self, supervisor: Supervisor, rank: int, node: int, incarnation: int,
               env: Mapping[str, str], cwd: str, python: str | None) -> NodeRank:
        stack_file = StackFile()
        try:
            proc = supervisor.spawn(worker_argv(python), env, cwd, stacks_fd=stack_file.fd)
        except BaseException:
            stack_file.close()
            raise
        stream = streams.PipeStream(proc.read_fd, proc.write_fd, blocking_reads=False)
        if self._writer is None:  # pragma: no cover - a bug: launch() needs a writer
            raise RuntimeError("RankSpawner.launch() needs the writer of the ranks' pipes")
        # quiet: a rank that is gone is reported by its status pipe, not by a send
        conn = framing.Connection(stream, self._writer, quiet=True)
        return NodeRank(rank, node, incarnation, proc, conn, stack_file)

    def close(self) -> None:
        """End the supervisor, which kills whatever is still below it."""
        with self._lock:
            supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.close()


# --------------------------------------------------------------------------- Ray's way


class PrestartedWorker:
    """A worker interpreter started before its rank is known (its imports done meanwhile),
    under ``supervisor``, waiting on a Unix socket for its assignment; it exits if that
    socket closes first."""

    def __init__(self, supervisor: Supervisor, env: Mapping[str, str],
                 stacks_fd: int | None = None) -> None:
        self.env = dict(env)
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # until it is assigned, what it prints goes where its starter's output goes
            self.proc = supervisor.spawn(worker_argv(), {"PYTHONUNBUFFERED": "1", **env}, None,
                                         stacks_fd=stacks_fd,
                                         stream=("handoff:{0}", (child.fileno(),)),
                                         output=(1, 2))
        except BaseException:
            self._sock.close()
            raise
        finally:
            child.close()

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a rank with ``env`` can use this process (nothing read at start-up
        changes)."""
        return not any(
            key.startswith(READ_AT_START) and self.env.get(key) != value
            for key, value in env.items()
            if key not in APPLIED_LATER
        )

    def assign(self, env: Mapping[str, str], cwd: str | None, control: Sequence[int],
               stdout_fd: int, stderr_fd: int) -> SupervisedProcess:
        """Make it the rank: its variables, cwd, control stream (a socket, or a pair of
        pipes: read end, write end) and output (the caller keeps its copies of the
        descriptors)."""
        data = json.dumps({"env": dict(env), "cwd": cwd, "control": len(control)}).encode()
        socket.send_fds(self._sock, [struct.pack("<I", len(data)) + data[:4096]],
                        [*control, stdout_fd, stderr_fd])
        if len(data) > 4096:
            self._sock.sendall(data[4096:])
        self._sock.close()
        return self.proc

    def discard(self) -> None:
        """Not needed after all: it exits when its socket closes; reap it."""
        self._sock.close()
        stop_processes([self.proc], grace=1.0)
        self.proc.release()


# --------------------------------------------------------------------------- stopping


def stop_processes(
    procs: Iterable[SupervisedProcess], *, grace: float = config.DEFAULT_TERM_GRACE,
    force: bool = False,
) -> None:
    """SIGTERM every process tree, wait up to ``grace`` s, SIGKILL what is left; returns
    once every worker has exited and its keeper has ended what it left behind (or
    ``config.CLEANUP_WAIT`` has passed). With ``force`` it goes straight to SIGKILL.
    """
    procs = list(procs)
    if not force:
        for proc in procs:
            if proc.alive():
                proc.signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.exitcode(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        proc.signal_tree(signal.SIGKILL)
    for proc in procs:
        if proc.exitcode(10.0) is None:  # pragma: no cover - SIGKILL cannot be ignored
            logger.error("worker pid %s did not exit after SIGKILL", proc.pid)
    deadline = time.monotonic() + config.CLEANUP_WAIT
    for proc in procs:
        if not proc.wait_cleaned(max(0.0, deadline - time.monotonic())):
            logger.error("what worker pid %s started was not all ended in time", proc.pid)


def wait_all_exit(procs: Iterable[SupervisedProcess], timeout: float) -> list[SupervisedProcess]:
    """Wait up to ``timeout`` for the processes to exit on their own; returns those still alive."""
    deadline = time.monotonic() + timeout
    return [proc for proc in procs
            if proc.exitcode(max(0.0, deadline - time.monotonic())) is None]
