"""A remote debugger on one rank: ``px.breakpoint()`` in the rank, ``phalanx debug`` to attach.

A rank that calls :func:`breakpoint` stops there and waits for a debugger; the user attaches
from another terminal, so the session is not interleaved with the other ranks' output (and
the rank's stdin, which phalanx does not connect, is not needed). This module is the rank's
side and what both sides agree on (the :class:`WaitingRank` record, the directory, the
markers); the client's side, ``phalanx debug``, is :mod:`phalanx.cli.debug`::

    rank: px.breakpoint()                         terminal: phalanx debug [RANK | --pid PID]
    listen on 127.0.0.1, ephemeral port
    write DIR/<pid>-<port>.json (0600) ---------> read the records, drop stale ones
    "[phalanx] rank R ... is waiting" on stderr
    accept <------------------------------------- connect, send "<token>\\n"
    (every connection at once, see below)
    hmac.compare_digest(token)  ----- "ok\\n" --> (or "refused: ...\\n", and keep waiting)
    remove the record, close the listener
    pdb on the connection: its output as text,
    a NUL byte each time it waits for a line ---> print up to the NUL; input(prompt)
    read one line  <----------------------------- "<line>\\n"
    continue / quit / EOF: close  --------------> the session is over: exit 0

A record says which rank it is (``RANK``) and of which group: the group's name, which the
controller gives every rank as ``PHALANX_GROUP`` (:data:`phalanx.config.ENV_GROUP`), so that
``phalanx debug --list`` and every message about the rank tell apart the ranks 1 of two
groups (``rank 1 of group policy (pid 4242)``).

Who may attach: the records live in a per-user directory (``PHALANX_DEBUG_DIR``, else
``/tmp/phalanx-debug-<uid>``) that must be a directory of ours, kept at mode 0700; each record
holds a random token that the client must send before the rank reads anything else from it.
The socket listens on the loopback interface only, so attaching happens on the rank's host.

Other users on the host can still reach that port, and ``/tmp`` is theirs too, so:

- connections are checked together, on the waiting thread, with a selector: each has
  ``config.DEBUG_TOKEN_TIMEOUT`` seconds in all to send its line, and past
  ``config.DEBUG_MAX_PENDING`` held at once the oldest is dropped. Strangers that connect
  and say nothing therefore delay no one: the owner's client sends its token as soon as it
  is connected and is answered at once (when tokens were read one connection at a time,
  four silent connections made ``phalanx debug`` time out again and again). The backlog is
  ``config.DEBUG_BACKLOG``; a new connection's line is looked for as soon as it is taken,
  and at most ``DEBUG_MAX_PENDING`` are taken per turn, so a flood of connections neither
  starves those already taken nor pushes the owner's out before its token is read;
- nothing a stranger sends or does raises into user code or ends the wait: garbage, a
  line that is not the token, hanging up at any moment, connections dropped to make room
  (while their data is still to be read in the same turn: once a ``KeyError`` out of
  ``px.breakpoint()``), running out of descriptors. Such connections are closed and
  logged at debug level (``phalanx.rank.debugger``); an error that should not happen is
  logged once as a warning, and the rank keeps waiting for its owner;
- a path at ``/tmp/phalanx-debug-<uid>`` that is not a directory of ours (another user made
  it first, or put a link there) is never used: both sides then use
  ``~/.cache/phalanx/debug`` (the home directory from the password database, not
  ``$HOME``, so that both find the same one). ``$PHALANX_DEBUG_DIR`` set to a path not ours
  is refused, naming its owner and what to do.

How the session ends:

- ``continue`` with no breakpoint set: the rank runs on. With breakpoints set, the session
  stays open until the rank stops again, at one of them or at its next ``px.breakpoint()``;
- ``quit``: ``bdb.BdbQuit`` is raised where the rank stopped, as pdb does;
- the client goes away (Ctrl-D or Ctrl-C in ``phalanx debug``, a closed terminal): pdb reads
  end of file, which here means "clear the breakpoints and continue", never "abort the rank";
  writes to a dead connection are dropped instead of raising into user code.

The fixed default directory (not ``$XDG_RUNTIME_DIR``) is deliberate: ranks started by Ray
or a batch system often lack the session variables of the user's terminal, and both sides
must find the same directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import json
import logging
import os
import pdb
import pwd
import secrets
import selectors
import socket
import stat
import sys
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO, cast

from phalanx import config

ENV_DEBUG_DIR = "PHALANX_DEBUG_DIR"  # where ranks register while they wait for a debugger
TOKEN_TIMEOUT = config.DEBUG_TOKEN_TIMEOUT  # seconds a connecting client has to send the token
INPUT_MARKER = b"\0"  # rank -> client: "pdb now waits for one line of input"
_TOKEN_LINE_LIMIT = 256  # bytes; a longer first line is not a token
_START_TIME_SLACK = 1.0  # seconds; a pid whose process started later than recorded was reused
_RANK_VARS = ("RANK", "PHALANX_RANK")
# accept() failing for want of descriptors or memory: free one or pause, never spin
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RESOURCE_BACKOFF = 0.05  # seconds

logger = logging.getLogger(__name__)


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where ranks register: ``$PHALANX_DEBUG_DIR``, else ``/tmp/phalanx-debug-<uid>``
    unless something not ours is there, else ``~/.cache/phalanx/debug``."""
    env = os.environ if environ is None else environ
    chosen = env.get(ENV_DEBUG_DIR)
    if chosen:
        return Path(chosen)
    shared = Path("/tmp") / f"phalanx-debug-{os.getuid()}"
    try:
        info = os.lstat(shared)
    except FileNotFoundError:
        return shared
    except OSError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        return shared
    # Someone else took the name: a home directory is ours alone. From the password
    # database, not $HOME, which a rank's environment may not share with the terminal.
    return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "phalanx" / "debug"


def private_dir(path: Path, *, create: bool) -> bool:
    """Make sure ``path`` is a directory only this user can use (mode 0700, tightened if
    needed); create it (mode 0700) when ``create``. False when it does not exist (and was
    not created). Raises ``PermissionError`` naming the owner for a path another user owns
    or that is not a directory: a directory someone else controls could collect the
    tokens."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError as exc:
            raise PermissionError(f"cannot create the debugger's directory {path}: "
                                  f"{exc.strerror or exc}; point {ENV_DEBUG_DIR} at a "
                                  f"directory of yours (mode 0700)") from exc
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    uid = os.getuid()
    fix = (f"point {ENV_DEBUG_DIR} at a directory of yours (mode 0700), e.g. "
           f"{ENV_DEBUG_DIR}=~/.cache/phalanx/debug, in the ranks' environment and in "
           f"phalanx debug's")
    if info.st_uid != uid:
        raise PermissionError(
            f"{path} belongs to user {_user_name(info.st_uid)}, not to you "
            f"({_user_name(uid)}): phalanx keeps debugger tokens only in a directory of "
            f"yours; {fix}"
        )
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise PermissionError(f"{path} is {kind}; debugger records need a private "
                              f"directory: {fix}")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return True


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None if it does not exist."""
    # a dependency of phalanx, imported here: user code rarely calls this (and untyped:
    # types-psutil is not a dependency)
    import psutil  # type: ignore[import-untyped]

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


@dataclasses.dataclass(frozen=True)
class WaitingRank:
    """The record a rank stopped in :func:`breakpoint` leaves for ``phalanx debug``."""

    rank: int | None  # None outside a phalanx group (no RANK / PHALANX_RANK)
    pid: int
    host: str
    port: int  # on 127.0.0.1
    token: str
    group: str | None  # the name of the rank's group (PHALANX_GROUP), if any
    process_start: float  # tells a live rank from a reused pid
    since: float  # time.time() when it started waiting
    file: str
    line: int
    function: str

    @property
    def who(self) -> str:
        """``rank 1 of group policy (pid 4242)``, as errors name a rank (``rank 1 (pid
        4242)`` outside a group)."""
        rank = "?" if self.rank is None else self.rank
        group = "" if self.group is None else f" of group {self.group}"
        return f"rank {rank}{group} (pid {self.pid})"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    @property
    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def is_stale(self) -> bool:
        """True when the process that wrote the record is gone (only known on its host)."""
        if not self.on_this_host:
            return False
        started = _process_start(self.pid)
        return started is None or abs(started - self.process_start) > _START_TIME_SLACK

    def file_name(self) -> str:
        return f"{self.pid}-{self.port}.json"

    def write(self, directory: Path) -> Path:
        """Publish the record atomically, readable by this user only."""
        path = directory / self.file_name()
        partial = directory / f".{self.file_name()}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(self), f)
        os.replace(partial, path)
        return path

    @classmethod
    def read(cls, path: Path) -> WaitingRank:
        """Raises ``OSError`` or ``ValueError`` for a record that is unreadable or malformed."""
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a record")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}") from None


# -- the rank's side -------------------------------------------------------------------------


def _rank_from_env() -> int | None:
    for name in _RANK_VARS:
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[name])
    return None


def _group_from_env() -> str | None:
    """The name of this rank's group, as its controller set it (None outside a group)."""
    return os.environ.get(config.ENV_GROUP) or None


def _attach_hint(record: WaitingRank, directory: Path) -> str:
    target = f" {record.rank}" if record.rank is not None else f" --pid {record.pid}"
    if directory != default_dir({}):
        target += f" --dir {directory}"
    return f"phalanx debug{target}"


def breakpoint(*, timeout: float | None = None) -> bool:
    """Stop this rank in pdb, served to ``phalanx debug`` from another terminal.

    Writes a record for ``phalanx debug`` into the per-user debug directory, says on stderr
    that the rank waits, and blocks until a debugger attaches -- or, with ``timeout``, until
    that many seconds passed (then returns False and the code runs on). Once attached, the
    session starts at the caller's next line, as with the built-in ``breakpoint()``; it can
    also be that: ``PYTHONBREAKPOINT=phalanx.breakpoint``.

    Returns True when a debugger attached.
    """
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    caller = sys._getframe(1)  # noqa: SLF001 - the caller's frame, where pdb starts (as pdb does)
    active = getattr(sys.gettrace(), "__self__", None)
    if isinstance(active, _RankPdb) and not active.connection.closed:
        # still attached (the user continued with breakpoints set): stop in that session,
        # with tracing off meanwhile so that it does not stop inside set_trace itself
        sys.settrace(None)
        active.set_trace(caller)
        return True
    directory = default_dir()
    private_dir(directory, create=True)
    connection = None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(config.DEBUG_BACKLOG)
        token = secrets.token_hex(32)
        record = WaitingRank(
            rank=_rank_from_env(), pid=os.getpid(), host=socket.gethostname(),
            port=listener.getsockname()[1], token=token, group=_group_from_env(),
            process_start=_process_start(os.getpid()) or 0.0, since=time.time(),
            file=caller.f_code.co_filename, line=caller.f_lineno,
            function=caller.f_code.co_name,
        )
        path = record.write(directory)
        try:
            # The one line the user needs to act on; it travels with the rank's stderr to
            # the controller's terminal (prefixed with the rank), not through logging, which
            # a worker process has not configured.
            sys.stderr.write(f"[phalanx] {record.who} is waiting for a debugger at "
                             f"{record.where}: run '{_attach_hint(record, directory)}' to "
                             f"attach\n")
            sys.stderr.flush()
            deadline = None if timeout is None else time.monotonic() + timeout
            connection = _accept(listener, token.encode(), deadline)
        finally:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    if connection is None:
        sys.stderr.write(f"[phalanx] {record.who}: no debugger attached within {timeout:g} s; "
                         f"continuing\n")
        sys.stderr.flush()
        return False
    debugger = _RankPdb(_PdbStream(connection), record.who)
    debugger.set_trace(caller)
    return True  # nothing may run in this frame after set_trace: it would be traced too


def _accept(listener: socket.socket, token: bytes, deadline: float | None
            ) -> socket.socket | None:
    """The first connection that sends ``token``, or None once ``deadline`` passed. Every
    connection is checked at once (see the module docstring): one that stalls holds only
    itself, and nothing a connection does (its bytes, hanging up at any moment, hundreds
    of them coming and going) raises out of here or ends the wait."""
    waiting = _Waiting(listener, token)
    try:
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            try:
                accepted = waiting.turn(now, deadline)
            except Exception as exc:  # noqa: BLE001 - never into user code: keep waiting
                waiting.failed(exc)
                continue
            if accepted is not None:
                return accepted
    finally:
        waiting.close()


class _Waiting:
    """The connections of one wait in :func:`_accept`, oldest first, each with when it must
    have sent its line and what it sent so far; a selector over them and the listener."""

    def __init__(self, listener: socket.socket, token: bytes) -> None:
        self._listener = listener
        self._token = token
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}
        self._selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._failures = 0  # unexpected errors in a row (see failed)
        self._warned = False

    def turn(self, now: float, deadline: float | None) -> socket.socket | None:
        """Wait for what comes next (at most until the first due time) and handle it; the
        owner's connection once it sent the token."""
        for conn, (due, _) in list(self._pending.items()):
            if due <= now:  # a client that vanished or stalled
                self._drop(conn, "sent no line in time")
        dues = [due for due, _ in self._pending.values()]
        if deadline is not None:
            dues.append(deadline)
        events = self._selector.select(None if not dues else max(0.0, min(dues) - now))
        # the connections taken already first, then new ones: a line that arrived is read
        # before newcomers can push its connection out to make room
        for key, _ in sorted(events, key=lambda event: event[0].fileobj is self._listener):
            if key.fileobj is self._listener:
                found = self._take()
            else:
                # dropped earlier in this turn (to make room, or its descriptor reused by a
                # newer connection): key.data is then no longer pending, and is skipped
                found = self._check(key.data)
            if found is not None:
                return found
        self._failures = 0
        return None

    def _take(self) -> socket.socket | None:
        """Take the connections waiting on the listener (a bounded number per turn, so a
        flood of them does not starve those already taken). Each is checked at once: the
        owner's client sends its token as soon as it is connected."""
        for _ in range(config.DEBUG_MAX_PENDING):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    # out of descriptors: free the oldest stranger's, and do not spin
                    if self._pending:
                        self._drop(next(iter(self._pending)), "dropped: out of descriptors")
                    else:
                        time.sleep(_RESOURCE_BACKOFF)
                return None  # else the peer went away before it was taken: nothing to do
            try:
                conn.setblocking(False)
            except OSError:
                conn.close()
                continue
            if len(self._pending) >= config.DEBUG_MAX_PENDING:
                self._drop(next(iter(self._pending)), "dropped: too many connections")
            self._pending[conn] = (time.monotonic() + TOKEN_TIMEOUT, bytearray())
            self._selector.register(conn, selectors.EVENT_READ, data=conn)
            found = self._check(conn)
            if found is not None:
                return found
        return None

    def _check(self, conn: socket.socket) -> socket.socket | None:
        """Read what ``conn`` sent; once its line is complete, answer it: the connection
        itself if it carried the token, else it is closed (None either way until then)."""
        entry = self._pending.get(conn)
        if entry is None:
            return None
        try:
            line = _line_so_far(conn, entry[1])
            if line is None:
                return None
            self._forget(conn)
            if _answer(conn, line, self._token):
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
            logger.debug("debugger: refused a connection that sent no valid token")
        except Exception as exc:  # noqa: BLE001 - that connection's trouble alone
            logger.debug("debugger: dropped a connection: %r", exc)
        self._forget(conn)
        conn.close()
        return None

    def failed(self, exc: Exception) -> None:
        """A turn raised unexpectedly: say so once, and keep waiting (after a pause if it
        keeps happening, so as not to spin)."""
        self._failures += 1
        if not self._warned:
            self._warned = True
            logger.warning("debugger: error while waiting for the debugger (still waiting): "
                           "%r", exc)
        else:
            logger.debug("debugger: error while waiting for the debugger: %r", exc)
        if self._failures > 1:
            time.sleep(min(_RESOURCE_BACKOFF * self._failures, 1.0))

    def _forget(self, conn: socket.socket) -> None:
        """Stop watching ``conn`` (if it was watched); does not close it."""
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn)

    def _drop(self, conn: socket.socket, why: str) -> None:
        logger.debug("debugger: a connection %s", why)
        self._forget(conn)
        conn.close()

    def close(self) -> None:
        for conn in list(self._pending):
            self._forget(conn)
            conn.close()
        with contextlib.suppress(Exception):
            self._selector.close()


def _line_so_far(conn: socket.socket, received: bytearray) -> bytes | None:
    """Read what ``conn`` has; its first line once complete (b"" when it closed, or
    ``_TOKEN_LINE_LIMIT`` bytes came without a newline), else None."""
    try:
        chunk = conn.recv(_TOKEN_LINE_LIMIT - len(received))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""
    if not chunk:
        return b""
    received += chunk
    if b"\n" not in received and len(received) < _TOKEN_LINE_LIMIT:
        return None
    return bytes(received).partition(b"\n")[0]


def _answer(conn: socket.socket, line: bytes, token: bytes) -> bool:
    """Compare the client's first line with the token and answer either way. (The client
    sends nothing else before the answer, so no byte of the session was read.) A refusal
    is sent without waiting: a stranger that does not read holds no one up."""
    accepted = bool(line) and hmac.compare_digest(line.strip(), token)
    if not accepted:
        with contextlib.suppress(OSError):
            conn.send(b"refused: wrong token\n")
        return False
    try:
        conn.settimeout(TOKEN_TIMEOUT)
        conn.sendall(b"ok\n")
        conn.settimeout(None)
    except OSError:  # it vanished meanwhile: wait for the next one
        return False
    return True


def read_line(sock: socket.socket) -> tuple[bytes, bytes]:
    """The first line (at most ``_TOKEN_LINE_LIMIT`` bytes, without its newline) and the
    bytes received after it: the token the client sends, the answer the rank gives."""
    received = b""
    while b"\n" not in received and len(received) < _TOKEN_LINE_LIMIT:
        chunk = sock.recv(_TOKEN_LINE_LIMIT)
        if not chunk:
            break
        received += chunk
    line, _, rest = received.partition(b"\n")
    return line, rest


class _PdbStream:
    """pdb's stdin and stdout: text over the debugger's socket. A peer that went away reads
    as end of file and swallows writes, so that user code never sees a socket error."""

    encoding = "utf-8"

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._output: list[str] = []
        self._input = b""

    @property
    def closed(self) -> bool:
        return self._sock is None

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if self._sock is not None:
            self._output.append(text)
        return len(text)

    def flush(self) -> None:
        self._send(b"")

    def readline(self) -> str:
        self._send(INPUT_MARKER)
        while self._sock is not None and b"\n" not in self._input:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
            self._input += chunk
        line, newline, self._input = self._input.partition(b"\n")
        return (line + newline).decode("utf-8", "replace")

    def as_text_file(self) -> TextIO:
        """This stream where a text file is asked for (pdb's stdin and stdout, sys.stdin):
        it has what those use of one (readline, write, flush, isatty, encoding, closed)."""
        return cast("TextIO", self)

    def close(self) -> None:
        self._send(b"")
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None

    def _send(self, suffix: bytes) -> None:
        text, self._output = "".join(self._output), []
        if self._sock is None or not (text or suffix):
            return
        # a NUL in the text would end the client's prompt early
        data = text.replace("\0", "\\0").encode("utf-8", "replace") + suffix
        try:
            self._sock.sendall(data)
        except OSError:
            self.close()


class _RankPdb(pdb.Pdb):
    """pdb over a :class:`_PdbStream`, closing it when the session ends (see the module
    docstring), leaving the rank's signal handlers alone and never stopping in phalanx."""

    def __init__(self, connection: _PdbStream, who: str) -> None:
        stream = connection.as_text_file()
        super().__init__(stdin=stream, stdout=stream, skip=["phalanx", "phalanx.*"],
                         nosigint=True, readrc=False)
        self.connection = connection
        self._who = who
        self._farewell: str | None = None

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:
            self._farewell = f"{self._who} continues."

    def set_quit(self) -> None:
        super().set_quit()
        self._farewell = f"{self._who} quits the debugger: BdbQuit is raised where it stopped."

    def do_EOF(self, arg: str) -> bool:
        """The client went away: let the rank run on."""
        self.clear_all_breaks()
        return bool(self.do_continue(arg))

    def do_interact(self, arg: str) -> None:
        # code.interact reads sys.stdin and writes sys.stdout: the rank's, not the session's
        saved = sys.stdin, sys.stdout
        sys.stdin = sys.stdout = self.connection.as_text_file()
        try:
            super().do_interact(arg)
        finally:
            sys.stdin, sys.stdout = saved

    def interaction(self, frame: types.FrameType | None, traceback: Any) -> None:
        super().interaction(frame, traceback)
        if self._farewell is not None:
            self.message(self._farewell)
            self.connection.close()
