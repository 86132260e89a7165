"""The cluster backend's output, launch by launch: what an earlier launch of a rank sent
late is never taken for the output of the rank started after it; and a rank's output
pipes in the controller are made only once it prints."""

from __future__ import annotations

import os

import phalanx as px
from phalanx.backends.cluster import messages as agentwire
from phalanx.backends.cluster.link import AgentLink
from tests.helpers import wait_until
from tests.unit.test_protocol import transmit
from tests.workers import Probe


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


def test_ranks_that_print_nothing_hold_no_descriptor_of_the_controller(agent_cluster, capfd):
    """The output pipes of a rank of agents are made with its first bytes: a group of 16
    ranks that print nothing costs the controller its links, not four descriptors a rank
    (ten thousand ranks would need forty thousand); the rank that prints is shown."""
    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = descriptors()
    with px.WorkerGroup(Probe, nodes=2, procs_per_node=8,
                        backend=agent_cluster.backend()) as group:
        group.call("pid")
        quiet = descriptors() - before
        assert quiet < 4 * group.world_size, quiet  # (links, the dispatcher's, a log pump)
        group.call("say", "words from rank 3", workers=[3])
        seen: list[str] = []

        def shown() -> bool:
            seen.append(capfd.readouterr().out)
            return "words from rank 3" in "".join(seen)

        assert wait_until(shown, 10)
        assert descriptors() - before <= quiet + 4  # the one that printed: its two pipes
