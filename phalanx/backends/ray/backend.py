"""The Ray backend: ranks are Ray actors in a placement group; calls take phalanx's channel.

Ray places the processes (one placement-group bundle per rank), keeps them, and reports how
they died; phalanx does everything else as it does locally. Each actor
(:mod:`phalanx.backends.ray.actor`) connects back to a listener of the controller's over
TCP and proves a per-group secret handed to it through Ray (the handshake also compares
both sides' phalanx versions: a Ray worker of another release is refused), so a call
costs what it costs locally instead of a Ray task's milliseconds (Ray's Compiled Graphs
make the same move). The listener (:class:`~phalanx.backends.ray.channel.Listener`) binds
the address the cluster knows the driver's Ray node by, runs each handshake on its own
thread with its own deadline, caps those in progress, and outlives whatever one
connection does; ranks on this machine connect to a Unix socket of this user's alone.

Reservation (:meth:`RayBackend._reserve`): the placement group, ready within
``start_timeout`` or a :class:`~phalanx.errors.StartupError` saying what was asked and
what the cluster has (a request no node could ever hold fails at once), where each rank
sits (:mod:`phalanx.backends.ray.seats`). A rank's actor is made when the rank launches,
its start left in Ray's key-value store for it (``actor.put_start``: an argument would cost
the actor Ray's serialization context), and starts its rank in its constructor. The
actors of a node on another machine are all made at once, the first to pick that node's
ports, the others to start meanwhile; their starts come at launch the same way.
Ranks are numbered by node, then by bundle; the nodes are the Ray nodes as they are, so
``NODE_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``MASTER_ADDR`` tell the truth on
a real cluster.

The rank runs inside its actor's worker process (:mod:`phalanx.backends.ray.actor`), so
Ray inside a rank is Ray inside an actor. A rank's death reaches the group as soon as its
control stream ends (at once, on any node). Its exit status comes first from the kernel
for a rank on this machine (its actor process watched through a pidfd:
:mod:`phalanx.backends.ray.exits`, there as the stream ends), else from the rank's own
``sys.exit`` or its warden (:mod:`phalanx.node.warden`). A death by a signal is told at
once, with its last output: a ``kill -9`` fails the rank's calls before Ray itself has
learnt of it. Otherwise the bury waits a moment for Ray's account too (``ray.kill``, a
lost node); an account that arrives later (Ray's memory monitor behind a SIGKILL) still
replaces the record kept for the rank. The pure placement rules live in
:mod:`phalanx.backends.ray.placement`.

A detached group (``detached=True``) outlives its driver, which an actor of the driver's
cannot: it runs on agents that are detached Ray actors instead, through a cluster backend
(:mod:`phalanx.backends.ray.detached`), so this backend offers no ``detaching`` of its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx import config
from phalanx.backends.base import Backend, Boot, Channel, Node, RankStart
from phalanx.backends.held import HeldObject
from phalanx.backends.ownblocks import OwnBlocks, maps_blocks_of_here
from phalanx.backends.parts import Capabilities, SlotReservation
from phalanx.backends.ray import session as ray_session
from phalanx.backends.ray.channel import (
    RAY_SHUT_DOWN,
    Bundle,
    ChannelServices,
    Listener,
    RayChannel,
    hand_over_pipes,
    ray_exit_code,
)
from phalanx.backends.ray.exits import ExitWatch
from phalanx.backends.ray.placement import (
    STRATEGIES,
    TRANSPORTS,
    check_resources,
    class_settings,
    describe_ray_error,
    relays,
)
from phalanx.backends.ray.relay import RelayChannel
from phalanx.backends.ray.seats import check_placement_group, seats_in_own_pg, seats_in_user_pg
from phalanx.backends.ray.store import RayShares
from phalanx.errors import StartupError
from phalanx.node import shm
from phalanx.node.machine import pick_free_ports
from phalanx.output import console
from phalanx.output.logs import LogPump, OutputOptions
from phalanx.wire import framing, handshake, protocol
from phalanx.world.layout import Layout

logger = logging.getLogger(__name__)


def _no_auto_init(api: Any) -> Any:
    """Ray's API function ``api`` without its automatic ``ray.init()``: called from the
    watch thread while the user's ``ray.shutdown()`` is under way, ``ray.wait`` would
    otherwise start a new Ray in this process between the check that Ray is up and the
    wait (then fail for ever on the old session's objects). Unwrapped, it raises at once
    when Ray is down, which the watch loop then sees."""
    code = getattr(api, "__code__", None)
    if code is not None and code.co_name == "auto_init_wrapper":
        return getattr(api, "__wrapped__", api)
    return api


class RayBackend(Backend):
    """Run a group's ranks as Ray actors, one placement-group bundle each.

    ``address``: None joins the Ray that ``ray.init()`` already connected or that
    ``RAY_ADDRESS`` names, else starts a local Ray (stopped again once no group uses it);
    ``"auto"`` or ``"host:port"`` joins that cluster. phalanx stops only what it started.
    ``placement_strategy``: ``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
    ``resources_per_worker``: one rank's resources as Ray spells them, fractions included,
    e.g. ``{"CPU": 1}`` (the default), ``{"GPU": 1}`` or ``{"GPU": 0.5, "CPU": 1}``.
    ``placement_group``: a placement group of the user's (``ray.util.placement_group``):
    the ranks go on its bundles, rank ``i`` on bundle ``i`` or on ``bundle_indices[i]``,
    then in node order (ranks of one node contiguous, nodes in the order of their first
    bundle, the given order within a node); phalanx waits for it to be ready within
    ``start_timeout`` but never creates nor removes it, and ``placement_strategy`` does not
    apply. Each rank takes its whole bundle unless ``resources_per_worker`` (or the
    ``@ray.remote`` class's options) says less, so that groups can share bundles.
    A ``@ray.remote`` class as the target runs as the class it wraps; its ``num_cpus``,
    ``num_gpus`` and ``resources`` are the resources per rank, its ``runtime_env`` the
    ranks' (other options are refused). ``runtime_env`` and ``namespace`` are used when
    phalanx connects to Ray (``runtime_env`` also for every actor); actors are named
    ``{name_prefix}-r{rank}-i{incarnation}`` (a fresh name per incarnation).
    ``transport``: ``"direct"`` (each rank connects back to this process), ``"ray"`` (calls
    travel as Ray calls through each rank's actor: for a controller the cluster cannot
    reach), or ``"auto"``: direct, except for a Ray Client (``ray://``) address.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        placement_strategy: str = "PACK",
        resources_per_worker: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        name_prefix: str | None = None,
        transport: str = "auto",
        placement_group: Any = None,
        bundle_indices: Sequence[int] | None = None,
    ) -> None:
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a string or None, got {address!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, "
                             f"got {transport!r}")
        if placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {placement_strategy!r}")
        if runtime_env is not None and not isinstance(runtime_env, Mapping):
            raise TypeError(f"runtime_env must be a dict, got {type(runtime_env).__name__}")
        self.placement_group = placement_group
        self.bundle_indices = check_placement_group(placement_group, bundle_indices)
        self.address = address
        self.placement_strategy = placement_strategy
        self.resources_per_worker = check_resources(resources_per_worker)
        self.runtime_env = dict(runtime_env) if runtime_env is not None else None
        self.namespace = namespace
        self.name_prefix = name_prefix
        self.transport = transport
        # per rank, from resources_per_worker or a @ray.remote target (adopt_target_options)
        self._rank_resources = self.resources_per_worker
        self._actor_env = self.runtime_env  # the rank actors' runtime_env
        self._python: str | None = None  # python=
        self._made_with: dict[int, str | None] = {}  # rank -> what its actor runs
        self._checked: set[str | None] = {None}  # python= checked on this machine
        self._own_pg = False  # whether self._pg is one this backend made (and removes)
        self._seat_resources: dict[int, dict[str, float]] = {}  # bundle index -> per rank
        self._node_of_rank: list[int] | None = None  # a pool's nodes of its ranks
        self._relayed = relays(address, transport)
        self._bundles: list[Bundle] = []
        self._channels: dict[tuple[int, int], RayChannel] = {}
        # (rank, incarnation) -> the key of its start in Ray's store, until its actor took
        # it (connected) or is gone (actor.put_start)
        self._start_keys: dict[tuple[int, int], bytes] = {}
        self._pg: Any = None
        self._session: ray_session.Lease | None = None
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._listener: Listener | None = None
        self._logs: LogPump | None = None
        self._writer: framing.BacklogWriter | None = None
        self._shares: RayShares | None = None
        self._own = OwnBlocks(_alive)  # put objects for the ranks on this machine

    def settings(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "placement_strategy": self.placement_strategy,
            "resources_per_worker": self.resources_per_worker,
            "runtime_env": self.runtime_env,
            "namespace": self.namespace,
            "name_prefix": self.name_prefix,
            "transport": self.transport,
            # the user's PlacementGroup itself: settings copy a backend in this process
            # (create_backend), and a PlacementGroup pickles (its id, its bundles) anyway
            "placement_group": self.placement_group,
            "bundle_indices": self.bundle_indices,
        }

    def adopt_target_options(self, options: Mapping[str, Any], target_name: str) -> None:
        """A ``@ray.remote`` class's ``num_cpus``/``num_gpus``/``resources`` become the
        resources per rank, its ``runtime_env`` the ranks' (see
        :func:`~phalanx.backends.ray.placement.class_settings`)."""
        self._rank_resources, self._actor_env = class_settings(
            options, target_name, self.resources_per_worker, self.runtime_env)

    def place_nodes(self, node_of_rank: list[int]) -> None:
        """The node of each rank as a resource pool made them (its slots' nodes, before
        :meth:`reserve`): they may be virtual, several on one Ray node."""
        self._node_of_rank = list(node_of_rank)

    @property
    def capabilities(self) -> Capabilities:
        """It holds put objects (Ray's object store, and a node's block for ranks outside
        Ray's workers) and reserves pools' slots (a placement group)."""
        return Capabilities(objects=self if shm.supported() else None, slots=self)

    # -- opening -----------------------------------------------------------------------

    def reserve_slots(self, counts: Sequence[int], *, gpus: int,
                      resources: Mapping[str, float], timeout: float,
                      holder: str = "a pool") -> SlotReservation:
        """One placement group, a bundle per slot (:mod:`phalanx.backends.ray.pool`)."""
        from phalanx.backends.ray.pool import reserve_slots

        return reserve_slots(self, counts, gpus, resources, timeout, holder)

    def _open(self, output: OutputOptions) -> None:
        self._session = ray_session.acquire(self.address, namespace=self.namespace,
                                            runtime_env=self.runtime_env, min_cpus=output.world)
        import ray

        self._ray = ray
        self._secret = secrets.token_bytes(32)
        self._prefix = self.name_prefix or f"phalanx-{secrets.token_hex(4)}"
        self._writer = framing.BacklogWriter()
        self._logs = LogPump(output)
        self._services = ChannelServices(ray, self._writer, self._logs)
        self._watch_lock = threading.Lock()
        self._watched: dict[Any, RayChannel] = {}
        self._host, self._port, self._local_name = "", 0, ""  # (the Unix socket's path)
        if self._relayed:
            console.notice("phalanx: calls to this group go through Ray's own calls (the "
                           "cluster cannot connect back to a Ray Client driver): same "
                           "results, Ray's speed")
        else:
            self._listen(ray_session.driver_address(ray))
        thread = threading.Thread(target=self._watch_loop, name="phalanx-ray-watch",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def _listen(self, host: str) -> None:
        """Where this group's ranks connect (:class:`~phalanx.backends.ray.channel.Listener`):
        TCP on ``host``, and a Unix socket of this user's alone for ranks on this machine."""
        self._listener = Listener(host, self._secret, self._arrived,
                                  timeout=config.HANDSHAKE_TIMEOUT)
        self._host, self._port = host, self._listener.port
        self._local_name = self._listener.local_path

    def _arrived(self, hello: handshake.Hello, sock: socket.socket) -> None:
        """A connection whose peer proved the secret (its handshake's thread): to its
        rank's channel, or closed if that rank's incarnation is gone."""
        self._start_keys.pop((hello.rank, hello.incarnation), None)  # taken by its actor
        channel = self._channels.get((hello.rank, hello.incarnation))
        if channel is None:
            sock.close()
        elif hello.role == handshake.ROLE_CONTROL and sock.family == socket.AF_UNIX:
            # a rank in its actor's process on this machine: its end is watched from here
            watch = ExitWatch.of_peer(sock) if channel.ray_worker else None
            channel.maps_own_blocks = (watch is not None and channel.blocks_here
                                       and maps_blocks_of_here(watch.pid))
            channel.connected_pipes(*hand_over_pipes(sock), exits=watch)
        else:
            channel.connected(hello.role, sock, hello.auth)

    def _ray_gone(self) -> bool:
        """Whether this process left Ray while the group ran (the user's ``ray.shutdown()``):
        the actors went with the connection, and any Ray call now would start a new Ray."""
        return not self._ray.is_initialized()

    def _watch_loop(self) -> None:
        """Learn from Ray how each serving actor ended."""
        ray = self._ray
        wait, get = _no_auto_init(ray.wait), _no_auto_init(ray.get)
        while not self._stopping:
            if self._ray_gone():
                with self._watch_lock:
                    channels = list(self._watched.values())
                    self._watched.clear()
                for ended in channels:  # their streams end as their actors do
                    ended.ray_reports(RAY_SHUT_DOWN)
                return
            with self._watch_lock:
                refs = list(self._watched)
            if not refs:
                time.sleep(0.05)
                continue
            try:
                done, _ = wait(refs, num_returns=1, timeout=0.1, fetch_local=True)
            except Exception:
                if self._stopping or self._ray_gone():
                    continue  # ended above, or by close()
                # a ray.shutdown() under way fails the waits (owners unknown) a moment
                # before Ray says it is not initialized: look again before calling it a fault
                time.sleep(0.2)
                if self._stopping or self._ray_gone():
                    continue
                logger.exception("waiting on Ray actors failed")
                time.sleep(0.1)
                continue
            for ref in done:
                with self._watch_lock:
                    channel = self._watched.pop(ref, None)
                if channel is None:
                    continue
                try:
                    served = get(ref, timeout=5.0)
                except Exception as exc:  # noqa: BLE001 - Ray's account of the death
                    if self._ray_gone():  # the user's ray.shutdown() ended it, and ended
                        channel.ray_reports(RAY_SHUT_DOWN)  # Ray before get() was asked
                    else:
                        channel.ray_reports(describe_ray_error(exc),
                                            exitcode=ray_exit_code(exc))
                else:
                    channel.ray_reports(None, served)

    # -- reserving ---------------------------------------------------------------------

    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float,
                 holder: str) -> list[Node]:
        ray = self._ray
        deadline = time.monotonic() + timeout
        self._release_reservation()  # reserving again (a resize): the previous one goes
        if self.placement_group is not None:
            held = seats_in_user_pg(ray, self.placement_group, self.bundle_indices, layout,
                                    bundle_for_rank=self._rank_resources,
                                    gpus_per_worker=gpus_per_worker, deadline=deadline,
                                    timeout=timeout, first=not self._bundles,
                                    node_of_rank=self._node_of_rank)
        else:
            held = seats_in_own_pg(ray, layout, bundle_for_rank=self._rank_resources,
                                   gpus_per_worker=gpus_per_worker,
                                   strategy=self.placement_strategy,
                                   name=f"{self._prefix}-pg", deadline=deadline,
                                   timeout=timeout)
        self._pg, self._own_pg, self._seat_resources = held.pg, held.own, held.resources
        self._bundles = seats = held.seats
        # Where each rank is comes from the placement group itself: nothing waits here for
        # an actor to start. On this machine a rank's actor is made when the rank
        # launches, given its start (it starts its rank in its constructor). On another
        # machine the node's first actor picks its ports, which the launch waits for: every
        # actor of such a node is made now, so that they all start while the first is
        # asked (made one after the other, the group's start took two actor starts).
        # Relayed ranks' actors are all made now.
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self._start_timeout = timeout
        nodes: list[Node] = []
        self._first_rank = []
        for _, group in itertools.groupby(range(len(seats)), key=lambda r: held.node_keys[r]):
            ranks = list(group)
            address = addresses[seats[ranks[0]].node_id]
            self._first_rank.append(ranks[0])
            nodes.append(Node(index=len(nodes), address=address, ranks=len(ranks), gpus=None,
                              same_host=address == self._host))
            made_now = [] if nodes[-1].same_host and not self._relayed else ranks
            for rank in made_now:
                self._new_actor(seats[rank], rank)
        return nodes

    def _new_actor(self, b: Bundle, rank: int) -> None:
        """A new actor for ``b`` (its next incarnation), made ahead of its rank's launch."""
        b.incarnation += 1
        b.used = False
        self._make_actor(b, rank)

    def _make_actor(self, b: Bundle, rank: int, start: Any = None) -> None:
        """``b``'s actor for its current incarnation; with ``start`` (an ``ActorStart``,
        left for it in Ray's store), one that starts its rank in its constructor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from phalanx.backends.ray.actor import (
            AHEAD,
            CONCURRENCY,
            RankActor,
            rank_runtime_env,
        )
        from phalanx.backends.ray.relay import RELAY_CONCURRENCY, RelayedRankActor

        resources = dict(self._seat_resources[b.index])
        cpus = resources.pop("CPU", 0.0)
        gpus = resources.pop("GPU", 0.0)
        memory = resources.pop("memory", None)
        options: dict[str, Any] = {
            "num_cpus": cpus,
            "num_gpus": gpus,
            "resources": resources or None,
            "max_restarts": 0,
            # direct: the rank runs on the actor's main thread (a sync actor, one call at
            # a time); relayed: the relay's calls run beside serve_relayed
            "max_concurrency": RELAY_CONCURRENCY if self._relayed else CONCURRENCY,
            "name": self._actor_name(b, rank),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=b.index),
        }
        if memory:
            options["memory"] = memory
        if self.namespace is not None:
            options["namespace"] = self.namespace
        options["runtime_env"] = rank_runtime_env(self._actor_env, self._python)
        self._made_with[rank] = self._python
        made = ray_session.remote_class(
            RelayedRankActor if self._relayed else RankActor).options(**options)
        # no argument (Ray would deserialize it with its serialization context): the
        # actor takes its start from Ray's store, in its constructor or (made ahead,
        # AHEAD there until then) serve()
        if self._relayed or self._leave_start(b, rank, AHEAD if start is None else start):
            b.actor = made.remote()
        else:  # the key is another group's: the start goes the way Ray's arguments do
            b.actor = made.remote(start, start is None)

    def _leave_start(self, b: Bundle, rank: int, start: Any) -> bool:
        """Leave ``start`` (an ``ActorStart``, or ``AHEAD``) in Ray's store for ``b``'s
        actor, under the key its name makes (over this controller's ``AHEAD``); False where
        another group's start holds that key."""
        from phalanx.backends.ray.actor import put_start, start_key

        ours = self._start_keys.get((rank, b.incarnation))
        key = ours or start_key(str(self._ray.get_runtime_context().namespace),
                                self._pg.id.hex(), self._actor_name(b, rank))
        if not put_start(start, key, replace=ours is not None):
            return False
        self._start_keys[(rank, b.incarnation)] = key
        return True

    def _actor_name(self, b: Bundle, rank: int) -> str:
        return f"{self._prefix}-r{rank}-i{b.incarnation}"

    def _live_bundle(self, rank: int) -> Bundle:
        """The rank's bundle with an actor that has not served yet: a new one (a fresh
        name, the same bundle, so the same node) once the previous one has served. Not
        waited for: the first call to it waits for it to start."""
        b = self._bundles[rank]
        if b.used or b.actor is None:
            self._new_actor(b, rank)
        return b

    def ports(self, node: Node, count: int) -> list[int]:
        """Asked of the node's first actor (the first thing that waits for it to start);
        on this machine, picked here (the ranks' starts need not wait for that actor)."""
        if count == 0:
            return []
        if node.same_host:
            return pick_free_ports(node.address, count)
        ray = self._ray
        b = self._live_bundle(self._first_rank[node.index])
        try:
            ports: list[int] = ray.get(b.actor.free_ports.remote(node.address, count),
                                       timeout=self._start_timeout)
            return ports
        except ray.exceptions.GetTimeoutError:
            first = self._first_rank[node.index]
            raise StartupError(
                f"ranks {list(range(first, first + node.ranks))} did not become ready within "
                f"{self._start_timeout:g} s: Ray had not started the actor of rank {first}; "
                "raise start_timeout= (or PHALANX_START_TIMEOUT) on a busy cluster",
                rank=first,
            ) from None
        except ray.exceptions.RayError as exc:
            raise StartupError(f"a rank's actor could not start: {describe_ray_error(exc)}",
                               rank=self._first_rank[node.index]) from exc

    # -- launching and stopping --------------------------------------------------------

    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        from phalanx.backends.ray.actor import (
            ActorStart,
            interpreter_path,
            replace_idle,
            share_ray_refs,
        )

        sys_path = interpreter_path(boot.python, boot.sys_path if node.same_host else ())
        self._python = boot.python  # python=: idle actors made without it are made anew
        here = node.same_host and boot.python not in self._checked
        replace_idle(self._ray, [self._bundles[s.rank] for s in ranks if self._made_with.get(
            s.rank) != boot.python], boot.python, here=here, timeout=self._start_timeout)
        if here:
            self._checked.add(boot.python)
        cwd = boot.cwd or (os.getcwd() if node.same_host else None)
        if not self._relayed:  # ray.ObjectRefs in calls keep their owner (Ray's own reducer)
            share_ray_refs()
        for start in ranks:
            b = self._bundles[start.rank]
            ahead = b.actor is not None and not b.used  # made before its rank launched
            if not ahead:
                b.incarnation += 1
            b.used = True
            channel = (RelayChannel if self._relayed else RayChannel)(self._services, start, b)
            self._channels[(start.rank, b.incarnation)] = channel
            channels.append(channel)
            channel.send(protocol.init_frame(start.rank, sys_path, dict(boot.options),
                                             boot.payload))
            if isinstance(channel, RelayChannel):
                if not ahead:
                    self._make_actor(b, start.rank)
                    channel.actor = b.actor
                channel.serve_ref = b.actor.serve_relayed.remote(dict(start.env), cwd)
                channel.start_relay()
            else:
                # a rank that joins a Ray of the group's own (framework="ray") cannot run
                # in a process already connected to this one: its actor starts it apart
                own = boot.options.get("framework") == "ray"
                channel.ray_worker = not own
                actor_start = ActorStart((self._host, self._port, self._local_name),
                                         self._secret, start.rank, b.incarnation,
                                         dict(start.env), cwd, own)
                if ahead:  # its start from Ray's store too, where the key is free
                    channel.serve_ref = (b.actor.serve.remote() if self._leave_start(
                        b, start.rank, actor_start) else b.actor.serve.remote(actor_start))
                else:  # the rank starts in its actor's constructor: serve() serves it
                    self._make_actor(b, start.rank, actor_start)
                    channel.actor = b.actor
                    channel.serve_ref = b.actor.serve.remote()
            with self._watch_lock:
                self._watched[channel.serve_ref] = channel

    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None:
        ray = self._ray
        ours = [c for c in channels if isinstance(c, RayChannel)]
        for channel in ours:
            channel.stopped_on_purpose()
        if self._ray_gone():  # their actors went with this process's Ray
            for channel in ours:
                self._channels.pop((channel.rank, channel.incarnation), None)
            return
        # the ranks' process trees are stopped (SIGTERM, grace, SIGKILL), then the actors
        # go: a direct rank's by its warden over the side stream (its actor's main thread
        # is the rank's), a relayed rank's by its (threaded) actor
        wait = 0.0 if force else grace
        deadline = time.monotonic() + wait + config.RAY_KILL_WAIT
        asked = [(c, c.begin_stop(wait)) for c in ours if not isinstance(c, RelayChannel)]
        stops = [c.actor.stop.remote(wait) for c in ours if isinstance(c, RelayChannel)]
        for channel, request in asked:
            channel.end_stop(request, deadline)
        if stops:
            ray.wait(stops, num_returns=len(stops),
                     timeout=max(0.0, deadline - time.monotonic()), fetch_local=False)
        for channel in ours:
            try:
                ray.kill(channel.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("ray.kill of rank %d: %s", channel.rank, exc)
        refs = [c.serve_ref for c in ours if c.serve_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=config.RAY_KILL_WAIT, fetch_local=False)
        with self._watch_lock:
            for ref in refs:
                self._watched.pop(ref, None)
        untaken = [self._start_keys.pop((c.rank, c.incarnation), None) for c in ours]
        self._drop_starts([key for key in untaken if key is not None])
        for channel in ours:
            self._channels.pop((channel.rank, channel.incarnation), None)

    def _drop_starts(self, keys: Sequence[bytes]) -> None:
        """Remove from Ray's store the starts no actor took (theirs never started)."""
        if keys:
            from phalanx.backends.ray.actor import drop_starts

            drop_starts(keys)

    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        """A relayed rank's end is its actor's ``serve_relayed`` returning; a direct
        rank's, its warden's account (its actor's ``serve`` never returns)."""
        deadline = time.monotonic() + timeout
        refs = [c.serve_ref for c in channels
                if isinstance(c, RelayChannel) and c.serve_ref is not None]
        for channel in channels:
            if isinstance(channel, RayChannel) and not isinstance(channel, RelayChannel):
                channel.wait_ended(deadline)
        if refs and not self._ray_gone():
            self._ray.wait(refs, num_returns=len(refs), fetch_local=False,
                           timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if not self.opened or self._stopping:
            return
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
        try:
            if self._session is not None and not self._ray_gone():
                self._release_cluster_side()
        finally:
            for thread in self._threads:
                thread.join(timeout=5)
            self._own.close()
            if self._logs is not None:
                self._logs.stop()
            if self._writer is not None:
                self._writer.stop()
            if self._session is not None:
                self._session.release()
                self._session = None

    def share(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        """Ranks that map this process's blocks (on the controller's machine) read it from
        one of them, as the local backend's ranks do; the others from Ray's object store,
        put there once: ranks in Ray workers read it there, others through a store actor
        on their node (:mod:`phalanx.backends.ray.store`)."""
        here, there = _by_reach(channels)
        if here:
            self._own.share(obj, here, keep_segments=bool(there), fetch=lambda: (
                None if self._shares is None else self._shares.segments(obj.id)))
        if there:
            self._node_side().share(obj, there, lambda c: self._bundles[c.rank].node_id,
                                    fetch=lambda: self._own.parts(obj.id))

    def unshare(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        here, there = _by_reach(channels)
        self._own.unshare(obj, here)
        if self._shares is not None:
            self._shares.unshare(obj, there)

    def released(self, channel: Channel, ref_id: int) -> None:
        # a block of this process: reused once its readers let go of it (Ray's store keeps
        # an object's pages while any view of them lives)
        self._own.released(channel, ref_id)

    def segments(self, obj: HeldObject) -> list[Any] | None:
        if obj.segments is not None:
            return obj.segments
        parts = self._own.parts(obj.id)
        if parts is None and self._shares is not None:
            parts = self._shares.segments(obj.id)
        return parts

    def free_port(self, node: Node) -> int:
        """Asked of the node's store actor (its ranks' actors are busy running them)."""
        return self._node_side().free_port(self._bundles[self._first_rank[node.index]].node_id,
                                           node.address, self._start_timeout)

    def _node_side(self) -> RayShares:
        if self._shares is None:
            self._shares = RayShares(self._ray, self._prefix, self.namespace, self.runtime_env)
        return self._shares

    def _release_cluster_side(self) -> None:
        """Kill every actor this backend made and remove its placement group (never the
        user's)."""
        if self._shares is not None:
            self._shares.close()
        self._release_reservation()
        untaken, self._start_keys = list(self._start_keys.values()), {}
        self._drop_starts(untaken)

    def _release_reservation(self) -> None:
        """Kill the actors of the current reservation and remove its placement group if it
        is phalanx's own (a user's ``placement_group=`` is left as it is)."""
        ray = self._ray
        for b in self._bundles:
            if b.actor is not None:
                try:
                    ray.kill(b.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self._pg is not None and self._own_pg:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        self._pg, self._own_pg = None, False


def _alive(channel: Any) -> bool:
    """Whether a rank's channel still has its rank (the pool's question: can it still say
    RELEASED?)."""
    return isinstance(channel, RayChannel) and channel.alive()


def _by_reach(channels: Sequence[Channel]) -> tuple[list[Channel], list[Channel]]:
    """``channels`` split: the ranks that map this process's blocks, and the others."""
    here: list[Channel] = []
    there: list[Channel] = []
    for channel in channels:
        (here if getattr(channel, "maps_own_blocks", False) else there).append(channel)
    return here, there
