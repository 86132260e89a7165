"""What ``phalanx run`` was asked to do: frozen options, read from the command line once.

:class:`RunOptions` is the whole run's (the program, the ranks, the backend, the restart
budget, where output goes); :class:`JobOptions` is present only with ``--nnodes N`` (N >
1), when this launcher is one of a job of several, one per node (torchrun's rendezvous
flags). :class:`BadOptions` is how the launcher says the group refused them before
anything started (the command line exits 2 for it).

Plain data only: every part of the launcher imports this module, and it imports none.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """How this launcher takes part in a job of several: torchrun's rendezvous flags."""

    min_nodes: int
    max_nodes: int
    node_rank: int | None  # static: this node's; c10d: None (assigned on joining)
    static: bool
    endpoint: tuple[str, int]  # where the launchers meet
    join_timeout: float = 600.0  # torchrun's rdzv join_timeout
    last_call: float = 30.0  # c10d, MIN < MAX: how long to wait for more after MIN


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """One ``phalanx run``: the program every rank runs and how the launcher runs it."""

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False
    nodes: int = 1
    procs_per_node: int | str = 1
    framework: str | None = None
    gpus_per_worker: int = 0
    max_restarts: int = 0
    log_dir: str | None = None
    ranks: tuple[int, ...] | None = None  # shown ranks
    local_ranks: tuple[int, ...] | None = None  # shown local ranks (torchrun's filter)
    collapse: bool = True
    grace: float = 10.0  # seconds between forwarding SIGINT/SIGTERM and SIGKILL
    start_timeout: float | None = None
    role: str = "default"  # torchrun's --role: ROLE_NAME
    run_id: str | None = None  # TORCHELASTIC_RUN_ID (None: a fresh one)
    no_python: bool = False  # the target is a command, not a Python program
    master_addr: str | None = None  # torchrun's --master-addr / --master-port (None: chosen)
    master_port: int | None = None
    backend: str = "local"  # or "ray": every rank of a Ray cluster, from this terminal
    address: str | None = None  # the Ray cluster's (None: RAY_ADDRESS, or a local Ray)
    exit_code: str = "torchrun"  # or "rank": exit with the failing rank's own status
    hosts: tuple[str, ...] | None = None  # the cluster backend's agents
    token_file: str | None = None  # their token (None: $PHALANX_TOKEN)
    sync: str | None = None  # the directory shipped to the agents (the script is in it)
    dns: str | None = None  # the agents behind a DNS name (instead of hosts)
    agent_port: int | None = None
    nameserver: str | None = None
    job: JobOptions | None = None  # one launcher per node (None: this launcher only)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise BadOptions(f"max_restarts must be >= 0, got {self.max_restarts}")


class BadOptions(ValueError):
    """The group refused the launcher's options before anything started."""
