"""``phalanx debug``: attach this terminal to a rank stopped in ``px.breakpoint()``.

The client's side of :mod:`phalanx.rank.debugger`, whose docstring draws the exchange: read
the records ranks leave in the per-user debug directory (:func:`waiting_ranks`, dropping
those of processes that are gone), pick one (:func:`choose`), connect to its loopback port,
send its token, and bridge the terminal to the rank's pdb (:func:`attach`) -- the rank's
output shown as it comes, the line its prompt is on held back until it asks for input, so
that ``input()`` shows the prompt and readline can redraw it. Ctrl-D or Ctrl-C detaches and
the rank continues.

The rank's side never imports this module.
"""

from __future__ import annotations

import codecs
import contextlib
import socket
import time
from pathlib import Path
from typing import TextIO

from phalanx.errors import DebuggerUnavailable
from phalanx.rank.debugger import (
    ENV_DEBUG_DIR,
    INPUT_MARKER,
    WaitingRank,
    default_dir,
    private_dir,
    read_line,
)

__all__ = ["CONNECT_TIMEOUT", "attach", "choose", "default_dir", "describe_waiting",
           "waiting_ranks"]

CONNECT_TIMEOUT = 5.0  # seconds `phalanx debug` waits for a rank to accept and answer


def waiting_ranks(directory: Path) -> list[WaitingRank]:
    """The ranks waiting for a debugger, oldest first; records of processes that are gone
    are deleted on the way, malformed ones ignored."""
    if not private_dir(directory, create=False):
        return []
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = WaitingRank.read(path)
        except (OSError, ValueError):
            continue
        if record.is_stale():
            path.unlink(missing_ok=True)
        else:
            found.append(record)
    return sorted(found, key=lambda r: (r.since, r.pid))


def describe_waiting(records: list[WaitingRank], now: float | None = None) -> str:
    """A table of the waiting ranks, for ``phalanx debug --list``: each one's rank, pid,
    host, group (its name; ``-`` outside a group), how long it has waited, and where."""
    now = time.time() if now is None else now
    rows = [("RANK", "PID", "HOST", "GROUP", "WAITING", "WHERE")]
    for r in records:
        rank = "?" if r.rank is None else str(r.rank)
        rows.append((rank, str(r.pid), r.host, r.group or "-", _duration(now - r.since),
                     r.where))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True))
        + "  " + row[5]
        for row in rows
    )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def choose(records: list[WaitingRank], rank: int | None, pid: int | None,
           directory: Path) -> WaitingRank:
    """The record to attach to: the one with ``pid``, with ``rank``, or the only one."""
    if not records:
        raise DebuggerUnavailable(
            f"no rank is waiting for a debugger (records are read from {directory}; a rank "
            f"waits after calling px.breakpoint(), with the same {ENV_DEBUG_DIR})"
        )
    if pid is not None:
        matches = [r for r in records if r.pid == pid]
        wanted = f"pid {pid}"
    elif rank is not None:
        matches = [r for r in records if r.rank == rank]
        wanted = f"rank {rank}"
    else:
        matches = records
        wanted = "a rank"
    waiting = ", ".join(r.who for r in records)
    if not matches:
        raise DebuggerUnavailable(f"{wanted} is not waiting for a debugger (waiting: {waiting})")
    if len(matches) > 1:
        raise DebuggerUnavailable(
            f"{len(matches)} processes match {wanted} ({', '.join(r.who for r in matches)}): "
            f"choose one with --pid"
        )
    record = matches[0]
    if not record.on_this_host:
        raise DebuggerUnavailable(
            f"{record.who} waits on host {record.host}, and debuggers attach over its "
            f"loopback interface: run phalanx debug there"
        )
    return record


def attach(record: WaitingRank, out: TextIO, err: TextIO) -> None:
    """Bridge this terminal to the rank's pdb until the session ends or the user detaches
    (end of input or Ctrl-C: the rank continues)."""
    try:
        sock = socket.create_connection(("127.0.0.1", record.port), timeout=CONNECT_TIMEOUT)
    except OSError as exc:
        raise DebuggerUnavailable(
            f"{record.who} does not answer on 127.0.0.1:{record.port} ({exc}): another "
            f"debugger may have attached first, or it stopped waiting"
        ) from exc
    with sock:
        try:
            sock.sendall(record.token.encode() + b"\n")
            line, session_start = read_line(sock)  # pdb's output may follow in one packet
        except OSError as exc:
            raise DebuggerUnavailable(f"{record.who} dropped the connection: {exc}") from exc
        reply = line.decode("utf-8", "replace").strip()
        if reply != "ok":
            raise DebuggerUnavailable(f"{record.who} refused the debugger: {reply or 'no reply'}")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err.write(f"attached to {record.who}, stopped at {record.where} "
                  f"(Ctrl-D or Ctrl-C detaches and lets it continue)\n")
        err.flush()
        _bridge(sock, _Terminal(sock, out, session_start), record, err)


def _bridge(sock: socket.socket, relay: _Terminal, record: WaitingRank, err: TextIO) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    try:
        while True:
            prompt = relay.next_prompt()
            if prompt is None:
                return  # the rank ended the session
            line = input(prompt)
            sock.sendall(line.encode("utf-8", "replace") + b"\n")
    except (EOFError, KeyboardInterrupt):
        err.write(f"\ndetached from {record.who}; it continues\n")
    except OSError:
        err.write(f"\nthe connection to {record.who} was lost\n")
    err.flush()


class _Terminal:
    """Copies the rank's output to the terminal, holding back the line pdb's prompt is on
    until the rank asks for input, so that ``input()`` can show it (and readline redraw it)."""

    def __init__(self, sock: socket.socket, out: TextIO, unread: bytes = b"") -> None:
        self._sock = sock
        self._out = out
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._unread = unread
        self._partial_line = ""

    def next_prompt(self) -> str | None:
        """Show output until the rank waits for a line (return its prompt) or the session
        ended (return None)."""
        while True:
            text, marker, rest = self._unread.partition(INPUT_MARKER)
            self._unread = rest
            self._show(self._decoder.decode(text))
            if marker:
                prompt, self._partial_line = self._partial_line, ""
                return prompt
            try:
                self._unread = self._sock.recv(65536)
            except OSError:
                self._unread = b""
            if not self._unread:
                self._show(self._decoder.decode(b"", final=True))
                if self._partial_line:
                    self._out.write(self._partial_line + "\n")
                    self._out.flush()
                return None

    def _show(self, text: str) -> None:
        complete, newline, self._partial_line = (self._partial_line + text).rpartition("\n")
        if newline:
            self._out.write(complete + newline)
            self._out.flush()
