"""phalanx: launch, drive and supervise a group of distributed worker processes.

The public API is this module's ``__all__``; everything else is reached through it. The
packages are layers, and a package imports only the layers below its own (import-linter
contracts in pyproject.toml keep it so; docs/architecture.md is the map)::

    cli/          the ``phalanx`` command (``python -m phalanx``)
    launcher/     ``phalanx run``: attempts, the restart policy, multi-node, its report
    controller/   WorkerGroup and its parts, the dispatcher, futures, put()
    backends/     base (the node-level boundary); local, ray/, cluster/ (each alone)
    node/ rank/   the node side (spawning, supervision, shared memory) and what runs
                  inside a rank (the worker runtime); neither imports the other
    output/       rank-prefixed logs, collapsing, the console
    wire/         streams, frames, pickling, the protocol, the handshake
    world/        pure: layouts, framework recipes, sharding, selection, placement rules
    errors, config, options, dumps   the exception tree, settings, checks (pure)

The pure layer does no process or socket I/O and is tested without spawning anything.
"""

from __future__ import annotations

import importlib

from phalanx.version import __version__

# typing.TYPE_CHECKING without importing typing: the node supervisor imports this package,
# and its start is on a rank's critical path.
TYPE_CHECKING = False

# Public name -> defining module. Loaded on first use, so that a worker process (which
# imports phalanx.rank.runtime) does not pay for the controller's modules at start-up.
_EXPORTS = {
    "CallOptions": "phalanx.world.calloptions",
    "CallView": "phalanx.controller.callforms",
    "DebuggerUnavailable": "phalanx.errors",
    "GroupState": "phalanx.controller.state",
    "LocalBackend": "phalanx.backends.local",
    "NonIntegerLayoutError": "phalanx.errors",
    "RemoteTraceback": "phalanx.errors",
    "StreamFuture": "phalanx.controller.futures",
    "UnknownAxisError": "phalanx.errors",
    "VersionMismatch": "phalanx.errors",
    "AuthenticationError": "phalanx.errors",
    "CallTimeout": "phalanx.errors",
    "CollectiveStuck": "phalanx.errors",
    "DevicesTaken": "phalanx.errors",
    "ClusterBackend": "phalanx.backends.cluster.backend",
    "FrameworkNotInstalled": "phalanx.errors",
    "GroupClosed": "phalanx.errors",
    "MembershipChanged": "phalanx.errors",
    "MembershipEvent": "phalanx.errors",
    "NodeInfo": "phalanx.errors",
    "ObjectFreed": "phalanx.errors",
    "ObjectLost": "phalanx.errors",
    "ObjectRef": "phalanx.controller.refs",
    "RefState": "phalanx.controller.refs",
    "ResultRef": "phalanx.controller.refs",
    "SliceRef": "phalanx.controller.refs",
    "chunk": "phalanx.controller.chunks",
    "keep": "phalanx.rank.kept",
    "GroupSlice": "phalanx.controller.slices",
    "ResourcePool": "phalanx.controller.pool",
    "InjectedFault": "phalanx.rank.faults",
    "PhalanxError": "phalanx.errors",
    "ProcessFailure": "phalanx.errors",
    "QuorumTimeout": "phalanx.errors",
    "SerializationError": "phalanx.errors",
    "StartupError": "phalanx.errors",
    "WorkerDied": "phalanx.errors",
    "WorkerError": "phalanx.errors",
    "WorkerUnresponsive": "phalanx.errors",
    "StackReport": "phalanx.controller.watch",
    "StartupReport": "phalanx.controller.watch",
    "GroupFuture": "phalanx.controller.futures",
    "NamedSharding": "phalanx.world.sharding",
    "Region": "phalanx.world.syncplan",
    "Shard": "phalanx.world.syncplan",
    "ShardedFuture": "phalanx.controller.futures",
    "RankFuture": "phalanx.controller.futures",
    "RankHealth": "phalanx.controller.watch",
    "RayBackend": "phalanx.backends.ray.backend",
    "SlurmBackend": "phalanx.backends.cluster.slurm",
    "WorkerGroup": "phalanx.controller.group",
    "breakpoint": "phalanx.rank.debugger",
    "rendezvous": "phalanx.controller.joint",
    "joint_store": "phalanx.rank.joint",
    "spmd": "phalanx.controller.spmd",
    "WeightSync": "phalanx.controller.weightsync",
    "weight_sync": "phalanx.controller.weightsync",
    "Trace": "phalanx.controller.trace",
    "trace": "phalanx.controller.trace",
    "Dashboard": "phalanx.monitor.server",
    "dashboard": "phalanx.monitor.server",
    "Orphaned": "phalanx.controller.detached",
    "attach": "phalanx.controller.attach",
    "attached": "phalanx.controller.attach",
}

__all__ = [
    "AuthenticationError",
    "CallOptions",
    "CallTimeout",
    "CallView",
    "ClusterBackend",
    "CollectiveStuck",
    "Dashboard",
    "DebuggerUnavailable",
    "DevicesTaken",
    "FrameworkNotInstalled",
    "GroupClosed",
    "GroupFuture",
    "GroupSlice",
    "GroupState",
    "InjectedFault",
    "LocalBackend",
    "MembershipChanged",
    "MembershipEvent",
    "NamedSharding",
    "NodeInfo",
    "NonIntegerLayoutError",
    "ObjectFreed",
    "ObjectLost",
    "ObjectRef",
    "Orphaned",
    "PhalanxError",
    "ProcessFailure",
    "QuorumTimeout",
    "RankFuture",
    "RankHealth",
    "RayBackend",
    "RefState",
    "Region",
    "RemoteTraceback",
    "ResourcePool",
    "ResultRef",
    "SerializationError",
    "Shard",
    "ShardedFuture",
    "SliceRef",
    "SlurmBackend",
    "StackReport",
    "StartupError",
    "StartupReport",
    "StreamFuture",
    "Trace",
    "UnknownAxisError",
    "VersionMismatch",
    "WeightSync",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
    "WorkerUnresponsive",
    "__version__",
    "attach",
    "attached",
    "breakpoint",
    "chunk",
    "dashboard",
    "joint_store",
    "keep",
    "rendezvous",
    "spmd",
    "trace",
    "weight_sync",
]

if TYPE_CHECKING:
    from phalanx.backends.cluster.backend import ClusterBackend
    from phalanx.backends.cluster.slurm import SlurmBackend
    from phalanx.backends.local import LocalBackend
    from phalanx.backends.ray.backend import RayBackend
    from phalanx.controller.attach import attach, attached
    from phalanx.controller.callforms import CallView
    from phalanx.controller.chunks import chunk
    from phalanx.controller.detached import Orphaned
    from phalanx.controller.futures import GroupFuture, RankFuture, ShardedFuture, StreamFuture
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.joint import rendezvous
    from phalanx.controller.pool import ResourcePool
    from phalanx.controller.refs import ObjectRef, RefState, ResultRef, SliceRef
    from phalanx.controller.slices import GroupSlice
    from phalanx.controller.spmd import spmd
    from phalanx.controller.state import GroupState
    from phalanx.controller.trace import Trace, trace
    from phalanx.controller.watch import RankHealth, StackReport, StartupReport
    from phalanx.controller.weightsync import WeightSync, weight_sync
    from phalanx.errors import (
        AuthenticationError,
        CallTimeout,
        CollectiveStuck,
        DebuggerUnavailable,
        DevicesTaken,
        FrameworkNotInstalled,
        GroupClosed,
        MembershipChanged,
        MembershipEvent,
        NodeInfo,
        NonIntegerLayoutError,
        ObjectFreed,
        ObjectLost,
        PhalanxError,
        ProcessFailure,
        QuorumTimeout,
        RemoteTraceback,
        SerializationError,
        StartupError,
        UnknownAxisError,
        VersionMismatch,
        WorkerDied,
        WorkerError,
        WorkerUnresponsive,
    )
    from phalanx.monitor.server import Dashboard, dashboard
    from phalanx.rank.debugger import breakpoint
    from phalanx.rank.faults import InjectedFault
    from phalanx.rank.joint import joint_store
    from phalanx.rank.kept import keep
    from phalanx.world.calloptions import CallOptions
    from phalanx.world.sharding import NamedSharding
    from phalanx.world.syncplan import Region, Shard


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
