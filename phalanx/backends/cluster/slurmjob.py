"""A Slurm job that runs one ``phalanx agent`` per node, for :class:`~.slurm.SlurmBackend`.

Outside an allocation the job is submitted (``sbatch``) with a batch script of one line,
``srun ... phalanx agent --slurm DIR`` (one step, one task per node); inside one
(``$SLURM_JOB_ID`` set) that ``srun`` is run here, as a step of the allocation, and nothing
is submitted. ``DIR`` is a directory only this user can enter, under ``state_dir`` (a
filesystem the nodes share: ``~/.cache/phalanx/slurm`` by default), holding

    token        the job's token: 256 fresh bits (0600; never on a command line), removed
                 once every agent listens (each read it first); written back while the
                 agents keep a detached group, for the controller that attaches
    agents/<n>   ``host:port`` of node n's agent, written by the agent once it listens,
                 removed as it exits
    job          the job's id, its nodes in the group's order, and whether the agents
                 run as a step of an allocation (JSON), written once every agent listens:
                 how ``SlurmBackend(job=ID)`` finds the directory of job ``ID``
    job.sh       the batch script (a submitted job)
    agent-<host>.log, batch.log, srun.log   what the agents, the script and srun printed

``state_dir`` may be a path other users can reach, and whoever can write to it could swap
the job's directory for one of their own: have the controller dial an address of theirs,
plant a link where srun writes a log (and have it written over a file of the user's), or a
FIFO where the controller reads (and block it). So it is used only when it is a directory
of the user's that no one else can write to (created 0700; anything else is refused, before
anything is submitted, naming its owner and mode: :mod:`phalanx.output.ownfiles`), and the
controller opens the files in the job's directory without following links or blocking, and
only when they are regular files of its user.

The directory goes with the job however it ends: the controller removes it as the job ends
(:meth:`SlurmJob.end`); where the controller was killed, the last agent to exit removes it
(:meth:`~phalanx.backends.cluster.agent.slurmnode.SlurmNode.withdraw`), and where the
agents were killed too, the batch script does as its srun returns (a submitted job).

Its life, as :class:`JobState`: NEW, then PENDING while Slurm queues it (a notice names
Slurm's reason each time it changes), STARTING while the agents start and publish their
addresses, RUNNING once every node's has, and ENDED. It ends when its user is done
(:meth:`SlurmJob.end`: the agents, told by their connections' end, exit, and the job with
them; ``scancel`` after ``config.SLURM_END_WAIT``), and also when the controller dies: the
agents see their last connection end and exit (``--once``), which ends the step and the job.
A job whose controller died before its agents started ends by the agents' idle timeout.

A detached group (``WorkerGroup(..., detached=True)``) keeps the job past its controller:
its agents keep the group's session while it waits for another controller, and an agent
that serves one job (``--once``) counts that session as a connection, so it stays. The
controller writes the token back (:meth:`SlurmJob.keep_token`; it holds it in memory) for
the controller that attaches, which finds the job by its id (:meth:`SlurmJob.existing`)
and reads the agents' addresses and the token here. The group ended for good (shut down,
or nobody attaching within its ``detach_timeout``), its agents exit and the job ends with
them, its directory removed, as above.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

from phalanx import config
from phalanx.backends.cluster.token import new_token
from phalanx.errors import PhalanxError
from phalanx.output import console, ownfiles
from phalanx.world.slurm import JOB_AGENTS as AGENTS
from phalanx.world.slurm import JOB_TOKEN as TOKEN
from phalanx.world.slurm import expand_hostlist, parse_record

logger = logging.getLogger(__name__)

JOB = "job"  # DIR/job: the job's id, its nodes in order, whether a step (JSON)
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")  # a job's id (an array's task: 4711_3)

# Slurm's job states once a job is over (squeue's and scontrol's JobState)
_OVER = frozenset(("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"))


# pending reasons that no wait can cure: the request exceeds the partition, the account or
# the QOS (a cluster without EnforcePartLimits queues such a job for ever)
_HOPELESS = frozenset(("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                       "BadConstraints", "InvalidAccount", "InvalidQOS", "AccountNotAllowed",
                       "QOSNotAllowed", "PartitionDown", "InactiveLimit",
                       "QOSMaxNodePerJobLimit", "AssocMaxNodesPerJobLimit",
                       "QOSMaxWallDurationPerJobLimit", "AssocMaxWallDurationPerJobLimit"))


# states of a job Slurm is ending (its processes are being killed): the state it ends in
# shows once they are gone
_ENDING = frozenset(("COMPLETING", "SIGNALING", "STAGE_OUT"))
# states of a job Slurm ended and queued again (a node failure, a preemption): its agents
# were ended
_REQUEUED = frozenset(("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING"))

# What each of the states of a job over means, in a killed rank's or a lost node's message
_STATE_MEANS = {
    "CANCELLED": "it was cancelled with scancel, by its user or an administrator",
    "TIMEOUT": "it reached its time limit",
    "NODE_FAIL": "one of its nodes failed",
    "PREEMPTED": "it was preempted by another job",
    "OUT_OF_MEMORY": "a step ran out of memory",
    "DEADLINE": "it reached its deadline",
    "BOOT_FAIL": "its nodes failed to boot",
    "FAILED": "its batch script failed",
    "COMPLETED": "its batch script ended",
    "REVOKED": "it was revoked (a federated job run elsewhere)",
    "SPECIAL_EXIT": "it ended with a special exit state",
}

# slurmstepd's notice on a step's stderr as it signals the tasks: "slurmstepd: error: ***
# STEP 7.0 ON n1 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***" (JOB for a batch
# step; "DUE TO PREEMPTION", "DUE TO NODE FAILURE", or no cause for scancel)
_STEP_NOTICE = re.compile(
    r"\*\*\* ((?:JOB|STEP) \S+ ON \S+ ([A-Z_]+) AT [^*\n]*?) \*\*\*")
# the job state each "DUE TO" cause of such a notice stands for
_NOTICE_CAUSES = {"TIME LIMIT": "TIMEOUT", "PREEMPTION": "PREEMPTED",
                  "NODE FAILURE": "NODE_FAIL"}


# The batch script of a submitted job: one srun step of the agents. Its directory goes when
# the job ends (the controller removes it as it closes, and the agents as they end; this is
# for the job whose controller was killed and whose agents were too); a TERM from Slurm
# (scancel, the time limit) exits through the EXIT trap once srun has returned.
_BATCH_SCRIPT = """#!/bin/sh
# phalanx: one agent per node, for its controller
trap 'rm -rf -- {directory}' EXIT
trap 'exit 143' TERM INT HUP
{srun}
"""


# why a state_dir that is not private is refused, and what to do
_STATE_DIR_FIX = ("phalanx will not read an agent address from it, nor have Slurm write the "
                  "agents' logs there: give SlurmBackend(state_dir=) a directory of your own "
                  "that only you can write to (chmod 700 it), or a path that does not exist "
                  "yet (phalanx creates it, mode 0700)")


class JobState(enum.Enum):
    NEW = "new"
    PENDING = "pending"  # submitted; Slurm has not started it
    STARTING = "starting"  # running; its agents are starting
    RUNNING = "running"  # every node's agent listens
    ENDED = "ended"


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """What to ask Slurm for (``SlurmBackend``'s arguments)."""

    nodes: int | None = None
    partition: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()

    def sbatch_options(self) -> list[str]:
        """The request as sbatch's options (one task per node: the agent)."""
        options = [f"--nodes={self.nodes or 1}", "--ntasks-per-node=1"]
        for flag, value in (("--partition", self.partition), ("--time", self.time),
                            ("--gpus-per-node", self.gpus_per_node),
                            ("--cpus-per-task", self.cpus_per_node),
                            ("--account", self.account), ("--qos", self.qos)):
            if value is not None:
                options.append(f"{flag}={value}")
        return options + list(self.sbatch_args)

    def given(self) -> list[str]:
        """The arguments that shape a submitted job (they mean nothing in an allocation)."""
        return [name for name in ("partition", "time", "gpus_per_node", "cpus_per_node",
                                  "account", "qos") if getattr(self, name) is not None] + (
            ["sbatch_args"] if self.sbatch_args else [])


class SlurmJob:
    """The agents of one Slurm job (see the module's docstring)."""

    def __init__(self, request: JobRequest, *, state_dir: str | None = None,
                 allocation_timeout: float | None = None, start_timeout: float = 300.0,
                 environ: Mapping[str, str] | None = None) -> None:
        self.request = request
        self.allocation_timeout = allocation_timeout
        self.start_timeout = start_timeout
        self._environ = os.environ if environ is None else environ
        self.inside = bool(self._environ.get("SLURM_JOB_ID"))  # an allocation of our own
        self.job_id: str | None = self._environ.get("SLURM_JOB_ID") if self.inside else None
        self.step = self.inside  # the agents run as a step of an allocation (not the job)
        self.attached = False  # another controller's job, found by its id (existing())
        self.state = JobState.NEW
        self._state_dir = state_dir
        self.directory: str | None = None
        self.token = new_token()  # the agents' (written to DIR/token as it starts)
        self.hosts: list[str] = []  # "host:port" of each node's agent, in the job's order
        self.node_names: list[str] = []  # Slurm's name of each, in that order
        self._srun: subprocess.Popen[bytes] | None = None  # the agents' step (inside)
        self._why: str | None = None  # why Slurm ended it, once known (why_ended)
        self._why_lock = threading.Lock()
        # seconds: submit (sbatch's answer), queued (until Slurm ran it, submit included),
        # agents (from then until every agent listened: srun and the agents' start)
        self.timings: dict[str, float] = {}

    @property
    def label(self) -> str:
        return f"slurm job {self.job_id}" if self.job_id else "a slurm job"

    def allocation_nodes(self) -> int | None:
        """How many nodes the allocation this process runs in has (``SLURM_JOB_NUM_NODES``);
        None outside one. ValueError naming the variable when it is not a number."""
        if not self.inside:
            return None
        for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            text = self._environ.get(name, "").strip()
            if text:
                if not (text.isascii() and text.isdigit() and int(text) > 0):
                    raise ValueError(f"inside {self.label}: ${name}={text!r} is not a node "
                                     "count")
                return int(text)
        return 1

    @classmethod
    def existing(cls, job: str | int, state_dir: str | None = None) -> SlurmJob:
        """The running job ``job`` whose agents a controller's ``SlurmBackend`` started,
        for another controller to attach to its detached group: its directory under
        ``state_dir`` (the one holding that id in its ``job`` file), its nodes and the
        token its controller left there. ValueError for what is no job id; PhalanxError
        naming the job when it does not run, has no phalanx directory there, or keeps no
        detached group (only a detached group's controller leaves the token)."""
        if isinstance(job, bool) or not isinstance(job, (str, int)) or not _JOB_ID.match(
                str(job)):
            raise ValueError(f"job must be a Slurm job id such as '4711', got {job!r}")
        self = cls(JobRequest(), state_dir=state_dir, environ={})
        self.job_id, self.attached = str(job), True
        root = state_root(state_dir)
        found = self._directories(root)
        record = self.record()
        state = record.get("JobState", "")
        if not found:
            said = ("Slurm knows no such job (it may have ended long ago)" if not record
                    else f"it is {state}" if state != "RUNNING" else
                    "it runs, but not with agents of this state_dir (give SlurmBackend("
                    "state_dir=) as the controller that started it did)")
            raise PhalanxError(f"{self.label} has no phalanx directory under {root}: {said}")
        if state != "RUNNING":
            said = "Slurm knows it no more" if not record else f"it is {state}"
            raise PhalanxError(f"{self.label} is not running ({said}): its agents, and any "
                               f"detached group they kept, are gone")
        keeping = [(d, info) for d, info in found
                   if os.path.lexists(os.path.join(d, TOKEN))]
        if not keeping:
            raise PhalanxError(f"{self.label} keeps no detached group: its directory "
                               f"{found[0][0]} holds no token (the controller of a group "
                               "started with detached=True leaves it there)")
        if len(keeping) > 1:
            raise PhalanxError(f"{self.label} holds {len(keeping)} phalanx steps that keep "
                               f"detached groups ({', '.join(d for d, _ in keeping)}); "
                               "attach with one state_dir per step")
        self.directory, info = keeping[0]
        self.node_names, self.step = list(info["nodes"]), bool(info.get("step"))
        path = os.path.join(self.directory, TOKEN)
        try:
            token = ownfiles.read_regular(path, f"{self.label}'s token {path}", 1024)
        except (OSError, ValueError) as exc:
            raise PhalanxError(f"{self.label}'s token cannot be read: {exc}") from None
        self.token = token.decode(errors="replace").strip()
        self.state = JobState.RUNNING
        return self

    def _directories(self, root: str) -> list[tuple[str, dict[str, Any]]]:
        """The job directories under ``root`` that name this job in their ``job`` file,
        with what it says (only private directories of this user's are looked at)."""
        try:
            ownfiles.private_dir(root, f"state_dir {root!r}", _STATE_DIR_FIX, create=False)
            names = sorted(os.listdir(root))
        except (OSError, ValueError):
            return []
        found = []
        for name in names:
            directory = os.path.join(root, name)
            path = os.path.join(directory, JOB)
            if not name.startswith("job-"):
                continue
            try:
                ownfiles.private_dir(directory, directory, _STATE_DIR_FIX, create=False)
                info = json.loads(ownfiles.read_regular(path, path, 65536))
            except (OSError, ValueError):  # (json's errors are ValueErrors)
                continue
            if isinstance(info, dict) and info.get("job") == self.job_id and isinstance(
                    info.get("nodes"), list):
                found.append((directory, info))
        return found

    def read_agents(self, running: bool = False) -> list[str]:
        """The ``host:port`` of the agents of a job found by :meth:`existing`, in its
        nodes' order; PhalanxError naming a node whose agent is gone. ``running``: those
        that still run, ``node_names`` narrowed to their nodes (a pool's job, whose agents
        exit node by node as its groups end); PhalanxError only when none does."""
        assert self.directory is not None
        hosts, names, gone = [], [], []
        for name in self.node_names:
            address = self._read_address(os.path.join(self.directory, AGENTS, name))
            if address is None:
                gone.append(name)
            else:
                hosts.append(address)
                names.append(name)
        if gone and (not running or not hosts):
            raise PhalanxError(f"{self.label}: the agent of node {gone[0]} is gone (no "
                               f"address in {self.directory}/{AGENTS}/)")
        self.hosts, self.node_names = hosts, names
        return hosts

    def keep_token(self) -> None:
        """Write the token back into the job's directory (0600, as it was there when the
        agents started) for the controller that attaches to a detached group."""
        if self.directory is None or os.path.lexists(os.path.join(self.directory, TOKEN)):
            return  # (there already: it is this job's, or _create would refuse it)
        with self._create(TOKEN) as out:
            out.write(self.token.encode() + b"\n")

    def drop_token(self) -> None:
        """No one needs the token on the disk (the agents read it; no detached group)."""
        if self.directory is None:
            return
        try:
            os.unlink(os.path.join(self.directory, TOKEN))
        except FileNotFoundError:
            pass

    # -- starting ---------------------------------------------------------------------

    def start(self) -> list[str]:
        """Submit the job (or start the agents' step in this allocation) and wait until
        every node's agent listens -> their ``host:port``. PhalanxError, quoting Slurm,
        when Slurm refuses or ends the job; nothing is left behind then."""
        if self.state is not JobState.NEW:
            raise RuntimeError(f"{self.label} was started already")
        started = time.monotonic()
        try:
            self._prepare()
            if self.inside:
                self._start_step()
                self.state = JobState.STARTING
            else:
                self._submit()
                self.timings["submit"] = time.monotonic() - started
                self.state = JobState.PENDING
                self._wait_running()
                self.state = JobState.STARTING
            queued = time.monotonic()
            self.timings["queued"] = queued - started
            self._wait_agents()
            self.timings["agents"] = time.monotonic() - queued
        except BaseException:
            self.end()
            raise
        self.state = JobState.RUNNING
        return self.hosts

    def _prepare(self) -> None:
        root = state_root(self._state_dir)
        shown = f"state_dir {root!r}" if self._state_dir else f"Slurm state directory {root!r}"
        try:  # made 0700 if absent; else it must be ours, and no one else's to write
            ownfiles.private_dir(root, shown, _STATE_DIR_FIX)
        except ValueError as exc:
            raise PhalanxError(str(exc)) from None
        self.directory = tempfile.mkdtemp(prefix="job-", dir=root)  # 0700
        os.mkdir(os.path.join(self.directory, AGENTS), 0o700)
        with self._create(TOKEN) as out:
            out.write(self.token.encode() + b"\n")

    def _create(self, name: str) -> BinaryIO:
        """A new file of the job's directory, 0600: never through a link, never a FIFO."""
        assert self.directory is not None
        path = os.path.join(self.directory, name)
        try:
            fd = ownfiles.open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                       f"{self.label}'s {path}")
        except ValueError as exc:
            raise PhalanxError(str(exc)) from None
        return os.fdopen(fd, "wb")

    def _agent_command(self) -> list[str]:
        assert self.directory is not None
        log = os.path.join(self.directory, "agent-%N.log")
        return ["--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--output={log}",
                f"--error={log}", sys.executable, "-m", "phalanx", "agent", "--slurm",
                self.directory]

    def _submit(self) -> None:
        assert self.directory is not None
        script = os.path.join(self.directory, "job.sh")
        srun = " ".join(shlex.quote(part) for part in ["srun", *self._agent_command()])
        with self._create("job.sh") as out:
            out.write(_BATCH_SCRIPT.format(directory=shlex.quote(self.directory),
                                           srun=srun).encode())
        # --no-requeue: a job Slurm requeued (a node failure, a preemption) would start
        # agents for a controller that has given up on them (sbatch_args may still requeue)
        done = _slurm("sbatch", "--parsable", "--job-name=phalanx", "--no-requeue",
                      f"--output={os.path.join(self.directory, 'batch.log')}",
                      f"--chdir={os.getcwd()}", *self.request.sbatch_options(), script,
                      doing="submitting the job")
        self.job_id = done.stdout.strip().split(";")[0]
        logger.info("submitted %s (%s)", self.label, " ".join(self.request.sbatch_options()))

    def _start_step(self) -> None:
        assert self.directory is not None
        have = self.allocation_nodes() or 1
        wanted = self.request.nodes or have
        if wanted > have:
            raise PhalanxError(f"nodes={wanted}, but this allocation ({self.label}) has "
                               f"{have} node(s)")
        if self.request.given():
            logger.warning("inside %s: %s shape a job that is submitted, and this one is "
                           "not (the allocation's own are used)", self.label,
                           ", ".join(self.request.given()))
        self.request = dataclasses.replace(self.request, nodes=wanted)
        srun = shutil.which("srun")
        if srun is None:
            raise PhalanxError(f"inside {self.label} but no srun on PATH")
        with self._create("srun.log") as log:
            # --overlap: the step shares the allocation's CPUs with the controller's own
            self._srun = subprocess.Popen(
                [srun, f"--nodes={wanted}", "--overlap", *self._agent_command()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def _wait_running(self) -> None:
        """Until Slurm runs the job, with a notice naming its reason each time it changes."""
        began = time.monotonic()
        told: tuple[str, str] | None = None
        while True:
            record = self.record()
            state, reason = record.get("JobState", "?"), record.get("Reason", "None")
            if state == "RUNNING":
                self.node_names = expand_hostlist(record.get("NodeList", ""))
                return
            if state in _OVER or not record:
                raise PhalanxError(f"{self.label} ended before it ran: {state}"
                                   f"{'' if reason == 'None' else f' ({reason})'}"
                                   f"{self._tail('batch.log')}")
            if reason in _HOPELESS:
                raise PhalanxError(f"{self.label} can never start: Slurm says {state} "
                                   f"({reason}) for {' '.join(self.request.sbatch_options())}; "
                                   "it was cancelled")
            waited = time.monotonic() - began
            if (state, reason) != told:
                told = (state, reason)
                why = "" if reason == "None" else f" ({reason})"
                console.notice(f"phalanx: {self.label} is {state}{why}, "
                               f"{waited:.0f} s in the queue")
            if self.allocation_timeout is not None and waited > self.allocation_timeout:
                raise PhalanxError(f"{self.label} was still {state} ({reason}) after "
                                   f"allocation_timeout={self.allocation_timeout:g} s; "
                                   "it was cancelled")
            time.sleep(config.SLURM_POLL)

    def _wait_agents(self) -> None:
        """Until every node's agent has published its address; the job's end, or
        ``start_timeout``, is an error naming the nodes missing and their log."""
        assert self.directory is not None
        wanted = self.request.nodes or 1
        folder = os.path.join(self.directory, AGENTS)
        deadline = time.monotonic() + self.start_timeout
        while True:
            found: dict[str, str] = {}
            try:
                names = os.listdir(folder)
            except FileNotFoundError:  # its last agent removed it as it ended: the job did
                names = []
            for name in names:
                address = None if name.endswith(".part") else self._read_address(
                    os.path.join(folder, name))
                if address:
                    found[name] = address
            if len(found) >= wanted:
                break
            missing = [n for n in self.node_names if n not in found] or [
                f"{wanted - len(found)} node(s)"]
            ended = self._ended()
            if ended is not None or time.monotonic() > deadline:
                why = ended or f"not within {self.start_timeout:g} s"
                logs = "".join(self._tail(f"agent-{n}.log") for n in missing
                               if n in self.node_names)
                raise PhalanxError(f"{self.label}: the agents of {', '.join(missing)} did "
                                   f"not start ({why}){logs}{self._tail('srun.log')}"
                                   f"{self._tail('batch.log')}")
            time.sleep(min(config.SLURM_POLL, 0.1))
        order = self.node_names or sorted(found)
        names = [n for n in order if n in found] + sorted(set(found) - set(order))
        self.node_names = names[:wanted]
        self.hosts = [found[n] for n in self.node_names]
        with self._create(JOB) as out:  # how SlurmBackend(job=) finds this directory
            out.write(json.dumps({"job": self.job_id, "nodes": self.node_names,
                                  "step": self.step}).encode())
        # every agent read the token before it listened: it need not wait on the shared
        # disk for the job's end (the controller holds it in memory for the connections)
        self.drop_token()

    def _ended(self) -> str | None:
        """Why the agents' step or job is over, or None while it runs."""
        if self._srun is not None:
            code = self._srun.poll()
            return None if code is None else f"srun exited with status {code}"
        record = self.record()
        state = record.get("JobState", "gone")
        return None if state in ("RUNNING", "CONFIGURING") else f"the job is {state}"

    # -- watching -----------------------------------------------------------------------

    def record(self, timeout: float = config.SLURM_COMMAND_TIMEOUT) -> dict[str, str]:
        """``scontrol show job -o`` of the job ({} once Slurm has forgotten it)."""
        if self.job_id is None:
            return {}
        done = _slurm("scontrol", "show", "job", "-o", self.job_id, check=False,
                      doing="asking for the job's state", timeout=timeout)
        if done.returncode != 0:
            return {}
        for line in done.stdout.splitlines():
            try:
                record = parse_record(line)
            except ValueError:
                continue
            if record.get("JobId") == self.job_id:
                return record
        return {}

    def why_ended(self, wait: float = config.SLURM_CAUSE_WAIT) -> str | None:
        """Why Slurm is ending the job (or the agents' step), as it says it, for the
        message of a rank killed or a node lost as it does: scancel, the time limit, a
        node failure, a preemption. The job's state once it is over; while Slurm is
        ending it (COMPLETING, which hides why) up to ``wait`` s more for that state, or
        the notice slurmstepd wrote in the agents' logs as it signalled them. None while
        the job runs on (Slurm had no part in it) or when Slurm cannot be asked. Once
        known it is kept (a job ends once); one thread asks at a time."""
        with self._why_lock:
            if self._why is None:
                self._why = self._ask_why(wait)
            return self._why

    def _ask_why(self, wait: float) -> str | None:
        deadline = time.monotonic() + wait
        while True:
            state, reason = "", "None"
            if self.job_id is not None:
                try:
                    record = self.record(timeout=max(0.5, deadline - time.monotonic()))
                except PhalanxError as exc:  # no answer: the logs may still say
                    logger.debug("asking Slurm why %s ended: %s", self.label, exc)
                    record = {}
                state, reason = record.get("JobState", ""), record.get("Reason", "None")
            why = "" if reason in ("None", "") else f", {reason}"
            if state in _OVER:
                return (f"Slurm ended {self.label}: {_STATE_MEANS.get(state, 'it is over')} "
                        f"({state}{why})")
            if state in _REQUEUED:
                return f"Slurm requeued {self.label} ({state}{why})"
            notice = self._step_notice()
            if notice is not None:
                return f"Slurm ended {self.label}: {notice}"
            if state not in _ENDING:
                return None
            if time.monotonic() >= deadline:
                return f"Slurm is ending {self.label} ({state}{why})"
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _step_notice(self) -> str | None:
        """slurmstepd's notice of the job's or the step's end in the agents' and the batch
        script's logs (``*** STEP 7.0 ON n1 CANCELLED AT ... ***``), if one is there yet
        (the job's directory may be gone already: its last agent removes it)."""
        if self.directory is None:
            return None
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".log"))
        except OSError:
            return None
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                text = ownfiles.read_regular(path, path, 16384, last=True)
            except ValueError as exc:
                logger.warning("%s: not read", exc)
                continue
            except OSError:
                continue
            notices = _STEP_NOTICE.findall(text.decode(errors="replace"))
            if notices:
                text, state = notices[-1]
                cause = text.upper().partition(" DUE TO ")[2].strip()
                state = _NOTICE_CAUSES.get(cause, state if not cause else "")
                means = _STATE_MEANS.get(state, "its agents were signalled")
                return f'{means} (slurmstepd: "{text.strip()}")'
        return None

    def describe(self) -> str:
        """The job's state as Slurm says it now (for an error that names the job)."""
        if self.inside:
            return self.label
        record = self.record()
        if not record:
            return f"{self.label} (gone from Slurm)"
        reason = record.get("Reason", "None")
        return f"{self.label} ({record.get('JobState', '?')}" + (
            ")" if reason == "None" else f", {reason})")

    def _tail(self, name: str, lines: int = 8) -> str:
        if self.directory is None:
            return ""
        path = os.path.join(self.directory, name)
        try:
            data = ownfiles.read_regular(path, path, 8192, last=True)
        except ValueError as exc:  # a link or a FIFO there: not read, and said
            return f"\n  {name}: not read: {exc}"
        except OSError:
            return ""
        text = data.decode(errors="replace").splitlines()[-lines:]
        return f"\n  {name}:\n    " + "\n    ".join(text) if text else ""

    def _read_address(self, path: str) -> str | None:
        """The ``host:port`` an agent published at ``path`` (None while there is none);
        PhalanxError for what no agent writes there (a link, a FIFO, another user's file)."""
        try:
            data = ownfiles.read_regular(path, f"{self.label}'s agent address {path}", 1024)
        except ValueError as exc:
            raise PhalanxError(f"{exc}: phalanx will not dial an address read from it"
                               ) from None
        except OSError:
            return None
        return data.decode(errors="replace").strip() or None

    # -- ending -------------------------------------------------------------------------

    def end(self, wait: float = config.SLURM_END_WAIT) -> None:
        """Let the job end (its agents exit as their connections end, which the caller
        closed first), waiting up to ``wait`` s; then cancel it. Idempotent."""
        if self.state is JobState.ENDED:
            return
        state, self.state = self.state, JobState.ENDED
        if self._srun is not None:
            _end_process(self._srun, wait)
        elif self.attached and self.step:  # the step of another's allocation: the
            # agents end as their connections did; the allocation is not this one's to end
            deadline = time.monotonic() + wait
            agents = os.path.join(self.directory or "", AGENTS)
            while os.path.isdir(agents) and time.monotonic() < deadline:
                time.sleep(min(config.SLURM_POLL, 0.2))
            if os.path.isdir(agents):
                logger.warning("%s: its agents did not exit within %g s (%s)", self.label,
                               wait, agents)
                return
        elif self.job_id is not None and state is not JobState.NEW:
            deadline = time.monotonic() + (wait if state is JobState.RUNNING else 0)
            while time.monotonic() < deadline and self._ended() is None:
                time.sleep(min(config.SLURM_POLL, 0.2))
            if self._ended() is None or self.record().get("JobState") == "PENDING":
                _slurm("scancel", self.job_id, check=False, doing="cancelling the job")
                logger.info("cancelled %s", self.label)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def state_root(state_dir: str | None) -> str:
    """Where the jobs' directories are made: ``state_dir``, else phalanx's Slurm directory
    in the user's cache (``~/.cache/phalanx/slurm``)."""
    return state_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phalanx",
        "slurm")


def _end_process(proc: subprocess.Popen[bytes], wait: float) -> None:
    """srun of the agents' step: it ends as they exit; else SIGTERM (srun forwards it to
    the tasks), then SIGKILL."""
    try:
        proc.wait(wait)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(config.SLURM_END_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(config.SLURM_END_WAIT)


def _slurm(command: str, *args: str, doing: str, check: bool = True,
           timeout: float = config.SLURM_COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run one of Slurm's commands; PhalanxError quoting its message when it fails (with
    ``check``), or when it is missing or does not answer within ``timeout``."""
    path = shutil.which(command)
    if path is None:
        raise PhalanxError(f"{doing}: no {command} on PATH (is this a Slurm cluster's node?)")
    try:
        done = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise PhalanxError(f"{doing}: {command} did not answer within {timeout:g} s "
                           "(is slurmctld up?)") from None
    if check and done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}"
        raise PhalanxError(f"{doing}: Slurm said: {said}")
    return done


def sequence_or_empty(value: Sequence[str] | str | None, name: str) -> tuple[str, ...]:
    """``sbatch_args``: a sequence of strings (one string is a mistake: give a list)."""
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings such as ['--exclusive'], got "
                         f"{value!r}")
    return tuple(value)
