"""The cluster backend's output, launch by launch: what an earlier launch of a rank sent
late is never taken for the output of the rank started after it."""

from __future__ import annotations

from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.link import AgentLink
from tests.unit.test_protocol import transmit


class _Channel:
    """What the link hands a rank's output to: a launch, and what it was given."""

    def __init__(self, rank: int, incarnation: int) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.received: list[tuple[int, bytes | None]] = []

    def output(self, stream: int, data: bytes | None) -> None:
        self.received.append((stream, data))


def _link_with(channel: _Channel) -> AgentLink:
    link = object.__new__(AgentLink)  # no connection: only the routing of a read
    link._channels = {channel.rank: channel}
    return link


def test_an_earlier_launchs_output_end_does_not_end_the_new_launchs_stream():
    new = _Channel(rank=1, incarnation=7)
    link = _link_with(new)
    link._route(transmit(agentwire.output_end(1, 6, agentwire.STDOUT),  # launch 6: late
                         agentwire.output(1, 6, agentwire.STDERR, b"old words\n")), None)
    assert new.received == []
    link._route(transmit(agentwire.output(1, 7, agentwire.STDOUT, b"new words\n"),
                         agentwire.output_end(1, 7, agentwire.STDOUT)), None)
    assert new.received == [(agentwire.STDOUT, b"new words\n"), (agentwire.STDOUT, None)]
