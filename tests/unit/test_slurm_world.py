"""Slurm's words, read (``phalanx.world.slurm``): hostlists and tasks per node compressed
and expanded back, records of ``scontrol -o``, and srun tasks' environments.

The records and environments are what Slurm 22.05 wrote on the two-node test cluster
(``tests/slurmcluster.py``: ``n1`` on 127.0.0.2, ``n2`` on 127.0.0.3): ``scontrol show node
-o n1``, ``scontrol show job -o`` (and ``-d``, and without ``-o``) of a batch job named
``my job``, and ``env`` in tasks of ``srun -N2``, ``srun -N2 -n3``, a batch script and an
``srun -N1`` inside a two-node job; the variables that say nothing of the step are left
out.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.world.slurm import (
    MAX_NODES,
    SrunTask,
    expand_hostlist,
    expand_tasks_per_node,
    parse_record,
    srun_task,
)

NODE_N1 = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.2 "
    "NodeHostName=localhost Port=55675 Version=22.05.8 OS=Linux 6.18.44-fc-v1045 #1 SMP "
    "PREEMPT_DYNAMIC @0  RealMemory=2000 AllocMem=0 FreeMem=23784 Sockets=2 Boards=1 "
    "State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=debug  BootTime=2026-12-02T09:17:12 SlurmdStartTime=2026-12-02T11:26:31 "
    "LastBusyTime=2026-12-02T11:26:31 CfgTRES=cpu=2,mem=2000M,billing=2 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 "
    "ExtSensorsTemp=n/s"
)

# A node slurmctld lost: its Reason holds spaces and brackets (Slurm's own wording).
NODE_DOWN = (
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.00 "
    "NodeAddr=127.0.0.3 NodeHostName=localhost Port=43797 Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v1045 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=2000 "
    "State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Partitions=debug  "
    "Reason=Not responding [slurm@2026-12-02T11:30:02]"
)

JOB_3 = (
    "JobId=3 JobName=my job UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 "
    "TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-02T11:26:33 "
    "EligibleTime=2026-12-02T11:26:33 AccrueTime=2026-12-02T11:26:33 "
    "StartTime=2026-12-02T11:26:34 EndTime=Unknown Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-12-02T11:26:34 Scheduler=Main Partition=debug "
    "AllocNode:Sid=localhost:2950 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] "
    "BatchHost=n1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/tmp/probe/job.sh "
    "WorkDir=/work/main StdErr=/tmp/probe/job.out StdIn=/dev/null StdOut=/tmp/probe/job.out "
    "Power= "
)

# scontrol show job -d -o: the per-node details in the middle
JOB_3_DETAILS = JOB_3.replace(
    "CoreSpec=* ", "CoreSpec=* JOB_GRES=(null)   Nodes=n[1-2] CPU_IDs=0 Mem=0 GRES= ")

# scontrol show job (no -o): one record over several lines
JOB_3_LINES = """\
JobId=3 JobName=my job
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901757 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=n[1-2]
   BatchHost=n1
   NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,node=2,billing=2
   Command=/tmp/probe/job.sh
   Power=
"""

# srun -N2 (in a fresh allocation, job 1): task 0, on n1
SRUN_N2_TASK0 = {
    "SLURMD_NODENAME": "n1", "SLURM_GTIDS": "0", "SLURM_JOBID": "1", "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "bash", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_TASK_PID": "4874",
    "SLURM_TOPOLOGY_ADDR": "n1",
}
SRUN_N2_TASK1 = {**SRUN_N2_TASK0, "SLURMD_NODENAME": "n2", "SLURM_GTIDS": "1",
                 "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_TASK_PID": "4875",
                 "SLURM_TOPOLOGY_ADDR": "n2"}

# srun -N2 -n3: two tasks on n1, one on n2; this is task 1 (n1's second)
SRUN_N2_N3_TASK1 = {**SRUN_N2_TASK0, "SLURM_GTIDS": "0,1", "SLURM_LOCALID": "1",
                    "SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
                    "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1",
                    "SLURM_TASKS_PER_NODE": "2,1"}

# sbatch -N2 (job 3): the batch script itself, on n1 only
BATCH = {
    "SLURMD_NODENAME": "n1", "SLURM_GTIDS": "0", "SLURM_JOBID": "3", "SLURM_JOB_ID": "3",
    "SLURM_JOB_NAME": "my job", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "4969",
}

# srun -N1 -n1 in that batch script: the step has one of the job's two nodes
BATCH_SRUN_N1 = {**BATCH, "SLURM_NNODES": "1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
                 "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1",
                 "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1",
                 "SLURM_TASKS_PER_NODE": "1", "SLURM_TASK_PID": "4988"}


# -- hostlists ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "names"), [
    ("n[1-3,5],gpu[01-02]", ["n1", "n2", "n3", "n5", "gpu01", "gpu02"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[8-010]", ["n8", "n9", "n10"]),  # the first number's padding, as Slurm's
    ("n[01-2]", ["n01", "n02"]),
    ("n[2,1],n1", ["n2", "n1", "n1"]),  # order and repeats kept
    ("a-b[1-2]", ["a-b1", "a-b2"]),
    ("[1-2]", ["1", "2"]),
    ("n7", ["n7"]),
    ("a b,c", ["a", "b", "c"]),  # white space separates too
    ("n[1-2],", ["n1", "n2"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("", []),
])
def test_hostlists_expand_as_slurm_expands_them(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(("text", "why"), [
    ("n[3-1]", "runs backwards"),
    ("n[1-2", "never closed"),
    ("n1]", "with no"),
    ("n[[1]]", "inside a bracket"),
    ("n[]", "not a number"),
    ("n[a-b]", "not a number"),
    ("n[1-]", "not a number"),
    ("n[1--2]", "not a number"),
    ("n[ 1-2]", "not a number"),
    ("n[1-3:2]", "not a number"),
    ("n[\u0661-\u0662]", "not a number"),  # Arabic-Indic digits: int() takes them, Slurm not
    (f"n[1-{MAX_NODES + 1}]", "more than"),
    (f"a[1-{MAX_NODES}],b", "more than"),
    ("r[1-2048]n[1-2048]", "more than"),
])
def test_a_malformed_hostlist_is_refused_naming_it(text, why):
    with pytest.raises(ValueError, match=why) as caught:
        expand_hostlist(text)
    assert repr(text) in str(caught.value)


# One name: literal parts and bracket groups in turn; a group is a list of ranges, each
# (first, count, padding, whether the last number is written padded too).
_LITERAL = st.text("abcxyzAZ019-_.", min_size=1, max_size=4)
_RANGES = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 4), st.integers(0, 3),
                             st.booleans()), min_size=1, max_size=3)
_NAME = st.lists(st.one_of(_LITERAL, _RANGES), min_size=1, max_size=4)


def _bracket(ranges) -> tuple[str, list[str]]:
    """A bracket group's text, and the numbers it stands for."""
    items, numbers = [], []
    for first, extra, padding, padded_last in ranges:
        width = len(str(first)) + padding
        low = str(first).zfill(width)
        last = first + extra
        high = str(last).zfill(width) if padded_last else str(last)
        items.append(low if extra == 0 and padded_last else f"{low}-{high}")
        numbers.extend(str(n).zfill(width) for n in range(first, last + 1))
    return "[" + ",".join(items) + "]", numbers


def _compress(parts) -> tuple[str, list[str]]:
    """One name's hostlist text, and the names it stands for (the last group fastest)."""
    text, choices = [], []
    for part in parts:
        if isinstance(part, str):
            text.append(part)
            choices.append([part])
        else:
            written, numbers = _bracket(part)
            text.append(written)
            choices.append(numbers)
    return "".join(text), ["".join(p) for p in itertools.product(*choices)]


@given(st.lists(_NAME, max_size=5), st.sampled_from([",", " ", ", "]))
def test_compressed_names_expand_back(names, separator):
    pieces = [_compress(parts) for parts in names]
    text = separator.join(written for written, _ in pieces)
    assert expand_hostlist(text) == [name for _, expanded in pieces for name in expanded]


def _runs(names: list[tuple[str, str]]) -> str:
    """Slurm's way of writing a list of names (prefix, digits): consecutive numbers of one
    prefix and one width as ranges in one bracket."""
    out = []
    for (prefix, width), group in itertools.groupby(names, key=lambda n: (n[0], len(n[1]))):
        digits = [d for _, d in group]
        if not width:
            out.extend(prefix for _ in digits)
            continue
        items, start = [], 0
        for i in range(1, len(digits) + 1):
            if i == len(digits) or int(digits[i]) != int(digits[i - 1]) + 1:
                run = digits[start:i]
                items.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
                start = i
        out.append(f"{prefix}[{','.join(items)}]")
    return ",".join(out)


_NODE = st.tuples(st.sampled_from(["n", "gpu", "rack-a"]),
                  st.tuples(st.integers(0, 30), st.integers(0, 3)).map(
                      lambda nw: str(nw[0]).zfill(nw[1])))


@given(st.lists(_NODE, max_size=30))
def test_a_list_of_names_compressed_as_slurm_does_expands_back(nodes):
    assert expand_hostlist(_runs(nodes)) == [prefix + digits for prefix, digits in nodes]


@given(st.text(max_size=30))
def test_any_text_is_a_hostlist_or_a_value_error(text):
    try:
        names = expand_hostlist(text)
    except ValueError:
        return
    assert all(name and "[" not in name and "]" not in name for name in names)


# -- tasks per node -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "counts"), [
    ("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]), ("4", [4]), ("2,1", [2, 1]),
    ("1(x1),3(x2)", [1, 3, 3]), (" 1(x2)\n", [1, 1]),
])
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "2(x0)", "2(3)", "2(x3", "1,,2", "-1", "2 (x3)",
                                  f"1(x{MAX_NODES + 1})"])
def test_malformed_tasks_per_node_are_refused_naming_them(text):
    with pytest.raises(ValueError) as caught:
        expand_tasks_per_node(text)
    assert repr(text) in str(caught.value)


@given(st.lists(st.integers(0, 64), max_size=40))
def test_tasks_per_node_compressed_expand_back(counts):
    text = ",".join(count if repeats == 1 else f"{count}(x{repeats})"
                    for count, repeats in ((str(c), len(list(g)))
                                           for c, g in itertools.groupby(counts)))
    if not counts:
        with pytest.raises(ValueError):
            expand_tasks_per_node(text)
    else:
        assert expand_tasks_per_node(text) == counts


# -- scontrol's records -------------------------------------------------------------------


def test_a_node_record_with_spaces_in_values():
    node = parse_record(NODE_N1)
    assert node["NodeName"] == "n1"
    assert node["NodeAddr"] == "127.0.0.2"
    assert node["NodeHostName"] == "localhost"
    assert node["OS"] == "Linux 6.18.44-fc-v1045 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["CfgTRES"] == "cpu=2,mem=2000M,billing=2"
    assert node["AllocTRES"] == ""
    assert node["MCS_label"] == "N/A"
    assert node["ExtSensorsTemp"] == "n/s"
    assert len(node) == 38


def test_a_down_node_keeps_its_reason_whole():
    node = parse_record(NODE_DOWN)
    assert node["Reason"] == "Not responding [slurm@2026-12-02T11:30:02]"
    assert node["State"] == "DOWN+NOT_RESPONDING"
    assert node["Partitions"] == "debug"


def test_a_job_record():
    job = parse_record(JOB_3)
    assert job["JobId"] == "3"
    assert job["JobName"] == "my job"
    assert job["NodeList"] == "n[1-2]"
    assert expand_hostlist(job["NodeList"]) == ["n1", "n2"]
    assert job["AllocNode:Sid"] == "localhost:2950"
    assert job["CPUs/Task"] == "1"
    assert job["ReqB:S:C:T"] == "0:0:*:*"
    assert job["TRES"] == "cpu=2,node=2,billing=2"
    assert job["Power"] == ""
    assert len(job) == 60


def test_details_and_the_several_line_form_read_the_same():
    details = parse_record(JOB_3_DETAILS)
    assert details["Nodes"] == "n[1-2]"
    assert details["GRES"] == ""
    assert {k: v for k, v in details.items() if k in parse_record(JOB_3)} == parse_record(JOB_3)
    lines = parse_record(JOB_3_LINES)
    assert lines["JobName"] == "my job"
    assert lines["UserId"] == "root(0)"
    assert lines["Power"] == ""
    assert {k: parse_record(JOB_3)[k] for k in lines} == lines


def test_a_repeated_key_keeps_its_first_value():
    assert parse_record("Nodes=n1 CPU_IDs=0 Nodes=n2 CPU_IDs=1") == {"Nodes": "n1",
                                                                     "CPU_IDs": "0"}


@pytest.mark.parametrize("line", ["", "   ", "\n"])
def test_a_blank_line_is_no_record(line):
    assert parse_record(line) == {}


@pytest.mark.parametrize("line", ["Node nope not found", "nodeName=n1", "=x", "x A=1",
                                  "slurm_load_node error: Unable to contact slurm controller"])
def test_text_that_is_no_record_is_refused(line):
    with pytest.raises(ValueError, match="not a Slurm record"):
        parse_record(line)


_KEYS = st.from_regex(r"[A-Z][A-Za-z0-9_:/.]{0,8}", fullmatch=True)
_VALUES = st.lists(st.text("abc019()[]@*:,/=-_.#", max_size=6), max_size=3).map(" ".join)


@given(st.dictionaries(_KEYS, _VALUES, max_size=8))
def test_records_written_back_read_back(record):
    line = " ".join(f"{key}={value}" for key, value in record.items())
    assert parse_record(line) == {key: value.strip() for key, value in record.items()}


@given(st.text(max_size=40))
def test_any_line_is_a_record_or_a_value_error(line):
    try:
        parse_record(line)
    except ValueError:
        pass


# -- srun tasks ---------------------------------------------------------------------------


def test_the_tasks_of_srun_n2():
    first, second = srun_task(SRUN_N2_TASK0), srun_task(SRUN_N2_TASK1)
    assert first == SrunTask(job_id="1", step_id="0", node_names=("n1", "n2"), node_index=0,
                             tasks_per_node=(1, 1), task=0)
    assert (first.nodes, first.first_node, first.tasks_on_node, first.one_per_node) == (
        2, "n1", 1, True)
    assert second is not None
    assert (second.node_index, second.task, second.first_node) == (1, 1, "n1")


def test_several_tasks_on_a_node():
    task = srun_task(SRUN_N2_N3_TASK1)
    assert task is not None
    assert (task.nodes, task.node_index, task.tasks_per_node, task.tasks_on_node) == (
        2, 0, (2, 1), 2)
    assert not task.one_per_node


def test_a_step_on_part_of_its_job():
    task = srun_task(BATCH_SRUN_N1)
    assert task is not None
    assert (task.job_id, task.nodes, task.node_names, task.tasks_on_node) == ("3", 1, ("n1",),
                                                                             1)


@pytest.mark.parametrize("environ", [{}, BATCH, {"SLURM_JOB_ID": "7"},
                                     {"PATH": "/usr/bin", "HOME": "/root"}])
def test_no_srun_task_outside_a_step(environ):
    """A batch script runs on its job's first node alone: no step, no task (its job's two
    nodes would make a launcher wait for a second launcher that never starts)."""
    assert srun_task(environ) is None


def test_the_old_names_stand_in():
    environ = {k: v for k, v in SRUN_N2_TASK1.items() if k not in ("SLURM_STEP_ID",
                                                                   "SLURM_JOB_ID")}
    task = srun_task(environ)
    assert task is not None
    assert (task.job_id, task.step_id, task.node_index) == ("1", "0", 1)


def test_the_jobs_node_list_stands_in_only_for_a_step_on_all_of_it():
    environ = {k: v for k, v in SRUN_N2_TASK1.items() if k != "SLURM_STEP_NODELIST"}
    task = srun_task(environ)
    assert task is not None and task.node_names == ("n1", "n2")
    part = {k: v for k, v in BATCH_SRUN_N1.items() if k != "SLURM_STEP_NODELIST"}
    with pytest.raises(ValueError, match="no SLURM_STEP_NODELIST"):
        srun_task(part)


def test_the_node_index_from_the_nodes_name():
    environ = {k: v for k, v in SRUN_N2_TASK1.items() if k != "SLURM_NODEID"}
    task = srun_task(environ)
    assert task is not None and task.node_index == 1


def test_the_tasks_per_node_from_the_older_variable():
    environ = {k: v for k, v in SRUN_N2_N3_TASK1.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    task = srun_task(environ)
    assert task is not None and task.tasks_per_node == (2, 1)


@pytest.mark.parametrize(("change", "why"), [
    ({"SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES=3 but the node list"),
    ({"SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_NUM_NODES": "3"},
     r"SLURM_STEP_TASKS_PER_NODE=1\(x2\) gives 2 nodes but the step has 3"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 but the step has 2 nodes"),
    ({"SLURM_NODEID": "0"}, "SLURM_NODEID=0 is n1, but SLURMD_NODENAME=n2 is node 1"),
    ({"SLURM_NODEID": "one"}, "SLURM_NODEID='one' is not a number"),
    ({"SLURM_NODEID": "-1"}, "is not a number"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,0"}, "leaves a node of the step with no task"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x)"}, "SLURM_STEP_TASKS_PER_NODE: malformed"),
    ({"SLURM_STEP_NUM_TASKS": "4"}, "SLURM_STEP_NUM_TASKS=4 but"),
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 but the step has 2 tasks"),
    ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1 but node 1 \\(n2\\) runs 1 tasks"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"}, "SLURM_STEP_NODELIST: malformed hostlist"),
    ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST is empty"),
    ({"SLURM_JOB_ID": None, "SLURM_JOBID": None}, "has no SLURM_JOB_ID"),
    ({"SLURM_PROCID": None}, "no SLURM_PROCID"),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None},
     "no SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_NODEID": None, "SLURMD_NODENAME": "frontend"}, "no SLURM_NODEID"),
])
def test_variables_that_contradict_are_refused_naming_them(change, why):
    environ = {**SRUN_N2_TASK1, **change}
    environ = {k: v for k, v in environ.items() if v is not None}
    with pytest.raises(ValueError, match=why) as caught:
        srun_task(environ)
    assert "srun step" in str(caught.value)


def test_a_front_end_nodes_name_is_no_contradiction():
    """Where slurmd runs on a front end, SLURMD_NODENAME is not one of the step's nodes."""
    task = srun_task({**SRUN_N2_TASK1, "SLURMD_NODENAME": "frontend"})
    assert task is not None and task.node_index == 1


@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.data())
def test_every_task_of_a_step_reads_its_own_node(tasks_per_node, data):
    """Whatever the step's shape, each task's node and count are where Slurm put it."""
    nodes = len(tasks_per_node)
    names = [f"c{i:03d}" for i in range(nodes)]
    node = data.draw(st.integers(0, nodes - 1))
    local = data.draw(st.integers(0, tasks_per_node[node] - 1))
    rank = sum(tasks_per_node[:node]) + local
    spec = ",".join(str(c) for c in tasks_per_node)
    task = srun_task({"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "2",
                      "SLURM_STEP_NODELIST": f"c[000-{nodes - 1:03d}]",
                      "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": spec,
                      "SLURM_STEP_NUM_TASKS": str(sum(tasks_per_node)),
                      "SLURM_NODEID": str(node), "SLURMD_NODENAME": names[node],
                      "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local)})
    assert task is not None
    assert (task.nodes, task.node_index, task.tasks_on_node, task.first_node) == (
        nodes, node, tasks_per_node[node], "c000")
    assert task.one_per_node == all(c == 1 for c in tasks_per_node)
