"""A pipelined call's route (:class:`phalanx.controller.callpath.Route`): whatever happens
between two calls -- a death, a rank placed again, the group closed -- a call by its route
sends to the ranks and fails with the errors the whole path would (no process started)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import GroupClosed
from phalanx.controller.callforms import Scope
from phalanx.controller.callpath import CallPath
from phalanx.controller.methods import MethodNames
from phalanx.controller.state import Gate, GroupState
from phalanx.world.calloptions import DEFAULT

WORLD = 3


class Dead(Exception):
    """The table's refusal of a dead rank (WorkerDied, in the group)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} died")
        self.rank = rank


class Table:
    """The rank table's part a call reads: the selection, checked, and its counters."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.alive = [True] * WORLD
        self.version = 0
        self.selections = 0
        self._dispatcher = dispatcher

    def select(self, workers: Any) -> list[int]:
        self.selections += 1
        for rank in workers:
            if not self.alive[rank]:
                raise Dead(rank)
        return list(workers)

    def checked(self, ranks: list[int]) -> list[int]:
        return ranks


class Dispatcher:
    deaths = 0


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int], Any]] = []

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[bytes]:
        return [repr((args, kwargs)).encode()]

    def send_plain(self, method: str, ranks: list[int], payload: Any, workers: Any,
                   keep: bool = False) -> tuple[str, list[int], Any]:
        sent = (method, list(ranks), payload)
        self.sent.append(sent)
        return sent

    send = send_plain


def _path() -> tuple[CallPath, Gate, Table, Dispatcher]:
    gate = Gate("g")
    gate.move(GroupState.RUNNING)
    methods = MethodNames("Probe")
    methods.learn({"step": ["x"]})
    dispatcher = Dispatcher()
    table = Table(dispatcher)
    path = CallPath(gate, methods, table, Sender(), dispatcher)  # type: ignore[arg-type]
    return path, gate, table, dispatcher


def _outcome(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except (Dead, GroupClosed, AttributeError) as exc:
        return type(exc), getattr(exc, "rank", None)


EVENTS = st.lists(st.one_of(
    st.tuples(st.just("call"), st.integers(0, WORLD - 1), st.sampled_from(["step", "nope"])),
    st.tuples(st.just("kill"), st.integers(0, WORLD - 1)),
    st.tuples(st.just("place"), st.integers(0, WORLD - 1)),
    st.tuples(st.just("close"),),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(EVENTS)
def test_a_call_by_its_route_does_what_the_whole_path_does(events):
    path, gate, table, dispatcher = _path()
    scope = Scope(mesh=None)  # type: ignore[arg-type]
    routes: dict[tuple[int, str], Any] = {}
    for event in events:
        if event[0] == "kill" and table.alive[event[1]]:
            table.alive[event[1]] = False
            dispatcher.deaths += 1
        elif event[0] == "place" and not table.alive[event[1]]:
            table.alive[event[1]] = True
            table.version += 1
        elif event[0] == "close" and not gate.shut:
            gate.move(GroupState.CLOSING)
        elif event[0] == "call":
            _, rank, method = event
            options = DEFAULT.with_options({"workers": [rank]})
            route = routes.setdefault((rank, method), path.route(options, scope))
            by_route = _outcome(path.call_routed, route, method, (rank,), {}, scope)
            whole = _outcome(path.call_async, method, (rank,), {}, options, scope)
            assert by_route == whole, event


def test_a_route_selects_once_while_nothing_changes_and_again_after_a_change():
    path, gate, table, dispatcher = _path()
    scope = Scope(mesh=None)  # type: ignore[arg-type]
    route = path.route(DEFAULT.with_options({"workers": [1]}), scope)
    assert route is not None
    for _ in range(5):
        assert path.call_routed(route, "step", (), {}, scope)[1] == [1]
    assert table.selections == 1
    dispatcher.deaths += 1  # another rank died: its selection is checked again
    path.call_routed(route, "step", (), {}, scope)
    path.call_routed(route, "step", (), {}, scope)
    assert table.selections == 2
    table.version += 1  # a rank placed again
    path.call_routed(route, "step", (), {}, scope)
    assert table.selections == 3
    gate.move(GroupState.CLOSING)
    with pytest.raises(GroupClosed):
        path.call_routed(route, "step", (), {}, scope)


def test_only_a_plain_list_of_ranks_gets_a_route():
    path = _path()[0]
    scope = Scope(mesh=None)  # type: ignore[arg-type]
    assert path.route(DEFAULT.with_options({"workers": [0]}), scope) is not None
    for workers in ("ready", "any", "all", 1):
        assert path.route(DEFAULT.with_options({"workers": workers}), scope) is None
    assert path.route(DEFAULT.with_options({"workers": [0], "rank0_only_axes": ["dp"]}),
                      scope) is None
    sliced = Scope(mesh=None, workers=(0, 1), members=frozenset({0, 1}))  # type: ignore[arg-type]
    assert path.route(DEFAULT.with_options({"workers": [0]}), sliced) is None
