"""A node agent's part in a tree (:mod:`phalanx.backends.cluster.tree`): its children and what it
forwards to and from them. A :class:`Branch` is held by each
:class:`phalanx.backends.cluster.agent.ranks.Session`, which tells it what passes and gives
it what it needs of the session (:class:`Relay`): how to send up, and how to watch a
child's connection in the session's poll.

Down: a node's request for another node of the subtree goes to the child above that node;
a rank's message goes once to each child whose subtree holds some of its ranks, its header
naming those. Up: what a child sends is relayed unchanged, except the results of calls,
which are *gathered*: an agent holds the results of its subtree's ranks for a call until
every one of them answered -- or none came for ``GATHER_WINDOW`` (the others are late:
those in hand go up now, the late ones after), or it held them ``GATHER_MOST`` -- and
sends them up as one RESULTS message, in rank order -- so the controller reads one message
per top agent, not one per rank, and reads it in one pass: the ranks' pickles travel back
to back in one segment, their lengths in the header
(:func:`phalanx.backends.cluster.messages.results`). Errors, deaths and lost children go up
at once (a failure anywhere reaches the controller without waiting for the rest), and the
ranks they concern are no longer waited for.

A detached group's tree (:mod:`phalanx.backends.cluster.agent.detached`) waits at its top
agents: when the controller leaves, the calls gathered then become *inherited*, and each
answer to one that reaches this node -- its own ranks' or a child's -- is handed to the
session's keeper of orphans instead of going up. The children and their ranks run on
untouched (their upstream, this agent, stays); the subtree this node formed is kept
(:attr:`Branch.formed`), so that a controller attaching learns it without forming it again.

A child is an agent with the token, but its messages are still checked before they are
read: a FAULT or RESULTS that is malformed (sizes or counts that do not give each rank its
own bytes and segments, ranks out of order, a header that does not parse) loses that
child, as its connection ending would.
"""

from __future__ import annotations

import logging
import select
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.wire import framing, protocol

logger = logging.getLogger(__name__)

# s: how long an agent holds results for a call while no more of them come (a subtree whose
# ranks answer one after the other, agents busy, is waited for; a late rank is not)
GATHER_WINDOW = 0.05
GATHER_MOST = 0.5  # s: the longest an agent holds a result waiting for its siblings'

_RESULT = protocol.RESULT
_RESULTS = agentwire.RESULTS


def malformed_from_child(segs: list[Any]) -> str | None:
    """What is wrong with a child's FAULT or RESULTS, before the relay reads it (None: it
    is well formed): a RESULTS must give each of its ranks its own bytes and segments
    (:func:`phalanx.backends.cluster.messages.read_results`)."""
    try:
        kind, _, _, extra = protocol.parse(segs[0])
    except Exception as exc:  # noqa: BLE001 - reading bad bytes raises anything
        return f"a malformed message header ({type(exc).__name__}: {exc})"
    if kind == agentwire.FAULT:
        return None if len(extra) == 1 else f"a FAULT with {len(extra)} fields"
    try:
        agentwire.read_results(segs)
    except Exception as exc:  # noqa: BLE001 - anything it raises says the message is bad
        return f"a malformed RESULTS ({exc})"
    return None


def _unread(conn: framing.Connection) -> bool:
    """Whether bytes from the peer wait on ``conn`` unread."""
    poller = select.poll()
    poller.register(conn.read_fd, select.POLLIN)
    return bool(poller.poll(0))


class _Child:
    """A child of this node in a tree: its connection and the nodes of its subtree."""

    def __init__(self, joined: agenttree.Joined, conn: framing.Connection, ids: list[int]) -> None:
        self.where = f"{joined.host}:{joined.port}"
        self.conn, self.ids = conn, ids
        self.heard = time.monotonic()


class _Gather:
    """The results of one call's ranks in this subtree, held until all are in."""

    __slots__ = ("got", "inherited", "last", "method", "since", "waiting")

    def __init__(self, method: str) -> None:
        self.method = method
        self.waiting: set[int] = set()  # ranks not answered yet
        self.got: dict[int, list[Any]] = {}  # rank -> its RESULT's payload segments
        self.since = 0.0  # when the first result held now arrived
        self.last = 0.0  # when the last one did
        self.inherited = False  # a call of a controller that left: its answers are orphans


# what keeps an answer to an inherited call: (rank, call id, method, ok, segments: the
# header first)
Orphans = Callable[[int, int, str, bool, list[Any]], None]


def _result(call_id: int, rank: int, payload: list[Any]) -> list[Any]:
    """The segments of ``rank``'s RESULT of ``call_id`` (``payload``: its pickle, buffers)."""
    return [protocol.header(_RESULT, call_id, rank), *payload]


class Relay(NamedTuple):
    """What a branch needs of its session (the relay thread's, unless said otherwise)."""

    writer: framing.BacklogWriter  # writes to the children's connections
    lock: threading.Lock  # the session's; guards children adopted by a request thread
    wake: Callable[[], None]  # wake the relay from another thread
    node_timeout: float  # a child silent this long is lost (frozen, gone, cut off)
    send: Callable[[list[Any]], None]  # a frame up, now (any thread)
    queue: Callable[[list[Any]], None]  # a frame up, with the rest of this pass
    watch: Callable[[int, Any], None]  # poll a child's descriptor: from_child(child) then
    unwatch: Callable[[int], None]


class Branch:
    """One agent's children in a tree, the routes down to them, and the results held on
    the way up."""

    def __init__(self, relay: Relay, secret: bytes | None,
                 tls: ssl.SSLContext | None = None) -> None:
        self._relay = relay
        self._secret = secret  # to reach children
        self._tls = tls  # TLS to them, when this agent serves TLS
        self.tree_id = 0  # this node's id in a tree (0: none)
        self._children: list[_Child] = []
        self._adopted: list[_Child] = []  # from the ADOPT request, to register
        self._node_route: dict[int, _Child] = {}  # tree node -> the child it is below
        self._rank_route: dict[int, _Child] = {}  # rank -> the child it is below
        self._gathers: dict[int, _Gather] = {}  # call id -> its results held here
        self._orphans: Orphans | None = None  # set once calls were inherited
        # what this node's ADOPT formed below it ({"nodes", "missing"}, as it answered)
        self.formed: dict[str, Any] = {"nodes": [], "missing": []}

    @property
    def has_children(self) -> bool:
        return bool(self._children)

    @property
    def routes_ranks(self) -> bool:
        """Whether some ranks are below children (a rank message may go down)."""
        return bool(self._rank_route)

    @property
    def gathering(self) -> bool:
        """Whether results are held (the relay then passes at least every
        ``GATHER_WINDOW``)."""
        return bool(self._gathers)

    @property
    def adopting(self) -> bool:
        """Whether children adopted by a request wait for :meth:`register_children`."""
        return bool(self._adopted)

    # -- gathering results ---------------------------------------------------------------

    def expect(self, call_id: int, ranks: tuple[int, ...], method: str) -> None:
        """A call of ``method`` for ``ranks`` of this subtree passes: gather their
        results."""
        gather = self._gathers.get(call_id)
        if gather is None:
            gather = self._gathers[call_id] = _Gather(method)
        gather.waiting.update(ranks)

    def inherit(self, orphans: Orphans) -> None:
        """The controller left: the calls gathered now are inherited, their answers (those
        held here already, and those to come) go to ``orphans``, not up."""
        self._orphans = orphans
        for call_id, gather in list(self._gathers.items()):
            gather.inherited = True
            got, gather.got, gather.since = gather.got, {}, 0.0
            for rank in sorted(got):
                self._orphan(call_id, gather, rank, True, _result(call_id, rank, got[rank]))
            if not gather.waiting:
                self._gathers.pop(call_id, None)

    def _orphan(self, call_id: int, gather: _Gather, rank: int, ok: bool,
                segs: list[Any]) -> None:
        """An answer to an inherited call (``segs``: the header first) to the keeper."""
        gather.waiting.discard(rank)
        if not gather.waiting:
            self._gathers.pop(call_id, None)
        assert self._orphans is not None  # (set by inherit, before any call is inherited)
        self._orphans(rank, call_id, gather.method, ok, [bytes(s) for s in segs])

    def ranks_below(self) -> list[int]:
        """The ranks of this subtree below this node's children."""
        return sorted(self._rank_route)

    def up(self, segs: list[Any], head: tuple[int, int, int]) -> None:
        """A message of a rank of this subtree, for the controller (``head``: its header's
        ``(kind, call id, rank)``)."""
        if self._gathers and self._held(segs, head):
            return
        self._relay.queue(framing.frame(list(segs)))

    def _up_results(self, segs: list[Any], gathered: protocol.Gathered) -> None:
        """A child's RESULTS (read and checked): held with the call's other results here,
        or, when this node gathers none for that call, passed up as it came."""
        call_id = protocol.unpack_head(segs[0])[1]
        gather = self._gathers.get(call_id)
        if gather is None:
            self._relay.queue(framing.frame(list(segs)))
            return
        if gather.inherited:
            for i, rank in enumerate(gathered.ranks):
                self._orphan(call_id, gather, rank, True,
                             _result(call_id, rank, gathered.payload(i)))
            return
        waiting, got = gather.waiting, gather.got
        for i, rank in enumerate(gathered.ranks):
            waiting.discard(rank)
            got[rank] = gathered.payload(i)
        gather.last = time.monotonic()
        if not gather.since:
            gather.since = gather.last

    def _held(self, segs: list[Any], head: tuple[int, int, int]) -> bool:
        """Whether a message going up is a result gathered here (else it goes at once; a
        failure stops the wait for its rank)."""
        kind, call_id, rank = head
        gather = self._gathers.get(call_id)
        if kind == _RESULT:
            if gather is None or rank not in gather.waiting:
                return False
            if gather.inherited:
                self._orphan(call_id, gather, rank, True, segs)
                return True
            gather.waiting.discard(rank)
            gather.got[rank] = segs[1:]
        elif kind == protocol.ERROR:
            if gather is not None:
                if gather.inherited and rank in gather.waiting:
                    self._orphan(call_id, gather, rank, False, segs)
                    return True
                gather.waiting.discard(rank)
            return False
        elif kind == protocol.EXITED:
            self.rank_gone((rank,))
            return False
        else:
            return False
        gather.last = time.monotonic()
        if not gather.since:
            gather.since = gather.last
        return True

    def rank_gone(self, ranks: Any) -> None:
        """``ranks`` will not answer (dead, or below a lost child): wait no more for them."""
        for gather in self._gathers.values():
            gather.waiting.difference_update(ranks)

    def send_gathered(self) -> None:
        """Send up what is complete, or held long enough (each pass of the relay)."""
        now = time.monotonic()
        for call_id, gather in list(self._gathers.items()):
            if gather.got and (not gather.waiting or now - gather.last >= GATHER_WINDOW
                               or now - gather.since >= GATHER_MOST):
                got = gather.got
                ranks = sorted(got)
                if len(ranks) == 1:
                    frame = protocol.result_frame(call_id, ranks[0], got[ranks[0]])
                else:
                    frame = agentwire.results(call_id, ranks, [got[r] for r in ranks])
                self._relay.queue(frame)
                gather.got, gather.since = {}, 0.0
            if not gather.waiting and not gather.got:
                del self._gathers[call_id]

    # -- routing ---------------------------------------------------------------------------

    def route_down(self, dest: int, kind: int, request_id: int, fields: tuple[Any, ...],
                   segs: list[Any]) -> None:
        """A node's request for node ``dest`` of this subtree: to the child above it."""
        child = self._node_route.get(dest)
        if child is None:
            if request_id and kind != agentwire.SIGNAL:
                self._relay.send(agentwire.reply(request_id, False, f"tree node {dest} cannot "
                                                 f"be reached through this agent (lost)"))
            return
        if kind == agentwire.LAUNCH:
            for start in fields[0]:
                self._rank_route[start[0]] = child
        self._to_child(child, framing.frame(list(segs)))

    def hand_down(self, ranks: tuple[int, ...], segs: list[Any]) -> tuple[int, ...]:
        """Send a rank message on to the children holding some of ``ranks`` (once each,
        naming theirs); the ranks left for this node."""
        own: list[int] = []
        below: dict[_Child, list[int]] = {}
        route = self._rank_route
        for rank in ranks:
            child = route.get(rank)
            if child is None:
                own.append(rank)
            else:
                below.setdefault(child, []).append(rank)
        for child, theirs in below.items():
            head = segs[0] if len(theirs) == len(ranks) else protocol.retarget(segs[0], theirs)
            self._to_child(child, framing.frame([head, *segs[1:]]))
        return tuple(own)

    def _to_child(self, child: _Child, frame: list[Any]) -> None:
        try:
            child.conn.send(frame)
        except framing.ConnectionLost as exc:
            self._lose_child(child, f"its connection failed ({exc})")

    def from_child(self, child: _Child) -> None:
        """Read what a child sent (its descriptor turned readable)."""
        try:
            frames = child.conn.reader.recv_frames(block=False)
        except framing.FrameTooLarge as exc:  # bytes that are no frame: this child alone
            self._lose_child(child, f"it sent {exc}")
            return
        except framing.ConnectionLost as exc:  # FrameRejected too: it says so
            self._lose_child(child, f"its connection ended ({exc})")
            return
        child.heard = time.monotonic()
        for segs in frames:
            if len(segs[0]) < protocol.HEAD_SIZE:
                self._lose_child(child, f"it sent a malformed message header ({len(segs[0])} "
                                 "bytes)")
                return
            kind = segs[0][0]
            if kind == agentwire.PING or kind == agentwire.WELCOME:
                continue
            if kind == _RESULTS:
                try:
                    gathered = agentwire.read_results(segs)
                except Exception as exc:  # noqa: BLE001 - anything it raises: a bad message
                    self._lose_child(child, f"it sent a malformed RESULTS ({exc})")
                    return
                self._up_results(segs, gathered)
                continue
            if kind == agentwire.FAULT:
                why = malformed_from_child(segs)
                self._lose_child(child, str(protocol.parse(segs[0])[3][0]) if why is None
                                 else f"it sent {why}")
                return
            self.up(segs, protocol.unpack_head(segs[0]))

    def check_children(self, now: float) -> None:
        """Lose the children silent too long; ping the others. Each child sends a sign of
        life every second from a thread of its own, and anything it sends counts; one whose
        bytes wait unread here is not silent (this relay is behind): it is read first."""
        limit = self._relay.node_timeout
        for child in list(self._children):
            if now - child.heard > limit and _unread(child.conn):
                self.from_child(child)
            if child not in self._children:
                continue
            if now - child.heard > limit:
                self._lose_child(child, f"it was silent for {now - child.heard:.0f} s "
                                        f"(node_timeout={limit:g} s: frozen, its machine "
                                        f"gone or its link cut)")
            else:
                self._to_child(child, agentwire.ping())

    def _lose_child(self, child: _Child, reason: str) -> None:
        """A child is gone: its whole subtree is, for the controller (relay thread only)."""
        if child not in self._children:
            return
        self._children.remove(child)
        self._relay.unwatch(child.conn.read_fd)
        child.conn.close()
        for tree_id in child.ids:
            self._node_route.pop(tree_id, None)
        below = [r for r, c in self._rank_route.items() if c is child]
        for rank in below:
            del self._rank_route[rank]
        self.rank_gone(below)
        logger.warning("lost the agent at %s (and %d node(s) below it): %s", child.where,
                       len(child.ids) - 1, reason)
        self._relay.queue(agentwire.lost(child.ids,
                                         f"lost the agent at {child.where}: {reason}"))

    def register_children(self) -> None:
        """Take on the children a request adopted (relay thread)."""
        with self._relay.lock:
            adopted, self._adopted = self._adopted, []
        for child in adopted:
            self._children.append(child)
            for tree_id in child.ids:
                self._node_route[tree_id] = child
            self._relay.watch(child.conn.read_fd, child)

    def adopt(self, own_id: int, entries: list[Any], fanout: int, timeout: float,
              payload: list[Any]) -> dict[str, Any]:
        """ADOPT (a request thread): become node ``own_id`` of a tree and adopt ``entries``
        below it."""
        secret, tls = self._secret, self._tls
        if secret is None:
            raise RuntimeError("this agent cannot reach other agents (it has no token)")
        self.tree_id = own_id

        def connect(host: str, port: int, timeout: float) -> agenttree.Joined:
            return agenttree.connect_agent(host, port, secret, tls, timeout)

        formation = agenttree.form([tuple(e) for e in entries], fanout, connect,
                                   time.monotonic() + timeout)
        children = [_Child(h.joined, h.joined.connection(self._relay.writer), h.ids)
                    for h in formation.heads]
        with self._relay.lock:  # registered by the relay before it reads the next request
            self._adopted.extend(children)
        self._relay.wake()
        self.formed = {
            "nodes": [[i, welcome] for i, (_, welcome) in formation.nodes.items()],
            "missing": [[i, where, why] for i, (where, why) in formation.missing.items()]}
        return self.formed

    def subtree(self) -> dict[str, Any]:
        """The subtree below this node as its ADOPT formed it, less the nodes lost since
        (an ADOPT's answer, for a controller attaching to a detached group)."""
        alive = self._node_route
        nodes = [[i, welcome] for i, welcome in self.formed["nodes"] if i in alive]
        lost = [[i, "?", "lost while the group was detached"]
                for i, _ in self.formed["nodes"] if i not in alive]
        return {"tree_id": self.tree_id, "nodes": nodes,
                "missing": [*self.formed["missing"], *lost]}

    def close(self) -> None:
        """End every child's connection (they stop their ranks in turn)."""
        for child in self._children + self._adopted:
            child.conn.close()
