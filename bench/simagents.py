"""Many lightweight ``phalanx agent``s in one process, for the scale benchmark (W10).

Each simulated node is a real :class:`~phalanx.backends.cluster.agent.daemon.Agent`: its own
loopback address and listening socket, the token proved both ways, a real
:class:`~phalanx.backends.cluster.agent.ranks.Session` relaying -- and, in a tree, adopting and
forwarding to its children. Only its rank is
simulated: instead of a process started under a supervisor, a tiny in-process object
answers the rank's messages in the relay's own pass (INIT, CALL, SHUTDOWN), with the same
frames a worker process would send. So a thousand nodes fit on a small machine, and what
is measured is the controller's and the agents' part of a call.

A simulated rank answers as a real one does: its method's value as a RESULT, an exception
as an ERROR with the rank's traceback (what the controller reports, naming the rank); a
method that returns :data:`NO_ANSWER` leaves the call unanswered, as a rank stuck in it
would (a test of fail-fast: another rank's error must not wait for it).

Run as ``python -m bench.simagents --token-file F ADDRESS...``: it prints one JSON line
with the agents' ``host:port`` entries, then serves until stdin closes or SIGTERM. A line
``bytes`` on stdin is answered with one JSON line: for each agent (its address), the bytes
it has received from whoever is above it (the controller, or its parent agent in a tree),
over all its sessions -- what each link of a tree carries. A line ``stop HOST:PORT`` stops
that agent as if its machine went (its connections end, above and below; its listener
closes) and is answered ``stopped HOST:PORT``: a test's dead node, or dead subtree.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
from typing import Any

from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.agent.daemon import Agent
from phalanx.backends.cluster.agent.ranks import Session
from phalanx.errors import RemoteFailure
from phalanx.wire import pickling, protocol

_PREFIX = struct.Struct("<IQ")


class _NoAnswer:
    # told by this mark, not by identity: this module runs as __main__ in the agents'
    # processes, where the ranks' code imports it again as bench.simagents
    sim_no_answer = True


NO_ANSWER = _NoAnswer()  # a simulated rank's method that returns it never answers the call
_RECEIVED: dict[str, int] = {}  # an agent's address -> bytes it received from above
_RECEIVED_LOCK = threading.Lock()


def _segments(frame: list[Any]) -> list[bytes]:
    """The segments of a frame built by :func:`phalanx.wire.framing.frame` (for a simulated
    rank)."""
    data = b"".join(bytes(s) for s in frame)
    count, _ = _PREFIX.unpack_from(data)
    lengths = struct.unpack_from(f"<{count}Q", data, _PREFIX.size)
    pos = _PREFIX.size + 8 * count
    segments = []
    for length in lengths:
        segments.append(data[pos:pos + length])
        pos += length
    return segments


class _SimConn:
    """A simulated rank's end of its connection: it answers in the relay's pass."""

    read_fd = -1

    def __init__(self, session: SimSession, rank: _SimRank) -> None:
        self.session, self.rank = session, rank

    def send(self, frame: list[Any]) -> None:
        segs = _segments(frame)
        kind, call_id, _, extra = protocol.parse(segs[0])
        rank = self.rank
        if kind == protocol.CALL:
            try:
                args, kwargs = pickling.loads(segs[1:])
                value = getattr(rank.obj, extra[0])(*args, **kwargs)
            except Exception as exc:  # the rank's error, reported as a rank does
                failure = RemoteFailure.from_exception(exc, "running the method",
                                                       exc.__traceback__)
                self.session._up(rank, [[protocol.header(  # type: ignore[arg-type]
                    protocol.ERROR, call_id, rank.rank, failure.as_tuple())]])
                return
            if getattr(type(value), "sim_no_answer", False) is True:
                return
            self.session._up(rank, [[protocol.header(protocol.RESULT, call_id,  # type: ignore[arg-type]
                                                     rank.rank),
                                     *pickling.dumps_fast(value)]])
        elif kind == protocol.SHUTDOWN:
            rank.exitcode = 0
            self.session._queue(rank.exited())

    def close(self) -> None:
        pass


class _SimBurial:
    """What the session asks of a rank's burial: whether its death was claimed (a
    simulated rank dies only when stopped)."""

    def __init__(self, rank: _SimRank) -> None:
        self._rank = rank

    @property
    def claimed(self) -> bool:
        return self._rank.exitcode is not None


class _SimProcess:
    pid = os.getpid()


class _SimRank:
    def __init__(self, session: SimSession, rank: int, node: int, incarnation: int,
                 obj: Any) -> None:
        self.rank, self.node, self.incarnation, self.obj = rank, node, incarnation, obj
        self.exitcode: int | None = None
        self.calls: dict[int, str] = {}  # as a real rank's record: the calls sent to it
        self.broke: str | None = None
        self.ready: list[Any] | None = None  # a real rank's READY kept for an attach
        self.process = _SimProcess()  # what the session's record of an orphan reads
        self.conn = _SimConn(session, self)
        self.burial = _SimBurial(self)

    def exited(self) -> list[Any]:
        return agentwire.exited(self.rank, self.incarnation, {
            "rank": self.rank, "node": self.node, "pid": os.getpid(),
            "exitcode": self.exitcode, "stderr_tail": (), "reason": None})


class SimSession(Session):
    """A session whose ranks are simulated in-process (see the module's docstring)."""

    def __init__(self, sock: Any, **options: Any) -> None:
        count = options["counters"]
        host, port = sock.getsockname()[:2]
        address = f"{host}:{port}"

        def counters(name: str, value: float) -> None:  # the bytes from above, kept too
            if name == "received_bytes_total":
                with _RECEIVED_LOCK:
                    _RECEIVED[address] = _RECEIVED.get(address, 0) + int(value)
            count(name, value)

        super().__init__(sock, **{**options, "counters": counters})

    def _launch(self, starts: list[tuple], sys_path: list[str], options: dict,
                cwd: str | None, payload: list[Any]) -> list[int]:
        target, args, kwargs, own = pickling.loads(payload)  # own: rank_kwargs=
        ranks = []
        for rank, node_index, incarnation, _env in starts:
            mine = {**kwargs, **own.get(rank, {})}
            ranks.append(_SimRank(self, rank, node_index, incarnation, target(*args, **mine)))
        with self._lock:
            self._launched.extend((r.rank, r) for r in ranks)
        # {method: its parameters' names}, as a real rank reports them (phalanx.rank)
        methods: dict[str, list[str]] = {}
        if ranks:
            for m in dir(ranks[0].obj):
                if not m.startswith("_") and callable(getattr(ranks[0].obj, m)):
                    code = getattr(getattr(ranks[0].obj, m), "__code__", None)
                    methods[m] = ([] if code is None
                                  else list(code.co_varnames[1:code.co_argcount]))
        for r in ranks:  # after _launched: the relay registers them before the next call
            ready = protocol.ready_frame(r.rank, os.getpid(), methods, {})
            r.ready = _segments(ready)  # as a real rank's: sent again to an attaching one
            self._send(ready)
        return [os.getpid()] * len(ranks)

    def _from_controller(self) -> bool:
        if self._launched:
            self._register_launched()
        return super()._from_controller()

    def _register_launched(self) -> None:
        with self._lock:
            launched, self._launched = self._launched, []
        for number, rank in launched:
            self._ranks[number] = rank  # type: ignore[assignment]

    def _stop(self, ranks: list[int], grace: float, force: bool, payload: list[Any]) -> None:
        for number in ranks:
            rank = self._ranks.get(number)
            if rank is not None and rank.exitcode is None:
                rank.exitcode = -signal.SIGTERM
                self._send(rank.exited())  # type: ignore[attr-defined]

    def _wait(self, ranks: list[int], timeout: float, payload: list[Any]) -> None:
        pass

    def _stacks(self, rank: int, timeout: float, payload: list[Any]) -> str:
        return "(no stack: a simulated rank)"

    def _end(self) -> None:
        self._ranks.clear()
        super()._end()


class SimAgent(Agent):
    session_class = SimSession


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-file", required=True)
    parser.add_argument("addresses", nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with open(args.token_file, "rb") as f:
        token = f.read().strip()
    store = tempfile.mkdtemp(prefix="phalanx-sim-store-")  # no code is shipped here
    # node_timeout: a parent judges its children by it; two CPUs shared by a thousand
    # agents may leave one unscheduled for seconds under a broadcast
    agents = [SimAgent(address, 0, token, heartbeat_timeout=120.0, node_timeout=120.0,
                       store=store)
              for address in args.addresses]
    for agent in agents:
        threading.Thread(target=agent.serve_forever, daemon=True).start()
    print(json.dumps([f"{a.address[0]}:{a.address[1]}" for a in agents]), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())

    by_address = {f"{a.address[0]}:{a.address[1]}": a for a in agents}

    def commands() -> None:
        for line in sys.stdin:
            word, _, argument = line.strip().partition(" ")
            if word == "bytes":
                with _RECEIVED_LOCK:
                    print(json.dumps(_RECEIVED), flush=True)
            elif word == "stop" and argument in by_address:
                by_address[argument].stop(2.0)
                print(json.dumps(f"stopped {argument}"), flush=True)
        done.set()

    threading.Thread(target=commands, daemon=True).start()
    done.wait()
    stoppers = [threading.Thread(target=agent.stop, args=(2.0,), daemon=True)
                for agent in agents]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(5.0)
    shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
