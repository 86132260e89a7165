"""Process trees on Linux, read from ``/proc``: who descends from whom, and killing a
subtree until nothing of it is left.

A process that should outlive none of what it started makes itself a *child subreaper*
(:func:`become_subreaper`): whatever its descendants orphan (a double fork, a ``setsid``
daemon whose parent exited) is re-parented to it instead of to init, so everything it ever
started stays below it and :func:`kill_descendants` finds it. The node supervisor, the
per-rank keepers it forks and the Ray rank actor all do this.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # typing's, without importing typing (the supervisor starts lean)
if TYPE_CHECKING:  # the same names, as typeshed knows them (it has no stub for _signal)
    import signal

    signals = signal  # assigned, not imported: an export (the warden imports it from here)
else:
    try:  # CPython's C module: signal.py's enums are ~2.5 ms of the node supervisor's start
        import _signal as signals
    except ImportError:  # pragma: no cover - another interpreter
        import signal as signals

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # only where prctl is used (the supervisor, its keepers): not at import

    try:
        result: int = ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
        return result == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants; False where the system cannot."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signals.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def parent_table() -> dict[int, tuple[int, str]]:
    """Every process now: pid -> (parent pid, state letter, e.g. ``Z`` for a zombie)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is None:  # exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split(b" ", 2)
        table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """The pids below ``root`` that are still running (zombies left out), parents first.

    Without ``table``, read where the kernel keeps each task's children
    (``/proc/PID/task/TID/children``): a few files for a small tree, where the whole
    process table is two reads per process of the machine (~1 ms of CPU for 70 of them,
    spent by a keeper just as its rank dies, beside the controller being told of it)."""
    if table is None:
        found = _descendants_by_children(root)
        if found is not None:
            return found
        table = parent_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), ()):
            queue.append(child)
            if table[child][1] != "Z":
                found.append(child)
    return found


def _descendants_by_children(root: int) -> list[int] | None:
    """:func:`descendants` from the kernel's lists of children; None where it keeps none
    (a kernel built without ``CONFIG_PROC_CHILDREN``, or no ``/proc``)."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    found: list[int] = []
    queue = [root]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # exited meanwhile: its children went to a subreaper, seen next time
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", "rb") as f:
                    listed = f.read().split()
            except OSError:
                continue
            for child in map(int, listed):
                queue.append(child)
                if state(child) not in (None, "Z"):
                    found.append(child)
    return found


def signal_descendants(pid: int, sig: int) -> None:
    """Signal the descendants of ``pid`` that left its process group (e.g. via setsid).

    Read from /proc, not with psutil: importing psutil while the interpreter exits (a
    group shut down by its atexit handler) would clear Python's note of an unhandled
    Ctrl-C, and the script would exit with status 1 instead of dying of SIGINT."""
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return
    for child in descendants(pid):
        try:
            os.kill(child, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_children() -> list[tuple[int, int]]:
    """Reap every child that has exited, without blocking: ``(pid, wait status)`` each."""
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def has_children() -> bool:
    """Whether this process has a child, running or exited and not yet reaped (none reaped
    here)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def kill_descendants(timeout: float = 5.0) -> list[tuple[int, int]]:
    """SIGKILL everything below this process (a subreaper) and reap it, over and over,
    until nothing is left or ``timeout`` passes; what was reaped, as ``(pid, status)``.

    A subreaper with no child has no descendant (what its children orphan is re-parented
    to it), so a keeper whose rank left nothing behind returns without reading ``/proc``."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - no /proc
        return reap_children()
    me = os.getpid()
    deadline = time.monotonic() + timeout
    reaped = []
    while True:
        reaped += reap_children()
        if not has_children():
            return reaped
        left = descendants(me)
        for pid in left:
            try:
                os.kill(pid, signals.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() >= deadline:
            import logging  # only here: the node supervisor imports this module at start

            logging.getLogger(__name__).error("processes %s survived SIGKILL for %.1f s",
                                              left, timeout)
            return reaped + reap_children()
        time.sleep(0.002)


def _stat(pid: int) -> bytes | None:
    """``/proc/PID/stat``, or None when the process is gone or the file cannot be read.
    Read with ``os`` calls, not ``open()``: this is on the path from a rank's death to its
    caller's error, and a file object's set-up costs twice the read itself."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stat = part = os.read(fd, 4096)  # (the kernel hands the whole file to one read)
        while part:
            part = os.read(fd, 4096)
            stat += part
    except OSError:
        return None
    finally:
        os.close(fd)
    return stat


def state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), None if
    it is gone."""
    stat = _stat(pid)
    if stat is None:
        return None
    return stat[stat.rfind(b")") + 2:][:1].decode()


def stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat``'s fields after the command name (the state first), or None when
    the process is gone or the file cannot be read."""
    stat = _stat(pid)
    if stat is None:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def exit_status(pid: int) -> int | None:
    """The wait status of ``pid`` once it is exiting, from ``/proc/PID/stat``'s
    ``exit_code`` field (Linux 3.5): a zombie's (exited, not yet reaped by its parent), or
    that of a process still tearing itself down. The kernel sets the status as the exit
    begins, and closes the process's descriptors before it is a zombie: a single-threaded
    process's pipes end about 2 ms before that here. A process that runs has 0 there, so
    a status of 0 counts only from a zombie. None if it runs, is gone, exits with 0 and is
    no zombie yet, or the kernel does not say. (Ask only of a process known to be ending:
    one stopped under a tracer that resumed it with a signal holds that signal there for
    a moment.)"""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 50:
        return None
    try:
        status = int(fields[49])  # field 52 of the file: the third is the state
    except ValueError:
        return None
    if fields[0] == b"Z" or (status and fields[0] in (b"R", b"D")):
        return status
    return None


def catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler installed for ``sig`` (from ``/proc/PID/status``)."""
    return signal_in(f"/proc/{pid}/status", b"SigCgt:", sig)


def signal_in(status: str, field: bytes, sig: int) -> bool:
    """Whether ``sig``'s bit is set in the mask ``field`` (``SigCgt:``, ``SigPnd:``, ...)
    of the ``/proc`` status file ``status`` (False if it cannot be read)."""
    try:
        with open(status, "rb") as f:
            for line in f:
                if line.startswith(field):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
