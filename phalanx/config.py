"""Defaults, and the environment variables phalanx reads or sets, in one place.

The controller reads its own environment once, in :meth:`Settings.from_env`; workers read
the variables the controller set for them once, at start-up.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

DEFAULT_START_TIMEOUT = 120.0  # seconds for every worker to construct its object
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds for cleanup and a graceful exit before SIGKILL
DEFAULT_TERM_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when stopping one worker
STDERR_TAIL_LINES = 20  # lines of a dead worker's stderr quoted in WorkerDied
STDERR_TAIL_LINE_BYTES = 500  # of each quoted line; the rest is replaced by a count
STDERR_TAIL_CHARS = 4000  # the whole quote, at most (older lines are dropped first)
COLLAPSE_WINDOW = 0.2  # seconds a worker line waits for identical lines from other ranks
COLLAPSE_MAX_LINE = 64 * 1024  # longer lines are shown at once, never held for collapsing
# A longer worker line is shown (with its rank prefix) in pieces of at most this many bytes
# as it arrives, so the controller holds about this much per stream; log files get it whole.
MAX_LINE_BYTES = 1024 * 1024
ORPHAN_GRACE = 1.0  # seconds a worker waits for its main thread after losing the controller
EXIT_WAIT = 1.0  # after its control stream ended, how long a process may take to exit
OUTPUT_WAIT = 0.2  # how long a death waits for the rank's last stderr lines
# ... of which the pumping thread waits this long itself (the output's reader sees the end
# of a dead rank's pipes a moment after the controller does), before a helper takes over
OUTPUT_PEEK = 0.003
HANDSHAKE_TIMEOUT = 5.0  # seconds a peer connecting to the controller has to prove the secret
SPAWN_TIMEOUT = 30.0  # seconds for the node supervisor to report a new worker's pid
STACKS_TIMEOUT = 1.0  # seconds a rank has to dump its threads' stacks
STACKS_ON_TIMEOUT = 1.0  # a CallTimeout of at least this many seconds carries stacks
DEFAULT_HEARTBEAT_TIMEOUT = 180.0  # seconds of silence before a rank is unresponsive
# seconds some ranks may wait in a collective that others have not entered before the
# call raises CollectiveStuck and the ranks are released
DEFAULT_COLLECTIVE_TIMEOUT = 180.0
# seconds a detached group's nodes keep its ranks after its controller went, waiting for
# another to attach (px.attach), before they stop them
DEFAULT_DETACH_TIMEOUT = 600.0
# seconds a cluster node's agent may give no sign of life (it sends one every second, from a
# thread of its own) before the node is lost: frozen, its machine gone, or its link cut
DEFAULT_NODE_TIMEOUT = 15.0
AGENT_PORT = 32300  # phalanx agent's control port (its HTTP port: the next one)
# px.SlurmBackend: an agent srun started exits if its controller has not come this long (the
# controller died while the job was pending), so that the job ends by itself
SLURM_AGENT_IDLE_TIMEOUT = 600.0
SLURM_COMMAND_TIMEOUT = 30.0  # seconds for one sbatch, squeue, scontrol or scancel
SLURM_POLL = 0.5  # seconds between looks at a pending job and at the agents' addresses
# seconds for a submitted job to end by itself once its agents are told to go; then scancel
SLURM_END_WAIT = 10.0
# seconds, at most, a rank killed or a node lost on a Slurm job that Slurm is ending waits
# for it to say why (its state while COMPLETING hides it: cancelled, the time limit, ...)
SLURM_CAUSE_WAIT = 3.0
# seconds between the notices of a quorum wait naming the agents not there yet and why
# (a wrong port or token shows at once, not after quorum_timeout's 300 s of silence)
QUORUM_REPORT_EVERY = 5.0
DEFAULT_STRAGGLER_WARNING = 120.0  # seconds after a call's first answer to name late ranks
MAX_GROUP_NAME = 64  # characters of a group's name (WorkerGroup(name=)), in every message
CLEANUP_WAIT = 5.0  # seconds for a rank's keeper to end what the rank left running
CONNECT_TIMEOUT = 30.0  # seconds a rank's node side has to reach the controller
# A call whose arguments carry at least this many bytes of out-of-band buffers (numpy
# arrays, torch CPU tensors) sends them through each node's shared memory
# (phalanx.controller.shared).
AUTO_SHARE_BYTES = 1 << 20
SHARE_BLOCK_PREFIX = "phalanx-"  # every shared-memory block's name (memfd:phalanx-<token>)
SHARE_POOL_BYTES = 1 << 30  # freed blocks the controller keeps for reuse: at most this many
SHARE_POOL_BLOCKS = 4  # bytes, and this many blocks
# The cluster agent (phalanx agent). Connections before authentication are bounded: each
# holds a thread and a descriptor until it proves the token or its handshake times out, so
# a burst of silent connections could otherwise take every descriptor the agent has.
AGENT_HANDSHAKE_TIMEOUT = 5.0  # seconds a connecting controller has to prove the token
AGENT_MAX_UNAUTHENTICATED = 64  # connections still in their handshake, all peers together
AGENT_MAX_UNAUTHENTICATED_PER_PEER = 16  # of them from one peer address
AGENT_LISTEN_BACKLOG = 512  # connections the kernel queues before the agent accepts them
# Sessions an agent serves at once (controllers that proved the token: each group's, pool's
# and parent agent's connection is one), each holding threads and descriptors for as long as
# it stays; past them a controller is refused, naming the limit (phalanx agent
# --max-sessions).
AGENT_MAX_SESSIONS = 64
# After accept() failed (no descriptor left, no thread could start), how long the agent
# waits before it tries again: the first retry soon, then up to the maximum.
AGENT_ACCEPT_BACKOFF = 0.05
AGENT_ACCEPT_BACKOFF_MAX = 1.0
# The agent's HTTP port (/health, /metrics): a client has this long for its whole request
# (not per read: a header line every few seconds does not keep it), and at most this many
# connections are served at once; more are closed at once.
AGENT_HTTP_REQUEST_TIMEOUT = 5.0
AGENT_HTTP_MAX_CONNECTIONS = 32
AGENT_HTTP_BACKLOG = 128
# Every plain-HTTP port (the agent's, the dashboard's): a request's header lines together
# may take this many bytes; past them it is refused with 431 (phalanx.wire.httpserve).
HTTP_MAX_HEADER_BYTES = 32 * 1024
# px.dashboard(): a request has this long from its connection being taken to carrying the
# token (not per read), and at most this many connections without it are served at once, a
# quarter of them from one address (the oldest is shut down to make room). Read when a
# dashboard starts.
DASHBOARD_REQUEST_TIMEOUT = 10.0
DASHBOARD_MAX_CONNECTIONS = 32
DASHBOARD_BACKLOG = 128
# A rank stopped in px.breakpoint() (phalanx.rank.debugger): connections waiting to be
# checked are served together, one thread, so strangers that connect and say nothing delay
# no one; each has this long to send the token, and past the most held at once the oldest is
# dropped (the owner's client sends its token at once).
DEBUG_TOKEN_TIMEOUT = 5.0
DEBUG_MAX_PENDING = 128
DEBUG_BACKLOG = 128
# A multi-node phalanx run's host (phalanx.launcher.jobhost): each launcher's connection
# holds a thread there. Past the job's most nodes (--nnodes) plus this many, a connection is
# refused at once (a "refused" message naming the limit) and closed, with no thread.
JOB_MAX_EXTRA_CONNECTIONS = 64
# ... and a connection that has not sent its join within this many seconds is closed, so
# that silent connections cannot hold those places and turn a real launcher away.
JOB_JOIN_WITHIN = 30.0
# The shared token, read by a controller and an agent; kept out of every rank's environment
# (phalanx.node.spawn), since user code runs there.
ENV_TOKEN = "PHALANX_TOKEN"
WITHHELD_FROM_RANKS = (ENV_TOKEN,)
# Ray backend
# After a rank's stream ends, the longest wait for how it ended. It ends as soon as the exit
# status is known (its warden, or its actor's return, reports it within a few ms) or nothing
# is left that could tell it (the warden is gone, and Ray has given its account); the bound
# only runs out when a source still alive is that slow -- seconds on a loaded node, where a
# shorter one posted deaths with no exit status at all.
RAY_CAUSE_WAIT = 10.0
# Of which, once the exit status is known, the longest wait for Ray's own account too (it
# names causes the status cannot: ray.kill(), Ray's memory monitor, a node's death)
RAY_REASON_WAIT = 0.25
RAY_SIGNAL_TIMEOUT = 10.0  # seconds for a signal to reach a rank through its actor
RAY_KILL_WAIT = 10.0  # seconds for killed actors to be reported gone
# What an agent takes from a controller (phalanx.backends.cluster.messages.check_request):
# a count or a size over its limit is refused, naming the field, before any work starts.
AGENT_MAX_FRAME_SEGMENTS = 1 << 18  # segments in one frame (its table: 2 MiB)
AGENT_MAX_PORTS = 1024  # free ports one PORTS request picks
AGENT_MAX_RANKS = 4096  # ranks of one node: a LAUNCH's starts, a STOP's or a WAIT's list
AGENT_MAX_FILES = 1 << 17  # shipped code: files in a SYNC or TREE listing, a BLOBS batch
AGENT_MAX_TREE = 1 << 16  # agents one ADOPT places below this one
# the top agents of a tree: the connections a controller holds (its CPU per call grows with
# them; each agent below holds up to the backend's fanout). A no-op call to 1,000
# simulated nodes took 0.73 ms of its CPU with 4, 1.35 ms with 8, 5.1 ms with 50 (on 2
# cores, the agents simulated beside it)
TREE_TOP_FANOUT = 4
AGENT_MAX_ENV = 4096  # variables of one rank's environment, entries of its sys.path (LAUNCH)
# requests of one controller in progress at once (each waits on a thread of its own)
AGENT_MAX_REQUESTS = 1024
AGENT_MAX_HELD = 4096  # put objects one controller holds on a node (each a memfd)
# bytes of put objects one controller holds on a node (phalanx agent --max-held-mib);
# None: half the node's memory (its cgroup's limit, if lower)
AGENT_MAX_HELD_BYTES: int | None = None
# Which processes may map each other's memory blocks (phalanx.wire.memfd.block_domain):
# set on agents that stand for separate machines on one (tests, benchmarks), so that their
# ranks pass kept results to each other as between machines, through the agents.
ENV_BLOCK_DOMAIN = "PHALANX_BLOCK_DOMAIN"
KEPT_COPY_TIMEOUT = 300.0  # s: for an agent to fetch a kept result from another's

# Set by the controller for each worker (the framework-agnostic names are in frameworks.py).
ENV_FD = "PHALANX_FD"  # file descriptor of the worker's control socket
ENV_FRAME_KEYS = "PHALANX_FRAME_KEYS"  # its frame keys, when that socket crossed a network
ENV_GROUP = "PHALANX_GROUP"  # its group's name (px.breakpoint() records it for phalanx debug)
# the modules the node's supervisor imports once and forks the group's ranks from
# (comma-separated), and the path to find them on (os.pathsep-separated); read by the
# supervisor's starter, never by the rank (phalanx.node.keeper._Preload)
ENV_PRELOAD = "PHALANX_PRELOAD"
ENV_PRELOAD_PATH = "PHALANX_PRELOAD_PATH"
ENV_PARENT_PID = "PHALANX_PARENT_PID"  # the parent's pid, re-checked after PDEATHSIG
ENV_RANK_SCHED = "PHALANX_RANK_SCHED"  # "batch" (default) or "normal": a rank's CPU policy
# "1": run the pure-Python twins of phalanx.wire._speedups even where it was built (read by
# phalanx.wire.compiled at import, in every process, from its own environment)
ENV_PURE_PYTHON = "PHALANX_PURE_PYTHON"
ENV_STACKS_FD = "PHALANX_STACKS_FD"  # file the worker dumps its threads' stacks into
STACKS_SIGNAL = signal.SIGRTMIN + 3  # asks for that dump (SIGUSR1/2 are the frameworks')
# (phalanx.node.stacks) A rank's own stack thread, named STACKS_THREAD, answers STACKS_REQUEST
# with its stacks read under the GIL, a record between two STACKS_MARKs in that file;
# STACKS_SIGNAL, sent to that thread only, makes faulthandler dump them without the GIL.
STACKS_REQUEST = signal.SIGRTMIN + 4
STACKS_THREAD = "phalanx-stacks"  # as /proc/PID/task/TID/comm shows it (15 bytes at most)
STACKS_MARK = "\x1e"  # ASCII RS: never in faulthandler's output (it escapes control bytes)

# Read from the controller's environment.
ENV_START_TIMEOUT = "PHALANX_START_TIMEOUT"
ENV_PROGRESS = "PHALANX_PROGRESS"  # "0" hides the start-up progress bar, "1" forces it


class Settings:
    """Controller-side settings that may come from the environment.

    A plain class, not a dataclass: the node supervisor imports this module, and its start
    is on a rank's critical path (``dataclasses`` costs it ~5 ms).
    """

    __slots__ = ("progress", "start_timeout")

    def __init__(self, start_timeout: float = DEFAULT_START_TIMEOUT,
                 progress: bool | None = None) -> None:
        self.start_timeout = start_timeout
        self.progress = progress  # None: show when stderr is a terminal

    def __repr__(self) -> str:
        return f"Settings(start_timeout={self.start_timeout!r}, progress={self.progress!r})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        progress = env.get(ENV_PROGRESS)
        start_timeout = env.get(ENV_START_TIMEOUT)
        try:
            timeout = float(start_timeout) if start_timeout else DEFAULT_START_TIMEOUT
        except ValueError:
            raise ValueError(
                f"{ENV_START_TIMEOUT}={start_timeout!r} is not a number of seconds"
            ) from None
        return cls(
            start_timeout=timeout,
            progress=None if progress is None else progress not in ("0", "false", ""),
        )
