"""W1 from a fresh process: each trial is a new interpreter that imports one contender's
library, starts its workers until ready and stops them, timed from the child's first
statement (imports included) to ready.

The child imports only what its contender needs (never ``bench.contenders``, ``bench.run``,
psutil or numpy): for phalanx ``phalanx`` and ``bench.workloads``, for pipe_pool
``bench.pipe_pool`` and ``bench.workloads``. It runs in a session of its own, so that what
it leaves behind is found after it exits: an orphan is re-parented to init (or a
subreaper), and is no longer a descendant of the run, which the run's final leftover check
looks for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from bench.util import clock, describe

COLD = ("phalanx", "pipe_pool")  # the contenders a fresh process starts (not ray's)
TIMEOUT_S = 120.0  # one trial, child start to exit
LEFTOVER_GRACE_S = 2.0  # how long processes of the child's session may take to go
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where bench/ is

# argv: contender name, workers. One JSON line on stdout. phalanx's keywords are those of
# PhalanxContender.start; json is imported once the timed part is over.
SCRIPT = """\
import time; t0 = time.perf_counter()
import sys
name, n = sys.argv[1], int(sys.argv[2])
if name == "phalanx":
    import phalanx
    from bench.workloads import Bench
    t_import = time.perf_counter()
    group = phalanx.WorkerGroup(Bench, procs_per_node=n, echo_output=False, backend="local")
    t1 = time.perf_counter()
    group.shutdown()
elif name == "pipe_pool":
    from bench.pipe_pool import PipePool
    from bench.workloads import Bench
    t_import = time.perf_counter()
    pool = PipePool(Bench, n)
    t1 = time.perf_counter()
    pool.close()
else:
    sys.exit(f"no fresh-process start for {name!r}")
t2 = time.perf_counter()
import json
print(json.dumps({"ready_s": t1 - t0, "import_s": t_import - t0, "start_s": t1 - t_import,
                  "stop_s": t2 - t1}))
"""


def fresh_start(name: str, n: int) -> dict[str, Any]:
    """One trial: :data:`SCRIPT` for contender ``name`` with ``n`` workers in a fresh
    interpreter (the run's environment, the repository root as its directory). Returns
    the child's timings, ``process_s`` (this process's view: spawn to exit, the
    interpreter's own start and exit included) and ``left``, the processes of its session
    still alive after it exited (killed). Raises when the child fails, times out or
    prints no JSON line; the message ends with its stderr's tail."""
    return run_fresh([sys.executable, "-c", SCRIPT, name, str(n)])


def run_fresh(argv: list[str], env: dict[str, str] | None = None,
              timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run ``argv`` in a session of its own (the repository root as its directory) and
    return the JSON line it printed last, with ``process_s`` (spawn to exit, seen from
    here) and ``left`` (what it listed as left behind, and what of its session is still
    alive after it exited: killed). Raises when it fails, runs past ``timeout`` or prints
    no JSON line; the message ends with its stderr's tail."""
    t0 = clock()
    # Popen rather than subprocess.run: on a timeout, run's kill reaches the child only, and
    # its second communicate() waits for every process holding the child's pipes.
    proc = subprocess.Popen(argv, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # its tree first: processes in sessions of their own (torchrun's workers) too
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        _kill(proc.pid, children)
        _kill(proc.pid)
        proc.kill()
        try:
            out, err = proc.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        raise RuntimeError(f"timed out after {timeout:.0f} s; stderr: {_tail(err)}") from None
    process_s = clock() - t0
    left = _left_behind(proc.pid)
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}; stderr: {_tail(err)}")
    found = _parse(out)
    if found is None:
        raise RuntimeError(f"no JSON line on stdout {out[-80:]!r}; stderr: {_tail(err)}")
    return {**found, "process_s": process_s, "left": [*found.get("left", []), *left]}


def _parse(out: str) -> dict[str, float] | None:
    for line in reversed(out.splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and "ready_s" in found:
            return found
    return None


def _tail(text: str, chars: int = 220) -> str:
    """The last lines of ``text`` on one line (an error's message keeps its first line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(lines[-4:])
    return joined if len(joined) <= chars else "..." + joined[-chars:]


def _session(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid`` (zombies left out: dead, for their new parent to
    reap), its leader excluded."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.pid != sid and os.getsid(proc.pid) == sid
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def _left_behind(sid: int) -> list[str]:
    """Processes of session ``sid`` still alive ``LEFTOVER_GRACE_S`` after its leader
    exited; they are killed, and described."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        left = _session(sid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    text = describe(left)
    _kill(sid, left)
    return text


def _kill(sid: int, procs: list[psutil.Process] | None = None) -> None:
    for proc in _session(sid) if procs is None else procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
