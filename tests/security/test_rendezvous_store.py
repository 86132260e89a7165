"""The store a joint torch world meets in -- ``px.weight_sync``'s and ``px.rendezvous``'s
(``px.joint_store``) -- with a stranger about who can reach its port while the world forms.

torch's ``TCPStore`` listened on every interface and answered anyone: a stranger read the
members' gloo address keys, and by overwriting them failed every formation. Now:

- during a weight sync's formation, held open by a busy target, a stranger who connects to
  every port the serving member opened (as ``TCPStore``'s client, and with the store's own
  greeting and a wrong proof) reads no key, writes none, and the push forms and delivers
  the weights; what it is sent is a 32-byte nonce, then a refusal and the end; the store
  listens on the node's address (127.0.0.2 on the agent cluster), never the wildcard, and
  no longer at all once the world formed;
- the same for ``px.rendezvous`` and ``px.joint_store``, the store on ``MASTER_ADDR``;
- the store itself (no torch): a silent stranger is dropped by its deadline, strangers
  holding every handshake slot do not keep a member out, a member never believes a peer
  that does not prove the secret, a frame altered, replayed or reordered is refused, and
  the wildcard address is refused.

Every wait is bounded; only loopback addresses are used.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest

import phalanx as px
from phalanx import AuthenticationError
from phalanx.wire import kvproto
from phalanx.wire.kvstore import StoreClient, StoreServer, StoreTimeout
from tests import helpers

SECRET = secrets.token_bytes(32)
# A nap ends when the test releases it (a file appears), once what it holds up is done:
# these are bounds on a nap the test never released (a failure), below the formation's
# 60 s timeouts; a fixed nap had to outlast the stranger's tries on a loaded machine.
NAP = 40.0  # seconds a target holds its world's formation open while the stranger tries
SOURCE_NAP = 20.0  # seconds the source answers late, so that a target's nap comes first
PROBE_TIMEOUT = 1.5  # seconds the stranger gives each attempt (on loopback: ample)
WILDCARDS = {"0.0.0.0", "::"}


# -- the naps that hold a formation open -----------------------------------------------------


def _nap(seconds: float, until: str | None) -> None:
    """Sleep ``seconds``, or until the file ``until`` exists (every rank of the suite runs
    on this machine, the agent cluster's too)."""
    helpers.wait_until(lambda: until is not None and os.path.exists(until), seconds)


class Release:
    """A file whose creation ends the naps given its path (:func:`_nap`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __call__(self) -> None:
        with open(self.path, "a"):
            pass


# -- the stranger -------------------------------------------------------------------------


def _greet_wrongly(address: tuple[str, int]) -> dict:
    """Connect, send the store's greeting, and a wrong proof if a nonce comes back: what
    came back, and whether (and how soon) the connection ended."""
    with socket.create_connection(address, timeout=PROBE_TIMEOUT) as sock:
        sock.sendall(kvproto.MAGIC + os.urandom(kvproto.NONCE_SIZE))
        first = _read_for(sock, PROBE_TIMEOUT, kvproto.NONCE_SIZE)
        if len(first) != kvproto.NONCE_SIZE:
            return {"store": False, "got": first}
        sock.sendall(os.urandom(kvproto.PROOF_SIZE))
        began = time.monotonic()
        rest = _read_for(sock, PROBE_TIMEOUT, 1 << 16)
        return {"store": True, "got": first + rest, "after_proof": rest,
                "ended_in": time.monotonic() - began}


def _read_for(sock: socket.socket, seconds: float, limit: int) -> bytes:
    """What arrives within ``seconds`` (up to ``limit`` bytes, or the end)."""
    data = b""
    deadline = time.monotonic() + seconds
    while len(data) < limit and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(limit - len(data))
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


# torch's own store client, in a process of its own: it may block past its timeout where a
# peer holds the connection without answering (gloo's listener does), so the test bounds it
# from outside, and kills it.
_TORCH_STRANGER = r"""
import json, sys, threading
from datetime import timedelta
import torch.distributed as dist

def attempt(host, port, size):
    where = [host, port]
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=float(sys.argv[1])))
    except Exception as exc:
        print(json.dumps({"address": where, "connected": False, "why": repr(exc)[:200]}),
              flush=True)
        return
    print(json.dumps({"address": where, "connected": True}), flush=True)
    read, wrote = {}, []
    try:
        read["num_keys"] = store.num_keys()
        read["0/0"] = store.get("0/0").hex()  # the serving member's gloo address
    except Exception:
        pass
    for rank in range(1, size):  # garbage in the others' places: the formation fails
        try:
            store.set(f"0/{rank}", b"\xff" * 64)
            wrote.append(rank)
        except Exception:
            pass
    print(json.dumps({"address": where, "connected": True, "read": read, "wrote": wrote}),
          flush=True)

print("ready", flush=True)
for line in sys.stdin:
    host, port, size = line.split()
    threading.Thread(target=attempt, args=(host, int(port), int(size)), daemon=True).start()
"""


class TorchStranger:
    """A process that connects where it is told as torch's ``TCPStore`` client, reads the
    gloo address keys and writes garbage over the others' -- what the finding did."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _TORCH_STRANGER, str(PROBE_TIMEOUT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.lines.get(timeout=120) == "ready", "the stranger did not start"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def attack(self, addresses: list[tuple[str, int]], world_size: int, within: float
               ) -> dict[tuple[str, int], dict]:
        """Each address's last report (``connected`` False: refused, or no answer within
        ``within`` s)."""
        assert self.proc.stdin is not None
        for host, port in addresses:
            self.proc.stdin.write(f"{host} {port} {world_size}\n")
        self.proc.stdin.flush()
        reports: dict[tuple[str, int], dict] = {
            a: {"connected": False, "why": "no answer in time"} for a in addresses}
        deadline = time.monotonic() + within
        done: set[tuple[str, int]] = set()
        while len(done) < len(addresses) and (left := deadline - time.monotonic()) > 0:
            try:
                report = json.loads(self.lines.get(timeout=left))
            except queue.Empty:
                break
            address = (report["address"][0], report["address"][1])
            reports[address] = report
            if not report["connected"] or "read" in report:
                done.add(address)
        return reports

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def torch_stranger():
    pytest.importorskip("torch", reason="the joint world is torch's: pip install torch")
    stranger = TorchStranger()
    try:
        yield stranger
    finally:
        stranger.close()


def _attack(addresses: list[tuple[str, int]], world_size: int,
            stranger: TorchStranger) -> dict:
    """Both attempts on every address at once (the formation waits meanwhile)."""
    with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
        greeted = {a: pool.submit(_greet_wrongly, a) for a in addresses}
        as_torch = stranger.attack(addresses, world_size, within=2 * PROBE_TIMEOUT)
        return {a: (greeted[a].result(timeout=30), as_torch[a]) for a in addresses}


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _new_listeners(pid: int, before: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """The listeners ``pid`` opened since ``before``: once one is open (a store's), and a
    moment more for a second (gloo's, opened as soon as the store answers), within bounds."""
    assert helpers.wait_until(lambda: _listening(pid) - before, 60, interval=0.05), (
        "the serving member never opened a port")
    helpers.wait_until(lambda: len(_listening(pid) - before) >= 2, 2.0, interval=0.05)
    return _listening(pid) - before


def _check_the_stranger_failed(attempts: dict, node_address: str) -> tuple[str, int]:
    """Nothing read or written; the store (the port that greeted back) sent a nonce, then
    a refusal and the end, and listens on the node's address: its address."""
    for address, (_, as_torch) in attempts.items():
        assert not as_torch["connected"], (
            f"a stranger connected to {address} as torch's store client: {as_torch}")
    stores = [a for a, (greeted, _) in attempts.items() if greeted["store"]]
    assert len(stores) == 1, f"no port (or several) answered as the store: {attempts}"
    greeted = attempts[stores[0]][0]
    assert greeted["after_proof"] == kvproto.REFUSED, greeted  # and nothing else
    assert greeted["ended_in"] < PROBE_TIMEOUT, "the store kept the stranger connected"
    assert stores[0][0] == node_address, f"the store listens on {stores[0]}"
    assert not {ip for ip, _ in attempts} & WILDCARDS, (
        f"a port of the formation listens on every interface: {sorted(attempts)}")
    return stores[0]


# -- px.weight_sync ------------------------------------------------------------------------


class Trainer:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.weights = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}

    def state(self) -> dict:
        return self.weights

    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float, until: str | None = None) -> None:
        _nap(seconds, until)


class Generator:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.weights: dict = {}

    def load(self, state: dict) -> None:
        self.weights = {name: t.clone() for name, t in state.items()}

    def total(self) -> float:
        return float(sum(t.sum() for t in self.weights.values()))

    def nap(self, seconds: float, until: str | None = None) -> None:
        _nap(seconds, until)


@pytest.fixture(params=["local", "cluster"])
def where(request):
    """A backend, and the address of its node 0 (the agents' cluster: 127.0.0.2)."""
    pytest.importorskip("torch", reason="a weight sync moves torch tensors: pip install torch")
    if request.param == "cluster":
        return request.getfixturevalue("agent_cluster").backend()
    return "local"


def test_a_stranger_cannot_read_write_or_fail_a_weight_sync_formation(where, torch_stranger,
                                                                      tmp_path):
    source_answers, formation_goes_on = Release(tmp_path / "source"), Release(tmp_path / "nap")
    with px.WorkerGroup(Trainer, backend=where, echo_output=False) as trainers, \
            px.WorkerGroup(Generator, procs_per_node=2, backend=where,
                           echo_output=False) as generators:
        node_address = trainers.free_port()[0]
        serving = trainers.call_one(0, "pid")  # the source, on its group's node 0
        before = _listening(serving)
        with px.weight_sync(trainers, generators, transport="broadcast", timeout=120) as sync:
            # The push asks every member where it is, then forms the world. The source
            # answers late (it naps first); the generators at once, and then generator 1
            # starts a nap of its own, which the formation waits for (until the stranger
            # is done).
            source_napping = trainers.call_async("nap", SOURCE_NAP, source_answers.path)
            pushing = concurrent.futures.ThreadPoolExecutor(1)
            try:
                pushed = pushing.submit(sync.push, "state", "load")
                assert helpers.wait_until(lambda: _asked_where(trainers, generators), 30)
                # the source's question is registered a moment before the generators' (one
                # after the other, then sent): still so a moment later, they were answered
                time.sleep(0.3)
                assert helpers.wait_until(lambda: _asked_where(trainers, generators), 30)
                napping = generators.call_async("nap", NAP, formation_goes_on.path,
                                                workers=[1])
                # the nap is sent ahead of the formation's own calls to generator 1
                source_answers()
                source_napping.result(timeout=60)
                opened = _new_listeners(serving, before)
                attempts = _attack(sorted(opened), 3, torch_stranger)
                held_open = not pushed.done()
                formation_goes_on()
                store = _check_the_stranger_failed(attempts, node_address)
                assert held_open, "the formation ended before the stranger's tries"
                stats = pushed.result(timeout=120)  # formed, whatever the stranger did
            finally:
                source_answers()  # (on a failure: the groups shut down at once)
                formation_goes_on()
                pushing.shutdown(wait=True)
            napping.result(timeout=60)
            assert stats.formed and sync.state.name == "FORMED"
            assert generators.call("total") == [499503.0, 499503.0]
            # formed: nobody needs the store's port any more
            assert store not in _listening(serving)
            assert sync.push("state", "load").formed is False


def _asked_where(trainers: px.WorkerGroup, generators: px.WorkerGroup) -> bool:
    """Whether the push's first question is waiting at the napping source and was answered
    by every generator (they were asked at the same time)."""
    return (trainers.health()[0].calls_in_flight >= 2
            and all(h.calls_in_flight == 0 for h in generators.health()))


# -- px.rendezvous and px.joint_store -------------------------------------------------------


class Member:
    def __init__(self, value: float = 0.0) -> None:
        import torch

        torch.set_num_threads(1)
        self.tensor = torch.full((8,), value)

    def join(self, world: dict) -> int:
        import torch.distributed as dist

        self.store = px.joint_store(world, timeout=60)
        rank, size = int(world["RANK"]), int(world["WORLD_SIZE"])
        self.joint = dist.ProcessGroupGloo(self.store, rank, size, timedelta(seconds=60))
        return rank

    def broadcast(self) -> float:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.joint.broadcast([self.tensor], options).wait()
        return float(self.tensor.sum())

    def nap(self, seconds: float, until: str | None = None) -> None:
        _nap(seconds, until)

    def pid(self) -> int:
        return os.getpid()


def test_a_stranger_cannot_read_write_or_fail_a_rendezvous_world(torch_stranger, tmp_path):
    formation_goes_on = Release(tmp_path / "nap")
    with px.WorkerGroup(Member, args=(2.0,), echo_output=False) as trainers, \
            px.WorkerGroup(Member, procs_per_node=2, echo_output=False) as generators:
        worlds = px.rendezvous(trainers, generators)
        secret = worlds[0][0]["STORE_SECRET"]
        assert len(bytes.fromhex(secret)) == 32
        assert {w["STORE_SECRET"] for ws in worlds for w in ws} == {secret}
        address = (worlds[0][0]["MASTER_ADDR"], int(worlds[0][0]["MASTER_PORT"]))
        serving = trainers.call_one(0, "pid")
        before = _listening(serving)
        napping = generators.call_async("nap", NAP, formation_goes_on.path, workers=[1])
        joined = [trainers.map_async("join", worlds[0]), generators.map_async("join", worlds[1])]
        try:
            opened = _new_listeners(serving, before)
            assert address in opened, f"rank 0 does not serve on {address}: {sorted(opened)}"
            attempts = _attack(sorted(opened), 3, torch_stranger)
            held_open = not joined[1].done()
        finally:
            formation_goes_on()
        assert _check_the_stranger_failed(attempts, address[0]) == address
        assert held_open, "the formation ended before the stranger's tries"
        assert [f.result(timeout=120) for f in joined] == [[0], [1, 2]]
        napping.result(timeout=60)
        sent = [trainers.call_async("broadcast"), generators.call_async("broadcast")]
        assert [f.result(timeout=60) for f in sent] == [[16.0], [16.0, 16.0]]


def test_joint_store_says_what_is_wrong_with_a_world_dict():
    pytest.importorskip("torch", reason="the joint world is torch's: pip install torch")
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
             "RANK": "1"}
    with pytest.raises(KeyError, match=r"STORE_SECRET.*older px\.rendezvous"):
        px.joint_store(world)
    with pytest.raises(ValueError, match=r"not what px\.rendezvous"):
        px.joint_store({**world, "STORE_SECRET": "not hex"})
    with pytest.raises(ValueError, match="RANK 2 of WORLD_SIZE 2"):
        px.joint_store({**world, "RANK": "2", "STORE_SECRET": SECRET.hex()})
    with pytest.raises(ValueError, match="wildcard"):
        px.joint_store({**world, "MASTER_ADDR": "0.0.0.0", "RANK": "0",
                        "STORE_SECRET": SECRET.hex()})


# -- the store itself ------------------------------------------------------------------------


@pytest.fixture
def server():
    store = StoreServer("127.0.0.1", 0, SECRET, handshake_timeout=1.0, limit=8, per_peer=4)
    store.set("0/0", b"the serving member's gloo address")
    try:
        yield store
    finally:
        store.close()


def test_a_stranger_gets_a_nonce_then_a_refusal_and_no_key(server):
    greeted = _greet_wrongly(server.address)
    assert greeted["store"] and greeted["after_proof"] == kvproto.REFUSED
    assert greeted["ended_in"] < 1.0
    assert server.refusals == 1
    with socket.create_connection(server.address, timeout=5) as sock:  # a TCPStore's query
        sock.sendall(b"\x00" * 64)
        assert _read_for(sock, 3.0, 1024) == b""  # nothing, and the end: not the greeting
    assert server.num_keys() == 1 and server.get("0/0", 1) == b"the serving member's gloo address"


def test_a_silent_stranger_is_dropped_by_its_deadline(server):
    with socket.create_connection(server.address, timeout=5) as sock:
        began = time.monotonic()
        assert _read_for(sock, 5.0, 1024) == b""
        assert time.monotonic() - began < 3.0  # handshake_timeout=1 s, generously


def test_strangers_holding_every_slot_do_not_keep_a_member_out(server):
    strangers = [socket.create_connection(server.address, timeout=5) for _ in range(20)]
    try:
        began = time.monotonic()
        member = StoreClient(*server.address, SECRET, timeout=10)
        try:
            assert member.get("0/0", 1) == b"the serving member's gloo address"
            member.set("0/1", b"a member's")
            assert server.get("0/1", 1) == b"a member's"
        finally:
            member.close()
        assert time.monotonic() - began < 5.0
        held = [s for s in strangers if not _ended(s)]
        assert len(held) <= 4, f"{len(held)} strangers held from one address (at most 4)"
    finally:
        for sock in strangers:
            sock.close()


def test_a_member_believes_only_a_peer_that_proves_the_secret(server):
    with pytest.raises(AuthenticationError, match="refused this member's proof"):
        StoreClient(*server.address, secrets.token_bytes(32), timeout=10)
    squatter = socket.create_server(("127.0.0.1", 0))
    squatter.settimeout(0.1)  # its accept() looks at `stop` (a close would not wake it)
    stop = threading.Event()

    def pretend() -> None:  # a stranger who took the port first, and cannot prove anything
        while not stop.is_set():
            try:
                sock, _ = squatter.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            with sock:
                _read_for(sock, 2.0, kvproto.HELLO_SIZE)
                sock.sendall(os.urandom(kvproto.NONCE_SIZE))
                _read_for(sock, 2.0, kvproto.PROOF_SIZE)
                sock.sendall(kvproto.ACCEPTED + os.urandom(kvproto.PROOF_SIZE))

    thread = threading.Thread(target=pretend, daemon=True)
    thread.start()
    try:
        began = time.monotonic()
        with pytest.raises(AuthenticationError, match="not the world's store"):
            StoreClient(*squatter.getsockname()[:2], SECRET, timeout=30)
        assert time.monotonic() - began < 5.0  # at once, not at the timeout
    finally:
        stop.set()
        squatter.close()
        thread.join(timeout=5)


def test_a_store_waits_within_bounds_and_never_on_the_wildcard(server):
    member = StoreClient(*server.address, SECRET, timeout=10)
    try:
        began = time.monotonic()
        with pytest.raises(StoreTimeout, match="no key 0/2"):
            member.get("0/2", 0.3)
        assert time.monotonic() - began < 3.0
    finally:
        member.close()
    with pytest.raises(StoreTimeout, match="no store answered"):
        StoreClient("127.0.0.1", _closed_port(), SECRET, timeout=0.5)
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="wildcard"):
            StoreServer(wildcard, 0, SECRET)


def test_frames_altered_replayed_or_reordered_are_refused():
    proofs = kvproto.Proofs(SECRET, os.urandom(32), os.urandom(32))
    sealer, opener = kvproto.Sealer(proofs.to_server), kvproto.Opener(proofs.to_server)
    first = sealer.seal(kvproto.encode(kvproto.Op.SET, [b"0/1", b"address"]))
    second = sealer.seal(kvproto.encode(kvproto.Op.NUM_KEYS))

    def body_and_tag(frame: bytes) -> tuple[bytes, bytes]:
        length = kvproto.Opener.length(frame[:kvproto.HEADER_SIZE])
        body = frame[kvproto.HEADER_SIZE:kvproto.HEADER_SIZE + length]
        return body, frame[kvproto.HEADER_SIZE + length:]

    altered = bytearray(first)
    altered[-kvproto.TAG_SIZE - 1] ^= 1
    with pytest.raises(kvproto.ProtocolError, match="tag"):
        kvproto.Opener(proofs.to_server).open(*body_and_tag(bytes(altered)))
    with pytest.raises(kvproto.ProtocolError, match="tag"):  # the second first
        kvproto.Opener(proofs.to_server).open(*body_and_tag(second))
    assert opener.open(*body_and_tag(first))
    with pytest.raises(kvproto.ProtocolError, match="tag"):  # the first again
        opener.open(*body_and_tag(first))
    with pytest.raises(kvproto.ProtocolError, match="tag"):  # the other direction's key
        kvproto.Opener(proofs.to_client).open(*body_and_tag(first))
    other = kvproto.Proofs(SECRET, os.urandom(32), os.urandom(32))  # another connection
    with pytest.raises(kvproto.ProtocolError, match="tag"):
        kvproto.Opener(other.to_server).open(*body_and_tag(first))


def _ended(sock: socket.socket) -> bool:
    """Whether the peer ended the connection (read: its end, or a reset)."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
