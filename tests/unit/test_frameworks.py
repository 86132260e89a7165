"""Layout, per-rank environment and environment merging: pure functions, no processes."""

from __future__ import annotations

import pytest

from phalanx.config import Settings
from phalanx.frameworks import GENERIC_VARS, Layout, check_framework, merge_env, rank_env


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


def test_check_framework():
    check_framework(None)
    check_framework("spmd")
    with pytest.raises(ValueError, match="nonsense"):
        check_framework("nonsense")


def test_settings_read_from_the_environment_once():
    assert Settings.from_env({}).start_timeout > 0
    settings = Settings.from_env({"PHALANX_START_TIMEOUT": "7.5", "PHALANX_PROGRESS": "0"})
    assert settings.start_timeout == 7.5 and settings.progress is False
    assert Settings.from_env({"PHALANX_PROGRESS": "1"}).progress is True
    assert Settings.from_env({}).progress is None
    with pytest.raises(ValueError, match="PHALANX_START_TIMEOUT"):
        Settings.from_env({"PHALANX_START_TIMEOUT": "soon"})
