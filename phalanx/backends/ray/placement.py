"""The ray backend's placement rules, pure (no Ray, no I/O): one rank's bundle, why a request
could never be placed, the rank order over bundles, the bundles of a user's placement group
a group takes, what a ``@ray.remote`` class's options mean for a group, and Ray's account
of a death in one line. Tested without a cluster (tests/unit/test_ray_placement.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRANSPORTS = ("auto", "direct", "ray")
RESOURCE_UNIT = 0.0001  # the finest amount of a resource Ray counts


def relays(address: str | None, transport: str) -> bool:
    """Whether calls travel as Ray calls (pure): asked for, or a Ray Client driver, which
    the cluster's nodes cannot connect back to."""
    if transport == "auto":
        return isinstance(address, str) and address.startswith("ray://")
    return transport == "ray"


def check_resources(resources: Mapping[str, object] | None) -> dict[str, float] | None:
    """``resources_per_worker=`` (pure): None, or a copy of the dict once each entry is
    checked (a name -> a non-negative number Ray can count)."""
    if resources is None:
        return None
    return _checked_resources(resources)


def _checked_resources(resources: Mapping[str, object]) -> dict[str, float]:
    if not isinstance(resources, Mapping):
        raise TypeError(f"resources_per_worker must be a dict such as {{'CPU': 1}}, "
                        f"got {type(resources).__name__}")
    checked: dict[str, float] = {}
    for key, value in resources.items():
        if not isinstance(key, str) or isinstance(value, bool) \
                or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"resources_per_worker entries must be name -> non-negative "
                             f"number, got {key!r}: {value!r}")
        if 0 < value < RESOURCE_UNIT:
            raise ValueError(f"resources_per_worker {key!r}: {value!r} is finer than Ray "
                             f"counts resources ({RESOURCE_UNIT:g})")
        checked[key] = value
    return checked


def check_bundle_indices(indices: object, bundles: int | None) -> list[int] | None:
    """``bundle_indices=`` (pure): None, or a list of distinct bundle indices, each below
    ``bundles`` (the placement group's bundle count, when known here)."""
    if indices is None:
        return None
    if not isinstance(indices, (list, tuple)) or not indices:
        raise TypeError(f"bundle_indices must be a non-empty list of bundle indices, got "
                        f"{indices!r}")
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise ValueError(f"bundle_indices must be non-negative ints, got {bad[0]!r} in "
                         f"{list(indices)}")
    if len(set(indices)) != len(indices):
        twice = sorted({i for i in indices if list(indices).count(i) > 1})
        raise ValueError(f"bundle_indices must be distinct: {twice} appear more than once in "
                         f"{list(indices)}")
    if bundles is not None and max(indices) >= bundles:
        raise ValueError(f"bundle_indices {list(indices)} name bundle {max(indices)}; the "
                         f"placement group has {bundles} bundles (0..{bundles - 1})")
    return list(indices)


def bundles_of_ranks(world_size: int, bundles: int, indices: Sequence[int] | None) -> list[int]:
    """The bundle of each rank, before ranks are put in node order (pure): bundle ``i`` for
    rank ``i``, or ``indices[i]``; ValueError naming both counts when there are too few."""
    chosen = list(range(bundles)) if indices is None else list(indices)
    if indices is not None:
        check_bundle_indices(indices, bundles)
    if world_size > len(chosen):
        which = (f"bundle_indices names {len(chosen)} of its {bundles} bundles"
                 if indices is not None else f"it has {bundles} bundles")
        raise ValueError(f"a group of {world_size} ranks needs {world_size} bundles of the "
                         f"placement group (one per rank); {which}")
    return chosen[:world_size]


def bundle_shortfall(per_rank: Sequence[Mapping[str, float]], bundle_indices: Sequence[int],
                     specs: Mapping[int, Mapping[str, float]]) -> str | None:
    """Why a rank's resources do not fit the bundle it is given (pure), naming what the rank
    asks and what the bundle has; None when every one fits."""
    for asked, index in zip(per_rank, bundle_indices, strict=True):
        has = specs[index]
        short = {k: v for k, v in asked.items() if has.get(k, 0.0) + 1e-9 < v}
        if short:
            return (f"each rank asks {dict(asked)}, but bundle {index} of the placement group "
                    f"has {dict(has)} (short of {sorted(short)})")
    return None


# -- a @ray.remote class as a group's target -----------------------------------------------

# What to write instead of each option of @ray.remote(...) a group cannot take as it is.
_INSTEAD = {
    "max_restarts": "phalanx replaces dead ranks itself: group.recreate(rank), group.restart() "
                    "or `phalanx run --max-restarts`",
    "max_task_retries": "retry the call yourself; a rank's death fails its calls",
    "max_concurrency": "WorkerGroup(concurrency=N)",
    "concurrency_groups": "WorkerGroup(concurrency=N)",
    "name": "RayBackend(name_prefix=...) (each rank's actor gets its own name)",
    "namespace": "RayBackend(namespace=...)",
    "lifetime": "nothing: a group's actors live as long as the group",
    "scheduling_strategy": "RayBackend(placement_group=..., bundle_indices=...) or "
                           "RayBackend(placement_strategy=...)",
    "placement_group": "RayBackend(placement_group=...)",
    "memory": "RayBackend(resources_per_worker={'memory': ...})",
    "accelerator_type": "RayBackend(resources_per_worker={'accelerator_type:<type>': 0.001})",
    "object_store_memory": "nothing: put objects are held by phalanx (group.put)",
}
CLASS_RESOURCES = ("num_cpus", "num_gpus", "resources")
CLASS_OPTIONS = (*CLASS_RESOURCES, "runtime_env")


def class_settings(
    options: Mapping[str, object], class_name: str,
    resources_per_worker: Mapping[str, float] | None, runtime_env: Mapping[str, object] | None,
) -> tuple[dict[str, float] | None, dict[str, object] | None]:
    """What the options of a ``@ray.remote`` class given as a group's target mean for the
    group (pure): its resources per rank and its actors' runtime_env. ``num_cpus``,
    ``num_gpus`` and ``resources`` are one rank's resources (when ``resources_per_worker``
    is not given or says the same), ``runtime_env`` the ranks' (unless the backend's says
    otherwise); any other option is refused, naming it and what to write instead."""
    other = [k for k in options if k not in CLASS_OPTIONS]
    if other:
        key = other[0]
        instead = _INSTEAD.get(key, "remove it")
        raise ValueError(f"@ray.remote({key}=...) of {class_name} has no meaning for a phalanx "
                         f"group: instead, {instead} (a group takes only "
                         f"{', '.join(CLASS_OPTIONS)} from @ray.remote)")
    resources: dict[str, float] | None = None
    if any(options.get(k) is not None for k in CLASS_RESOURCES):
        extra = options.get("resources") or {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"@ray.remote(resources=...) of {class_name} must be a dict, got "
                            f"{extra!r}")
        asked: dict[str, object] = dict(extra)
        if options.get("num_cpus") is not None:
            asked["CPU"] = options["num_cpus"]
        if options.get("num_gpus") is not None:
            asked["GPU"] = options["num_gpus"]
        resources = _checked_resources(asked)
        spelled = ", ".join(f"{k}={options[k]!r}" for k in CLASS_RESOURCES
                            if options.get(k) is not None)
        if resources_per_worker is not None and _amounts(resources) != _amounts(
                resources_per_worker):
            raise ValueError(f"{class_name} asks @ray.remote({spelled}) per rank, but "
                             f"RayBackend(resources_per_worker={dict(resources_per_worker)}) "
                             "asks otherwise: give one of the two")
    if resources_per_worker is not None:
        resources = dict(resources_per_worker)
    asked_env = options.get("runtime_env")
    env: dict[str, object] | None
    if asked_env is not None:
        if not isinstance(asked_env, Mapping):  # ray.remote() itself lets only dicts through
            raise TypeError(f"@ray.remote(runtime_env=...) of {class_name} must be a dict, "
                            f"got {asked_env!r}")
        env = dict(asked_env)
        if runtime_env is not None and dict(runtime_env) != env:
            raise ValueError(f"{class_name} asks @ray.remote(runtime_env={env}), but "
                             f"RayBackend(runtime_env={dict(runtime_env)}) says otherwise: "
                             "give one of the two")
    else:
        env = dict(runtime_env) if runtime_env is not None else None
    return resources, env


def _amounts(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if v}


def bundle_for(resources: Mapping[str, float] | None, gpus_per_worker: int) -> dict[str, float]:
    """One rank's placement-group bundle (pure): the resources asked, else one CPU (and
    ``gpus_per_worker`` GPUs)."""
    bundle = dict(resources) if resources else {"CPU": 1.0}
    if gpus_per_worker and "GPU" not in bundle:
        bundle["GPU"] = float(gpus_per_worker)
    return {k: float(v) for k, v in bundle.items() if v}


def total_resources(items: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The resources of several bundles (or nodes) together (pure)."""
    out: dict[str, float] = {}
    for item in items:
        for k, v in item.items():
            out[k] = out.get(k, 0.0) + v
    return out


def placement_problem(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why no amount of waiting could place ``bundles`` on a cluster whose nodes have
    ``nodes`` total resources (pure); None when it could fit once resources free up."""

    def fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in bundle.items())

    total = total_resources

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


def virtual_nodes(bundle_nodes: Sequence[str], counts: Sequence[int]) -> list[int] | None:
    """The layout's node of each bundle when Ray placed them otherwise than ``counts`` per
    node (pure): bundles in rank order (:func:`order_bundles`), the next ``counts[k]`` of
    them node ``k``'s -- virtual nodes, several perhaps on one Ray node. None when a node so
    made would span two Ray nodes (its ranks could not share a machine)."""
    ordered = [i for group in order_bundles(bundle_nodes) for i in group]
    if len(ordered) != sum(counts):
        return None
    node_of = [0] * len(ordered)
    first = 0
    for node, count in enumerate(counts):
        mine = ordered[first:first + count]
        if len({bundle_nodes[i] for i in mine}) > 1:
            return None
        for i in mine:
            node_of[i] = node
        first += count
    return node_of


def describe_ray_error(exc: BaseException) -> str:
    """A one-line account of how Ray says an actor died (pure): the sentence of its message
    that gives the reason, with the worker's exit type and detail (and exit code) when Ray
    has them."""
    import re

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
            detail = text[kind:].split(". ", 1)[0]
            if "connection error code" in detail.lower():  # Ray saw its socket close
                detail = (detail.split(" Worker exit detail:", 1)[0] + "; the process ended "
                          "without telling Ray why: a signal, os._exit or the kernel's "
                          "out-of-memory killer")
            code = re.search(r"exits? with an exit code (-?\d+)", text[kind:])
            if code:
                detail += f"; exit code {code.group(1)}"
            detail = f" ({detail})"
        return f"Ray: {sentence[0].lower()}{sentence[1:]}{detail}"
    if "unavailable" in lowered:
        return "Ray: the actor is unreachable (its node may have failed)"
    first = text.split(". ", 1)[0]
    return f"Ray: {type(exc).__name__}: {first[:200]}"
