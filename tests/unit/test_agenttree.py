"""The pure parts of agents in a tree: how agents are split among heads, how a message is
re-addressed to a subtree's ranks, the cluster backend's tree and membership options, and
the interfaces between its parts (a link is no rank's channel; what membership is handed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import phalanx as px
from phalanx.backends.base import Channel, Link
from phalanx.backends.cluster import token as cluster_token
from phalanx.backends.cluster import tree as agenttree
from phalanx.backends.cluster.link import AgentLink, AgentNode, AgentRankChannel, Dialer
from phalanx.backends.cluster.members import Discovery, Members
from phalanx.wire import handshake, protocol

TOKEN = "t" * 32


@given(count=st.integers(0, 3000), fanout=st.integers(2, 64))
def test_split_gives_at_most_fanout_contiguous_chunks_of_even_sizes(count, fanout):
    entries = list(range(count))
    chunks = agenttree.split(entries, fanout)
    assert [e for chunk in chunks for e in chunk] == entries  # contiguous, in order
    assert len(chunks) == min(fanout, count)
    sizes = [len(c) for c in chunks]
    assert all(sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
    assert sizes == sorted(sizes, reverse=True)  # the longer ones first


def _depth(count: int, fanout: int) -> int:
    """How deep a tree of ``count`` agents goes when every one answers."""
    def below(entries: list[int]) -> int:
        return max((1 + below(chunk[1:]) for chunk in agenttree.split(entries, fanout)),
                   default=0)
    return below(list(range(count)))


@pytest.mark.parametrize(("count", "fanout", "depth"),
                         [(9, 2, 3), (100, 50, 2), (1000, 50, 2), (2500, 50, 2), (2551, 50, 3)])
def test_a_tree_of_a_thousand_agents_is_two_levels_deep_with_fanout_fifty(count, fanout, depth):
    assert _depth(count, fanout) == depth


@given(ranks=st.lists(st.integers(0, 10_000), min_size=1, max_size=40, unique=True),
       data=st.data())
def test_retarget_keeps_everything_but_the_ranks(ranks, data):
    subset = data.draw(st.lists(st.sampled_from(ranks), min_size=1, unique=True))
    head = protocol.header(protocol.CALL, 77, ranks, "train_step")
    assert protocol.parse(protocol.retarget(head, subset)) == (
        protocol.CALL, 77, tuple(subset), ("train_step", 0))
    extra = protocol.header(protocol.SHUTDOWN, 0, ranks)
    assert protocol.parse(protocol.retarget(extra, subset))[2] == tuple(subset)


@pytest.mark.parametrize(("option", "value", "words"), [
    ("tree_threshold", 0, "tree_threshold must be an integer >= 1"),
    ("tree_threshold", 2.5, "tree_threshold must be an integer >= 1"),
    ("fanout", 1, "fanout must be an integer >= 2"),
    ("fanout", True, "fanout must be an integer >= 2"),
    ("top_fanout", 0, "top_fanout must be an integer >= 1"),
    ("dns_interval", 0, "dns_interval must be > 0 seconds"),
    ("dns_interval", "5", "dns_interval must be > 0 seconds"),
])
def test_bad_tree_and_membership_options_are_refused_naming_them(option, value, words):
    with pytest.raises(ValueError, match=words):
        px.ClusterBackend(["127.0.0.1:32300"], token=TOKEN, **{option: value})


def test_tree_and_membership_options_survive_the_copy_a_group_makes():
    backend = px.ClusterBackend(dns="agents.ns.svc", port=32300, token=TOKEN, dns_interval=0.5,
                                tree_threshold=10, fanout=4)
    settings = type(backend)(**backend.settings()).settings()
    assert (settings["dns_interval"], settings["tree_threshold"], settings["fanout"],
            settings["top_fanout"]) == (0.5, 10, 4, 4)  # top: the fewer of fanout and 4
    narrow = px.ClusterBackend(["127.0.0.1:32300"], token=TOKEN, fanout=3)
    assert narrow.top_fanout == 3
    wide = px.ClusterBackend(["127.0.0.1:32300"], token=TOKEN, fanout=50)
    assert wide.top_fanout == 4 and wide.members.top_fanout == 4
    copied = type(wide)(**{**wide.settings(), "top_fanout": 3})
    assert type(copied)(**copied.settings()).top_fanout == 3


def test_an_agents_link_is_what_its_ranks_channels_share_not_a_channel():
    assert issubclass(AgentLink, Link) and not issubclass(AgentLink, Channel)
    assert issubclass(AgentRankChannel, Channel)


def test_a_dialer_never_shows_its_secret():
    dialer = Dialer(TOKEN.encode())
    assert TOKEN not in repr(dialer) and dialer.tls is None


def test_the_backend_hands_its_membership_what_it_needs():
    backend = px.ClusterBackend(dns="agents.ns.svc", port=32300, token=TOKEN, dns_interval=0.5,
                                nameserver="127.0.0.1:53", fanout=4, max_frame=1 << 20)
    members = backend.members
    assert members.discovery == Discovery("agents.ns.svc", 32300, "127.0.0.1:53", 0.5)
    assert (members.fanout, members.max_frame, members.dialer.secret) == (
        4, 1 << 20, handshake.stretch(TOKEN.encode()))  # the token stretched
    assert members.nodes == [] and members.links == [] and members.connection_count() == 0
    flat = px.ClusterBackend(["127.0.0.1:32300"], token=TOKEN)
    assert flat.members.discovery is None


def _node(index: int, lost: str | None = None) -> AgentNode:
    node = AgentNode(None, 0, f"10.0.0.{index}", 32300, {})  # type: ignore[arg-type]
    node.lost_reason = lost
    return node


def test_reserving_takes_the_groups_nodes_then_the_added_ones_then_the_others():
    heard: list = []
    members = Members(Dialer(TOKEN.encode()), max_frame=1 << 20, fanout=50, discovery=None,
                      tell=heard.append)
    first, lost, spare_one, other = _node(1), _node(2, "gone"), _node(3), _node(4)
    members.nodes = [first, lost, other]
    members.spares = [spare_one]
    assert members.available(2) == 2  # the lost one out, the added one in
    assert members.current(2) == [first, spare_one, other]
    assert members.nodes == [first, spare_one, other]
    assert [n.index for n in members.nodes] == [0, 1, 2] and members.spares == []
    assert heard == []  # reserving is no membership change


def test_both_sides_read_the_token_by_the_same_rules(tmp_path):
    assert cluster_token.given_token(f"  {TOKEN}\n") == TOKEN.encode()
    assert cluster_token.read_token(None, {cluster_token.TOKEN_ENV: TOKEN}) == TOKEN.encode()
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    assert cluster_token.read_token(str(path), {}) == TOKEN.encode()
    with pytest.raises(ValueError, match="at least 16"):
        cluster_token.given_token("short")
    with pytest.raises(ValueError, match="--token-file FILE or \\$PHALANX_TOKEN"):
        cluster_token.read_token(None, {})
