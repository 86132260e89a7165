"""Who the cluster backend's nodes are, over time: its connections and membership changes.

Part of :mod:`phalanx.backends.cluster.backend`, which makes one :class:`Members` and hands it
what it needs: a :class:`~phalanx.backends.cluster.link.Dialer` (how to reach an agent), the
DNS name to watch (a :class:`Discovery`, with ``dns=``), the largest frame and the tree's
fan-out, and where to tell changes. :class:`Members` holds every connection to an agent
(:attr:`Members.links`) and the group's nodes in order (:attr:`Members.nodes`).

A node is *removed* when it is lost (its agent's connection ended, it fell silent, or in a
tree the agent above it lost it) or, with ``dns=``, when the name stops listing it; an
address the name starts listing, whose agent answers, is *added* -- kept aside, connected
and authenticated, until the group admits it (``group.resize()`` or ``restart()``). Each
change reaches the backend's membership listener (the group) as a
:class:`~phalanx.errors.MembershipEvent` *before* the ranks of a removed node are reported
dead, so the calls it breaks fail as a membership change.

With ``Discovery.interval``, a thread resolves the name again every so often and compares.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.cluster import dns as dnsquery
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.link import AgentLink, AgentNode, Dialer, parse_host
from phalanx.errors import MembershipEvent, NodeInfo, PhalanxError
from phalanx.wire import framing
from phalanx.wire.memfd import machine_id

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Discovery:
    """A DNS name listing the agents (``dns=``): every address on ``port``, resolved by
    the system or by ``nameserver``, again every ``interval`` seconds (None: never)."""

    name: str
    port: int
    nameserver: str | None = None
    interval: float | None = None


class Members:
    """The nodes of one cluster backend: the group's, those added since, and the
    connections that reach them. ``tell`` hears of every change (any thread)."""

    def __init__(self, dialer: Dialer, *, max_frame: int, fanout: int,
                 top_fanout: int | None = None,
                 discovery: Discovery | None, tell: Callable[[MembershipEvent], None]) -> None:
        self.dialer = dialer
        self.max_frame, self.fanout = max_frame, fanout
        self.top_fanout = fanout if top_fanout is None else top_fanout  # its connections
        self.discovery = discovery
        self._on_change = tell
        self.links: list[AgentLink] = []  # every connection to an agent
        self.nodes: list[AgentNode] = []  # every node, in the group's order
        self.next_id = 1  # the next tree id to give
        self.tree = False  # whether the agents form a tree
        self.spares: list[AgentNode] = []  # added, not admitted yet
        self._writer: framing.BacklogWriter | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Start the thread that writes to every link (before the first connection)."""
        self._writer = framing.BacklogWriter("phalanx-cluster-writer")

    def connection_count(self) -> int:
        """How many agents this controller holds a connection to now."""
        return sum(1 for link in self.links if link.lost_reason is None)

    # -- the nodes --------------------------------------------------------------------

    def _link(self, joined: agenttree.Joined) -> AgentLink:
        if self._writer is None:  # pragma: no cover - a bug
            raise RuntimeError("Members.open() was not called before connecting")
        link = AgentLink(joined, self._writer, self.max_frame, on_lost=self._lost)
        self.links.append(link)
        return link

    def node_of(self, joined: agenttree.Joined) -> AgentNode:
        """The node a direct connection reaches (flat: named 0 there)."""
        link = self._link(joined)
        node = link.nodes[0] = AgentNode(link, 0, joined.host, joined.port, joined.welcome)
        return node

    def tree_of(self, head: agenttree.Head,
                found: dict[int, tuple[str, dict[str, Any]]]) -> list[AgentNode]:
        """The nodes reached through a tree's head: itself and its subtree."""
        self.tree = True
        link = self._link(head.joined)
        for tree_id in head.ids:
            name, welcome = found[tree_id]
            link.nodes[tree_id] = AgentNode(link, tree_id, *parse_host(name), welcome)
        return [link.nodes[i] for i in head.ids]

    def current(self, in_use: int | None) -> list[AgentNode]:
        """The nodes in the order a group reserving now takes them, indexed so, and kept as
        :attr:`nodes`: the first ``in_use`` (the group's so far; None: all) not lost, those
        added since (admitted by this), then the others that answered."""
        with self._lock:
            spares, self.spares = self.spares, []
        agents = self.nodes
        cut = len(agents) if in_use is None else in_use
        nodes = [n for n in agents[:cut] + spares + agents[cut:] if n.lost_reason is None]
        for index, node in enumerate(nodes):
            node.index = index
        self.nodes = nodes
        return nodes

    def available(self, in_use: int) -> int:
        """How many nodes the group would have with the added ones in, the removed out."""
        with self._lock:
            spares = list(self.spares)
        return sum(1 for n in self.nodes[:in_use] + spares if n.lost_reason is None)

    # -- changes ----------------------------------------------------------------------

    def _tell(self, event: MembershipEvent) -> None:
        logger.warning("the cluster's nodes changed: %s", event)
        self._on_change(event)

    def _lost(self, nodes: list[AgentNode], reason: str) -> None:
        """From a link: ``nodes`` are gone (before their ranks are reported dead)."""
        with self._lock:
            spares = [n for n in nodes if n in self.spares]
            self.spares = [n for n in self.spares if n not in nodes]
        removed = tuple(NodeInfo(None if n in spares or n.index < 0 else n.index, n.name,
                                 n.link.ranks_of(n), n.label)
                        for n in sorted(nodes, key=lambda n: (n.index, n.tree_id)))
        self._tell(MembershipEvent((), removed, reason))

    def start(self) -> None:
        """Watch the DNS name, if there is one to watch again."""
        if self.discovery is not None and self.discovery.interval is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="phalanx-cluster-dns")
            self._thread.start()

    def stop(self) -> None:
        """Stop watching; nothing is added from now on."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(config.CONNECT_TIMEOUT + 5)

    def close(self) -> None:
        """Stop watching, end every connection (the agents stop our ranks) and the writer."""
        self.stop()
        for link in self.links:
            link.close()
        if self._writer is not None:
            self._writer.stop()

    def _watch(self) -> None:
        name = self.discovery
        if name is None or name.interval is None:  # pragma: no cover - start() checks
            return
        while not self._stopping.wait(name.interval):
            try:
                found = dnsquery.resolve(name.name, name.nameserver)
            except dnsquery.DNSError as exc:  # a DNS hiccup is not a change
                logger.info("resolving %s again failed: %s", name.name, exc)
                continue
            try:
                self.compare({(address, name.port) for address in found})
            except Exception:  # a bug must not stop the watching
                logger.exception("comparing the cluster's nodes with %s failed", name.name)

    def compare(self, listed: set[tuple[str, int]]) -> None:
        """Remove the nodes no longer ``listed`` and add those newly listed."""
        where = "the DNS name" if self.discovery is None else self.discovery.name
        with self._lock:
            known = [n for n in self.nodes + self.spares if n.lost_reason is None]
        for node in known:
            if (node.host, node.port) not in listed and not self._stopping.is_set():
                reason = f"it is no longer listed under {where}"
                if node.tree_id == 0:
                    node.link.lose(reason)  # the agent stops its ranks when we hang up
                else:  # below another agent: ask it to stop them, answer or not
                    ranks = list(node.link.ranks_of(node))
                    if ranks:
                        node.link.send(agentwire.request(agentwire.STOP, 0, ranks, 0.0, True,
                                                         node=node.tree_id))
                    node.link.lose_nodes([node], reason)
        names = {(n.host, n.port) for n in known}
        for host, port in sorted(listed - names):
            if self._stopping.is_set():
                return
            added = self._add(host, port)
            if added is not None:
                self._tell(MembershipEvent((NodeInfo(None, added.name, ()),), ()))

    def _add(self, host: str, port: int) -> AgentNode | None:
        """Connect to a newly listed agent (in a tree: below a top agent when the
        controller holds ``top_fanout`` connections already); None if it does not answer."""
        try:
            if self.tree and self.connection_count() >= self.top_fanout:
                node = self._adopt_below(host, port)
            else:
                joined = self.dialer.connect(host, port, config.CONNECT_TIMEOUT)
                if self.tree:
                    tree_id = self._new_id()
                    try:
                        agenttree.adopt(joined, tree_id, [], self.fanout,
                                        config.CONNECT_TIMEOUT)
                    except OSError:
                        joined.close()
                        raise
                    node = self.tree_of(agenttree.Head((tree_id, host, port), joined,
                                                       [tree_id]),
                                        {tree_id: (f"{host}:{port}", joined.welcome)})[0]
                else:
                    node = self.node_of(joined)
        except (OSError, PhalanxError) as exc:
            logger.info("the agent newly listed at %s:%d does not answer yet: %s", host, port,
                        exc)
            return None
        node.same_host = node.welcome.get("machine") == machine_id()
        with self._lock:
            self.spares.append(node)
        return node

    def _new_id(self) -> int:
        with self._lock:
            tree_id, self.next_id = self.next_id, self.next_id + 1
        return tree_id

    def _adopt_below(self, host: str, port: int) -> AgentNode:
        links = [link for link in self.links if link.lost_reason is None]
        link = min(links, key=lambda lk: len(lk.nodes))
        top = min((n for n in link.nodes.values() if n.lost_reason is None),
                  key=lambda n: n.tree_id)
        tree_id = self._new_id()
        answer = top.request(agentwire.ADOPT, top.tree_id, [[tree_id, host, port]],
                             self.fanout, config.CONNECT_TIMEOUT)
        found = dict((i, w) for i, w in answer["nodes"])
        if tree_id not in found:
            why = "; ".join(str(m[2]) for m in answer["missing"]) or "no answer"
            raise OSError(why)
        node = link.nodes[tree_id] = AgentNode(link, tree_id, host, port, found[tree_id])
        return node
