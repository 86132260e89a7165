"""torchrun's command line, as ``phalanx run`` understands it.

Every torchrun flag is accepted in both of its spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's ``PET_<FLAG>`` environment variables as defaults,
so existing command lines and job scripts run unchanged:

- flags with a phalanx meaning take it (``--nproc-per-node cpu|gpu|auto``, ``--rdzv-id``,
  ``--local-ranks-filter``, ``--shutdown-timeout``, ``--no-python``, ``--run-path``, ...);
- flags that change nothing here (``--monitor-interval``, ``--start-method``, ...) are
  accepted with a one-line notice, never an error;
- ``--rdzv-backend`` other than ``static`` or ``c10d`` is refused, naming the two.

Under ``srun``, one task per node, ``--nnodes``, ``--node-rank`` and ``--master-addr``
default to the step's (:mod:`phalanx.launcher.slurmenv`); a flag or its ``PET_*`` variable
still wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from phalanx.launcher import slurmenv

RDZV_BACKENDS = ("static", "c10d")
STATIC_ADDR, STATIC_PORT = "127.0.0.1", 29500  # torchrun's --master-addr/--master-port
C10D_PORT = 29400  # torchrun's port for a c10d --rdzv-endpoint without one
RDZV_CONF = {"join_timeout": 600.0, "last_call_timeout": 30.0}  # honoured, with defaults

# torchrun flags that change nothing for phalanx: (dest, spellings, takes a value, why)
_NO_EFFECT = (
    ("monitor_interval", ("--monitor-interval", "--monitor_interval"), True,
     "phalanx learns of a rank's death at once, with no polling interval"),
    ("start_method", ("--start-method", "--start_method"), True,
     "every rank is a fresh interpreter"),
    ("event_log_handler", ("--event-log-handler", "--event_log_handler"), True,
     "torch.distributed.elastic's event log is not used"),
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
    # Under srun, the step's node count and this node's index (the address only once it is
    # needed: master_addr()); with several tasks on a node, or variables that contradict,
    # no --nnodes default at all, so that phalanx run refuses to start unless --nnodes is
    # given (srun_refusal()).
    slurm = slurmenv.srun_defaults(env)
    task = slurm.task if slurm.applies else None
    nnodes = None if slurm.refusal else "1" if task is None else str(task.nodes)
    run.set_defaults(srun_defaults=slurm)
    torchrun = run.add_argument_group(
        "torchrun's flags", "accepted as torchrun takes them, with their PET_* environment "
                            "defaults; flags that change nothing here print a notice")
    torchrun.add_argument("--nnodes", default=_pet(env, "nnodes", nnodes), metavar="N|MIN:MAX",
                          help="nodes, each running a launcher of its own, that form one "
                               "world (MIN:MAX with --rdzv-backend c10d: start with MIN, "
                               "admit up to MAX) (default: 1; under srun, one task per node: "
                               "the step's nodes)")
    torchrun.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                          default=int(_pet(env, "node_rank", 0 if task is None else
                                           task.node_index)), metavar="I",
                          help="this launcher's node, 0..N-1 (static rendezvous; node 0 "
                               "hosts the job) (default: 0; under srun: this node's index "
                               "in the step)")
    torchrun.add_argument("--master-addr", "--master_addr", dest="master_addr",
                          default=_pet(env, "master_addr", None), metavar="HOST",
                          help="node 0's address, the ranks' MASTER_ADDR (default: chosen); "
                               "with --nnodes > 1, where node 0's launcher hosts the job "
                               "(default: 127.0.0.1; under srun: the step's first node's "
                               "NodeAddr)")
    torchrun.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                          default=_pet(env, "master_port", None), metavar="PORT",
                          help="the ranks' MASTER_PORT (default: a free port, new on each "
                               "restart); with --nnodes > 1, the job's port on node 0 "
                               "(default: 29500)")
    torchrun.add_argument("--standalone", action="store_true",
                          default=_pet_flag(env, "standalone"),
                          help="one node with a local rendezvous: what phalanx does anyway")
    torchrun.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                          default=_pet(env, "rdzv_backend", "static"), metavar="NAME",
                          help=f"rendezvous backend: {' or '.join(RDZV_BACKENDS)}")
    torchrun.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                          default=_pet(env, "rdzv_endpoint", ""), metavar="HOST:PORT",
                          help="where the launchers meet (c10d: required with several "
                               f"nodes, port {C10D_PORT} by default; static: "
                               "--master-addr:--master-port)")
    torchrun.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", type=rdzv_conf,
                          default=rdzv_conf(_pet(env, "rdzv_conf", "")), metavar="K=V,...",
                          help="join_timeout (s to wait for the nodes, default 600) and "
                               "last_call_timeout (c10d MIN:MAX: s to wait for more nodes "
                               "once MIN joined, default 30); other keys change nothing")
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


def srun_refusal(options: argparse.Namespace) -> str | None:
    """Why ``phalanx run`` must not start under this srun step as its options stand (several
    tasks on a node, or contradicting variables, and no ``--nnodes``); None if it may."""
    slurm: slurmenv.SrunDefaults | None = getattr(options, "srun_defaults", None)
    if options.nnodes is not None or slurm is None:
        return None
    return slurm.refusal


def node_rank_from_srun(options: argparse.Namespace) -> bool:
    """Whether ``--node-rank`` is what the srun step made it (this node's index), which an
    explicit ``--nnodes 1`` (every task a run of its own) leaves unused, not an error."""
    slurm: slurmenv.SrunDefaults | None = getattr(options, "srun_defaults", None)
    return (slurm is not None and slurm.applies and slurm.task is not None
            and options.node_rank == slurm.task.node_index)


def master_addr(options: argparse.Namespace) -> str:
    """Where node 0's launcher hosts a static job: ``--master-addr`` (or
    ``PET_MASTER_ADDR``), else under srun the step's first node's address (asked of
    scontrol now, the one time it is needed), else 127.0.0.1."""
    if options.master_addr:
        return str(options.master_addr)
    slurm: slurmenv.SrunDefaults | None = getattr(options, "srun_defaults", None)
    return (None if slurm is None else slurm.master_addr()) or STATIC_ADDR


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` -> ``(MIN, MAX)``."""
    low, colon, high = str(value).partition(":")
    try:
        counts = (int(low), int(high if colon else low))
    except ValueError:
        raise ValueError(f"--nnodes expects N or MIN:MAX, got {value!r}") from None
    if counts[0] < 1 or counts[0] > counts[1]:
        raise ValueError(f"--nnodes expects N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return counts


def rdzv_conf(value: str) -> dict[str, Any]:
    """torchrun's ``--rdzv-conf key=value,...``: the timeouts phalanx honours as floats,
    other keys kept as given (they change nothing; a notice says so)."""
    conf: dict[str, Any] = dict(RDZV_CONF)
    for item in filter(None, (part.strip() for part in str(value).split(","))):
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--rdzv-conf expects key=value,..., got {item!r}")
        if key in RDZV_CONF:
            try:
                conf[key] = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--rdzv-conf {key} expects seconds, got {text!r}") from None
            if conf[key] <= 0:
                raise argparse.ArgumentTypeError(f"--rdzv-conf {key} must be > 0, got {text}")
        else:
            conf[key] = text
    return conf


def endpoint(value: str, default_port: int) -> tuple[str, int]:
    """``host:port`` (or ``host``, or ``[v6]:port``) -> ``(host, port)``."""
    host, port = value, default_port
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        if rest.startswith(":"):
            port = _port(rest[1:], value)
    elif value.count(":") == 1:
        host, _, text = value.partition(":")
        port = _port(text, value)
    if not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host, port


def _port(text: str, whole: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1-65535, got {whole!r}")
    return port


def several_nodes_problem(options: argparse.Namespace, nnodes: tuple[int, int]) -> str | None:
    """Why one launcher per node cannot run with these options; None if it can. Where the
    srun step gave ``--nnodes``, the reason says so (the user never typed it)."""
    problem = _several_nodes_problem(options, nnodes)
    slurm: slurmenv.SrunDefaults | None = getattr(options, "srun_defaults", None)
    if (problem is None or slurm is None or not slurm.applies or slurm.task is None
            or options.nnodes != str(slurm.task.nodes)):
        return problem
    return (f"{problem} (under srun, one task on each of the step's {slurm.task.nodes} "
            "nodes, --nnodes defaults to the step's nodes; give --nnodes 1 for a launcher "
            "of its own on each node)")


def _several_nodes_problem(options: argparse.Namespace,
                           nnodes: tuple[int, int]) -> str | None:
    low, high = nnodes
    if (options.backend or "local") != "local" or options.hosts or options.dns:
        return ("--nnodes: with --backend ray or --hosts one launcher drives every node; use "
                "--nodes K instead")
    if options.nodes not in (None, 1):
        return "--nnodes runs one launcher per node; --nodes (several in one launcher) must be 1"
    if options.standalone:
        return "--standalone is for one node; drop it with --nnodes > 1"
    if options.framework not in ("spmd", "torch"):
        return (f"--framework {options.framework} needs one controller for the whole world; "
                "with --nnodes use spmd or torch, or run one launcher with --nodes K")
    if options.rdzv_backend == "static":
        if low != high:
            return (f"--nnodes {low}:{high} needs --rdzv-backend c10d (a static rendezvous "
                    "has a fixed number of nodes)")
        if not 0 <= options.node_rank < high:
            return f"--node-rank {options.node_rank} is outside 0..{high - 1} (--nnodes {high})"
    elif not options.rdzv_endpoint:
        return "--rdzv-backend c10d with several nodes needs --rdzv-endpoint HOST:PORT"
    return None


def no_effect_conf(conf: dict[str, Any]) -> list[str]:
    return [f"phalanx run: --rdzv-conf {key} has no effect here" for key in conf
            if key not in RDZV_CONF]


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
