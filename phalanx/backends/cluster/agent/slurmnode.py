"""An agent that ``px.SlurmBackend`` started with ``srun``: ``phalanx agent --slurm DIR``.

The controller made ``DIR`` (a directory only its user can enter, on a filesystem its nodes
share: the home directory on most clusters) with the job's token in ``DIR/token``; ``srun``
starts one agent per node of the job with ``--slurm DIR``. Each agent

- listens on its node's address as Slurm knows it (``NodeAddr`` in ``scontrol show node``;
  the node's name where scontrol cannot tell), on a port the system picks, so that two jobs
  on one node never race for a port;
- publishes ``host:port`` in ``DIR/agents/<node>`` (written whole, then renamed, so the
  controller never reads half of it);
- serves one controller and exits as it leaves (or when none came within its idle
  timeout), which ends the step and so the job; a detached group's session counts as a
  connection while it waits for the next controller, so the agent stays until that
  group ends (shut down, or its ``detach_timeout`` passed with nobody attaching);
- withdraws its address as it exits, and the last agent of the job to go removes ``DIR``
  (the controller removes it as it closes; one killed outright cannot, and the directory,
  with the agents' logs, would stay in the user's home). An agent killed outright leaves
  its address, and so the directory, behind: a submitted job's batch script removes it
  as the job ends.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil

from phalanx.node.slurm import node_address
from phalanx.output.ownfiles import private_dir
from phalanx.world.slurm import JOB_AGENTS as AGENTS
from phalanx.world.slurm import JOB_TOKEN as TOKEN


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    """This node as the job's agent sees it."""

    directory: str
    node: str  # $SLURMD_NODENAME
    address: str  # where the agent listens: the node's NodeAddr

    @property
    def token_file(self) -> str:
        return os.path.join(self.directory, TOKEN)

    @classmethod
    def from_environment(cls, directory: str) -> SlurmNode:
        """The node this srun task runs on; ValueError outside a Slurm step or for a
        directory that is not the controller's (or not its user's alone: another user's,
        one others can write to, a link)."""
        node = os.environ.get("SLURMD_NODENAME")
        if not node:
            raise ValueError("--slurm: $SLURMD_NODENAME is not set; this agent must be "
                             "started by srun inside the job")
        if not os.path.isdir(os.path.join(directory, AGENTS)):
            raise ValueError(f"--slurm {directory}: no {AGENTS}/ directory in it (it is made "
                             "by px.SlurmBackend on a filesystem the nodes share)")
        for path in (directory, os.path.join(directory, AGENTS)):  # its user's, 0700
            private_dir(path, f"--slurm {path}", "phalanx agent will not read a token from "
                        "it nor publish its address there", create=False)
        return cls(directory, node, node_address(node))

    def announce(self, host: str, port: int) -> None:
        """Publish ``host:port`` for the controller (atomically)."""
        final = os.path.join(self.directory, AGENTS, self.node)
        partial = f"{final}.{os.getpid()}.part"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{host}:{port}\n")
        os.replace(partial, final)
        # however the agent ends but killed outright (its controller gone, SIGTERM from
        # Slurm, the idle timeout), its address goes with it; not as a child forked from
        # it ends (those end with os._exit, but a fork inherits the handler)
        atexit.register(self.withdraw, os.getpid())

    def withdraw(self, pid: int | None = None) -> None:
        """This agent is ending: remove its address; the last agent of the job to go
        removes the whole directory. Only an agent that announced itself withdraws (one
        that failed before leaves the logs to its controller's error), and the last is the
        one whose ``rmdir`` of the emptied ``agents/`` succeeds: it fails for every other,
        atomically, while an address (or one being written) is left. ``pid``: only in
        that process (the agent's)."""
        if pid is not None and os.getpid() != pid:
            return
        agents = os.path.join(self.directory, AGENTS)
        try:
            os.unlink(os.path.join(agents, self.node))
            os.rmdir(agents)
        except OSError:  # gone already, or another agent is still there
            return
        # (on NFS a file still open, such as a log slurmstepd writes, is renamed and stays
        # until it closes: a submitted job's batch script removes what is left then)
        shutil.rmtree(self.directory, ignore_errors=True)
