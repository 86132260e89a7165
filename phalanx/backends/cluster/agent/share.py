"""An agent holding its node's copy of a controller's put objects (``group.put()``).

The controller sends each object once per node (HOLD, the pickle and its buffers as the
payload); the session writes it into a shared-memory block -- the node side's one holder,
:class:`phalanx.node.shm.Holder` -- and tells every rank of the node where it is (SHARE),
and every rank started there later too. DROP frees it: the ranks forget it (UNSHARE) and
the block goes once no rank maps it. Blocks live only in the agent's memory: they end with
the session, however it ends.

What one session holds is bounded twice: at most ``config.AGENT_MAX_HELD`` objects (each a
descriptor of the agent's), and at most ``config.AGENT_MAX_HELD_BYTES`` bytes (``phalanx
agent --max-held-mib``; by default half the node's memory, :func:`held_bytes_limit`). A
HOLD or COPY past either is refused with an :class:`~phalanx.backends.cluster.messages.
OverLimit` naming the limit, before its block is made, and the session goes on. The bytes
are reserved before a block is written, so HOLDs running at once on their request threads
cannot together pass the limit. The agent keeps every block it holds mapped, its pages
present (:meth:`phalanx.wire.memfd.Block.map_resident`): the held bytes are part of the
agent's own resident set (``RssShmem``), so the kernel's OOM killer, on a node short of
memory, sees them as the agent's -- whose end frees them -- rather than as no one's.

A result kept on a rank of another machine (``keep=True``) comes the same way, but from
the producer's node, not from the controller: COPY names the producer's agent and where
its rank keeps the result; this agent connects to that one (the token proved both ways,
as between the agents of a tree), READs the block's parts, and holds them as HOLD would,
under the id the controller gave the copy. The agent that is read maps its rank's block
(``/proc/<pid>/fd/<n>``) and sends its parts; it never unpickles them.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.node import shm
from phalanx.rank import shared as rankshared
from phalanx.wire import framing, protocol
from phalanx.wire.memfd import extents_of

logger = logging.getLogger(__name__)


class NodeObjects:
    """A session's put objects, and telling the node's ranks of them.

    ``lock`` is the session's: held while the ranks are told, and while the session adds a
    rank it launches to those ``ranks()`` returns, so that every rank hears of every
    object exactly once. A rank is anything with ``rank`` (its number) and ``conn``.
    ``max_bytes``: the most bytes held at once (None: :func:`held_bytes_limit`).
    """

    def __init__(self, lock: threading.Lock, ranks: Callable[[], list[Any]],
                 secret: bytes | None = None,
                 writer: framing.BacklogWriter | None = None,
                 tls: ssl.SSLContext | None = None, max_bytes: int | None = None) -> None:
        self._lock = lock
        self._ranks = ranks
        self._holder = shm.Holder()
        self._max_bytes = held_bytes_limit() if max_bytes is None else max_bytes
        self._room = threading.Lock()  # guards the two below (never held while writing)
        self._sizes: dict[int, int] = {}  # ref id -> its block's bytes, once held
        self._reserved = 0  # bytes of blocks being written now
        self._secret = secret  # to reach other agents (COPY)
        self._tls = tls  # TLS to them, when this agent serves TLS
        self._writer = writer

    def check_room(self, ref_id: int) -> None:
        """Before a HOLD starts: OverLimit if it would hold one object more than
        ``config.AGENT_MAX_HELD`` (replacing one held already takes no room)."""
        held = len(self._holder.objects())
        if held >= config.AGENT_MAX_HELD and self._holder.where(ref_id) is None:
            raise agentwire.OverLimit(f"HOLD: the objects held are {held + 1}, over the "
                                      f"agent's limit of {config.AGENT_MAX_HELD} "
                                      "(phalanx.config.AGENT_MAX_HELD)")

    @property
    def held_bytes(self) -> int:
        """The bytes of the blocks held now."""
        with self._room:
            return sum(self._sizes.values())

    def check_bytes(self, size: int, reserve: bool = False, what: str = "HOLD") -> None:
        """OverLimit if ``size`` bytes more would take what is held (and being written)
        past ``max_bytes``; ``reserve``: count them as being written (until
        :meth:`_settle`)."""
        with self._room:
            total = sum(self._sizes.values()) + self._reserved + size
            if total > self._max_bytes:
                raise agentwire.OverLimit(
                    f"{what}: an object of {size} bytes would make the bytes held {total}, "
                    f"over the agent's limit of {self._max_bytes} "
                    "(phalanx.config.AGENT_MAX_HELD_BYTES, phalanx agent --max-held-mib); "
                    "free objects no longer needed (ref.free())")
            if reserve:
                self._reserved += size

    def _settle(self, reserved: int, ref_id: int | None = None, size: int = 0) -> None:
        """A write that reserved ``reserved`` bytes ended: held as ``ref_id`` (replacing
        any earlier copy), or not at all."""
        with self._room:
            self._reserved -= reserved
            if ref_id is not None:
                self._sizes[ref_id] = size

    def hold(self, ref_id: int, token: str, writable: bool, payload: list[Any]) -> int:
        """HOLD: write the object into a block; every rank of the node hears of it. The
        block's size."""
        if not shm.supported():
            raise RuntimeError("this node cannot hold shared objects (it needs Linux's "
                               "memfd_create and /proc)")
        size = extents_of(payload)[1]  # Block.holding's capacity
        self.check_bytes(size, reserve=True)
        kept = False
        try:
            written = self._holder.write(payload)  # the copy is made before the lock is taken
            try:
                written[0].map_resident()  # its bytes count in the agent's RSS
                with self._lock:
                    location = self._holder.keep(ref_id, token, written, writable=writable)
                    kept = True
                    for rank in self._ranks():
                        _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))
            finally:
                if not kept:
                    written[0].close()
        finally:
            self._settle(size, ref_id if kept else None, size)
        return size

    def copy(self, ref_id: int, token: str, block: list[Any], host: str, port: int,
             timeout: float, payload: list[Any]) -> int:
        """COPY: fetch a kept result from the agent at ``host:port`` (READ) and hold it as
        object ``ref_id`` (see :meth:`hold`). The copy's size."""
        if self._holder.where(ref_id) is not None:
            return 0  # held already (another call named it meanwhile)
        self.check_room(ref_id)
        self.check_bytes(sum(n for _, n in block[3]), what="COPY")  # at least its parts
        if self._secret is None or self._writer is None:
            raise RuntimeError("this agent cannot reach other agents (it has no token)")
        where = f"the agent at {host}:{port}"
        try:
            joined = agenttree.connect_agent(host, port, self._secret, self._tls, timeout,
                                             own="the agent of the consuming node")
        except OSError as exc:
            raise RuntimeError(f"could not reach {where}: {exc}") from None
        try:
            joined.sock.settimeout(timeout)
            conn = joined.connection(self._writer)
            conn.send(agentwire.request(agentwire.READ, 1, list(block)))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for segs in conn.reader.recv_frames(block=True):
                    try:
                        kind, request_id, _, extra = protocol.parse(segs[0])
                        if kind == agentwire.FAULT:
                            raise RuntimeError(f"{where} refused to READ: {extra[0]}")
                        if kind != agentwire.REPLY or request_id != 1:
                            continue  # its PINGs
                        ok, value = extra
                    except RuntimeError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - unpickling bad bytes raises anything
                        raise framing.FrameTooLarge(
                            f"a malformed message ({type(exc).__name__}: {exc})") from None
                    if not ok:
                        raise RuntimeError(f"{where} could not READ it: {value}")
                    tensors = len(block) > 5 and block[5] is True  # copy-on-write views
                    return self.hold(ref_id, token, tensors, segs[1:])
            raise RuntimeError(f"{where} did not answer READ within {timeout:g} s")
        except framing.FrameTooLarge as exc:  # bytes that are no message: this copy alone
            logger.warning("ending the copy of object %d from %s: it sent %s", ref_id, where,
                           exc)
            raise RuntimeError(f"{where} sent {exc} during READ") from None
        except (OSError, framing.ConnectionLost) as exc:
            raise RuntimeError(f"the connection to {where} failed during READ: {exc}") from None
        finally:
            joined.close()

    def drop(self, ref_id: int) -> None:
        """DROP: the object was freed."""
        with self._lock:
            if self._holder.where(ref_id) is None:
                return
            for rank in self._ranks():
                _send(rank, protocol.unshare_frame(rank.rank, ref_id))
            self._holder.drop(ref_id)
        with self._room:
            self._sizes.pop(ref_id, None)

    def share_with(self, rank: Any) -> None:
        """A rank just launched (the session's lock held): where every object held now
        is."""
        for ref_id, token, location in self._holder.objects():
            _send(rank, protocol.share_frame(rank.rank, ref_id, token, location))

    def close(self) -> None:
        self._holder.close()
        with self._room:
            self._sizes.clear()


def held_bytes_limit() -> int:
    """The most bytes one session holds: ``config.AGENT_MAX_HELD_BYTES``, or half this
    node's memory -- its cgroup's limit, if lower (a container's, a Slurm job's)."""
    if config.AGENT_MAX_HELD_BYTES is not None:
        return config.AGENT_MAX_HELD_BYTES
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_memory_limit()
    return (memory if limit is None else min(memory, limit)) // 2


def _cgroup_memory_limit() -> int | None:
    """The lowest ``memory.max`` of this process's cgroup (v2) and its ancestors; None if
    there is none or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    lowest = None
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), 0, -1):
        try:
            with open(os.path.join("/sys/fs/cgroup", *parts[:depth], "memory.max")) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            lowest = int(value) if lowest is None else min(lowest, int(value))
    return lowest


def read(block: list[Any], payload: list[Any]) -> agentwire.WithPayload:
    """READ: the parts of a block a rank of this node keeps a result in, as the reply's
    payload (views of a mapping of it: sent without a copy here)."""
    pid, fd, name, extents, capacity = block[:5]
    try:
        mapping = rankshared.map_block(pid, fd, name, capacity, False, locked=True)
    except rankshared.NotShared as exc:
        raise LookupError(f"the rank that kept it is gone: {exc}") from None
    view = memoryview(mapping)
    return agentwire.WithPayload(len(extents), [view[o:o + n] for o, n in extents])


def _send(rank: Any, frame: list[Any]) -> None:
    try:
        rank.conn.send(frame)
    except framing.ConnectionLost:
        pass  # its death is reported from the status pipe
