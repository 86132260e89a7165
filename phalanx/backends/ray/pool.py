"""A resource pool on Ray: one placement group, a bundle per slot.

:func:`reserve_slots` makes the placement group (``STRICT_PACK`` for a one-node pool;
``PACK`` for several, then checked to hold the asked slots per node: Ray has no way to
ask "these bundles together, those apart" in one group) and waits until it is ready. A
group placed on the pool is a :class:`~phalanx.backends.ray.backend.RayBackend` in that
placement group (``placement_group=``, ``bundle_indices=`` its slots' bundles), each rank
taking ``1/colocate`` of its bundle: colocated groups' rank i share bundle i, so Ray gives
them the same GPUs. The pool removes the placement group when it closes, never before.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.backends.ray import session as ray_session
from phalanx.backends.ray.placement import order_bundles, placement_problem
from phalanx.errors import StartupError

if TYPE_CHECKING:
    from phalanx.backends.ray.backend import RayBackend
    from phalanx.world.pools import PoolSlot

logger = logging.getLogger(__name__)


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
        return type(self._template)(**settings)  # a fresh one, configured as the pool's

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement_group)
        except Exception as exc:  # noqa: BLE001 - Ray gone already: so is the group
            logger.debug("could not remove the pool's placement group: %s", exc)
        self._lease.release()


def _fraction(amount: float, share: float) -> float:
    """``share`` of a bundle's ``amount``, rounded down to Ray's unit (so colocated ranks
    never ask more than the bundle holds)."""
    return int(amount * share * 10_000) / 10_000


def reserve_slots(template: RayBackend, counts: Sequence[int], gpus: int,
                  resources: Mapping[str, float], timeout: float) -> RaySlots:
    """The pool's placement group, ready, with ``counts[n]`` slots on the n-th node;
    StartupError naming what is short when Ray cannot place it."""
    lease = ray_session.acquire(template.address, namespace=template.namespace,
                                runtime_env=template.runtime_env, min_cpus=sum(counts))
    try:
        return _reserve(template, lease, counts, gpus, resources, timeout)
    except BaseException:
        lease.release()
        raise


def _reserve(template: RayBackend, lease: ray_session.Lease, counts: Sequence[int], gpus: int,
             resources: Mapping[str, float], timeout: float) -> RaySlots:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1.0, **{k: float(v) for k, v in resources.items()}}
    if gpus:
        bundle["GPU"] = float(gpus)
    bundle = {k: v for k, v in bundle.items() if v}
    total = sum(counts)
    strategy = "STRICT_PACK" if len(counts) == 1 else "PACK"
    asked = f"{total} bundles {bundle} ({list(counts)} per node, strategy {strategy})"
    problem = placement_problem([bundle] * total, strategy,
                                [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    if problem is not None:
        raise StartupError(f"Ray cannot place a resource pool of {asked}: {problem} "
                           f"(cluster resources: {ray.cluster_resources()})")
    pg = placement_group([bundle] * total, strategy=strategy,
                         name=f"phalanx-pool-{secrets.token_hex(4)}")
    began = time.monotonic()
    if not pg.wait(timeout_seconds=timeout):
        remove_placement_group(pg)
        raise StartupError(f"Ray did not place the resource pool of {asked} within "
                           f"{timeout:g} s (available now: {ray.available_resources()})")
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    groups = order_bundles([node_of[i] for i in range(total)])
    got = [len(g) for g in groups]
    if len(counts) > 1 and got != list(counts):
        remove_placement_group(pg)
        raise StartupError(f"Ray placed the resource pool's bundles {got} per node, not the "
                           f"{list(counts)} asked; give a one-node pool, or nodes whose "
                           "resources (GPUs) make Ray place the bundles so")
    logger.info("resource pool placement group ready in %.2f s: %s", time.monotonic() - began,
                asked)
    return RaySlots(template, pg, bundle, [b for group in groups for b in group], lease)
