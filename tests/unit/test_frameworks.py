"""Layout, per-rank and per-framework environments, GPU placement, environment merging:
pure functions, no processes."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.config import Settings
from phalanx.world.frameworks import (
    ENV_FRAMEWORK,
    ENV_MONARCH_WORKERS,
    ENV_NODE_ADDRS,
    ENV_NODE_SERVICE,
    FRAMEWORKS,
    NodeService,
    check_layout,
    get_framework,
    jax_local_devices,
    monarch_worker_address,
    monarch_worker_command,
    ray_address,
    ray_start_command,
    resolve_procs_per_node,
    tf_config,
    worker_env,
)
from phalanx.world.layout import (
    GENERIC_VARS,
    Launch,
    Layout,
    check_gpus,
    gpu_env,
    merge_env,
    parse_visible_gpus,
    rank_env,
)


def test_layout_numbers_ranks_node_major():
    layout = Layout(nodes=2, procs_per_node=3)
    assert layout.world_size == 6
    assert [layout.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.local_rank_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
@pytest.mark.parametrize("field", ["nodes", "procs_per_node"])
def test_layout_rejects_non_positive_integers(field, bad):
    kwargs = {"nodes": 1, "procs_per_node": 1, field: bad}
    with pytest.raises(ValueError, match=field):
        Layout(**kwargs)


def test_rank_env_for_two_nodes_of_two():
    layout = Layout(nodes=2, procs_per_node=2)
    envs = [rank_env(layout, r, "10.0.0.1", 29500) for r in range(4)]
    expected = [
        {"RANK": r, "LOCAL_RANK": r % 2, "NODE_RANK": r // 2} for r in range(4)
    ]
    for env, want in zip(envs, expected, strict=True):
        for name, value in want.items():
            assert env[name] == str(value)
            assert env[f"PHALANX_{name}"] == str(value)
        assert env["WORLD_SIZE"] == env["PHALANX_WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "10.0.0.1"
        assert env["MASTER_PORT"] == "29500"
        assert set(env) == set(GENERIC_VARS) | {f"PHALANX_{n}" for n in GENERIC_VARS}
        assert all(isinstance(v, str) for v in env.values())


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_env_rejects_ranks_outside_the_world(rank):
    with pytest.raises(ValueError, match=str(rank)):
        rank_env(Layout(2, 2), rank, "127.0.0.1", 1)


# -- uneven layouts -----------------------------------------------------------------------

counts_lists = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(counts=counts_lists)
def test_uneven_layouts_number_ranks_node_major(counts):
    layout = Layout.of(counts)
    assert layout.nodes == len(counts)
    assert layout.counts == tuple(counts)
    assert layout.world_size == sum(counts)
    # node 0's ranks first, then node 1's, ... each node's a contiguous block
    assert [r for n in range(layout.nodes) for r in layout.ranks_of(n)] == list(
        range(layout.world_size)
    )
    for node in range(layout.nodes):
        ranks = layout.ranks_of(node)
        assert len(ranks) == layout.local_world_size(node) == counts[node]
        for local, rank in enumerate(ranks):
            assert layout.node_of(rank) == node
            assert layout.local_rank_of(rank) == local


@settings(max_examples=100, deadline=None)
@given(counts=counts_lists)
def test_rank_env_gives_each_node_its_own_local_world_size(counts):
    layout = Layout.of(counts)
    for rank in range(layout.world_size):
        env = rank_env(layout, rank, "10.0.0.1", 29500)
        node = layout.node_of(rank)
        assert env["LOCAL_WORLD_SIZE"] == env["PHALANX_LOCAL_WORLD_SIZE"] == str(counts[node])
        assert env["NODE_RANK"] == str(node)
        assert env["LOCAL_RANK"] == str(layout.local_rank_of(rank))
        assert env["WORLD_SIZE"] == str(sum(counts))
    with pytest.raises(ValueError, match=str(layout.world_size)):
        rank_env(layout, layout.world_size, "10.0.0.1", 29500)


def test_rank_env_for_an_uneven_layout_of_two_then_one():
    layout = Layout(nodes=2, procs_per_node=(2, 1))
    envs = [rank_env(layout, r, "10.0.0.1", 29500) for r in range(3)]
    assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "2"),
        ("1", "0", "1", "2"),
        ("2", "1", "0", "1"),
    ]
    assert all(e["WORLD_SIZE"] == "3" for e in envs)


@settings(max_examples=100, deadline=None)
@given(count=st.integers(min_value=1, max_value=8), nodes=st.integers(min_value=1, max_value=6))
def test_equal_counts_normalise_to_the_int(count, nodes):
    for procs in ((count,) * nodes, [count] * nodes):
        layout = Layout(nodes, procs)
        assert layout.procs_per_node == count
        assert layout.uniform
        assert layout == Layout(nodes, count) == Layout.of([count] * nodes)
        assert layout.counts == (count,) * nodes
    if nodes > 1:
        uneven = Layout.of([count + 1] + [count] * (nodes - 1))
        assert not uneven.uniform
        assert uneven.procs_per_node == (count + 1, *(count,) * (nodes - 1))
        assert uneven != Layout(nodes, count)


@pytest.mark.parametrize(
    "bad", [(0,), (2, 0), (1, -1), (True, 1), (1, False), (1.5, 1), ("2", 1), (None,)]
)
def test_uneven_layout_rejects_non_positive_integer_counts(bad):
    with pytest.raises(ValueError, match="procs_per_node"):
        Layout(len(bad), bad)
    with pytest.raises(ValueError, match="procs_per_node"):
        Layout.of(list(bad))


@pytest.mark.parametrize(("nodes", "counts"), [(1, (1, 2)), (3, (1, 2)), (2, (3,))])
def test_uneven_layout_needs_one_count_per_node(nodes, counts):
    with pytest.raises(ValueError, match="nodes") as info:
        Layout(nodes, counts)
    assert "procs_per_node" in str(info.value)


def test_layout_of_no_counts_is_no_layout():
    with pytest.raises(ValueError, match="nodes"):
        Layout.of([])


def test_procs_per_node_lists_resolve_to_tuples():
    for name in FRAMEWORKS:
        assert resolve_procs_per_node([2, 1], get_framework(name), 4) == (2, 1)
        assert resolve_procs_per_node((3,), get_framework(name), None) == (3,)


@pytest.mark.parametrize("name", ["torch", "jax", None, "spmd"])
def test_auto_needs_a_gpu_count(name):
    with pytest.raises(ValueError, match="procs_per_node='auto'"):
        resolve_procs_per_node("auto", get_framework(name), None)


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
def test_one_per_node_frameworks_resolve_auto_without_a_gpu_count(name):
    assert resolve_procs_per_node("auto", get_framework(name), None) == 1


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
def test_one_per_node_frameworks_reject_uneven_layouts(name):
    framework = get_framework(name)
    check_layout(framework, Layout.of([1, 1, 1]))
    with pytest.raises(ValueError, match="procs_per_node"):
        check_layout(framework, Layout.of([1, 2]))


@pytest.mark.parametrize("name", [None, "spmd", "torch", "jax"])
def test_multi_process_frameworks_accept_uneven_layouts(name):
    check_layout(get_framework(name), Layout.of([3, 1]))


def test_jax_local_devices_share_each_nodes_gpus_by_its_own_count():
    # separate machines of four GPUs each: two ranks on node 0, one on node 1
    layout = Layout.of([2, 1])
    launch = make_launch(visible_gpus=tuple("0123"))
    got = [jax_local_devices(layout, rank, launch) for rank in range(3)]
    assert got == [[0, 1], [2, 3], [0, 1, 2, 3]]


def test_merge_env_layers_inherited_phalanx_user_then_rank():
    base = {"PATH": "/bin", "RANK": "stale", "A": "base", "PYTHONUNBUFFERED": "0"}
    generic = {"RANK": "1", "WORLD_SIZE": "2"}
    env = merge_env(base, generic, {"A": "user", "B": "user"}, {"B": "rank"})
    assert env["PATH"] == "/bin"
    assert env["RANK"] == "1"  # phalanx's value beats an inherited one
    assert env["A"] == "user"
    assert env["B"] == "rank"  # the per-rank override wins
    assert env["PYTHONUNBUFFERED"] == "0"  # an explicit inherited choice is kept
    assert merge_env({}, {}, None, None)["PYTHONUNBUFFERED"] == "1"
    assert base["RANK"] == "stale"  # inputs are not modified


@pytest.mark.parametrize(
    ("user", "per_rank", "label", "key"),
    [
        ({"GOOD": "x", "NUM_THREADS": 4}, None, "env", "NUM_THREADS"),
        (None, {"FLAG": None}, "rank_env", "FLAG"),
        ({"PATHLIKE": b"bytes"}, None, "env", "PATHLIKE"),
        ({3: "three"}, None, "env", "3"),
    ],
)
def test_merge_env_rejects_non_string_entries_naming_the_key(user, per_rank, label, key):
    with pytest.raises(TypeError) as info:
        merge_env({}, {}, user, per_rank)
    assert label in str(info.value)
    assert key in str(info.value)


def test_get_framework_knows_every_framework_and_refuses_others():
    for name in (None, "spmd", "torch", "jax", "tensorflow", "ray", "monarch"):
        get_framework(name)
    with pytest.raises(ValueError, match="nonsense"):
        get_framework("nonsense")


def test_settings_read_from_the_environment_once():
    assert Settings.from_env({}).start_timeout > 0
    settings = Settings.from_env({"PHALANX_START_TIMEOUT": "7.5", "PHALANX_PROGRESS": "0"})
    assert settings.start_timeout == 7.5 and settings.progress is False
    assert Settings.from_env({"PHALANX_PROGRESS": "1"}).progress is True
    assert Settings.from_env({}).progress is None
    with pytest.raises(ValueError, match="PHALANX_START_TIMEOUT"):
        Settings.from_env({"PHALANX_START_TIMEOUT": "soon"})


# -- frameworks: the exact variables of every rank ----------------------------------------

MASTER = "10.0.0.1"
NODE_ADDRS = ("10.0.0.1", "10.0.0.2")
PORTS = {
    "jax": (7001, 7002),
    "tensorflow": (8001, 8002),
    "ray": (6379, 6380),
    "monarch": (9001, 9002),
}
GENERIC_AND_PHALANX = set(GENERIC_VARS) | {f"PHALANX_{name}" for name in GENERIC_VARS}


def make_launch(**overrides) -> Launch:
    values = {
        "master_addr": MASTER,
        "master_port": 29500,
        "node_addrs": NODE_ADDRS,
        "ports": PORTS,
        "token": "t0k",
    }
    values.update(overrides)
    return Launch(**values)


def envs_of(name: str | None, layout: Layout, launch: Launch | None = None) -> list[dict]:
    launch = make_launch() if launch is None else launch
    framework = get_framework(name)
    return [worker_env(framework, layout, rank, launch) for rank in range(layout.world_size)]


@pytest.mark.parametrize(
    ("name", "label"), [(None, "spmd"), ("spmd", "spmd"), ("torch", "torch")]
)
def test_generic_frameworks_set_only_the_rendezvous_variables(name, label):
    layout = Layout(nodes=2, procs_per_node=2)
    for rank, env in enumerate(envs_of(name, layout)):
        assert set(env) == GENERIC_AND_PHALANX | {ENV_FRAMEWORK}
        assert env[ENV_FRAMEWORK] == label
        # exactly what torch's env:// rendezvous reads, nothing added or changed
        assert {k: v for k, v in env.items() if k != ENV_FRAMEWORK} == rank_env(
            layout, rank, MASTER, 29500
        )


def test_jax_variables_for_two_nodes_of_two():
    envs = envs_of("jax", Layout(nodes=2, procs_per_node=2))
    for rank, env in enumerate(envs):
        extras = set(env) - GENERIC_AND_PHALANX - {ENV_FRAMEWORK}
        assert extras == {
            "JAX_COORDINATOR_ADDRESS",
            "JAX_PROCESS_ID",
            "JAX_NUM_PROCESSES",
            "JAX_LOCAL_DEVICE_IDS",
        }
        assert env[ENV_FRAMEWORK] == "jax"
        # every process dials the coordinator on node 0, on node 0's jax port
        assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:7001"
        assert env["JAX_PROCESS_ID"] == env["RANK"] == str(rank)
        assert env["JAX_NUM_PROCESSES"] == "4"
        assert env["JAX_LOCAL_DEVICE_IDS"] == str(rank % 2)
        assert "CUDA_VISIBLE_DEVICES" not in env


def test_jax_local_devices_are_renumbered_when_phalanx_assigns_gpus():
    launch = make_launch(gpus_per_worker=2, visible_gpus=("0", "1", "2", "3"))
    envs = envs_of("jax", Layout(nodes=2, procs_per_node=2), launch)
    assert [env["JAX_LOCAL_DEVICE_IDS"] for env in envs] == ["0,1"] * 4
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "2,3", "0,1", "2,3"]


def test_tensorflow_config_has_one_worker_task_per_node():
    envs = envs_of("tensorflow", Layout(nodes=2, procs_per_node=1))
    for node, env in enumerate(envs):
        assert set(env) - GENERIC_AND_PHALANX == {ENV_FRAMEWORK, "TF_CONFIG"}
        config = json.loads(env["TF_CONFIG"])
        assert config == {
            "cluster": {"worker": ["10.0.0.1:8001", "10.0.0.2:8002"]},
            "task": {"type": "worker", "index": node},
        }
    assert tf_config(Layout(2, 1), 1, make_launch())["task"] == {"type": "worker", "index": 1}


@pytest.mark.parametrize("name", ["tensorflow", "ray", "monarch"])
def test_one_per_node_frameworks_reject_several_processes_per_node(name):
    framework = get_framework(name)
    check_layout(framework, 1)
    with pytest.raises(ValueError, match="procs_per_node") as info:
        check_layout(framework, 2)
    assert f"framework={name!r}" in str(info.value)
    assert "procs_per_node=2" in str(info.value)


@pytest.mark.parametrize("name", [None, "spmd", "torch", "jax"])
def test_multi_process_frameworks_accept_several_processes_per_node(name):
    check_layout(get_framework(name), 8)  # does not raise


def test_ray_variables_and_node_services():
    envs = envs_of("ray", Layout(nodes=2, procs_per_node=1))
    head, worker = envs
    # only the driver on node 0 connects to the cluster; node 1 only hosts a Ray node
    assert head["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert "RAY_ADDRESS" not in worker
    for env in envs:
        assert env[ENV_FRAMEWORK] == "ray"
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"] == "t0k"
        assert env[ENV_NODE_ADDRS] == "10.0.0.1,10.0.0.2"
        assert ENV_NODE_SERVICE in env

    head_service = NodeService.from_json(head[ENV_NODE_SERVICE])
    assert head_service.command == (
        "ray",
        "start",
        "--head",
        "--port=6379",
        "--include-dashboard=false",
        "--node-ip-address=10.0.0.1",
        "--temp-dir=/tmp/phalanx-ray-t0k-0",
        "--disable-usage-stats",
        "--block",
    )
    assert head_service.after is None  # the head waits for nobody
    assert head_service.ready_line == "Ray runtime started"
    assert head_service.env == {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}

    worker_service = NodeService.from_json(worker[ENV_NODE_SERVICE])
    assert worker_service.command == (
        "ray",
        "start",
        "--address=10.0.0.1:6379",
        "--node-ip-address=10.0.0.2",
        "--temp-dir=/tmp/phalanx-ray-t0k-1",
        "--disable-usage-stats",
        "--block",
    )  # Ray refuses dashboard options on a joining node
    assert "--head" not in worker_service.command
    assert worker_service.after == ("10.0.0.1", 6379)  # joins only once the head listens
    assert worker_service.ready_line == "Ray runtime started"
    assert worker_service.env == {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def test_ray_start_command_is_a_valid_foreground_command_line():
    launch = make_launch()
    assert ray_address(launch) == "10.0.0.1:6379"
    for node in (0, 1):
        command = ray_start_command(node, launch)
        assert command[:2] == ["ray", "start"]
        assert command[-1] == "--block"  # stopping the process stops the Ray node
        assert shlex.split(shlex.join(command)) == command
        assert f"--node-ip-address={NODE_ADDRS[node]}" in command


@pytest.mark.parametrize("name", ["ray", "monarch"])
def test_node_service_is_started_by_local_rank_zero_only(name):
    # worker_env itself does not enforce one process per node, so a 2 x 2 layout shows
    # that exactly one worker per node carries the service
    envs = envs_of(name, Layout(nodes=2, procs_per_node=2))
    assert [ENV_NODE_SERVICE in env for env in envs] == [True, False, True, False]
    services = [NodeService.from_json(envs[r][ENV_NODE_SERVICE]) for r in (0, 2)]
    assert services[0] != services[1]  # each node's own service


def test_monarch_variables_and_worker_loops():
    envs = envs_of("monarch", Layout(nodes=2, procs_per_node=1))
    for node, env in enumerate(envs):
        assert env[ENV_FRAMEWORK] == "monarch"
        assert env[ENV_MONARCH_WORKERS] == "tcp://10.0.0.1:9001,tcp://10.0.0.2:9002"
        assert env[ENV_NODE_ADDRS] == "10.0.0.1,10.0.0.2"
        assert env["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] == "tcp"
        service = NodeService.from_json(env[ENV_NODE_SERVICE])
        address = f"tcp://{NODE_ADDRS[node]}:{PORTS['monarch'][node]}"
        assert service.ready_port == (NODE_ADDRS[node], PORTS["monarch"][node])
        assert service.after is None
        assert service.command[:2] == ("python", "-c")
        code = service.command[2]
        compile(code, "<monarch worker>", "exec")  # a valid program
        assert "from monarch.actor import run_worker_loop_forever" in code
        assert f"run_worker_loop_forever(address={address!r}" in code
        assert tuple(monarch_worker_command(node, make_launch())) == service.command


def test_monarch_worker_addresses():
    launch = make_launch()
    assert monarch_worker_address(launch, 0) == "tcp://10.0.0.1:9001"
    assert monarch_worker_address(launch, 1) == "tcp://10.0.0.2:9002"


@pytest.mark.parametrize(
    ("node_addrs", "tcp"),
    [
        (("127.0.0.1", "127.0.0.1"), False),
        (("127.0.0.1", "127.0.1.1"), False),
        (("localhost", "localhost"), False),
        (("127.0.0.1", "10.0.0.2"), True),
        (("10.0.0.1", "10.0.0.2"), True),
    ],
)
def test_monarch_uses_tcp_only_between_machines(node_addrs, tcp):
    launch = make_launch(master_addr=node_addrs[0], node_addrs=node_addrs)
    for env in envs_of("monarch", Layout(nodes=2, procs_per_node=1), launch):
        assert ("HYPERACTOR_MESH_DEFAULT_TRANSPORT" in env) is tcp
        if tcp:
            assert env["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] == "tcp"


def test_framework_table_is_consistent():
    for key, framework in FRAMEWORKS.items():
        assert framework.name == (key or "spmd")
        assert get_framework(key) is framework
        if framework.package is not None:
            assert framework.install  # a missing package comes with a way to install it
        if framework.single_controller:
            assert framework.one_per_node
        if framework.service is not None:
            assert framework.one_per_node


# -- GPUs -----------------------------------------------------------------------------------


def test_gpu_env_gives_each_local_rank_its_own_block():
    launch = make_launch(gpus_per_worker=2, visible_gpus=("4", "5", "6", "7"))
    assert gpu_env(0, launch) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert gpu_env(1, launch) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    one_each = make_launch(gpus_per_worker=1, visible_gpus=("3", "1"))
    assert [gpu_env(i, one_each) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "3"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]


def test_no_gpu_variable_without_gpus_per_worker():
    launch = make_launch(gpus_per_worker=0, visible_gpus=("0", "1"))
    assert gpu_env(0, launch) == {}
    for env in envs_of("torch", Layout(nodes=2, procs_per_node=2), launch):
        assert "CUDA_VISIBLE_DEVICES" not in env  # workers inherit the controller's view


def test_worker_env_puts_each_rank_on_its_gpus():
    launch = make_launch(gpus_per_worker=1, visible_gpus=("0", "1"))
    envs = envs_of("torch", Layout(nodes=2, procs_per_node=2), launch)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "0", "1"]


@given(
    visible=st.lists(st.integers(0, 63), min_size=1, max_size=16, unique=True).map(
        lambda ids: tuple(str(i) for i in ids)
    ),
    gpus_per_worker=st.integers(1, 16),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_gpu_blocks_are_disjoint_and_drawn_from_the_visible_gpus(visible, gpus_per_worker, data):
    max_procs = len(visible) // gpus_per_worker
    if max_procs == 0:
        with pytest.raises(ValueError):
            check_gpus(gpus_per_worker, 1, visible)
        return
    procs = data.draw(st.integers(1, max_procs))
    check_gpus(gpus_per_worker, procs, visible)  # enough GPUs: accepted
    launch = make_launch(gpus_per_worker=gpus_per_worker, visible_gpus=visible)
    blocks = [gpu_env(i, launch)["CUDA_VISIBLE_DEVICES"].split(",") for i in range(procs)]
    assert all(len(block) == gpus_per_worker for block in blocks)
    used = [gpu for block in blocks for gpu in block]
    assert len(set(used)) == len(used)  # no GPU shared by two workers
    assert used == list(visible[: len(used)])  # in the order they are visible


def test_check_gpus_names_needed_and_visible_counts():
    with pytest.raises(ValueError) as info:
        check_gpus(2, 2, ("0", "1", "2"))
    message = str(info.value)
    assert "gpus_per_worker=2" in message
    assert "needs 4 GPUs" in message
    assert "3 are visible" in message
    with pytest.raises(ValueError, match="0 are visible"):
        check_gpus(1, 1, ())


@pytest.mark.parametrize(
    ("gpus_per_worker", "procs", "visible"),
    [(0, 8, ()), (1, 2, ("0", "1")), (2, 2, ("0", "1", "2", "3")), (3, 1, ("0", "1", "2", "3"))],
)
def test_check_gpus_accepts_enough_gpus(gpus_per_worker, procs, visible):
    check_gpus(gpus_per_worker, procs, visible)  # does not raise


@pytest.mark.parametrize("bad", [-1, 1.5, True, False, "1", None])
def test_check_gpus_rejects_non_integer_or_negative_counts(bad):
    with pytest.raises(ValueError, match="gpus_per_worker"):
        check_gpus(bad, 1, ("0", "1", "2", "3"))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", ()),
        ("0", ("0",)),
        ("0, 2", ("0", "2")),
        ("3,1", ("3", "1")),
        ("0,,1,", ("0", "1")),
        ("GPU-8f2c,GPU-11ab", ("GPU-8f2c", "GPU-11ab")),
    ],
)
def test_parse_visible_gpus(value, expected):
    assert parse_visible_gpus(value) == expected


# -- processes per node --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gpus", "expected"),
    [
        ("torch", 4, 4),
        ("torch", 0, 1),
        ("jax", 8, 8),
        ("jax", 0, 1),
        (None, 4, 1),
        ("spmd", 4, 1),
        ("tensorflow", 4, 1),
        ("ray", 4, 1),
        ("monarch", 4, 1),
    ],
)
def test_auto_procs_per_node(name, gpus, expected):
    assert resolve_procs_per_node("auto", get_framework(name), gpus) == expected


@pytest.mark.parametrize("value", [1, 3, 16])
def test_integer_procs_per_node_pass_through(value):
    for name in FRAMEWORKS:
        assert resolve_procs_per_node(value, get_framework(name), 4) == value


@pytest.mark.parametrize("bad", ["", "Auto", "4", "gpus"])
def test_other_strings_are_not_procs_per_node(bad):
    with pytest.raises(ValueError, match="procs_per_node"):
        resolve_procs_per_node(bad, get_framework("torch"), 2)


# -- framework names and node services ------------------------------------------------------


@pytest.mark.parametrize("bad", ["nope", "Torch", "", ["torch"]])
def test_unknown_framework_lists_the_known_names(bad):
    with pytest.raises(ValueError) as info:
        get_framework(bad)
    message = str(info.value)
    assert repr(bad) in message
    for known in ("'spmd'", "'torch'", "'jax'", "'tensorflow'", "'ray'", "'monarch'"):
        assert known in message


@pytest.mark.parametrize(
    "service",
    [
        NodeService(command=("sleep", "1")),
        NodeService(
            command=("ray", "start", "--block"),
            ready_line="ready",
            ready_port=("10.0.0.2", 9002),
            after=("10.0.0.1", 6379),
            env={"A": "1", "B": ""},
        ),
    ],
)
def test_node_service_json_round_trip(service):
    text = service.to_json()
    assert isinstance(json.loads(text), dict)
    back = NodeService.from_json(text)
    assert back == service
    assert isinstance(back.command, tuple)
    if service.ready_port is not None:
        assert isinstance(back.ready_port, tuple) and isinstance(back.after, tuple)


@pytest.mark.parametrize(
    ("visible", "node_gpus", "layout", "expected"),
    [
        ((), (), Layout(1, 2), [[0], [1]]),  # CPU: one device per process
        (tuple("01234567"), (), Layout(1, 2), [[0, 1, 2, 3], [4, 5, 6, 7]]),  # equal shares
        (tuple("01234567"), (), Layout(1, 1), [list(range(8))]),  # one process: all of them
        (("0",), (), Layout(1, 2), [None, None]),  # fewer GPUs than processes: jax decides
        # simulated nodes: CUDA_VISIBLE_DEVICES holds each node's share, numbered from 0
        (tuple("0123"), ((0, 1), (2, 3)), Layout(2, 1), [[0, 1], [0, 1]]),
    ],
)
def test_jax_local_devices_share_the_nodes_gpus(visible, node_gpus, layout, expected):
    launch = make_launch(visible_gpus=visible, node_gpus=node_gpus)
    got = [jax_local_devices(layout, rank, launch) for rank in range(layout.world_size)]
    assert got == expected
    envs = envs_of("jax", layout, launch)
    for env, devices in zip(envs, expected, strict=True):
        if devices is None:
            assert "JAX_LOCAL_DEVICE_IDS" not in env
        else:
            assert env["JAX_LOCAL_DEVICE_IDS"] == ",".join(map(str, devices))
