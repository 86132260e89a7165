"""The cluster backend: ranks run on nodes (hosts, Kubernetes pods) served by ``phalanx agent``.

``ClusterBackend(hosts=["10.0.0.5:32300", ...], token=...)`` connects to every listed
agent, proving the shared token both ways (:mod:`phalanx.wire.handshake`; an agent of
another phalanx version is refused at once with :class:`~phalanx.errors.VersionMismatch`),
and waits until ``quorum`` of them (default: all) have answered -- past ``quorum_timeout`` it raises
:class:`~phalanx.errors.QuorumTimeout` naming who answered and who did not, and never goes
on with fewer. Node ``i`` of the group is the ``i``-th agent that answered, in the order
the hosts were listed.

One connection per node (an :class:`AgentLink`) carries every rank of that node: a call
whose payload is the same for several of them crosses it once (``rank = MANY``; the agent
hands it to each), and their replies, output and deaths come back over it
(:mod:`phalanx.backends.cluster.messages`). Each rank still has a channel of its own
(:class:`AgentRankChannel`), so the group sees them exactly as local ranks. A node lost --
its agent killed, its connection ended, or silent past ``node_timeout`` -- fails every
call pending on its ranks at once, naming the node and the agent.

Node liveness is the agents' own, apart from the ranks': each agent sends a sign of life
every second from a thread of its own (neither its ranks' code nor its busy relay can delay
it), and anything else it sends counts too. An agent silent for ``node_timeout`` (default
``config.DEFAULT_NODE_TIMEOUT``, 15 s) -- stopped (SIGSTOP), its machine gone, its link cut
-- is lost, its ranks with it, while they may still be running. A rank that hangs on a live
node is the group's to judge, by its own ``heartbeat_timeout``. Bytes from an agent that
wait unread here are read before anyone is judged, so a controller that falls behind
(stopped, starved) does not take its agents for silent ones. Every control connection has
TCP keepalive too (:func:`phalanx.wire.streams.keep_alive`).

From ``tree_threshold`` agents on, the controller connects to at most ``top_fanout`` of
them and the agents form a tree below those, each with at most ``fanout`` children
(:mod:`phalanx.backends.cluster.tree`). The controller's share is small on purpose: it is
the one process every call passes through, and its CPU per call grows with its
connections (each a send, a wake-up, a read and a check of a sealed frame), while the
agents below share the rest. Nodes lost, and with
``dns=`` nodes leaving or joining the name, are membership changes
(:mod:`phalanx.backends.cluster.members`): the group hears of them before anything fails.
"""

from __future__ import annotations

import itertools
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx import config
from phalanx.backends.base import Backend, Boot, Channel, Node, RankStart
from phalanx.backends.cluster import codesync
from phalanx.backends.cluster import dns as dnsquery
from phalanx.backends.cluster import gpus as agentgpus
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.link import (
    CONNECT_RETRY,
    REQUEST_TIMEOUT,
    AgentNode,
    AgentRankChannel,
    Dialer,
    parse_host,
)
from phalanx.backends.cluster.members import Discovery, Members
from phalanx.backends.cluster.token import TOKEN_ENV, given_token, read_token
from phalanx.backends.held import HeldObject, KeptCopy, NodeAddress
from phalanx.backends.parts import Capabilities, SlotReservation
from phalanx.errors import (
    AuthenticationError,
    DevicesTaken,
    MembershipEvent,
    PhalanxError,
    QuorumTimeout,
    VersionMismatch,
)
from phalanx.node.machine import require_interpreter, without_own_install
from phalanx.output import console
from phalanx.output.logs import LogPump, OutputOptions
from phalanx.wire import handshake
from phalanx.wire.memfd import machine_id
from phalanx.world.layout import Layout

logger = logging.getLogger(__name__)


class ClusterBackend(Backend):
    """Ranks on nodes served by ``phalanx agent`` (see the module's docstring).

    ``hosts``: ``"host:port"`` of each agent; or ``dns``: a name whose A/AAAA records are
    the agents (a Kubernetes headless Service), all on ``port``, resolved by the system or
    by ``nameserver="host:port"``, and waited for until ``quorum`` of them (default: one)
    are listed. ``token`` (or ``token_file``, or ``$PHALANX_TOKEN``): the shared secret the
    agents were started with. ``quorum``: how many agents must answer before the group
    starts (default: all listed); ``quorum_timeout``: how long to wait for them.
    ``node_timeout``: an agent that gives no sign of life this long (frozen, its machine
    gone, its link cut) is lost, with its node (agents send one every second).
    ``heartbeat_timeout``: a node silent this long is lost too (the shorter of the two
    judges; the group's own ``heartbeat_timeout`` judges its ranks). ``max_frame``: the
    largest frame accepted from an agent. ``tls``: True, a CA file or an
    ``ssl.SSLContext``. ``sync``: a directory shipped to every node before ranks start
    (``group.reload()`` re-ships it).
    ``dns_interval``: how often the name is resolved again while the group lives (None:
    never). ``tree_threshold``: from this many agents on they form a tree, each with at
    most ``fanout`` children, and the controller holds at most ``top_fanout``
    connections (the tree's top agents; default: ``fanout`` or 4, the fewer).
    """

    name = "cluster"
    # a subclass that starts its agents itself (px.SlurmBackend) is given no hosts: it lists
    # them in _find_agents() as it opens
    finds_agents = False

    def __init__(self, hosts: Sequence[str] | None = None, token: str | bytes | None = None,
                 *, dns: str | None = None, port: int = config.AGENT_PORT,
                 nameserver: str | None = None,
                 token_file: str | None = None, quorum: int | None = None,
                 quorum_timeout: float = 300.0,
                 heartbeat_timeout: float = config.DEFAULT_HEARTBEAT_TIMEOUT,
                 node_timeout: float = config.DEFAULT_NODE_TIMEOUT,
                 max_frame: int = 1 << 30, tls: bool | str | ssl.SSLContext | None = None,
                 sync: str | os.PathLike[str] | None = None,
                 dns_interval: float | None = 5.0, tree_threshold: int = 100,
                 fanout: int = 50, top_fanout: int | None = None) -> None:
        found_at_open = hosts is None and dns is None and self.finds_agents
        if (hosts is None) == (dns is None) and not found_at_open:
            raise ValueError("give the agents as hosts=['host:port', ...] or dns='name' "
                             "(one of the two)")
        self.dns, self.port, self.nameserver = dns, port, nameserver
        self.hosts: list[str] = []
        if found_at_open:
            pass  # _find_agents() lists them as the backend opens
        elif dns is not None:
            dnsquery.build_query(dns, dnsquery.A, 0)  # a ValueError for a malformed name
            parse_host(f"agents:{port}")  # a ValueError naming a bad port
            if nameserver is not None:
                parse_host(nameserver)
        elif isinstance(hosts, str) or not hosts:
            raise ValueError(f"hosts must be a non-empty list of 'host:port', got {hosts!r}")
        else:
            self.hosts = [f"{h}:{p}" for h, p in map(parse_host, hosts)]
            if len(set(self.hosts)) != len(self.hosts):
                raise ValueError(f"hosts lists an agent twice: {self.hosts}")
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        self.token = token
        self.token_file = token_file
        if token is not None:
            secret = given_token(token)
        elif token_file is not None or os.environ.get(TOKEN_ENV):
            secret = read_token(token_file)
        else:
            raise ValueError(f"ClusterBackend needs the agents' token: token=..., "
                             f"token_file=... or ${TOKEN_ENV}")
        most = len(self.hosts) if dns is None else 1 << 20
        if quorum is not None and not (isinstance(quorum, int) and 1 <= quorum <= most):
            raise ValueError(f"quorum must be an integer in 1..{len(self.hosts)}, got "
                             f"{quorum!r}" if dns is None else
                             f"quorum must be a positive integer, got {quorum!r}")
        self.quorum = quorum
        if not quorum_timeout > 0:
            raise ValueError(f"quorum_timeout must be > 0 seconds, got {quorum_timeout!r}")
        self.quorum_timeout = quorum_timeout
        for name, value in (("heartbeat_timeout", heartbeat_timeout),
                            ("node_timeout", node_timeout)):
            if isinstance(value, bool) or not (isinstance(value, (int, float))
                                               and 2 <= value < float("inf")):
                raise ValueError(f"{name} must be at least 2 seconds (agents send a sign "
                                 f"of life every second), got {value!r}")
        self.heartbeat_timeout = heartbeat_timeout
        self.node_timeout = node_timeout
        self.max_frame = max_frame
        self.tls = tls
        # the handshake proves a stretched token: each offline guess costs scrypt
        self._dialer = Dialer(handshake.stretch(secret), _tls_context(tls))
        if sync is not None and not os.path.isdir(sync):
            raise ValueError(f"sync={os.fspath(sync)!r} is not a directory")
        self.sync = sync
        if dns_interval is not None and not (isinstance(dns_interval, (int, float))
                                             and dns_interval > 0):
            raise ValueError(f"dns_interval must be > 0 seconds (or None: never), got "
                             f"{dns_interval!r}")
        self.dns_interval = dns_interval
        for name, value, least in (("tree_threshold", tree_threshold, 1),
                                   ("fanout", fanout, 2),
                                   ("top_fanout", 1 if top_fanout is None else top_fanout, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.tree_threshold, self.fanout = tree_threshold, fanout
        self.top_fanout = (min(fanout, config.TREE_TOP_FANOUT) if top_fanout is None
                           else top_fanout)
        self.code_version: str | None = None  # of the code the nodes run (with sync)
        self._in_use: int | None = None  # how many of the nodes the group runs on
        discovery = None if dns is None else Discovery(dns, port, nameserver, dns_interval)
        # the connections and the nodes, in the group's order (members.nodes)
        self.members = Members(self._dialer, max_frame=max_frame, fanout=fanout,
                               top_fanout=self.top_fanout,
                               discovery=discovery, tell=self._membership_changed)
        self._incarnations = itertools.count(1)
        self._stopping = threading.Event()
        # each node's GPUs, set on the backend of a group placed on a pool (which holds them)
        self.placed_gpus: list[tuple[str, ...]] | None = None
        self.placed_hold: agentgpus.PoolHold | None = None  # the pool's, its nodes share
        self._holding: tuple[str, list[AgentNode]] | None = None  # GPUs held: whose, where
        self.labels: dict[str, str] = {}  # "host:port" -> what else names that agent's node
        # px.attach's (group name, force): the ranks "launched" are that group's, taken over
        self.attach_request: tuple[str, bool] | None = None
        self._taken_over: set[int] = set()  # the nodes whose ranks it took over: LAUNCH now

    def __repr__(self) -> str:
        parts = [repr(self.hosts)] if self.dns is None else [
            f"dns={self.dns!r}", f"port={self.port}"] + (
            [f"nameserver={self.nameserver!r}"] if self.nameserver else [])
        if self.token is not None:
            parts.append("token=<hidden>")
        elif self.token_file is not None:
            parts.append(f"token_file={self.token_file!r}")
        if self.quorum is not None:
            parts.append(f"quorum={self.quorum}")
        return f"px.ClusterBackend({', '.join(parts)})"

    def __str__(self) -> str:
        return self.name

    def settings(self) -> dict[str, Any]:
        where = ({"hosts": list(self.hosts)} if self.dns is None else
                 {"dns": self.dns, "port": self.port, "nameserver": self.nameserver})
        return {**where, "token": self.token, "token_file": self.token_file,
                "quorum": self.quorum, "quorum_timeout": self.quorum_timeout,
                "heartbeat_timeout": self.heartbeat_timeout,
                "node_timeout": self.node_timeout, "max_frame": self.max_frame,
                "tls": self.tls, "sync": self.sync, "dns_interval": self.dns_interval,
                "tree_threshold": self.tree_threshold, "fanout": self.fanout,
                "top_fanout": self.top_fanout}

    # -- connecting -------------------------------------------------------------------

    def _membership_changed(self, event: MembershipEvent) -> None:
        listener = self.on_membership
        if listener is not None:
            listener(event)

    def _open(self, output: OutputOptions) -> None:
        self.members.open()
        self._logs = LogPump(output)
        try:
            if self.finds_agents:
                self.hosts = self._find_agents()
            deadline = time.monotonic() + self.quorum_timeout
            if self.dns is not None:
                self.hosts = self._resolve_quorum(deadline)
            if len(self.hosts) >= self.tree_threshold:
                self.members.nodes = self._form_tree(deadline)
            else:
                self.members.nodes = [self.members.node_of(joined)
                                      for joined in self._connect_quorum(deadline)]
        except BaseException:
            self.close()
            raise
        machine = machine_id()
        for index, agent in enumerate(self.members.nodes):
            agent.index = index
            agent.label = self.labels.get(agent.name)
            agent.same_host = agent.welcome.get("machine") == machine
        if self.sync is not None:
            try:
                self.reload_code()
            except BaseException:
                self.close()
                raise
        threading.Thread(target=self._heartbeats, name="phalanx-cluster-heartbeat",
                         daemon=True).start()
        self.members.start()

    def _find_agents(self) -> list[str]:
        """The agents' ``host:port``, found as the backend opens (:attr:`finds_agents`)."""
        raise NotImplementedError  # pragma: no cover - only subclasses that find them

    def _resolve_quorum(self, deadline: float) -> list[str]:
        """The agents the DNS name lists, once at least ``quorum`` of them (default: one)
        do; QuorumTimeout naming the name and what it resolved to otherwise."""
        wanted = self.quorum or 1
        found: list[str] = []
        problem = "no address"
        while True:
            try:
                found = dnsquery.resolve(self.dns, self.nameserver)  # type: ignore[arg-type]
                problem = f"{len(found)} address(es): {', '.join(found) or 'none'}"
            except dnsquery.DNSError as exc:
                problem = str(exc)
            if len(found) >= wanted or time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if len(found) < wanted:
            raise QuorumTimeout(wanted, [], {f"{self.dns} (DNS)": problem}, self.quorum_timeout)
        return [f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}" for a in found]

    def _connect_quorum(self, deadline: float) -> list[agenttree.Joined]:
        wanted = self.quorum or len(self.hosts)
        answered: dict[int, agenttree.Joined] = {}
        errors: dict[int, str] = {}
        failure: list[BaseException] = []
        done = threading.Condition()

        def connect(index: int) -> None:
            host, port = parse_host(self.hosts[index])
            while not self._stopping.is_set():
                try:
                    result = self._dialer.connect(
                        host, port, min(config.CONNECT_TIMEOUT, deadline - time.monotonic()))
                except VersionMismatch as exc:  # it names the agent and both versions
                    with done:
                        failure.append(exc)
                        done.notify_all()
                    return
                except AuthenticationError as exc:
                    with done:
                        failure.append(AuthenticationError(f"agent {host}:{port}: {exc}"))
                        done.notify_all()
                    return
                except OSError as exc:
                    with done:
                        errors[index] = str(exc)
                    if time.monotonic() + CONNECT_RETRY >= deadline:
                        return
                    time.sleep(CONNECT_RETRY)
                    continue
                with done:
                    if len(answered) >= wanted:  # the quorum was reached without it
                        result.close()
                    else:
                        answered[index] = result
                    done.notify_all()
                return

        threads = [threading.Thread(target=connect, args=(i,), daemon=True,
                                    name="phalanx-cluster-connect")
                   for i in range(len(self.hosts))]
        for thread in threads:
            thread.start()
        with done:
            told = time.monotonic()
            while len(answered) < wanted and not failure:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    break
                if now - told >= config.QUORUM_REPORT_EVERY and errors:
                    told = now  # a wrong port or token shows now, not at quorum_timeout
                    absent = "; ".join(f"{self.hosts[i]}: {why}" for i, why in
                                       sorted(errors.items()) if i not in answered)
                    console.notice(f"phalanx: waiting for {wanted - len(answered)} more "
                                   f"agent(s) (quorum {wanted} of {len(self.hosts)}, "
                                   f"{remaining:.0f} s left of quorum_timeout): {absent}")
                done.wait(min(remaining, config.QUORUM_REPORT_EVERY))
            enough = len(answered) >= wanted
            self._stopping.set()  # the others stop trying
        for thread in threads:
            thread.join(config.CONNECT_TIMEOUT + 1)
        self._stopping.clear()
        if failure or not enough:
            for joined in answered.values():
                joined.close()
            if failure:
                raise failure[0]
            names = [self.hosts[i] for i in sorted(answered)]
            missing = {self.hosts[i]: errors.get(i, "no answer") for i in
                       range(len(self.hosts)) if i not in answered}
            raise QuorumTimeout(wanted, names, missing, self.quorum_timeout)
        return [answered[i] for i in sorted(answered)]

    def _form_tree(self, deadline: float) -> list[AgentNode]:
        """The agents as a tree below at most ``top_fanout`` of them; its nodes in order."""
        if self._dialer.tls is not None:
            raise ValueError(f"{len(self.hosts)} agents would form a tree (tree_threshold="
                             f"{self.tree_threshold}), which does not use TLS yet: raise "
                             f"tree_threshold to connect to each agent over TLS")
        wanted = self.quorum or len(self.hosts)
        entries = [(i + 1, *parse_host(h)) for i, h in enumerate(self.hosts)]
        while True:
            formation = agenttree.form(entries, self.fanout, self._dialer.connect, deadline,
                                       attaching=self.attach_request, top=self.top_fanout)
            if formation.refused:
                formation.close()
                raise formation.refused[0]
            if len(formation.nodes) >= wanted:
                break
            formation.close()
            if time.monotonic() + CONNECT_RETRY >= deadline:
                raise QuorumTimeout(wanted, [formation.nodes[i][0] for i in sorted(
                    formation.nodes)], dict(formation.missing.values()), self.quorum_timeout)
            time.sleep(CONNECT_RETRY)
        nodes = [self.members.tree_of(head, formation.nodes) for head in formation.heads]
        self.members.next_id = len(entries) + 1
        return sorted((n for tree in nodes for n in tree), key=lambda n: n.tree_id)

    def _heartbeats(self) -> None:
        """Judge each agent's silence (often: a node lost is known within a fraction of a
        second of its limit), and ping the agents (they judge this controller by theirs)."""
        name, limit = min(("node_timeout", self.node_timeout),
                          ("heartbeat_timeout", self.heartbeat_timeout), key=lambda x: x[1])
        check = max(0.05, min(0.5, limit / 10))
        ping_every = max(0.05, min(5.0, self.heartbeat_timeout / 5))
        next_ping = time.monotonic()
        while not self._stopping.wait(check):
            ping = time.monotonic() >= next_ping
            if ping:
                next_ping = time.monotonic() + ping_every
            for link in list(self.members.links):
                if link.lost_reason is not None:
                    continue
                if link.unread():  # read before judging: its bytes are signs of life
                    link.catch_up(check)
                silent = time.monotonic() - link.heard
                if silent > limit and not link.unread():
                    link.lose(f"it was silent for {silent:.0f} s ({name}={limit:g} s: its "
                              f"agent frozen, its machine gone or its link cut)")
                elif ping:
                    link.send(agentwire.ping())

    # -- nodes ------------------------------------------------------------------------

    def _reserve(self, layout: Layout, *, gpus_per_worker: int, timeout: float,
                 holder: str) -> list[Node]:
        agents = self.members.current(self._in_use)  # lost out, admitted ones in
        self._in_use = layout.nodes
        if layout.nodes > len(agents):
            raise ValueError(f"nodes={layout.nodes} but {len(agents)} agents answered "
                             f"({', '.join(a.name for a in agents) or 'none'})")
        if self.sync is not None and self.code_version is not None and any(
                a.code_path is None for a in agents[:layout.nodes]):
            self.reload_code()  # nodes admitted since: every node gets the code as it is now
        chosen = agents[:layout.nodes]
        gpus = [tuple(agent.welcome.get("gpus") or ()) for agent in chosen]
        if self.placed_gpus is not None:  # on a pool's slots: the pool holds them
            gpus = list(self.placed_gpus)
            if self.placed_hold is not None and self._holding is None:  # until it closes
                self._holding = agentgpus.share(chosen, self.placed_hold)
        elif gpus_per_worker and self.attach_request is not None:  # px.attach: the group's
            gpus = self._attached_gpus(chosen, [c * gpus_per_worker for c in layout.counts])
        elif gpus_per_worker and all(layout.counts[n] * gpus_per_worker <= len(gpus[n])
                                     for n in range(layout.nodes)):  # else placement says
            gpus = self.hold_gpus(chosen, [c * gpus_per_worker for c in layout.counts],
                                  holder)
        return [Node(index=n, address=agent.welcome.get("address") or agent.host,
                     ranks=layout.counts[n], gpus=gpus[n], same_host=agent.same_host)
                for n, agent in enumerate(chosen)]

    def hold_gpus(self, agents: Sequence[AgentNode], counts: Sequence[int],
                  holder: str) -> list[tuple[str, ...]]:
        """``counts[n]`` GPUs of ``agents[n]``'s node for ``holder`` until :meth:`close` (or
        the next call: reserving again, for a restart, gives the others back first) -> each
        node's ids; DevicesTaken naming the node and who holds them."""
        self._give_back_gpus()
        name = agentgpus.holder_name(holder)
        gpus = agentgpus.hold(agents, counts, name)
        self._holding = (name, list(agents))
        return gpus

    def _attached_gpus(self, agents: Sequence[AgentNode],
                       counts: Sequence[int]) -> list[tuple[str, ...]]:
        """The GPUs the detached group being attached holds on each of ``agents``' nodes
        (``counts[n]`` each), as its sessions there say (DESCRIBE): those its ranks run on.
        Taken over, not held anew: ATTACH moves this controller's connections to those
        sessions, which hold them on -- through a restart, for this controller, or the
        next -- and free them when the group ends. DevicesTaken naming the node where
        the group holds other than its ranks there need."""
        assert self.attach_request is not None
        name = self.attach_request[0]
        below = [agent.where for agent in agents if not agent.direct]
        if below:  # their sessions are the top agents' children, which DESCRIBE does not ask
            raise RuntimeError(f"attaching detached group {name}: its GPUs on nodes below "
                               f"a tree's top agents ({', '.join(below[:3])}) cannot be told "
                               "yet; use fewer agents than tree_threshold")
        held: dict[AgentNode, tuple[str, ...]] = {}

        def ask(agent: AgentNode) -> None:
            described = agent.request(agentwire.DESCRIBE, name)
            held[agent] = tuple(described.get("gpus") or ())

        _on_each(list(agents), ask, "phalanx-attach-gpus")
        out = [held[agent] for agent in agents]
        for agent, gpus, count in zip(agents, out, counts, strict=True):
            if len(gpus) != count:
                raise DevicesTaken(f"{agent.where}: detached group {name} holds "
                                   f"{len(gpus)} GPU(s) there ({', '.join(gpus) or 'none'}), "
                                   f"not the {count} its ranks there were given")
        return out

    def _give_back_gpus(self) -> None:
        if self._holding is not None:
            name, agents = self._holding
            self._holding = None
            agentgpus.give_back(agents, name)

    @property
    def capabilities(self) -> Capabilities:
        """Everything: its agents hold put objects and copies of other machines' kept
        results, its first agents are a pool's nodes, it ships code (``sync``), its
        nodes may change (DNS), and the ranks of a node share their agent's connection."""
        return Capabilities(objects=self, kept_copies=self, slots=self, code=self,
                            changing=self, detaching=self, shared_links=True)

    # -- a detached group (phalanx.controller.attach) --------------------------------------

    def detach(self, name: str, timeout: float | None, spec: bytes) -> None:
        def tell(agent: AgentNode) -> None:
            agent.request(agentwire.DETACH, name, timeout, payload=[spec])

        used = self.members.nodes[:self._in_use]  # the group's: the first in_use, in order
        # in a tree, its top agents: the nodes below them see no controller come or go (the
        # agents above them stay), and the top ones keep their subtrees' orphans
        _on_each([node for node in used if node.lost_reason is None and node.direct], tell,
                 "phalanx-detach")

    @property
    def dialer(self) -> Dialer:
        """How this backend reaches an agent (its token and TLS)."""
        return self._dialer

    def agent_hosts(self) -> list[str]:
        """The agents' ``host:port`` as configured (``hosts=``; a backend that finds its
        agents finds them now)."""
        return list(self.hosts) if self.hosts or not self.finds_agents else self._find_agents()

    def attach_to(self, name: str, force: bool) -> None:
        self.attach_request = (name, force)

    def carry_over(self, original: Backend) -> None:
        if isinstance(original, ClusterBackend):  # px.attach's: the copy takes over too
            self.attach_request = original.attach_request

    def attaching(self) -> str | None:
        return None if self.attach_request is None else self.attach_request[0]

    def describe(self, name: str) -> dict[str, Any]:
        from phalanx.backends.cluster import detaching

        return detaching.describe(self, name)

    def listing(self) -> list[dict[str, Any]]:
        from phalanx.backends.cluster import detaching

        return detaching.listing(self)

    def orphans(self, take: bool) -> list[list[Any]]:
        found: list[list[Any]] = []
        lock = threading.Lock()

        def ask(agent: AgentNode) -> None:
            answer = agent.request(agentwire.ORPHANS, take)
            with lock:
                found.extend(answer)

        _on_each(list(self.members.nodes), ask, "phalanx-orphans")
        return sorted(found, key=lambda o: (o[3], o[0]))  # by call, then rank

    def leave(self) -> None:
        self._stopping.set()  # its GPUs stay held: the ranks on them run on
        self.members.close()
        if self.opened:
            self._logs.stop()

    def reserve_slots(self, counts: Sequence[int], *, gpus: int,
                      resources: Mapping[str, float], timeout: float,
                      holder: str = "a pool") -> SlotReservation:
        """The first agents of ``hosts`` (:mod:`phalanx.backends.cluster.pool`)."""
        from phalanx.backends.cluster.pool import reserve_slots

        return reserve_slots(self, counts, gpus, resources, holder, timeout)

    def available_nodes(self) -> int:
        return self.members.available(self._in_use or len(self.members.nodes))

    def connection_count(self) -> int:
        """How many agents this backend holds a connection to now (a group runs on a copy
        of the backend it is given: ``group._backend``)."""
        return self.members.connection_count()

    def ports(self, node: Node, count: int) -> list[int]:
        return list(self.members.nodes[node.index].request(agentwire.PORTS, count))

    def _launch(
        self, node: Node, ranks: list[RankStart], boot: Boot, channels: list[Channel]
    ) -> None:
        agent = self.members.nodes[node.index]
        starts: list[tuple[int, int, int, dict[str, str]]] = []
        made: list[AgentRankChannel] = []
        for start in ranks:
            channel = AgentRankChannel(agent, start, next(self._incarnations), self._logs)
            channels.append(channel)
            made.append(channel)
            starts.append((start.rank, start.node, channel.incarnation, dict(start.env)))
        for channel in made:
            agent.link.adopt(channel)
        same, code = node.same_host, agent.code_path
        if code is not None and self.code_version is not None:  # the shipped code first
            for _, _, _, env in starts:
                env[codesync.ENV_VERSION] = self.code_version
        options = dict(boot.options)
        controller_path = boot.sys_path
        if boot.python is not None:  # python=: a path on the agent's node, checked there
            if same:  # the same files: checked here too, the error a ValueError
                require_interpreter(boot.python, f"{agent.where} (this machine)")
            options["python"] = boot.python
            controller_path = without_own_install(controller_path)  # its own, not ours
        sys_path = ([code] if code else []) + (list(controller_path) if same else [])
        cwd = code or ((boot.cwd or os.getcwd()) if same else None)
        if self.attach_request is not None and node.index not in self._taken_over:
            name, force = self.attach_request  # px.attach: the group's running ranks
            pids = agent.request(agentwire.ATTACH, name, starts, force)
            self._taken_over.add(node.index)  # a rank started again there is launched
        else:
            pids = agent.request(agentwire.LAUNCH, starts, sys_path, options, cwd,
                                 payload=boot.payload)
        for channel, pid in zip(made, pids, strict=False):
            channel.pid = pid or None

    def reload_code(self) -> str | None:
        """Ship the ``sync`` directory to every node (only the files a node lacks); the
        code's version, or None without ``sync``. Ranks started from now on run it."""
        if self.sync is None:
            return None
        version, listing = codesync.scan(self.sync)
        self._ship_all([a for a in self.members.nodes if a.lost_reason is None], version,
                       listing)
        self.code_version = version
        return version

    def _ship_all(self, agents: list[AgentNode], version: str,
                  listing: list[codesync.Entry]) -> None:
        def ship(agent: AgentNode) -> None:
            agent.code_path = _ship(agent, self.sync, version, listing)

        _on_each(agents, ship, "phalanx-cluster-sync")

    # -- shared objects ---------------------------------------------------------------

    def share(self, obj: HeldObject, channels: Sequence[Channel]) -> None:
        """Each node's agent gets the object once (HOLD) and tells its ranks, those it
        starts later included; the controller keeps the bytes for nodes admitted later."""
        agents = [a for a in _by_agent(channels) if obj.id not in a.holding]
        segments = obj.segments
        if segments is None:
            return  # freed meanwhile

        def hold(agent: AgentNode) -> None:
            try:
                agent.request(agentwire.HOLD, obj.id, obj.token, obj.tensors,
                              payload=segments)
            except PhalanxError as exc:
                raise PhalanxError(f"{agent.where} could not hold {obj.label} "
                                   f"({obj.nbytes} bytes): {exc}") from None
            agent.holding.add(obj.id)

        _on_each(agents, hold, "phalanx-cluster-hold")

    def unshare(self, obj: HeldObject | KeptCopy, channels: Sequence[Channel]) -> None:
        for agent in list(self.members.nodes):
            if obj.id in agent.holding and agent.lost_reason is None:
                agent.holding.discard(obj.id)
                agent.link.send(agentwire.request(agentwire.DROP, 0, obj.id,
                                                  node=agent.tree_id))

    def released(self, channel: Channel, ref_id: int) -> None:
        return None  # an agent's blocks are its own: it reuses none the controller knows of

    def segments(self, obj: HeldObject) -> list[Any] | None:
        return obj.segments  # kept for nodes admitted later

    def release_copy(self, copy: KeptCopy) -> None:
        self.unshare(copy, ())  # a kept result's copy is held (and dropped) as a put object

    def source_of(self, channel: Channel) -> NodeAddress | None:
        agent = getattr(channel, "agent", None)
        return None if agent is None else (agent.host, agent.port)

    def copy_kept(self, copy: KeptCopy, channels: Sequence[Channel]) -> None:
        """Each agent of ``channels`` on another machine than the producer's fetches the
        result from the producer's agent (COPY, which READs it there) and holds it."""
        host, port = copy.source
        wait = config.KEPT_COPY_TIMEOUT

        def fetch(agent: AgentNode) -> None:
            agent.request(agentwire.COPY, copy.id, copy.token, copy.location.block(), host,
                          port, wait, timeout=wait + REQUEST_TIMEOUT)
            agent.holding.add(copy.id)

        _on_each([a for a in _by_agent(channels) if copy.id not in a.holding
                  and a.welcome.get("blocks", a.welcome.get("machine")) != copy.machine],
                 fetch, "phalanx-cluster-copy")

    def _stop(self, channels: list[Channel], *, grace: float, force: bool) -> None:
        for agent, ranks in _by_agent(channels).items():
            try:
                agent.request(agentwire.STOP, ranks, grace, force,
                             timeout=grace + config.CLEANUP_WAIT + REQUEST_TIMEOUT)
            except PhalanxError as exc:
                logger.debug("stopping ranks %s: %s", ranks, exc)

    def wait_exited(self, channels: Sequence[Channel], timeout: float) -> None:
        for agent, ranks in _by_agent(channels).items():
            try:
                agent.request(agentwire.WAIT, ranks, timeout, timeout=timeout + REQUEST_TIMEOUT)
            except PhalanxError:
                pass

    def close(self) -> None:
        self._stopping.set()
        self._give_back_gpus()  # before the connections end: free for the next at once
        self.members.close()
        if self.opened:
            self._logs.stop()


SHIP_CHUNK = 64 << 20  # bytes of files per BLOBS request


def _ship(agent: AgentNode, root: Any, version: str, listing: list[codesync.Entry]) -> str:
    """The path of ``version`` on ``agent``'s node, sending the files it lacks first."""
    answer = agent.request(agentwire.SYNC, version, listing)
    path: str | None = answer["path"]
    if path is not None:
        return path
    batch: list[tuple[str, bytes]] = []
    size = 0
    for digest, data in [*codesync.read_blobs(root, listing, answer["missing"]), ("", b"")]:
        if (size + len(data) > SHIP_CHUNK or not digest) and batch:
            agent.request(agentwire.BLOBS, [d for d, _ in batch],
                         payload=[b for _, b in batch], timeout=REQUEST_TIMEOUT * 5)
            batch, size = [], 0
        if digest:
            batch.append((digest, data))
            size += len(data)
    made: str = agent.request(agentwire.TREE, version, listing, timeout=REQUEST_TIMEOUT * 5)
    return made


def _tls_context(tls: bool | str | ssl.SSLContext | None) -> ssl.SSLContext | None:
    """``tls``: None/False (plain TCP), True (the system's CAs), a CA file, or a context."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    if isinstance(tls, (str, os.PathLike)):
        try:
            return ssl.create_default_context(cafile=os.fspath(tls))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls={tls!r}: cannot load the CA certificates: {exc}") from None
    raise TypeError(f"tls must be True, a CA file or an ssl.SSLContext, got {tls!r}")


def _on_each(agents: list[AgentNode], task: Callable[[AgentNode], None], name: str) -> None:
    """``task(agent)`` for every agent at once, on threads; the first error is raised."""
    errors: list[BaseException] = []

    def run(agent: AgentNode) -> None:
        try:
            task(agent)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, naming the node
            errors.append(exc)

    if len(agents) == 1:
        run(agents[0])
    else:
        threads = [threading.Thread(target=run, args=(agent,), daemon=True, name=name)
                   for agent in agents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def _by_agent(channels: Sequence[Channel]) -> dict[AgentNode, list[int]]:
    groups: dict[AgentNode, list[int]] = {}
    for channel in channels:
        if isinstance(channel, AgentRankChannel):
            groups.setdefault(channel.agent, []).append(channel.rank)
    return groups

