"""The variables torchrun (torch.distributed.elastic) gives its workers, for ``phalanx run``
(pure).

Scripts and libraries written for torchrun detect it by these names:
``torch.distributed.is_torchelastic_launched()`` looks for ``TORCHELASTIC_RUN_ID``;
PyTorch Lightning and accelerate read ``GROUP_RANK`` and ``ROLE_*``. With them, such a
program cannot tell that phalanx started it.

torchrun's agent also hosts the rendezvous store itself and says so with
``TORCHELASTIC_USE_AGENT_STORE=True``; ``phalanx run`` hosts none, so it sets ``False`` and
rank 0's ``init_process_group`` hosts the store at ``MASTER_PORT``, as it does without an
agent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.world.layout import Layout

ERROR_FILE = "error.json"  # in each rank's directory: where torch's @record writes


def elastic_env(
    layout: Layout,
    *,
    run_id: str,
    max_restarts: int,
    attempt: int,
    role: str = "default",
    error_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The variables every rank shares, and each rank's own (``rank -> variables``).

    ``attempt`` is the attempt's number, from 0: torchrun's restart count.
    ``error_dir``: the attempt's directory; rank ``r`` gets ``error_dir/r/error.json`` as
    ``TORCHELASTIC_ERROR_FILE``, as torchrun lays it out. ``environ`` is the launcher's
    environment: a variable the user set there is left alone.
    """
    environ = os.environ if environ is None else environ
    common = {
        "GROUP_WORLD_SIZE": str(layout.nodes),
        "ROLE_NAME": role,
        "ROLE_WORLD_SIZE": str(layout.world_size),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in environ:
        common["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    per_rank = {}
    for rank in range(layout.world_size):
        own = {"GROUP_RANK": str(layout.node_of(rank)), "ROLE_RANK": str(rank)}
        if error_dir is not None:
            own["TORCHELASTIC_ERROR_FILE"] = error_file(error_dir, rank)
        per_rank[rank] = own
    return common, per_rank


def error_file(error_dir: str, rank: int) -> str:
    """Where rank ``rank`` of an attempt writes its error record."""
    return os.path.join(error_dir, str(rank), ERROR_FILE)


def read_error_file(path: str) -> tuple[str, str | None] | None:
    """What torch's ``@record`` wrote for a failed rank: its message and Python traceback;
    None when the rank wrote nothing there (or something unreadable)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):  # {"message": {"message": ..., "extraInfo": {...}}}
        extra = message.get("extraInfo") or {}
        text = message.get("message")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        if isinstance(text, str):
            return text, stack if isinstance(stack, str) else None
    if isinstance(message, str):  # a record of another shape: its message alone
        return message, None
    return None
