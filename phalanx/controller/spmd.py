"""``spmd(fn)``: run a plain function on every rank, like torchrun, but get the values back."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from phalanx.controller.group import WorkerGroup
from phalanx.controller.names import GROUP_NAMES, base_of, check_name
from phalanx.world.frameworks import ENV_MONARCH_WORKERS


class FunctionRunner:
    """The worker object behind :func:`spmd`: holds the function, runs it on request."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def run(self, *args: Any, **kwargs: Any) -> Any:
        workers = os.environ.get(ENV_MONARCH_WORKERS)
        if workers and "allocator" not in kwargs and _takes_allocator(self.fn):
            # framework="monarch": the addresses of every node's worker loop, for
            # monarch.actor.attach_to_workers(workers=allocator, ...)
            kwargs["allocator"] = workers.split(",")
        return self.fn(*args, **kwargs)


def _takes_allocator(fn: Callable[..., Any]) -> bool:
    try:
        return "allocator" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def spmd(fn: Callable[..., Any], **group_options: Any) -> Callable[..., list[Any]]:
    """Wrap ``fn`` so that calling the wrapper starts a group, runs ``fn(*args, **kwargs)``
    on every rank, shuts the group down and returns the list of results in rank order.

    ``group_options`` are those of :class:`WorkerGroup` (``nodes``, ``procs_per_node``,
    ``env``, ``framework``, ``gpus_per_worker``, ``name``, ...)::

        losses = px.spmd(train, procs_per_node=4)(lr=0.1)

    Each call's group is named after ``fn`` (``train``, ``train-2``, ...) unless ``name=``
    names it; a name is checked here, before anything starts.

    With a single-controller framework (``"ray"``, ``"monarch"``) the function runs on
    node 0 only, over the cluster the group started, and the list holds its one result.
    """
    if not callable(fn):
        raise TypeError(f"spmd() needs a function, got {fn!r}")
    timeout = group_options.pop("timeout", None)
    name = group_options.pop("name", None)
    if name is not None:
        check_name(name)

    @functools.wraps(fn)
    def run_on_all_ranks(*args: Any, **kwargs: Any) -> list[Any]:
        # the group is the function's: named after it, not after the runner that holds it
        named = GROUP_NAMES.unused(base_of(fn)) if name is None else name
        with WorkerGroup(FunctionRunner, args=(fn,), name=named, **group_options) as group:
            workers = [0] if group.single_controller else "all"
            return group.call("run", *args, workers=workers, timeout=timeout, **kwargs)

    return run_on_all_ranks
