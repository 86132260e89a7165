"""W8: ``phalanx run`` next to ``torchrun`` as a launcher, start to exit.

Both launch the same trivial script on 4 local ranks (it prints its rank) and exit; the
wall time of the whole command is measured, interpreter starts included: what a user waits
for each time they launch a job. Runs alternate; medians are compared. Needs torch (for
torchrun); without it the torchrun row is left out.

The two-node case starts two launchers at once on this machine (``--nnodes 2 --node-rank
I --master-addr 127.0.0.1 --master-port P``, static rendezvous, 2 ranks each) and measures
until both have exited, for phalanx and for torchrun with the same flags.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
    _alternate(trials, errors, commands, _time)
    _ratio(ratio, ours, theirs)
    rows = [ours, theirs, ratio] if theirs.raw else [ours]
    return rows + _two_nodes(trials, errors)


def _alternate(trials: int, errors: Errors, commands: list[tuple[Row, list[str]]],
               timer: Callable[[Row, list[str], Path, dict[str, str]], None]) -> None:
    """Time each command ``trials`` times on the trivial script, alternating their order."""
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "trivial.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "PHALANX_PROGRESS": "0"}
        for trial in range(trials):
            for row, command in commands if trial % 2 == 0 else commands[::-1]:
                errors.attempt("W8", "phalanx", lambda row=row, command=command: timer(
                    row, command, script, env))


def _two_nodes(trials: int, errors: Errors) -> list[Row]:
    ours = Row("W8.nodes.phalanx", "W8 two launchers (--nnodes 2, static) x 2 ranks, start to "
               "exit", "s", "lower")
    theirs = Row("W8.nodes.torchrun", "W8 two torchruns, the same flags", "s", "lower")
    ratio = Row("W8.nodes.ratio", "W8 two nodes: phalanx run / torchrun", "x", "lower")
    commands = [(ours, [sys.executable, "-m", "phalanx", "run"])]
    if importlib.util.find_spec("torch") is not None:
        commands.append((theirs, [sys.executable, "-m", "torch.distributed.run"]))
    _alternate(trials, errors, commands, _time_nodes)
    _ratio(ratio, ours, theirs)
    return [ours, theirs, ratio] if theirs.raw else [ours]


def _ratio(ratio: Row, ours: Row, theirs: Row) -> None:
    if ours.raw.get("phalanx") and theirs.raw.get("phalanx"):
        ratio.add("phalanx", median(ours.raw["phalanx"]) / median(theirs.raw["phalanx"]))


def _time_nodes(row: Row, command: list[str], script: Path, env: dict[str, str]) -> None:
    settle()
    port = free_port()
    started = time.perf_counter()
    launchers = [subprocess.Popen(
        [*command, "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--nproc-per-node", "2", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=script.parent) for node in (1, 0)]
    try:
        outputs = [launcher.communicate(timeout=120) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait()
    elapsed = time.perf_counter() - started
    if any(launcher.returncode for launcher in launchers) or sum(
            out.count("rank") for out, _ in outputs) < 4:
        raise RuntimeError(f"{command[2]} two nodes exited "
                           f"{[launcher.returncode for launcher in launchers]}: "
                           f"{outputs[-1][1][-500:]}")
    row.add("phalanx", elapsed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _time(row: Row, command: list[str], script: Path, env: dict[str, str]) -> None:
    settle()
    started = time.perf_counter()
    done = subprocess.run([*command, str(script)], capture_output=True, text=True, env=env,
                          cwd=script.parent, timeout=120)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or done.stdout.count("rank") < 1:
        raise RuntimeError(f"{command[2]} exited {done.returncode}: {done.stderr[-500:]}")
    row.add("phalanx", elapsed)
