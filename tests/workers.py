"""Worker classes and crash helpers shared by the tests.

This is an importable module, so the controller pickles these classes by reference and
each worker imports this module itself -- *after* its environment was set, which
``ENV_AT_IMPORT`` records.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ENV_AT_IMPORT = {
    name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "PHALANX_RANK", "USER_VAR")
}


def my_rank() -> int:
    return int(os.environ["RANK"])


class Probe:
    """A general-purpose worker: reports its environment, sleeps, records, fails on demand."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args
        self.kwargs = kwargs
        self.log: list = []
        self.children: list[subprocess.Popen] = []

    # -- identity and environment --
    def init_args(self):
        return self.args, self.kwargs

    def env(self, *names: str) -> dict:
        return {name: os.environ.get(name) for name in names}

    def env_at_import(self) -> dict:
        return dict(ENV_AT_IMPORT)

    def pid(self) -> int:
        return os.getpid()

    def rank(self) -> int:
        return my_rank()

    def cwd(self) -> str:
        return os.getcwd()

    def ray_node(self) -> str:
        """The address of the Ray node this rank runs on (ray backend), read off the
        command line of that node's raylet, independently of what phalanx says."""
        import psutil

        raylet = psutil.Process(int(os.environ["RAY_RAYLET_PID"])).cmdline()
        return next(arg.split("=", 1)[1] for arg in raylet
                    if arg.startswith("--node_ip_address="))

    def print_once(self, text: str) -> None:
        print(text, flush=True)

    def cpu_policy(self) -> str:
        """How the kernel schedules this process: "batch", "normal" or another policy."""
        policy = os.sched_getscheduler(0)
        return {os.SCHED_BATCH: "batch", os.SCHED_OTHER: "normal"}.get(policy, str(policy))

    def on_main_thread(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def bind_master_port(self) -> bool:
        """What rank 0 of torch.distributed does: listen on MASTER_ADDR:MASTER_PORT."""
        with socket.socket() as sock:
            sock.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            sock.listen()
        return True

    # -- plain calls --
    def echo(self, *args, **kwargs):
        return args, kwargs

    def identity(self, value):
        return value

    def add(self, a, b=0):
        return a + b

    def sleep(self, seconds: float, value=None):
        time.sleep(seconds)
        return value

    async def async_sleep(self, seconds: float, value=None):
        await asyncio.sleep(seconds)
        return value

    def record(self, item) -> int:
        self.log.append(item)
        return len(self.log)

    def history(self) -> list:
        return list(self.log)

    def clear(self) -> None:
        self.log.clear()

    def array_summary(self, array) -> dict:
        return {
            "sha256": hashlib.sha256(array.tobytes()).hexdigest(),
            "sum": float(array.sum()),
            "shape": tuple(array.shape),
            "dtype": str(array.dtype),
        }

    def make_array(self, n: int):
        import numpy as np

        return np.arange(n, dtype=np.float64) * (my_rank() + 1)

    # -- failures --
    def raise_value_error(self, message: str):
        raise ValueError(message)

    def fail_on_rank(self, rank: int, sleep: float):
        """Rank ``rank`` raises at once; every other rank sleeps ``sleep`` seconds."""
        if my_rank() == rank:
            raise KeyError(f"rank {rank} failed on purpose")
        time.sleep(sleep)
        return my_rank()

    def raise_unrebuildable(self):
        raise NeedsTwoArguments("cannot be rebuilt here", 7)

    def return_unpicklable(self):
        return threading.Lock()

    def sys_exit(self, code=None):
        sys.exit(code)

    def exit_with(self, code: int, stderr_lines: tuple = ()):
        for line in stderr_lines:
            print(line, file=sys.stderr, flush=True)
        os._exit(code)

    def kill_self(self, stderr_lines: tuple = ()):
        """SIGKILL itself right after writing ``stderr_lines`` (still unread then)."""
        for line in stderr_lines:
            print(line, file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    # -- output and processes --
    def say(self, text: str, stderr: bool = False) -> int:
        print(text, file=sys.stderr if stderr else sys.stdout, flush=True)
        return my_rank()

    def say_long_lines(self, length: int, count: int) -> None:
        """``count`` lines of ``length`` copies of this rank's digit, in small writes."""
        digit = str(my_rank() % 10)
        for _ in range(count):
            for _ in range(length // 4096):
                sys.stdout.write(digit * 4096)
            sys.stdout.write(digit * (length % 4096) + "\n")
        sys.stdout.flush()

    def spawn_sleeper(self, new_session: bool = False) -> int:
        proc = subprocess.Popen(["sleep", "60"], start_new_session=new_session)
        self.children.append(proc)
        return proc.pid

    def hang(self) -> None:
        time.sleep(60)

    def cleanup(self) -> None:
        """A cleanup method for shutdown(cleanup=...): marks that it ran on this rank."""
        if my_rank() == self.kwargs.get("fail_cleanup_on"):
            raise RuntimeError("cleanup failed on purpose")
        time.sleep(self.kwargs.get("cleanup_delay", 0.0))
        Path(self.kwargs["marker_dir"], f"rank{my_rank()}").write_text(str(os.getpid()))

    # -- crash matrix --
    def crash_running(self, kind: str | None):
        if kind is None:
            return "ok"
        crash(kind)

    def return_crash_on_pickle(self, kind: str | None):
        return "ok" if kind is None else CrashOnPickle(kind)

    def return_crash_on_unpickle(self, kind: str | None):
        return "ok" if kind is None else CrashOnUnpickle(kind)


class FailingConstructor:
    """Raises in the constructor on ``fail_rank``; other ranks sleep ``sleep`` seconds first."""

    def __init__(self, fail_rank: int, sleep: float = 0.0, exit_code: int | None = None,
                 pid_dir: str | None = None) -> None:
        if pid_dir is not None:
            Path(pid_dir, f"rank{my_rank()}").write_text(str(os.getpid()))
        if my_rank() == fail_rank:
            if exit_code is not None:
                os._exit(exit_code)
            raise RuntimeError(f"constructor failed on rank {fail_rank}")
        time.sleep(sleep)

    def ping(self) -> int:
        return my_rank()


class FailsOnceFlagged(Probe):
    """Constructs normally until ``flag`` exists; then rank 1's constructor fails in the way
    ``how`` names: ``"raise"`` at once, or ``"hang"`` (never becomes ready)."""

    def __init__(self, flag: str, how: str = "raise") -> None:
        super().__init__(flag, how)
        if my_rank() == 1 and os.path.exists(flag):
            if how == "hang":
                time.sleep(600)
            raise RuntimeError("rank 1 cannot be rebuilt")


class NeedsTwoArguments(Exception):
    """An exception that pickle cannot rebuild (its __init__ takes two arguments)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class SlowConstructor:
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)

    def ping(self) -> int:
        return my_rank()


class CountingPickles:
    """Counts, in the process that pickles it, how many times it was pickled."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return (CountingPickles, ())


# ----------------------------------------------------------------------- crash helpers

CRASH_KINDS = ("exception", "sys.exit", "os._exit", "SIGSEGV", "SIGKILL")


class CrashError(Exception):
    """The exception the ``"exception"`` crash kind raises."""


def crash(kind: str) -> None:
    """Fail the current process in the way ``kind`` names."""
    if kind == "exception":
        raise CrashError("injected failure")
    if kind == "sys.exit":
        sys.exit(5)
    if kind == "os._exit":
        os._exit(3)
    if kind in ("SIGSEGV", "SIGKILL"):
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        except (ImportError, OSError, ValueError):
            pass
        os.kill(os.getpid(), getattr(signal, kind))
        time.sleep(10)  # the signal is delivered before this returns
    raise ValueError(f"unknown crash kind {kind!r}")


class CrashOnPickle:
    """Crashes whichever process pickles it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __reduce__(self):
        crash(self.kind)


class CrashOnUnpickle:
    """Pickles fine; crashes whichever process unpickles it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __getstate__(self):
        return {"kind": self.kind}

    def __setstate__(self, state):
        crash(state["kind"])


class MeshProbe(Probe):
    """A Probe whose ``note`` records each call's arguments (read back with ``history``)."""

    def note(self, *args, **kwargs):
        self.log.append((args, kwargs))
        return my_rank(), args, kwargs


# ------------------------------------------------------------- supervision and process trees


class Supervised(Probe):
    """A Probe that can wedge itself beyond the heartbeat thread's reach and start a tree of
    subprocesses in every way a worker may (for the supervision and process-tree tests)."""

    def whoami(self) -> int:
        return my_rank()

    def deadlock_holding_gil(self) -> None:
        """Lock a plain mutex twice from a C call that keeps the GIL (``PyDLL``): no thread
        of this process runs Python again."""
        import ctypes

        libc = ctypes.PyDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)

    def busy(self, seconds: float) -> int:
        """Pure Python for ``seconds`` (the GIL changes hands every few ms)."""
        deadline = time.monotonic() + seconds
        spins = 0
        while time.monotonic() < deadline:
            spins += 1
        return spins

    def spawn_tree(self) -> dict[str, int]:
        """Start a sleeper in this process group, one in a new session, one orphaned by a
        shell and one double-forked into its own session; their pids by kind."""
        same_group = subprocess.Popen(["sleep", "1000"])
        new_session = subprocess.Popen(["sleep", "1001"], start_new_session=True)
        shell = subprocess.run(
            "sleep 1002 </dev/null >/dev/null 2>&1 & echo $!", shell=True,
            capture_output=True, text=True, check=True, timeout=10)
        self.children += [same_group, new_session]
        return {
            "same_group": same_group.pid,
            "new_session": new_session.pid,
            "shell_background": int(shell.stdout.strip()),
            "double_fork": _double_fork(["sleep", "1003"]),
        }


def _double_fork(argv: list[str]) -> int:
    """Run ``argv`` as a grandchild in a session of its own whose parent has exited (a
    classic daemon); its pid, once it runs ``argv``."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # only async-signal-safe calls from here to exec
        try:
            os.close(read_fd)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:  # the write end closes on exec: EOF says "exec'd"
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.execvp(argv[0], argv)
            os.write(write_fd, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(child, 0)
    with os.fdopen(read_fd, "rb") as pipe:
        return int(pipe.read())


class IgnoresTerm(Supervised):
    """A Supervised worker that ignores SIGTERM (only SIGKILL ends it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class TorchReadmit:
    """A torch.distributed rank that can be re-admitted into a new gloo group: it joins the
    group in its constructor unless it was started to be re-admitted (``PHALANX_READMIT``)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if os.environ.get("PHALANX_READMIT") != "1":
            dist.init_process_group("gloo")

    def readmit(self, rendezvous: dict) -> int:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.update(rendezvous)
        dist.init_process_group("gloo")
        return dist.get_rank()

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def pid(self) -> int:
        return os.getpid()


class OptionNamed:
    """A worker whose methods have parameters named as phalanx's call options."""

    def __init__(self) -> None:
        self.calls = 0

    def f(self, x=0, timeout=None, keep="default", workers=None, method=None):
        self.calls += 1
        return {"x": x, "timeout": timeout, "keep": keep, "workers": workers,
                "method": method, "rank": my_rank()}

    def plain(self, x=0):
        self.calls += 1
        return x

    def count(self):
        return self.calls

    def sleep(self, seconds):
        time.sleep(seconds)
        return my_rank()
