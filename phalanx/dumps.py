"""Reading faulthandler's stack dumps (pure: no process or file I/O).

:func:`innermost_user_frames` picks out, per thread, the frame nearest the top that belongs
to the user's code rather than to phalanx, the standard library or site-packages: what
straggler reports, :class:`~phalanx.errors.CallTimeout` and
:class:`~phalanx.errors.WorkerUnresponsive` quote.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_PHALANX = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[key]) + os.sep
                  for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)})


def is_user_file(filename: str) -> bool:
    """Not phalanx's, not the standard library's, not an installed package's."""
    if filename.startswith("<") or filename.startswith(_PHALANX):
        return False
    return not os.path.realpath(filename).startswith(_library_dirs())


def innermost_user_frames(dump: str) -> list[str]:
    """For each thread of a faulthandler dump that runs user code: its innermost user frame,
    as ``File "x.py", line 3 in train``."""
    frames = []
    found = False
    for line in dump.splitlines():
        if _THREAD.match(line):
            found = False
            continue
        match = _FRAME.match(line)
        if match and not found and is_user_file(match["file"]):
            found = True
            frames.append(line.strip())
    return frames


def format_report(stacks: dict[int, str], titles: dict[int, str] | None = None) -> str:
    """Ranks' dumps as one text, each under a header line naming the rank."""
    parts = []
    for rank in sorted(stacks):
        title = (titles or {}).get(rank, f"rank {rank}")
        parts.append(f"=== {title} ===\n{stacks[rank].rstrip()}\n")
    return "\n".join(parts)
