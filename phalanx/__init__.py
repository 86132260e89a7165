"""phalanx: launch, drive and supervise a group of distributed worker processes.

Layers (a module imports only from layers below its own)::

    api        __init__ (this file), spmd, group
    runtime    dispatch, futures, backends/*, node, logs, worker
    transport  wire
    pure       errors, config, frameworks, console

The pure layer does no process or socket I/O and is tested without spawning anything.
"""

from phalanx.errors import (
    CallTimeout,
    GroupClosed,
    PhalanxError,
    ProcessFailure,
    SerializationError,
    StartupError,
    WorkerDied,
    WorkerError,
)
from phalanx.futures import GroupFuture, RankFuture
from phalanx.group import RankHealth, WorkerGroup
from phalanx.spmd import spmd

__version__ = "0.1.0"

__all__ = [
    "CallTimeout",
    "GroupClosed",
    "GroupFuture",
    "PhalanxError",
    "ProcessFailure",
    "RankFuture",
    "RankHealth",
    "SerializationError",
    "StartupError",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
    "__version__",
    "spmd",
]
