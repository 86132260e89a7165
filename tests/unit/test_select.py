"""``workers=`` selections resolve to ranks without touching any process."""

from __future__ import annotations

import pytest

from phalanx.world.selection import select_ranks

ALIVE = [True, False, True, True]  # rank 1 is dead


def test_all_includes_dead_ranks_so_the_caller_can_report_them():
    assert select_ranks("all", ALIVE) == [0, 1, 2, 3]


def test_ready_skips_dead_ranks():
    assert select_ranks("ready", ALIVE) == [0, 2, 3]
    assert select_ranks("ready", [False, False]) == []


def test_any_is_the_first_live_rank():
    assert select_ranks("any", ALIVE) == [0]
    assert select_ranks("any", [False, False, True]) == [2]
    assert select_ranks("any", [False, False]) == []


def test_explicit_ranks_come_back_sorted_and_keep_dead_ones():
    assert select_ranks([3, 1], ALIVE) == [1, 3]
    assert select_ranks((2,), ALIVE) == [2]
    assert select_ranks(1, ALIVE) == [1]
    assert select_ranks([], ALIVE) == []


@pytest.mark.parametrize("workers", ["everyone", "ALL", ""])
def test_unknown_selection_names_raise_value_error(workers):
    with pytest.raises(ValueError, match=repr(workers)):
        select_ranks(workers, ALIVE)


@pytest.mark.parametrize("workers", [[4], [-1], 4, [0, 9]])
def test_ranks_outside_the_group_raise_value_error(workers):
    with pytest.raises(ValueError, match="outside"):
        select_ranks(workers, ALIVE)


def test_a_rank_named_twice_raises_value_error():
    with pytest.raises(ValueError, match="twice"):
        select_ranks([2, 2], ALIVE)


@pytest.mark.parametrize("workers", [[1.0], [True], ["0"], [None], True])
def test_non_integer_ranks_raise_type_error(workers):
    with pytest.raises(TypeError):
        select_ranks(workers, ALIVE)
