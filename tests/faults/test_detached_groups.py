"""A controller that can die and be replaced: ``detached=True`` groups on agents and
``px.attach``.

A controller in a process of its own starts a detached group on two agents, records state
on its ranks, keeps a result on each, starts a long call, and is SIGKILLed in the middle of
it. This process then attaches by the group's name and holds the very same ranks: the same
pids, their state, handles of the kept results (``kept()``) that read the same values,
the answers of the call that was running (``orphaned()``), and new calls work. Around that:
nobody attaching within ``detach_timeout`` stops the ranks; a group a live controller holds
is refused naming it, or taken over with ``force=True``; a group that is not detached dies
with its controller as before; bad input is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import phalanx as px
from tests import helpers
from tests.agentcluster import free_port
from tests.conftest import BACKENDS
from tests.helpers import REPO, wait_until
from tests.workers import Probe

needs_agents = pytest.mark.skipif("cluster" not in BACKENDS,
                                  reason="the cluster backend is not under test")

CONTROLLER = textwrap.dedent("""
    import json, sys, time
    import phalanx as px
    from tests.workers import Probe

    TREE = {"tree_threshold": 1, "fanout": 2}

    hosts, token_file, name, detached, timeout, end, tree = json.loads(sys.argv[1])
    if hosts is not None:
        hosts = hosts if tree else hosts[:2]  # a tree: all three, node 1 below node 0
    backend = ("local" if hosts is None else
               px.ClusterBackend(hosts, token_file=token_file, **TREE if tree else {}))
    if end == "attach-kill":  # a second controller, itself killed in a call
        group = px.attach(name, backend=backend, echo_output=False)
        group.call("record", "second")
    else:
        group = px.WorkerGroup(Probe, nodes=None if hosts is None else len(hosts),
                               procs_per_node=None if hosts is not None else 2,
                               backend=backend, name=name, detached=detached,
                               detach_timeout=timeout, echo_output=False)
    group.call("record", "before")
    kept = group.call("make_array", 1000, keep=True)
    print(json.dumps({"pids": group.call("pid"),
                      "sums": [float(h.get().sum()) for h in kept]}), flush=True)
    running = group.call_async("sleep", 2.0, "slept")
    time.sleep(0.3)
    print("running", flush=True)
    if end == "exit":  # a normal exit: the group is detached, not shut down
        sys.exit(0)
    if end == "detach":
        group.detach()
        print("detached", flush=True)
    time.sleep(60)  # killed here, inside the running call
""")


def _controller(agents, name: str, *, detached: bool = True, timeout: float = 30.0,
                end: str = "kill", tree: bool = False) -> tuple[subprocess.Popen, dict]:
    """A controller process that started the group (on ``agents``; None: the local
    backend) and runs a call; what it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    hosts = None if agents is None else agents.hosts
    token_file = None if agents is None else agents.token_file
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER,
         json.dumps([hosts, token_file, name, detached, timeout, end, tree])],
        stdout=subprocess.PIPE, env=env, cwd=REPO, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    running = proc.stdout.readline()  # type: ignore[union-attr]
    if not line or running != "running\n":
        proc.kill()
        proc.wait()
        pytest.fail(f"the controller ended before starting its group (code {proc.wait()})")
    return proc, json.loads(line)


def _next_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The controller's next line of output within ``timeout`` s ("" if none came; the
    reader ends once the controller is killed and its output closed)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()  # type: ignore[union-attr]


def _attach_the_same_ranks(name: str, backend, pids: list[int], force: bool = False) -> None:
    """Attach, find the very ranks ``pids`` there, and end the group: they go."""
    group = px.attach(name, backend=backend, force=force, echo_output=False)
    try:
        assert group.call("pid") == pids
    finally:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(pids), 15)


@needs_agents
def test_a_killed_controllers_group_is_attached_with_its_ranks_state_and_kept_results(
        agent_cluster):
    proc, started = _controller(agent_cluster, "attach-me")
    _kill(proc)  # inside the 2 s call
    t0 = time.monotonic()
    group = px.attach("attach-me", backend=agent_cluster.backend(), echo_output=False)
    try:
        attach_s = time.monotonic() - t0
        assert group.call("pid") == started["pids"]  # the same processes: 0 restarts
        assert group.name == "attach-me" and group.world_size == 2 and group.detachable
        assert attach_s < 10, attach_s  # (the 2 s is measured in bench/)
        # the running call's answers, once it ended, are the orphans
        assert wait_until(lambda: len(group.orphaned()) == 2, 10)
        orphans = group.orphaned(take=True)
        assert [(o.rank, o.method, o.value, o.error) for o in orphans] == [
            (0, "sleep", "slept", None), (1, "sleep", "slept", None)]
        assert group.orphaned() == []
        kept = group.kept()
        assert sorted(float(h.get().sum()) for h in kept) == sorted(started["sums"])
        assert all(s["sum"] == kept[0].get().sum()  # a handle passed to a call
                   for s in group.call("array_summary", kept[0]))
        assert group.call("history") == [["before"], ["before"]]  # state on the ranks
        assert group.call("add", 1, 2) == [3, 3]
    finally:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(started["pids"]), 15)


@needs_agents
def test_a_detached_group_on_a_tree_of_agents_is_attached_through_its_top_agent(
        agent_cluster):
    """Three agents in a tree (the controller reaches nodes 0 and 2; node 1 is below node
    0): the top agents wait, the node below runs on, and the controller that attaches
    drives all three again, with the running call's answers of every rank -- node 1's kept
    by node 0's agent, named with its node and pid here."""
    proc, started = _controller(agent_cluster, "tree-group", tree=True)
    _kill(proc)  # inside the 2 s call, on all three ranks
    backend = agent_cluster.backend(tree_threshold=1, fanout=2)
    group = px.attach("tree-group", backend=backend, echo_output=False)
    try:
        assert group._backend.connection_count() == 2  # the top agents' only
        assert group.call("pid") == started["pids"]  # 0 restarts, on every level
        assert wait_until(lambda: len(group.orphaned()) == 3, 10)
        orphans = group.orphaned()
        assert [(o.rank, o.method, o.value) for o in orphans] == [
            (r, "sleep", "slept") for r in range(3)]
        assert group.call("history") == [["before"]] * 3
        assert sorted(float(h.get().sum()) for h in group.kept()) == sorted(started["sums"])
        assert group.call("add", 1, 2) == [3, 3, 3]
        assert [g["ranks"] for g in px.attached(agent_cluster.backend())
                if g["name"] == "tree-group"] == [[0, 1, 2]]
    finally:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(started["pids"]), 15)


@needs_agents
@pytest.mark.parametrize("end", ["exit", "detach"])
def test_a_controller_that_exits_or_detaches_leaves_the_group_to_the_next(agent_cluster, end):
    proc, started = _controller(agent_cluster, f"left-{end}", end=end)
    try:
        if end == "detach":  # attached once detach() returned, not while it lets go
            assert _next_line(proc) == "detached\n"
        assert proc.wait(timeout=20) == 0 if end == "exit" else proc.poll() is None
        _attach_the_same_ranks(f"left-{end}", agent_cluster.backend(), started["pids"])
    finally:
        _kill(proc)


@needs_agents
def test_a_group_outlives_one_controller_after_another(agent_cluster):
    first, started = _controller(agent_cluster, "relay")
    _kill(first)
    second, again = _controller(agent_cluster, "relay", end="attach-kill")
    _kill(second)  # inside its own call: the orphans of both controllers' calls
    group = px.attach("relay", backend=agent_cluster.backend(), echo_output=False)
    try:
        assert again["pids"] == started["pids"] == group.call("pid")
        assert group.call("history") == [["before", "second", "before"]] * 2
        assert wait_until(lambda: len(group.orphaned()) == 4, 10)
        assert sorted(o.call_id for o in group.orphaned())[0] < 1 << 32  # the first's
    finally:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(started["pids"]), 15)


@needs_agents
def test_an_agent_that_stops_ends_the_detached_groups_it_keeps(agent_cluster):
    from tests.agentcluster import Agents, listening, start_agent, terminate

    host, port = "127.0.0.5", free_port("127.0.0.5")
    agent = start_agent(host, port, agent_cluster.token_file, "--once")
    try:
        assert wait_until(lambda: listening(host, port), 30)
        proc, started = _controller(Agents([agent], [f"{host}:{port}"], agent_cluster.token,
                                           agent_cluster.token_file), "agent-ends")
        _kill(proc)
        assert helpers.alive(started["pids"]) == started["pids"]  # kept for the next controller
    finally:
        terminate([agent])  # SIGTERM: an agent that stops stops every rank it holds
    assert wait_until(lambda: not helpers.alive(started["pids"]), 10)


@needs_agents
def test_nobody_attaching_within_the_timeout_stops_the_ranks(agent_cluster):
    proc, started = _controller(agent_cluster, "left-alone", timeout=1.0)
    _kill(proc)
    assert helpers.alive(started["pids"]) == started["pids"]  # the nodes keep them a while
    assert wait_until(lambda: not helpers.alive(started["pids"]), 20)
    with pytest.raises(LookupError, match="no agent keeps a detached group named"):
        px.attach("left-alone", backend=agent_cluster.backend())


@needs_agents
def test_a_group_that_is_not_detached_ends_with_its_controller(agent_cluster):
    proc, started = _controller(agent_cluster, "not-detached", detached=False)
    _kill(proc)
    assert wait_until(lambda: not helpers.alive(started["pids"]), 20)


@needs_agents
def test_a_held_group_is_refused_naming_its_controller_or_taken_over_with_force(
        agent_cluster):
    proc, started = _controller(agent_cluster, "held")  # alive: it holds the group
    try:
        listed = {g["name"]: g for g in px.attached(agent_cluster.backend())}
        assert listed["held"]["holder"].startswith("127.")  # held by that controller
        assert len(listed["held"]["hosts"]) == 2 and listed["held"]["timeout"] == 30
        with pytest.raises(RuntimeError, match="is held by the controller at 127"):
            px.attach("held", backend=agent_cluster.backend())
        stranger = px.ClusterBackend(agent_cluster.hosts, token="not-the-token-" * 3,
                                     quorum_timeout=5)
        with pytest.raises(px.AuthenticationError):  # before anything is shown
            px.attach("held", backend=stranger)
        shown = subprocess.run(
            [sys.executable, "-m", "phalanx", "ps", "--hosts", ",".join(agent_cluster.hosts),
             "--token-file", agent_cluster.token_file], capture_output=True, text=True,
            timeout=60, cwd=REPO)
        line = next(row for row in shown.stdout.splitlines() if row.startswith("held "))
        assert line.split()[1] == "2" and "127.0.0.1:" in line, shown.stdout
        _attach_the_same_ranks("held", agent_cluster.backend(), started["pids"], force=True)
    finally:
        _kill(proc)


@needs_agents
def test_bad_detached_groups_are_refused_before_anything_starts(agent_cluster):
    with pytest.raises(ValueError, match="detached=True needs name="):
        px.WorkerGroup(Probe, backend=agent_cluster.backend(), detached=True)
    with pytest.raises(ValueError, match="runs the group on this user's local agent, one node"):
        px.WorkerGroup(Probe, nodes=2, name="local-detached", detached=True)
    with pytest.raises(ValueError, match="detach_timeout must be a positive"):
        px.WorkerGroup(Probe, backend=agent_cluster.backend(), name="x", detached=True,
                       detach_timeout=0)
    with pytest.raises(ValueError, match="must pickle"):
        px.WorkerGroup(Probe, backend=agent_cluster.backend(), name="x", detached=True,
                       kwargs={"lock": threading.Lock()})
    # a process connected to no Ray (this one may be: the Ray tests' cluster): a local Ray
    # started for it would keep none
    env = {k: v for k, v in helpers.script_env().items() if k != "RAY_ADDRESS"}
    lone = subprocess.run(
        [sys.executable, "-c", "import phalanx as px; px.attach('x', backend=px.RayBackend())"],
        env=env, capture_output=True, text=True, timeout=60)
    assert lone.returncode == 1, lone.stderr
    assert "ValueError: detached groups on Ray live on a Ray cluster that outlives this " \
        "process" in lone.stderr, lone.stderr
    # a Slurm backend that would submit a job of its own has no agents to ask: give the job
    with pytest.raises(ValueError, match=r"give px\.SlurmBackend\(job=JOBID\)"):
        px.attached(px.SlurmBackend(nodes=1))


def test_the_local_backend_keeps_a_detached_group_in_a_local_agent(local_agent_dir):
    proc, started = _controller(None, "local-kept")
    _kill(proc)
    listed = px.attached()  # the local agent's, by default
    assert [(g["name"], g["holder"]) for g in listed] == [("local-kept", None)]
    group = px.attach("local-kept", echo_output=False)
    try:
        assert group.call("pid") == started["pids"]
        assert group.call("history") == [["before"], ["before"]]
        assert wait_until(lambda: len(group.orphaned()) == 2, 10)
    finally:
        group.shutdown()
    assert wait_until(lambda: not helpers.alive(started["pids"]), 15)
