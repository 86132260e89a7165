"""W1t's rank target: a module that imports torch at module level, as a training job's
module does, so that starting a rank means importing torch (``python -m bench.torchstart``).

Every contender's ranks import this module: phalanx's ranks by unpickling :class:`Target`,
Ray's actors in their constructor, the forkserver by preloading it (its children run
:func:`answer`), and torchrun's processes run it as their script (``-m bench.torchtarget``:
each prints one ``ready`` line and exits).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

READY = "ready"  # what a torchrun process prints first on its line once it is up


class Target:
    """One rank: its answer is a small torch computation (torch is loaded and working)."""

    def ping(self) -> str:
        return f"{torch.__version__} {float(torch.ones(4).sum())}"

    def pid(self) -> int:
        return os.getpid()


def answer(conn: Any) -> None:
    """A forkserver child's whole life: build the target, send its answer, exit."""
    try:
        conn.send(Target().ping())
    finally:
        conn.close()


if __name__ == "__main__":  # a torchrun process
    sys.stdout.write(f"{READY} {os.environ.get('RANK', '?')} {Target().ping()}\n")
    sys.stdout.flush()
