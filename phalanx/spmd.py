"""``spmd(fn)``: run a plain function on every rank, like torchrun, but get the values back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from phalanx.group import WorkerGroup


class FunctionRunner:
    """The worker object behind :func:`spmd`: holds the function, runs it on request."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def spmd(fn: Callable[..., Any], **group_options: Any) -> Callable[..., list[Any]]:
    """Wrap ``fn`` so that calling the wrapper starts a group, runs ``fn(*args, **kwargs)``
    on every rank, shuts the group down and returns the list of results in rank order.

    ``group_options`` are those of :class:`WorkerGroup` (``nodes``, ``procs_per_node``,
    ``env``, ``framework``, ...)::

        losses = px.spmd(train, procs_per_node=4)(lr=0.1)
    """
    if not callable(fn):
        raise TypeError(f"spmd() needs a function, got {fn!r}")
    timeout = group_options.pop("timeout", None)

    @functools.wraps(fn)
    def run_on_all_ranks(*args: Any, **kwargs: Any) -> list[Any]:
        with WorkerGroup(FunctionRunner, args=(fn,), **group_options) as group:
            return group.call("run", *args, timeout=timeout, **kwargs)

    return run_on_all_ranks
