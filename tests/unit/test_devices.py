"""The book of a machine's GPUs (pure): no device is handed to two holders, refusals name
the holders and what is free, giving back frees exactly a holder's devices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.errors import DevicesTaken, PhalanxError
from phalanx.world.devices import DeviceBook

GPUS = ("0", "1", "2", "3")


def test_devices_go_to_one_holder_in_order_and_come_back():
    book = DeviceBook()
    assert book.take(2, "pool-1", GPUS) == ("0", "1")
    assert book.take(1, "group 1 (P, 1 rank)", GPUS) == ("2",)
    assert book.free(GPUS) == ["3"]
    book.give_back("pool-1")
    assert book.free(GPUS) == ["0", "1", "3"]
    assert book.holders() == {"group 1 (P, 1 rank)": ["2"]}
    assert book.take(0, "anyone", GPUS) == ()


def test_a_refusal_names_the_holders_and_what_is_free_and_takes_nothing():
    book = DeviceBook()
    book.take(3, "pool-1", GPUS)
    with pytest.raises(DevicesTaken) as info:
        book.take(2, "pool-2", GPUS)
    assert isinstance(info.value, PhalanxError) and isinstance(info.value, ValueError)
    assert str(info.value) == (
        "pool-2 needs 2 GPU(s) of 0, 1, 2, 3, but only 1 is free (3): pool-1 holds 0, 1, 2; "
        "close the holder first, or ask for fewer")
    assert book.free(GPUS) == ["3"]  # nothing half-taken


def test_only_the_ids_asked_among_count():
    book = DeviceBook()
    book.take(1, "node 0's group", ("0", "1"))
    assert book.take(2, "node 1's group", ("2", "3")) == ("2", "3")


@given(st.lists(st.tuples(st.sampled_from(["take", "give"]), st.integers(0, 5),
                          st.integers(0, 3)), max_size=40))
def test_no_device_is_ever_held_twice(steps):
    book = DeviceBook()
    held: dict[str, set[str]] = {}
    for op, count, who in steps:
        holder = f"holder {who}"
        if op == "take":
            try:
                held.setdefault(holder, set()).update(book.take(count, holder, GPUS))
            except DevicesTaken:
                assert len(book.free(GPUS)) < count
        else:
            book.give_back(holder)
            held.pop(holder, None)
        taken = [d for devices in held.values() for d in devices]
        assert len(taken) == len(set(taken))  # never one device to two holders
        assert sorted(taken) == sorted(set(GPUS) - set(book.free(GPUS)))


def test_a_node_refuses_a_holder_name_that_could_forge_lines_for_other_controllers():
    """A holder's name reaches other controllers' refusals and ``/health``: a name with a
    line break or terminal escape takes nothing."""
    from phalanx.backends.cluster.agent.devices import NodeDevices

    node = NodeDevices(["0", "1"])
    owner = object()
    for name in ("pool\nphalanx: forged line", "pool\x1b[2J", "pool\u202e"):
        answer = node.take(owner, 1, name)
        assert "refused" in answer and "must be printable text" in answer["refused"], answer
        assert "\n" not in answer["refused"] and "\x1b" not in answer["refused"]
    assert node.take(owner, 2, "pool-1 of the controller on h, pid 42") == {"gpus": ["0", "1"]}
