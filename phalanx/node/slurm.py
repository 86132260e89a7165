"""Slurm as a node sees it: its ``NodeAddr``, asked of ``scontrol``.

Both ``phalanx run`` under ``srun`` (the first node's address, the ranks' ``MASTER_ADDR``)
and ``phalanx agent --slurm`` (the address it listens on) need it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from phalanx.world.slurm import parse_record

logger = logging.getLogger(__name__)

# seconds for `scontrol show node` to answer (one RPC to slurmctld, usually milliseconds;
# a controller that does not answer makes scontrol retry for much longer)
SCONTROL_TIMEOUT = 10.0


def node_address(name: str, timeout: float = SCONTROL_TIMEOUT) -> str:
    """Slurm's ``NodeAddr`` for node ``name`` (``scontrol show node -o NAME``); ``name``
    itself, with a debug line saying why, when scontrol is not on PATH, fails, takes
    longer than ``timeout`` seconds or names no address for it."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        logger.debug("no scontrol on PATH: node %s's address is taken to be its name", name)
        return name
    try:
        done = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True,
                              text=True, errors="replace", timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.debug("scontrol show node %s failed (%s): its address is taken to be its "
                     "name", name, exc)
        return name
    if done.returncode == 0:
        for line in done.stdout.splitlines():
            try:
                record = parse_record(line)
            except ValueError:  # a line of scontrol's own ("Node n9 not found")
                continue
            if record.get("NodeName") == name and record.get("NodeAddr"):
                return record["NodeAddr"]
    logger.debug("scontrol show node %s names no NodeAddr (exit status %s: %s): its "
                 "address is taken to be its name", name, done.returncode,
                 done.stderr.strip() or done.stdout.strip()[:200])
    return name
