"""``PHALANX_RANK_SCHED``: how a rank is scheduled
(:func:`phalanx.world.layout.rank_scheduling`)."""

from __future__ import annotations

import pytest

from phalanx.world.layout import rank_scheduling


def test_ranks_are_batch_tasks_by_default_and_normal_on_request():
    assert rank_scheduling({}) == "batch"
    assert rank_scheduling({"PHALANX_RANK_SCHED": "batch"}) == "batch"
    assert rank_scheduling({"PHALANX_RANK_SCHED": "normal"}) == "normal"


@pytest.mark.parametrize("value", ["", "BATCH", "idle", "fifo"])
def test_another_value_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"PHALANX_RANK_SCHED=.*expected one of 'batch', 'normal'"):
        rank_scheduling({"PHALANX_RANK_SCHED": value})
