"""The pure parts of a multi-node ``phalanx run``: who may join, when an attempt starts, which
node rank each launcher gets, whom a timed-out join names, which failure is the root cause,
and what one node's ranks are told about the world."""

from __future__ import annotations

import argparse
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.launcher.flags import endpoint, parse_nnodes, rdzv_conf
from phalanx.launcher.jobhost import MAX_MESSAGE, JobError, Lines, send_message
from phalanx.launcher.report import Failure
from phalanx.launcher.roster import Member, Roster, layout_counts, root_cause
from phalanx.world.frameworks import FRAMEWORKS, WorldPart
from phalanx.world.layout import Layout


def member(key: int, node_rank: int | None = None, nproc: int = 2,
           hosting: bool = False) -> Member:
    return Member(key, node_rank, nproc, f"host{key}", hosting)


def test_a_static_attempt_starts_once_every_node_rank_joined():
    roster = Roster(3, 3, static=True)
    assert roster.join(member(10, 2), now=0) is None
    assert roster.join(member(11, 0), now=0) is None
    assert not roster.ready(now=1000)  # never on a timer: node 1 is missing
    assert roster.missing() == ("node rank 1 never joined (joined: node 0 from host11, "
                                "node 2 from host10)")
    assert roster.join(member(12, 1, nproc=4), now=0) is None
    assert roster.ready(now=0)
    assert [m.node_rank for m in roster.assign()] == [0, 1, 2]
    assert layout_counts(roster.assign()) == [2, 4, 2]


@pytest.mark.parametrize(("rank", "reason"), [(5, "--node-rank 5 is outside 0..1"),
                                              (None, "--node-rank None is outside 0..1"),
                                              (0, "node rank 0 has already joined")])
def test_a_static_join_with_a_bad_or_taken_node_rank_is_refused(rank, reason):
    roster = Roster(2, 2, static=True)
    assert roster.join(member(1, 0), now=0) is None
    assert reason in roster.join(member(2, rank), now=0)
    assert len(roster) == 1


def test_a_static_rendezvous_needs_a_fixed_node_count():
    with pytest.raises(ValueError, match="use --rdzv-backend c10d"):
        Roster(2, 3, static=True)


def test_c10d_starts_with_min_after_the_last_call_or_at_once_with_max():
    roster = Roster(2, 3, static=False, last_call=5.0)
    roster.join(member(1), now=0)
    assert not roster.ready(now=100) and roster.next_decision(now=100) is None
    assert roster.missing().startswith("1 more node needed for the minimum of 2")
    roster.join(member(2), now=10)
    assert not roster.ready(now=14) and roster.next_decision(now=14) == pytest.approx(1.0)
    assert roster.ready(now=15)
    roster.join(member(3), now=11)
    assert roster.ready(now=11)  # MAX joined: no need to wait
    assert "already has its 3 nodes" in roster.join(member(4), now=12)


def test_c10d_loses_its_quorum_clock_when_a_member_leaves():
    roster = Roster(2, 3, static=False, last_call=5.0)
    roster.join(member(1), now=0)
    roster.join(member(2), now=0)
    roster.leave(2)
    roster.join(member(3), now=10)
    assert not roster.ready(now=12)  # the last call counts from the new quorum
    assert roster.ready(now=15)


@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_c10d_node_ranks_follow_joining_order_with_the_host_first(hosting):
    roster = Roster(1, 8, static=False)
    host = hosting.index(True) if True in hosting else None
    for key, is_host in enumerate(hosting):
        roster.join(member(key, hosting=is_host and key == host), now=0)
    order = [m.key for m in roster.assign()]
    expected = list(range(len(hosting)))
    if host is not None:
        expected.remove(host)
        expected.insert(0, host)
    assert order == expected


def test_the_root_cause_is_the_failure_seen_first():
    late = Failure(0, 0, 1, 1, "raised RuntimeError: Connection closed by peer", seen=10.2)
    first = Failure(3, 1, 2, 137, "killed by SIGKILL", seen=10.0)
    lost = Failure(None, 1, None, 1, "lost its launcher", seen=10.0)
    assert root_cause([late, first]) == first
    assert root_cause([lost, first]) == first  # the same moment: a rank's own first
    assert root_cause([]) is None


def test_one_node_of_a_world_gets_the_world_s_variables():
    part = WorldPart(Layout.of([2, 3]), node=1)
    assert (part.first_rank, part.size) == (2, 3)
    env = part.rank_env(1, "10.0.0.1", 29500)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "3",
        "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_a_world_part_refuses_a_mismatched_group_or_a_single_controller_framework():
    part = WorldPart(Layout.of([2, 2]), node=0)
    part.check(FRAMEWORKS["torch"], Layout(1, 2))
    with pytest.raises(ValueError, match="must have one node of 2 ranks"):
        part.check(FRAMEWORKS["torch"], Layout(1, 3))
    with pytest.raises(ValueError, match="needs one controller for the whole world"):
        part.check(FRAMEWORKS["jax"], Layout(1, 2))
    with pytest.raises(ValueError, match=r"node must be in 0\.\.1"):
        WorldPart(Layout.of([2, 2]), node=2)


@pytest.mark.parametrize(("text", "counts"), [("1", (1, 1)), ("4", (4, 4)), ("2:8", (2, 8))])
def test_nnodes_is_n_or_min_max(text, counts):
    assert parse_nnodes(text) == counts


@pytest.mark.parametrize("text", ["0", "x", "3:2", "1:", ":2"])
def test_nnodes_nonsense_is_refused(text):
    with pytest.raises(ValueError, match="--nnodes expects"):
        parse_nnodes(text)


@pytest.mark.parametrize(("text", "address"), [("node0:1234", ("node0", 1234)),
                                               ("node0", ("node0", 29400)),
                                               ("[::1]:99", ("::1", 99))])
def test_an_endpoint_is_host_and_port(text, address):
    assert endpoint(text, 29400) == address


@pytest.mark.parametrize("text", [":1234", "host:0", "host:x", "host:70000"])
def test_a_bad_endpoint_is_refused(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        endpoint(text, 29400)


def test_rdzv_conf_honours_the_timeouts_and_keeps_other_keys():
    conf = rdzv_conf("join_timeout=5, last_call_timeout=0.5,read_timeout=60")
    assert conf == {"join_timeout": 5.0, "last_call_timeout": 0.5, "read_timeout": "60"}
    assert rdzv_conf("") == {"join_timeout": 600.0, "last_call_timeout": 30.0}
    for bad in ("join_timeout", "join_timeout=soon", "join_timeout=0"):
        with pytest.raises(argparse.ArgumentTypeError, match="rdzv-conf"):
            rdzv_conf(bad)


def test_launcher_messages_are_json_lines_with_a_size_limit():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_message(ours, {"type": "join", "nproc": 2})
        ours.sendall(b'{"type": "done"}\n[1, 2]\n')
        lines = Lines(theirs)
        assert lines.read() == {"type": "join", "nproc": 2}
        assert lines.read() == {"type": "done"}
        with pytest.raises(JobError, match="not a launcher's message"):
            lines.read()
        def flood_it() -> None:
            try:
                ours.sendall(b"x" * (MAX_MESSAGE + 70000))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the reader stopped reading (below): what ends this send

        flood = threading.Thread(target=flood_it)
        flood.start()
        with pytest.raises(JobError, match=f"a message over {MAX_MESSAGE} bytes"):
            lines.read()
        theirs.shutdown(socket.SHUT_RD)
        flood.join(10)
