"""The joint worlds' store (``phalanx.wire.kvproto``, ``phalanx.wire.kvstore``,
``phalanx.rank.joint``): torch's store semantics, the same in the serving process and over a
member's connection, and as a ``torch.distributed.Store`` (torch's C++ side calling it
through a ``PrefixStore``, as its process groups do). The strangers' side is
tests/security/test_rendezvous_store.py."""

from __future__ import annotations

import secrets
import threading
import time
from datetime import timedelta

import pytest

from phalanx.wire import kvproto
from phalanx.wire.kvstore import StoreClient, StoreServer, StoreTimeout

SECRET = secrets.token_bytes(32)


@pytest.fixture
def stores():
    """The server's own handle and a member's connection to it."""
    server = StoreServer("127.0.0.1", 0, SECRET)
    client = StoreClient(*server.address, SECRET, timeout=10)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("side", ["server", "client"])
def test_every_operation_means_what_torch_means(stores, side):
    server, client = stores
    store = server if side == "server" else client
    store.set("a", b"1")
    assert store.get("a", 1) == b"1"
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3 and store.get("n", 1) == b"3"
    store.set("word", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("word", 1)
    assert store.compare_set("a", b"1", b"2") == b"2"  # matched: set
    assert store.compare_set("a", b"1", b"3") == b"2"  # not: the value now
    assert store.compare_set("new", b"", b"v") == b"v"  # missing, empty expected: set
    assert store.compare_set("gone", b"e", b"v") == b"e" and not store.check(["gone"])
    assert store.check(["a", "n"]) and not store.check(["a", "zz"])
    count = store.num_keys()
    assert store.delete("a") and not store.delete("a") and store.num_keys() == count - 1
    store.set("bin", bytes(range(256)))
    assert store.get("bin", 1) == bytes(range(256))  # values are bytes, any bytes


def test_a_wait_returns_when_another_member_sets_the_key(stores):
    server, client = stores
    threading.Timer(0.2, server.set, args=("late", b"here")).start()
    began = time.monotonic()
    client.wait(["late"], 10)
    assert client.get("late", 10) == b"here" and time.monotonic() - began < 5
    with pytest.raises(StoreTimeout, match="no key never"):
        server.wait(["never"], 0.1)


def test_the_table_agrees_with_torchs_hash_store():
    dist = pytest.importorskip("torch.distributed", reason="torch is not installed")
    theirs, ours = dist.HashStore(), kvproto.Table()
    steps = [("set", "k", b"1"), ("compare_set", "k", b"1", b"2"),
             ("compare_set", "k", b"9", b"3"), ("compare_set", "m", b"", b"x"),
             ("compare_set", "q", b"e", b"y"), ("add", "c", 4), ("add", "c", -1)]
    for op, key, *args in steps:
        got_theirs = getattr(theirs, op)(key, *args)
        got_ours = getattr(ours, op)(key.encode(), *args)
        assert got_theirs == got_ours, (op, key, args)
    assert theirs.num_keys() == len(ours)


def test_torchs_own_side_works_through_the_store():
    pytest.importorskip("torch", reason="torch is not installed")
    import torch.distributed as dist

    from phalanx.rank.joint import secret_store

    port = _free_port()
    served = secret_store("127.0.0.1", port, SECRET, serve=True, timeout=10)
    member = secret_store("127.0.0.1", port, SECRET, serve=False, timeout=10)
    try:
        prefixed = dist.PrefixStore("group", member)  # C++ calls the Python methods
        prefixed.set("k", "v")
        assert served.get("group/k") == b"v"
        assert prefixed.add("n", 2) == 2 and prefixed.compare_set("k", "v", "w") == b"w"
        assert prefixed.check(["k"]) and prefixed.delete_key("k")
        assert prefixed.num_keys() >= 1
        prefixed.wait(["n"], timedelta(seconds=1))
        with pytest.raises(dist.DistStoreError, match="no key group/missing"):
            prefixed.wait(["missing"], timedelta(seconds=0.2))  # torch's barrier catches it
        clone = member.clone()
        try:
            assert clone.get("group/n") == b"2"
        finally:
            clone.close()
    finally:
        member.close()
        served.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
