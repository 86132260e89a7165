"""torchrun's worker variables and error files, as ``phalanx run`` makes and reads them."""

from __future__ import annotations

import json

from phalanx.launcher.elastic import elastic_env, error_file, read_error_file
from phalanx.world.layout import Layout


def test_group_and_role_variables_follow_the_layout():
    common, per_rank = elastic_env(Layout.of([2, 1]), run_id="job7", max_restarts=3,
                                   attempt=1, role="trainer", error_dir="/e", environ={})
    assert common == {
        "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "trainer", "ROLE_WORLD_SIZE": "3",
        "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert [per_rank[r]["GROUP_RANK"] for r in range(3)] == ["0", "0", "1"]
    assert [per_rank[r]["ROLE_RANK"] for r in range(3)] == ["0", "1", "2"]
    assert per_rank[2]["TORCHELASTIC_ERROR_FILE"] == "/e/2/error.json" == error_file("/e", 2)


def test_a_users_own_nccl_setting_is_left_alone_and_error_files_are_optional():
    common, per_rank = elastic_env(Layout.of([1]), run_id="r", max_restarts=0, attempt=0,
                                   environ={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in common
    assert "TORCHELASTIC_ERROR_FILE" not in per_rank[0]


def test_an_error_file_as_torch_record_writes_it(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {
        "message": "ValueError: empty", "extraInfo": {"py_callstack": "Traceback...",
                                                      "timestamp": "1"}}}))
    assert read_error_file(str(path)) == ("ValueError: empty", "Traceback...")


def test_missing_broken_or_odd_error_files_read_as_what_they_hold(tmp_path):
    assert read_error_file(str(tmp_path / "none.json")) is None
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert read_error_file(str(broken)) is None
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "killed by the scheduler"}))
    assert read_error_file(str(plain)) == ("killed by the scheduler", None)
    assert read_error_file(str(tmp_path)) is None  # a directory
