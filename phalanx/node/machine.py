"""What only this machine can tell: its free ports, its GPUs, its installed packages, who it is.

The decisions are pure (:mod:`phalanx.world.placement`); this module answers the questions
they leave to the machine a node side runs on (the local backend, an agent, a Ray actor,
the launcher), and to the controller about its own machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from phalanx.errors import FrameworkNotInstalled
from phalanx.world.frameworks import Framework
from phalanx.world.layout import parse_visible_gpus

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the driver knows


def free_port(host: str) -> int:
    """A port free now on every address of this machine (see :func:`pick_free_ports`)."""
    return pick_free_ports(host, 1)[0]


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free now on every address of this machine, ``host`` (an
    address of this machine's: OSError otherwise; ``""``: any) among them.

    Free on every address, not just ``host``: whoever is given the port may bind it on
    the wildcard address (torch's TCPStore, for ``MASTER_PORT``, binds ``::``), and a port
    free on ``host`` may be held on another of this machine's addresses (its other
    loopback addresses, where simulated nodes and agents listen) -- the wildcard bind
    would fail. So each port is the kernel's pick for a bind to port 0 on the wildcard
    address, both IPv6 and IPv4 where the machine has dual stack, which conflicts with a
    holder on any address; all are held until every one is picked, so none is picked
    twice."""
    _check_own_address(host)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(_wildcard_socket())
            ports.append(sock.getsockname()[1])
        return ports


def _wildcard_socket() -> socket.socket:
    """A TCP socket bound to a port of the kernel's choice on every address (``::`` with
    IPv4 mapped where there is dual stack, else ``0.0.0.0``). No SO_REUSEADDR: the
    strictest test, so a port in any use (a connection's TIME_WAIT too) is passed over."""
    if socket.has_dualstack_ipv6():
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
            return sock
        except OSError:  # IPv6 present but unusable (no address): IPv4's wildcard
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", 0))
    except BaseException:
        sock.close()
        raise
    return sock


def _check_own_address(host: str) -> None:
    """OSError (``socket.gaierror`` for a name that does not resolve) unless ``host`` is
    an address this machine can bind to (``""``: every address)."""
    if not host:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """GPU ids this machine's workers may use: ``CUDA_VISIBLE_DEVICES`` when it is set
    (as a scheduler would set it), otherwise every GPU the NVIDIA driver lists."""
    env = os.environ if environ is None else environ
    listed = parse_visible_gpus(env.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        return listed
    try:
        count = len(os.listdir(NVIDIA_GPUS_DIR))
    except OSError:
        count = 0
    return tuple(str(i) for i in range(count))


def require_package(framework: Framework) -> None:
    """Raise :class:`FrameworkNotInstalled` now rather than deep inside a worker."""
    if framework.package is None:
        return
    try:
        found = importlib.util.find_spec(framework.package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise FrameworkNotInstalled(framework.name, framework.package, framework.install)


def check_interpreter(python: object) -> str | None:
    """``python=``: None (the node's default), or the path of a Python interpreter, as a
    string (TypeError otherwise; ValueError for one with a NUL or too long). A relative path
    is the controller's: it is made absolute against its working directory. Whether it
    exists is checked where the ranks run (:func:`require_interpreter`)."""
    if python is None:
        return None
    if not isinstance(python, (str, os.PathLike)) or not os.fspath(python):
        raise TypeError(f"python must be the path of a Python interpreter, got {python!r}")
    path = os.fspath(python)
    if not isinstance(path, str):
        raise TypeError(f"python must be the path of a Python interpreter, got {python!r}")
    if "\0" in path or len(path) > MAX_INTERPRETER_PATH:
        raise ValueError(f"python={path!r:.200} is not a path (a NUL, or over "
                         f"{MAX_INTERPRETER_PATH} characters)")
    return os.path.abspath(os.path.expanduser(path))


MAX_INTERPRETER_PATH = 4096  # PATH_MAX: what a LAUNCH may carry as its python


def require_interpreter(python: str, where: str = "this machine") -> str:
    """``python`` as given, if it is an executable file on this machine; ValueError naming
    it (and ``where``) otherwise. Run by the node side before it starts any rank."""
    if not os.path.isabs(python):
        raise ValueError(f"python={python!r}: the interpreter's path must be absolute")
    if not os.path.isfile(python):
        why = "is not a file" if os.path.exists(python) else "does not exist"
        raise ValueError(f"python={python!r}: no such interpreter on {where} (the path "
                         f"{why}); give the path of a Python inside the group's environment, "
                         "e.g. /path/to/venv/bin/python")
    if not os.access(python, os.X_OK):
        raise ValueError(f"python={python!r}: the interpreter on {where} is not executable")
    return python


# What interpreter_problem runs: phalanx's release, then each package's ("-": missing).
_PROBE = """import sys, phalanx
found = [phalanx.__version__]
for name in sys.argv[1:]:
    try:
        found.append(getattr(__import__(name), "__version__", "?"))
    except ImportError:
        found.append("-")
sys.stdout.write(" ".join(found))"""


def interpreter_problem(python: str, version: str, where: str,
                        needs: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """What keeps ``python`` on this machine from running a rank of phalanx ``version``:
    ``("missing", why)`` (no such executable file), ``("unusable", why)`` (it cannot import
    phalanx, or has another release, or lacks a package of ``needs`` -- name -> the release
    the controller runs, e.g. Ray's -- or has another release of it), or None. Runs it
    once (outside any cwd that holds phalanx), for a node side that cannot see a rank's own
    start fail (a Ray worker)."""
    import subprocess

    try:
        require_interpreter(python, where)
    except ValueError as exc:
        return "missing", str(exc)
    needs = dict(needs or {})
    try:
        done = subprocess.run([python, "-c", _PROBE, *needs], capture_output=True, text=True,
                              cwd="/", timeout=60, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "unusable", f"the interpreter {python} on {where} could not be run: {exc}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        return "unusable", (f"the interpreter {python} (python=) on {where} cannot run a "
                            f"rank: {lines[-1]}; install phalanx into its environment")
    found = done.stdout.split()
    if not found or found[0] != version:
        return "unusable", (f"the interpreter {python} (python=) on {where} runs phalanx "
                            f"{found[0] if found else '(nothing)'} but the controller runs "
                            f"phalanx {version}: install phalanx {version} into its "
                            "environment")
    for (name, wanted), has in zip(needs.items(), found[1:], strict=False):
        if has == "-":
            return "unusable", (f"the interpreter {python} (python=) on {where} has no "
                                f"{name}, which its ranks need: install {name}=={wanted} "
                                "into its environment")
        if has != wanted:
            return "unusable", (f"the interpreter {python} (python=) on {where} has {name} "
                                f"{has} but the controller runs {name} {wanted}: install "
                                f"{name}=={wanted} into its environment")
    return None


def without_own_install(sys_path: Sequence[str]) -> tuple[str, ...]:
    """The entries of ``sys_path`` (this interpreter's, or a controller's on the same
    machine) that are not part of this Python's own installation: for ranks that run
    another interpreter (``python=``), which have their standard library and packages of
    their own; what is left is the user's code (a script's directory, the cwd, edits)."""
    import sysconfig

    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                         sys.base_exec_prefix) if p}
    own.update(os.path.realpath(p) for p in sysconfig.get_paths().values() if p)

    def installed(entry: str) -> bool:  # "" (the cwd) is the user's
        real = os.path.realpath(entry) if entry else ""
        return any(real == p or real.startswith(p.rstrip(os.sep) + os.sep) for p in own)

    return tuple(entry for entry in sys_path if not installed(entry))
