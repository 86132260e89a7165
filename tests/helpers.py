"""Small test utilities: waiting on conditions, process liveness, controller scripts.

Importing it needs no pytest: the test clusters (tests/slurmcluster.py, ...) use it, and
they also run outside the suite (``python -m bench.slurm``, where only phalanx and its
bench extra are installed). What skips or marks a test imports pytest where it does so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import pytest

REPO = Path(__file__).resolve().parent.parent

# Groups that deliberately outlive one test (module-scoped fixtures): their live workers
# are not leftovers of the test that happens to be running.
LONG_LIVED: list = []
# Processes of the Ray test cluster (its daemons, and below them the actors' processes,
# which the Ray leak check covers): they outlive every test by design.
CLUSTER_ROOTS: set[int] = set()


# The optional packages tests may need (the import name), and how a user installs each.
EXTRAS = {
    "torch": "pip install 'phalanx[torch]'",
    "ray": "pip install 'phalanx[ray]'",
    "jax": "pip install 'phalanx[jax]'",
    "tensorflow": "pip install 'phalanx[tensorflow]'",
    "monarch": "pip install 'phalanx[monarch]' (the torchmonarch package)",
}


def installed(package: str) -> bool:
    """Whether ``package`` can be imported, decided the way phalanx decides it (find_spec,
    which does not import the package: importing torch or ray takes seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _missing_reason(package: str) -> str:
    install = EXTRAS.get(package.partition(".")[0], f"pip install {package}")
    return f"{package} is not installed ({install})"


def requires(package: str) -> None:
    """Skip the running test, with the reason, when the optional ``package`` is missing."""
    __tracebackhide__ = True  # report the test's line, not this one
    import pytest

    if not installed(package):
        pytest.skip(_missing_reason(package))


def needs(package: str) -> pytest.MarkDecorator:
    """A marker that skips a test, with the reason, when the optional ``package`` is
    missing: ``@helpers.needs("torch")``. Checked at collection, without importing it."""
    import pytest

    return pytest.mark.skipif(not installed(package), reason=_missing_reason(package))


@contextlib.contextmanager
def long_lived_group(*args, **kwargs):
    """A group shared by the tests of one module (their workers are not leftovers)."""
    from phalanx import WorkerGroup

    group = WorkerGroup(*args, **kwargs)
    LONG_LIVED.append(group)
    try:
        yield group
    finally:
        LONG_LIVED.remove(group)
        group.shutdown(timeout=5)


def token_file(directory: Path) -> str:
    """A fresh cluster token in ``directory``/token, private to its owner (as agents
    require: a token file others can read is refused)."""
    path = Path(directory) / "token"
    path.write_text(secrets.token_urlsafe(32))
    path.chmod(0o600)
    return str(path)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run, in order (zombies count as dead)."""
    return [pid for pid in pids if pid_alive(pid)]


def wait_dead(pids: list[int] | int, timeout: float = 5.0) -> bool:
    """Wait until every pid has exited (without reaping anything)."""
    pids = [pids] if isinstance(pids, int) else list(pids)
    return wait_until(lambda: not any(pid_alive(p) for p in pids), timeout)


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def live_worker_pids(group) -> set[int]:
    """A live group's worker processes, and on the local backend its node supervisor with
    the keepers it forked for them."""
    pids = {h.pid for h in group.health() if h.alive and h.pid is not None}
    supervisor = getattr(group._backend, "supervisor_pid", None)
    if supervisor is not None:
        try:
            pids |= {supervisor} | {p.pid for p in psutil.Process(supervisor).children()}
        except psutil.Error:
            pass
    return pids


def stray_children() -> list[psutil.Process]:
    """Live descendants of this process that belong to no long-lived group."""
    allowed: set[int] = set()
    for group in LONG_LIVED:
        allowed |= live_worker_pids(group)
    for root in CLUSTER_ROOTS:
        try:
            allowed |= {root} | {p.pid for p in psutil.Process(root).children(recursive=True)}
        except (psutil.Error, OSError):  # gone (psutil may say so as its /proc file went)
            pass
    strays = []
    for child in psutil.Process().children(recursive=True):
        if child.pid not in allowed and pid_alive(child.pid):
            strays.append(child)
    return strays


def script_env() -> dict[str, str]:
    """The environment of a controller script: this checkout importable, no progress bar,
    and the Ray test cluster's address when one runs (so backend="ray" joins it)."""
    env = dict(os.environ)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PHALANX_PROGRESS"] = "0"
    return env


def write_script(directory: Path, source: str, name: str = "controller.py") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


def run_script(path: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run a controller script to completion with this interpreter."""
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=str(path.parent),
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_script(path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(path)],
        cwd=str(path.parent),
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def running_script(path: Path):
    """:func:`start_script`; on the way out the controller is ended (if it still runs) and
    its pipes closed, however the test went."""
    controller = start_script(path)
    try:
        yield controller
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(10)
        controller.stdout.close()
        controller.stderr.close()


def json_lines(text: str) -> list:
    """The JSON documents a script printed, one per line, ignoring other output."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):
            out.append(json.loads(line))
    return out


class RankControl:
    """Faults for the contract suite, delivered through ``group.send_signal`` (the backend's
    own path to a rank's process)."""

    def __init__(self, reports_signal: bool) -> None:
        self.reports_signal = reports_signal

    def kill(self, group, rank: int, wait: bool = True) -> None:
        """SIGKILL the rank; with ``wait``, until the group has noticed."""
        import signal

        group.send_signal(signal.SIGKILL, workers=[rank])
        if wait:
            assert wait_until(lambda: not group.health()[rank].alive, 10), \
                f"rank {rank} still looks alive 10 s after SIGKILL"

    def stop(self, group, rank: int) -> None:
        import signal

        group.send_signal(signal.SIGSTOP, workers=[rank])

    def resume(self, group, rank: int) -> None:
        import signal

        group.send_signal(signal.SIGCONT, workers=[rank])

    def signal(self, group, rank: int, sig: int) -> None:
        group.send_signal(sig, workers=[rank])

    def killed_signal(self, name: str = "SIGKILL") -> str | None:
        """The signal name a WorkerDied reports for a rank this fixture killed."""
        return name if self.reports_signal else None


def shared_memory_blocks(pid: int) -> set[str]:
    """The names of phalanx's shared-memory blocks that process ``pid`` holds open or maps
    (empty once it is gone)."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            names.update(_BLOCK.findall(maps.read()))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                names.update(_BLOCK.findall(os.readlink(f"/proc/{pid}/fd/{fd}")))
            except OSError:
                continue
    except OSError:  # gone
        pass
    return names


def shared_memory_holders(name: str) -> list[int]:
    """Every process on this machine that holds or maps block ``name``."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and name in shared_memory_blocks(int(p))]


_BLOCK = re.compile(r"memfd:phalanx-([0-9a-f]+)")


def shmem_bytes() -> int:
    """The machine's shared memory in use now (/proc/meminfo's Shmem)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Shmem line in /proc/meminfo")


def make_venv(path: Path, *entries: str) -> str:
    """A venv at ``path`` (no pip: fast) whose site-packages names ``entries`` in a ``.pth``
    file; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=60)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=30).stdout.strip()
    Path(site, "phalanx_test.pth").write_text("".join(f"{e}\n" for e in entries))
    return str(python)
