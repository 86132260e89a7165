"""The backend boundary: nodes, channels and events.

A backend is where ranks run. The group talks to it at the level of *nodes*:

1. :meth:`Backend.reserve` finds the nodes for a layout (a simulated node on this machine, a
   Ray node holding placement-group bundles, an agent's pod) and reports each one's
   address, the devices phalanx may hand out there, and how many ranks landed on it.
2. :meth:`Backend.ports` picks free ports *on* a node (for ``MASTER_PORT`` and framework
   services): only the node knows which of its ports are free.
3. :meth:`Backend.launch` starts one batch of ranks on one node. The group gives each rank
   the variables phalanx and the user set; the node side layers them over its own base
   environment, picks the working directory and whether the controller's ``sys.path``
   means anything there. It returns :class:`Channel` objects, not processes.

A channel carries the messages of one or more ranks (:mod:`phalanx.wire.protocol`). Once
attached to an :class:`EventSink` (the group's dispatcher) it names the descriptors to
wait on (any :class:`Receiver`: the channel itself, or the :class:`Link` it shares with the
other ranks of its node) and turns readiness into complete events -- READY, RESULT,
ERROR, ..., and EXITED with the rank's whole failure record -- or posts events from a
thread of its own (a watcher that learns of a death from Ray). Nothing a channel does in
:meth:`Channel.receive` blocks: a death that needs waiting (for the last stderr lines, for
Ray's account of it) is finished on a helper thread and posted.

Transport errors stop here: :meth:`Channel.send` never raises for a lost connection; the
loss arrives as an EXITED event for each rank the channel carried.

What a backend offers beyond this -- holding put objects, copying kept results between
machines, reserving a pool's slots, shipping code, nodes that change -- is a typed part it
has or not, named once in :attr:`Backend.capabilities` (:mod:`.parts`); what crosses the
boundary with them (held objects, kept copies) is defined in :mod:`.held`, below it.

Template methods (as torch elastic's ``PContext``): the public methods hold the checks and
the cleanup on failure; backends implement the ``_``-prefixed ones.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from phalanx.backends.parts import Capabilities
from phalanx.errors import MembershipEvent, ProcessFailure
from phalanx.world.layout import Layout

if TYPE_CHECKING:
    from phalanx.output.logs import OutputOptions
    from phalanx.wire.protocol import Gathered

logger = logging.getLogger(__name__)


class Receiver(Protocol):
    """What an :class:`EventSink` watches a descriptor for: a :class:`Channel`, or a
    :class:`Link` that hands the events it reads to its channels."""

    def receive(self, fd: int) -> list[list[Any]]:
        """The events complete now on ``fd``; never blocks."""


class EventSink(Protocol):
    """Where a channel delivers events (implemented by the dispatcher). Thread-safe."""

    def watch(self, fd: int, channel: Receiver,
              read: Callable[[], list[list[Any]] | tuple[bytes, bytes]] | None = None
              ) -> None:
        """Call ``channel.receive(fd)`` whenever ``fd`` is readable; the events it returns
        are that channel's. ``read``, where given, is what ``receive(fd)`` does while the
        stream is whole, called instead (one call fewer per event): it never blocks, and
        it raises :class:`~phalanx.wire.streams.ConnectionLost` once the stream ended or
        broke, when ``receive(fd)`` is called to handle that (it must see the same end).
        It may return one event of a header and one pickle as that pair alone, a tuple
        (:meth:`FrameReader.recv_pair <phalanx.wire.framing.FrameReader.recv_pair>`)."""

    def unwatch(self, fd: int, channel: Receiver | None = None) -> None:
        """Stop watching ``fd`` (before it is closed), if ``channel`` still owns it."""

    def post(self, channel: Channel, events: list[list[Any]]) -> None:
        """Deliver events from another thread (a watcher's EXITED)."""

    def post_all(self, batches: list[tuple[Channel, list[list[Any]]]]) -> None:
        """:meth:`post` for several channels at once (one wake-up)."""

    def deliver(self, channel: Channel, events: list[list[Any]]) -> None:
        """Only from inside a watched channel's ``receive()``: handle another channel's
        events now (a connection shared by several channels)."""

    def resolve_results(self, call_id: int, gathered: Gathered, link: object,
                        channel_of: Callable[[int], Channel | None]) -> None:
        """Only from inside a watched ``link``'s ``receive()``: one call's results of
        several ranks at once (a tree's gathered ones); ``channel_of(rank)``: the channel
        ``link`` carries for that rank (None: none)."""

    def wait(self, is_done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``is_done()`` (or ``timeout``), receiving meanwhile: how a thread waits
        for an answer that arrives on a watched descriptor. Never from ``receive()``."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a group, as its backend reserved it."""

    index: int
    address: str  # how the other nodes reach it (node 0's is MASTER_ADDR)
    ranks: int  # how many ranks run there
    gpus: tuple[str, ...] | None = ()  # device ids phalanx may hand out there;
    #                                    None: the backend assigns devices itself (Ray)
    same_host: bool = True  # on the controller's machine: its cwd and sys.path apply


@dataclasses.dataclass(frozen=True)
class RankStart:
    """What the group decided for one rank: identity and the variables it sets."""

    rank: int
    node: int
    local_rank: int
    env: Mapping[str, str]  # phalanx's and the user's variables, over the node's own


@dataclasses.dataclass(frozen=True)
class Boot:
    """The same for every rank of a start: what INIT carries, and the user's cwd."""

    payload: list[Any]  # pickled (target, args, kwargs)
    options: Mapping[str, Any]
    sys_path: tuple[str, ...]  # the controller's, applied on nodes that share its files
    cwd: str | None = None  # None: the node side decides (local: the controller's cwd)
    # the options of a @ray.remote class given as the target (see plain_target), for
    # Backend.adopt_target_options; the payload holds the class it wraps
    target_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    target_name: str = ""  # that class's name, for messages
    python: str | None = None  # the interpreter ranks run (None: the node's own default)


def plain_target(target: Any) -> tuple[Any, dict[str, Any], str]:
    """A ``@ray.remote`` class (Ray's ``ActorClass``) is the user's class underneath: that
    class, the options given to ``@ray.remote(...)`` and its name; anything else is itself,
    with no options. Told by its type's name, without importing Ray."""
    if not any(c.__name__ == "ActorClass" and c.__module__ == "ray.actor"
               for c in type(target).__mro__):
        return target, {}, ""
    meta = target.__ray_metadata__
    cls = getattr(meta.modified_class, "__ray_actor_class__", meta.modified_class)
    return cls, dict(getattr(target, "_default_options", None) or {}), cls.__qualname__


class Link(abc.ABC):
    """One connection carrying the messages of several ranks of a node (an agent's): not a
    rank's channel, but what their channels share.

    Each of those channels names it as its :attr:`Channel.link`; a frame for several of
    them goes through it once (:meth:`send`, with ``rank = MANY`` in its header). The sink
    watches its descriptor, and :meth:`receive` hands each rank's events to that rank's
    channel itself (``sink.deliver``), so it returns none of its own.
    """

    @abc.abstractmethod
    def receive(self, fd: int) -> list[list[Any]]:
        """Read what is complete on ``fd`` and hand it to the channels; never blocks."""

    @abc.abstractmethod
    def send(self, frame: list[Any]) -> None:
        """Queue one frame; a lost connection is reported through the channels' EXITED,
        never raised here."""


class Channel(abc.ABC):
    """Carries the messages of some ranks of one node, and reports their deaths."""

    ranks: tuple[int, ...]
    node: int
    # The connection this channel shares with the other ranks of its node (an agent's),
    # if any: a frame for several of them goes through it once (``link.send(frame)``).
    link: Link | None = None

    @abc.abstractmethod
    def attach(self, sink: EventSink) -> None:
        """Start delivering this channel's events to ``sink``."""

    @abc.abstractmethod
    def receive(self, fd: int) -> list[list[Any]]:
        """The events complete now on ``fd`` (watched through the sink); never blocks."""

    @abc.abstractmethod
    def send(self, frame: list[Any]) -> None:
        """Queue one frame; a lost connection is reported as EXITED, never raised here."""

    def sender(self) -> Callable[[list[Any]], None]:
        """:meth:`send`, as the call path keeps it for each rank: a channel with a shorter
        way to the same effect returns that (the local one, its connection's own send)."""
        return self.send

    @abc.abstractmethod
    def signal(self, rank: int, sig: int) -> None:
        """Deliver ``sig`` to the rank's process (and its process group)."""

    def stacks(self, rank: int, timeout: float) -> str:
        """Every thread's Python stack of the rank's process now (see
        :mod:`phalanx.node.stacks`), or a line saying why there is none."""
        return "(no stack: this backend cannot take one)"

    def dying(self, rank: int) -> bool:
        """Whether the rank's death is known here and its EXITED is still on its way (a
        channel that waits for the last of its account, as Ray's does): a call on
        ``workers="ready"`` or ``"any"`` skips it already."""
        return False

    @abc.abstractmethod
    def exit_record(self, rank: int) -> ProcessFailure:
        """How the rank's process ended, as known now (after :meth:`Backend.stop`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release descriptors and threads (the processes are stopped by the backend)."""


class Backend(abc.ABC):
    """Reserves nodes and starts, signals and stops the ranks of one group on them."""

    name = "abstract"
    opened = False
    # Told of every membership change (nodes lost, or joining and leaving a DNS name),
    # before the ranks of a lost node are reported dead; set by the group. Any thread.
    on_membership: Callable[[MembershipEvent], None] | None = None

    def settings(self) -> dict[str, Any]:
        """The constructor arguments this backend was configured with."""
        return {}

    @property
    def capabilities(self) -> Capabilities:
        """What it offers beyond the basics (:mod:`phalanx.backends.parts`): none here."""
        return Capabilities()

    def carry_over(self, original: Backend) -> None:
        """Take what was set on ``original`` after its construction, which its settings do
        not say (a group runs on a copy of the backend it is given): nothing here."""
        return None

    def open(self, output: OutputOptions) -> None:
        """Start what the backend needs to serve one group (threads, a Ray connection);
        ``output`` says what happens to the ranks' stdout and stderr."""
        if self.opened:
            raise RuntimeError(f"this {self.name} backend already serves a group")
        self.opened = True
        self._open(output)

    def adopt_target_options(self, options: Mapping[str, Any], target_name: str) -> None:
        """Take the options of the ``@ray.remote`` class ``target_name`` that is the group's
        target (once, before the first :meth:`reserve`); raises if they cannot be honoured.
        Only Ray places ranks by them: any other backend runs the class it wraps, and
        refuses a class that sets options."""
        if options:
            given = ", ".join(f"{k}={v!r}" for k, v in options.items())
            raise ValueError(
                f"{target_name} is a @ray.remote({given}) class: the {self.name} backend runs "
                "the class it wraps but cannot honour Ray's options; remove them (a plain "
                "@ray.remote class runs on every backend) or use backend=px.RayBackend(...)")

    def gpus_per_node(self, nodes: int) -> int | None:
        """GPUs each node offers, if known before the ranks are placed (for
        ``procs_per_node="auto"``); None when only placement tells."""
        return None

    def group_nodes(self, nodes: int | None) -> int:
        """How many nodes a group that asks for ``nodes`` (None: it named none) runs on,
        decided before anything starts: ``nodes``, or 1. A backend whose nodes are known
        before it opens (``px.SlurmBackend``: its job's) gives them all, and refuses more
        with a ValueError."""
        return 1 if nodes is None else nodes

    def reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float,
                holder: str = "a group") -> list[Node]:
        """Find nodes for ``layout`` (ranks per node in order); raises before any rank runs.
        ``holder`` names the group in messages (and in the books of devices it takes).

        A backend that places ranks itself (Ray) may return another split of the same
        number of ranks: the nodes as they really are.
        """
        nodes = self._reserve(layout, gpus_per_worker=gpus_per_worker, timeout=timeout,
                              holder=holder)
        if sum(n.ranks for n in nodes) != layout.world_size:  # pragma: no cover - a bug
            raise RuntimeError(f"{self.name} reserved {nodes} for {layout.world_size} ranks")
        return nodes

    def launch(self, node: Node, ranks: Sequence[RankStart], boot: Boot) -> list[Channel]:
        """Start ``ranks`` on ``node`` and send each its INIT; their channels, not attached.

        If starting one fails, those already started are stopped before the error
        propagates.
        """
        if not ranks:
            raise ValueError("no ranks to launch")
        channels: list[Channel] = []
        try:
            self._launch(node, list(ranks), boot, channels)
        except BaseException:
            self.stop(channels, grace=0.0, force=True)
            raise
        return channels

    def stop(self, channels: Sequence[Channel], *, grace: float, force: bool = False) -> None:
        """SIGTERM, wait up to ``grace`` s, SIGKILL, reap; returns when none is alive."""
        if channels:
            self._stop(list(channels), grace=grace, force=force)
        for channel in channels:
            channel.close()

    def free_port(self, node: Node) -> int:
        """A port free now on ``node``, whose ranks are running (for a joint world)."""
        return self.ports(node, 1)[0]

    @abc.abstractmethod
    def _open(self, output: OutputOptions) -> None: ...

    @abc.abstractmethod
    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float,
                 holder: str) -> list[Node]:
        ...

    @abc.abstractmethod
    def ports(self, node: Node, count: int) -> list[int]:
        """``count`` distinct ports free on ``node`` now."""

    @abc.abstractmethod
    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        """Start the ranks, appending each channel to ``channels`` as soon as it exists."""

    @abc.abstractmethod
    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None: ...

    @abc.abstractmethod
    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        """Wait up to ``timeout`` for the ranks' processes to exit on their own."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the backend holds (threads, a placement group, a Ray it started)."""

