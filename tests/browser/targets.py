"""What the dashboard's tests run on their ranks: an importable module, so each rank imports
it itself (by reference, as a user's own module would be)."""

from __future__ import annotations

import os
import time


class Worker:
    """A rank that steps: answers its rank after sleeping ``seconds`` (a visible span on
    the timeline when it is not zero)."""

    def step(self, seconds: float = 0.0) -> int:
        if seconds:
            time.sleep(seconds)
        return int(os.environ["RANK"])
