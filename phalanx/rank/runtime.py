"""The worker process: ``python -m phalanx.rank.runtime``.

It is started with its rank environment already set and a connected control socket whose
file descriptor is in ``PHALANX_FD``. It then

1. arranges to die with the controller: its keeper (:mod:`phalanx.node.keeper`) armed
   ``PR_SET_PDEATHSIG`` before ``exec``; it re-checks its parent, and a watchdog on the
   control stream's hang-up is the portable fallback;
2. receives ``INIT``: the controller's ``sys.path`` and the pickled target and constructor
   arguments; builds the user object and answers ``READY`` (or ``INIT_ERROR``);
3. serves ``CALL`` frames in the order they arrive on its main thread (or on a pool of
   ``concurrency`` threads), answering ``RESULT`` or ``ERROR`` for each, until ``SHUTDOWN``
   or end of stream.

``sys.exit()`` in user code ends the worker with that code, as it would a script; any other
exception is reported to the controller and the worker keeps serving.

The same loop runs under every backend: it only needs a connected stream socket. On Ray
it runs inside the rank's actor process instead (:func:`start_in_actor`, then
:func:`finish`, called by :mod:`phalanx.backends.ray.actor` on the actor's main thread),
which outlives the rank: there ``sys.exit(code)`` returns ``code`` rather than ending the
process.
"""

from __future__ import annotations

import enum
import os
import select
import signal
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx import config
from phalanx.rank import faults, kept, tracing
from phalanx.rank import shared as shmrank
from phalanx.rank.attach import open_stream
from phalanx.version import __version__
from phalanx.wire import framing, pickling, protocol, seal, streams
from phalanx.wire.protocol import BUILTIN, KEEP, TRACED

if TYPE_CHECKING:
    from phalanx.errors import RemoteFailure


def _check_parent(parent_pid: int) -> None:
    """Exit if the keeper that started us is gone already. It armed our parent-death signal
    (SIGKILL) before ``exec`` -- here that would cost ``ctypes``, ~5 ms of every rank's
    start -- so from now on its death kills us."""
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def arm_stack_dumps(fd: int | None = None) -> None:
    """Write every thread's stack into the file the node side gave us (``fd``, or the one
    ``config.ENV_STACKS_FD`` names) when it asks, from a thread of the rank's own, never
    interrupting the others (see :mod:`phalanx.rank.stacks`)."""
    if fd is None:
        named = os.environ.pop(config.ENV_STACKS_FD, None)
        if named is None:
            return
        fd = int(named)
    from phalanx.rank import stacks  # only with a stack file: a rank's start-up stays light

    stacks.arm(fd)


def _beat(conn: framing.Connection, rank: int, interval: float,
          tracker: types.ModuleType | None = None) -> None:
    """Send HEARTBEAT every ``interval`` s from a thread of its own: the controller hears
    nothing while the process is stopped or a C call holds the GIL. With ``tracker``
    (:mod:`phalanx.rank.collectives`), the collectives the rank is in go with it
    (COLLECTIVE) whenever they changed."""

    def beat() -> None:
        frame = protocol.heartbeat_frame(rank)
        while True:  # the first at once: the controller judges silence from then on
            try:
                conn.send(frame)
                if tracker is not None and tracker.changed():
                    conn.send(protocol.collective_frame(rank, *tracker.report()))
            except framing.ConnectionLost:
                return
            _SHARES.poll()  # a view of a freed object dropped since
            time.sleep(interval)

    threading.Thread(target=beat, name="phalanx-heartbeat", daemon=True).start()


def _process_age() -> float:
    """Seconds since this process was created (the kernel counts in clock ticks)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


_STARTED = (time.monotonic(), 0.0)  # when main() began, and how long the process had lived


def _watch_for_hangup(stream: streams.Stream) -> None:
    """Exit when the controller's end of the stream closes, even if user code never returns."""

    def watch() -> None:
        poller = select.poll()
        poller.register(stream.read_fd, stream.hangup_events)
        while True:
            try:
                events = poller.poll()
            except InterruptedError:  # pragma: no cover
                continue
            except (OSError, ValueError):
                return
            if events:
                break
        time.sleep(config.ORPHAN_GRACE)  # let an orderly exit of the main thread finish first
        os._exit(1)

    threading.Thread(target=watch, name="phalanx-hangup-watch", daemon=True).start()


def _static_attr(obj: Any, name: str) -> Any:
    """``obj``'s attribute ``name`` as stored, found as ``inspect.getattr_static`` finds
    it for an instance or a module (its own ``__dict__``, then its class's MRO) without
    running a descriptor or ``__getattr__``; AttributeError if it is in neither. A rank
    does not import :mod:`inspect` (with ``ast``, ``dis`` and ``tokenize``, several ms of
    every rank's start)."""
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:  # __slots__
        own = {}
    if name in own:
        return own[name]
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(name)


def _is_awaitable(value: Any) -> bool:
    """``inspect.isawaitable``: a coroutine, a generator-based one, or anything with
    ``__await__``."""
    if type(value) is types.GeneratorType:
        return bool(value.gi_code.co_flags & _CO_ITERABLE_COROUTINE)
    return isinstance(value, Awaitable)


_CO_ITERABLE_COROUTINE = 0x100  # inspect.CO_ITERABLE_COROUTINE: @types.coroutine's flag
_GENERATORS = (types.GeneratorType, types.AsyncGeneratorType)


def public_methods(obj: Any) -> list[str]:
    """Names of the public callables of ``obj``, without running any property."""
    names = []
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            attr = _static_attr(obj, name)
        except AttributeError:
            continue
        if isinstance(attr, (staticmethod, classmethod)) or callable(attr):
            names.append(name)
    return names


def method_parameters(obj: Any) -> dict[str, list[str]]:
    """Each public method of ``obj`` with the names its parameters can be given by as
    keywords (what the controller checks a call's option keywords against). Read from
    the code object, without importing inspect: a callable that has none (a builtin, a
    callable instance) lists none."""
    out: dict[str, list[str]] = {}
    for name in public_methods(obj):
        fn = _static_attr(obj, name)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None:
            out[name] = []
            continue
        count = code.co_argcount + code.co_kwonlyargcount
        first = code.co_posonlyargcount  # positional-only ones cannot clash with keywords
        out[name] = list(code.co_varnames[first:count])
    return out


_PHALANX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_internal(filename: str) -> bool:
    return filename.startswith(_PHALANX_DIR) or filename in _RUNPY

_RUNPY = ("<frozen runpy>", os.path.join(os.path.dirname(os.__file__), "runpy.py"))


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the first frame outside phalanx (and runpy) on: what the user
    wrote, not the machinery that called it."""
    first = tb
    while tb is not None and _is_internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else first


def version_mismatch(controller: str | None) -> str | None:
    """Why this rank cannot serve a controller of phalanx ``controller``; None if it can."""
    if controller == __version__:
        return None
    return (
        f"this rank runs phalanx {__version__} ({sys.executable}) but the controller runs "
        f"phalanx {controller or 'of unknown version'}: install phalanx {controller} in "
        "the rank's interpreter, or run the controller with the same release"
    )


def _failure(exc: BaseException, stage: str) -> RemoteFailure:
    # imported on the first failure: phalanx.errors is ~8 ms of a rank's start otherwise
    from phalanx.errors import RemoteFailure

    return RemoteFailure.from_exception(exc, stage, _user_frames(exc.__traceback__))


class _Missing(enum.Enum):
    """The sentinel of a method the user object lacks (an enum member: ``is`` narrows)."""

    METHOD = 0


T = TypeVar("T")
_SHARES = shmrank.RANK_SHARES
_PLAIN_RESULTS = frozenset({type(None), int, float, str, bytes, bool, list, dict, tuple})


class _WorkerExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class WorkerRuntime:
    """Builds the user object and serves calls over one connection."""

    def __init__(self, conn: framing.Connection) -> None:
        self.conn = conn
        self._answer = conn.sender()  # a result's send: compiled where it can be (a pipe)
        self.obj: Any = None
        self._loop: Any = None  # asyncio event loop, made on the first async method
        self._pool: Any = None  # ThreadPoolExecutor when concurrency > 1
        self._early_frames: list[list[Any]] = []  # calls that arrived together with INIT
        self._loop_lock = threading.Lock()
        self.bootstrap: Any = None  # phalanx.rank.bootstrap.Bootstrap when a framework needs one
        self.rank = 0  # from INIT's header; stamped on every reply
        self._faults: dict[str, tuple[str, Any]] = {}  # method -> fault armed by INJECT

    # -- start-up ---------------------------------------------------------------------

    def initialise(self) -> bool:
        """Wait for INIT, build the user object; False when that failed (already reported)."""
        while True:
            frames = self.conn.reader.recv_frames()
            if frames:
                break
        clock = time.monotonic
        timings = {"interpreter": _STARTED[1], "waiting": clock() - _STARTED[0]}
        segs = frames[0]
        self._early_frames = frames[1:]
        kind, _, ranks, (sys_path, options) = protocol.parse(segs[0])
        if kind != protocol.INIT:
            raise RuntimeError(f"expected INIT, got message kind {kind}")
        self.rank = kept.RANK = ranks[0]
        mismatch = version_mismatch(options.get("version"))
        if mismatch:  # the pickles name modules of another release: refuse before loading one
            failure = _failure(RuntimeError(mismatch), "checking phalanx's version")
            self.conn.send(protocol.init_error_frame(self.rank, failure.as_tuple()))
            return False
        _SHARES.notify = self._released
        tracker: types.ModuleType | None = None
        if options.get("collectives"):  # collective_timeout: which collective it is in
            from phalanx.rank import collectives

            collectives.arm()
            tracker = collectives
        if options.get("heartbeat"):
            _beat(self.conn, self.rank, options["heartbeat"], tracker)
        sys.path[:] = list(dict.fromkeys([*sys_path, *sys.path]))
        stage = "unpickling the target"
        try:
            framework = options.get("framework")
            if framework not in (None, "spmd"):
                stage = f"starting the {framework} framework"
                began = clock()
                self._start_framework(framework)
                timings["framework"] = clock() - began
                stage = "unpickling the target"
            began = clock()
            target, args, kwargs, own = pickling.loads(segs[1:])
            if self.rank in own:  # rank_kwargs=: this rank's, over the common ones
                kwargs = {**kwargs, **own[self.rank]}
            timings["import"] = clock() - began
            stage = "constructing the worker object"
            began = clock()
            if isinstance(target, types.ModuleType):
                self.obj = target
            else:
                self.obj = target(*args, **kwargs)
            timings["constructor"] = clock() - began
        except BaseException as exc:  # noqa: BLE001 - reported to the controller
            failure = _failure(exc, stage)
            self.conn.send(protocol.init_error_frame(self.rank, failure.as_tuple()))
            return False
        concurrency = options.get("concurrency", 1)
        if concurrency > 1:
            import concurrent.futures  # only for concurrency > 1

            self._pool = concurrent.futures.ThreadPoolExecutor(
                concurrency, thread_name_prefix="phalanx-call"
            )
        self.conn.send(protocol.ready_frame(self.rank, os.getpid(),
                                            method_parameters(self.obj), timings,
                                            os.environ.get("PHALANX_CODE_VERSION")))
        return True

    def _start_framework(self, name: str) -> None:
        # only for a framework: a plain rank's start-up does not pay for them
        from phalanx.rank import bootstrap
        from phalanx.world.frameworks import get_framework

        self.bootstrap = bootstrap.Bootstrap(get_framework(name))
        self.bootstrap.setup()

    def cleanup(self) -> None:
        """The framework's cleanup, once, as the worker exits."""
        if self.bootstrap is not None:
            self.bootstrap.cleanup()
            self.bootstrap = None

    # -- serving ----------------------------------------------------------------------

    def serve(self) -> int:
        """Serve calls until SHUTDOWN or end of stream; returns the exit code."""
        recv = self.conn.reader.recv_frames
        readable = None
        if isinstance(self.conn.stream, streams.SocketStream):
            # Sleep in poll(), not in recv(): a blocked recv() on a Unix socket is also woken
            # each time the controller drains what we sent (a spurious context switch per
            # call); poll() filters that wake-up out. Pipes need no such care.
            poller = select.poll()
            poller.register(self.conn.read_fd, select.POLLIN)
            readable = poller.poll
        run = self._run_call if self._pool is None else self._submit_call
        call, head, head_size = protocol.CALL, protocol.unpack_head, protocol.HEAD_SIZE
        many = protocol.MANY
        frames, self._early_frames = self._early_frames, []
        while True:
            for segs in frames:
                first = segs[0]
                kind, call_id, rank = head(first)
                start = head_size if rank != many else protocol.body_offset(first)
                if kind == call:
                    run(call_id, first[start + 1:].decode(), segs, False, first[start])
                elif kind == protocol.CALL_STREAM:
                    run(call_id, first[start + 1:].decode(), segs, True, first[start])
                elif kind == protocol.SHUTDOWN:
                    return 0
                else:
                    self._node_message(kind, first)
            try:
                if readable is None:
                    frames = recv()
                else:
                    frames = recv(False)
                    while not frames:
                        readable()
                        frames = recv(False)
            except framing.ConnectionLost:
                return 0

    def _node_message(self, kind: int, header: Any) -> None:
        """A shared object held on this node, or freed; a fault to inject."""
        extra = protocol.parse(header)[3]
        if kind == protocol.SHARE:
            _SHARES.add(*extra)
        elif kind == protocol.UNSHARE:
            _SHARES.drop(*extra)
        elif kind == protocol.UNMAP:
            _SHARES.unmap(*extra)
        elif kind == protocol.INJECT:
            method, fault, argument = extra
            self._faults[method] = (fault, argument)

    def _released(self, ref_id: int) -> None:
        try:
            self.conn.send(protocol.released_frame(self.rank, ref_id))
        except framing.ConnectionLost:
            pass

    def _submit_call(
        self, call_id: int, method: str, segs: list[Any], stream: bool = False, flags: int = 0
    ) -> None:
        assert self._pool is not None
        self._pool.submit(self._run_call_guarded, call_id, method, segs, stream, flags)

    def _run_call_guarded(
        self, call_id: int, method: str, segs: list[Any], stream: bool = False, flags: int = 0
    ) -> None:
        try:
            self._run_call(call_id, method, segs, stream, flags)
        except _WorkerExit as exc:
            _flush_and_exit(self.conn, exc.code, runtime=self)

    def _run_call(
        self, call_id: int, method: str, segs: list[Any], stream: bool = False,
        flags: int = 0, answered: list[float] | None = None,
    ) -> bool:
        """Run one call and answer it; True when the answer was an error. ``flags``: the
        call's (protocol.KEEP, TRACED, BUILTIN); ``answered``: where to note when the
        answer went out (a traced call's)."""
        if flags & TRACED:  # a trace asked when it ran (phalanx.rank.tracing)
            began = tracing.clock()
            stamp: list[float] = []
            failed = self._run_call(call_id, method, segs, stream, flags & ~TRACED, stamp)
            tracing.record(call_id, began, stamp[0] if stamp else tracing.clock(), failed)
            return failed
        # One try block; ``stage`` says which side of the call an exception came from.
        stage = "unpickling the arguments"
        keep = flags & KEEP  # keep=True: the result stays here (phalanx.rank.kept)
        try:
            if self._faults and method in self._faults:
                stage = "running the method"
                faults.perform(method, *self._faults.pop(method))
                stage = "unpickling the arguments"
            args, kwargs = pickling.loads(segs[1:])
            if kept.IN_RAY_WORKER and (args or kwargs):
                args, kwargs = kept.resolve_ray_arguments(args, kwargs)
            stage = "looking up the method"
            fn = (getattr(self.obj, method, _Missing.METHOD) if not flags & BUILTIN
                  else kept.builtin(method, self.obj) or _Missing.METHOD)
            if fn is _Missing.METHOD:
                available = ", ".join(public_methods(self.obj)) or "none"
                raise AttributeError(
                    f"{type(self.obj).__name__} has no method {method!r}; available: {available}"
                )
            stage = "running the method"
            result = fn(*args, **kwargs)
            if type(result) not in _PLAIN_RESULTS:
                if _is_awaitable(result):
                    result = self._await(result)
                elif not stream and isinstance(result, _GENERATORS):
                    raise TypeError(
                        f"{method}() returned a generator, which cannot be sent back whole; "
                        "use group.call_stream() to receive its items"
                    )
            if stream:
                self._stream(call_id, result, answered)
                return False
            stage = "pickling the result"
            payload = (kept.KEPT.keep(call_id, result, method) if keep
                       else kept.dumps_result(result))
        except SystemExit as exc:
            raise _WorkerExit(exit_code_of(exc.code)) from None
        except BaseException as exc:  # noqa: BLE001 - reported to the controller
            if answered is not None:
                answered.append(tracing.clock())
            self._send_error(call_id, exc, stage)
            return True
        del result
        if answered is not None:
            answered.append(tracing.clock())
        self._answer(protocol.result_frame(call_id, self.rank, payload))
        _SHARES.poll()  # freed objects whose last views this call may have let go (if any)
        return False

    def _stream(self, call_id: int, result: Any, answered: list[float] | None = None) -> None:
        """Send each item of a generator (sync or async) as it comes, then the end marker
        (``answered``: note when, for a trace). Exceptions propagate to _run_call, which
        reports them with the stage reached."""
        send, rank, dumps = self.conn.send, self.rank, pickling.dumps_fast
        if isinstance(result, types.AsyncGeneratorType):
            while True:
                more, item = self._await(_anext(result))
                if not more:
                    break
                send(protocol.result_frame(call_id, rank, dumps(item), item=True))
        elif isinstance(result, types.GeneratorType):
            for item in result:
                send(protocol.result_frame(call_id, rank, dumps(item), item=True))
        else:
            send(protocol.result_frame(call_id, rank, dumps(result), item=True))
        if answered is not None:
            answered.append(tracing.clock())
        send(protocol.end_of_stream_frame(call_id, rank))

    def _await(self, awaitable: Any) -> Any:
        import asyncio  # on the first awaitable: ~20 ms a rank without one never pays

        if self._pool is None:  # serial calls: run the coroutine on this (main) thread
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(awaitable)
        # concurrent calls: every coroutine shares one event loop on its own thread
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="phalanx-asyncio", daemon=True
                ).start()
        return asyncio.run_coroutine_threadsafe(_as_coroutine(awaitable), self._loop).result()

    def _send_error(self, call_id: int, exc: BaseException, stage: str) -> None:
        failure = _failure(exc, stage)
        self.conn.send(protocol.error_frame(call_id, self.rank, failure.as_tuple()))


async def _anext(agen: Any) -> tuple[bool, Any]:
    try:
        return True, await agen.__anext__()
    except StopAsyncIteration:
        return False, None


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def exit_code_of(code: Any) -> int:
    """The process exit status for ``sys.exit(code)``, as Python itself makes it (a
    non-integer is printed to stderr and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)  # sys.exit(True) is 1
    print(code, file=sys.stderr, flush=True)
    return 1


def _drain(conn: framing.Connection, wait: float = 1.0) -> None:
    """Give the writer thread up to ``wait`` s to send what is queued (the last results)."""
    deadline = time.monotonic() + wait
    while conn.has_backlog() and time.monotonic() < deadline:
        time.sleep(0.005)


def _flush_and_exit(
    conn: framing.Connection, code: int, wait: float = 1.0, runtime: WorkerRuntime | None = None
) -> None:
    if runtime is not None:
        runtime.cleanup()
    _drain(conn, wait)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _guarded(conn: framing.Connection, runtime: WorkerRuntime, step: Callable[[], T],
             in_process: bool) -> T | int:
    """``step()``, or the exit status when the rank ends in it. ``sys.exit`` in user code
    ends the process here (after the framework's cleanup), or, ``in_process`` (a process
    that outlives its rank: a Ray actor), gives its code."""
    try:
        return step()
    except _WorkerExit as exc:
        if not in_process:
            _flush_and_exit(conn, exc.code, runtime=runtime)
        return exc.code
    except framing.ConnectionLost:
        return 0
    except KeyboardInterrupt:  # SIGINT while idle (e.g. sent with group.send_signal): exit
        return 128 + signal.SIGINT
    except SystemExit:  # raised outside a call (a handler of the host process's)
        if in_process:
            runtime.cleanup()
            _drain(conn)
        raise


def start(conn: framing.Connection, runtime: WorkerRuntime, *,
          in_process: bool = False) -> int | None:
    """Wait for INIT and build the user object: None once READY is sent, else the exit
    status (the rank ended while starting)."""
    def initialise() -> int | None:
        if runtime.initialise():
            return None
        if not in_process:
            _flush_and_exit(conn, 1, runtime=runtime)
        return 1

    return _guarded(conn, runtime, initialise, in_process)


def finish(conn: framing.Connection, runtime: WorkerRuntime, code: int | None, *,
           in_process: bool = False, first: Any = None) -> int:
    """Serve until SHUTDOWN or end of stream (unless ``code``: the rank ended while
    starting), after ``first()`` if given; then clean up. The exit status."""
    def serve() -> int:
        if first is not None:
            first()
        return runtime.serve()

    if code is None:
        code = _guarded(conn, runtime, serve, in_process)
    runtime.cleanup()
    _drain(conn)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run(conn: framing.Connection, runtime: WorkerRuntime, *, in_process: bool = False) -> int:
    """Build the user object and serve until SHUTDOWN or end of stream; the exit status."""
    return finish(conn, runtime, start(conn, runtime, in_process=in_process),
                  in_process=in_process)


def start_in_actor(conn: framing.Connection,
                   stacks_fd: int | None = None) -> tuple[WorkerRuntime, int | None]:
    """The rank started inside a process that outlives it (its Ray actor's, on the
    actor's main thread): its runtime, and what :func:`start` gave. :func:`finish` (with
    ``in_process=True``) serves it; there ``sys.exit(code)`` in user code gives ``code``.
    The caller set up the rank's environment, output and signals, and ends what the rank
    left behind; with ``stacks_fd``, every thread's stack is written there when the node
    side asks (:func:`arm_stack_dumps`)."""
    global _STARTED
    _STARTED = (time.monotonic(), 0.0)  # the process was there before the rank
    kept.IN_RAY_WORKER = True  # its kept results name its Ray node (read from other machines)
    if stacks_fd is not None:
        arm_stack_dumps(stacks_fd)
    runtime = WorkerRuntime(conn)
    return runtime, start(conn, runtime, in_process=True)


def _default_signals() -> None:
    """Start as a fresh Python program would, whatever the node side ignored or blocked (a
    Ray worker's threads block signals, and the mask and ignored signals survive exec)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main() -> None:
    global _STARTED
    _STARTED = (time.monotonic(), _process_age())
    _default_signals()
    arm_stack_dumps()
    parent = int(os.environ.pop(config.ENV_PARENT_PID, "0"))
    _check_parent(parent)
    stream = open_stream(os.environ.pop(config.ENV_FD))
    # a socket to the controller over the network (a Ray actor's connect-back) comes with
    # the keys of its handshake: every frame on it is sealed and checked (wire.seal)
    keys = os.environ.pop(config.ENV_FRAME_KEYS, None)
    auth = seal.FrameAuth.taken_over(keys) if keys else None
    _watch_for_hangup(stream)
    conn = framing.Connection(stream, framing.BacklogWriter("phalanx-worker-writer"),
                              auth=auth)
    sys.exit(run(conn, WorkerRuntime(conn)))


if __name__ == "__main__":
    main()
