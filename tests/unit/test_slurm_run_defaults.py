"""``phalanx run`` under ``srun`` needs no flags: the step's ``--nnodes``, ``--node-rank``
and ``--master-addr`` (``phalanx.launcher.slurmenv``), flags and ``PET_*`` variables still
first, several tasks on a node refused, and the first node's ``NodeAddr`` asked of
``scontrol`` only when it is needed (a fake ``scontrol`` on PATH here; the real one is the
Slurm end-to-end test's)."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.launcher import flags, slurmenv
from tests.unit.test_slurm_world import (
    BATCH,
    BATCH_SRUN_N1,
    SRUN_N2_N3_TASK1,
    SRUN_N2_TASK0,
    SRUN_N2_TASK1,
)

FAKE_SCONTROL = """\
#!/bin/sh
# scontrol show node -o NAME, as Slurm 22.05 answers it; every call noted in CALLS
echo "$*" >> {calls}
{delay}
if [ "$4" = n1 ]; then
    echo "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr={address} NodeHostName=node-one \
Port=6818 Version=22.05.8 OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 \
(2024-02-01)  RealMemory=2000 State=IDLE Partitions=debug  CfgTRES=cpu=2 AllocTRES="
    exit 0
fi
echo "Node $4 not found"
exit 1
"""


class FakeScontrol:
    """A ``scontrol`` first on PATH; ``calls``: the command lines it was run with."""

    def __init__(self, directory: Path, address: str = "10.1.2.3", delay: float = 0) -> None:
        self.directory = directory
        self._calls = directory / "calls"
        script = directory / "scontrol"
        script.write_text(textwrap.dedent(FAKE_SCONTROL).format(
            calls=self._calls, address=address, delay=f"exec sleep {delay}" if delay else ""))
        script.chmod(0o755)

    @property
    def calls(self) -> list[str]:
        return self._calls.read_text().splitlines() if self._calls.exists() else []


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    fake = FakeScontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return fake


def parse(environ: dict[str, str], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_torchrun_arguments(parser, environ=environ)
    return parser.parse_args(list(argv))


# -- the defaults -------------------------------------------------------------------------


def test_each_task_of_a_step_of_two_nodes_takes_its_node():
    first, second = parse(SRUN_N2_TASK0), parse(SRUN_N2_TASK1)
    assert (first.nnodes, first.node_rank, first.master_addr) == ("2", 0, None)
    assert (second.nnodes, second.node_rank, second.master_addr) == ("2", 1, None)
    assert second.srun_defaults.applies


def test_flags_given_win_over_the_steps():
    options = parse(SRUN_N2_TASK1, "--nnodes", "3", "--node-rank", "2", "--master-addr", "h")
    assert (options.nnodes, options.node_rank, options.master_addr) == ("3", 2, "h")
    assert flags.master_addr(options) == "h"


def test_pet_variables_win_over_the_steps():
    environ = {**SRUN_N2_TASK1, "PET_NNODES": "4", "PET_NODE_RANK": "3",
               "PET_MASTER_ADDR": "head"}
    options = parse(environ)
    assert (options.nnodes, options.node_rank, options.master_addr) == ("4", 3, "head")


def test_each_flag_is_defaulted_on_its_own():
    options = parse(SRUN_N2_TASK1, "--master-addr", "n1-ib0")
    assert (options.nnodes, options.node_rank, options.master_addr) == ("2", 1, "n1-ib0")


@pytest.mark.parametrize("environ", [{}, BATCH, BATCH_SRUN_N1, {"SLURM_JOB_ID": "5"}],
                         ids=["no-slurm", "batch-script", "one-node-step", "job-only"])
def test_outside_a_step_of_several_nodes_the_defaults_are_phalanxs(environ):
    options = parse(environ)
    assert (options.nnodes, options.node_rank, options.master_addr) == ("1", 0, None)
    assert flags.srun_refusal(options) is None
    assert not options.srun_defaults.applies


def test_several_tasks_on_a_node_are_refused_unless_nnodes_is_given():
    options = parse(SRUN_N2_N3_TASK1)
    assert options.nnodes is None and options.node_rank == 0
    refusal = flags.srun_refusal(options)
    assert refusal is not None
    assert "srun runs 2 tasks on node n1 (step 1.0)" in refusal
    assert "srun --ntasks-per-node=1 phalanx run -n N" in refusal
    assert flags.srun_refusal(parse(SRUN_N2_N3_TASK1, "--nnodes", "1")) is None
    assert flags.srun_refusal(parse({**SRUN_N2_N3_TASK1, "PET_NNODES": "3"})) is None


def test_contradicting_variables_are_refused_unless_nnodes_is_given():
    environ = {**SRUN_N2_TASK1, "SLURM_NODEID": "5"}
    options = parse(environ)
    refusal = flags.srun_refusal(options)
    assert refusal is not None
    assert "SLURM_NODEID=5 but the step has 2 nodes" in refusal
    assert "--nnodes 1 to run on this node alone" in refusal
    assert flags.srun_refusal(parse(environ, "--nnodes", "1")) is None


# -- the address of the first node --------------------------------------------------------


def test_parsing_asks_scontrol_nothing(scontrol):
    parse(SRUN_N2_TASK1)
    assert scontrol.calls == []


def test_the_master_address_is_the_first_nodes_node_addr(scontrol):
    assert flags.master_addr(parse(SRUN_N2_TASK1)) == "10.1.2.3"
    assert scontrol.calls == ["show node -o n1"]


def test_a_master_address_given_asks_scontrol_nothing(scontrol):
    assert flags.master_addr(parse(SRUN_N2_TASK1, "--master-addr", "h")) == "h"
    assert flags.master_addr(parse({**SRUN_N2_TASK1, "PET_MASTER_ADDR": "p"})) == "p"
    assert flags.master_addr(parse({})) == flags.STATIC_ADDR
    assert flags.master_addr(parse(BATCH)) == flags.STATIC_ADDR
    assert scontrol.calls == []


def test_without_scontrol_the_address_is_the_nodes_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no scontrol
    assert slurmenv.node_address("n1") == "n1"
    assert flags.master_addr(parse(SRUN_N2_TASK1)) == "n1"


def test_a_node_scontrol_does_not_know_is_its_name(scontrol):
    assert slurmenv.node_address("n7") == "n7"
    assert scontrol.calls == ["show node -o n7"]


def test_a_record_with_no_node_addr_is_the_nodes_name(scontrol):
    FakeScontrol(scontrol.directory, address="")
    assert slurmenv.node_address("n1") == "n1"


def test_an_scontrol_that_hangs_is_given_up_on(tmp_path, monkeypatch):
    FakeScontrol(tmp_path, delay=30)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert slurmenv.node_address("n1", timeout=0.5) == "n1"


# -- the job phalanx run forms ------------------------------------------------------------


def _srun_environment(monkeypatch, environ: dict[str, str]) -> None:
    """This process's environment as an srun task's (``main.build_parser`` reads it)."""
    for name in list(os.environ):
        if name.startswith(("SLURM", "PET_")):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_phalanx_run_under_srun_forms_the_steps_job(scontrol, monkeypatch):
    _srun_environment(monkeypatch, SRUN_N2_TASK1)
    job = main._job(main.build_parser().parse_args(["run", "train.py"]))
    assert job is not None
    assert (job.min_nodes, job.max_nodes, job.node_rank, job.static, job.endpoint) == (
        2, 2, 1, True, ("10.1.2.3", flags.STATIC_PORT))


def test_a_c10d_endpoint_given_asks_scontrol_nothing(scontrol, monkeypatch):
    _srun_environment(monkeypatch, SRUN_N2_TASK1)
    job = main._job(main.build_parser().parse_args(
        ["run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:1234", "train.py"]))
    assert job is not None and job.endpoint == ("head", 1234) and job.node_rank is None
    assert scontrol.calls == []


def test_nnodes_1_makes_every_task_a_run_of_its_own(scontrol, monkeypatch):
    """The node rank srun gave is left unused, not an error."""
    _srun_environment(monkeypatch, SRUN_N2_TASK1)
    assert main._job(main.build_parser().parse_args(["run", "--nnodes", "1", "x.py"])) is None
    with pytest.raises(ValueError, match="--node-rank 2: with one node it must be 0"):
        main._job(main.build_parser().parse_args(
            ["run", "--nnodes", "1", "--node-rank", "2", "x.py"]))


def test_several_tasks_on_a_node_stop_phalanx_run(monkeypatch):
    _srun_environment(monkeypatch, SRUN_N2_N3_TASK1)
    with pytest.raises(ValueError, match="--ntasks-per-node=1"):
        main._job(main.build_parser().parse_args(["run", "train.py"]))


def test_a_problem_with_the_nnodes_srun_gave_says_it_came_from_srun(monkeypatch):
    _srun_environment(monkeypatch, SRUN_N2_TASK1)
    with pytest.raises(ValueError, match=r"under srun, one task on each of the step's 2 "
                                         r"nodes, --nnodes defaults"):
        main._job(main.build_parser().parse_args(["run", "--framework", "jax", "x.py"]))
    with pytest.raises(ValueError) as caught:
        main._job(main.build_parser().parse_args(
            ["run", "--nnodes", "3", "--framework", "jax", "x.py"]))
    assert "srun" not in str(caught.value)
