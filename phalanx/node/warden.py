"""The warden of a rank that runs inside its Ray actor's process: its side stream, and
nothing of it outliving the actor.

A rank on Ray runs in its actor's own worker process (:mod:`phalanx.backends.ray.actor`),
whose main thread is busy with user code, so what the controller must be able to do
meanwhile is done from outside, by this small process the actor starts with fork and exec
(its child, so a sibling of whatever the rank starts). It holds

- the rank's *side stream* to the controller (``handshake.ROLE_SIDE``; sealed like the
  control stream across the network) and answers on it: ``SIGNAL`` (deliver a signal to
  the actor and everything below it, as a terminal would), ``STACKS`` (every thread's
  stack, written by the rank's stack thread into a file shared with this process:
  :mod:`phalanx.node.stacks`), ``STOP`` (SIGTERM the actor's tree, SIGKILL whatever is left
  after ``grace`` s);
- the read end of a pipe whose write end only the actor holds (the *notes*): the actor
  writes there how it is about to end (``exit N``, ``signal N``) and ``done N`` when it
  ended its rank itself. End of file without ``done`` means the actor died (``ray.kill``,
  Ray's out-of-memory killer, a signal, ``os._exit``): everything the actor had started
  is SIGKILLed -- this process keeps that list fresh every :data:`SCAN_INTERVAL` s, since
  the orphans of a dead actor are no longer below anything it can read -- and the
  controller is told on the side stream (``EXITED``) the exit status where it is known:
  the note, the status the kernel still holds for an unreaped actor, or the fatal signal
  this process itself delivered.

Started as ``python [-S] -c BOOT SIDE_FD NOTES_FD STACKS_FD ACTOR_PID`` (the side stream's
frame keys, across the network, in ``config.ENV_FRAME_KEYS``). The frames are
:mod:`phalanx.wire.framing` frames whose header is :func:`phalanx.wire.protocol.header`
with one of the kinds below; their fields are plain data. The controller's end of the
stream is :class:`SideStream`.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable

from phalanx.node import proctree
from phalanx.node.proctree import signals as signal  # _signal: no enums to import
from phalanx.wire import framing, protocol, seal, streams

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from typing import Any

# side stream kinds, apart from the control stream's (phalanx.wire.protocol: below 32)
# controller -> warden, call id: the request's, answered with ANSWER
SIGNAL = 32  # (signal number,)
STACKS = 33  # (timeout,)
STOP = 34  # (grace,)
ANSWER = 35  # warden -> controller, the request's call id: (text,)
EXITED = 36  # warden -> controller, call id 0: (pid, exit status or None, how it is known)

SCAN_INTERVAL = 0.2  # seconds between two readings of the actor's descendants
_KILL_WAIT = 5.0  # seconds for SIGKILLed processes to be gone
_REAP_LOOK = 0.05  # seconds to look for the dead actor's status while it is a zombie
_FATAL_BY_DEFAULT = frozenset(
    int(s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGILL,
                     signal.SIGABRT, signal.SIGFPE, signal.SIGKILL, signal.SIGSEGV,
                     signal.SIGPIPE, signal.SIGALRM, signal.SIGTERM, signal.SIGBUS,
                     signal.SIGUSR1, signal.SIGUSR2))

BOOT = "import sys; sys.path.insert(0, {root!r}); from phalanx.node.warden import main; main()"


def argv(side_fd: int, notes_fd: int, stacks_fd: int, actor_pid: int, *,
         site: bool) -> list[str]:
    """The warden's command line (``site``: with site-packages, for the seal's ciphers)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = [] if site else ["-S"]
    return [sys.executable, *flags, "-c", BOOT.format(root=root), str(side_fd),
            str(notes_fd), str(stacks_fd), str(actor_pid)]


def exit_status(pid: int) -> int | None:
    """The exit status of ``pid`` as the kernel keeps it once it is exiting (a zombie, its
    parent has not reaped it yet, or still tearing itself down): the exit code, or minus
    the signal that killed it."""
    status = proctree.exit_status(pid)
    return None if status is None else os.waitstatus_to_exitcode(status)


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (exited, or a zombie)."""
    state = proctree.state(pid)
    return state is None or state in "ZX"


def kill_all(pids: list[int], timeout: float = _KILL_WAIT) -> None:
    """SIGKILL ``pids`` and whatever is below them now, again until all are gone or
    ``timeout`` passes."""
    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        table = proctree.parent_table()
        targets = set(pids)
        for pid in pids:
            targets.update(proctree.descendants(pid, table))
        targets.discard(me)
        left = [pid for pid in targets if pid in table and table[pid][1] != "Z"]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proctree.reap_children()
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


class Warden:
    """One rank's warden (this process's main loop)."""

    def __init__(self, conn: framing.Connection | None, notes_fd: int, stacks_fd: int,
                 actor: int) -> None:
        self.conn = conn
        self.notes_fd = notes_fd
        self.actor = actor
        self.root = actor  # the rank's process: the actor's, or its child's (note "rank")
        self.below: list[int] = []  # the actor's descendants at the last scan
        self.note: tuple[str, int] | None = None  # the actor's last word on its end
        self.delivered: int | None = None  # the last fatal signal this process delivered
        self.ended = False  # the notes reached their end (the actor ended)
        self._notes = b""
        from phalanx.node.stacks import StackFile

        self.stacks = StackFile(stacks_fd)  # over the file the actor dumps into

    def scan(self) -> None:
        """Keep the list of the actor's descendants fresh (this process left out)."""
        me = os.getpid()
        self.below = [pid for pid in proctree.descendants(self.actor) if pid != me]

    def tree(self) -> list[int]:
        """The rank's process and what is below it now, this process left out."""
        self.scan()
        if self.root == self.actor:
            return [self.actor, *self.below]
        me = os.getpid()
        return [self.root, *(p for p in proctree.descendants(self.root) if p != me)]

    def run(self) -> None:
        poller = select.poll()
        side = self.conn.read_fd if self.conn is not None else None
        if side is not None:
            poller.register(side, select.POLLIN)
        poller.register(self.notes_fd, select.POLLIN)
        next_scan = 0.0
        while True:
            now = time.monotonic()
            if now >= next_scan:
                self.scan()
                next_scan = now + SCAN_INTERVAL
            for fd, _ in poller.poll(max(1, int((next_scan - time.monotonic()) * 1000))):
                if fd == self.notes_fd:
                    if not self._read_notes():
                        self.ended = True
                elif fd == side:
                    frames = self._receive()
                    if frames is None:  # the controller is gone: Ray ends us
                        poller.unregister(side)
                        side = None
                        continue
                    for segments in frames:
                        self._request(segments[0])
            if self.ended:
                self._actor_ended()
                return

    def _receive(self) -> list[list[Any]] | None:
        """The requests now complete on the side stream; None once it is lost (then the
        connection is dropped), here or while an answer was sent."""
        conn = self.conn
        if conn is None:
            return None
        try:
            return conn.reader.recv_frames(block=False)
        except framing.ConnectionLost:
            self.conn = None
            return None

    def _rank_ended(self, wait: float) -> bool:
        """Whether the actor said its rank ended (``done``) or ended, waiting up to
        ``wait`` s for its notes."""
        if not self.ended and streams.wait_readable([self.notes_fd], wait):
            self.ended = not self._read_notes()
        return self.ended or (self.note is not None and self.note[0] == "done")

    def _read_notes(self) -> bool:
        """Take what the actor wrote; False at end of file (the actor ended)."""
        try:
            data = os.read(self.notes_fd, 4096)
        except OSError:
            data = b""
        if not data:
            return False
        self._notes += data
        *lines, self._notes = self._notes.split(b"\n")
        for line in lines:
            word, _, number = line.decode().partition(" ")
            try:
                value = int(number)
            except ValueError:
                continue
            if word == "rank":  # the rank runs in a child of the actor's
                self.root = value
            else:
                self.note = (word, value)
        return True

    def _actor_ended(self) -> None:
        """End of the notes: the actor is gone (or finished its rank, ``done``)."""
        if self.note is not None and self.note[0] == "done":
            kill_all(self.below)  # started after the actor's own clean-up: none, usually
            self._report(self.note[1], "returned")
            return
        status, how = None, "unknown"
        deadline = time.monotonic() + _REAP_LOOK
        while status is None and time.monotonic() < deadline:
            status = exit_status(self.actor)
            if status is not None:
                how = "kernel"
            elif proctree.state(self.actor) is None:
                break
            else:
                time.sleep(0.001)
        kill_all([*self.below, *(p for p in [self.actor] if not gone(p))])
        if status is None and self.note is not None:
            word, number = self.note
            status, how = (number, "note") if word == "exit" else (-number, "note")
        if status is None and self.delivered is not None:
            status, how = -self.delivered, "delivered"
        self._report(status, how)

    def _report(self, status: int | None, how: str) -> None:
        self._send(EXITED, 0, self.actor, status, how)
        conn = self.conn
        if conn is None:  # no controller to tell (gone before, or while sending)
            return
        deadline = time.monotonic() + 1.0
        while conn.has_backlog() and time.monotonic() < deadline:
            time.sleep(0.005)
        try:
            conn.close()
        except framing.ConnectionLost:
            pass

    def _send(self, kind: int, call_id: int, *extra: object) -> None:
        """A frame to the controller; the connection is dropped once it is lost."""
        if self.conn is None:
            return
        try:
            self.conn.send(framing.frame([protocol.header(kind, call_id, 0, *extra)]))
        except framing.ConnectionLost:
            self.conn = None

    def _request(self, header: object) -> None:
        kind, call_id, _, extra = protocol.parse(header)
        if kind == SIGNAL:
            answer = self.signal(int(extra[0]))
        elif kind == STACKS:
            answer = self.stacks.take(self.root, float(extra[0]))
        elif kind == STOP:
            answer = self.stop(float(extra[0]))
        else:
            answer = f"unknown request {kind}"
        self._send(ANSWER, call_id, answer)

    def signal(self, sig: int) -> str:
        """``sig`` to the actor and everything below it (this process left out)."""
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig in _FATAL_BY_DEFAULT and self.root == self.actor:
            self.delivered = sig
        return "delivered"

    def stop(self, grace: float) -> str:
        """SIGTERM the actor's tree, SIGKILL what is left after ``grace`` s (at once for
        ``grace <= 0``), reap."""
        tree = self.tree()
        if grace > 0:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            # until the rank's processes are gone, or the rank has ended (Ray's SIGTERM
            # handler ends a rank in the actor's process, and the actor lives on)
            while time.monotonic() < deadline and not all(gone(p) for p in tree):
                if self._rank_ended(0.01):
                    return "stopped"
        tree = self.tree()
        if not gone(self.root):
            self.delivered = int(signal.SIGKILL)
        kill_all([p for p in tree if not gone(p)])
        return "stopped"


# --------------------------------------------------------------------------- controller side


class SideStream:
    """The controller's end of a rank's side stream, whose other end is the rank's warden
    (:mod:`phalanx.node.warden`) on its node: requests answered while user code runs
    (signals, stacks, stops), and the warden's account of the rank's end (``exited(pid,
    status, how)``, on this stream's reader thread)."""

    def __init__(self, sock: socket.socket, auth: seal.FrameAuth | None,
                 writer: framing.BacklogWriter, exited: Callable[..., None],
                 name: str) -> None:
        sock.setblocking(True)
        self._conn = framing.Connection(streams.SocketStream(sock), writer, auth=auth)
        self._exited = exited
        self._cond = threading.Condition()
        self._answers: dict[int, Any] = {}
        self._next = 1
        self._ended = False
        threading.Thread(target=self._read, name=name, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                for segments in self._conn.reader.recv_frames():
                    kind, call_id, _, extra = protocol.parse(segments[0])
                    if kind == ANSWER:
                        with self._cond:
                            self._answers[call_id] = extra[0]
                            self._cond.notify_all()
                    elif kind == EXITED:
                        self._exited(*extra)
        except (framing.ConnectionLost, OSError, ValueError) as exc:
            import logging  # not at import: this process starts without it

            logging.getLogger(__name__).debug("a rank's side stream ended: %s", exc)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def ask(self, kind: int, argument: Any) -> int | None:
        """Send a request; its id (to :meth:`answer`), or None if the stream is gone."""
        with self._cond:
            if self._ended:
                return None
            call_id, self._next = self._next, self._next + 1
        try:
            self._conn.send(framing.frame([protocol.header(kind, call_id, 0, argument)]))
        except framing.ConnectionLost:
            return None
        return call_id

    def answer(self, call_id: int | None, deadline: float) -> Any:
        """The answer to request ``call_id`` by ``deadline`` (``time.monotonic()``); None
        if none came (the warden is gone, or too slow)."""
        if call_id is None:
            return None
        with self._cond:
            while call_id not in self._answers and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._answers.pop(call_id, None)

    def request(self, kind: int, argument: Any, timeout: float) -> Any:
        return self.answer(self.ask(kind, argument), time.monotonic() + timeout)

    @property
    def ended(self) -> bool:
        """Whether the stream has ended (the warden is gone, or the stream was closed)."""
        with self._cond:
            return self._ended

    def close(self) -> None:
        self._conn.close()


def main() -> None:
    """The warden process (see the module's docstring for its command line)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # a Ray worker's thread blocked some
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a signal for the rank is not for us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    side_fd, notes_fd, stacks_fd, actor = (int(a) for a in sys.argv[1:5])
    for fd in (side_fd, notes_fd, stacks_fd):
        os.set_inheritable(fd, False)
    conn = None
    if side_fd >= 0:
        from phalanx import config

        keys = os.environ.pop(config.ENV_FRAME_KEYS, None)
        auth = seal.FrameAuth.taken_over(keys) if keys else None
        sock = socket.socket(fileno=side_fd)
        sock.setblocking(True)
        conn = framing.Connection(streams.SocketStream(sock),
                                  framing.BacklogWriter("phalanx-warden-writer"), auth=auth)
    Warden(conn, notes_fd, stacks_fd, actor).run()
    os._exit(0)


if __name__ == "__main__":
    main()
