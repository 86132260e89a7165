"""Call options apart from the method's arguments (``group.options(...)``), the refusal of
an option keyword that is also the method's, the group's state, and the order of the
checks, on every backend."""

from __future__ import annotations

import threading
import time

import pytest

import phalanx as px
from tests import helpers
from tests.workers import OptionNamed


@pytest.fixture(scope="module")
def group(backend):
    with helpers.long_lived_group(OptionNamed, nodes=2, procs_per_node=2, backend=backend,
                                  mesh={"dp": 2, "tp": 2}, echo_output=False) as group:
        yield group


def calls_made(group) -> int:
    return sum(group.call("count"))


def test_a_view_passes_every_keyword_to_the_method(group):
    view = group.options(timeout=30, workers=[1, 2])
    out = view.call("f", 1, timeout=5, keep="mine", workers=7, method="m")
    assert [o["rank"] for o in out] == [1, 2]
    assert all(o == {"x": 1, "timeout": 5, "keep": "mine", "workers": 7, "method": "m",
                     "rank": o["rank"]} for o in out)
    # every form of the view
    assert view.call_async("f", timeout=1).result(30)[0]["timeout"] == 1
    assert view.call_one(3, "f", keep=False)["keep"] is False
    assert [o["workers"] for o in view.map("f", workers=["a", "b"])] == ["a", "b"]
    assert [o["timeout"] for o in view.map_async("f", timeout=[1, 2]).result(30)] == [1, 2]
    streamed = list(view.call_stream("f", keep=1))
    assert sorted(rank for rank, _ in streamed) == [1, 2]
    assert all(item["keep"] == 1 for _, item in streamed)
    assert view.f.call(timeout=9)[0]["timeout"] == 9  # attribute style, on a view too


def test_the_option_keywords_still_work_where_the_method_has_no_such_parameter(group):
    assert group.call("plain", 3, timeout=30, workers=[0, 3]) == [3, 3]
    assert group.call_one(2, "plain", 4, timeout=30) == 4
    refs = group.call("plain", 5, keep=True, workers=[1])
    assert isinstance(refs[0], px.ResultRef)
    assert refs[0].get(timeout=30) == 5


@pytest.mark.parametrize("form, option", [
    ("call", {"timeout": 5}), ("call", {"keep": True}), ("call", {"workers": [0]}),
    ("call_async", {"keep": False}), ("map", {"timeout": 5}),
    ("call_stream", {"timeout": 5}), ("call_one", {"timeout": 5}),
])
def test_an_option_keyword_that_is_also_the_methods_is_refused_before_anything_is_sent(
        group, form, option):
    before = calls_made(group)
    name = next(iter(option))
    with pytest.raises(TypeError, match=f"f\\(\\) has a parameter of that name.*"
                                        f"group.options\\({name}="):
        if form == "call_one":
            group.call_one(0, "f", **option)
        else:
            getattr(group, form)("f", **option)
    assert calls_made(group) == before


@pytest.mark.parametrize("options, error, words", [
    ({"keep": "mine"}, TypeError, "keep must be True or False"),
    ({"timeout": "5"}, TypeError, "timeout must be a number"),
    ({"timeout": -1}, ValueError, "zero or more"),
    ({"workers": "some"}, ValueError, "'all', 'any', 'ready'"),
    ({"workers": [0, "1"]}, TypeError, "integer ranks"),
    ({"rank0_only_axes": "tp"}, TypeError, "list of axis names"),
    ({"common_kwargs": [1]}, TypeError, "mapping"),
    ({"retries": 3}, TypeError, "'retries' is not a call option"),
])
def test_option_values_are_checked_when_given(group, options, error, words):
    before = calls_made(group)
    with pytest.raises(error, match=words):
        group.options(**options)
    name = next(iter(options))
    if name in ("keep", "timeout", "workers"):  # the convenience keyword: checked too
        with pytest.raises(error, match=words):
            group.call("plain", **options)
    assert calls_made(group) == before


def test_a_slice_takes_options_but_not_workers(group):
    part = group.slice(dp=1)
    assert [o["rank"] for o in part.options(timeout=30).call("f", workers=1)] == [2, 3]
    assert part.options(rank0_only_axes=["tp"]).call("plain", 1) == [1]
    with pytest.raises(TypeError, match="a slice calls its own ranks"):
        part.options(workers=[2])
    # on a slice, workers= was never an option: it is the method's
    assert [o["workers"] for o in part.call("f", workers="mine")] == ["mine", "mine"]


def test_unknown_attributes_list_the_methods(group):
    with pytest.raises(AttributeError, match="no method 'trian'; its methods: count, f, "
                                             "plain, sleep"):
        group.trian.call()
    with pytest.raises(AttributeError):
        group.options().trian.call()


def test_the_group_state(group):
    assert group.state is px.GroupState.RUNNING
    assert not group.closed


def test_a_closed_group_says_so_before_anything_else(backend):
    group = px.WorkerGroup(OptionNamed, backend=backend, echo_output=False)
    view = group.options(timeout=5)
    group.shutdown()
    assert group.state is px.GroupState.CLOSED and group.closed
    for attempt in (lambda: group.call("nope"), lambda: view.call("nope"),
                    lambda: group.call("f", workers=[99]), lambda: group.recreate(0),
                    lambda: group.restart()):
        with pytest.raises(px.GroupClosed):
            attempt()
    assert "closed" in repr(group)


def test_recreate_and_shutdown_from_two_threads_run_one_after_the_other(backend):
    group = px.WorkerGroup(OptionNamed, procs_per_node=2, backend=backend,
                           echo_output=False)
    seen: list[px.GroupState] = []
    errors: list[BaseException] = []

    def recreate() -> None:
        try:
            group.recreate(1, timeout=60)
        except BaseException as exc:  # checked below
            errors.append(exc)

    try:
        worker = threading.Thread(target=recreate)
        worker.start()
        while worker.is_alive() and not seen:  # ends with the thread, bounded above
            if group.state is px.GroupState.REPLACING:
                seen.append(group.state)
            time.sleep(0.001)
        group.shutdown(timeout=60)
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert group.state is px.GroupState.CLOSED
        # whichever came first, the other did not cut it short: the recreate either
        # finished (its rank was ready) or was refused outright as the group was closed
        assert not errors or isinstance(errors[0], px.GroupClosed), errors
    finally:
        group.shutdown()


def test_a_value_equal_to_a_good_one_is_still_checked(group):
    """The group keeps the records its calls' option keywords made: a value equal to one
    it made a record for, but of another type, is refused all the same."""
    assert group.call("plain", 1, workers=[1], keep=False) == [1]
    assert group.call("plain", 1, workers=[1]) == [1]
    with pytest.raises(TypeError, match="integer ranks"):
        group.call("plain", 1, workers=[True])
    with pytest.raises(TypeError, match="keep must be True or False"):
        group.call("plain", 1, workers=[1], keep=0)
