"""The controller side: ``WorkerGroup`` and the parts it is made of.

:mod:`.group` is the public class. It holds its parts by composition; each owns its own
state behind a small, documented interface, and none touches another's fields::

    Gate            lifecycle.py   open or closed
    Dispatcher      dispatch.py    the event pump: channels' events to futures, deaths
    RankTable       ranks.py       every rank's entry and its state machine (RankState);
                                   workers= selections
    SharedObjects   shared.py      put() objects and the calls that hold them
    MethodNames     methods.py     the worker object's methods (and group.train.call())
    Sender          calls.py       the one place calls are encoded and sent
    Starter         startup.py     placement, nodes, launches; starting and retiring ranks
    Mesh            meshcalls.py   the mesh, dp leaders, call_sharded's plans; map payloads
    Watcher         watch.py       health(), stacks(), startup_report(), send_signal()
    Watchdog        watchdog.py    the supervision thread: silences, stragglers
    Membership      membership.py  the backend's nodes changing; resize()
    Lifecycle       lifecycle.py   recreate(), restart(), reload(), the teardown

:mod:`.futures` holds a call's results (``GroupFuture``, ``RankFuture``, ``StreamFuture``,
``ShardedFuture``) with their completion side (``Completion``), which the dispatcher and
the other parts complete them through. :mod:`.injection` is ``inject_fault``;
:mod:`.spmd` runs a plain function on a group. :mod:`.observe` lets a trace
(:mod:`.trace`, ``group.trace()``) or a dashboard watch a group's calls.

May import: :mod:`phalanx.backends` (through :mod:`phalanx.backends.base`, the boundary,
and the factory), and every layer below. Imported only by the launcher, the dashboard, the
CLI and the public API.
"""
