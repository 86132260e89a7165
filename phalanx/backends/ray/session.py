"""This process's connection to Ray, shared by every Ray-backed group in it.

phalanx stops only what it started: a Ray the user connected (``ray.init()`` before the
first group) is used and left alone; a connection phalanx made -- to the cluster that
``address`` or ``RAY_ADDRESS`` names, or to a local Ray it started -- is closed once the
last group using it has shut down.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_users = 0  # groups using a connection phalanx made
_owned = False


class Lease:
    """One group's use of the connection; :meth:`release` it once."""

    def __init__(self, owned: bool) -> None:
        self._owned = owned
        self._released = False

    def release(self) -> None:
        global _users, _owned
        if self._released:
            return
        self._released = True
        if not self._owned:
            return
        import ray

        with _lock:
            _users -= 1
            if _users == 0 and _owned:
                _owned = False
                logger.info("disconnecting from the Ray phalanx connected to")
                ray.shutdown()


def acquire(
    address: str | None,
    *,
    namespace: str | None,
    runtime_env: Mapping[str, Any] | None,
    min_cpus: int,
) -> Lease:
    """Use the current Ray connection, or make one. A local Ray started here gets at least
    ``min_cpus`` CPUs, so that a group's one-CPU bundles fit on a small machine."""
    global _users, _owned
    try:
        import ray
    except ImportError as exc:
        from phalanx.errors import FrameworkNotInstalled

        raise FrameworkNotInstalled("ray", "ray", "pip install 'phalanx[ray]'") from exc
    with _lock:
        if ray.is_initialized():
            if _owned:
                _users += 1
            return Lease(owned=_owned)
        options: dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
        if runtime_env is not None:
            options["runtime_env"] = dict(runtime_env)
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # a local Ray of our own, without the dashboard (seconds of start-up)
            # ("local": ray.init() alone would join any Ray running on this machine)
            options.update(address="local", num_cpus=max(os.cpu_count() or 1, min_cpus),
                           include_dashboard=False)
        else:
            options["address"] = address
        logger.info("connecting to Ray (%s)", address or os.environ.get("RAY_ADDRESS") or "local")
        ray.init(**options)
        _owned = True
        _users = 1
        return Lease(owned=True)


def driver_address(ray: Any) -> str:
    """The address by which the cluster's nodes reach this process: that of the Ray node
    it runs on, as Ray knows it (the node's ``NodeManagerAddress``, which is also what
    every other node reaches that node's raylet at; 127.0.0.1 when Ray runs there), not
    whatever address the host would use outward."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
                address: str = node["NodeManagerAddress"]
                return address
    except Exception as exc:  # noqa: BLE001 - Ray's own answer below
        logger.debug("the driver's Ray node was not found: %s", exc)
    logger.debug("the driver's node is not in Ray's node table; using Ray's node address")
    ip: str = ray.util.get_node_ip_address()
    return ip


def remote_class(cls: type) -> Any:
    """``ray.remote(cls)``, made once per Ray connection: each new one exports the class
    to the cluster again (tens of milliseconds per actor started)."""
    import ray

    # Ray has no public name for "this connection": its worker's core worker is made anew by
    # each ray.init(), and set on the worker at connect (so absent from the Worker's type)
    worker: Any = ray._private.worker.global_worker  # noqa: SLF001 - see above
    key = (cls, id(worker.core_worker))
    made = _remotes.get(key)
    if made is None:
        made = _remotes[key] = ray.remote(cls)
    return made


_remotes: dict[tuple[type, int], Any] = {}  # (class, connection) -> its ActorClass
