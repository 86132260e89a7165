"""What a controller's put objects take on an agent's node is bounded in bytes, and is the
agent's own: ``group.put()`` past ``phalanx agent --max-held-mib`` (``config.
AGENT_MAX_HELD_BYTES``) fails with an error naming the limit and nothing is held for it,
the agent and the group go on, and freeing objects makes room again; the bytes held show in
the agent's resident set (``RssShmem``), which the kernel's OOM killer weighs, and leave it
when the objects are freed.

The agent is a real ``phalanx agent`` of this module's own on 127.0.0.14 (loopback only),
holding at most 8 MiB for one controller; the objects are 3 MiB numpy arrays.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import phalanx as px
from phalanx.node import shm
from tests import helpers
from tests.agentcluster import free_port, listening, start_agent, terminate
from tests.workers import Probe

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not shm.supported(),
                                reason="put objects need Linux's memfd_create and /proc")

HOST = "127.0.0.14"
ROOMY_HOST = "127.0.0.15"  # an agent of no limit of its own, beside the limited one
MIB = 1 << 20
LIMIT_MIB = 8
OBJECT = 3 * MIB  # two fit under the limit, a third does not
START_TIMEOUT = 30.0  # seconds for the agent to listen, however loaded the machine


class Agent:
    def __init__(self, pid: int, address: str, token_file: str) -> None:
        self.pid, self.address, self.token_file = pid, address, token_file

    def status(self, field: str) -> int:
        """A ``/proc/<pid>/status`` field in bytes (``VmRSS``, ``RssShmem``)."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB$", text, re.MULTILINE)
        assert match is not None, f"no {field} in the agent's status:\n{text}"
        return int(match.group(1)) * 1024

    def group(self) -> px.WorkerGroup:
        backend = px.ClusterBackend([self.address], token_file=self.token_file)
        return px.WorkerGroup(Probe, backend=backend, echo_output=False)


def _agent(where: Path, host: str, *flags: str):
    token_file = str(where / "token") if (where / "token").exists() else \
        helpers.token_file(where)
    port = free_port(host)
    proc = start_agent(host, port, token_file, *flags, store=str(where / f"store-{host}"))
    helpers.CLUSTER_ROOTS.add(proc.pid)  # it outlives each test; what it runs is checked
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or listening(host, port),
                                  START_TIMEOUT, interval=0.05)
        assert proc.poll() is None, f"the agent exited ({proc.returncode})"
        yield Agent(proc.pid, f"{host}:{port}", token_file)
    finally:
        helpers.CLUSTER_ROOTS.discard(proc.pid)
        terminate([proc])


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("held-bytes")


@pytest.fixture(scope="module")
def agent(where):
    yield from _agent(where, HOST, "--max-held-mib", str(LIMIT_MIB))


@pytest.fixture(scope="module")
def roomy(where, agent):
    yield from _agent(where, ROOMY_HOST)


def _array(value: float) -> np.ndarray:
    return np.full(OBJECT // 8, value, dtype=np.float64)


def test_a_put_past_the_bytes_held_fails_naming_the_limit_and_the_agent_goes_on(agent):
    with agent.group() as group:
        first, second = group.put(_array(1.0)), group.put(_array(2.0))
        with pytest.raises(px.PhalanxError) as caught:
            group.put(_array(3.0))
        message = str(caught.value)
        assert f"over the agent's limit of {LIMIT_MIB * MIB}" in message, message
        assert "phalanx.config.AGENT_MAX_HELD_BYTES" in message, message
        assert "--max-held-mib" in message, message

        # the objects held before are still there, and the group still serves
        assert group.call("array_summary", second)[0]["sum"] == 2.0 * (OBJECT // 8)
        first.free()  # makes room: the same put now succeeds
        third = group.put(_array(3.0))
        assert group.call("array_summary", third)[0]["sum"] == 3.0 * (OBJECT // 8)
        assert group.call("rank") == [0]


def test_the_bytes_held_are_in_the_agents_resident_set(agent):
    with agent.group() as group:
        before = agent.status("RssShmem")
        refs = [group.put(_array(1.0)), group.put(_array(2.0))]  # each held once it returns
        held = agent.status("RssShmem") - before
        # 6 MiB and two pickle headers; a little of the agent's own shared memory may move
        assert held >= 2 * OBJECT - MIB // 4, (held, agent.status("VmRSS"))
        assert agent.status("VmRSS") >= 2 * OBJECT
        for ref in refs:
            ref.free()
        # DROP has no answer: the next request's answer comes after it was handled
        group.call("rank")
        assert helpers.wait_until(lambda: agent.status("RssShmem") - before < MIB, 10), \
            agent.status("RssShmem") - before
    assert os.path.exists(f"/proc/{agent.pid}")


def test_a_put_one_node_refuses_is_held_by_no_node(agent, roomy):
    """Over two agents, the limited one refusing the third object: the other, which took
    it, drops it again, so the failed put() holds no bytes anywhere."""
    backend = px.ClusterBackend([agent.address, roomy.address], token_file=agent.token_file)
    with px.WorkerGroup(Probe, nodes=2, backend=backend, echo_output=False) as group:
        refs = [group.put(_array(1.0)), group.put(_array(2.0))]
        two = roomy.status("RssShmem")
        with pytest.raises(px.PhalanxError, match="AGENT_MAX_HELD_BYTES"):
            group.put(_array(3.0))
        group.call("rank")  # DROP has no answer: a later request's answer comes after it
        assert helpers.wait_until(lambda: roomy.status("RssShmem") - two < MIB, 10), \
            roomy.status("RssShmem") - two
        sums = [summary["sum"] for summary in group.call("array_summary", refs[1])]
        assert sums == [2.0 * (OBJECT // 8)] * 2
