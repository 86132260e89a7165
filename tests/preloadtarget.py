"""The rank target of the preload tests (tests/contract/test_preload.py).

An importable module of the user's own, so each rank imports it itself, after its
environment is set -- never its node's supervisor, which preloads only what it is told (or,
by default, the installed packages a target's module imports: this one imports only the
standard library, so it adds none). What the rank saw as it imported this module is kept in
``AT_IMPORT``: whether the preloaded modules were there already, its environment, its
``sys.argv`` and ``__main__``.
"""

from __future__ import annotations

import atexit
import os
import random
import sys
import time
from pathlib import Path

AT_IMPORT = {
    "decimal": "decimal" in sys.modules,  # a fresh interpreter has not imported it
    "numpy": "numpy" in sys.modules,
    "env": {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "PRELOAD_USER_VAR")},
    "argv": list(sys.argv),
    "main_name": getattr(sys.modules.get("__main__"), "__name__", None),
}


class Rank:
    """What a rank reports about how it was started, and the things a program does that a
    forked rank must do as a fresh interpreter would."""

    def at_import(self) -> dict:
        return AT_IMPORT

    def command_line(self) -> list[str]:
        """This process's command line as the system shows it: a fresh interpreter's runs
        the rank runtime; a rank forked from preloaded modules keeps its supervisor's."""
        with open("/proc/self/cmdline", "rb") as f:
            return [part.decode() for part in f.read().split(b"\0") if part]

    def sys_path(self) -> list[str]:
        return list(sys.path)

    def pid(self) -> int:
        return os.getpid()

    def python_random(self) -> float:
        return random.random()

    def numpy_random(self) -> float:
        import numpy

        return float(numpy.random.random())

    def write_to_a_closed_pipe(self) -> str:
        """Write to a pipe nobody reads: a Python program gets ``BrokenPipeError`` (the
        interpreter ignores SIGPIPE), not a death by the signal."""
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            os.write(write_end, b"x")
        except BrokenPipeError:
            return "BrokenPipeError"
        finally:
            os.close(write_end)
        return "written"

    def exit_with(self, code: int) -> None:
        sys.exit(code)

    def at_exit_write(self, path: str) -> None:
        """Have the interpreter write ``path`` as it exits (an ``atexit`` handler)."""
        atexit.register(Path(path).write_text, f"rank {os.environ['RANK']} exited\n")

    def print_until(self, text: str, flag: str, within: float = 30.0) -> bool:
        """Print ``text`` without flushing, then wait (at most ``within`` s) for the file
        ``flag`` to appear: True if it did."""
        print(text)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if os.path.exists(flag):
                return True
            time.sleep(0.02)
        return False


class TorchRank:
    """A rank of a ``framework="torch"`` group: its thread count, and a matrix product that
    uses its thread pool."""

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def matmul(self) -> float:
        import torch

        a = torch.ones(1000, 1000)
        return float((a @ a)[0, 0])
