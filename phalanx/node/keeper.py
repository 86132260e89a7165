"""The node supervisor process (see :mod:`phalanx.node.supervisor` for what it does and for the
controller's side): its request loop, the per-rank keepers it forks, and how a keeper
starts its rank.

Its start-up is on the critical path of every group's start (no rank can be forked before
it runs), so it imports only :mod:`os`, :mod:`marshal`, :mod:`select`, the C modules
under :mod:`signal` and :mod:`socket` (whose Python layers build enums it has no use for)
and :mod:`phalanx.node.proctree` -- not :mod:`phalanx.config`, nor :mod:`subprocess`: a
keeper forks and execs its rank itself (:func:`_start`), which also lets it arm the rank's
parent-death signal before ``exec`` (the rank does not load ``ctypes`` for that) and works
alike on every Python from 3.10. Measured under ``-S``, CPU time until it serves: ~11 ms,
where it took ~21 ms with ``subprocess``, the settings module and the enum layers (an
interpreter that does nothing takes ~6 ms).

What the controller's side tells it comes on its command line (the request socket's
descriptor and the controller's pid) and in each request (what to name the variable
holding the keeper's pid), never from :mod:`phalanx.config`.
"""

from __future__ import annotations

import marshal
import os
import select
import sys

from phalanx.node import proctree

TYPE_CHECKING = False  # typing's, without importing typing (this process starts lean)
if TYPE_CHECKING:  # _signal's names as typeshed knows them: it has no stub for _signal
    import _socket as socket
    import signal
    from typing import TypedDict

    # One start request, marshalled by phalanx.node.supervisor.Supervisor.spawn: the
    # rank's command, environment and directory; of the descriptors sent with it (indices
    # into them), those the rank inherits ("pass": its control stream, its stack file) and
    # its stdout, stderr and status pipe; the variables that name descriptors ("{i}": the
    # i-th one's number in the rank); the variable that tells the rank its keeper's pid;
    # and whether it runs as SCHED_BATCH (PHALANX_RANK_SCHED, phalanx.world.layout).
    # "preload": modules to import once in this process and fork the rank from, with
    # "preload_path" on sys.path for them (see _Preload); "forked" and "why_not", set
    # here: whether it is, and if not, why.
    StartRequest = TypedDict("StartRequest", {
        "argv": list[str], "env": dict[str, str], "cwd": str | None, "pass": list[int],
        "stdout": int, "stderr": int, "status": int, "fd_env": dict[str, str],
        "pid_env": str, "batch": bool, "preload": list[str], "preload_path": list[str],
        "forked": bool, "why_not": str,
    })
else:
    # CPython's C modules: signal.py and socket.py on top of them are ~6 ms of this
    # process's start (enum, selectors, array), for names it does not use
    try:
        import _signal as signal
        import _socket as socket
    except ImportError:  # pragma: no cover - another interpreter
        import signal
        import socket

_MAX_REQUEST = 1 << 20
_MAX_FDS = 16
_CANNOT_START = 127  # how a rank's child reports that exec failed (as a shell does)


def main() -> None:
    """The supervisor process: serve start requests until the controller goes away.

    Started as ``python -S -c BOOT SOCKET_FD CONTROLLER_PID``."""
    # Started from a thread of a Ray worker, this process inherits its blocked and ignored
    # signals: a keeper must receive the SIGTERM that says the supervisor died, and wait
    # for its rank (an ignored SIGCHLD would reap it unseen).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the controller's
    if sys.version_info < (3, 11):  # the controller could not ask Popen for a group of our own
        os.setpgid(0, 0)
    sock = socket.socket(fileno=int(sys.argv[1]))
    parent = int(sys.argv[2])
    proctree.become_subreaper()
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    try:
        controller = os.pidfd_open(parent)
        poller.register(controller, select.POLLIN)
    except (AttributeError, OSError):  # gone already, or an old kernel: EOF tells alone
        controller = -1
    keepers: dict[int, int] = {}  # pid -> pidfd (-1 without one)
    try:
        if parent and os.getppid() != parent:
            return
        while True:
            events = dict(poller.poll(1000))
            if controller in events:
                return
            if sock.fileno() in events:
                try:
                    request, fds = _receive(sock)
                except OSError:
                    return
                if not request:
                    return
                pid = _fork_keeper(request, fds, sock, controller)
                keepers[pid] = _watch(poller, pid)
            _reap(keepers, poller)
    finally:
        proctree.kill_descendants()


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One request and the descriptors sent with it (``socket.recv_fds``, on the C module);
    they close on exec: a rank inherits only those its request names."""
    request, ancillary, _, _ = sock.recvmsg(_MAX_REQUEST, socket.CMSG_LEN(_MAX_FDS * 4),
                                            socket.MSG_CMSG_CLOEXEC)
    fds = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True)
                    for i in range(0, len(data) - len(data) % 4, 4)]
    return request, fds


def _watch(poller: select.poll, pid: int) -> int:
    """A pidfd for a keeper, polled: it is reaped as soon as it exits, so that nobody
    waiting for it (its pid is the rank's parent) waits for the next timeout of the poll."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # an old kernel: reaped within the poll's timeout
        return -1
    poller.register(pidfd, select.POLLIN)
    return pidfd


def _reap(keepers: dict[int, int], poller: select.poll) -> None:
    """Reap keepers that ended; a keeper killed before its cleanup leaves orphans here."""
    killed = False
    for pid, status in proctree.reap_children():
        pidfd = keepers.pop(pid, None)
        if pidfd is None:
            continue
        if pidfd >= 0:
            poller.unregister(pidfd)
            os.close(pidfd)
        killed |= os.WIFSIGNALED(status)
    if killed:  # its rank and what the rank started were re-parented to us: end them
        me, table = os.getpid(), proctree.parent_table()
        orphans = [pid for pid, (ppid, _) in table.items() if ppid == me and pid not in keepers]
        for orphan in orphans:  # not the other keepers' ranks, which live on
            for pid in (orphan, *proctree.descendants(orphan, table)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _fork_keeper(data: bytes, fds: list[int], sock: socket.socket, controller: int) -> int:
    request = marshal.loads(data)
    if request.get("preload"):
        why_not = _PRELOAD.ready(request)
        request["forked"] = why_not is None
        request["why_not"] = why_not or ""
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:  # the keeper
        code = 1
        try:
            sock.close()
            if controller >= 0:
                os.close(controller)
            code = _keep(request, fds, supervisor)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _keep(request: StartRequest, fds: list[int], supervisor: int) -> int:
    """Start one rank, report its pid and exit status, then end what it left behind."""
    proctree.become_subreaper()
    signal.signal(signal.SIGTERM, _orphaned)
    proctree.die_with_parent(signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the signal was armed
        return 1
    status = fds[request["status"]]
    env = dict(request["env"])
    for key, template in request["fd_env"].items():
        env[key] = template.format(*fds)
    env[request["pid_env"]] = str(os.getpid())
    if request.get("why_not"):
        _report(status, "note", request["why_not"])
    try:
        rank = _start(request, fds, env)
    except OSError as exc:
        _report(status, "error", str(exc) if type(exc) is _CannotStart else
                f"{type(exc).__name__}: {exc}")
        return 1
    for fd in fds:
        if fd != status:
            os.close(fd)
    _report(status, "pid", rank)
    while True:  # adopted orphans that exit are reaped here too
        # who exited, left a zombie until its status is told: the node side, woken by the
        # end of the rank's stream, finds the status in /proc or already on the pipe (were
        # the rank reaped first, it would wait for this line: a millisecond of scheduling)
        exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        if exited is None:  # pragma: no cover - only with WNOHANG
            continue
        if exited.si_pid == rank:
            _report(status, "status", _wait_status(exited))
            os.waitpid(rank, 0)
            break
        os.waitpid(exited.si_pid, 0)
    proctree.kill_descendants()
    return 0


def _wait_status(exited: os.waitid_result) -> int:
    """The wait status (as ``os.waitpid`` gives it) of a child ``os.waitid`` reported."""
    if exited.si_code == os.CLD_EXITED:
        return exited.si_status << 8
    if exited.si_code == os.CLD_DUMPED:
        return exited.si_status | 0x80
    return exited.si_status  # CLD_KILLED: the signal


def _start(request: StartRequest, fds: list[int], env: dict[str, str]) -> int:
    """Fork and exec the rank as ``subprocess.Popen`` would (its own process group, stdin
    left on the keeper's ``/dev/null``, output on the descriptors handed over, only those
    named inherited, SIGPIPE back to default) and one thing more: the kernel SIGKILLs it
    if this keeper dies, armed before ``exec`` so no window is left. Raises OSError (e.g.
    a cwd that does not exist) when the fork or ``exec`` could not happen."""
    argv, cwd = request["argv"], request["cwd"]
    stdout, stderr = fds[request["stdout"]], fds[request["stderr"]]
    inherited = [fds[i] for i in request["pass"]]
    keeper = os.getpid()
    errors_r, errors_w = os.pipe()  # closes on exec: end of file there means it ran
    pid = os.fork()
    if pid == 0:  # the rank, until exec
        try:
            os.close(errors_r)
            os.setpgid(0, 0)
            proctree.die_with_parent(signal.SIGKILL)
            if os.getppid() != keeper:
                os._exit(1)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            for fd in inherited:
                os.set_inheritable(fd, True)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; a rank's
                signal.signal(sig, signal.SIG_DFL)        # programs expect the defaults
            if request.get("batch"):  # PHALANX_RANK_SCHED (phalanx.world.layout)
                _schedule_as_batch()
            if cwd:
                os.chdir(cwd)
            if request.get("forked"):
                os.close(errors_w)  # it runs: nothing more to report through it
                _run_forked(argv, env)  # never returns
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 - reported to the keeper, then exit
            try:
                os.write(errors_w, f"{type(exc).__name__}: {exc}".encode(errors="replace"))
            finally:
                os._exit(_CANNOT_START)
    os.close(errors_w)
    try:
        chunks = []
        while True:
            chunk = os.read(errors_r, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(errors_r)
    if chunks:
        os.waitpid(pid, 0)
        raise _CannotStart(b"".join(chunks).decode(errors="replace"))
    return pid


class _Preload:
    """The modules ranks import, imported once in this process (the node supervisor), so
    that a rank forked from it (by its keeper, with no ``exec``) starts with them loaded:
    a node pays ``import torch`` once, not once per rank, and again at every recreate.

    :meth:`ready` says whether a rank can be forked from here, or why not -- the rank is
    then started as a fresh interpreter, as without preloading, and the keeper reports the
    reason on the status pipe (``note TEXT``) for the node side to log:

    - it runs another interpreter (``python=``), or its environment sets a variable the
      interpreter reads as it starts (``PYTHONPATH``, ``LD_PRELOAD``, ...) otherwise than
      this process's (for that rank only);
    - a module could not be imported here (the rank will try itself);
    - importing started a thread (a fork copies no thread, but does copy the locks the
      others held) or initialised CUDA (a forked child cannot use it);
    - a preloaded module's file changed since (a rank must run the code on disk).

    The import runs once, on the first request that names modules; this process is
    single-threaded, so nothing else runs meanwhile. It was started with ``-S``: ``site``
    is run then, to find the packages a rank would find.
    """

    def __init__(self) -> None:
        self.modules: list[str] | None = None  # imported (None: not yet tried)
        self.why_not: str | None = None  # why no rank can be forked from here
        self.files: dict[str, float] = {}  # file -> its mtime when imported

    def ready(self, request: StartRequest) -> str | None:
        if request["argv"][0] != sys.executable:
            return f"the ranks run another interpreter ({request['argv'][0]})"
        env = request["env"]
        for key in sorted(set(env) | set(os.environ)):
            if (key.startswith(READ_AT_START) and key not in APPLIED_LATER
                    and env.get(key) != os.environ.get(key)):
                return (f"the rank's {key} differs from the node's (read as an interpreter "
                        "starts)")
        if self.modules is None:
            self._load(request["preload"], request.get("preload_path", []))
        if self.why_not is None:
            for path, mtime in self.files.items():
                try:
                    changed = os.stat(path).st_mtime != mtime
                except OSError:
                    changed = True
                if changed:
                    self.why_not = f"{path} changed since it was preloaded"
                    break
        return self.why_not

    def _load(self, modules: list[str], path: list[str]) -> None:
        import gc
        import importlib

        if "site" not in sys.modules:
            import site

            site.main()
        sys.path.extend(p for p in path if p not in sys.path)
        self.modules = []
        failed = []
        # OpenMP starts its pool as torch is imported, and a child forked after the pool
        # ran hangs in its first parallel region: imported with one thread, no pool is
        # made here; each rank sets its own count after the fork (_threads_as_fresh)
        given = {key: os.environ.get(key) for key in _ONE_THREAD}
        os.environ.update(dict.fromkeys(_ONE_THREAD, "1"))
        try:
            for name in modules:
                try:
                    module = importlib.import_module(name)
                except BaseException as exc:  # noqa: BLE001 - any error: the rank's to see
                    failed.append(f"{name} ({type(exc).__name__}: {exc})")
                    continue
                self.modules.append(name)
                where = getattr(module, "__file__", None)
                if where and not where.startswith(sys.base_prefix):  # the stdlib stays
                    self.files[where] = os.stat(where).st_mtime
        finally:
            for key, value in given.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        threads = len(os.listdir("/proc/self/task"))
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if threads > 1:
            self.why_not = (f"importing {', '.join(self.modules)} started {threads - 1} "
                            "thread(s): a fork would copy the locks they hold")
        elif cuda is not None and cuda.is_initialized():
            self.why_not = f"importing {', '.join(self.modules)} initialised CUDA"
        elif failed and not self.modules:
            self.why_not = f"nothing could be preloaded: {'; '.join(failed)}"
        gc.freeze()  # what is imported stays shared between the ranks' pages


_PRELOAD = _Preload()
# Variables the interpreter or the dynamic loader read as a process starts: a rank whose
# environment sets one otherwise than a process started ahead of it (this one, a Ray
# rank's prestarted interpreter) needs a fresh interpreter; but PYTHONUNBUFFERED, which a
# rank's streams take after the start (_fresh_streams here).
READ_AT_START = ("LD_", "PYTHON", "MALLOC_")
APPLIED_LATER = ("PYTHONUNBUFFERED",)
_ONE_THREAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _threads_as_fresh(env: dict[str, str]) -> None:
    """The intra-op thread count torch takes in a fresh interpreter, where the preloading
    set one: one per physical core the rank may run on, or fewer as ``OMP_NUM_THREADS`` /
    ``MKL_NUM_THREADS`` say; with MKL (x86 builds) never more than those cores."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    cores = _physical_cores()
    mkl = bool(getattr(getattr(torch.backends, "mkl", None), "is_available", bool)())
    count = cores
    for key in ("MKL_NUM_THREADS", "OMP_NUM_THREADS") if mkl else ("OMP_NUM_THREADS",):
        given = env.get(key, "").strip()
        if given.isdigit() and int(given) > 0:
            count = min(int(given), cores) if mkl else int(given)
            break
    torch.set_num_threads(count)


def _physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (hyperthreads of one
    core counted once); the CPUs themselves where the topology cannot be read."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def _run_forked(argv: list[str], env: dict[str, str]) -> None:
    """Become the rank in this forked process, as ``exec`` of ``argv`` (``python -c
    CODE``) would have: its environment, a fresh ``__main__``, Python's default signal
    handlers, fresh random state; then run ``CODE`` and exit as the interpreter would
    (``SystemExit``'s code, atexit handlers, non-daemon threads joined, streams flushed)."""
    import atexit
    import threading
    import types

    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-c"]
    _fresh_streams(bool(env.get("PYTHONUNBUFFERED")))
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # what Python ignores as it starts (the keeper set them back to the default for exec):
    # a write to a closed pipe raises BrokenPipeError, it does not kill the rank
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _threads_as_fresh(env)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # its global state is seeded once, at import: reseed it
        numpy_random.seed()  # (Python's random reseeds itself in a forked child)
    code: object = 0
    try:
        exec(compile(argv[2], "<string>", "exec"), main.__dict__)  # phalanx's own boot
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught one
        import traceback

        traceback.print_exc()
        code = 1
    try:
        # what the interpreter does at its exit, which this process never reaches
        threading._shutdown()  # type: ignore[attr-defined]  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        if code is None:
            code = 0
        elif not isinstance(code, int):
            sys.stderr.write(f"{code}\n")
            code = 1
        os._exit(code)


def _fresh_streams(unbuffered: bool) -> None:
    """``sys.stdout`` and ``sys.stderr`` on descriptors 1 and 2 as a fresh interpreter makes
    them (``PYTHONUNBUFFERED``: no buffer, each write goes out at once)."""
    import io

    for fd, name, errors in ((1, "stdout", None), (2, "stderr", "backslashreplace")):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                  encoding=encoding, errors=errors or getattr(old, "errors", None),
                                  line_buffering=not unbuffered and name == "stderr",
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _schedule_as_batch() -> None:
    """``SCHED_BATCH`` for this process (its nice value kept), where the system has it."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: the inherited policy
        pass


class _CannotStart(OSError):
    """exec did not happen; the text says why, as the rank's child saw it."""


def _orphaned(signum: int, frame: object) -> None:
    """The supervisor died without ending us (SIGKILLed): end the rank's tree, all of which
    is below this keeper, and go."""
    proctree.kill_descendants()
    os._exit(1)


def _report(fd: int, what: str, value: object) -> None:
    """One line on the status pipe: ``pid N``, ``status N`` (a wait status), ``error TEXT``
    or ``note TEXT`` (why the rank was not forked from preloaded modules)."""
    text = " ".join(str(value).split())  # one line
    try:
        os.write(fd, f"{what} {text}\n".encode())
    except OSError:  # the controller is gone: the supervisor ends us all
        pass
