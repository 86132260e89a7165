"""torchrun's command line, as ``phalanx run`` understands it.

Every torchrun flag is accepted in both of its spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's ``PET_<FLAG>`` environment variables as defaults,
so existing command lines and job scripts run unchanged:

- flags with a phalanx meaning take it (``--nproc-per-node cpu|gpu|auto``, ``--rdzv-id``,
  ``--local-ranks-filter``, ``--shutdown-timeout``, ``--no-python``, ``--run-path``, ...);
- flags that change nothing here (``--monitor-interval``, ``--start-method``, ...) are
  accepted with a one-line notice, never an error;
- ``--rdzv-backend`` other than ``static`` or ``c10d`` is refused, naming the two.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

RDZV_BACKENDS = ("static", "c10d")

# torchrun flags that change nothing for phalanx: (dest, spellings, takes a value, why)
_NO_EFFECT = (
    ("monitor_interval", ("--monitor-interval", "--monitor_interval"), True,
     "phalanx learns of a rank's death at once, with no polling interval"),
    ("start_method", ("--start-method", "--start_method"), True,
     "every rank is a fresh interpreter"),
    ("event_log_handler", ("--event-log-handler", "--event_log_handler"), True,
     "torch.distributed.elastic's event log is not used"),
    ("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"), True,
     "the rendezvous needs no configuration"),
    ("redirects", ("-r", "--redirects"), True,
     "--log-dir already writes every rank's output to files"),
    ("tee", ("-t", "--tee"), True,
     "--log-dir already writes every rank's output to files, and the console shows it"),
    ("duplicate_stdout_filters", ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
     True, "not supported"),
    ("duplicate_stderr_filters", ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
     True, "not supported"),
    ("local_addr", ("--local-addr", "--local_addr"), True,
     "the node's address is found without it"),
    ("logs_specs", ("--logs-specs", "--logs_specs"), True,
     "torchrun's logs specs plugins are not used"),
    ("numa_binding", ("--numa-binding", "--numa_binding"), True, "not supported"),
    ("signals_to_handle", ("--signals-to-handle", "--signals_to_handle"), True,
     "SIGINT and SIGTERM are forwarded to the ranks"),
    ("virtual_local_rank", ("--virtual-local-rank", "--virtual_local_rank"), False,
     "not supported"),
)


def parse_ranks(value: str) -> tuple[int, ...]:
    """``"0,2,4-6"`` -> ``(0, 2, 4, 5, 6)``."""
    ranks: list[int] = []
    try:
        for part in value.split(","):
            first, sep, last = part.strip().partition("-")
            if sep:
                ranks.extend(range(int(first), int(last) + 1))
            else:
                ranks.append(int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ranks such as 0,2 or 0-3, got {value!r}"
        ) from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0,2 or 0-3, got {value!r}")
    return tuple(sorted(set(ranks)))


def _pet(environ: Mapping[str, str], dest: str, default: Any) -> Any:
    """torchrun's environment default for a flag: ``PET_<DEST>``."""
    return environ.get(f"PET_{dest.upper()}", default)


def _pet_flag(environ: Mapping[str, str], dest: str) -> bool:
    return _pet(environ, dest, "0").lower() in ("1", "true", "yes")


def add_torchrun_arguments(run: argparse.ArgumentParser,
                           environ: Mapping[str, str] | None = None) -> None:
    """torchrun's flags that ``phalanx run`` does not spell its own way already."""
    env = os.environ if environ is None else environ
    torchrun = run.add_argument_group(
        "torchrun's flags", "accepted as torchrun takes them, with their PET_* environment "
                            "defaults; flags that change nothing here print a notice")
    torchrun.add_argument("--nnodes", default=_pet(env, "nnodes", "1"), metavar="N|MIN:MAX",
                          help="nodes that each run a launcher (only 1 so far: --nodes "
                               "simulates several on this machine)")
    torchrun.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                          default=int(_pet(env, "node_rank", 0)), metavar="I",
                          help="this launcher's node (0 with one node)")
    torchrun.add_argument("--master-addr", "--master_addr", dest="master_addr",
                          default=_pet(env, "master_addr", None), metavar="HOST",
                          help="node 0's address, the ranks' MASTER_ADDR (default: chosen)")
    torchrun.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                          default=_pet(env, "master_port", None), metavar="PORT",
                          help="the ranks' MASTER_PORT (default: a free port, new on each "
                               "restart)")
    torchrun.add_argument("--standalone", action="store_true",
                          default=_pet_flag(env, "standalone"),
                          help="one node with a local rendezvous: what phalanx does anyway")
    torchrun.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                          default=_pet(env, "rdzv_backend", "static"), metavar="NAME",
                          help=f"rendezvous backend: {' or '.join(RDZV_BACKENDS)}")
    torchrun.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                          default=_pet(env, "rdzv_endpoint", ""), metavar="HOST:PORT",
                          help="the rendezvous endpoint (one node: not needed)")
    torchrun.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id",
                          default=_pet(env, "rdzv_id", None), metavar="ID",
                          help="the job's id: TORCHELASTIC_RUN_ID (default: a fresh one)")
    torchrun.add_argument("--no-python", "--no_python", dest="no_python",
                          action="store_true", default=_pet_flag(env, "no_python"),
                          help="run the target as a command (a shell script, a binary), not "
                               "with Python")
    torchrun.add_argument("--run-path", "--run_path", dest="run_path", action="store_true",
                          default=_pet_flag(env, "run_path"),
                          help="run the script with runpy.run_path: what phalanx does anyway "
                               "(overrides --no-python, as in torchrun)")
    torchrun.add_argument("--local-ranks-filter", "--local_ranks_filter",
                          dest="local_ranks_filter", type=parse_ranks,
                          default=_pet(env, "local_ranks_filter", None), metavar="LIST",
                          help="show only these local ranks' output (as --ranks on one node)")
    torchrun.add_argument("--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout",
                          type=float, default=_pet(env, "shutdown_timeout", None),
                          metavar="SECONDS", help="the same as --grace")
    for dest, spellings, takes_value, _ in _NO_EFFECT:
        if takes_value:
            torchrun.add_argument(*spellings, dest=dest, default=_pet(env, dest, None),
                                  help=argparse.SUPPRESS)
        else:
            torchrun.add_argument(*spellings, dest=dest, action="store_true",
                                  default=_pet_flag(env, dest), help=argparse.SUPPRESS)


def no_effect_notices(options: argparse.Namespace) -> list[str]:
    """One line for each torchrun flag given that changes nothing here."""
    notices = []
    for dest, spellings, _, why in _NO_EFFECT:
        value = getattr(options, dest, None)
        if value not in (None, False):
            name = next(s for s in spellings if s.startswith("--"))
            notices.append(f"phalanx run: {name} has no effect here: {why}")
    return notices


def check_nnodes(value: str) -> str | None:
    """Why ``--nnodes`` cannot be honoured; None if it can."""
    low, _, high = value.partition(":")
    try:
        counts = [int(low), int(high or low)]
    except ValueError:
        return f"--nnodes expects N or MIN:MAX, got {value!r}"
    if min(counts) < 1 or counts[0] > counts[1]:
        return f"--nnodes expects N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}"
    if counts != [1, 1]:
        return (f"--nnodes {value}: a launcher per node is not supported yet; run one "
                "launcher, with --nodes K to simulate K nodes on this machine")
    return None


def procs_per_node(value: str, gpus: int, cpus: int) -> int | str:
    """torchrun's ``--nproc-per-node``: a count, ``cpu`` (one per core), ``gpu`` (one per
    GPU, which must exist) or ``auto`` (one per GPU, else one per core)."""
    if value == "cpu":
        return cpus
    if value == "gpu":
        if not gpus:
            raise ValueError("--nproc-per-node gpu: this machine has no visible GPU")
        return gpus
    if value == "auto":
        return gpus or cpus
    return int(value)
