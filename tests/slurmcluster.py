"""A real two-node Slurm cluster on this machine, for the tests that submit to Slurm.

Debian's ``slurm-wlm`` and ``munge`` (``scripts/setup-slurm`` installs them): a munged of
its own (own key, own socket), one slurmctld and two slurmd, ``n1`` on 127.0.0.2 and ``n2``
on 127.0.0.3, each declaring ``CPUS_PER_NODE`` CPUs (the machine may have fewer: the nodes
oversubscribe it, which Slurm does not check with ``task/none``), partition ``debug``.
Everything lives in a private temporary directory and listens on ports free when the
cluster starts, so it neither needs nor touches a system Slurm. slurmd runs as root (it
switches to the job's user), hence :func:`available`.

Every daemon runs in the foreground under a small supervisor (``_SUPERVISOR``) that is a
child of this process and a *child subreaper*: slurmd launches each job step's slurmstepd
through a double fork, so without one the slurmstepds and the jobs' processes would be
reparented to init, out of reach of this process. Under the supervisor they stay this
process's descendants; the supervisor reaps them as they end, and when its daemon exits
(or this process dies) it SIGKILLs whatever is left below it before exiting itself. The
supervisors are registered in ``helpers.CLUSTER_ROOTS`` while they run (the suite's rule
that no test leaves a child behind does not count the cluster); :meth:`SlurmCluster.
leftovers` is the check that no job step is left running under the slurmds.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

NODES = ("n1", "n2")
ADDRESSES = ("127.0.0.2", "127.0.0.3")
CPUS_PER_NODE = 2
PARTITION = "debug"
START_TIMEOUT = 30.0  # seconds for the whole cluster to be up, both nodes idle
COMMAND_TIMEOUT = 20.0  # seconds for one client command (sinfo, scancel, ...)
STOP_TIMEOUT = 10.0  # seconds for a daemon to exit on SIGTERM before it is killed
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey")
CLIENTS = ("sinfo", "squeue", "srun", "sbatch", "scancel", "scontrol", "sdiag")
SBIN = ("/usr/sbin", "/sbin")  # where the daemons are, not always on PATH
running: SlurmCluster | None = None  # the cluster started last and not yet stopped

# Runs ``argv[2:]`` as its child and reaps every process orphaned below it (it is a child
# subreaper), SIGTERM/SIGINT/SIGHUP go on to the daemon, SIGUSR1 SIGKILLs it; once the
# daemon has exited, everything left below is SIGKILLed and reaped, then it exits with the
# daemon's status. ``argv[1]``: the pid of its parent, whose death SIGKILLs all of it too.
# Written into the cluster's directory and run with ``python -I -S`` (stdlib only: quick).
_SUPERVISOR = r"""
# The supervisor of one daemon of a Slurm test cluster (tests/slurmcluster.py).
import ctypes, os, signal, sys, time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
libc = ctypes.CDLL(None, use_errno=True)
if (libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
        or libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0) != 0):
    sys.exit(f"supervisor: prctl failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):  # the parent died before PR_SET_PDEATHSIG was set
    sys.exit("supervisor: the test process is gone")
argv = sys.argv[2:]
main = os.fork()
if main == 0:
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"supervisor: cannot run {argv[0]}: {exc}", file=sys.stderr, flush=True)
    os._exit(127)
status = None

def forward(sig, frame):
    if status is None:
        os.kill(main, signal.SIGKILL if sig == signal.SIGUSR1 else sig)

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(sig, forward)
while status is None:
    pid, code = os.waitpid(-1, 0)
    if pid == main:
        status = code

def children():
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found

while True:
    for child in children():
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.01)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN])
    return shutil.which(name, path=path)


@functools.cache
def available() -> str | None:
    """None when this machine can run the cluster, else why not (a skip's reason)."""
    if not sys.platform.startswith("linux"):
        return f"the Slurm test cluster needs Linux (this is {sys.platform})"
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found; scripts/setup-slurm "
                "installs slurm-wlm and munge)")
    if os.geteuid() != 0:
        return (f"the Slurm test cluster runs slurmd, which needs root (this is uid "
                f"{os.geteuid()})")
    for name in ("slurmd", "munged"):
        try:
            subprocess.run([_which(name), "-V"], capture_output=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{name} -V failed: {exc}"
    return None


class SlurmCluster:
    """A running cluster: its files, its daemons, and what tests do to it.

    ``dir``: its temporary directory; ``conf``: its slurm.conf; ``env``: what a client's
    environment needs (``SLURM_CONF``), to merge into ``os.environ``; ``nodes``: the node
    names; ``addresses``: each node's address; ``ports``: the ports it listens on;
    ``procs``: the supervisors of ``munged``, ``slurmctld`` and each node's slurmd (by node
    name), the Popen objects of this process's children.
    """

    def __init__(self, directory: str, ports: dict[str, int]) -> None:
        self.dir = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.env = {"SLURM_CONF": self.conf}
        self.nodes = list(NODES)
        self.addresses = dict(zip(NODES, ADDRESSES, strict=True))
        self.ports = ports
        self.procs: dict[str, subprocess.Popen] = {}
        self.munge_socket = os.path.join(directory, "munge", "socket")
        self.key_file = os.path.join(directory, "munge-key", "key")

    # -- files -----------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def log_files(self) -> dict[str, list[str]]:
        """Each daemon's log files: its own log and what it wrote on stdout/stderr."""
        files = {"munged": [self.path("log", "munged.log")],
                 "slurmctld": [self.path("log", "slurmctld.log")]}
        files.update({node: [self.path("log", f"slurmd.{node}.log")] for node in self.nodes})
        for name in files:
            files[name].append(self.path("log", f"{name}.out"))
        return files

    def logs(self, lines: int = 20) -> str:
        """The last ``lines`` of each daemon's logs, for a failure's message."""
        parts = []
        for name, paths in self.log_files().items():
            for path in paths:
                try:
                    with open(path, errors="replace") as f:
                        tail = f.readlines()[-lines:]
                except OSError:
                    continue
                if tail:
                    parts.append(f"--- {os.path.basename(path)} ({name}):\n" + "".join(tail))
        return "\n".join(parts) or "(no daemon wrote a log)"

    # -- commands --------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT,
            check: bool = False) -> subprocess.CompletedProcess:
        """A client command (``srun``, ``sinfo``, ...) against this cluster: its output."""
        return subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=timeout, check=check,
                              stdin=subprocess.DEVNULL)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo reports it ("idle", "alloc", "idle*", "down*", ...);
        empty when slurmctld does not answer."""
        try:
            out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T",
                           timeout=5).stdout
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def scheduled_once(self) -> bool:
        """Whether slurmctld's main scheduler has run (sdiag counts its cycles)."""
        try:
            out = self.run("sdiag", timeout=5).stdout
        except subprocess.TimeoutExpired:
            return False
        main = out.partition("Main schedule statistics")[2]
        cycles = main.partition("Total cycles:")[2].split()
        return bool(cycles) and cycles[0].isdigit() and int(cycles[0]) > 0

    def jobs(self) -> list[str]:
        """The ids of the jobs not yet over (pending, running, completing)."""
        out = self.run("squeue", "--noheader", "--format=%i").stdout
        return out.split()

    # -- processes -------------------------------------------------------------------------

    def _daemon(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        """``argv`` under a supervisor, a child of this process, registered as a cluster
        root (its descendants are not a test's leftovers)."""
        from tests import helpers

        with open(self.path("log", f"{name}.out"), "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", self.path("supervise.py"), str(os.getpid()),
                 *argv],
                env={**os.environ, **self.env}, cwd=self.dir, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # a Ctrl-C reaches the tests, whose teardown stops it
        self.procs[name] = proc
        helpers.CLUSTER_ROOTS.add(proc.pid)
        return proc

    def _start_node(self, node: str) -> None:
        self._daemon(node, [_which("slurmd"), "-D", "-N", node, "-f", self.conf])

    def descendants(self, name: str) -> list:
        """The processes below one supervisor (psutil.Process objects)."""
        import psutil

        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return []
        try:
            return psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def steps(self) -> list:
        """The job steps' processes: each slurmstepd and what runs below it, on any node."""
        import psutil

        found = []
        for node in self.nodes:
            daemon = None
            proc = self.procs.get(node)
            if proc is not None:
                try:  # the supervisor's first child is its slurmd, the rest is the jobs'
                    daemon = min((p for p in psutil.Process(proc.pid).children()
                                  if _name(p) == "slurmd"), key=lambda p: p.pid, default=None)
                except psutil.Error:
                    pass
            found += [p for p in self.descendants(node)
                      if daemon is None or p.pid != daemon.pid]
        return found

    def leftovers(self, timeout: float = 5.0) -> list[str]:
        """The job steps still running after ``timeout`` s (a finished job's slurmstepd
        takes a moment to exit), described; empty when none is."""
        from tests.helpers import wait_until

        if wait_until(lambda: not self.steps(), timeout, interval=0.05):
            return []
        return [_describe(p) for p in self.steps()]

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def wait_idle(self, nodes: Sequence[str] | None = None,
                  timeout: float = START_TIMEOUT) -> None:
        """Wait until sinfo reports ``nodes`` (all by default) idle; RuntimeError with the
        daemons' logs if they are not within ``timeout`` s or a daemon exits."""
        nodes = list(self.nodes if nodes is None else nodes)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm test cluster: {', '.join(dead)} exited "
                                   f"({self._statuses()})\n{self.logs()}")
            states = self.node_states()
            if all(states.get(node) == "idle" for node in nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: nodes {nodes} not idle within "
                                   f"{timeout:g} s (sinfo: {states or 'no answer'})\n"
                                   f"{self.logs()}")
            time.sleep(0.1)

    def _statuses(self) -> str:
        return ", ".join(f"{name}: {proc.poll()}" for name, proc in self.procs.items())

    def kill_node(self, node: str, mark_down: bool = False) -> None:
        """Lose ``node`` as a machine is lost: its slurmd and every job process on it
        SIGKILLed at once. slurmctld is not told: it finds out as it would, when the node
        stops answering its pings (with SlurmdTimeout=30 it reports the node not
        responding after ~25 s and DOWN, failing its jobs, after ~50 s). ``mark_down``: tell
        it at once (``scontrol update State=DOWN``, as an admin or a health check would):
        the node's jobs end as NODE_FAIL within a second or so."""
        proc = self.procs[node]
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # the supervisor SIGKILLs its slurmd and the rest
        _wait_or_kill(proc, STOP_TIMEOUT)
        self._forget(node)
        if mark_down:
            self.run("scontrol", "update", f"NodeName={node}", "State=DOWN",
                     "Reason=killed by the test", check=True)

    def restart_node(self, node: str, timeout: float = START_TIMEOUT) -> None:
        """Start ``node``'s slurmd again (killing it first if it runs) and wait until
        slurmctld reports the node idle (``ReturnToService=2`` brings a down node back)."""
        from tests.helpers import wait_until

        deadline = time.monotonic() + timeout
        if self.alive(node):
            # a job that just ended is cleaned up on its nodes (COMPLETING) by a message
            # from slurmctld; killed before it arrives, the node stays COMPLETING until
            # slurmctld resends it, ~30 s later: let that finish first (bounded)
            wait_until(lambda: "completing" not in self.node_states().get(node, ""),
                       min(5.0, timeout / 2), interval=0.05)
            self.kill_node(node)
        self._start_node(node)
        # slurmctld may still report a node it has not missed yet idle: first the new
        # slurmd listening (it registers once it listens), then the node idle
        while not self._slurmd_listening(node):
            if not self.alive(node) or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: slurmd of {node} did not start "
                                   f"({self._statuses()})\n{self.logs()}")
            time.sleep(0.02)
        self.wait_idle([node], max(1.0, deadline - time.monotonic()))

    def _slurmd_listening(self, node: str) -> bool:
        import psutil

        for proc in self.descendants(node):
            if _name(proc) != "slurmd":
                continue
            # (psutil < 6 has connections() only, 7 deprecates it)
            connections = getattr(proc, "net_connections", None) or proc.connections
            try:
                return any(conn.status == psutil.CONN_LISTEN and
                           conn.laddr.port == self.ports[node]
                           for conn in connections(kind="tcp"))
            except psutil.Error:
                return False
        return False

    def _forget(self, name: str) -> None:
        from tests import helpers

        proc = self.procs.get(name)
        if proc is not None:
            helpers.CLUSTER_ROOTS.discard(proc.pid)

    def cancel_all(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Cancel every job and wait (bounded) until none runs; whether none does."""
        if not self.alive("slurmctld"):
            return False
        from tests.helpers import wait_until

        try:
            jobs = self.jobs()
            if jobs:
                self.run("scancel", "--full", "--quiet", *jobs)
            return wait_until(lambda: not self.jobs() and not self.steps(), timeout,
                              interval=0.1)
        except subprocess.TimeoutExpired:
            return False


def _name(proc) -> str:
    import psutil

    try:
        return proc.name()
    except psutil.Error:
        return ""


def _describe(proc) -> str:
    import psutil

    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline()) or proc.name()}"
    except psutil.Error:
        return f"pid {proc.pid}: <gone>"


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for a supervisor to exit; past ``timeout`` s make it SIGKILL its daemon, and
    past twice that SIGKILL it and all below it."""
    import psutil

    try:
        proc.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGUSR1)
    try:
        proc.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    for p in below:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.kill()
    proc.wait(timeout)
    psutil.wait_procs(below, timeout=timeout)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on every address now (each held until all are
    picked, so none is picked twice)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def slurm_conf(cluster: SlurmCluster, extra: dict[str, str] | None = None) -> str:
    """The cluster's slurm.conf (every path absolute: slurmctld changes directory).
    ``extra``: settings added or replacing these (``{"SlurmdTimeout": "10"}``)."""
    d = cluster.path
    settings = {
        "ClusterName": "pxtest",
        "SlurmctldHost": "localhost(127.0.0.1)",
        "SlurmctldPort": str(cluster.ports["slurmctld"]),
        "SlurmdPort": str(cluster.ports["slurmd"]),
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={cluster.munge_socket}",
        "CredType": "cred/munge",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "StateSaveLocation": d("state"),
        "SlurmdSpoolDir": d("spool", "%n"),
        "SlurmctldPidFile": d("slurmctld.pid"),
        "SlurmdPidFile": d("slurmd.%n.pid"),
        "SlurmctldLogFile": d("log", "slurmctld.log"),
        "SlurmdLogFile": d("log", "slurmd.%n.log"),
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "SchedulerType": "sched/backfill",
        # Slurm defers scheduling to its next pass when a batch job is submitted or a job
        # ends (batch_sched_delay, 3 s by default): a queued job started ~2.5 s after the
        # one before it ended, a batch job 2-3 s after sbatch. With 0: ~0.3 s and ~1 s.
        "SchedulerParameters": "batch_sched_delay=0",
        "JobCompType": "jobcomp/none",
        "AccountingStorageType": "accounting_storage/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "MpiDefault": "none",
        "ReturnToService": "2",
        "SlurmctldTimeout": "30",
        "SlurmdTimeout": "30",
        "InactiveLimit": "0",
        "KillWait": "2",
        "MinJobAge": "30",
        "PlugStackConfig": "/dev/null",
    }
    settings.update(extra or {})
    lines = [f"{key}={value}" for key, value in settings.items()]
    for node in cluster.nodes:
        lines.append(f"NodeName={node} NodeAddr={cluster.addresses[node]} "
                     f"NodeHostname=localhost Port={cluster.ports[node]} "
                     f"CPUs={CPUS_PER_NODE} RealMemory=2000")
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(cluster.nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def start(extra_conf: dict[str, str] | None = None,
          timeout: float = START_TIMEOUT) -> SlurmCluster:
    """Start the cluster and wait until both nodes are idle (RuntimeError, with the
    daemons' logs, if they are not within ``timeout`` s: the cluster is then stopped)."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"cannot start the Slurm test cluster: {reason}")
    directory = tempfile.mkdtemp(prefix="phalanx-slurm-")
    os.chmod(directory, 0o755)  # the munge socket below must be reachable
    ports = dict(zip(("slurmctld", "slurmd", *NODES), _free_ports(2 + len(NODES)),
                     strict=True))
    cluster = SlurmCluster(directory, ports)
    try:
        for sub, mode in (("munge-key", 0o700), ("munge", 0o755), ("log", 0o755),
                          ("state", 0o755), ("spool", 0o755)):
            os.mkdir(cluster.path(sub), mode)
            os.chmod(cluster.path(sub), mode)  # whatever the umask
        for node in cluster.nodes:
            os.mkdir(cluster.path("spool", node), 0o755)
        with open(cluster.conf, "w") as f:
            f.write(slurm_conf(cluster, extra_conf))
        with open(cluster.path("supervise.py"), "w") as f:
            f.write(_SUPERVISOR)
        subprocess.run([_which("mungekey"), "--create", "--keyfile", cluster.key_file,
                        "--bits", "1024"], check=True, capture_output=True,
                       timeout=COMMAND_TIMEOUT)
        cluster._daemon("munged", [
            _which("munged"), "--foreground", f"--socket={cluster.munge_socket}",
            f"--key-file={cluster.key_file}", f"--log-file={cluster.path('log', 'munged.log')}",
            f"--pid-file={cluster.path('munge', 'munged.pid')}",
            f"--seed-file={cluster.path('munge-key', 'seed')}"])
        deadline = time.monotonic() + timeout
        while not os.path.exists(cluster.munge_socket):
            if cluster.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: munged did not start\n"
                                   f"{cluster.logs()}")
            time.sleep(0.02)
        cluster._daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", cluster.conf])
        for node in cluster.nodes:
            cluster._start_node(node)
        cluster.wait_idle(timeout=max(1.0, deadline - time.monotonic()))
        # slurmctld's first scheduling pass comes ~3.5 s after it starts: a batch job
        # submitted before it waits for it (srun's allocations do not), so that
        # `sbatch --wait` would see the first job end 10 s after it began, not 2 s
        while not cluster.scheduled_once():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: slurmctld did not schedule within "
                                   f"{timeout:g} s\n{cluster.logs()}")
            time.sleep(0.05)
    except BaseException:
        stop(cluster)
        raise
    global running
    running = cluster
    return cluster


def strays(cluster: SlurmCluster) -> list:
    """Processes of this cluster that escaped its supervisors (which should not happen):
    any process run with its slurm.conf or naming its directory, but this process and
    its ancestors (whose environment has ``SLURM_CONF`` too)."""
    import psutil

    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        if proc.pid in mine:
            continue
        cmdline = " ".join(proc.info.get("cmdline") or [])
        environ = proc.info.get("environ") or {}
        if environ.get("SLURM_CONF") == cluster.conf or cluster.dir in cmdline:
            found.append(proc)
    return found


def stop(cluster: SlurmCluster) -> None:
    """Cancel every job, stop the slurmds, slurmctld, then munged (SIGTERM, SIGKILL past
    ``STOP_TIMEOUT``), kill whatever of the cluster still runs, remove its directory."""
    import psutil

    global running
    if running is cluster:
        running = None
    try:
        cluster.cancel_all()
        order = [[n for n in cluster.nodes if n in cluster.procs], ["slurmctld"], ["munged"]]
        for names in order:
            names = [n for n in names if n in cluster.procs]  # (a start that failed early)
            procs = [cluster.procs[n] for n in names]
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # the supervisor passes it on to its daemon
            for name, proc in zip(names, procs, strict=True):
                _wait_or_kill(proc, STOP_TIMEOUT)
                cluster._forget(name)
        left = strays(cluster)
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=STOP_TIMEOUT)
    finally:
        for name in list(cluster.procs):
            cluster._forget(name)
        shutil.rmtree(cluster.dir, ignore_errors=True)
