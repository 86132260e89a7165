"""W8: ``phalanx run`` next to ``torchrun`` as a launcher, start to exit.

Both launch the same trivial script on 4 local ranks (it prints its rank) and exit; the
wall time of the whole command is measured, interpreter starts included: what a user waits
for each time they launch a job. Runs alternate; medians are compared. Needs torch (for
torchrun); without it the torchrun row is left out.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import median

from bench.contenders import Contender
from bench.util import Errors, Row, settle

SCRIPT = 'import os\nprint("rank", os.environ["RANK"])\n'
RANKS = 4


def w8_launcher(contenders: Sequence[Contender], plan: object, errors: Errors) -> list[Row]:
    if not any(c.name == "phalanx" for c in contenders):
        return []
    trials = 3 if getattr(plan, "quick", False) else 7
    ours = Row("W8.phalanx", f"W8 phalanx run -n {RANKS} trivial script, start to exit",
               "s", "lower")
    theirs = Row("W8.torchrun", f"W8 torchrun --nproc-per-node {RANKS}, same script",
                 "s", "lower")
    ratio = Row("W8.ratio", "W8 phalanx run / torchrun", "x", "lower")
    commands = [(ours, [sys.executable, "-m", "phalanx", "run", "-n", str(RANKS)])]
    if importlib.util.find_spec("torch") is not None:
        commands.append((theirs, [sys.executable, "-m", "torch.distributed.run",
                                  f"--nproc-per-node={RANKS}"]))
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "trivial.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "PHALANX_PROGRESS": "0"}
        for trial in range(trials):
            for row, command in commands if trial % 2 == 0 else commands[::-1]:
                errors.attempt("W8", "phalanx",
                               lambda row=row, command=command: _time(row, command, script, env))
    if ours.raw.get("phalanx") and theirs.raw.get("phalanx"):
        ratio.add("phalanx", median(ours.raw["phalanx"]) / median(theirs.raw["phalanx"]))
    return [ours, theirs, ratio] if theirs.raw else [ours]


def _time(row: Row, command: list[str], script: Path, env: dict[str, str]) -> None:
    settle()
    started = time.perf_counter()
    done = subprocess.run([*command, str(script)], capture_output=True, text=True, env=env,
                          cwd=script.parent, timeout=120)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or done.stdout.count("rank") < 1:
        raise RuntimeError(f"{command[2]} exited {done.returncode}: {done.stderr[-500:]}")
    row.add("phalanx", elapsed)
