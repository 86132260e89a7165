"""The Ray backend's put objects: Ray's object store, read where the ranks run.

``share`` puts the object's pickle and buffers into Ray's object store once
(``ray.put``). A rank that runs in its actor's Ray worker (the usual case) is told the
reference (its id and owner: :func:`phalanx.rank.shared.ray_location`) and reads it with
``ray.get`` from its node's object store: Ray moves the bytes to each node once, and the
rank's arrays are views of the store's memory, with no copy. The controller holds the
reference until the object is freed; a rank's views keep their pages after that, as
Ray's own do.

An object whose views must be writable (a call's own arguments, torch tensors), and
every object for a rank in a process of its own (``framework="ray"``, or relayed: a
child of its actor, no Ray worker of this cluster), goes through its node instead: on
each Ray node that runs such ranks, a :class:`NodeStore` actor (no CPU, pinned to the
node, one per node for the group's life) resolves the reference and writes the bytes
into a shared-memory block, held by the node side's one holder
(:class:`phalanx.node.shm.Holder`), that those ranks map (copy-on-write where writable).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.backends.ray import session as ray_session
from phalanx.errors import PhalanxError
from phalanx.node import shm
from phalanx.rank.shared import ray_location
from phalanx.wire import protocol
from phalanx.wire.memfd import Location

logger = logging.getLogger(__name__)

STORE_TIMEOUT = 120.0  # seconds for a node's store to start and take an object


class NodeStore:
    """A Ray actor holding one node's copies of a group's put objects (the node side's
    one holder, :class:`phalanx.node.shm.Holder`)."""

    def __init__(self) -> None:
        self._objects = shm.Holder()

    def hold(self, ref_id: int, writable: bool, parts: list[Any]) -> Location:
        """Write the object (its parts, resolved from Ray's store) into a block here;
        where the node's ranks find it."""
        return self._objects.hold(ref_id, "", parts, writable=writable)

    def drop(self, ref_id: int) -> None:
        self._objects.drop(ref_id)

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node now."""
        from phalanx.node.machine import pick_free_ports

        return pick_free_ports(host, count)


class RayShares:
    """Which objects are in Ray's store, and which node's store holds each, where."""

    def __init__(self, ray: Any, prefix: str, namespace: str | None,
                 runtime_env: Mapping[str, Any] | None) -> None:
        self._ray = ray
        self._prefix, self._namespace, self._runtime_env = prefix, namespace, runtime_env
        self._stores: dict[str, Any] = {}  # Ray node id -> its NodeStore actor
        self._objects: dict[int, Any] = {}  # ref id -> its ray.ObjectRef in Ray's store
        self._held: dict[tuple[int, str], Location] = {}  # (ref id, node id) -> location
        self._lock = threading.Lock()

    def share(self, obj: Any, channels: Sequence[Any], node_of: Callable[[Any], str],
              fetch: Callable[[], list[Any] | None] = lambda: None) -> None:
        """Put the object into Ray's store once (from its segments, else from ``fetch()``:
        the controller's own copy); tell each channel's rank where to read it."""
        ray = self._ray
        import numpy

        with self._lock:
            data = self._objects.get(obj.id)
            if data is None:
                parts = obj.segments if obj.segments is not None else fetch()
                if parts is None:
                    return  # freed meanwhile
                data = ray.put([numpy.frombuffer(s, numpy.uint8) for s in parts])
                self._objects[obj.id] = data
                obj.segments = None  # Ray's store has it now
        by_node: dict[str, list[Any]] = {}
        direct = []
        writable = obj.private or obj.tensors  # copy-on-write mappings of a node's block
        for channel in channels:
            if getattr(channel, "ray_worker", False) and not writable:
                direct.append(channel)
            else:
                by_node.setdefault(node_of(channel), []).append(channel)
        if direct:
            location = ray_location(data)  # the controller holds data until freed
            for channel in direct:
                channel.send(protocol.share_frame(channel.rank, obj.id, obj.token, location))
        if not by_node:
            return
        asked = {}
        for node_id in by_node:
            if (obj.id, node_id) not in self._held:
                asked[node_id] = self._store(node_id).hold.remote(obj.id, obj.tensors, data)
        try:
            where = ray.get(list(asked.values()), timeout=STORE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - Ray's errors have no common base
            raise PhalanxError(f"a Ray node could not hold {obj.label} ({obj.nbytes} bytes): "
                               f"{type(exc).__name__}: {exc}") from None
        for node_id, location in zip(asked, where, strict=True):
            self._held[(obj.id, node_id)] = location
        for node_id, on_node in by_node.items():
            location = self._held[(obj.id, node_id)]
            for channel in on_node:
                channel.send(protocol.share_frame(channel.rank, obj.id, obj.token, location))

    def segments(self, ref_id: int) -> list[Any] | None:
        """Object ``ref_id``'s pickle and buffers, read from Ray's store (None: freed)."""
        with self._lock:
            data = self._objects.get(ref_id)
        return None if data is None else list(self._ray.get(data))

    def unshare(self, obj: Any, channels: Sequence[Any]) -> None:
        with self._lock:
            self._objects.pop(obj.id, None)  # Ray frees it with its last reference
            nodes = [node for (ref_id, node) in self._held if ref_id == obj.id]
            for node_id in nodes:
                del self._held[(obj.id, node_id)]
        for channel in channels:
            channel.send(protocol.unshare_frame(channel.rank, obj.id))
        for node_id in nodes:
            store = self._stores.get(node_id)
            if store is not None:
                store.drop.remote(obj.id)

    def free_port(self, node_id: str, host: str, timeout: float) -> int:
        """A port free now on the node (asked of its store actor)."""
        try:
            ports: list[int] = self._ray.get(self._store(node_id).free_ports.remote(host, 1),
                                             timeout=timeout)
            return ports[0]
        except Exception as exc:  # noqa: BLE001 - Ray's errors have no common base
            raise PhalanxError(f"could not find a free port on Ray node {node_id[:12]}: "
                               f"{type(exc).__name__}: {exc}") from None

    def _store(self, node_id: str) -> Any:
        store = self._stores.get(node_id)
        if store is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options: dict[str, Any] = {
                "num_cpus": 0, "max_concurrency": 4,
                "name": f"{self._prefix}-store{len(self._stores)}",
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
            if self._namespace is not None:
                options["namespace"] = self._namespace
            if self._runtime_env is not None:
                options["runtime_env"] = dict(self._runtime_env)
            store = ray_session.remote_class(NodeStore).options(**options).remote()
            self._stores[node_id] = store
        return store

    def close(self) -> None:
        """Kill every store (their blocks go with them)."""
        stores, self._stores = list(self._stores.values()), {}
        self._objects.clear()
        self._held.clear()
        for store in stores:
            try:
                self._ray.kill(store, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
