"""The ``phalanx`` command line: ``phalanx run`` (a torchrun-like launcher) and ``phalanx
debug`` (attach to a rank stopped in ``px.breakpoint()``)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from phalanx import config
from phalanx.cli import k8s, ps
from phalanx.launcher import flags as runflags
from phalanx.launcher import report as runreport
from phalanx.launcher.flags import parse_ranks
from phalanx.launcher.options import JobOptions
from phalanx.launcher.program import path_in_tree
from phalanx.version import __version__
from phalanx.world.frameworks import FRAMEWORKS

USAGE_ERROR = 2

RUN_DESCRIPTION = """\
Run a Python script (or -m module) on every rank of a group of local worker processes,
like torchrun (with --nnodes N, one launcher per node forms one world). Each rank gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT (and
PHALANX_* equivalents), torchrun's GROUP_RANK, ROLE_*, TORCHELASTIC_* variables (so
is_torchelastic_launched() is true and a rank's @record writes its
TORCHELASTIC_ERROR_FILE), plus what --framework adds, before the script is imported.
Output lines are prefixed with their rank; identical lines from several ranks are shown
once as "[ranks 0-3] ...".
"""


RUN_EPILOG = """\
exit status:
  0        every rank finished (returned or called sys.exit(0))
  1        a rank failed, however it failed, as with torchrun; a root-cause report (the
           rank, its node, its exit code or signal, its Python traceback) is printed at
           the end. With --exit-code rank: that rank's own status instead (its
           sys.exit(N) code, 1 for an uncaught exception, 128+S when signal S killed it)
           With --nnodes: on every launcher, also when another node's rank failed, a node
           never joined, or node 0's launcher was lost
  128+S    the launcher itself got SIGINT/SIGTERM (S), which it forwarded to every rank
           (then SIGKILL after --grace seconds, or at once on a second signal); with
           --nnodes, every launcher of the job
  2        bad command line

examples:
  phalanx run -n 4 train.py --lr 0.1
  phalanx run -n 2 --nodes 2 --framework torch --max-restarts 3 --log-dir logs train.py
  phalanx run -n auto --framework jax -m mypkg.train
  phalanx run --nnodes 2 --node-rank 0 --master-addr node0 -n 2 train.py   # on node0
  phalanx run --nnodes 2 --node-rank 1 --master-addr node0 -n 2 train.py   # on node1
  srun -N2 --ntasks-per-node=1 phalanx run -n 2 train.py   # the same, in a Slurm job
"""


DEBUG_DESCRIPTION = """\
Attach this terminal to a rank stopped in px.breakpoint(), or list the ranks waiting for a
debugger. With no argument, attaches when exactly one rank waits and lists them otherwise.
The session is pdb's: 'c' lets the rank run on, 'q' raises BdbQuit where it stopped;
Ctrl-D or Ctrl-C detaches, and the rank continues.
"""

DEBUG_EPILOG = """\
ranks register in $PHALANX_DEBUG_DIR, else /tmp/phalanx-debug-<uid> (a directory only you
can read); records of processes that are gone are removed. Attach on the rank's host.

exit status:
  0        the session ended (or the listing was shown)
  1        no rank is waiting, the one named is not, or it refused the connection
  2        bad command line

examples:
  phalanx debug            # attach to the only waiting rank, or list them
  phalanx debug 3          # attach to rank 3
  phalanx debug --pid 4242 # attach to one process (several groups, or no RANK variable)
  phalanx debug --list
"""


_Number = TypeVar("_Number", int, float)


def _number(value: str, convert: Callable[[str], _Number], minimum: float, what: str) -> _Number:
    try:
        number = convert(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return number


def _procs(value: str) -> int | str:
    if value in ("auto", "cpu", "gpu"):
        return value
    return _number(value, int, 1, "a positive integer, 'auto', 'cpu' or 'gpu'")


def _hosts(value: str) -> tuple[str, ...]:
    from phalanx.backends.cluster.link import parse_host

    entries = tuple(entry.strip() for entry in value.split(",") if entry.strip())
    try:
        for entry in entries:
            parse_host(entry)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not entries:
        raise argparse.ArgumentTypeError("expected host:port,... (one agent per node)")
    return entries


def _positive(value: str) -> int:
    return _number(value, int, 1, "a positive integer")


def _non_negative(value: str) -> int:
    return _number(value, int, 0, "an integer >= 0")


def _seconds(value: str) -> float:
    return _number(value, float, 0, "a number of seconds >= 0")


def _positive_seconds(value: str) -> float:
    seconds = _number(value, float, 0, "a number of seconds > 0")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Launch, drive and supervise a group of distributed worker processes.",
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    run = commands.add_parser(
        "run",
        help="run a script or module on every rank (like torchrun)",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pet = os.environ.get
    run.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                     type=_procs, default=_procs(pet("PET_NPROC_PER_NODE", "1")), metavar="N",
                     help="worker processes per node, or as torchrun: 'cpu' (one per core), "
                          "'gpu' (one per GPU), 'auto' (one per GPU, else one per core) "
                          "(default: 1)")
    run.add_argument("--backend", choices=("local", "ray", "cluster"), default=None,
                     help="where the ranks run: local processes (default), the actors of a "
                          "Ray cluster, or the nodes of phalanx agents (--hosts), driven "
                          "from this terminal")
    run.add_argument("--hosts", type=_hosts, metavar="H:P,...",
                     help="the phalanx agents to run on, one node each (the cluster "
                          "backend); --token-file or $PHALANX_TOKEN holds their token")
    run.add_argument("--dns", metavar="NAME",
                     help="instead of --hosts: the agents behind this DNS name (a headless "
                          "Service), all on --agent-port")
    run.add_argument("--agent-port", type=_port, default=None, metavar="PORT",
                     help="with --dns: the agents' port (default: 32300)")
    run.add_argument("--nameserver", metavar="H:P",
                     help="with --dns: ask this DNS server (default: the system's resolver)")
    run.add_argument("--token-file", metavar="FILE",
                     help="with --hosts: the agents' shared token (default: $PHALANX_TOKEN)")
    run.add_argument("--sync", metavar="DIR",
                     help="with --hosts: ship DIR (which holds the script) to every agent "
                          "first; the ranks run in it")
    run.add_argument("--address", metavar="ADDR",
                     help="with --backend ray: the cluster to join ('auto', 'host:port', "
                          "'ray://...'; default: RAY_ADDRESS, else a local Ray)")
    run.add_argument("--nodes", type=_positive, default=None, metavar="K",
                     help="nodes: simulated on this machine with distinct NODE_RANKs, "
                          "distinct Ray nodes with --backend ray, or the first K agents of "
                          "--hosts (default: 1, or every host); world size = K x N")
    frameworks = sorted(name for name in FRAMEWORKS if name is not None)
    run.add_argument("--framework", choices=frameworks, default="spmd",
                     help="environment to set up on every rank (default: spmd, the generic "
                          "variables only); ray and monarch run the script on node 0 only")
    run.add_argument("--gpus-per-worker", type=_non_negative, default=0, metavar="G",
                     help="give each rank G GPUs of its node via CUDA_VISIBLE_DEVICES")
    run.add_argument("--max-restarts", "--max_restarts", dest="max_restarts",
                     type=_non_negative, default=_non_negative(pet("PET_MAX_RESTARTS", "0")),
                     metavar="R",
                     help="restart the whole group up to R times after a failure; ranks see "
                          "the restart count in PHALANX_RESTART_COUNT (and "
                          "TORCHELASTIC_RESTART_COUNT) (default: 0)")
    run.add_argument("--log-dir", "--log_dir", dest="log_dir",
                     default=pet("PET_LOG_DIR"), metavar="DIR",
                     help="also write each rank's output to DIR/rank-N.stdout.log and "
                          "DIR/rank-N.stderr.log")
    run.add_argument("--ranks", type=parse_ranks, metavar="LIST",
                     help="show only these ranks' output, e.g. 0 or 0,2 or 0-3 (log files "
                          "and the failure report still cover every rank)")
    run.add_argument("--no-collapse", action="store_true",
                     help="show every rank's lines separately, even identical ones")
    run.add_argument("--grace", type=_seconds, default=10.0, metavar="SECONDS",
                     help="after forwarding SIGINT/SIGTERM, wait this long before SIGKILL "
                          "(default: 10)")
    run.add_argument("--start-timeout", type=_seconds, default=None, metavar="SECONDS",
                     help="seconds for every rank (and its framework) to start (default: 120)")
    run.add_argument("--exit-code", choices=runreport.EXIT_CODES, default="torchrun",
                     help="the status to exit with when a rank fails: torchrun's 1 "
                          "(default), or the failing rank's own")
    run.add_argument("--role", default=pet("PET_ROLE", "default"),
                     help="the workers' role, as torchrun's --role: ROLE_NAME (default: "
                          "default)")
    run.add_argument("-m", "--module", action="store_true",
                     default=pet("PET_MODULE", "0").lower() in ("1", "true"),
                     help="run the target as a module (python -m), not a script path")
    run.add_argument("target", metavar="script.py | module",
                     help="the program every rank runs")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="...",
                     help="arguments for the program")
    runflags.add_torchrun_arguments(run)
    _add_agent(commands)
    k8s.add_parser(commands)
    ps.add_parser(commands)
    token = commands.add_parser(
        "token", help="make a shared token for agents and their controllers (256 bits)",
        description="Print a fresh token (256 random bits, URL-safe), or write it to a new "
                    "file only you can read (--file). Give the same token to every agent "
                    "(phalanx agent --token-file) and to the controller "
                    "(px.ClusterBackend(token_file=...) or $PHALANX_TOKEN).")
    token.add_argument("--file", metavar="FILE",
                       help="write the token to FILE (created 0600; never overwritten) "
                            "instead of printing it")
    debug = commands.add_parser(
        "debug",
        help="attach to a rank stopped in px.breakpoint(), or list the ranks waiting",
        description=DEBUG_DESCRIPTION,
        epilog=DEBUG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = debug.add_mutually_exclusive_group()
    which.add_argument("rank", nargs="?", type=_non_negative,
                       help="the rank to attach to (default: the only one waiting)")
    which.add_argument("--pid", type=_positive, metavar="PID",
                       help="attach to the waiting process PID")
    which.add_argument("-l", "--list", action="store_true",
                       help="only list the waiting ranks: rank, pid, host, group (its "
                            "name), how long it has waited, where it stopped")
    debug.add_argument("--dir", metavar="DIR",
                       help="where ranks register (default: $PHALANX_DEBUG_DIR, else "
                            "/tmp/phalanx-debug-<uid>)")
    return parser


AGENT_DESCRIPTION = """\
Serve this node's ranks to controllers that use px.ClusterBackend(hosts=[...]). Every
controller must prove the shared token (--token-file, or $PHALANX_TOKEN) before anything
it sends is read; the agent listens on loopback unless --host says otherwise. When a
controller goes away (its connection ends, or it is silent for --heartbeat-timeout
seconds) its ranks are stopped, with everything they started, and the agent waits for the
next one. --http-port serves /health and /metrics (Prometheus text) over plain HTTP.
"""


def _add_agent(commands: Any) -> None:  # argparse's subparsers (a class with no public name)
    from phalanx.backends.cluster.agent.daemon import DEFAULT_PORT

    agent = commands.add_parser(
        "agent", help="serve this node's ranks to a controller's ClusterBackend",
        description=AGENT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    agent.add_argument("--host", default=None,
                       help="the address to listen on (default: 127.0.0.1; 0.0.0.0 in a pod; "
                            "with --slurm, the node's NodeAddr)")
    agent.add_argument("--port", type=_port, default=None,
                       help=f"the control port (default: {DEFAULT_PORT}; with --slurm, any "
                            "free one)")
    agent.add_argument("--http-port", type=_port, default=None, metavar="PORT",
                       help="the /health and /metrics port (default: --port + 1)")
    agent.add_argument("--no-http", action="store_true", help="serve no HTTP")
    agent.add_argument("--token-file", metavar="FILE",
                       help="the shared token (default: $PHALANX_TOKEN)")
    agent.add_argument("--heartbeat-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                       help="a controller silent this long is gone (default: 30)")
    agent.add_argument("--node-timeout", type=_positive_seconds,
                       default=config.DEFAULT_NODE_TIMEOUT, metavar="SECONDS",
                       help="in a tree, a child agent silent this long is lost with its "
                            f"subtree (default: {config.DEFAULT_NODE_TIMEOUT:g})")
    agent.add_argument("--handshake-timeout", type=_positive_seconds,
                       default=config.AGENT_HANDSHAKE_TIMEOUT, metavar="SECONDS",
                       help="a connection has this long to prove the token, or it is "
                            f"closed (default: {config.AGENT_HANDSHAKE_TIMEOUT:g})")
    agent.add_argument("--max-frame-mib", type=_positive, default=1024, metavar="MIB",
                       help="refuse frames larger than this from a controller (default: 1024)")
    agent.add_argument("--max-held-mib", type=_positive, default=None, metavar="MIB",
                       help="refuse put objects past this many MiB held for one controller "
                            "(default: half the node's memory)")
    agent.add_argument("--max-sessions", type=_positive, default=config.AGENT_MAX_SESSIONS,
                       metavar="N",
                       help="serve at most N controllers' sessions at once (each group and "
                            "pool is one); one more is refused, naming this limit (default: "
                            f"{config.AGENT_MAX_SESSIONS})")
    agent.add_argument("--store", metavar="DIR",
                       help="where shipped code is kept (ClusterBackend(sync=...); default: "
                            "$XDG_CACHE_HOME/phalanx/agent)")
    agent.add_argument("--tls-cert", metavar="PEM",
                       help="serve over TLS with this certificate chain (and --tls-key)")
    agent.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    agent.add_argument("--tls-ca", metavar="PEM",
                       help="with TLS: the certificates this agent trusts in other agents "
                            "(a tree's, kept results' sources; default: --tls-cert itself)")
    agent.add_argument("--once", action="store_true",
                       help="serve one controller's job: exit as the last of its connections ends")
    agent.add_argument("--idle-timeout", type=_positive_seconds, default=None,
                       metavar="SECONDS",
                       help="exit if no controller has connected this long (default: never; "
                            "600 with --slurm)")
    agent.add_argument("--slurm", metavar="DIR",
                       help="an agent that px.SlurmBackend started with srun, one per node: "
                            "the token from DIR/token, listening on the node's NodeAddr on "
                            "a free port, published in DIR/agents/<node>; --once, no HTTP")
    # $PHALANX_TOKEN, handed over by the agent itself as it runs again without it
    agent.add_argument("--token-fd", type=_non_negative, help=argparse.SUPPRESS)
    agent.add_argument("-v", "--verbose", action="store_true", help="log every connection")


def _port(value: str) -> int:
    port = _number(value, int, 0, "a port number (0-65535)")
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {value!r}")
    return port


def _agent(options: argparse.Namespace, argv: list[str] | None = None) -> int:
    """``argv``: the command line, when it is this process's own (then a token in the
    environment is handed over to a fresh exec of it, so /proc/<pid>/environ never
    shows it)."""
    from phalanx.backends.cluster import token as tokens
    from phalanx.backends.cluster.agent import daemon as agent

    logging.getLogger("phalanx").setLevel(logging.INFO if options.verbose else logging.WARNING)
    for handler in logging.getLogger().handlers:  # peers' text cannot forge a line of it
        handler.setFormatter(agent.LogLines(LOG_FORMAT))
    on_listening = None
    if options.slurm is not None:
        from phalanx.backends.cluster.agent import slurmnode

        try:
            slurm = slurmnode.SlurmNode.from_environment(options.slurm)
        except ValueError as exc:
            print(f"phalanx agent: {exc}", file=sys.stderr)
            return USAGE_ERROR
        options.token_file = options.token_file or slurm.token_file
        options.host = options.host or slurm.address
        options.port = 0 if options.port is None else options.port
        options.once, options.no_http = True, options.http_port is None
        if options.idle_timeout is None:
            options.idle_timeout = config.SLURM_AGENT_IDLE_TIMEOUT
        on_listening = slurm.announce
    options.host = options.host or "127.0.0.1"
    options.port = agent.DEFAULT_PORT if options.port is None else options.port
    if argv is not None and options.token_file is None and options.token_fd is None:
        tokens.exec_without_token(argv)  # returns only if there is no $PHALANX_TOKEN
    try:
        token = (agent.read_token(options.token_file) if options.token_fd is None else
                 tokens.token_from_fd(options.token_fd))
        if (options.tls_cert is None) != (options.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        tls = (None if options.tls_cert is None else
               agent.tls_context(options.tls_cert, options.tls_key))
        if options.tls_ca is not None and tls is None:
            raise ValueError("--tls-ca is for an agent that serves TLS (--tls-cert and "
                             "--tls-key)")
        peer_tls = (None if tls is None else
                    agent.peer_tls_context(options.tls_ca or options.tls_cert))
    except ValueError as exc:
        print(f"phalanx agent: {exc}", file=sys.stderr)
        return USAGE_ERROR
    http_port = None if options.no_http else (
        options.http_port if options.http_port is not None else options.port + 1)
    return agent.run(options.host, options.port, token, http_port=http_port,
                     heartbeat_timeout=options.heartbeat_timeout,
                     node_timeout=options.node_timeout,
                     handshake_timeout=options.handshake_timeout,
                     max_frame=options.max_frame_mib << 20, tls=tls, peer_tls=peer_tls,
                     store=options.store, once=options.once,
                     idle_timeout=options.idle_timeout, on_listening=on_listening,
                     max_held=None if options.max_held_mib is None else options.max_held_mib << 20,
                     max_sessions=options.max_sessions)


def _token(options: argparse.Namespace) -> int:
    from phalanx.backends.cluster import token

    if options.file is None:
        print(token.new_token())
        return 0
    try:
        token.write_token_file(options.file)
    except ValueError as exc:
        print(f"phalanx token: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def _check_target(target: str, is_module: bool, no_python: bool = False) -> str | None:
    """Why the program cannot be run, checked before any process starts; None if fine."""
    if no_python:
        import shutil

        found = shutil.which(target) if os.sep not in target else (
            target if os.access(target, os.X_OK) and os.path.isfile(target) else None)
        return None if found else f"no executable command {target!r} (--no-python)"
    if is_module:
        # Only the top-level package is looked up: finding a submodule would import (run)
        # its parent packages here in the launcher. A missing submodule fails on the ranks.
        sys.path.insert(0, os.getcwd())
        try:
            importable = importlib.util.find_spec(target.partition(".")[0]) is not None
        except (ImportError, ValueError):
            importable = False
        finally:
            sys.path.pop(0)
        return None if importable else f"no module named {target!r}"
    if not os.path.isfile(target):
        return f"no such file: {target!r}"
    return None


LOG_FORMAT = "phalanx: %(message)s"  # every command's log lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    # the launcher reports a rank's death itself (restart notice, root-cause report)
    logging.getLogger("phalanx.controller.group").setLevel(logging.ERROR)
    if options.command == "run":
        return _run(parser, options)
    if options.command == "debug":
        return _debug(options)
    if options.command == "agent":
        return _agent(options, list(sys.argv[1:]) if argv is None else None)
    if options.command == "k8s":
        return k8s.main(options)
    if options.command == "ps":
        return ps.main(options)
    if options.command == "token":
        return _token(options)
    parser.error(f"unknown command {options.command!r}")  # pragma: no cover - argparse checks
    return USAGE_ERROR  # pragma: no cover


def _run(parser: argparse.ArgumentParser, options: argparse.Namespace) -> int:
    # imported here, not at the top: the launcher brings the controller's modules, which
    # `phalanx debug` and `phalanx agent` do without
    from phalanx.errors import PhalanxError
    from phalanx.launcher import api as launcher
    from phalanx.node.machine import visible_gpus
    from phalanx.output import console

    no_python = options.no_python and not options.run_path  # --run-path wins, as in torchrun
    agents = bool(options.hosts or options.dns)
    backend = options.backend or ("cluster" if agents else "local")
    problem = (_check_target(options.target, options.module, no_python)
               or (None if not (options.hosts and options.dns) else
                   "--hosts and --dns both name the agents: give one")
               or (None if (backend == "cluster") == agents else
                   "--hosts names phalanx agents: use it with --backend cluster (or alone)"
                   if agents else "--backend cluster needs --hosts H:P,... or --dns NAME")
               or (None if options.dns or (options.agent_port is None
                                           and options.nameserver is None) else
                   "--agent-port and --nameserver go with --dns")
               or (None if options.token_file is None or agents else
                   "--token-file is the agents' token: use it with --hosts")
               or _sync_problem(options)
               or (None if not agents or options.token_file
                   or os.environ.get("PHALANX_TOKEN") else
                   "--hosts needs the agents' token: --token-file FILE or $PHALANX_TOKEN"))
    nodes = options.nodes or 1
    if problem is None and options.hosts and not options.nodes:
        nodes = len(options.hosts)
    elif problem is None and options.dns and not options.nodes:
        nodes, problem = _dns_nodes(options)
    problem = (problem
               or (None if options.address is None or backend == "ray" else
                   "--address names a Ray cluster: use it with --backend ray")
               or (None if options.rdzv_backend in runflags.RDZV_BACKENDS else
                   f"--rdzv-backend {options.rdzv_backend!r} is not supported: use "
                   f"{' or '.join(runflags.RDZV_BACKENDS)}"))
    try:
        job = None if problem else _job(options)
        gpus = len(visible_gpus())
        procs = runflags.procs_per_node(str(options.nproc_per_node), gpus, os.cpu_count() or 1)
    except ValueError as exc:
        problem = problem or str(exc)
    if problem is not None:
        parser.exit(USAGE_ERROR, f"phalanx run: {problem}\n")
    if options.nproc_per_node == "auto" and options.framework in ("torch", "jax"):
        # the framework's own count: one rank per GPU, else 1 (every launcher says its own)
        procs = "auto" if job is None else max(gpus, 1)
    for notice in runflags.no_effect_notices(options) + runflags.no_effect_conf(
            options.rdzv_conf):
        console.notice(notice)
    run_options = launcher.RunOptions(
        target=options.target,
        args=tuple(options.args),
        is_module=options.module,
        nodes=nodes,
        procs_per_node=procs,
        framework=options.framework,
        gpus_per_worker=options.gpus_per_worker,
        max_restarts=options.max_restarts,
        log_dir=options.log_dir,
        ranks=options.ranks,
        local_ranks=options.local_ranks_filter,
        collapse=not options.no_collapse,
        grace=options.grace if options.shutdown_timeout is None else options.shutdown_timeout,
        start_timeout=options.start_timeout,
        role=options.role,
        run_id=options.rdzv_id,
        no_python=no_python,
        master_addr=options.master_addr,
        master_port=options.master_port,
        backend=backend,
        address=options.address,
        hosts=options.hosts,
        dns=options.dns,
        agent_port=options.agent_port,
        nameserver=options.nameserver,
        token_file=options.token_file,
        sync=options.sync,
        exit_code=options.exit_code,
        job=job,
    )
    try:
        return launcher.run(run_options)
    except launcher.BadOptions as exc:  # options the group refused before starting
        parser.exit(USAGE_ERROR, f"phalanx run: {exc}\n")
    except (PhalanxError, OSError) as exc:  # a missing framework, an unwritable log dir
        parser.exit(1, f"phalanx run: {exc}\n")
    return USAGE_ERROR  # pragma: no cover


def _dns_nodes(options: argparse.Namespace) -> tuple[int, str | None]:
    """With ``--dns`` and no ``--nodes``: one node per agent the name lists now."""
    from phalanx.backends.cluster import dns as dnsquery

    try:
        found = dnsquery.resolve(options.dns, options.nameserver)
    except (dnsquery.DNSError, ValueError) as exc:
        return 1, f"--dns {options.dns}: {exc}"
    if not found:
        return 1, f"--dns {options.dns} lists no agent yet: wait for it, or give --nodes N"
    return len(found), None


def _sync_problem(options: argparse.Namespace) -> str | None:
    """Why ``--sync`` cannot ship the program; None if it can (or is not given)."""
    if options.sync is None:
        return None
    if not (options.hosts or options.dns):
        return "--sync ships code to the agents: use it with --hosts"
    if not os.path.isdir(options.sync):
        return f"--sync {options.sync!r} is not a directory"
    if options.no_python or options.module:
        return None  # a command or module found on the ranks' path
    if path_in_tree(options.target, options.sync) is None:
        return f"--sync {options.sync!r} does not hold the script {options.target!r}"
    return None


def _job(options: argparse.Namespace) -> JobOptions | None:
    """The job this launcher joins with ``--nnodes N`` (N > 1), else None; ValueError
    when its options cannot work."""
    refusal = runflags.srun_refusal(options)
    if refusal is not None:
        raise ValueError(refusal)
    low, high = runflags.parse_nnodes(options.nnodes)
    if high == 1:
        if options.node_rank != 0 and not runflags.node_rank_from_srun(options):
            raise ValueError(f"--node-rank {options.node_rank}: with one node it must be 0")
        return None
    problem = runflags.several_nodes_problem(options, (low, high))
    if problem is not None:
        raise ValueError(problem)
    static = options.rdzv_backend == "static"
    if static:
        port = options.master_port or runflags.STATIC_PORT
        if not 0 < port < 65536:
            raise ValueError(f"--master-port expects a port in 1-65535, got {port}")
        address = (runflags.endpoint(options.rdzv_endpoint, port) if options.rdzv_endpoint
                   else (runflags.master_addr(options), port))
    else:
        address = runflags.endpoint(options.rdzv_endpoint, runflags.C10D_PORT)
    conf = options.rdzv_conf
    return JobOptions(low, high, options.node_rank if static else None, static, address,
                      join_timeout=conf["join_timeout"], last_call=conf["last_call_timeout"])


def _debug(options: argparse.Namespace) -> int:
    from pathlib import Path

    from phalanx.cli import debug
    from phalanx.errors import PhalanxError

    directory = Path(options.dir) if options.dir else debug.default_dir()
    try:
        records = debug.waiting_ranks(directory)
        wants_list = options.list or (
            options.rank is None and options.pid is None and len(records) > 1
        )
        if wants_list:
            if not records:
                print(f"no rank is waiting for a debugger (in {directory})")
            else:
                print(debug.describe_waiting(records))
                where = f" --dir {options.dir}" if options.dir else ""
                print(f"\nattach with: phalanx debug RANK{where}  (or --pid PID)")
            return 0
        record = debug.choose(records, options.rank, options.pid, directory)
        debug.attach(record, sys.stdout, sys.stderr)
    except (PhalanxError, OSError) as exc:  # nothing to attach to, an unsafe directory
        print(f"phalanx debug: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
