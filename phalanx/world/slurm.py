"""Slurm's words, read as pure logic: hostlists, ``scontrol -o`` records, an srun task.

What Slurm writes that phalanx reads, each read by a pure function (the caller reads the
environment or runs ``scontrol``, and passes what it got):

- :func:`expand_hostlist`: Slurm's compressed node lists (``SLURM_STEP_NODELIST``,
  ``NodeList=`` in ``scontrol show job``): ``n[1-3,5],gpu[01-02]`` is ``n1 n2 n3 n5 gpu01
  gpu02``. Names are separated by commas (or white space) outside brackets; inside, a
  bracket holds numbers and ranges, and a range keeps its first number's zero padding
  (``[08-10]`` is ``08 09 10``; ``[8-010]`` is ``8 9 10``, as Slurm's own parser has it).
  Several brackets in one name vary the last fastest: ``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1
  r2n2``. Order and repeats are kept. Text after the last bracket (``n[1-2]-ib``) is
  taken too, though Slurm never writes it.
- :func:`expand_tasks_per_node`: the ``2(x3),1`` of ``SLURM_TASKS_PER_NODE`` and
  ``SLURM_STEP_TASKS_PER_NODE`` (two tasks on each of three nodes, then one).
- :func:`parse_record`: one record of ``scontrol show node -o`` or ``scontrol show job -o``,
  ``Key=Value`` pairs separated by spaces, where a value may hold spaces itself
  (``OS=Linux 6.1.0 #1 SMP``, ``JobName=my job``, ``Reason=Not responding [slurm@...]``).
- :func:`srun_task`: whether an environment is that of a task ``srun`` started, and what
  its step is (:class:`SrunTask`).

The variables of an srun task (``srun(1)``, OUTPUT ENVIRONMENT VARIABLES; as Slurm 22.05
sets them, checked on a two-node cluster): ``srun`` writes the step's own,
``SLURM_STEP_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_NODES``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE`` (and overwrites ``SLURM_NNODES``,
``SLURM_NTASKS`` and ``SLURM_TASKS_PER_NODE`` with the step's values, unless
``--preserve-env``); ``slurmstepd`` adds each task's ``SLURM_NODEID`` (its node's index in
the step), ``SLURM_PROCID`` (its rank in the step), ``SLURM_LOCALID`` and
``SLURMD_NODENAME``. The job's (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
``SLURM_JOB_NUM_NODES``) stay the whole allocation's: a step may use fewer nodes than its
job (``srun -N1`` in a two-node job), so they stand in for the step's only where they are
sure to be the same. A batch script's environment (``sbatch``) has the job's variables, a
``SLURM_NODEID`` and a ``SLURM_PROCID`` of 0, but no ``SLURM_STEP_ID``: it runs on the
job's first node alone, and is no srun task.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping

# More names than one hostlist or tasks-per-node list may expand to: far beyond any
# cluster (the largest have ~10^5 nodes), low enough that a typo such as n[1-999999999]
# is refused before it fills memory.
MAX_NODES = 1 << 20

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits: \d takes any script's
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
# A key starts a new pair only at the start or after white space, and begins with a
# capital letter, as every key Slurm prints does (NodeName, MCS_label, CPUs/Task,
# AllocNode:Sid, ReqB:S:C:T); "cpu=2" inside TRES=cpu=2,mem=2000M is part of a value.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/.]*)=")


def expand_hostlist(text: str) -> list[str]:
    """Every name of Slurm's hostlist ``text``, in order (repeats kept); ``[]`` for an empty
    one. ValueError naming ``text`` for a malformed one (an unclosed or nested bracket, an
    empty bracket, a range that is not ``N`` or ``N-M`` with ``N <= M``), or for one that
    expands to more than :data:`MAX_NODES` names."""
    names: list[str] = []
    for piece in _split_hostlist(text):
        groups = _name_groups(piece, text)
        count = 1
        for group in groups:
            count *= len(group)
        if len(names) + count > MAX_NODES:
            raise ValueError(f"hostlist {text!r} expands to more than {MAX_NODES} names")
        names.extend("".join(parts) for parts in itertools.product(*groups))
    return names


def _split_hostlist(text: str) -> list[str]:
    """The names of a hostlist, split at commas and white space outside brackets."""
    pieces: list[str] = []
    current: list[str] = []
    inside = False
    for char in text:
        if char == "[":
            if inside:
                raise ValueError(f"malformed hostlist {text!r}: a bracket inside a bracket")
            inside = True
        elif char == "]":
            if not inside:
                raise ValueError(f"malformed hostlist {text!r}: ']' with no '[' before it")
            inside = False
        elif not inside and (char == "," or char.isspace()):
            pieces.append("".join(current))
            current = []
            continue
        current.append(char)
    if inside:
        raise ValueError(f"malformed hostlist {text!r}: '[' is never closed")
    pieces.append("".join(current))
    return [piece for piece in pieces if piece]


def _name_groups(piece: str, text: str) -> list[list[str]]:
    """One name of a hostlist as the choices of each of its parts: ``n[1-2]x`` ->
    ``[["n"], ["1", "2"], ["x"]]``."""
    groups: list[list[str]] = []
    for index, part in enumerate(re.split(r"\[([^]]*)\]", piece)):
        if index % 2 == 0:  # text outside brackets
            if part:
                groups.append([part])
            continue
        numbers: list[str] = []
        for item in part.split(","):
            match = _RANGE.fullmatch(item)
            if match is None:
                raise ValueError(f"malformed hostlist {text!r}: [{part}] holds {item!r}, not "
                                 "a number or a range N-M")
            first, last = match.group(1), match.group(2) or match.group(1)
            low, high = int(first), int(last)
            if low > high:
                raise ValueError(f"malformed hostlist {text!r}: range {item} runs backwards")
            if len(numbers) + high - low + 1 > MAX_NODES:
                raise ValueError(f"hostlist {text!r} expands to more than {MAX_NODES} names")
            numbers.extend(str(n).zfill(len(first)) for n in range(low, high + 1))
        groups.append(numbers)
    return groups


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node, ``2(x3),1`` -> ``[2, 2, 2, 1]``: counts separated by commas,
    each followed by ``(xR)`` when R consecutive nodes have it. ValueError naming ``text``
    for anything else, or for more than :data:`MAX_NODES` nodes."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.fullmatch(item)
        if match is None:
            raise ValueError(f"malformed tasks per node {text!r}: {item!r} is not N or "
                             "N(xR)")
        repeats = int(match.group(2) or 1)
        if repeats < 1:
            raise ValueError(f"malformed tasks per node {text!r}: {item} repeats 0 times")
        if len(counts) + repeats > MAX_NODES:
            raise ValueError(f"tasks per node {text!r} name more than {MAX_NODES} nodes")
        counts.extend([int(match.group(1))] * repeats)
    return counts


def parse_record(line: str) -> dict[str, str]:
    """One record of ``scontrol show node -o`` / ``scontrol show job -o`` as a dict:
    ``"NodeName=n1 NodeAddr=10.0.0.1 OS=Linux 6.1.0 #1 SMP"`` -> ``{"NodeName": "n1",
    "NodeAddr": "10.0.0.1", "OS": "Linux 6.1.0 #1 SMP"}``.

    A value runs to the next key: a word that starts with a capital letter and is followed
    by ``=`` (after white space), so a value may hold spaces, ``=`` and anything else but
    such a word (a job named ``a B=c`` reads as two pairs: Slurm's output cannot tell
    them apart either). White space around a value is dropped; an empty value
    (``AllocTRES=``) is ``""``. A key repeated (``scontrol show job -d``'s per-node
    details) keeps its first value. The record of ``scontrol`` without ``-o``, one record
    over several lines, reads the same. A blank line is ``{}``; text that does not start
    with a key (``Node n9 not found``) is a ValueError naming it."""
    text = line.strip()
    if not text:
        return {}
    keys = list(_KEY.finditer(text))
    if not keys or keys[0].start() != 0:
        shown = text if len(text) <= 120 else text[:117] + "..."
        raise ValueError(f"not a Slurm record of Key=Value pairs: {shown!r}")
    record: dict[str, str] = {}
    for key, following in zip(keys, [*keys[1:], None], strict=True):
        end = len(text) if following is None else following.start()
        record.setdefault(key.group(1), text[key.end():end].strip())
    return record


@dataclasses.dataclass(frozen=True)
class SrunTask:
    """One task of an srun step, as its environment describes it.

    ``node_names``: the step's nodes, in Slurm's order (node ``i`` of the step is
    ``node_names[i]``); ``node_index``: this task's node among them; ``tasks_per_node``:
    how many of the step's tasks run on each; ``task``: this task's rank in the step
    (``SLURM_PROCID``)."""

    job_id: str
    step_id: str
    node_names: tuple[str, ...]
    node_index: int
    tasks_per_node: tuple[int, ...]
    task: int

    @property
    def nodes(self) -> int:
        """The number of nodes of the step."""
        return len(self.node_names)

    @property
    def first_node(self) -> str:
        """The name of the step's node 0."""
        return self.node_names[0]

    @property
    def tasks_on_node(self) -> int:
        """How many of the step's tasks run on this task's node (this one included)."""
        return self.tasks_per_node[self.node_index]

    @property
    def one_per_node(self) -> bool:
        """Whether every node of the step runs exactly one task."""
        return all(count == 1 for count in self.tasks_per_node)


def srun_task(environ: Mapping[str, str]) -> SrunTask | None:
    """The srun task whose environment ``environ`` is; None when it is none: no
    ``SLURM_STEP_ID`` (nor its old name ``SLURM_STEPID``), as outside Slurm and in a batch
    script (which runs on one node of its job, so its job's node count says nothing of how
    many launchers there are).

    Each value comes from the step's own variable; the job's stands in only where it must
    be the same: the node list is ``SLURM_JOB_NODELIST``'s when ``SLURM_STEP_NODELIST`` is
    missing and the step has as many nodes as its job (``SLURM_STEP_NUM_NODES`` equal to
    ``SLURM_JOB_NUM_NODES``: a step runs on its job's nodes, so then on all of them). The
    node's index is ``SLURM_NODEID``, else where ``SLURMD_NODENAME`` is in the list; the
    tasks per node are ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` (which
    srun sets to the step's too).

    ValueError, naming the variables, when a step's variable is missing or malformed or
    they contradict one another: a node count other than the node list's length or the
    tasks-per-node list's, a node index outside the step, ``SLURMD_NODENAME`` listed at
    another index, a node with no task, a task count or rank that does not fit."""
    step_id = _first(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if step_id is None:
        return None
    job_id = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if not job_id:
        raise ValueError(f"srun step {step_id} (SLURM_STEP_ID) has no SLURM_JOB_ID")
    where = f"srun step {job_id}.{step_id}"
    names = _step_nodes(environ, where)
    count = _count(environ, "SLURM_STEP_NUM_NODES", where)
    if count is not None and count != len(names):
        raise ValueError(f"{where}: SLURM_STEP_NUM_NODES={count} but the node list "
                         f"{_nodelist_text(environ)!r} names {len(names)} nodes")
    tasks_name = ("SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ
                  else "SLURM_TASKS_PER_NODE")
    if tasks_name not in environ:
        raise ValueError(f"{where}: no SLURM_STEP_TASKS_PER_NODE (nor SLURM_TASKS_PER_NODE)")
    try:
        tasks = tuple(expand_tasks_per_node(environ[tasks_name]))
    except ValueError as exc:
        raise ValueError(f"{where}: {tasks_name}: {exc}") from None
    if len(tasks) != len(names):
        raise ValueError(f"{where}: {tasks_name}={environ[tasks_name]} gives {len(tasks)} "
                         f"nodes but the step has {len(names)}")
    if 0 in tasks:
        raise ValueError(f"{where}: {tasks_name}={environ[tasks_name]} leaves a node of the "
                         "step with no task")
    index = _node_index(environ, names, where)
    total = sum(tasks)
    declared = _count(environ, "SLURM_STEP_NUM_TASKS", where)
    if declared is not None and declared != total:
        raise ValueError(f"{where}: SLURM_STEP_NUM_TASKS={declared} but {tasks_name}="
                         f"{environ[tasks_name]} adds up to {total}")
    task = _count(environ, "SLURM_PROCID", where)
    if task is None:
        raise ValueError(f"{where}: no SLURM_PROCID")
    if task >= total:
        raise ValueError(f"{where}: SLURM_PROCID={task} but the step has {total} tasks")
    local = _count(environ, "SLURM_LOCALID", where)
    if local is not None and local >= tasks[index]:
        raise ValueError(f"{where}: SLURM_LOCALID={local} but node {index} "
                         f"({names[index]}) runs {tasks[index]} tasks ({tasks_name})")
    return SrunTask(job_id, step_id, names, index, tasks, task)


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    return next((environ[name] for name in names if name in environ), None)


def _count(environ: Mapping[str, str], name: str, where: str) -> int | None:
    """``environ[name]`` as a number >= 0; None when it is not set."""
    if name not in environ:
        return None
    text = environ[name].strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{where}: {name}={environ[name]!r} is not a number")
    return int(text)


def _nodelist_text(environ: Mapping[str, str]) -> str:
    return environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))


def _step_nodes(environ: Mapping[str, str], where: str) -> tuple[str, ...]:
    """The step's node names: its own list, else its job's when the step spans the job."""
    name = "SLURM_STEP_NODELIST"
    if name not in environ:
        step, job = environ.get("SLURM_STEP_NUM_NODES"), environ.get("SLURM_JOB_NUM_NODES")
        if step is None or step != job or "SLURM_JOB_NODELIST" not in environ:
            raise ValueError(f"{where}: no SLURM_STEP_NODELIST, and SLURM_STEP_NUM_NODES="
                             f"{step} does not show that the step runs on all of its job's "
                             f"SLURM_JOB_NUM_NODES={job} nodes (SLURM_JOB_NODELIST)")
        name = "SLURM_JOB_NODELIST"
    try:
        names = tuple(expand_hostlist(environ[name]))
    except ValueError as exc:
        raise ValueError(f"{where}: {name}: {exc}") from None
    if not names:
        raise ValueError(f"{where}: {name} is empty")
    return names


def _node_index(environ: Mapping[str, str], names: tuple[str, ...], where: str) -> int:
    """This task's node in the step: ``SLURM_NODEID``, checked against ``SLURMD_NODENAME``
    where the list names it (a front-end node's name may not be listed)."""
    here = environ.get("SLURMD_NODENAME")
    listed = names.index(here) if here is not None and here in names else None
    index = _count(environ, "SLURM_NODEID", where)
    if index is None:
        if listed is None:
            raise ValueError(f"{where}: no SLURM_NODEID, and SLURMD_NODENAME={here} is not "
                             "one of the step's nodes")
        return listed
    if index >= len(names):
        raise ValueError(f"{where}: SLURM_NODEID={index} but the step has {len(names)} nodes")
    if listed is not None and names[index] != here:
        raise ValueError(f"{where}: SLURM_NODEID={index} is {names[index]}, but "
                         f"SLURMD_NODENAME={here} is node {listed}")
    return index


# The private directory px.SlurmBackend makes for a job (phalanx.backends.cluster.slurmjob)
# and its agents read and write (``phalanx agent --slurm DIR``):
JOB_TOKEN = "token"  # DIR/token: the job's token (0600)
JOB_AGENTS = "agents"  # DIR/agents/<node>: "host:port" of that node's agent
