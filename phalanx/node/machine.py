"""What only this machine can tell: its free ports, its GPUs, its installed packages, who it is.

The decisions are pure (:mod:`phalanx.world.placement`); this module answers the questions
they leave to the machine a node side runs on (the local backend, an agent, a Ray actor,
the launcher), and to the controller about its own machine.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from phalanx.errors import FrameworkNotInstalled
from phalanx.world.frameworks import Framework
from phalanx.world.layout import parse_visible_gpus

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the driver knows


def free_port(host: str) -> int:
    """A port free on this machine's ``host`` address now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pick_free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on this machine's ``host`` address now."""
    taken: list[int] = []
    while len(taken) < count:
        port = free_port(host)
        if port not in taken:
            taken.append(port)
    return taken


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
    """``python=``: None (the node's default), or a path to a Python interpreter, as a
    string (TypeError otherwise)."""
    if python is None:
        return None
    if not isinstance(python, (str, os.PathLike)) or not os.fspath(python):
        raise TypeError(f"python must be the path of a Python interpreter, got {python!r}")
    return os.fspath(python)


def machine_id() -> str:
    """This machine and mount namespace: equal for processes that see the same files (a
    controller then knows its cwd and sys.path mean something on an agent's node), distinct
    per pod."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", Path.read_text),
                       ("/proc/self/ns/mnt", lambda p: os.readlink(p))):
        try:
            parts.append(str(read(Path(path))).strip())
        except OSError:
            parts.append(socket.gethostname())
    return ":".join(parts)
