"""Connections not proved yet: a bounded number, shared fairly between peer addresses.

A listener that strangers can reach (an agent's control port and its HTTP port, a Ray
group's listener) holds every connection it took in an :class:`Admission` until its peer
proved itself (or, on the HTTP port, until its answer is sent). Each has a deadline; and
at most ``limit`` are held at once, ``per_peer`` of them from one address. When a new
connection would go over either bound, the newcomer is taken and an older one is shut down
instead -- the oldest of the same address when that address is at its share, else the
oldest of the address holding the most -- so strangers that hold every slot cannot lock
out a real controller, rank or probe: it arrives newest, from an address of its own (or
its address's newest), and finishes its handshake in a round trip or two, long before the
strangers' next connections come round to it.

:meth:`Admission.admit` before a connection gets a thread, :meth:`Admission.release` once
its peer proved itself (or failed); :meth:`Admission.expire`, every moment, shuts down
those past their deadline, so a handshake that trickles (TLS reads one record at a time,
each under its own timeout) still ends on time. A connection is shut down by its
descriptor's number while it is held (a TLS wrapper takes the descriptor from the socket
object admitted), which is why its owner releases it before closing it: a closed number is
the next socket's. As a second guard, the admission notes which socket the descriptor is
(its inode) when it admits it, and leaves a number that names another one now alone.
"""

from __future__ import annotations

import os
import socket
import threading
import time

_Descriptor = tuple[int, int]  # a socket's descriptor: its number, and its inode


class Admission:
    """Connections in their handshake: how many in all and per peer address, and each one's
    deadline. Thread-safe."""

    def __init__(self, limit: int, per_peer: int, timeout: float, *,
                 spared: frozenset[str] = frozenset()) -> None:
        """``spared``: peers never shut down to make room for another's connection (a
        listener's own machine, reached on a socket strangers cannot open), unless only they
        hold any."""
        if limit < 1 or per_peer < 1 or not timeout > 0:
            raise ValueError(f"an admission needs limits of at least 1 and a positive "
                             f"timeout, not {limit!r}, {per_peer!r}, {timeout!r}")
        self.limit, self.per_peer, self.timeout = limit, min(per_peer, limit), timeout
        self.spared = spared
        self._lock = threading.Lock()
        # each connection, oldest first -> its peer, deadline, and descriptor: its number
        # and which socket that is (its inode)
        self._pending: dict[socket.socket, tuple[str, float, _Descriptor]] = {}
        self._per_peer: dict[str, int] = {}
        self.evicted = 0  # connections shut down to make room, in all

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def __contains__(self, sock: object) -> bool:
        """Whether ``sock`` is held: admitted, and neither released nor shut down to make
        room (one past its deadline is held until its thread releases it)."""
        with self._lock:
            return sock in self._pending

    def held_by(self, peer: str) -> int:
        with self._lock:
            return self._per_peer.get(peer, 0)

    def admit(self, sock: socket.socket, peer: str, *, share: int | None = None) -> str | None:
        """Take ``sock`` in; if that made room by shutting an older connection down, say
        whose (for the log), else None. ``share``: this peer's own bound instead of
        ``per_peer`` (a listener's own machine, say)."""
        mine = self.per_peer if share is None else min(share, self.limit)
        with self._lock:
            victim = None
            if self._per_peer.get(peer, 0) >= mine:
                victim = self._oldest_of(peer)
            elif len(self._pending) >= self.limit:
                others = [p for p in self._per_peer if p not in self.spared] or list(
                    self._per_peer)
                heaviest = max(others, key=lambda p: self._per_peer[p])
                victim = self._oldest_of(heaviest)
            why = None
            if victim is not None:
                victim_peer, descriptor = self._forget(victim)
                _shut_down(descriptor)
                self.evicted += 1
                why = (f"the oldest connection in its handshake from {victim_peer} was shut "
                       f"down to make room ({self.limit} at most, {mine} from one address)")
            self._pending[sock] = (peer, time.monotonic() + self.timeout, _descriptor(sock))
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        return why

    def release(self, sock: socket.socket) -> None:
        """``sock`` is no longer held (twice is once; an evicted one is not held)."""
        with self._lock:
            if sock in self._pending:
                self._forget(sock)

    def expire(self) -> int:
        """Shut down every connection past its deadline (its thread then fails and releases
        it); how many."""
        now = time.monotonic()
        with self._lock:  # a connection is released before it is closed: the fd is its own
            late = [descriptor for _, deadline, descriptor in self._pending.values()
                    if deadline <= now]
            for descriptor in late:
                _shut_down(descriptor)
        return len(late)

    # -- with the lock held --------------------------------------------------------------

    def _oldest_of(self, peer: str) -> socket.socket | None:
        return next((sock for sock, entry in self._pending.items() if entry[0] == peer), None)

    def _forget(self, sock: socket.socket) -> tuple[str, _Descriptor]:
        """Stop holding ``sock`` -> its peer and descriptor."""
        peer, _, descriptor = self._pending.pop(sock)
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]
        return peer, descriptor


def _descriptor(sock: socket.socket) -> _Descriptor:
    fd = sock.fileno()
    try:
        return fd, os.fstat(fd).st_ino
    except OSError:  # closed already (its peer's reset cannot close it: only its owner)
        return fd, -1


def _shut_down(descriptor: _Descriptor) -> None:
    """Shut the connection on ``descriptor`` down (its thread reads EOF and ends), unless
    that number was closed and names another socket now; the descriptor stays its owner's
    to close."""
    fd, inode = descriptor
    try:
        if os.fstat(fd).st_ino != inode:  # (a socket's inode is its own while it is open)
            return
    except OSError:  # closed, and no other took the number yet
        return
    view = socket.socket(fileno=fd)  # the same descriptor, not a copy
    try:
        view.shutdown(socket.SHUT_RDWR)
    except OSError:  # its peer reset it meanwhile
        pass
    finally:
        view.detach()
