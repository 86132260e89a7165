"""Streams workers' stdout and stderr to the controller, line by line, prefixed with the rank.

One thread per group reads every worker pipe (``poll``), forwards complete lines to
:mod:`phalanx.output.console` (collapsing identical lines from several ranks, see
:mod:`phalanx.output.collapse`), optionally writes them to per-rank files, and keeps the last lines
of each worker's stderr, which :class:`~phalanx.errors.WorkerDied` quotes.

Which group: the pumps of named groups (``OutputOptions.group``, the group's name) are
counted in :data:`RUNNING`, the process's one book. While more than one runs, every line
shown says its group, ``[Policy rank 1] ...`` / ``[Policy ranks 0-3] ...``; a group running
alone keeps ``[rank 1] ...``. This is decided as each line is shown (a group's lines take
the name from the moment a second group's pump opens until the other's has drained), and
collapsing stays within one group (one collapser per pump). Log files never collide: a group
whose ``log_dir`` has no other running group of the process writing ``rank-N.*.log`` in it
takes those names (and holds them until its pump ends); a group that finds them taken puts
its name in front, ``<group>.rank-N.stdout.log``, in the same directory (a name is letters,
digits and ``-_.``: never a path, and ``<group>.rank-N.*`` can be no other group's file).
The holder is told apart by the directory itself (device and inode), whatever path led to it.

Whatever a worker writes, the controller's share stays small. A line longer than
``config.MAX_LINE_BYTES`` is shown as it arrives, in pieces of at most that size, each
prefixed with the rank like a line of its own (log files still get its bytes unchanged), so
a stream never holds more than about one piece; such lines are not held for collapsing.
The stderr tail cuts each line to ``config.STDERR_TAIL_LINE_BYTES`` and keeps
``config.STDERR_TAIL_CHARS`` at most. Each turn of the reader takes at most one pipe's worth
(``_READ_SIZE``) from each ready pipe, so one rank's flood does not delay the others.

``log_dir`` (:class:`LogDir`) may be a path other users can reach (``/tmp``...), so it is
used only when it is a directory of ours that no one else can write to: created mode 0700
(an existing one of ours, 0700 or 0755, is taken as it is), and refused, with its owner and
mode named, when it is a link, belongs to another user, or is group- or world-writable --
someone else could otherwise plant a link at a log file's name and have a rank's output
written over a file of the user's. This is checked when the group is made, before any rank
starts. The directory is then opened once, and every log file is opened relative to it
(``dir_fd``), created 0600, appended to, never through a link (``O_NOFOLLOW``: a link at its
name is refused and its target left alone) and only if it is a regular file of ours (an
existing one is made 0600).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pathlib
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

from phalanx import config
from phalanx.output import console, ownfiles
from phalanx.output.collapse import Line, LineCollapser, line_prefix
from phalanx.wire.streams import WakePipe

logger = logging.getLogger(__name__)

_QUIET_MS = 200  # once stopping, pipes silent this long are given up on
_READ_SIZE = 65536  # a pipe's capacity: one read per ready pipe per turn


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """What happens to worker output: shown (collapsed, filtered) and/or written to files."""

    echo: bool = True
    collapse_window: float = config.COLLAPSE_WINDOW  # 0: every line on its own
    ranks: frozenset[int] | None = None  # shown ranks; None: all
    log_dir: pathlib.Path | None = None
    world: int = 1
    first_rank: int = 0  # the rank shown for the group's rank 0 (one node of a bigger job)
    group: str | None = None  # the group's name: said while several groups run (RUNNING)
    log_group: str | None = None  # in front of the log files' names, as build() found them

    @classmethod
    def build(
        cls,
        echo: bool,
        collapse: bool,
        ranks: Sequence[int] | None,
        log_dir: str | os.PathLike[str] | None,
        world: int,
        first_rank: int = 0,
        group: str | None = None,
    ) -> OutputOptions:
        """Check the user's options (before anything starts), create ``log_dir`` and every
        log file the group ``group`` (its name; None: a pump of no group's) will write
        there: ``rank-N.*.log``, or ``<group>.rank-N.*.log`` while another running group of
        this process writes those (see the module docstring). Its pump keeps to the names
        found here, unless the plain ones were taken by another group meanwhile."""
        shown = None
        if ranks is not None:
            if isinstance(ranks, (str, bytes)) or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in ranks
            ):
                raise TypeError(f"log_ranks must be a list of ranks, got {ranks!r}")
            bad = sorted(r for r in ranks if not 0 <= r < world)
            if bad:
                raise ValueError(f"log_ranks names ranks {bad} outside 0..{world - 1}")
            shown = frozenset(ranks)
        directory = named = None
        if log_dir is not None:
            directory = pathlib.Path(log_dir)
            with LogDir.open(directory) as opened:  # ValueError naming what is wrong
                if group is not None:
                    named = RUNNING.file_group(opened.identity, group)
                    if named is not None:
                        _say_named(group, opened)
                for rank in range(first_rank, first_rank + world):  # every file can be
                    for name in ("stdout", "stderr"):                   # written, up front
                        opened.open_file(rank, name, named).close()
        window = config.COLLAPSE_WINDOW if collapse else 0.0
        return cls(bool(echo), window, shown, directory, world, first_rank, group, named)

    def shows(self, rank: int) -> bool:
        return self.echo and (self.ranks is None or rank in self.ranks)


def log_path(directory: pathlib.Path, rank: int, name: str,
             group: str | None = None) -> pathlib.Path:
    return directory / log_name(rank, name, group)


def log_name(rank: int, name: str, group: str | None = None) -> str:
    """``rank-3.stdout.log``; with a group's name in front (``group``, see the module
    docstring): ``Policy.rank-3.stdout.log``."""
    own = f"rank-{rank}.{name}.log"
    return own if group is None else f"{group}.{own}"


class _Running:
    """The named groups whose output this process pumps now (:class:`LogPump` with
    ``OutputOptions.group``): how many there are, and which of them writes the plain
    ``rank-N.*.log`` files of each log directory (by the directory's device and inode).
    Thread-safe; :data:`RUNNING` is the process's one book."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pumps: set[LogPump] = set()
        # directory -> the group writing rank-N.*.log there, and its pumps doing so (two
        # while a group made again under its name opens as the last one's still drains)
        self._plain: dict[tuple[int, int], tuple[str, set[LogPump]]] = {}

    def several(self) -> bool:
        """More than one named group's output is pumped: lines say their group."""
        return len(self._pumps) > 1

    def file_group(self, directory: tuple[int, int], group: str) -> str | None:
        """What ``group``'s files in ``directory`` would have in front of ``rank-N``: None
        while no other running group writes the plain names there, else ``group``."""
        with self._lock:
            return self._named(directory, group)

    def holder(self, directory: tuple[int, int]) -> str | None:
        """The running group that writes the plain names in ``directory``, if one does."""
        with self._lock:
            held = self._plain.get(directory)
            return None if held is None else held[0]

    def _named(self, directory: tuple[int, int], group: str) -> str | None:
        held = self._plain.get(directory)
        return None if held is None or held[0] == group else group

    def add(self, pump: LogPump, group: str, directory: tuple[int, int] | None,
            named: str | None) -> str | None:
        """``pump`` (of ``group``) runs, writing into ``directory`` if it has a log_dir,
        under the names ``build()`` found (``named`` in front, or None: the plain ones).
        Returns the name in front of its files' names: ``named``, or ``group`` if another
        group took the plain ones meanwhile."""
        with self._lock:
            self._pumps.add(pump)
            if directory is None or named is not None:
                return named
            named = self._named(directory, group)
            if named is None:  # free, or held by a pump of this name still draining
                self._plain.setdefault(directory, (group, set()))[1].add(pump)
            return named

    def remove(self, pump: LogPump) -> None:
        """``pump`` ended: it counts no more, and the plain names it held are free."""
        with self._lock:
            self._pumps.discard(pump)
            for directory, (_, pumps) in list(self._plain.items()):
                pumps.discard(pump)
                if not pumps:
                    del self._plain[directory]


RUNNING = _Running()  # the named groups whose output this process pumps (module docstring)


def _say_named(group: str, directory: LogDir) -> None:
    """Log that ``group``'s log files have its name in front, and which group writes the
    plain names there: that one's files do not say it."""
    logger.info("group %s writes its logs in %s as %s.rank-N.{stdout,stderr}.log: group %s, "
                "running too, writes rank-N.*.log there", group, directory.path, group,
                RUNNING.holder(directory.identity))


class LogDir:
    """``log_dir``, opened once and checked, and the log files in it (see the module
    docstring): every file is opened relative to the directory's descriptor, so the path
    being swapped for another directory, or a link, afterwards changes nothing."""

    def __init__(self, path: pathlib.Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        info = os.fstat(fd)
        self.identity = (info.st_dev, info.st_ino)  # the directory, whatever path leads to it
        self._lock = threading.Lock()  # a file is not opened as the directory is closed

    @classmethod
    def open(cls, path: pathlib.Path) -> LogDir:
        """Create ``path`` (mode 0700, with its missing parents) or take the directory
        there, and open it. Raises ``ValueError`` naming the path, its owner and its mode
        when it is not a directory of ours that no one else can write to: a link, another
        user's directory, or one that is group- or world-writable (where someone else
        could plant a link at a log file's name, or swap the files)."""
        shown = f"log_dir={str(path)!r}"
        seen = ownfiles.private_dir(path, shown, _LOG_DIR_FIX)  # made 0700 if absent
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"{shown} cannot be opened: {exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
                raise ValueError(f"{shown} changed while it was being opened; refusing it")
            ownfiles.check_private(shown, info, _LOG_DIR_FIX)
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            raise

    def open_file(self, rank: int, name: str, group: str | None = None) -> BinaryIO:
        """Rank ``rank``'s log of ``name`` (stdout, stderr), appended to (across restarts
        of the rank): created 0600, never through a link (a link there is refused, its
        target left alone), and only a regular file of ours. ``group``: a name in front of
        the file's (see :func:`log_name`). Raises ``ValueError``."""
        file_name = log_name(rank, name, group)
        shown = f"log file {str(self.path / file_name)!r}"
        try:
            with self._lock:
                if self._fd is None:
                    raise ValueError(f"log_dir={str(self.path)!r} is closed")
                # never through a link, never blocking on a FIFO, only a regular file of ours
                fd = ownfiles.open_regular(file_name, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                           shown, dir_fd=self._fd, why=_LOG_FILE_FIX)
        except OSError as exc:
            raise ValueError(f"{shown} cannot be written: {exc.strerror or exc}") from None
        try:
            if os.fstat(fd).st_mode & 0o077:  # e.g. left 0644 by an older phalanx
                os.fchmod(fd, 0o600)
            return os.fdopen(fd, "ab", buffering=0)
        except OSError as exc:
            os.close(fd)
            raise ValueError(f"{shown} cannot be written: {exc.strerror or exc}") from None
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LogDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LOG_DIR_FIX = ("phalanx writes logs only into a directory of yours that no one else can write "
                "to: choose one (mode 0700 or 0755), or a path that does not exist yet: "
                "phalanx creates it, mode 0700")
_LOG_FILE_FIX = ("phalanx writes logs only into files of yours: remove it, or choose another "
                 "log_dir")


def _char_start(data: bytes | bytearray, index: int) -> int:
    """``index`` (< ``len(data)``) moved back to the start of the UTF-8 character it falls
    in, so that cutting there splits no character (invalid UTF-8: at most 3 bytes back)."""
    stop = max(0, index - 3)
    while index > stop and data[index] & 0xC0 == 0x80:
        index -= 1
    return index


class _StderrTail:
    """The last lines of one worker's stderr, as :class:`~phalanx.errors.WorkerDied` quotes
    them: at most ``STDERR_TAIL_LINES`` lines and ``STDERR_TAIL_CHARS`` characters, each line
    cut to ``STDERR_TAIL_LINE_BYTES``. Filled by the reader thread, read by whoever reports
    the worker's death."""

    def __init__(self) -> None:
        self._lines: collections.deque[str] = collections.deque()
        self._chars = 0
        self._head = b""  # the start of the line being received
        self._size = 0  # its length so far
        self._lock = threading.Lock()

    def add(self, piece: bytes | bytearray, final: bool) -> None:
        """The next piece of the current line; ``final``: its last piece."""
        limit = config.STDERR_TAIL_LINE_BYTES
        room = limit + 4 - len(self._head)  # a few bytes more, to cut between characters
        if room > 0:
            self._head += piece[:room]
        self._size += len(piece)
        if not final:
            return
        head, size = self._head, self._size
        self._head, self._size = b"", 0
        if size > limit:
            cut = _char_start(head, limit)
            line = head[:cut].decode("utf-8", errors="replace") + f" ... [{size - cut} bytes cut]"
        else:
            line = head.decode("utf-8", errors="replace")
        with self._lock:
            self._lines.append(line)
            self._chars += len(line)
            while (len(self._lines) > config.STDERR_TAIL_LINES
                   or self._chars > config.STDERR_TAIL_CHARS):
                self._chars -= len(self._lines.popleft())

    def lines(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._lines)


class _Stream:
    __slots__ = ("buffer", "closed", "continued", "decode", "echo", "fd", "file", "is_stderr",
                 "rank", "reading", "tail")

    def __init__(self, fd: int, rank: int, tail: _StderrTail | None, echo: bool,
                 file: BinaryIO | None, decode: Callable[[bytes], bytes] | None = None):
        self.fd = fd
        self.decode = decode  # bytes read -> the output they carry (see LogPump.attach)
        self.rank = rank
        self.is_stderr = tail is not None
        self.buffer = bytearray()  # the line being received: up to a piece and one read
        self.continued = False  # pieces of that line were passed on already
        self.tail = tail
        self.closed = threading.Event()
        self.reading = False  # the pump is between reading from it and passing it on
        self.echo = echo
        self.file = file


class OutputTap:
    """What one worker process wrote: its stderr tail, and whether its pipes have closed."""

    def __init__(self, streams: list[_Stream], tail: _StderrTail) -> None:
        self._streams = streams
        self._tail = tail

    def wait_closed(self, timeout: float) -> bool:
        """Wait (bounded) until the worker's pipes reach end of file: its last words are in."""
        for stream in self._streams:
            if not stream.closed.wait(timeout):
                return False
        return True

    def drained(self) -> bool:
        """Whether the last words of a worker *known to have exited* are in already,
        though the pump may not have seen its pipes end: nothing left unread in them,
        nothing of them being passed on, no unfinished line held. A process that exited
        writes nothing more, but lets go of its pipes only once its last thread is gone,
        a moment after its exit status is readable; this spares a death that wait (and
        the pump's thread being scheduled to see the end). What children of it that hold
        its pipes write afterwards is not waited for: its keeper is ending them."""
        for stream in self._streams:
            if stream.closed.is_set():
                continue
            if stream.reading or stream.buffer or stream.continued:
                return False
            poller = select.poll()
            poller.register(stream.fd, select.POLLIN)
            try:
                events = poller.poll(0)
            except (OSError, ValueError):  # closed meanwhile: the pump saw its end
                continue
            if events and events[0][1] & select.POLLIN:
                return False
        return True

    def stderr_tail(self) -> tuple[str, ...]:
        return self._tail.lines()


class LogPump:
    """The reader thread for all worker pipes of one group (named by
    ``OutputOptions.group``: counted in :data:`RUNNING` until the thread ends)."""

    def __init__(self, options: OutputOptions | None = None) -> None:
        self._options = options or OutputOptions()
        options = self._options
        self._group = options.group
        # opened (and checked again) here: the log files are opened relative to it
        self._log_dir = None if options.log_dir is None else LogDir.open(options.log_dir)
        self._file_group: str | None = None  # in front of the log files' names
        shown = options.world if options.ranks is None else len(options.ranks)
        self._collapser = LineCollapser(options.collapse_window, shown)
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._new: list[_Stream] = []
        self._wake = WakePipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="phalanx-logs", daemon=True)
        if self._group is not None:
            self._join_running(self._group)
        try:
            self._thread.start()
        except BaseException:
            RUNNING.remove(self)
            raise

    def _join_running(self, group: str) -> None:
        """Count in :data:`RUNNING`, and name the log files (see the module docstring)."""
        if self._log_dir is None:
            RUNNING.add(self, group, None, None)
            return
        named = self._options.log_group
        self._file_group = RUNNING.add(self, group, self._log_dir.identity, named)
        if self._file_group is not None and named is None:  # taken since build()
            _say_named(group, self._log_dir)

    @property
    def writes_files(self) -> bool:
        """Whether each rank's output also goes to files of its own (``log_dir``)."""
        return self._log_dir is not None

    def attach(self, rank: int, stdout_fd: int, stderr_fd: int,
               decoders: Sequence[Callable[[bytes], bytes] | None] = (None, None)
               ) -> OutputTap:
        """Start reading one worker's pipes (the pump owns and closes the descriptors).
        Lines and log files carry the rank as shown (``first_rank`` added). ``decoders``:
        for a stream that carries its output framed (sealed frames across the network),
        what turns the bytes read into the output (``b""``: none yet); one that raises ends
        that stream there."""
        tail = _StderrTail()
        echo = self._options.shows(rank)
        shown = rank + self._options.first_rank
        streams = [
            _Stream(stdout_fd, shown, None, echo, self._open_log(shown, "stdout"), decoders[0]),
            _Stream(stderr_fd, shown, tail, echo, self._open_log(shown, "stderr"), decoders[1]),
        ]
        for stream in streams:
            os.set_blocking(stream.fd, False)
        with self._lock:
            self._new.extend(streams)
        self._wake.wake()
        return OutputTap(streams, tail)

    def _open_log(self, rank: int, name: str) -> BinaryIO | None:
        if self._log_dir is None:
            return None
        try:  # appended to across restarts of the rank
            return self._log_dir.open_file(rank, name, self._file_group)
        except ValueError as exc:  # e.g. a link put there since the group started
            logger.warning("rank %d's %s is not written to a file: %s", rank, name, exc)
            return None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop once the pipes still open have drained (each write end is closed once its
        worker is reaped); ``timeout`` bounds the wait for pipes a stray grandchild holds."""
        self._stopping = True
        self._wake.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():  # it closes what is left when it ends
            logger.warning("worker output still arriving after %.0f s; not waiting", timeout)
            return
        self._wake.close()

    def _run(self) -> None:
        try:
            self._pump()
        finally:
            for stream in list(self._streams.values()):
                self._close(stream)
            self._show(self._collapser.flush())
            if self._log_dir is not None:
                self._log_dir.close()
            RUNNING.remove(self)  # its last lines are out: said with its name if need be

    def _pump(self) -> None:
        poller = select.poll()
        poller.register(self._wake.fd, select.POLLIN)
        quiet_since = None
        while True:
            with self._lock:
                new, self._new = self._new, []
            for added in new:
                self._streams[added.fd] = added
                poller.register(added.fd, select.POLLIN)
            if self._stopping and not self._streams:
                return
            deadline = self._collapser.next_deadline()
            wait = None
            if deadline is not None:
                wait = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if self._stopping:
                wait = _QUIET_MS if wait is None else min(wait, _QUIET_MS)
            try:
                events = poller.poll(wait)
            except InterruptedError:  # pragma: no cover
                continue
            now = time.monotonic()
            if deadline is not None:
                self._show(self._collapser.due(now))
            if self._stopping:
                # pipes that stay silent are held open by stray grandchildren: stop waiting
                if events:
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = now
                elif now - quiet_since >= _QUIET_MS / 1000:
                    return
            for fd, _ in events:
                if fd == self._wake.fd:
                    self._wake.drain()
                    continue
                stream = self._streams.get(fd)
                if stream is not None and not self._read(stream):
                    poller.unregister(fd)
                    self._close(stream)

    def _read(self, stream: _Stream) -> bool:
        """Pass on complete lines, and pieces of overlong ones; False at end of file."""
        stream.reading = True  # before the read: OutputTap.drained() trusts it
        try:
            return self._pass_on(stream)
        finally:
            stream.reading = False

    def _pass_on(self, stream: _Stream) -> bool:
        try:
            data = os.read(stream.fd, _READ_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data and stream.decode is not None:
            try:
                data = stream.decode(data)
            except Exception as exc:  # noqa: BLE001 - the rest of it cannot be trusted
                logger.warning("rank %d's %s ends here: %s", stream.rank,
                               "stderr" if stream.is_stderr else "stdout", exc)
                data = b""
            else:
                if not data:
                    return True  # a frame still arriving
        if not data:
            if stream.buffer or stream.continued:
                self._end_line(stream)  # the last line had no newline
            return False
        *lines, rest = data.split(b"\n")
        for line in lines:
            if stream.buffer or stream.continued or len(line) > config.MAX_LINE_BYTES:
                stream.buffer += line
                self._end_line(stream)
            else:
                self._emit(stream, line, final=True)
        stream.buffer += rest
        self._emit_pieces(stream)
        return True

    def _emit_pieces(self, stream: _Stream) -> None:
        """Pass on the received part of a line too long to hold, a piece at a time (the
        buffer is appended to and cut from the front: no copy is as long as the line)."""
        buffer, limit = stream.buffer, config.MAX_LINE_BYTES
        while len(buffer) > limit:
            cut = _char_start(buffer, limit)
            self._emit(stream, buffer[:cut], final=False)
            del buffer[:cut]

    def _end_line(self, stream: _Stream) -> None:
        self._emit_pieces(stream)
        line, stream.buffer = stream.buffer, bytearray()
        self._emit(stream, line, final=True)

    def _emit(self, stream: _Stream, raw: bytes | bytearray, final: bool) -> None:
        """Pass on a whole line, or a piece of a long one (``final``: the line ends here)."""
        if stream.file is not None:  # the bytes as written: pieces join up again
            try:
                stream.file.write(raw + b"\n" if final else raw)
            except (OSError, ValueError) as exc:  # a full disk must not stop the output pump
                logger.warning("cannot write rank %d's log file: %s", stream.rank, exc)
        continued, stream.continued = stream.continued, not final
        if final and raw.endswith(b"\r"):
            raw = raw.rstrip(b"\r")
        if stream.tail is not None:
            stream.tail.add(raw, final)
        if not stream.echo:
            return
        if continued and final and not raw:
            return  # the long line ended exactly at a cut: nothing left to show
        text = raw.decode("utf-8", errors="replace")
        if final and not continued and len(text) <= config.COLLAPSE_MAX_LINE:
            self._show(self._collapser.add(stream.rank, text, stream.is_stderr, time.monotonic()))
            return
        # Too long to hold while waiting for identical lines: shown now, after the lines
        # held so far (which keeps every rank's lines in order).
        self._show(self._collapser.flush())
        console.write_line(self._prefix([stream.rank]), text, stderr=stream.is_stderr)

    def _prefix(self, ranks: list[int]) -> str:
        """``[rank 1]``, or ``[Policy rank 1]`` while another group runs (module docstring)."""
        return line_prefix(ranks, self._group if RUNNING.several() else None)

    def _show(self, lines: list[Line]) -> None:
        for line in lines:
            console.write_line(self._prefix(line.ranks), line.text, stderr=line.stderr)

    def _close(self, stream: _Stream) -> None:
        if self._streams.pop(stream.fd, None) is not None:
            try:
                os.close(stream.fd)
            except OSError:
                pass
            if stream.file is not None:
                stream.file.close()
        stream.closed.set()
