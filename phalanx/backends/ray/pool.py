"""A resource pool on Ray: one placement group, a bundle per slot.

:func:`reserve_slots` makes the placement group (``STRICT_PACK`` for a one-node pool;
``PACK`` for several, then checked to hold the asked slots per node: Ray has no way to
ask "these bundles together, those apart" in one group) and waits until it is ready. A
group placed on the pool is a :class:`~phalanx.backends.ray.backend.RayBackend` in that
placement group (``placement_group=``, ``bundle_indices=`` its slots' bundles), each rank
taking ``1/colocate`` of its bundle: colocated groups' rank i share bundle i, so Ray gives
them the same GPUs. The pool removes the placement group when it closes, never before.

What this controller's pools hold is booked here (:data:`_HELD`): a pool that Ray cannot
place now because the controller's own pools hold what it lacks is refused at once,
naming them, instead of waiting out its timeout for resources that will not come back
while they live. A shortage of anything else (another job's, a node still to come) is
waited for, as Ray does.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.backends.ray import session as ray_session
from phalanx.backends.ray.placement import (
    order_bundles,
    placement_problem,
    total_resources,
    virtual_nodes,
)
from phalanx.errors import StartupError

if TYPE_CHECKING:
    from phalanx.backends.ray.backend import RayBackend
    from phalanx.world.pools import PoolSlot

logger = logging.getLogger(__name__)

# This process's pools on Ray: placement group id -> (pool name, what its bundles hold).
# One book for the process, as every pool it makes draws on the same cluster.
_HELD: dict[str, tuple[str, dict[str, float]]] = {}
_HELD_LOCK = threading.Lock()


def _text(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"


def shortage(ray: Any, need: Mapping[str, float]) -> dict[str, float]:
    """What of ``need`` the cluster does not have free now."""
    free = ray.available_resources()
    return {k: v - free.get(k, 0.0) for k, v in need.items() if v > free.get(k, 0.0) + 1e-9}


def held_by_pools(short: Mapping[str, float]) -> list[str]:
    """This controller's pools holding some of ``short``: "pool-1 (holds 2 GPU)"."""
    with _HELD_LOCK:
        held = list(_HELD.values())
    return [f"{name} (holds {_text({k: v for k, v in has.items() if k in short})})"
            for name, has in held if any(k in short for k in has)]


class RaySlots:
    """A pool's placement group, and the bundle of each slot (slots go node by node)."""

    gpus_per_worker = 0  # Ray hands out the bundles' GPUs itself

    def __init__(self, template: RayBackend, pg: Any, bundle: dict[str, float],
                 bundles: list[int], lease: ray_session.Lease) -> None:
        self._template = template
        self.placement_group = pg
        self.bundle = bundle
        self.bundles = bundles  # slot index -> bundle index
        self._lease = lease
        self._released = False

    def backend_for(self, slots: Sequence[PoolSlot], share: float) -> RayBackend:
        settings = self._template.settings()
        settings.update(placement_group=self.placement_group,
                        bundle_indices=[self.bundles[s.index] for s in slots],
                        resources_per_worker={k: _fraction(v, share)
                                              for k, v in self.bundle.items()})
        backend = type(self._template)(**settings)  # a fresh one, configured as the pool's
        backend.place_nodes([s.node for s in slots])  # the pool's nodes (virtual ones too)
        return backend

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement_group)
        except Exception as exc:  # noqa: BLE001 - Ray gone already: so is the group
            logger.debug("could not remove the pool's placement group: %s", exc)
        with _HELD_LOCK:
            _HELD.pop(self.placement_group.id.hex(), None)
        self._lease.release()


def _fraction(amount: float, share: float) -> float:
    """``share`` of a bundle's ``amount``, rounded down to Ray's unit (so colocated ranks
    never ask more than the bundle holds)."""
    return int(amount * share * 10_000) / 10_000


def reserve_slots(template: RayBackend, counts: Sequence[int], gpus: int,
                  resources: Mapping[str, float], timeout: float,
                  holder: str = "a pool") -> RaySlots:
    """The pool's placement group, ready, with ``counts[n]`` slots on the n-th node;
    StartupError naming what is short (and the controller's pools holding it) when Ray
    cannot place it; ``holder``: the pool's name."""
    lease = ray_session.acquire(template.address, namespace=template.namespace,
                                runtime_env=template.runtime_env, min_cpus=sum(counts))
    try:
        return _reserve(template, lease, counts, gpus, resources, timeout, holder)
    except BaseException:
        lease.release()
        raise


def _reserve(template: RayBackend, lease: ray_session.Lease, counts: Sequence[int], gpus: int,
             resources: Mapping[str, float], timeout: float, holder: str) -> RaySlots:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1.0, **{k: float(v) for k, v in resources.items()}}
    if gpus:
        bundle["GPU"] = float(gpus)
    bundle = {k: v for k, v in bundle.items() if v}
    total = sum(counts)
    strategy = "STRICT_PACK" if len(counts) == 1 else "PACK"
    asked = f"{total} bundles {bundle} ({list(counts)} per node, strategy {strategy})"
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
    problem = placement_problem([bundle] * total, strategy,
                                [n["Resources"] for n in nodes if n.get("Alive")])
    if problem is not None:
        everything = ray.cluster_resources()  # type: ignore[no-untyped-call]  # as nodes()
        raise StartupError(f"Ray cannot place {holder}, a resource pool of {asked}: "
                           f"{problem} (cluster resources: {everything})")
    need = total_resources([bundle] * total)
    short = shortage(ray, need)
    holders = held_by_pools(short)
    if short and holders:  # held by this controller's own pools: it would wait for nothing
        raise StartupError(f"Ray cannot place {holder} ({asked}) now: the cluster lacks "
                           f"{_text(short)}, held by {'; '.join(holders)}; close one of "
                           "them first, or ask for fewer")
    pg = placement_group([bundle] * total, strategy=strategy,
                         name=f"phalanx-{holder}-{secrets.token_hex(4)}")
    began = time.monotonic()
    if not pg.wait(timeout_seconds=timeout):
        remove_placement_group(pg)
        short = shortage(ray, need)
        holders = held_by_pools(short)
        raise StartupError(f"Ray did not place {holder} ({asked}) within {timeout:g} s: "
                           f"the cluster lacks {_text(short) if short else 'nothing now'}"
                           + (f" (held by {'; '.join(holders)})" if holders else ""))
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    placed = [node_of[i] for i in range(total)]
    groups = order_bundles(placed)
    got = [len(g) for g in groups]
    if len(counts) > 1 and got != list(counts):
        if virtual_nodes(placed, counts) is None:
            remove_placement_group(pg)
            raise StartupError(
                f"Ray placed {holder}'s bundles {got} per node, not the {list(counts)} "
                "asked, and not so that each of its nodes is on one Ray node; give a "
                "one-node pool, or nodes whose resources (GPUs) make Ray place the bundles so")
        logger.info("%s: %d nodes as virtual nodes on %d Ray node(s) (%s per Ray node)",
                    holder, len(counts), len(groups), got)
    with _HELD_LOCK:
        _HELD[pg.id.hex()] = (holder, need)
    logger.info("%s's placement group ready in %.2f s: %s", holder, time.monotonic() - began,
                asked)
    return RaySlots(template, pg, bundle, [b for group in groups for b in group], lease)
