"""Worker classes shared by every contender (importable by spawned processes)."""

from __future__ import annotations

import os
import time
from typing import Any


class Bench:
    def noop(self) -> None:
        return None

    def array_sum(self, array: Any) -> float:
        return float(array.sum())

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def take(self, data: Any = None) -> None:
        """A no-op that receives data (W7: call_sharded against a plain call)."""
        return None
