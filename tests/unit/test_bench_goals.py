"""``python -m bench.goals``'s one table: the goals of three suites that write them in two
shapes, and the controller's CPU time per call beside each wall-clock ratio."""

from __future__ import annotations

import pytest

from bench.goals import cpu_beside_wall, verdicts


def test_goals_of_both_shapes_are_read_and_skipped_ones_left_out():
    run = {"targets": [
        {"name": "W3 pipelined throughput >= 0.9x pipe_pool", "measure": "ratio",
         "measured": 0.95, "verdict": "PASS"},
        {"name": "W2@4 traced <= 1.1x untraced", "measure": "ratio", "measured": None,
         "verdict": "SKIP"}]}
    handoff = {"targets": [
        {"target": "W11: handles >= 3x faster than through the controller",
         "result": "FAIL", "measured": 2.5, "measure": "ratio"}]}
    torchstart = {"goals": [
        {"name": "W1t@4 phalanx-preload within 1.3x the forkserver floor", "measure": "ratio",
         "measured": 1.1, "verdict": "PASS"}]}
    got = (verdicts("run", run) + verdicts("handoff", handoff)
           + verdicts("torchstart", torchstart))
    assert [(g["suite"], g["verdict"], g["measured"]) for g in got] == [
        ("run", "PASS", 0.95), ("handoff", "FAIL", 2.5), ("torchstart", "PASS", 1.1)]
    assert got[1]["goal"] == "W11: handles >= 3x faster than through the controller"


def test_cpu_per_call_is_shown_beside_the_wall_ratio_where_both_sides_ran():
    rows = [{"key": "W2.noop.4", "values": {"phalanx": 90.0, "pipe_pool": 100.0,
                                            "ray": 2000.0, "phalanx-ray": None}},
            {"key": "W2.cpu.4", "values": {"phalanx": 55.0, "pipe_pool": 50.0,
                                           "ray": 1200.0, "phalanx-ray": 70.0}}]
    lines = cpu_beside_wall({"rows": rows})
    assert len(lines) == 1  # phalanx-ray has no wall figure: no line for it
    assert "phalanx / pipe_pool" in lines[0]
    assert "wall  0.90x" in lines[0] and "= " in lines[0]
    assert lines[0].rstrip().endswith(f"{55.0 / 50.0:5.2f}x")
    assert cpu_beside_wall({}) == []


@pytest.mark.parametrize("payload", [{}, {"targets": []}, {"goals": []}])
def test_a_suite_that_judged_nothing_adds_no_goal(payload):
    assert verdicts("any", payload) == []
