"""An authenticated controller still cannot make an agent spin, swell or crash: a count over
its limit is refused at once (a FAULT naming the field, the value and the limit) and the
session goes on; a frame's announced size costs nothing until its bytes arrive; a segment
table over the limit is refused from the frame's prefix; a malformed message gets a FAULT
saying what was wrong, and the agent's log one warning, no traceback.

The agent is a real ``phalanx agent`` of this module's own on 127.0.0.13 (loopback only),
spoken to with the real token over the connection a controller makes
(:func:`phalanx.backends.cluster.tree.connect_agent`).
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import phalanx as px
from phalanx import config
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.agent.branch import malformed_from_child
from phalanx.backends.cluster.agent.share import NodeObjects
from phalanx.backends.cluster.link import AgentLink
from phalanx.wire import framing, handshake, protocol
from tests import helpers
from tests.agentcluster import free_port, listening, terminate
from tests.workers import Probe

HOST = "127.0.0.13"
MIB = 1 << 20
_PREFIX = struct.Struct("<IQ")


class Agent:
    def __init__(self, proc: subprocess.Popen, port: int, token: bytes, token_file: str,
                 log: str) -> None:
        self.proc, self.port, self.token, self.token_file, self.log = (
            proc, port, token, token_file, log)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def log_text(self) -> str:
        with open(self.log) as f:
            return f.read()

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def children(self) -> list[int]:
        return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]

    def cpu(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    where = tmp_path_factory.mktemp("bounded")
    token_file = Path(helpers.token_file(where))
    log = str(where / "agent.log")
    port = free_port(HOST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(helpers.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("PHALANX_TOKEN", None)
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "agent", "--host", HOST, "--port", str(port),
             "--token-file", str(token_file), "--no-http", "--heartbeat-timeout", "10"],
            env=env, cwd=helpers.REPO, stdin=subprocess.DEVNULL, stderr=stderr)
    helpers.CLUSTER_ROOTS.add(proc.pid)  # it outlives each test; what it runs is checked
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(HOST, port), 20,
                                  interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        yield Agent(proc, port, handshake.stretch(token_file.read_bytes().strip()),
                    str(token_file), log)
    finally:
        helpers.CLUSTER_ROOTS.discard(proc.pid)
        terminate([proc])


class Controller:
    """A controller's connection to the agent, made by hand: the token proved, WELCOME read."""

    def __init__(self, agent: Agent) -> None:
        self.writer = framing.BacklogWriter("test-writer")
        self.joined = agenttree.connect_agent(HOST, agent.port, agent.token, None, 5.0)
        self.conn = self.joined.connection(self.writer)

    def request(self, kind: int, request_id: int, *fields) -> None:
        self.conn.send(agentwire.request(kind, request_id, *fields))

    def raw(self, data: bytes) -> None:
        """Bytes straight onto the socket (a frame the agent must refuse before it is
        complete, so before any tag could be checked)."""
        self.joined.sock.sendall(data)

    def next(self, kinds: tuple[int, ...], timeout: float = 5.0) -> tuple[int, int, tuple]:
        """The first message of one of ``kinds``: ``(kind, call_id, fields)``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.conn.read_fd], [], [], left)
            if not ready:
                break
            for segs in self.conn.reader.recv_frames(block=False):
                kind, call_id, _, extra = protocol.parse(segs[0])
                if kind in kinds:
                    return kind, call_id, extra
        raise AssertionError(f"no message of kinds {kinds} within {timeout} s")

    def closed_by_agent(self, timeout: float = 5.0) -> bool:
        try:
            self.next((), timeout)
        except framing.ConnectionLost:
            return True
        except AssertionError:
            return False
        return False

    def close(self) -> None:
        self.conn.close()
        self.writer.stop()


@pytest.fixture
def controller(agent):
    made: list[Controller] = []

    def connect() -> Controller:
        made.append(Controller(agent))
        return made[-1]

    yield connect
    for c in made:
        c.close()


def test_a_huge_ports_count_is_refused_at_once_and_the_agent_serves_on(agent, controller):
    c = controller()
    started = time.monotonic()
    c.request(agentwire.PORTS, 7, 10**6)
    kind, call_id, (reason,) = c.next((agentwire.FAULT, agentwire.REPLY))
    took = time.monotonic() - started
    assert (kind, call_id) == (agentwire.FAULT, 7)
    assert "PORTS count is 1000000" in reason and "limit of 1024" in reason, reason
    assert "AGENT_MAX_PORTS" in reason
    assert took < 1.0, f"the refusal took {took:.2f} s"
    c.request(agentwire.PORTS, 8, 2)  # the same session goes on
    kind, call_id, (ok, ports) = c.next((agentwire.FAULT, agentwire.REPLY))
    assert (kind, call_id, ok, len(set(ports))) == (agentwire.REPLY, 8, True, 2)
    c.close()
    backend = px.ClusterBackend([agent.address], token_file=agent.token_file)
    with px.WorkerGroup(Probe, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0]
    assert helpers.wait_until(lambda: not agent.children(), 10), "the group's ranks stayed"


@pytest.mark.parametrize(("fields", "words"), [
    (([[i, 0, 1, {}] for i in range(5000)], [], {}, None),
     "LAUNCH starts: its length is 5000, over the agent's limit of 4096"),
    (([[0, 0, 1, {f"V{i}": "x" for i in range(5000)}]], [], {}, None),
     "the variables of one is 5000, over the agent's limit of 4096"),
], ids=["starts", "environment"])
def test_a_launch_over_its_limits_starts_nothing(agent, controller, fields, words):
    c = controller()
    before = agent.children()
    c.request(agentwire.LAUNCH, 3, *fields)
    kind, call_id, (reason,) = c.next((agentwire.FAULT, agentwire.REPLY))
    assert (kind, call_id) == (agentwire.FAULT, 3)
    assert words in reason, reason
    assert agent.children() == before


@pytest.mark.parametrize(("kind", "fields", "words"), [
    (agentwire.STOP, (list(range(4097)), 1.0, True), "STOP ranks: its length is 4097"),
    (agentwire.WAIT, (list(range(4097)), 1.0), "WAIT ranks: its length is 4097"),
    (agentwire.SYNC, ("v", [["f", "h", 0, 0]] * ((1 << 17) + 1)),
     "SYNC listing: its length is 131073, over the agent's limit of 131072"),
    (agentwire.BLOBS, (["h"] * ((1 << 17) + 1),), "BLOBS hashes: its length is 131073"),
    (agentwire.ADOPT, (1, [], 1 << 20, 5.0), "ADOPT fanout is 1048576, over the agent's limit"),
    (agentwire.ADOPT, (1, [[2, "h", 1]] * ((1 << 16) + 1), 2, 5.0),
     "ADOPT entries: its length is 65537"),
], ids=["stop", "wait", "sync", "blobs", "fanout", "adopt"])
def test_each_count_over_its_limit_is_refused_and_the_session_goes_on(
        controller, kind, fields, words):
    c = controller()
    c.request(kind, 5, *fields)
    got, call_id, (reason,) = c.next((agentwire.FAULT, agentwire.REPLY))
    assert (got, call_id) == (agentwire.FAULT, 5)
    assert words in reason and "phalanx.config.AGENT_MAX_" in reason, reason
    c.request(agentwire.PORTS, 6, 1)
    assert c.next((agentwire.FAULT, agentwire.REPLY))[:2] == (agentwire.REPLY, 6)


def test_an_announced_gigabyte_costs_the_agent_what_arrived(agent, controller):
    c = controller()
    rss = agent.rss()
    body = (1 << 30) - 64  # under the agent's --max-frame-mib (1 GiB)
    table = struct.pack("<2Q", 16, body - 32)
    c.raw(_PREFIX.pack(2, body) + table + b"h" * 16 + b"x" * MIB)  # then nothing more
    time.sleep(1.0)
    grown = agent.rss() - rss
    print(f"agent RSS grew by {grown / MIB:.1f} MiB for a frame announcing {body / MIB:.0f} "
          "MiB (1 MiB of it sent)")
    assert grown < 16 * MIB, f"the agent's RSS grew by {grown / MIB:.0f} MiB"
    assert agent.proc.poll() is None


def test_a_64_mib_segment_table_is_refused_from_the_frames_prefix(agent, controller):
    c = controller()
    nseg = 8 * MIB  # its table: 64 MiB
    rss, cpu = agent.rss(), agent.cpu()
    table = bytes(8 * nseg)

    def send() -> None:
        try:
            c.raw(_PREFIX.pack(nseg, 8 * nseg + nseg) + table)
        except OSError:
            pass  # the agent hung up mid-table

    thread = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    thread.start()
    _, _, (reason,) = c.next((agentwire.FAULT,))
    took = time.monotonic() - started
    assert f"a frame of {nseg} segments (the limit is " in reason, reason
    assert took < 2.0
    assert c.closed_by_agent()
    thread.join(10)
    grown, spent = agent.rss() - rss, agent.cpu() - cpu
    print(f"a 64 MiB segment table: refused after {took:.2f} s; the agent spent {spent:.2f} s "
          f"of CPU and {grown / MIB:.1f} MiB")
    assert spent < 1.0 and grown < 32 * MIB


def _segment_zero(kind: int, extra: bytes) -> bytes:
    return protocol.pack_head(kind, 1, 0) + extra


@pytest.mark.parametrize(("frame", "words"), [
    (framing.frame([b"\x40\x01"]), "a malformed message header (error: "),
    (framing.frame([_segment_zero(agentwire.PORTS, pickle.dumps((3,)))]),
     "a malformed message header (ValueError: malformed header fields: unknown tag 0x80"),
    (agentwire.request(agentwire.PORTS, 1, "many"), "PORTS count is a str, not an integer"),
    (agentwire.request(agentwire.STOP, 1, [0]), "STOP with 1 fields (it has 3: ranks, grace"),
    (agentwire.request(99, 1), "a message of unknown kind 99"),
    (agentwire.request(protocol.RESULT, 1), "a message of unknown kind 2"),
    (agentwire.request(agentwire.READ, 1, [1, 2]),
     "READ block is list [1, 2], not (pid, fd, name, extents, capacity[, tensors])"),
    (agentwire.request(agentwire.READ, 1, [1, 3, "x", [[0, 100]], 64]),
     "READ block: an extent is [0, 100], not (offset, length) within its 64 bytes"),
    (agentwire.request(agentwire.COPY, 1, 5, "t", [1, 3, "x", [], 64], "h", 0, 1.0),
     "COPY port is 0, under 1"),
], ids=["short-header", "pickled-fields", "wrong-type", "wrong-arity", "unknown-node-kind",
        "unknown-rank-kind", "read-fields", "read-extent", "copy-port"])
def test_a_malformed_message_gets_a_fault_and_one_warning_without_traceback(
        agent, controller, frame, words):
    c = controller()
    c.conn.send(frame)
    kind, _, (reason,) = c.next((agentwire.FAULT, agentwire.REPLY))
    assert kind == agentwire.FAULT
    assert words in reason, reason
    assert c.closed_by_agent(), "the session went on after a malformed message"
    assert helpers.wait_until(lambda: words in agent.log_text(), 5)
    log = agent.log_text()
    assert "Traceback" not in log, log
    # the agent logs at WARNING and above: the line is there, once
    lines = [line for line in log.splitlines() if words in line]
    assert len(lines) == 1 and "ending a controller's session" in lines[0], lines


@pytest.mark.parametrize(("data", "words"), [
    (_PREFIX.pack(0, 8) + bytes(8), "a malformed frame header (0 segments in 8 bytes)"),
    (_PREFIX.pack(2, 40) + struct.pack("<2Q", 20, 30) + bytes(24),
     "its 2 segments' lengths add up to 50 bytes, its body holds 24"),
], ids=["no-segments", "lengths"])
def test_a_malformed_frame_prefix_gets_a_fault_and_no_traceback(agent, controller, data, words):
    c = controller()
    c.raw(data)
    _, _, (reason,) = c.next((agentwire.FAULT,))
    assert words in reason, reason
    assert c.closed_by_agent()
    assert helpers.wait_until(lambda: words in agent.log_text(), 5)
    assert "Traceback" not in agent.log_text()


def test_a_read_names_only_a_block_a_rank_keeps_not_any_descriptor(agent, controller):
    # READ serves a kept result's memory block to another agent; a descriptor that is not
    # one of phalanx's blocks (the agent's own stdin, a file) is refused, the session goes on
    c = controller()
    for pid, fd in ((agent.proc.pid, 0), (agent.proc.pid, 2), (1, 0)):
        c.request(agentwire.READ, 7, [pid, fd, "0123456789abcdef", [[0, 8]], 4096])
        kind, call_id, (ok, why) = c.next((agentwire.REPLY, agentwire.FAULT))
        assert (kind, call_id, ok) == (agentwire.REPLY, 7, False), why
        assert "the rank that kept it is gone" in why and "no longer holds it" in why, why
    c.request(agentwire.PORTS, 8, 1)
    assert c.next((agentwire.REPLY,))[2][0] is True


def test_the_agent_still_serves_after_all_of_it(agent):
    assert agent.proc.poll() is None
    with socket.create_connection((HOST, agent.port), timeout=5):
        pass
    backend = px.ClusterBackend([agent.address], token_file=agent.token_file)
    with px.WorkerGroup(Probe, backend=backend, echo_output=False) as group:
        assert group.call("rank") == [0]
    assert helpers.wait_until(lambda: not agent.children(), 10), "the group's ranks stayed"
    assert "Traceback" not in agent.log_text()


def _results(sizes=(1, 2), blob=b"xyy", listed=None, counts=None, buffers=0,
             count=2) -> list:
    """A RESULTS (messages.results' layout) of ranks 3 and 4, or whatever the fields say."""
    packed = struct.pack(f"<{len(sizes)}Q", *sizes) if isinstance(sizes, tuple) else sizes
    return [protocol.header(agentwire.RESULTS, 9, 3, count, listed, packed, counts), blob,
            *[b"b"] * buffers]


@pytest.mark.parametrize(("segs", "words"), [
    (_results(), None),
    (_results(listed=struct.pack("<2I", 3, 7), counts=struct.pack("<2I", 0, 1), buffers=1),
     None),
    ([protocol.header(agentwire.FAULT, 0, 0, "it stopped")], None),
    (_results(blob=b"xy"), "a malformed RESULTS (pickles of 3 bytes in all, in a segment of 2)"),
    (_results(sizes=(3,)), "sizes of 8 bytes for 2 ranks"),
    (_results(listed=struct.pack("<2I", 3, 3)), "ranks that are not increasing from 3"),
    (_results(sizes="12"), "sizes of a str '12' for 2 ranks"),
    (_results(buffers=1), "1 buffers, and no rank's count of them"),
    (_results(counts=struct.pack("<2I", 1, 1), buffers=1),
     "counts of buffers adding up to 2 for 1 buffers"),
    (_results(count=-1), "results of -1 ranks"),
    ([protocol.pack_head(agentwire.RESULTS, 9, 0) + b"\x80\x05junk"],
     "a malformed message header (ValueError: malformed header fields"),
], ids=["results", "listed-with-buffers", "fault", "short", "too-few-sizes", "unordered",
        "not-bytes", "buffers-uncounted", "buffers-miscounted", "negative", "pickle"])
def test_a_childs_results_are_checked_before_the_relay_reads_them(segs, words):
    found = malformed_from_child(segs)
    assert found is None if words is None else words in found, found


def test_a_hold_past_the_most_objects_held_is_refused_before_it_is_written(monkeypatch):
    from phalanx.node import shm

    if not shm.supported():
        pytest.skip("put objects need Linux's memfd_create")
    monkeypatch.setattr(config, "AGENT_MAX_HELD", 2)
    objects = NodeObjects(threading.Lock(), list)
    try:
        objects.hold(1, "a" * 16, False, [b"one"])
        objects.hold(2, "b" * 16, False, [b"two"])
        objects.check_room(2)  # replacing a held object takes no room
        with pytest.raises(agentwire.OverLimit, match=r"HOLD: the objects held are 3, over "
                                                      r"the agent's limit of 2"):
            objects.check_room(3)
        objects.drop(1)
        objects.check_room(3)
    finally:
        objects.close()


def test_a_controllers_request_over_a_limit_fails_alone_and_the_node_stays(agent):
    writer = framing.BacklogWriter("test-writer")
    joined = agenttree.connect_agent(HOST, agent.port, agent.token, None, 5.0)
    link = AgentLink(joined, writer, 1 << 30)
    try:
        with pytest.raises(px.PhalanxError, match=r"it refused a request: PORTS count is "
                                                  r"1000000, over the agent's limit of 1024"):
            link.request(agentwire.PORTS, 10**6, timeout=5)
        assert link.lost_reason is None
        assert len(set(link.request(agentwire.PORTS, 3, timeout=5))) == 3
    finally:
        link.close()
        writer.stop()
