"""A group's seats on Ray: each rank's bundle in a placement group, phalanx's own (made for
the group's layout) or the user's (``RayBackend(placement_group=)``), checked before anything
starts and waited for until ready, in rank order (by node, then by bundle).

A layout of several nodes gets one bundle per node, on distinct Ray nodes where the
cluster has enough (``STRICT_SPREAD``); on fewer Ray nodes than it asks (a one-node
development set-up) the nodes are *virtual*, as NeMo-RL's virtual cluster makes them:
``SPREAD``, several of them perhaps on one Ray node, each still a node of the group (its
own ``NODE_RANK``, ports, and the GPUs of its own bundle) -- unless the strategy asked is
``STRICT_SPREAD``, which refuses."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from phalanx.backends.ray.channel import Bundle
from phalanx.backends.ray.placement import (
    bundle_for,
    bundle_shortfall,
    bundles_of_ranks,
    check_bundle_indices,
    order_bundles,
    placement_problem,
)
from phalanx.errors import StartupError
from phalanx.world.layout import Layout

TAKEN_SETTLE = 3.0  # seconds: Ray's view of a placement group's free bundles catches up


@dataclasses.dataclass
class Seats:
    """A reservation: the placement group, whether phalanx made it, what each bundle gives
    a rank (bundle index -> resources), and each rank's seat, in rank order."""

    pg: Any
    own: bool
    resources: dict[int, dict[str, float]]
    seats: list[Bundle]
    # per rank, what makes it one node with the ranks beside it: its Ray node, or for a
    # layout of phalanx's own, its node's bundle (virtual nodes may share a Ray node)
    node_keys: list[str | int] = dataclasses.field(default_factory=list)


def seats_in_own_pg(ray: Any, layout: Layout, *, bundle_for_rank: Any, gpus_per_worker: int,
                    strategy: str, name: str, deadline: float, timeout: float) -> Seats:
    """A placement group of phalanx's own for the layout, ready, and each rank's seat."""
    from ray.util.placement_group import placement_group, remove_placement_group

    per_rank = bundle_for(bundle_for_rank, gpus_per_worker)
    if layout.nodes == 1:  # Ray places every rank: one bundle each, the user's strategy
        bundles = [per_rank] * layout.world_size
        pg_index = list(range(layout.world_size))
    else:  # a layout asked for: one bundle per node, on distinct Ray nodes if there are
        bundles = [{k: v * n for k, v in per_rank.items()} for n in layout.counts]
        pg_index = [layout.node_of(r) for r in range(layout.world_size)]
        alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        if strategy != "STRICT_SPREAD" and placement_problem(bundles, "STRICT_SPREAD", alive):
            strategy = "SPREAD"  # virtual nodes: fewer Ray nodes than the layout's
        else:
            strategy = "STRICT_SPREAD"
    asked = f"{len(bundles)} bundles {bundles[0]} (strategy {strategy})"
    alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    problem = placement_problem(bundles, strategy, alive)
    if problem is not None:
        raise StartupError(f"Ray cannot place {asked}: {problem} (cluster resources: "
                           f"{ray.cluster_resources()})")
    pg = placement_group(bundles, strategy=strategy, name=name)
    try:
        ready = pg.wait(timeout_seconds=_wait_seconds(deadline))
    except BaseException:  # interrupted: nothing is left holding it
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        raise StartupError(
            f"Ray did not place {asked} within {timeout:g} s (available now: "
            f"{ray.available_resources()}; in total: {ray.cluster_resources()}); raise "
            "start_timeout= or free resources"
        )
    table = ray.util.placement_group_table(pg)
    node_of_bundle = [table["bundles_to_node_id"][i] for i in range(len(bundles))]
    seats = [Bundle(pg_index[r], node_id=node_of_bundle[pg_index[r]])
             for r in range(layout.world_size)]
    if layout.nodes == 1:  # rank order: by node, then by bundle
        order = [i for group in order_bundles(node_of_bundle) for i in group]
        seats = [seats[i] for i in order]
        keys: list[str | int] = [seat.node_id for seat in seats]
    else:  # the layout's nodes, virtual ones included
        keys = list(pg_index)
    return Seats(pg, True, dict.fromkeys(range(len(bundles)), per_rank), seats, keys)


def seats_in_user_pg(ray: Any, pg: Any, bundle_indices: list[int] | None, layout: Layout, *,
                     bundle_for_rank: Any, gpus_per_worker: int, deadline: float,
                     timeout: float, first: bool = True,
                     node_of_rank: list[int] | None = None) -> Seats:
    """Each rank's seat in the user's placement group: its bundles checked against the
    group before anything starts, the group waited for until ready, and (``first``: the
    group's first reservation, before any actor of its own holds a bundle) its bundles
    checked to be free. Ranks go by node (nodes in the order of their first bundle), in
    the given order within one; ``node_of_rank`` (a resource pool's) says each rank's node
    instead, nodes that may be virtual (several on one Ray node)."""
    table = ray.util.placement_group_table(pg)
    name = f"placement group {table.get('name') or pg.id.hex()}"
    if table.get("state") == "REMOVED":
        raise StartupError(f"the {name} given as RayBackend(placement_group=) was removed")
    specs = {int(i): dict(spec) for i, spec in table["bundles"].items()}
    try:
        chosen = bundles_of_ranks(layout.world_size, len(specs), bundle_indices)
    except ValueError as exc:
        raise StartupError(f"cannot run the group in the {name}: {exc}") from None
    # each rank takes its whole bundle unless told how much of it
    per_rank = [bundle_for(bundle_for_rank or specs[i], gpus_per_worker) for i in chosen]
    problem = bundle_shortfall(per_rank, chosen, specs)
    if problem is not None:
        raise StartupError(f"cannot run the group in the {name}: {problem}")
    if not pg.wait(timeout_seconds=_wait_seconds(deadline)):
        state = ray.util.placement_group_table(pg).get("state")
        raise StartupError(
            f"the {name} was not ready within {timeout:g} s (state {state}; available "
            f"now: {ray.available_resources()}); raise start_timeout= or free resources")
    busy = _taken(ray, pg.id.hex(), chosen, per_rank, deadline) if first else {}
    if busy:  # Ray would hold the ranks' actors back until start_timeout, then "slow"
        raise StartupError(
            f"the bundles {sorted(busy)} of the {name} are taken (by other actors or "
            f"groups): {'; '.join(busy.values())}; give bundle_indices= of free bundles, "
            "or end what holds them")
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    seats = [Bundle(i, node_id=node_of[i]) for i in chosen]
    if node_of_rank is not None and len(node_of_rank) == len(seats):  # the pool's nodes
        return Seats(pg, False, dict(zip(chosen, per_rank, strict=True)), seats,
                     list(node_of_rank))
    groups = order_bundles([seat.node_id for seat in seats])
    if layout.nodes > 1 and tuple(len(g) for g in groups) != tuple(layout.counts):
        raise StartupError(
            f"the layout asks {list(layout.counts)} ranks per node, but the bundles "
            f"{chosen} of the {name} hold {[len(g) for g in groups]} ranks per node; "
            "with placement_group=, give the world size alone (procs_per_node=N)")
    ordered = [seats[r] for group in groups for r in group]
    return Seats(pg, False, dict(zip(chosen, per_rank, strict=True)), ordered,
                 [seat.node_id for seat in ordered])


def bundles_in_use(available: dict[str, float], pg_hex: str, chosen: list[int],
                   per_rank: list[dict[str, float]]) -> dict[int, str]:
    """The bundles of ``chosen`` (rank i on ``chosen[i]``, asking ``per_rank[i]``) that do
    not have what their ranks ask free now -> what each lacks. Ray accounts a placement
    group's bundles as resources of their own, ``CPU_group_<i>_<pg id>``."""
    asked: dict[int, dict[str, float]] = {}
    for index, need in zip(chosen, per_rank, strict=True):
        mine = asked.setdefault(index, {})
        for key, amount in need.items():
            mine[key] = mine.get(key, 0.0) + amount
    busy = {}
    for index, need in asked.items():
        lacks = {key: amount for key, amount in need.items() if amount and
                 available.get(f"{key}_group_{index}_{pg_hex}", 0.0) + 1e-9 < amount}
        if lacks:
            busy[index] = f"bundle {index} has " + ", ".join(
                f"{available.get(f'{k}_group_{index}_{pg_hex}', 0.0):g} of {v:g} {k} free"
                for k, v in lacks.items())
    return busy


def _taken(ray: Any, pg_hex: str, chosen: list[int], per_rank: list[dict[str, float]],
           deadline: float) -> dict[int, str]:
    """:func:`bundles_in_use` as Ray tells it: a bundle whose resources look used is asked
    again for up to TAKEN_SETTLE s (Ray's view of what is free lags a placement group just
    made, and leaves out what is used up: a free bundle shows within that)."""
    settle = min(time.monotonic() + TAKEN_SETTLE, deadline)
    while True:
        busy = bundles_in_use(ray.available_resources(), pg_hex, chosen, per_rank)
        if not busy or time.monotonic() >= settle:
            return busy
        time.sleep(0.2)


def _wait_seconds(deadline: float) -> int:
    """Whole seconds (at least one) until ``deadline``, for Ray's placement-group wait."""
    return max(1, int(deadline - time.monotonic() + 0.999))


def check_placement_group(pg: Any, indices: Any) -> list[int] | None:
    """``placement_group=`` and ``bundle_indices=`` checked before anything is sent: a
    PlacementGroup, and distinct indices of its bundles (their range once Ray says how many
    it has, if this process did not make it)."""
    if pg is None:
        if indices is not None:
            raise ValueError("bundle_indices= names bundles of a placement group: give it as "
                             "placement_group=")
        return None
    if not _is_placement_group(pg):
        raise TypeError("placement_group must be a Ray placement group (from "
                        f"ray.util.placement_group(...)), got {type(pg).__name__}: {pg!r}")
    if pg.id.is_nil():
        raise ValueError("placement_group is Ray's empty placement group: give one made by "
                         "ray.util.placement_group(...)")
    cache = pg.bundle_cache  # known here when this process made it: no need to ask Ray
    return check_bundle_indices(indices, len(cache) if cache else None)


def _is_placement_group(pg: object) -> bool:
    try:
        from ray.util.placement_group import PlacementGroup
    except ImportError:  # pragma: no cover - no Ray, so no placement group either
        return False
    return isinstance(pg, PlacementGroup)
