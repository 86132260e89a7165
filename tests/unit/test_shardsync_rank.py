"""The rank side of a sharded weight sync (phalanx/rank/shardsync.py), its built-ins driven
directly in real processes: each rank a spawned process holding a small object with
get/want/set, the test playing the controller (a plan made by hand from the blocks the
sources report and the regions the targets want). Sources and targets on "different
machines" (distinct block domains: every byte over TCP) and on one (a memory block named
over the socket)."""

from __future__ import annotations

import array
import math
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from phalanx.errors import AuthenticationError  # noqa: E402
from phalanx.rank import shardsync  # noqa: E402
from phalanx.wire import kvproto, shardwire  # noqa: E402
from phalanx.world.syncplan import Region, Shard  # noqa: E402
from tests import helpers  # noqa: E402

REPLY_TIMEOUT = 60.0  # seconds for a rank's answer: a spawned process imports torch first
SYNC = "sync-a"


# -- a rank: a spawned process answering commands ---------------------------------------------


class _Model:
    """The user's object on a rank."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.region: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []  # every dict set() was given, kept as given

    def get(self) -> dict[str, Any]:
        return self.state

    def want(self) -> dict[str, Any] | None:
        return self.region

    def set(self, state: dict[str, Any]) -> None:
        self.history.append(state)  # kept: the next version must not write into these


def _tensors_of(state: dict[str, Any]) -> list[Any]:
    return [v.tensor if isinstance(v, Shard) else v for v in state.values()]


def _zygote() -> None:
    """The process every rank of a test forks from (``python -c``), torch imported once:
    each line on stdin, ``<socket path> <block domain>``, forks a rank that connects to the
    test there (and says its pid). Ranks are reaped as they end. ``sys.argv[1:]``:
    modules to import before the first fork."""
    import importlib

    for module in sys.argv[1:]:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        path, domain = line.split()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ["PHALANX_BLOCK_DOMAIN"] = domain
            try:
                _rank_main(path)
            finally:
                os._exit(0)


def _rank_main(path: str) -> None:
    """A rank: commands from the test over a Unix socket, each answered; each message a
    length-prefixed pickle."""
    from phalanx.rank import kept
    from phalanx.rank import shardsync as rank_side

    model = _Model()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    _send(sock, os.getpid())

    def mutate() -> None:  # the optimizer step once send returned
        for tensor in _tensors_of(model.state):
            tensor.fill_(-1)

    def corrupt(part: memoryview) -> None:
        part[0] ^= 0xFF

    while True:
        try:
            op, *args = _receive(sock, None)
        except EOFError:
            return
        try:
            if op == "call":
                name, call_args = args
                result = kept.builtin(name, model)(*call_args)
            elif op == "hold":
                model.state, model.region = args
                result = None
            elif op == "domain":
                os.environ["PHALANX_BLOCK_DOMAIN"] = args[0]
                result = None
            elif op == "hooks":
                mutate_now, corrupt_on = args
                if mutate_now:
                    mutate()
                rank_side.CORRUPT = corrupt if corrupt_on else None
                result = None
            elif op == "dtensor":  # hold ``local`` as this rank's row shard of a DTensor
                result = _hold_dtensor(model, *args)
            elif op == "state":
                result = [t.clone() for t in _tensors_of(model.state)]
            elif op == "history":
                result = [{k: v.clone() for k, v in d.items()} for d in model.history]
            else:
                raise ValueError(f"unknown op {op}")
            answer: Any = ("ok", result)
        except Exception as exc:
            answer = ("error", f"{type(exc).__name__}: {exc}")
        _send(sock, answer)


def _hold_dtensor(model: _Model, store: str, rank: int, size: int, local: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as RowShard

    dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank,
                            world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    model.state = {"w": DTensor.from_local(local, mesh, [RowShard(0)], run_check=False)}


def _send(sock: socket.socket, value: Any) -> None:
    body = pickle.dumps(value)
    sock.sendall(struct.pack("<I", len(body)) + body)


def _receive(sock: socket.socket, timeout: float | None) -> Any:
    end = None if timeout is None else time.monotonic() + timeout
    (size,) = struct.unpack("<I", _exactly(sock, 4, end))
    return pickle.loads(_exactly(sock, size, end))


def _exactly(sock: socket.socket, size: int, end: float | None) -> bytes:
    out = b""
    while len(out) < size:
        sock.settimeout(None if end is None else max(0.001, end - time.monotonic()))
        chunk = sock.recv(size - len(out))
        if not chunk:
            raise EOFError("the peer ended the connection")
        out += chunk
    return out


class Rank:
    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock

    def ask(self, *msg: Any, timeout: float = REPLY_TIMEOUT) -> Any:
        _send(self.sock, msg)
        status, result = _receive(self.sock, timeout)
        if status != "ok":
            raise RuntimeError(result)
        return result

    def call(self, name: str, *args: Any, timeout: float = REPLY_TIMEOUT) -> Any:
        return self.ask("call", name, args, timeout=timeout)

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # one the test stopped
        self.signal(signal.SIGKILL)
        assert helpers.wait_dead(self.pid, 10)


@pytest.fixture
def spawn(tmp_path):
    """``spawn(domain, ..., preload=())``: a rank per block domain, forked from one
    process of the test's (torch, and the modules ``preload`` names, imported once), all
    killed at the end."""
    zygotes: list[subprocess.Popen[str]] = []
    path = str(tmp_path / "ranks.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    listener.settimeout(REPLY_TIMEOUT)
    started: list[Rank] = []

    def make(*domains: str, preload: tuple[str, ...] = ()) -> list[Rank]:
        if not zygotes:
            zygotes.append(subprocess.Popen(
                [sys.executable, "-c",
                 "from tests.unit.test_shardsync_rank import _zygote; _zygote()", *preload],
                stdin=subprocess.PIPE, text=True, env=helpers.script_env(), cwd=helpers.REPO))
        zygote = zygotes[0]
        assert zygote.stdin is not None
        ranks = []
        for domain in domains:
            zygote.stdin.write(f"{path} {domain}\n")
            zygote.stdin.flush()
            sock, _ = listener.accept()  # (within the listener's timeout)
            rank = Rank(_receive(sock, REPLY_TIMEOUT), sock)
            started.append(rank)
            ranks.append(rank)
        return ranks

    try:
        yield make
    finally:
        for rank in started:
            rank.kill()
            rank.sock.close()
        listener.close()
        for zygote in zygotes:
            zygote.kill()
            zygote.wait(10)
            if zygote.stdin is not None:
                zygote.stdin.close()


# -- the controller's part, by hand --------------------------------------------------------------


def _plan(blocks: dict[int, list[tuple[Any, ...]]], wants: dict[str, dict[str, Any]]
          ) -> tuple[dict[int, list[tuple[Any, ...]]], dict[str, tuple[dict[str, Any],
                                                                         list[tuple[Any, ...]]]]]:
    """Per source its boxes ``(tid, target, name, src_offset, shape, nbytes)``; per target
    its layout and transfers. Each wanted element from the first source holding it."""
    sends: dict[int, list[tuple[Any, ...]]] = {s: [] for s in blocks}
    expects: dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]] = {}
    fulls = {b[0]: b[3] for held in blocks.values() for b in held}
    tid = 0
    for target, regions in wants.items():
        layout: dict[str, Any] = {}
        transfers: list[tuple[Any, ...]] = []
        for name, region in regions.items():
            roff, rshape = region if region is not None else ((0,) * len(fulls[name]),
                                                               fulls[name])
            layout[name] = (rshape, "float32")
            done: set[tuple[Any, ...]] = set()
            for source, held in blocks.items():
                for bname, boff, bshape, _, dtype, itemsize in held:
                    assert (dtype, itemsize) == ("float32", 4)
                    if bname != name:
                        continue
                    lo = tuple(max(a, b) for a, b in zip(roff, boff, strict=True))
                    hi = tuple(min(a + s, b + t) for a, s, b, t
                               in zip(roff, rshape, boff, bshape, strict=True))
                    if any(h <= m for m, h in zip(lo, hi, strict=True)) or (lo, hi) in done:
                        continue
                    done.add((lo, hi))
                    shape = tuple(h - m for m, h in zip(lo, hi, strict=True))
                    nbytes = math.prod(shape) * 4
                    src = tuple(m - b for m, b in zip(lo, boff, strict=True))
                    dst = tuple(m - r for m, r in zip(lo, roff, strict=True))
                    sends[source].append((tid, target, name, src, shape, nbytes))
                    transfers.append((tid, name, dst, shape, nbytes))
                    tid += 1
        expects[target] = (layout, transfers)
    return sends, expects


def _stage(sources: dict[int, Rank], targets: dict[str, Rank], version: int,
           secret: str, wants: dict[str, dict[str, Any]], addresses: dict[str, Any],
           verify: bool = False, timeout: float = 20.0) -> dict[int, Any]:
    """One version: the plan from what the sources hold now, every target armed, every
    source sending; each source's answer."""
    blocks = {s: rank.call(shardsync.BLOCKS, SYNC, "get") for s, rank in sources.items()}
    sends, expects = _plan(blocks, wants)
    for key, rank in targets.items():
        if key in addresses:
            rank.call(shardsync.EXPECT, SYNC, 1, version, *expects[key])
    out = {}
    for s, rank in sources.items():
        rows = [(tid, key, *addresses[key], name, src, shape, nbytes)
                for tid, key, name, src, shape, nbytes in sends[s]]
        out[s] = rank.call(shardsync.SEND, SYNC, 1, version, "get", rows, verify, timeout,
                           secret)
    return out


def _listen(targets: dict[str, Rank], secret: str) -> dict[str, Any]:
    return {key: rank.call(shardsync.LISTEN, SYNC, 1, secret, "127.0.0.1")
            for key, rank in targets.items()}


def _wants(targets: dict[str, Rank], fulls: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names_full = {name: (tuple(full), "float32") for name, full in fulls.items()}
    return {key: rank.call(shardsync.WANTS, SYNC, "want" if key == "cols" else None,
                           names_full) for key, rank in targets.items()}


def _region_bytes(region: Any, full: tuple[int, ...]) -> int:
    return 4 * math.prod(full if region is None else region[1])


# -- tests ---------------------------------------------------------------------------------------


W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)  # row-sharded by the sources
V = torch.arange(6 * 40, dtype=torch.float32).reshape(6, 40) + 0.5  # column-sharded
B = torch.arange(5, dtype=torch.float32) - 7.0  # whole on both


def _hold(sources: list[Rank], plus: float = 0.0) -> None:
    w, v, b = W + plus, V + plus, B + plus
    sources[0].ask("hold", {"w": Shard(w[:32].clone(), (0, 0), (64, 48)),
                            "v": Shard(v[:, :20].clone(), (0, 0), (6, 40)),
                            "b": b.clone()}, None)
    sources[1].ask("hold", {"w": Shard(w[32:].clone(), (32, 0), (64, 48)),
                            "v": Shard(v[:, 20:].clone(), (0, 20), (6, 40)),
                            "b": b.clone()}, None)


def test_row_shards_reach_a_column_region_over_tcp_and_through_shared_memory(spawn):
    """Two row-sharded sources, a target wanting columns 8..40 of ``w`` only and one
    wanting everything (``v``'s column shards land in non-contiguous boxes of its
    staging): each target gets exactly its regions' bytes and values, first with every
    rank on a machine of its own (TCP), then on one machine (one memory block of each
    source for both targets);
    tensors a set() kept are never written by a later version."""
    s0, s1, cols, whole = spawn("m0", "m1", "m2", "m3")
    sources, targets = {0: s0, 1: s1}, {"cols": cols, "whole": whole}
    _hold([s0, s1])
    cols.ask("hold", {}, {"w": Region((0, 8), (64, 32))})
    assert s0.call(shardsync.BLOCKS, SYNC, "get") == [
        ("w", (0, 0), (32, 48), (64, 48), "float32", 4),
        ("v", (0, 0), (6, 20), (6, 40), "float32", 4),
        ("b", (0,), (5,), (5,), "float32", 4)]
    fulls = {"w": (64, 48), "v": (6, 40), "b": (5,)}
    wants = _wants(targets, fulls)
    assert wants == {"cols": {"w": ((0, 8), (64, 32))},
                     "whole": {"w": None, "v": None, "b": None}}
    expected = {key: sum(_region_bytes(r, fulls[n]) for n, r in regions.items())
                for key, regions in wants.items()}

    for generation_domain, via, plus, version in (("apart", "tcp", 0.0, 1),
                                                  ("one machine", "shared", 1000.0, 2)):
        if generation_domain == "one machine":
            for rank in (s0, s1, cols, whole):
                rank.ask("domain", "same")
            for rank in (s0, s1, cols, whole):  # a new generation: listeners on "same"
                rank.call(shardsync.CLOSE, SYNC)
            _hold([s0, s1], plus)
        secret = secrets.token_hex(32)
        addresses = _listen(targets, secret)
        answers = _stage(sources, targets, version, secret, wants, addresses)
        received: dict[str, int] = {}
        for answer in answers.values():
            assert answer["errors"] == {}
            assert set(answer["via"].values()) == {via}
            for key, nbytes in answer["acked"].items():
                received[key] = received.get(key, 0) + nbytes
        assert received == expected
        for rank in targets.values():
            assert rank.call(shardsync.APPLY, SYNC, 1, version, "set")[0] == version
            assert rank.call(shardsync.VERSION, SYNC) == version
        got_cols = cols.ask("history")[-1]
        assert list(got_cols) == ["w"]
        assert torch.equal(got_cols["w"], (W + plus)[:, 8:40])
        got = whole.ask("history")[-1]
        assert torch.equal(got["w"], W + plus)
        assert torch.equal(got["v"], V + plus)
        assert torch.equal(got["b"], B + plus)

    first, second = whole.ask("history")  # set() kept version 1's tensors: still version 1's
    assert torch.equal(first["w"], W) and torch.equal(second["w"], W + 1000.0)


def test_a_step_once_send_returned_changes_nothing_staged(spawn):
    """The source's tensors change (an optimizer step) as soon as send returned, before the
    target applies: the target applies the values send was called with, over TCP (sent from
    the tensor's own memory: a whole tensor) and through a block."""
    source, target = spawn("m0", "m1")
    sources, targets = {0: source}, {"whole": target}
    full = torch.randn(16, 8)
    wants = {"whole": {"w": None}}
    for version, domain in ((1, None), (2, "same")):
        if domain is not None:
            for rank in (source, target):
                rank.ask("domain", domain)
                rank.call(shardsync.CLOSE, SYNC)
        source.ask("hold", {"w": full.clone()}, None)
        secret = secrets.token_hex(32)
        addresses = _listen(targets, secret)
        answer = _stage(sources, targets, version, secret, wants, addresses)[0]
        source.ask("hooks", True, False)  # fill every tensor with -1 now
        assert answer["errors"] == {}
        assert answer["via"] == {"whole": "tcp" if domain is None else "shared"}
        target.call(shardsync.APPLY, SYNC, 1, version, "set")
        assert torch.equal(target.ask("history")[-1]["w"], full)
        (now,) = source.ask("state")  # the hook did run: the source's tensor changed
        assert torch.equal(now, torch.full((16, 8), -1.0))


def test_targets_wanting_the_same_box_each_get_it_over_tcp_shared_memory_or_both(spawn):
    """Two targets want the same columns of a source's tensor (a box it copies once for
    both): each gets them, with every rank apart (TCP), all on one machine (one block the
    targets both map), and one target beside the source and one apart (one of each);
    with verify, each transfer's digest checked."""
    source, a, b = spawn("m0", "m1", "m2")
    sources, targets = {0: source}, {"a": a, "b": b}
    layouts = (("apart", {"a": "tcp", "b": "tcp"}, ("m0", "m1", "m2")),
               ("one machine", {"a": "shared", "b": "shared"}, ("m", "m", "m")),
               ("both", {"a": "shared", "b": "tcp"}, ("n", "n", "o")))
    for version, (_, via, domains) in enumerate(layouts, start=1):
        for rank, domain in zip((source, a, b), domains, strict=True):
            rank.ask("domain", domain)
            rank.call(shardsync.CLOSE, SYNC)
        full = torch.randn(16, 8)
        source.ask("hold", {"w": full.clone()}, None)
        secret = secrets.token_hex(32)
        addresses = _listen(targets, secret)
        region = ((0, 2), (16, 4))  # (what each want() returns: see _wants)
        wants = {key: {"w": region} for key in targets}
        answer = _stage(sources, targets, version, secret, wants, addresses, verify=True)[0]
        assert answer["errors"] == {}, answer
        assert answer["via"] == via
        assert answer["acked"] == {"a": 16 * 4 * 4, "b": 16 * 4 * 4}
        for rank in (a, b):
            rank.call(shardsync.APPLY, SYNC, 1, version, "set")
            assert torch.equal(rank.ask("history")[-1]["w"], full[:, 2:6])


def test_a_stalled_or_dead_target_is_reported_and_the_other_completes(spawn):
    """A target stopped (SIGSTOP: its port takes the connection, nobody answers), then
    killed: the source reports it each time, within its timeout, and the live target gets
    its bytes and applies both versions."""
    source, live, victim = spawn("m0", "m1", "m2")
    targets = {"live": live, "victim": victim}
    secret = secrets.token_hex(32)
    addresses = _listen(targets, secret)
    wants = {key: {"w": None} for key in targets}
    timeout = 3.0
    for version, harm in ((1, "stop"), (2, "kill")):
        full = torch.randn(32, 32)
        source.ask("hold", {"w": full.clone()}, None)
        blocks = {0: source.call(shardsync.BLOCKS, SYNC, "get")}
        sends, expects = _plan(blocks, wants)
        live.call(shardsync.EXPECT, SYNC, 1, version, *expects["live"])
        if harm == "stop":
            victim.call(shardsync.EXPECT, SYNC, 1, version, *expects["victim"])
            victim.signal(signal.SIGSTOP)
        else:
            victim.kill()
        rows = [(tid, key, *addresses[key], name, src, shape, nbytes)
                for tid, key, name, src, shape, nbytes in sends[0]]
        start = time.monotonic()
        answer = source.call(shardsync.SEND, SYNC, 1, version, "get", rows, False, timeout,
                             secret)
        took = time.monotonic() - start
        # bounded by the timeout (what is over: a loaded machine's scheduling)
        assert took < timeout + 10, took
        assert set(answer["errors"]) == {"victim"}, answer
        why = answer["errors"]["victim"]
        assert (f"no answer within {timeout:g} s" if harm == "stop" else "cannot reach") in why
        assert answer["acked"] == {"live": full.numel() * 4}
        live.call(shardsync.APPLY, SYNC, 1, version, "set")
        assert torch.equal(live.ask("history")[-1]["w"], full)


def test_a_dtensor_is_sent_as_its_local_shard(spawn, tmp_path):
    """A source whose get() returns a DTensor (rows sharded over a gloo world of the two
    sources) reports its local shard's offset and the global shape, and sends from it."""
    pytest.importorskip("torch.distributed.tensor")
    s0, s1, target = spawn("m0", "m1", "m2", preload=("torch.distributed.tensor",))
    store = str(tmp_path / "store")
    full = torch.randn(10, 6)
    futures = []
    for rank, (source, rows) in enumerate(((s0, full[:5]), (s1, full[5:]))):
        _send(source.sock, ("dtensor", store, rank, 2, rows.clone()))  # both at once
        futures.append(source)
    for source in futures:
        status, result = _receive(source.sock, REPLY_TIMEOUT)
        assert status == "ok", result
    assert s1.call(shardsync.BLOCKS, SYNC, "get") == [
        ("w", (5, 0), (5, 6), (10, 6), "float32", 4)]
    secret = secrets.token_hex(32)
    targets = {"cols": target}
    target.ask("hold", {}, {"w": Region((0, 2), (10, 3))})
    wants = _wants(targets, {"w": (10, 6)})
    answers = _stage({0: s0, 1: s1}, targets, 1, secret, wants, _listen(targets, secret))
    assert all(a["errors"] == {} for a in answers.values())
    target.call(shardsync.APPLY, SYNC, 1, 1, "set")
    assert torch.equal(target.ask("history")[-1]["w"], full[:, 2:5])


def test_verify_catches_a_corrupted_transfer(spawn):
    """With verify, a transfer whose bytes changed after their digest (a test hook flips a
    byte of the snapshot) fails at the target, the source reports it, and apply refuses
    the version; the next clean version goes through. Over TCP and through a block."""
    source, target = spawn("m0", "m1")
    sources, targets = {0: source}, {"whole": target}
    full = torch.randn(8, 8)
    source.ask("hold", {"w": full.clone()}, None)
    wants = {"whole": {"w": None}}
    for domain in (None, "same"):
        if domain is not None:
            for rank in (source, target):
                rank.ask("domain", domain)
                rank.call(shardsync.CLOSE, SYNC)
        secret = secrets.token_hex(32)
        addresses = _listen(targets, secret)
        source.ask("hooks", False, True)
        answer = _stage(sources, targets, 1, secret, wants, addresses, verify=True)[0]
        assert "do not match their digest" in answer["errors"]["whole"], answer
        with pytest.raises(RuntimeError, match="not fully staged"):
            target.call(shardsync.APPLY, SYNC, 1, 1, "set")
        assert target.call(shardsync.VERSION, SYNC) is None
        source.ask("hooks", False, False)
        answer = _stage(sources, targets, 2, secret, wants, addresses, verify=True)[0]
        assert answer["errors"] == {}
        target.call(shardsync.APPLY, SYNC, 1, 2, "set")
        assert torch.equal(target.ask("history")[-1]["w"], full)


def test_a_stranger_without_the_secret_gets_nothing(spawn):
    """A peer with a wrong secret is refused (it saw a nonce and a refusal, nothing more)
    and stages nothing; one that sends a batch frame without a handshake is dropped; the
    target then still takes the real source's bytes."""
    (target,) = spawn("m1")
    secret = secrets.token_hex(32)
    host, port, _ = target.call(shardsync.LISTEN, SYNC, 1, secret, "127.0.0.1")
    target.call(shardsync.EXPECT, SYNC, 1, 1, {"w": ((4,), "float32")},
                [(0, "w", (0,), (4,), 16)])

    with pytest.raises(AuthenticationError, match="refused"):
        shardwire.connect(host, port, secrets.token_bytes(32), shardwire.Deadline(10))

    with socket.create_connection((host, port), timeout=10) as sock:  # raw: what it sees
        sock.sendall(shardwire.MAGIC + secrets.token_bytes(kvproto.NONCE_SIZE))
        seen = _read_all(sock, 10)
        assert len(seen) == kvproto.NONCE_SIZE  # a nonce; then it waits for a proof
        sock.sendall(b"\0" * kvproto.PROOF_SIZE)
        assert _read_all(sock, 10) == kvproto.REFUSED  # and the connection ends

    with socket.create_connection((host, port), timeout=10) as sock:  # no handshake at all
        sealer = kvproto.Sealer(b"k" * 32)
        batch = shardwire.Batch(1, shardwire.TCP, (0, 0, "", 0),
                                [shardwire.Entry(0, 16, 0, b"")])
        sock.sendall(sealer.seal(shardwire.encode_batch(batch)) + b"\1" * 16)
        assert _read_all(sock, 10) == b""  # dropped, unanswered

    with pytest.raises(RuntimeError, match="not fully staged"):
        target.call(shardsync.APPLY, SYNC, 1, 1, "set")

    # the real source still gets through (from this process: it knows the secret)
    sock, sealer, opener = shardwire.connect(host, port, bytes.fromhex(secret),
                                             shardwire.Deadline(10))
    with sock:
        data = array.array("f", [0.0, 1.0, 2.0, 3.0])
        batch = shardwire.Batch(1, shardwire.TCP, (0, 0, "", 0),
                                [shardwire.Entry(0, 16, 0, b"")])
        deadline = shardwire.Deadline(10)
        shardwire.send_frame(sock, sealer, shardwire.encode_batch(batch), deadline)
        shardwire.send_bytes(sock, memoryview(data), deadline)
        reply = shardwire.read_frame(sock, opener, deadline)
        assert reply is not None and shardwire.decode_ack(reply) == (16, [])
    target.call(shardsync.APPLY, SYNC, 1, 1, "set")
    assert torch.equal(target.ask("history")[-1]["w"], torch.arange(4, dtype=torch.float32))


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """What the peer sends until it waits (a short quiet) or ends, within ``timeout``."""
    end = time.monotonic() + timeout
    out = b""
    while time.monotonic() < end:
        sock.settimeout(0.5 if out else max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            return out
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    return out
