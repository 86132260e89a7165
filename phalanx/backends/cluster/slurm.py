"""``px.SlurmBackend``: ranks on the nodes of a Slurm job, through agents that ``srun`` starts.

Outside an allocation it submits one job for the request and waits for it (a notice names
Slurm's pending reason each time it changes); inside one (``$SLURM_JOB_ID`` set: an
``sbatch`` script, ``salloc``) it uses that allocation and submits nothing. Either way one
``phalanx agent`` per node, started by ``srun`` as one step, listens on the node's address
as Slurm knows it (``NodeAddr``) with a fresh token, and the backend connects to them as
:class:`~phalanx.backends.cluster.backend.ClusterBackend` does (:mod:`.slurmjob`). Then it
is a cluster backend: the ranks are the agents' children, they see ``SLURM_JOB_ID`` and
``SLURMD_NODENAME`` (the agent's environment is theirs) with the allocation's GPUs as
``CUDA_VISIBLE_DEVICES``, kept results cross between nodes through the agents, and a node
lost (``scancel``, the time limit, a node down) fails the calls pending on it, naming the
job and the node. Where Slurm ended the job, why (as its job state, or slurmstepd's notice
in the agents' logs, says it: cancelled, time limit, node failure, preempted) joins the
message and the failure records: a lost node's membership change and a rank killed by a
signal there ask Slurm (:meth:`~.slurmjob.SlurmJob.why_ended`, a few seconds at most).

A group that names no ``nodes`` runs on every node of the job (:meth:`SlurmBackend.
group_nodes`): the backend's ``nodes``, else the allocation's; outside an allocation with
neither, the group's ``nodes`` size the job. A group's backend submits its own job; a
:class:`~phalanx.controller.pool.ResourcePool` on this backend submits one for the pool,
which its colocated groups share. The job ends as the group or the pool closes, and when
the controller dies (the agents see their last connection end and exit, and the last of
them removes the job's directory).

A detached group (``WorkerGroup(..., name="policy", detached=True, detach_timeout=600)``)
keeps its job instead: the agents keep the group's ranks while it waits for a controller
(its session counts as their connection), and this backend's close leaves the job running
while it holds a group so kept. The token goes back into the job's directory for the
next controller: ``px.attach("policy", backend=px.SlurmBackend(job=JOBID))``, in any
process of this user that sees the directory (the login node), finds the job's
directory by its id (:meth:`~.slurmjob.SlurmJob.existing`), reads the agents' addresses
and the token there, and takes the ranks over as on any cluster backend.
``px.attached(px.SlurmBackend(job=JOBID))`` lists the job's detached groups. The group
ended for good (``shutdown()``, or nobody attaching within ``detach_timeout``), the agents
exit and the job ends with them, its directory removed.

A detached pool (``ResourcePool(..., backend=px.SlurmBackend(...), detached=True,
name=...)``) keeps its job the same way: each group placed on it runs on the job's agents
(:class:`JobAgents`), and detaching one writes the token back; releasing the pool leaves the
job running while its agents keep a detached group. Its groups share the job, each on the
nodes of its slots: ``px.attach(name, backend=px.SlurmBackend(job=JOBID))`` takes a group
over on the agents that keep it (of those that still run: an agent exits once its node's
last group ended), and a group ended for good ends the job only when the job's agents keep
no other detached group -- the last one's end ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx import config
from phalanx.backends.base import Backend
from phalanx.backends.cluster import detaching
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.backend import ClusterBackend
from phalanx.backends.cluster.pool import ClusterSlots
from phalanx.backends.cluster.pool import reserve_slots as reserve_cluster_slots
from phalanx.backends.cluster.slurmjob import JobRequest, SlurmJob, sequence_or_empty
from phalanx.backends.parts import SlotReservation
from phalanx.errors import MembershipEvent, PhalanxError
from phalanx.output.logs import OutputOptions
from phalanx.world.pools import PoolSlot

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class SlurmBackend(ClusterBackend):
    """Ranks on the nodes of a Slurm job (see the module's docstring).

    ``nodes``: how many (default: the allocation's inside one, else the group's or the
    pool's); a group that names no ``nodes`` runs on all of them. ``partition``,
    ``time`` (sbatch's ``--time``), ``gpus_per_node``, ``cpus_per_node`` (CPUs for the
    node's ranks, its agent's task), ``account``, ``qos`` and ``sbatch_args`` (more of
    sbatch's options, e.g. ``["--exclusive"]``) shape the job it submits.
    ``allocation_timeout``: how long it may wait in the queue (None: as long as it is
    queued; past it the job is cancelled). ``start_timeout``: how long the agents may take
    to start once it runs. ``state_dir``: where the job's private directory (its token, its
    agents' addresses and logs) is made, on a filesystem the nodes share (default:
    ``~/.cache/phalanx/slurm``). ``node_timeout``, ``heartbeat_timeout`` and ``sync``:
    as for ``ClusterBackend``.

    ``job``: the id of a running job whose agents a controller of this user started here
    (with the same ``state_dir``), to attach to its detached group
    (``px.attach(name, backend=px.SlurmBackend(job=4711))``); nothing is submitted, and
    the arguments that shape a job may not be given with it. PhalanxError naming the job
    when it does not run, has no phalanx directory under ``state_dir``, or keeps no
    detached group.
    """

    name = "slurm"
    finds_agents = True

    def __init__(self, nodes: int | None = None, partition: str | None = None,
                 time: str | None = None, gpus_per_node: int | None = None,
                 cpus_per_node: int | None = None, account: str | None = None,
                 qos: str | None = None, sbatch_args: Sequence[str] = (),
                 allocation_timeout: float | None = None, *, start_timeout: float = 300.0,
                 state_dir: str | None = None, job: str | int | None = None,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 node_timeout: float = config.DEFAULT_NODE_TIMEOUT, sync: Any = None,
                 max_frame: int = 1 << 30) -> None:
        for label, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node),
                             ("cpus_per_node", cpus_per_node)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if time is not None and not isinstance(time, str):  # sbatch judges its form
            raise ValueError(f"time must be a string such as '1:30:00', got {time!r}")
        for label, text in (("partition", partition), ("account", account), ("qos", qos)):
            if text is not None and not (isinstance(text, str) and _NAME.match(text)):
                raise ValueError(f"{label}={text!r} is not a Slurm name")
        for label, seconds in (("allocation_timeout", allocation_timeout),
                               ("start_timeout", start_timeout)):
            if seconds is not None and (isinstance(seconds, bool) or
                                        not isinstance(seconds, (int, float)) or seconds <= 0):
                raise ValueError(f"{label} must be > 0 seconds, got {seconds!r}")
        self.request = JobRequest(nodes, partition, time, gpus_per_node, cpus_per_node,
                                  account, qos, sequence_or_empty(sbatch_args, "sbatch_args"))
        self.allocation_timeout, self.start_timeout = allocation_timeout, start_timeout
        self.state_dir = state_dir
        shaping = ([] if nodes is None else ["nodes"]) + self.request.given()
        if job is not None and shaping:
            raise ValueError(f"px.SlurmBackend(job={job!r}) attaches to a running job: "
                             f"{', '.join(shaping)} shape a job that is submitted (leave "
                             "them out)")
        self.job = (SlurmJob.existing(job, state_dir) if job is not None else
                    SlurmJob(self.request, state_dir=state_dir,
                             allocation_timeout=allocation_timeout,
                             start_timeout=start_timeout))
        self.job_id = None if job is None else self.job.job_id
        # the detached groups this backend had its agents keep, or attaches to: while it
        # holds one, its close leaves the job running (the group may outlive it)
        self._keeping: set[str] = set()
        # whether it ended one for good: a job attached to (job=) is ended only then (a
        # group merely run on another's agents leaves their job as it found it)
        self._ended_one = False
        self._told_why = False  # whether the log has said why Slurm ended the job
        super().__init__(token=self.job.token, quorum_timeout=start_timeout,
                         heartbeat_timeout=heartbeat_timeout, node_timeout=node_timeout,
                         sync=sync, max_frame=max_frame, dns_interval=None)

    def __repr__(self) -> str:
        given = {k: v for k, v in self.settings().items()
                 if k in ("nodes", "partition", "time", "gpus_per_node", "job")
                 and v is not None}
        return f"px.SlurmBackend({', '.join(f'{k}={v!r}' for k, v in given.items())})"

    def settings(self) -> dict[str, Any]:
        r = self.request
        return {"nodes": r.nodes, "partition": r.partition, "time": r.time,
                "gpus_per_node": r.gpus_per_node, "cpus_per_node": r.cpus_per_node,
                "account": r.account, "qos": r.qos, "sbatch_args": list(r.sbatch_args),
                "allocation_timeout": self.allocation_timeout,
                "start_timeout": self.start_timeout, "state_dir": self.state_dir,
                "job": self.job_id, "heartbeat_timeout": self.heartbeat_timeout,
                "node_timeout": self.node_timeout, "sync": self.sync,
                "max_frame": self.max_frame}

    def gpus_per_node(self, nodes: int) -> int | None:
        return self.request.gpus_per_node

    def group_nodes(self, nodes: int | None) -> int:
        """Every node of the job when the group names none: ``nodes`` given here, else the
        allocation's inside one; outside one with no ``nodes`` here the job is submitted
        with the group's (1 when it names none). ValueError before anything starts for
        a group asking for more nodes than that, or for ``nodes`` here beyond the
        allocation's."""
        limit = self._node_limit()
        if nodes is None:
            return limit or 1
        if limit is not None and nodes > limit:
            raise ValueError(f"nodes={nodes}, but {self._node_source(limit)}: give the group "
                             f"at most {limit} (or leave nodes= out: all of them)")
        if limit is None:  # a job of its own, sized by the group (this copy is the group's)
            self.request = self.job.request = dataclasses.replace(self.request, nodes=nodes)
        return nodes

    def _node_limit(self) -> int | None:
        """The nodes the job has or asks for: ``nodes`` given here (checked against the
        allocation's inside one), else the allocation's; None outside an allocation when
        ``nodes`` was not given. A job attached to (``job=``): its nodes."""
        if self.job.attached:
            return len(self.job.node_names)
        have = self.job.allocation_nodes()
        wanted = self.request.nodes
        if have is not None and wanted is not None and wanted > have:
            raise ValueError(f"px.SlurmBackend(nodes={wanted}) inside {self.job.label}, "
                             f"which has {have} node(s) ($SLURM_JOB_NUM_NODES): ask for at "
                             "most that many (or leave nodes= out: all of them)")
        return wanted if wanted is not None else have

    def _node_source(self, limit: int) -> str:
        if self.job.attached:
            return f"{self.job.label} runs agents on {limit} node(s)"
        if self.request.nodes is not None:
            return (f"px.SlurmBackend(nodes={limit}) "
                    + ("uses" if self.job.inside else "asks Slurm for")
                    + f" {limit} node(s){'' if self.job.inside else ': ask for more there'}")
        return f"this allocation ({self.job.label}) has {limit} node(s) ($SLURM_JOB_NUM_NODES)"

    # -- a detached group ------------------------------------------------------------------

    def detach(self, name: str, timeout: float | None, spec: bytes) -> None:
        """As the cluster backend's; and while a group is kept, the job outlives this
        backend, its token in the job's directory for the controller that attaches."""
        super().detach(name, timeout, spec)
        if timeout is not None:
            self._keeping.add(name)
            self.job.keep_token()
        else:  # shut down for good: the agents, then the job, end as this backend closes
            self._keeping.discard(name)
            others = [] if self._keeping or not self.job.attached else self._kept_on_job()
            if others:  # a pool's job: the last of its groups ends it (its agents exit)
                logger.info("%s runs on: its agents keep detached group(s) %s",
                            self.job.label, ", ".join(others))
                return
            self._ended_one = True
            if not self._keeping:
                self.job.drop_token()

    def _kept_on_job(self) -> list[str]:
        """The detached groups every running agent of the job keeps (a pool's job holds
        several), by name; asked of each over a connection of its own."""
        names: set[str] = set()
        for host in self.job.hosts:
            try:
                found = detaching.ask(self, host, agentwire.DESCRIBE, "")
            except (PhalanxError, OSError):  # gone: it keeps none
                continue
            names.update(group["name"] for group in found)
        return sorted(names)

    def attach_to(self, name: str, force: bool) -> None:
        super().attach_to(name, force)
        self._keeping.add(name)  # a failed attach leaves the group (and the job) as it was

    def carry_over(self, original: Backend) -> None:
        super().carry_over(original)  # px.attach's request: the copy keeps the job too
        if self.attach_request is not None:
            self._keeping.add(self.attach_request[0])

    def agent_hosts(self) -> list[str]:
        """The agents of the job given as ``job=`` (px.attach's, px.attached's); a backend
        that would submit a job of its own has none to ask."""
        if not self.hosts and not self.job.attached:
            raise ValueError("a detached group on Slurm is found by its job: give "
                             "px.SlurmBackend(job=JOBID) (squeue --me lists your jobs; "
                             "phalanx's are named phalanx)")
        return super().agent_hosts()

    # -- the job --------------------------------------------------------------------------

    def _find_agents(self) -> list[str]:
        if self.job.attached:  # (a pool's job: the agents of ended groups' nodes are gone)
            nodes = list(self.job.node_names)
            hosts = self.job.read_agents(running=True)
            gone = [n for n in nodes if n not in self.job.node_names]
            if gone:
                logger.info("%s: the agents of node(s) %s are gone (their groups ended)",
                            self.job.label, ", ".join(gone))
        else:
            hosts = self.job.start()
        named = dict(zip(hosts, self.job.node_names, strict=True))
        if self.attach_request is not None:  # a pool's group: on the nodes of its slots
            hosts = self._keeping_group(hosts, self.attach_request[0])
        self.labels = {host: f"{self.job.label} node {named[host]}" for host in hosts}
        logger.info("%s: agents on %s", self.job.label, ", ".join(
            f"{named[h]} ({h})" for h in hosts))
        return hosts

    def _keeping_group(self, hosts: list[str], name: str) -> list[str]:
        """Of ``hosts``, in order, the agents that keep detached group ``name`` (all of
        them when none says so: attaching then names what each agent keeps)."""
        keeping = []
        for host in hosts:
            try:
                detaching.ask(self, host, agentwire.DESCRIBE, name)
            except (PhalanxError, OSError):  # it keeps no such group (or is gone)
                continue
            keeping.append(host)
        return keeping or hosts

    def _open(self, output: OutputOptions) -> None:
        super()._open(output)
        for agent in self.members.nodes:  # a rank killed by a signal: was it Slurm?
            agent.explain = self.job.why_ended

    def _membership_changed(self, event: MembershipEvent) -> None:
        """A node lost is most often the job's end (scancel, its time limit, a node
        failure, a preemption): Slurm's word on it, asked for a moment at most
        (``config.SLURM_CAUSE_WAIT``), joins the reason the group's calls fail with and
        its ranks' records carry."""
        if event.removed:
            why = self.job.why_ended()
            if why is not None:
                if not self._told_why:  # (the nodes lost are logged one by one)
                    self._told_why = True
                    logger.warning("%s", why)
                event = dataclasses.replace(
                    event, reason=f"{event.reason}; {why}" if event.reason else why)
        super()._membership_changed(event)

    def close(self) -> None:
        try:
            super().close()  # the agents' connections end: they exit, and the job ends
        finally:
            if self._keeping:  # unless they keep a detached group: it waits, and the job
                logger.info("%s runs on: its agents keep detached group(s) %s",
                            self.job.label, ", ".join(sorted(self._keeping)))
            elif not self.job.attached or self._ended_one:
                self.job.end()

    # -- a pool's job -------------------------------------------------------------------

    def reserve_slots(self, counts: Sequence[int], *, gpus: int,
                      resources: Mapping[str, float], timeout: float,
                      holder: str = "a pool") -> SlotReservation:
        """A job for the pool (as many nodes as it has, unless ``nodes`` asks for more),
        whose agents every group placed on it uses; it ends as the pool is released."""
        limit = self._node_limit()
        if limit is not None and len(counts) > limit:
            raise ValueError(f"a pool of {len(counts)} nodes, but "
                             f"{self._node_source(limit)}")
        job = self.job
        if job.request.nodes is None and not job.inside:
            job.request = dataclasses.replace(job.request, nodes=len(counts))
        hosts = job.start()
        labels = {host: f"{job.label} node {name}"
                  for host, name in zip(hosts, job.node_names, strict=True)}
        try:
            template = JobAgents(hosts, token=job.token, quorum_timeout=self.start_timeout,
                                 heartbeat_timeout=self.heartbeat_timeout,
                                 node_timeout=self.node_timeout, sync=self.sync,
                                 max_frame=self.max_frame, dns_interval=None)
            slots = reserve_cluster_slots(template, counts, gpus, resources, holder, timeout)
        except BaseException:
            job.end()
            raise
        return SlurmSlots(slots, job, labels)


class JobAgents(ClusterBackend):
    """A cluster backend on the agents of a pool's Slurm job (a group placed on the pool):
    detaching its group keeps the job for the next controller, as :class:`SlurmBackend`
    does for a group of its own (the token written back into the job's directory)."""

    slots: SlurmSlots | None = None  # the pool's, set as the group is placed

    def detach(self, name: str, timeout: float | None, spec: bytes) -> None:
        super().detach(name, timeout, spec)
        if self.slots is not None:
            self.slots.keeping(name, timeout is not None)


class SlurmSlots:
    """A pool's slots on a Slurm job's agents: a cluster pool whose release ends the job,
    unless its agents keep a detached group placed on it (a detached pool's), which the
    next controller attaches by the job's id; the job then ends with the last such group.
    A keeper connection stays open to every agent while the pool lives, so that the agents
    (which end with their last connection) outlast the groups placed on it."""

    def __init__(self, slots: ClusterSlots, job: SlurmJob, labels: dict[str, str]) -> None:
        self._slots, self._job, self._labels = slots, job, labels
        self._kept: set[str] = set()  # its groups the agents keep past this controller
        self._keeper = ClusterBackend(job.hosts, token=job.token, dns_interval=None)
        try:
            self._keeper.open(OutputOptions(echo=False))
        except BaseException:
            job.end()
            raise

    @property
    def counts(self) -> list[int]:
        return self._slots.counts

    @property
    def gpus_per_worker(self) -> int:
        return self._slots.gpus_per_worker

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> Backend:
        backend = self._slots.backend_for(slots, share)
        backend.labels = dict(self._labels)
        if isinstance(backend, JobAgents):
            backend.slots = self
        return backend

    def keeping(self, name: str, kept: bool) -> None:
        """Group ``name`` placed here is detached (``kept``: its token goes back into the
        job's directory, for px.attach by the job's id), or no more."""
        if kept:
            self._kept.add(name)
            self._job.keep_token()
        else:
            self._kept.discard(name)

    def release(self) -> None:
        kept: list[str] = []
        try:
            self._slots.release()
            if self._kept:  # detached groups: do the agents still keep one?
                kept = [g["name"] for g in self._keeper.listing()]
            self._keeper.close()
        finally:
            if kept:
                logger.info("%s runs on: its agents keep detached group(s) %s",
                            self._job.label, ", ".join(kept))
            else:
                self._job.end()
