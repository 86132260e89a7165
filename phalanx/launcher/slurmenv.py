"""``phalanx run`` started by ``srun``: the world's flags, defaulted from the srun step.

``srun -N4 --ntasks-per-node=1 phalanx run -n 8 train.py`` starts one launcher on each
node of the step, each with Slurm's variables and none of torchrun's flags. From those
variables (:func:`phalanx.world.slurm.srun_task`), a launcher that is the one task on its
node of a step of several nodes takes

- ``--nnodes``: the step's node count (``SLURM_STEP_NUM_NODES``);
- ``--node-rank``: its node's index in the step (``SLURM_NODEID``);
- ``--master-addr``: the step's first node's address: Slurm's ``NodeAddr`` for it, asked of
  ``scontrol show node -o NAME`` only when the address is needed (a static rendezvous, no
  ``--rdzv-endpoint``), the node's name where scontrol cannot tell.

Each flag given on the command line, or as torchrun's ``PET_*`` variable, wins over
Slurm's value, each on its own. When srun runs several tasks on a node, every one of them
would be a launcher running its own copy of the program (and, with ``--nnodes``, racing
the others for node 0's port), so ``phalanx run`` refuses to start unless ``--nnodes``
says how the launchers form a job; it refuses the same way when the step's variables
contradict one another. A batch script (``sbatch``: no step, and it runs on the job's
first node only) and a one-node step keep phalanx's own defaults.

A shell that ``srun -N2 --pty bash`` started is a task of a two-node step too: a
``phalanx run`` typed in it waits for the second node's launcher, which never comes
(``--nnodes 1`` runs it on that node alone).

This module holds the lookup's I/O (running ``scontrol``); what the variables mean is in
:mod:`phalanx.world.slurm`, pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from phalanx.node.slurm import node_address as node_address
from phalanx.world.slurm import SrunTask, srun_task


@dataclasses.dataclass(frozen=True)
class SrunDefaults:
    """What the srun step this launcher is a task of makes of its world's flags.

    ``task``: the task (None outside srun, or where its variables contradict);
    ``refusal``: why ``phalanx run`` must not start without ``--nnodes`` (several tasks on
    a node, contradicting variables); None when it may."""

    task: SrunTask | None = None
    refusal: str | None = None

    @property
    def applies(self) -> bool:
        """Whether Slurm supplies the defaults: one task per node, more than one node."""
        return self.task is not None and self.refusal is None and self.task.nodes > 1

    def master_addr(self) -> str | None:
        """The step's first node's address (running ``scontrol``); None where Slurm
        supplies no defaults."""
        if not self.applies or self.task is None:
            return None
        return node_address(self.task.first_node)


def srun_defaults(environ: Mapping[str, str]) -> SrunDefaults:
    """What ``environ``'s srun step (if any) makes of ``phalanx run``'s world flags. Reads
    only ``environ``; the address is looked up later (:meth:`SrunDefaults.master_addr`)."""
    try:
        task = srun_task(environ)
    except ValueError as exc:
        return SrunDefaults(refusal=f"{exc}; give --nnodes (and --node-rank, --master-addr) "
                                    "yourself, or --nnodes 1 to run on this node alone")
    if task is None or task.one_per_node:
        return SrunDefaults(task)
    crowded = max(range(task.nodes), key=lambda i: task.tasks_per_node[i])
    return SrunDefaults(task, refusal=(
        f"srun runs {task.tasks_per_node[crowded]} tasks on node {task.node_names[crowded]} "
        f"(step {task.job_id}.{task.step_id}), and each task is a launcher of its own that "
        "would run its own copy of the program; phalanx run starts each node's ranks itself "
        "(-n): start one task per node (srun --ntasks-per-node=1 phalanx run -n N ...), or "
        "give --nnodes to arrange the launchers yourself"))
