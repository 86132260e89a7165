"""Spawning: every rank gets the right environment, before user code is imported."""

from __future__ import annotations

import os
import threading

import pytest

from phalanx import WorkerGroup
from tests import helpers, modtarget
from tests.workers import Probe

GENERIC = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
           "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(
        Probe,
        args=("a",),
        kwargs={"k": 1},
        nodes=2,
        procs_per_node=2,
        env={"USER_VAR": "from-controller", "SHARED": "global"},
        rank_env={3: {"SHARED": "rank-three", "RANK_ONLY": "yes"}},
        backend=backend,
        echo_output=False,
    ) as group:
        yield group


def test_layout_properties(group):
    assert (group.world_size, group.nodes, group.procs_per_node) == (4, 2, 2)
    assert [h.node for h in group.health()] == [0, 0, 1, 1]


def test_every_rank_gets_the_generic_rendezvous_variables(group):
    envs = group.call("env", *GENERIC, *(f"PHALANX_{n}" for n in GENERIC))
    for rank, env in enumerate(envs):
        expected = {
            "RANK": rank,
            "LOCAL_RANK": rank % 2,
            "WORLD_SIZE": 4,
            "LOCAL_WORLD_SIZE": 2,
            "NODE_RANK": rank // 2,
        }
        for name, value in expected.items():
            assert env[name] == str(value), (rank, name)
        for name in GENERIC:
            assert env[f"PHALANX_{name}"] == env[name], (rank, name)
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert 0 < int(envs[0]["MASTER_PORT"]) < 65536


def test_rank_zero_can_listen_on_the_master_port(group):
    # torch.distributed's env:// rendezvous binds MASTER_ADDR:MASTER_PORT on rank 0.
    assert group.call_one(0, "bind_master_port") is True


def test_user_env_and_per_rank_overrides(group):
    envs = group.call("env", "USER_VAR", "SHARED", "RANK_ONLY")
    assert [e["USER_VAR"] for e in envs] == ["from-controller"] * 4
    assert [e["SHARED"] for e in envs] == ["global", "global", "global", "rank-three"]
    assert [e["RANK_ONLY"] for e in envs] == [None, None, None, "yes"]


def test_the_controller_environment_is_inherited(group):
    assert group.call("env", "PATH") == [{"PATH": os.environ["PATH"]}] * 4


def test_environment_is_set_before_user_code_is_imported(group):
    at_import = group.call("env_at_import")
    assert [e["RANK"] for e in at_import] == ["0", "1", "2", "3"]
    assert [e["PHALANX_RANK"] for e in at_import] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in at_import} == {"4"}
    assert {e["USER_VAR"] for e in at_import} == {"from-controller"}


def test_every_rank_is_constructed_with_the_same_arguments(group):
    assert group.call("init_args") == [(("a",), {"k": 1})] * 4


def test_worker_pids_are_distinct_children_processes(group):
    pids = group.call("pid")
    assert len(set(pids)) == 4
    assert os.getpid() not in pids
    assert [h.pid for h in group.health()] == pids


def test_cwd_option_sets_the_workers_directory(make_group, tmp_path):
    group = make_group(Probe, cwd=str(tmp_path))
    assert group.call("cwd") == [str(tmp_path)]


def test_a_module_can_be_the_target(make_group):
    group = make_group(modtarget, procs_per_node=2)
    assert group.call("rank") == [0, 1]
    assert group.map("double", [1, 2]) == [2, 4]
    assert {"rank", "double"} <= set(group.methods)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"env": {"GOOD": "1", "THREADS": 4}}, TypeError, ["THREADS"]),
        ({"rank_env": {0: {"FLAG": None}}}, TypeError, ["FLAG"]),
        ({"nodes": 0}, ValueError, ["nodes"]),
        ({"procs_per_node": -1}, ValueError, ["procs_per_node"]),
        ({"concurrency": 0}, ValueError, ["concurrency"]),
        ({"start_timeout": 0}, ValueError, ["start_timeout"]),
        ({"rank_env": {5: {"A": "b"}}}, ValueError, ["5"]),
        ({"framework": "no-such-framework"}, ValueError, ["no-such-framework"]),
        ({"backend": "no-such-backend"}, ValueError, ["no-such-backend", "local"]),
        ({"args": "not-a-tuple"}, TypeError, ["args"]),
        ({"kwargs": ["k"]}, TypeError, ["kwargs"]),
    ],
)
def test_bad_options_raise_before_any_process_starts(options, error, words):
    with pytest.raises(error) as info:
        WorkerGroup(Probe, echo_output=False, **options)
    for word in words:
        assert word in str(info.value)
    assert helpers.stray_children() == []


def test_bad_env_leaves_no_threads_or_descriptors_behind(backend):
    def count():
        return threading.active_count(), len(os.listdir("/proc/self/fd"))

    before = count()
    for _ in range(3):
        with pytest.raises(TypeError):
            WorkerGroup(Probe, env={"N": 1}, backend=backend, echo_output=False)
    assert helpers.wait_until(lambda: count() == before, 2.0), (before, count())


def test_a_given_rendezvous_is_every_ranks_and_survives_a_restart(make_group):
    from phalanx.node.machine import pick_free_ports

    (port,) = pick_free_ports("127.0.0.1", 1)
    group = make_group(Probe, procs_per_node=2, master_port=port, master_addr="localhost")
    expected = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}
    assert group.call("env", "MASTER_ADDR", "MASTER_PORT") == [expected, expected]
    group.restart()
    assert group.call("env", "MASTER_ADDR", "MASTER_PORT") == [expected, expected]


@pytest.mark.parametrize(("kwargs", "error"), [({"master_port": 0}, ValueError),
                                               ({"master_port": "29500"}, TypeError),
                                               ({"master_addr": ""}, TypeError)])
def test_a_bad_rendezvous_is_refused_before_anything_starts(kwargs, error):
    with pytest.raises(error, match="master_"):
        WorkerGroup(Probe, **kwargs)


def test_ranks_run_as_batch_tasks_unless_asked_otherwise(group, make_group, backend):
    """A rank a node supervisor starts is SCHED_BATCH (PHALANX_RANK_SCHED, default
    "batch"), what it starts too; "normal" keeps the policy it would inherit; anything
    else is refused before a rank starts, naming the variable."""
    if backend == "ray":
        pytest.skip("on Ray a rank runs in its actor's worker process, scheduled as Ray "
                    "starts it")
    assert group.call("cpu_policy") == ["batch"] * 4
    normal = make_group(Probe, procs_per_node=2,
                        rank_env={1: {"PHALANX_RANK_SCHED": "normal"}})
    assert normal.call("cpu_policy") == ["batch", "normal"]
    with pytest.raises(ValueError, match="PHALANX_RANK_SCHED='idle'"):
        make_group(Probe, env={"PHALANX_RANK_SCHED": "idle"})
