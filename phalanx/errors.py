"""Every exception phalanx raises, and the per-rank failure record behind them.

::

    PhalanxError                     base of everything below
     ├── StartupError                the group could not start: a constructor raised, a worker
     │                               died or did not report ready within ``start_timeout``
     ├── WorkerError                 user code (or (un)pickling in the worker) raised during a call
     ├── WorkerDied                  the worker process exited or was killed; also raised at once
     │    │                          for a call to a rank already known dead
     │    └── WorkerUnresponsive     silent past ``heartbeat_timeout`` (stopped, stuck holding
     │                               the GIL): killed; carries how long and its stacks
     ├── CallTimeout (TimeoutError)  a call's ``timeout`` passed before every rank answered
     ├── CollectiveStuck             ranks waited ``collective_timeout`` in a collective that
     │                               others never entered (or entered with other shapes): names
     │                               both, and how the waiting ranks were released
     ├── GroupClosed                 the group was shut down (pending calls end with this)
     ├── ObjectFreed (ValueError)    a put object's or kept result's handle used once freed
     ├── ObjectLost                  a kept result is gone with the rank that made it
     ├── DevicesTaken (ValueError)   GPUs asked for are held by another pool or group of this
     │                               machine (names the holders and what is free)
     ├── SerializationError          the controller could not pickle a call's arguments (nothing
     │                               was sent) or could not unpickle a rank's result
     ├── AuthenticationError         a peer failed to prove the group's secret (it is dropped)
     │    └── VersionMismatch        the peer runs another phalanx version (names both, and
     │                               the side to upgrade)
     ├── QuorumTimeout (TimeoutError)  fewer than ``quorum`` agents answered within
     │                               ``quorum_timeout`` (names who is missing)
     ├── MembershipChanged           a node left (or joined) the group while a call ran on it
     ├── DebuggerUnavailable         ``phalanx debug`` found no waiting rank to attach to
     └── FrameworkNotInstalled       ``framework=`` names a framework whose package is missing
         (ImportError)               (raised before any process starts)

    UnknownAxisError (ValueError, KeyError)      NamedSharding: no axis of that name
    NonIntegerLayoutError (ValueError, TypeError) NamedSharding: ranks that are not integers
    RemoteTraceback                  a rank's traceback text, the cause of the exception it
                                     raised (see below)
    InjectedFault (RuntimeError)     what ``inject_fault(..., "raise")`` raises in the rank
                                     (phalanx.rank.faults)

Bad arguments raise the built-in TypeError or ValueError naming what was wrong, before
anything is sent. ``phalanx run``'s own failures (``JobError``) are the launcher's and end
as its exit code. Every class here is exported as ``px.<Name>``.

``WorkerError`` keeps the remote exception as its ``__cause__`` when it can be rebuilt in the
controller; that exception's own cause is a :class:`RemoteTraceback` holding the worker's
traceback text, so a user sees the controller stack, then the worker stack.

Every error survives pickling (they cross process boundaries in user code too).

Text a peer chose (a version it claims, a reason an agent gives, a path it asked for) goes
into a log line or an error message only through :func:`printable`, so that no peer, proved
or not, can start a line of its own in a log or move a terminal's cursor.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import traceback
import types
from collections.abc import Sequence
from typing import Any

from phalanx.dumps import innermost_user_frames

SHOWN = 1000  # characters of a peer's text that printable() keeps by default


def printable(text: object, limit: int = SHOWN) -> str:
    """``text`` (a peer's: see the module docstring) fit for one line of a log or an
    error: every character that is not printable -- newlines, ESC and the other control
    characters, Unicode's line separators and direction overrides -- written as its Python
    escape (``\\n``, ``\\x1b``, ``\\u202e``), and its first ``limit`` characters only,
    then how many more there were."""
    whole = text if type(text) is str else str(text)
    head = whole[:max(0, limit)]
    shown = head if head.isprintable() else "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in head)
    more = len(whole) - len(head)
    return shown if not more else f"{shown}... ({more} more characters)"


def _rebuild(cls: type[BaseException], args: tuple[Any, ...],
             state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class PhalanxError(Exception):
    """Base class of every phalanx error."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; attached as the cause of a rebuilt remote error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nRemote traceback:\n" + self.text.rstrip()


@dataclasses.dataclass(frozen=True)
class RemoteFailure:
    """What a worker reports about an exception: sent as a plain tuple, rebuilt here."""

    exc_type: str
    message: str
    traceback: str
    stage: str  # "running the method", "unpickling the arguments", "pickling the result", ...
    pickled: bytes | None  # the exception itself, when it could be pickled

    @classmethod
    def from_exception(
        cls, exc: BaseException, stage: str, tb: types.TracebackType | None
    ) -> RemoteFailure:
        """The worker's report of ``exc``, its traceback shown from ``tb`` on."""
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - a broken __str__ must not lose the report
            message = f"<unprintable {type(exc).__name__}>"
        text = _format_traceback(exc, tb)
        return cls(type(exc).__name__, message, text, stage, _pickle_exception(exc))

    def as_tuple(self) -> tuple[Any, ...]:
        return dataclasses.astuple(self)

    def rebuild(self) -> BaseException | None:
        """The original exception with the remote traceback as its cause, or None."""
        if self.pickled is None:
            return None
        try:
            exc = pickle.loads(self.pickled)
        except Exception:  # noqa: BLE001 - any failure to rebuild means "keep the text only"
            return None
        if not isinstance(exc, BaseException):
            return None
        exc.__cause__ = RemoteTraceback(self.traceback)
        return exc


class _WithoutInit:
    """Pickles as ``_rebuild(cls, args, attributes)``: the exception comes back without its
    ``__init__`` being called, as phalanx's own errors do."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self.exc), self.exc.args, dict(vars(self.exc))))


def _pickle_exception(exc: BaseException) -> bytes | None:
    """``exc`` pickled so that the controller can rebuild it; None when it cannot be.

    Pickle rebuilds an exception as ``cls(*exc.args)``, which fails when ``__init__`` takes
    other arguments than it passes on (``E(a, b)`` calling ``super().__init__(f"{a}-{b}")``),
    and fails only when unpickled. So each way is checked by unpickling it here, where the
    classes are the controller's own (imported, or cloudpickled by value from its
    ``__main__`` and mapped back to the originals there); the second way restores ``args``
    and the attributes without calling ``__init__``.
    """
    # only when reporting an exception (see wire.dumps); cloudpickle ships no type hints
    import cloudpickle  # type: ignore[import-untyped]

    for candidate in (exc, _WithoutInit(exc)):
        try:
            pickled: bytes = cloudpickle.dumps(candidate, protocol=5)
            if isinstance(pickle.loads(pickled), BaseException):
                return pickled
        except Exception:  # noqa: BLE001 - try the next way; at worst the text travels alone
            continue
    return None


# What cloudpickle (3.1 on) writes as the file name of code it pickles by value: the
# functions and classes of the user's __main__, closures, classes defined in functions.
_SHIPPED_CODE = "<dynamic-code>"


def _format_traceback(exc: BaseException, tb: types.TracebackType | None) -> str:
    """``traceback.format_exception`` of ``exc`` from ``tb`` on, where frames of code shipped
    by value name their real file, from the ``__file__`` that cloudpickle ships with their
    globals, so that they read as in a local traceback: path, line number, source line."""
    report = traceback.TracebackException(type(exc), exc, tb, compact=True)
    pending = [(report, exc, tb)]
    seen: set[int] = set()
    while pending:  # the exception, then its chain (__cause__, __context__, groups)
        part, raised, frames_tb = pending.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        frames = [frame for frame, _ in traceback.walk_tb(frames_tb)]
        if len(frames) == len(part.stack):  # unless sys.tracebacklimit cut it short
            for i, frame in enumerate(frames):
                path = frame.f_globals.get("__file__")
                if frame.f_code.co_filename == _SHIPPED_CODE and isinstance(path, str):
                    part.stack[i] = _in_file(part.stack[i], path)
        linked = [(part.__cause__, raised.__cause__), (part.__context__, raised.__context__)]
        groups = getattr(part, "exceptions", None) or (), getattr(raised, "exceptions", ())
        linked += zip(*groups, strict=False)
        for linked_part, linked_exc in linked:
            if linked_part is not None and linked_exc is not None:
                pending.append((linked_part, linked_exc, linked_exc.__traceback__))
    return "".join(report.format())


def _in_file(summary: traceback.FrameSummary, path: str) -> traceback.FrameSummary:
    moved = traceback.FrameSummary(path, summary.lineno, summary.name)  # reads the line
    for position in ("end_lineno", "colno", "end_colno"):  # Python 3.11 on
        if hasattr(summary, position):
            setattr(moved, position, getattr(summary, position))
    return moved


def rank_text(rank: int, group: str | None = None) -> str:
    """How messages name a rank: ``rank 3``, or ``rank 3 of group Policy-2``."""
    return f"rank {rank}" if group is None else f"rank {rank} of group {group}"


class WorkerError(PhalanxError):
    """User code raised on a rank. ``.exc_type`` is the remote exception's type name,
    ``.traceback`` the remote traceback text, ``.stage`` says which side of the call failed,
    ``.group`` the name of the rank's group (None where it is not known).
    """

    def __init__(
        self,
        failure: RemoteFailure,
        *,
        rank: int,
        node: int,
        pid: int | None,
        method: str,
        group: str | None = None,
    ) -> None:
        where = f"{rank_text(rank, group)} (node {node}, pid {pid})"
        if failure.stage == "running the method":
            text = f"{failure.exc_type} on {where} in {method}(): {failure.message}"
        else:
            text = (
                f"{failure.exc_type} on {where} while {failure.stage} of {method}(): "
                f"{failure.message}"
            )
        super().__init__(text)
        self.rank = rank
        self.node = node
        self.pid = pid
        self.method = method
        self.group = group
        self.exc_type = failure.exc_type
        self.message = failure.message
        self.traceback = failure.traceback
        self.stage = failure.stage


# each signal's name by its number, looked up once: a death's message names its signal
# several times, on the path from the death to its calls failing (the enum's own lookup
# runs cold there, once a death)
_SIGNAL_NAMES = {int(sig): sig.name for sig in signal.Signals}


def signal_name(exitcode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; None for a normal exit code."""
    if exitcode is None or exitcode >= 0:
        return None
    name = _SIGNAL_NAMES.get(-exitcode)
    return f"signal {-exitcode}" if name is None else name


_LIKELY_CAUSE = {
    "SIGKILL": "killed by SIGKILL: the kernel's out-of-memory killer or an external `kill -9`",
    "SIGSEGV": "a crash in native code (segmentation fault in a C extension, CUDA, ...)",
    "SIGBUS": "a crash in native code (bus error; often a full /dev/shm or a truncated mmap)",
    "SIGILL": "a crash in native code (illegal instruction; a binary built for another CPU?)",
    "SIGFPE": "a crash in native code (arithmetic fault)",
    "SIGABRT": "an abort in native code (failed assertion, std::terminate, double free)",
    "SIGTERM": "asked to stop by another process (SIGTERM)",
    "SIGINT": "interrupted (SIGINT)",
}


def likely_cause(exitcode: int | None) -> str:
    """A short human explanation of how a worker ended (pure function of its exit code)."""
    if exitcode is None:
        return "lost its control connection; exit status unknown"
    name = signal_name(exitcode)
    if name is not None:
        return _LIKELY_CAUSE.get(name, f"killed by {name}")
    if exitcode == 0:
        return "exited normally (exit code 0) while calls were pending"
    return f"exited with code {exitcode} (sys.exit / os._exit in user code, or a fatal error)"


@dataclasses.dataclass(frozen=True)
class ProcessFailure:
    """How one worker process ended: the record behind :class:`WorkerDied`."""

    rank: int
    node: int
    pid: int | None
    exitcode: int | None  # negative: killed by that signal; None: unknown
    stderr_tail: tuple[str, ...] = ()
    reason: str | None = None  # what the backend knows of the cause (Ray: "the node died")
    silent_for: float | None = None  # set when it was killed for giving no sign of life
    stack: str | None = None  # its threads' stacks when that happened, if they could be taken

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)

    @property
    def never_started(self) -> bool:
        """Whether its process never ran: the node side has an exit status for it but never
        had its pid (it could not start it). A rank whose node was lost before its pid was
        heard of has neither, and may have run."""
        return self.pid is None and self.exitcode is not None

    @property
    def cause(self) -> str:
        if self.reason:
            return self.reason
        if self.never_started:  # the exit code is the node side's, not the rank's
            return ("its node could not start its process (a working directory or a program "
                    "that does not exist there?); the node side logged why: \"could not "
                    "start a worker: ...\"")
        return likely_cause(self.exitcode)

    def as_dict(self) -> dict[str, Any]:
        """Plain data, as a node side sends it in an EXITED message. Every field is
        immutable already: no deep copy (``dataclasses.asdict`` takes 20 us, on the path
        from a rank's death to its calls failing)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def merged(self, earlier: ProcessFailure | None) -> ProcessFailure:
        """This later account of a death, keeping what an earlier one knew and it does not
        (why the rank was killed, its stack)."""
        if earlier is None:
            return self
        return dataclasses.replace(
            self,
            reason=earlier.reason or self.reason,
            silent_for=self.silent_for if self.silent_for is not None else earlier.silent_for,
            stack=self.stack or earlier.stack,
            stderr_tail=self.stderr_tail or earlier.stderr_tail,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessFailure:
        return cls(**{**data, "stderr_tail": tuple(data.get("stderr_tail", ()))})


class WorkerDied(PhalanxError):
    """A worker process ended while calls were pending on it (or was called while dead).

    ``.exitcode`` is negative when a signal killed it; ``.signal`` is then its name;
    ``.stderr_tail`` holds the last lines it wrote to stderr; ``.cause`` a likely explanation;
    ``.before_sent`` whether it was known dead before ``.method`` was sent to it; ``.group``
    the name of its group (None where it is not known).
    """

    def __init__(self, failure: ProcessFailure, *, method: str | None = None,
                 before_sent: bool = False, group: str | None = None) -> None:
        text = f"{_what_happened(failure, method, before_sent, group)}: {failure.cause}"
        if failure.stack:
            where = innermost_user_frames(failure.stack)
            if where:
                text += "\nwhere it was:\n  " + "\n  ".join(where)
        if failure.stderr_tail:
            text += "\nlast lines of its stderr:\n  " + "\n  ".join(failure.stderr_tail)
        super().__init__(text)
        self.failure = failure
        self.rank = failure.rank
        self.node = failure.node
        self.pid = failure.pid
        self.exitcode = failure.exitcode
        self.signal = failure.signal
        self.stderr_tail = failure.stderr_tail
        self.cause = failure.cause
        self.method = method
        self.before_sent = before_sent
        self.group = group


def _what_happened(failure: ProcessFailure, method: str | None, before_sent: bool,
                   group: str | None) -> str:
    """``rank 1 of group Policy (node 0, pid 7) died while running step()``, or what
    happened instead: it never started, or it was dead before ``method()`` was sent to it."""
    rank = rank_text(failure.rank, group)
    if failure.never_started:
        during = f", so {method}() never ran" if method else ""
        return f"{rank} (node {failure.node}) never started{during}"
    pid = "" if failure.pid is None else f", pid {failure.pid}"
    where = f"{rank} (node {failure.node}{pid})"
    if method is None:
        return f"{where} died"
    if before_sent:
        return f"{where} was already dead when {method}() was sent"
    return f"{where} died while running {method}()"


class CollectiveStuck(PhalanxError):
    """Ranks of a call waited ``collective_timeout`` seconds in a collective that other
    members never entered, or entered with other arguments (see
    :mod:`phalanx.controller.collectivewatch`).

    ``.culprits``: ``{rank: what it was doing instead}`` (it returned from the method, is in
    another call or collective, is stopped, died, entered with another shape);
    ``.waiting``: ``{rank: the collective it waits in}``; ``.collective``: its operation;
    ``.since``: when the first rank entered it (a ``time.time()`` value); ``.released``: what
    was done so that the group answers calls again; ``.group``: the group's name.
    """

    def __init__(self, message: str, *, culprits: dict[int, str], waiting: dict[int, str],
                 collective: str, since: float, released: str,
                 group: str | None = None) -> None:
        super().__init__(message)
        self.culprits = culprits
        self.waiting = waiting
        self.collective = collective
        self.since = since
        self.released = released
        self.group = group


class WorkerUnresponsive(WorkerDied):
    """A rank gave no sign of life for ``heartbeat_timeout`` seconds (stopped, deadlocked
    with the GIL held, stuck in a C call): phalanx killed it so that it cannot come back
    half-alive. ``.silent_for`` says how long it was silent; ``.stack`` holds its threads'
    stacks when it was declared unresponsive (or why they could not be taken)."""

    def __init__(self, failure: ProcessFailure, *, method: str | None = None,
                 before_sent: bool = False, group: str | None = None) -> None:
        super().__init__(failure, method=method, before_sent=before_sent, group=group)
        self.silent_for = failure.silent_for
        self.stack = failure.stack


def death_error(failure: ProcessFailure, method: str | None = None, *,
                before_sent: bool = False, group: str | None = None) -> WorkerDied:
    """The error for calls pending on a rank that ended this way (``before_sent``: the
    rank was known dead before the call was sent to it; ``group``: its group's name)."""
    kind = WorkerUnresponsive if failure.silent_for is not None else WorkerDied
    return kind(failure, method=method, before_sent=before_sent, group=group)


class StartupError(PhalanxError):
    """The group could not start; every worker it had started has been stopped.

    ``.rank`` is the first rank that failed (None for a timeout of several), ``.group`` the
    name of the group (None where it is not known), and the underlying
    :class:`WorkerError` / :class:`WorkerDied` is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, rank: int | None = None, traceback: str | None = None,
                 group: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.group = group


class CallTimeout(PhalanxError, TimeoutError):
    """A call's ``timeout`` passed before every selected rank answered (``.group``: the name
    of their group, None where it is not known)."""

    def __init__(self, method: str, timeout: float, pending_ranks: list[int],
                 stacks: dict[int, str] | None = None, group: str | None = None) -> None:
        of = "" if group is None else f" of group {group}"
        text = (f"{method}() did not finish within {timeout:g} s on ranks {pending_ranks}{of}; "
                "the call keeps running there (see group.stacks(), or pass a larger timeout=)")
        where = {rank: innermost_user_frames(dump) for rank, dump in (stacks or {}).items()}
        if any(where.values()):
            text += "\nwhere the late ranks are:" + "".join(
                f"\n  rank {rank}: " + "; ".join(frames)
                for rank, frames in sorted(where.items()) if frames)
        super().__init__(text)
        self.method = method
        self.timeout = timeout
        self.pending_ranks = pending_ranks
        self.group = group
        self.stacks = stacks or {}  # rank -> every thread's stack when the timeout passed


class GroupClosed(PhalanxError):
    """The group was shut down; pending calls end with this, and new ones raise it."""


class ObjectFreed(PhalanxError, ValueError):
    """A handle (an ObjectRef: a put object's, or a kept result's ResultRef) was used after it
    was freed."""


class DevicesTaken(PhalanxError, ValueError):
    """GPUs a pool or a group asked for are held by another pool or group (one book of
    devices per machine); the message names the holders and the GPUs still free. Raised
    before any process starts; closing the holder frees them."""


class ObjectLost(PhalanxError):
    """A result kept on a rank (a ``keep=True`` handle) is gone with the rank (or node) that
    made it; the message names the producing group, rank and why."""


class SerializationError(PhalanxError):
    """The controller failed to pickle arguments (nothing was sent) or to unpickle a result."""

    def __init__(self, message: str, *, stage: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.rank = rank


def chain_remote(error: WorkerError, failure: RemoteFailure) -> WorkerError:
    """Attach the rebuilt remote exception (or the bare remote traceback) as the cause."""
    original: Any = failure.rebuild()
    error.__cause__ = original if original is not None else RemoteTraceback(failure.traceback)
    return error


class AuthenticationError(PhalanxError):
    """A peer connecting to the controller (or a node) did not prove the shared secret."""


def _release(version: str) -> tuple[int, ...] | None:
    """``"0.12.1"`` -> ``(0, 12, 1)``; None for a version that does not start so."""
    parts = []
    for part in version.split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts) or None


_VERSION_SHOWN = 64  # characters of a peer's version in a message (a release's are ~20)


class VersionMismatch(AuthenticationError):
    """Two ends of a connection run different phalanx versions (``phalanx.__version__``):
    refused at the handshake, before anything is unpickled (pickles name modules, which move
    between versions). Names both versions and which side to upgrade.

    ``peer_version`` is None for a peer so old that its handshake does not say its version.
    It is the peer's own text, as received; the message shows it through :func:`printable`
    (a stranger chooses it before it proves anything).
    """

    def __init__(self, own: str, own_version: str, peer: str,
                 peer_version: str | None) -> None:
        self.own, self.own_version = own, own_version
        self.peer, self.peer_version = peer, peer_version
        if peer_version is not None:
            peer_version = printable(peer_version, _VERSION_SHOWN)
        if peer_version is None:
            text = (f"{peer} runs an older phalanx, whose handshake does not say its version, "
                    f"and {own} runs phalanx {own_version}: upgrade {peer} to phalanx "
                    f"{own_version}")
        else:
            mine, theirs = _release(own_version), _release(peer_version)
            if mine is None or theirs is None or mine == theirs:
                advice = "install the same phalanx version on both sides"
            elif mine < theirs:
                advice = f"upgrade {own} to phalanx {peer_version}"
            else:
                advice = f"upgrade {peer} to phalanx {own_version}"
            text = (f"{peer} runs phalanx {peer_version} and {own} runs phalanx "
                    f"{own_version}: {advice} (both sides must run the same version)")
        super().__init__(text)


class QuorumTimeout(PhalanxError, TimeoutError):
    """Fewer node agents than the quorum answered in time; names those that did and not."""

    def __init__(self, wanted: int, answered: list[str], missing: dict[str, str],
                 timeout: float) -> None:
        self.wanted, self.answered, self.missing = wanted, list(answered), dict(missing)
        super().__init__(
            f"only {len(answered)} of the {wanted} agents needed answered within {timeout:g} "
            f"s; answered: {', '.join(answered) or 'none'}; missing: "
            + ", ".join(f"{host} ({why})" for host, why in missing.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.wanted, self.answered, self.missing, 0.0))


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """A node in a membership change: its index in the group (None for a node not admitted
    yet), its agent's ``host:port``, and the group's ranks that ran there (none for a node
    not admitted yet)."""

    node: int | None
    host: str
    ranks: tuple[int, ...] = ()
    label: str | None = None  # what else names it (a Slurm job's node)

    def __str__(self) -> str:
        if self.node is None:
            return f"the agent at {self.host} (not in the group yet)"
        which = f", ranks {list(self.ranks)}" if self.ranks else ""
        also = "" if self.label is None else f"{self.label}, "
        return f"node {self.node} ({also}agent at {self.host}{which})"


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """Nodes that joined (``added``: answering, waiting for ``group.resize()``) and left
    (``removed``: gone from DNS, lost, or their agent stopped answering); ``reason``: why
    the removed ones left."""

    added: tuple[NodeInfo, ...] = ()
    removed: tuple[NodeInfo, ...] = ()
    reason: str = ""

    def __str__(self) -> str:
        parts = ([f"removed {', '.join(map(str, self.removed))}"
                  + (f": {self.reason}" if self.reason else "")] if self.removed else []) + (
            [f"added {', '.join(map(str, self.added))}"] if self.added else [])
        return "; ".join(parts) or "no change"


class MembershipChanged(PhalanxError):
    """The group's nodes changed while a call ran: nodes left (``.removed``) or joined
    (``.added``), lists of :class:`NodeInfo`. Calls with ``workers="ready"`` or ``"any"``
    carry on instead; ``group.resize()`` takes the new nodes in."""

    def __init__(self, added: Sequence[NodeInfo] = (), removed: Sequence[NodeInfo] = (),
                 method: str | None = None, reason: str = "") -> None:
        self.added, self.removed, self.method = list(added), list(removed), method
        self.reason = reason
        during = f" while {method}() ran" if method else ""
        event = MembershipEvent(tuple(added), tuple(removed), reason)
        super().__init__(f"the group's nodes changed{during}: {event}"
                         + ("; group.resize() admits the new nodes" if added else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.added, self.removed, self.method, self.reason))


class FrameworkNotInstalled(PhalanxError, ImportError):
    """``framework=`` names a framework whose Python package cannot be imported here."""

    def __init__(self, framework: str, package: str, install: str | None) -> None:
        hint = f"; install it with: {install}" if install else ""
        super().__init__(
            f"framework={framework!r} needs the {package!r} package, which is not installed{hint}"
        )
        self.framework = framework
        self.package = package
        self.install = install


class DebuggerUnavailable(PhalanxError):
    """``phalanx debug`` cannot attach: no rank waits, not the one named, or it refused."""


class UnknownAxisError(ValueError, KeyError):
    """An axis name the sharding does not have.

    A ``ValueError`` as in NeMo-RL's ``get_ranks`` / ``get_axis_index``, and a ``KeyError``
    as its ``get_axis_size`` raises, so an ``except`` written for either still catches it.
    """

    __str__ = ValueError.__str__  # KeyError's would quote the whole message


class NonIntegerLayoutError(ValueError, TypeError):
    """A layout (or a replacement rank) that is not made of integer ranks.

    A ``ValueError`` as NeMo-RL raises for fractional ranks, and a ``TypeError`` as it raises
    (through numpy) for a layout of strings or other non-numbers.
    """
