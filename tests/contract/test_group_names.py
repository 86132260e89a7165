"""Group names (``WorkerGroup(..., name=)``), on every backend: the default is the target's
name, numbered when repeated; a given name is what errors, handles and reprs call the
group; a name held by an open group is refused until that group is shut down; a bad name
is refused before any process starts."""

from __future__ import annotations

import re

import psutil
import pytest

import phalanx as px
from phalanx import GroupClosed, StartupError, WorkerDied, WorkerError, WorkerGroup
from tests.workers import FailingConstructor, Probe


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def number(name: str) -> int:
    """Where a default name comes in its base's count: ``Probe`` 1, ``Probe-3`` 3."""
    found = re.fullmatch(r"Probe(?:-(\d+))?", name)
    assert found, f"{name!r} is not a default name of a Probe group"
    return int(found[1] or 1)


def fails_on_purpose(x: int) -> int:
    raise ValueError(f"no {x}")


def test_default_names_are_the_targets_numbered_and_unique(make_group):
    first, second = make_group(Probe), make_group(Probe)
    assert first.name != second.name and number(first.name) < number(second.name)
    assert re.fullmatch(r"Probe-\d+", second.name)
    assert f"<WorkerGroup {second.name} nodes=1" in repr(second)
    with pytest.raises(AttributeError):
        second.name = "other"  # read-only
    future = second.call_async("sleep", 0.0)
    assert f"group {second.name}" in repr(future)
    assert f"rank 0 of group {second.name}" in repr(future.futures[0])
    future.result(timeout=30)
    first.shutdown()  # a default name is never given again, even once its group is closed
    assert number(make_group(Probe).name) > number(second.name)


def test_a_given_name_is_what_errors_and_handles_call_the_group(make_group, ranks):
    group = make_group(Probe, procs_per_node=2, name="policy.v1")
    assert group.name == "policy.v1" and "<WorkerGroup policy.v1 " in repr(group)
    refs = group.call("identity", 7, keep=True)
    assert "rank 1 of group policy.v1" in repr(refs[1])
    with pytest.raises(WorkerError) as raised:
        group.call_one(0, "raise_value_error", "bad input")
    assert "ValueError on rank 0 of group policy.v1 (node 0" in str(raised.value)
    assert raised.value.group == "policy.v1"

    pending = group.call_async("sleep", 60, workers=[1])
    ranks.kill(group, 1, wait=False)
    with pytest.raises(WorkerDied) as died:
        pending.result(timeout=30)
    assert str(died.value).startswith("rank 1 of group policy.v1 (node ")
    assert "sleep()" in str(died.value) and died.value.group == "policy.v1"
    with pytest.raises(WorkerDied, match=r"^rank 1 of group policy\.v1 \(node "):
        group.call("pid", timeout=30)  # known dead now: refused before anything is sent

    with pytest.raises(px.CallTimeout, match=r"on ranks \[0\] of group policy\.v1; "):
        group.call_one(0, "sleep", 5, timeout=0.2)
    group.shutdown(timeout=2)
    with pytest.raises(GroupClosed, match=r"group policy\.v1 has been shut down"):
        group.call("pid")


def test_a_name_in_use_is_refused_until_its_group_is_shut_down(make_group, backend):
    first = make_group(Probe, name="trainer")
    before = children()
    with pytest.raises(ValueError, match="name='trainer' is the name of a group") as info:
        WorkerGroup(Probe, name="trainer", backend=backend, echo_output=False)
    assert "shut that group down first" in str(info.value)
    assert children() <= before  # refused before any process started
    first.shutdown(timeout=2)
    again = make_group(Probe, name="trainer")  # free once its group is shut down
    assert again.name == "trainer" and again.call("rank") == [0]


def test_a_start_that_fails_names_the_group_and_gives_its_name_back(make_group, backend):
    with pytest.raises(StartupError) as info:
        WorkerGroup(FailingConstructor, args=(1,), procs_per_node=2, name="flaky",
                    backend=backend, echo_output=False)
    assert "rank 1 of group flaky (node 0" in str(info.value) and info.value.group == "flaky"
    assert make_group(Probe, name="flaky").name == "flaky"


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "a/b", "naïve", "x" * 65])
def test_bad_names_are_refused_before_any_process_starts(backend, bad):
    before = children()
    with pytest.raises(ValueError, match=r"^name=") as info:  # naming the argument
        WorkerGroup(Probe, name=bad, backend=backend, echo_output=False)
    assert repr(bad[:10])[:-1] in str(info.value)  # and the value
    with pytest.raises(TypeError, match="name must be a str"):
        WorkerGroup(Probe, name=3, backend=backend, echo_output=False)
    with pytest.raises(ValueError, match="name"):
        px.spmd(fails_on_purpose, name=bad, backend=backend)
    assert children() <= before


def test_spmd_groups_are_named_after_their_function_or_given_name(backend):
    with pytest.raises(WorkerError) as default:
        px.spmd(fails_on_purpose, backend=backend, echo_output=False)(1)
    assert re.fullmatch(r"fails_on_purpose(-\d+)?", default.value.group or "")
    assert f"on rank 0 of group {default.value.group} " in str(default.value)
    with pytest.raises(WorkerError, match="on rank 0 of group sweep-7 "):
        px.spmd(fails_on_purpose, backend=backend, echo_output=False, name="sweep-7")(2)


def test_a_pool_books_its_groups_by_name(backend):
    with px.ResourcePool(nodes=1, procs_per_node=2, backend=backend) as pool:
        with WorkerGroup(Probe, pool=pool, name="gen", echo_output=False) as gen:
            assert pool.placed() == {0: ["group gen (2 ranks)"], 1: ["group gen (2 ranks)"]}
            with pytest.raises(ValueError, match="name='gen'"):
                WorkerGroup(Probe, pool=pool, name="gen", echo_output=False)
            assert gen.call("rank") == [0, 1]
        assert pool.placed() == {}
