"""A resource pool's books (phalanx.world.pools), pure: slots, splits, a group's layout on
them, and who sits where."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.world import pools

counts_st = st.lists(st.integers(1, 5), min_size=1, max_size=5)


@given(counts_st)
def test_slots_go_node_by_node_and_number_every_place_once(counts):
    slots = pools.slots_of(counts)
    assert [s.index for s in slots] == list(range(sum(counts)))
    assert [len(g) for g in pools.by_node(slots)] == counts
    assert all(s.local == i for g in pools.by_node(slots) for i, s in enumerate(g))


@given(counts_st, st.data())
def test_splits_are_disjoint_and_in_slot_order(counts, data):
    total = sum(counts)
    sizes = data.draw(st.lists(st.integers(1, total), min_size=1, max_size=4).filter(
        lambda s: sum(s) <= total))
    slots = pools.slots_of(counts)
    assert pools.split_counts(sizes, total) == sizes
    parts, first = [], 0
    for size in sizes:
        parts.append(slots[first:first + size])
        first += size
    flat = [s.index for part in parts for s in part]
    assert flat == list(range(sum(sizes)))  # disjoint, in order, nothing skipped


@given(counts_st, st.data())
def test_a_group_takes_the_first_slots_of_each_node_it_asks(counts, data):
    slots = pools.slots_of(counts)
    nodes = data.draw(st.integers(1, len(counts)))
    want = [data.draw(st.integers(1, c)) for c in counts[:nodes]]
    assert pools.layout_on(slots, nodes, want) == want
    chosen = pools.chosen_slots(slots, want)
    assert [len(g) for g in pools.by_node(chosen)] == want
    assert all(s.local < want[s.node] for s in chosen)
    assert pools.layout_on(slots, None, None) == counts  # the pool's own layout


def test_a_group_that_does_not_fit_is_refused_naming_the_pool_layout():
    slots = pools.slots_of([2, 1])
    with pytest.raises(ValueError, match=r"\[2, 2\] ranks per node does not fit.*\[2, 1\]"):
        pools.layout_on(slots, 2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        pools.layout_on(slots, 3, None)
    with pytest.raises(ValueError, match="gives 2 nodes but nodes=1"):
        pools.layout_on(slots, 1, [1, 1])


@pytest.mark.parametrize("sizes, error", [
    ([], TypeError), ("4", TypeError), ([0], ValueError), ([True], ValueError),
    ([3, 3], ValueError)])
def test_bad_splits_are_refused(sizes, error):
    with pytest.raises(error):
        pools.split_counts(sizes, 4)


@given(st.integers(1, 3), st.lists(st.sampled_from("abcd"), max_size=8))
def test_a_slot_holds_at_most_colocate_groups(colocate, names):
    book = pools.SlotBook(2, colocate)
    slots = pools.slots_of([2])
    placed: list[str] = []
    for name in names:
        if book.full(slots):
            assert len(placed) == colocate
            book.give_back(slots, placed.pop(0))
        book.take(slots, name)
        placed.append(name)
        assert book.placed(slots) == {0: placed, 1: placed}
    for name in list(placed):
        book.give_back(slots, name)
    assert book.placed(slots) == {} and book.groups() == []
