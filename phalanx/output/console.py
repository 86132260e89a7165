"""The one place phalanx writes to the user's terminal: rank-prefixed worker lines and the
start-up progress bar. Library diagnostics go through :mod:`logging` instead.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

# Whole lines only: output from many ranks never interleaves mid-line. Re-entrant, since a
# signal handler on the main thread may write a notice while that thread holds it.
_lock = threading.RLock()


def holding() -> threading.RLock:
    """The console's lock: ``with console.holding():`` no worker line or notice is written
    meanwhile (a caller that reads what the console wrote, say a test's capture, reads
    whole lines and loses none to a write in the middle of its read)."""
    return _lock


def write_line(prefix: str, line: str, *, stderr: bool = False) -> None:
    """Write one worker line as ``[rank 3] text`` to the controller's stdout or stderr."""
    stream: TextIO = sys.stderr if stderr else sys.stdout
    with _lock:
        try:
            stream.write(f"{prefix} {line}\n")
            stream.flush()
        except (ValueError, OSError):  # the stream was closed at interpreter exit
            pass


def notice(text: str) -> None:
    """A message of phalanx's own to the user (the launcher's reports), on stderr."""
    with _lock:
        try:
            sys.stderr.write(text.rstrip("\n") + "\n")
            sys.stderr.flush()
        except (ValueError, OSError):
            pass


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.enabled = enabled and total > 0
        self.label = label
        self.total = total
        self.count = 0

    def update(self, count: int) -> None:
        if not self.enabled or count == self.count:
            return
        self.count = count
        width = 30
        filled = width * count // self.total
        bar = "#" * filled + "-" * (width - filled)
        with _lock:
            sys.stderr.write(f"\r{self.label} [{bar}] {count}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.count:
            with _lock:
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()
