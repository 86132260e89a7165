"""The ray backend's placement rules, pure (no Ray, no I/O): one rank's bundle, why a request
could never be placed, the rank order over bundles, and Ray's account of a death in one
line. Tested without a cluster (tests/unit/test_ray_placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRANSPORTS = ("auto", "direct", "ray")


def relays(address: str | None, transport: str) -> bool:
    """Whether calls travel as Ray calls (pure): asked for, or a Ray Client driver, which
    the cluster's nodes cannot connect back to."""
    if transport == "auto":
        return isinstance(address, str) and address.startswith("ray://")
    return transport == "ray"


def check_resources(resources: Mapping[str, float] | None) -> dict[str, float] | None:
    if resources is None:
        return None
    if not isinstance(resources, Mapping):
        raise TypeError(f"resources_per_worker must be a dict such as {{'CPU': 1}}, "
                        f"got {type(resources).__name__}")
    for key, value in resources.items():
        if not isinstance(key, str) or isinstance(value, bool) \
                or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"resources_per_worker entries must be name -> non-negative "
                             f"number, got {key!r}: {value!r}")
    return dict(resources)


def bundle_for(resources: Mapping[str, float] | None, gpus_per_worker: int) -> dict[str, float]:
    """One rank's placement-group bundle (pure): the resources asked, else one CPU (and
    ``gpus_per_worker`` GPUs)."""
    bundle = dict(resources) if resources else {"CPU": 1.0}
    if gpus_per_worker and "GPU" not in bundle:
        bundle["GPU"] = float(gpus_per_worker)
    return {k: float(v) for k, v in bundle.items() if v}


def placement_problem(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why no amount of waiting could place ``bundles`` on a cluster whose nodes have
    ``nodes`` total resources (pure); None when it could fit once resources free up."""

    def fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in bundle.items())

    def total(items: Sequence[Mapping[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for item in items:
            for k, v in item.items():
                out[k] = out.get(k, 0.0) + v
        return out

    if not nodes:
        return "the cluster has no alive nodes"
    for bundle in bundles:
        if not any(fits(bundle, node) for node in nodes):
            return f"no node can hold one bundle {dict(bundle)}"
    need = total(bundles)
    if strategy == "STRICT_PACK" and not any(fits(need, node) for node in nodes):
        return f"STRICT_PACK needs {need} on one node and no node has that much"
    if strategy == "STRICT_SPREAD":
        able = sum(1 for node in nodes if fits(bundles[0], node))
        if able < len(bundles):
            return (f"STRICT_SPREAD needs {len(bundles)} distinct nodes that can each hold "
                    f"{dict(bundles[0])}; the cluster has {able}")
    if not fits(need, total(nodes)):
        return f"the whole cluster has {total(nodes)}, less than the {need} asked"
    return None


def order_bundles(bundle_nodes: Sequence[str]) -> list[list[int]]:
    """Bundle indices grouped by node (pure): nodes in the order of their first bundle,
    bundles in index order -- the rank order."""
    groups: dict[str, list[int]] = {}
    for index, node_id in enumerate(bundle_nodes):
        groups.setdefault(node_id, []).append(index)
    return list(groups.values())


def describe_ray_error(exc: BaseException) -> str:
    """A one-line account of how Ray says an actor died (pure): the sentence of its message
    that gives the reason, with the worker's exit type and detail when Ray has them."""
    text = " ".join(str(exc).split())
    lowered = text.lower()
    unreachable = lowered.find("could not connect back to the controller")
    if unreachable >= 0:  # the rank's node cannot reach this process: say how to go on
        hint = "transport='ray')"
        end = lowered.find(hint, unreachable)
        return "the rank " + text[unreachable:end + len(hint) if end >= 0 else None]
    if "killed by `ray.kill`" in lowered or "killed by ray.kill" in lowered:
        return "Ray: the actor was killed with ray.kill()"
    if type(exc).__name__ == "OutOfMemoryError" or "due to memory pressure" in lowered:
        return "Ray: the node ran out of memory and Ray's memory monitor killed the actor"
    if "its node has died" in lowered or "node died" in lowered:
        return "Ray: the actor's node died"
    marker = lowered.find("the actor is dead because")
    if marker >= 0:
        sentence = text[marker:].split(". ", 1)[0]
        detail = ""
        kind = lowered.find("worker exit type:")
        if kind >= 0:
            detail = " (" + text[kind:].split(". ", 1)[0] + ")"
        return f"Ray: {sentence[0].lower()}{sentence[1:]}{detail}"
    if "unavailable" in lowered:
        return "Ray: the actor is unreachable (its node may have failed)"
    first = text.split(". ", 1)[0]
    return f"Ray: {type(exc).__name__}: {first[:200]}"
