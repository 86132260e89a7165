"""A Ray whose raylet dies under a running group: the group's calls fail, its shutdown
returns, and the suite's own leftover checks (tests/raycluster.py, which the module
teardown runs) end within their bound -- nothing hangs.

The raylet killed is that of a throwaway Ray of the test's own (``ray start --head`` on
127.0.0.10, its own ports and temp dir), never the shared test cluster's, which later
tests still need. The controller is a script of its own (a user's driver): this process
may already be connected to the shared cluster, and a process joins one Ray at a time.
Every step is bounded -- the driver runs each on a thread it waits for a bounded time,
and the driver itself runs under a timeout -- so the test reports a hang, never hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests import helpers

pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")

# The throwaway Ray's addresses: not 127.0.0.1 (Ray rewrites it), nor the shared
# cluster's 127.0.0.2-4 or the cluster tests' own agents' 127.0.0.5-9.
HOST = "127.0.0.10"  # its head node: the driver's
NODE = "127.0.0.11"  # its second node, where the ranks run when they run apart
MARKER = "PHALANX_TEST_THROWAWAY_RAY"  # in the environment of every process of that Ray
CALL_BOUND = 20.0  # a call pending when the raylet dies fails within this
SHUTDOWN_BOUND = 15.0  # group.shutdown() returns within this
ANSWER_TIMEOUT = 3.0  # raycluster.ANSWER_TIMEOUT in the driver (20 s in the suite)
CHECK_WAIT = 1.0  # leftovers(wait=)
# leftovers(): its wait, then at most two questions of ANSWER_TIMEOUT each
CHECK_BOUND = CHECK_WAIT + 2 * ANSWER_TIMEOUT + 5.0
# The head's extra settings. Its GCS checks each raylet every 0.3 s, not 3 s: a dead
# raylet's node (and its actors) is declared dead about 1.5 s after its death (5 failed
# checks in a row), so the teardown's checks find the actors dead at once instead of
# waiting out CHECK_WAIT -- while a live raylet that is slow to answer on a loaded machine
# still has Ray's default 10 s a check before one counts as failed. No autoscaler monitor:
# nothing here autoscales, and each Python daemon fewer is a second of CPU less while the
# throwaway Ray starts (as is each node's log monitor: the driver takes no worker logs).
HEAD_ONLY = ["--no-monitor", "--system-config=" + json.dumps(
    {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 300})]


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now (held open until all are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def _instance_processes(marker: str) -> list[psutil.Process]:
    """The live processes of the throwaway Ray: they all inherit ``MARKER`` (``ray start``
    leaves them to init, so they are no children of this process), and their children.
    (A process that sets its title -- Ray's agents, ``ray::DashboardAgent`` -- may write
    over its environment's block, where the marker is read from: found as its raylet's
    child, else left behind once that raylet is killed.)"""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker:
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
        except psutil.Error:  # gone, or another user's
            continue
    return [proc for proc in found.values() if helpers.pid_alive(proc.pid)]


def _stop_instance(marker: str) -> list[str]:
    """SIGKILL every process of the throwaway Ray until none is left (at most 15 s); what
    was still alive then."""
    deadline = time.monotonic() + 15
    while True:
        procs = _instance_processes(marker)
        if not procs:
            return []
        if time.monotonic() >= deadline:
            return [f"pid {p.pid} ({p.name()})" for p in procs]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        helpers.wait_dead([p.pid for p in procs], timeout=5)


def _ray_start(node_ip: str, temp_dir: str, env: dict[str, str], cpus: int,
               head: str, is_head: bool) -> str | None:
    """``ray start`` of one node on ``node_ip``: the head (on ``head``'s port) or a node
    that joins ``head``, every port its own (the shared cluster's are taken); None once
    started, else what ``ray start`` said."""
    options = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port",
               "runtime-env-agent-port", "metrics-export-port", "node-manager-port",
               "object-manager-port"]
    if is_head:
        options += ["ray-client-server-port", "dashboard-port"]
        where = ["--head", f"--port={head.rpartition(':')[2]}", "--include-dashboard=false"]
    else:
        where = [f"--address={head}"]
    ports = _free_ports(node_ip, len(options))
    command = [str(Path(sys.executable).with_name("ray")), "start", *where,
               f"--node-ip-address={node_ip}", f"--temp-dir={temp_dir}",
               f"--num-cpus={cpus}", "--num-gpus=0", "--disable-usage-stats",
               f"--object-store-memory={150 * 1024 * 1024}",
               "--include-log-monitor=false", *(HEAD_ONLY if is_head else []),
               *(f"--{option}={port}" for option, port in zip(options, ports, strict=True))]
    started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    return None if started.returncode == 0 else started.stderr[-3000:]


def ray_env(marker: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the throwaway Ray's processes and of its driver: ``MARKER``, and
    token authentication off, as on the shared cluster (loopback only) -- else ``ray start
    --head`` turns it on whenever ~/.ray/auth_token exists (which a local ``ray.init()``
    writes), and a node or driver that was not told so is refused."""
    env = dict(os.environ if base is None else base, RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="disabled", **{MARKER: marker})
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    return env


@contextlib.contextmanager
def throwaway_ray(ranks_apart: bool, marker: str):
    """A Ray of this test's own, like the shared cluster's nodes (loopback, no dashboard,
    no token), with every port its own: a head node on HOST and, with ``ranks_apart``, a
    second node on NODE that has all its CPUs (the head none), so that the ranks run
    there; yields ``(address, temp_dirs)``, the temp dirs the head's and the node's.
    Started again (at most 3 times) when ``ray start`` fails, as when a port it was given
    was taken meanwhile. Its temp dirs are short (Ray's Unix socket paths must fit 107
    bytes), under the system's temp dir rather than tmp_path. Stopped by killing its
    processes: ``ray stop`` would stop every Ray of this machine's user, the shared
    cluster included."""
    env = ray_env(marker, helpers.script_env())  # its workers find this checkout
    root = tempfile.mkdtemp(prefix="phx-ray-")
    dirs = {"head": os.path.join(root, "h"), "node": os.path.join(root, "n")}
    try:
        for _ in range(3):
            address = f"{HOST}:{_free_ports(HOST, 1)[0]}"
            failed = _ray_start(HOST, dirs["head"], env, cpus=0 if ranks_apart else 2,
                                head=address, is_head=True)
            if failed is None and ranks_apart:
                failed = _ray_start(NODE, dirs["node"], env, cpus=2, head=address,
                                    is_head=False)
            if failed is None:
                break
            left = _stop_instance(marker)
            assert not left, f"a failed ray start left processes: {left}"
            for where in dirs.values():
                shutil.rmtree(where, ignore_errors=True)
        else:
            pytest.fail(f"ray start failed 3 times, the last:\n{failed}")
        yield address, dirs
    finally:
        left = _stop_instance(marker)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"the throwaway Ray's processes outlived SIGKILL: {left}"


def _raylets(temp_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "raylet" and any(
                    temp_dir + os.sep in arg for arg in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


DRIVER = """
    import json, os, sys, threading, time

    import ray

    import phalanx as px
    from tests import raycluster
    from tests.workers import Probe

    host, repo = sys.argv[1:3]
    call_bound, shutdown_bound, check_bound = map(float, sys.argv[3:6])
    raycluster.ANSWER_TIMEOUT = float(sys.argv[6])
    check_wait = float(sys.argv[7])
    address = sys.stdin.readline().strip()  # once the throwaway Ray is up


    def report(**fields):
        print(json.dumps({"phalanx-step": fields}), flush=True)


    def bounded(step, bound, question):
        # question() on a thread of its own, waited for at most bound s
        answer = {}

        def ask():
            try:
                answer["value"] = repr(question())[:500]
            except BaseException as exc:
                answer["error"], answer["text"] = type(exc).__name__, str(exc)[:2000]

        thread = threading.Thread(target=ask, daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(bound)
        report(step=step, hung=thread.is_alive(), took=round(time.monotonic() - started, 2),
               **answer)


    # connected the way the suite connects (raycluster.start): the connection is the
    # driver's, so it outlives the group and the teardown's checks run on it
    ray.init(address=address, _node_ip_address=host, log_to_driver=False)
    group = px.WorkerGroup(Probe, procs_per_node=2, backend=px.RayBackend(address=address),
                           echo_output=False)
    pids = group.call("pid", timeout=30)
    nodes = group.call("ray_node", timeout=30)
    pending = group.call_async("sleep", 300)
    report(step="ready", pids=pids, nodes=nodes)
    sys.stdin.readline()  # the raylet is dead now
    bounded("pending call", call_bound, lambda: pending.result(timeout=3 * call_bound))
    bounded("new call", call_bound, lambda: group.call("rank", timeout=3 * call_bound))
    # the module teardown's checks, as they run: with the group's actors still on Ray (a
    # module that leaked them), then after its shutdown (leftovers(), then clean())
    bounded("leftovers before shutdown", check_bound,
            lambda: raycluster.leftovers(wait=check_wait))
    bounded("shutdown", shutdown_bound, lambda: group.shutdown(timeout=5))
    bounded("leftovers", check_bound, lambda: raycluster.leftovers(wait=check_wait))
    bounded("clean", check_bound, raycluster.clean)
    bounded("ray.shutdown", shutdown_bound, ray.shutdown)
    # the hang this guards against: disconnected, with RAY_ADDRESS naming this Ray, Ray's
    # own list_named_actors would ray.init() against it (and wait forever when its head's
    # raylet is dead); the check must refuse at once instead
    os.environ["RAY_ADDRESS"] = address
    bounded("leftovers disconnected", check_bound,
            lambda: raycluster.leftovers(wait=check_wait))
    report(step="done")
"""


def _steps(stdout: str) -> dict[str, dict]:
    steps = {}
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):
            step = json.loads(line).get("phalanx-step")
            if step:
                steps[step["step"]] = step
    return steps


def _end_driver(driver: subprocess.Popen) -> None:
    """Kill the driver if it still runs, and close its pipes (again: a no-op)."""
    if driver.poll() is None:
        driver.kill()
        driver.wait(10)
    for pipe in (driver.stdin, driver.stdout, driver.stderr):
        with contextlib.suppress(OSError):
            pipe.close()


def _readline(pipe, timeout: float) -> str:
    ready, _, _ = select.select([pipe], [], [], timeout)
    return pipe.readline() if ready else ""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks_apart", [False, True],
                         ids=["the-drivers-raylet", "the-ranks-nodes-raylet"])
def test_a_dead_raylet_fails_calls_and_lets_shutdown_and_the_teardown_checks_end(
        tmp_path, ranks_apart):
    """The raylet of the driver's own node (the ranks with it), or of the node the ranks
    run on apart from the driver's, is SIGKILLed while a call runs on the ranks."""
    script = helpers.write_script(tmp_path, DRIVER, name="driver.py")
    marker = uuid.uuid4().hex
    # The driver starts first and imports Ray and phalanx while the throwaway Ray starts
    # (seconds of a loaded machine's time), then reads that Ray's address. Without the
    # shared cluster's RAY_ADDRESS; marked apart from that Ray's processes, which a
    # failed ``ray start`` has killed before a retry (this test kills the driver itself).
    env = ray_env(f"{marker}-driver", helpers.script_env())
    args = [sys.executable, str(script), HOST, str(helpers.REPO),
            str(CALL_BOUND), str(SHUTDOWN_BOUND), str(CHECK_BOUND), str(ANSWER_TIMEOUT),
            str(CHECK_WAIT)]
    driver = subprocess.Popen(args, cwd=str(tmp_path), env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    with contextlib.ExitStack() as stack:
        stack.callback(_end_driver, driver)  # however the Ray's start went
        address, temp_dirs = stack.enter_context(throwaway_ray(ranks_apart, marker))
        driver.stdin.write(address + "\n")
        driver.stdin.flush()
        try:
            line = _readline(driver.stdout, 90)
            ready = _steps(line).get("ready")
            if not ready:
                driver.kill()
                out, err = driver.communicate(timeout=10)
                pytest.fail(f"the driver did not start its group:\n{line}{out[-3000:]}\n"
                            f"{err[-3000:]}")
            assert ready["nodes"] == [NODE if ranks_apart else HOST] * 2, ready
            raylets = _raylets(temp_dirs["node" if ranks_apart else "head"])
            assert len(raylets) == 1, f"the throwaway Ray's raylet: {raylets}"
            raylets[0].kill()
            killed = time.monotonic()
            driver.stdin.write("go\n")
            driver.stdin.flush()
            bound = 2 * CALL_BOUND + 2 * SHUTDOWN_BOUND + 2 * CHECK_BOUND + 30
            try:
                out, err = driver.communicate(timeout=bound)
            except subprocess.TimeoutExpired:
                driver.kill()
                out, err = driver.communicate()
                pytest.fail(f"the driver did not end within {bound:g} s of the raylet's "
                            f"death:\n{out[-3000:]}\n{err[-3000:]}")
            ended = time.monotonic() - killed
        finally:
            _end_driver(driver)
        steps = _steps(out)
        context = f"steps: {json.dumps(steps, indent=1)}\nstderr:\n{err[-3000:]}"
        for name in ("pending call", "new call", "leftovers before shutdown", "shutdown",
                     "leftovers", "clean", "ray.shutdown", "leftovers disconnected"):
            assert name in steps, f"the driver never reported {name!r}\n{context}"
            assert not steps[name]["hung"], f"{name!r} hung\n{context}"
        # (a) the call pending on the ranks, and a new one, fail saying which rank died,
        # and the pending one what it was running
        for name in ("pending call", "new call"):
            step = steps[name]
            assert step.get("error") == "WorkerDied", context
            assert "rank " in step["text"] and "died" in step["text"], context
        assert "sleep()" in steps["pending call"]["text"], context
        # (b) the group's shutdown returns, and quietly
        assert "error" not in steps["shutdown"], context
        # (c) the teardown's checks answer or say Ray is unresponsive: never anything else
        for name in ("leftovers before shutdown", "leftovers", "clean"):
            assert steps[name].get("error") in (None, "RayUnresponsive"), context
        assert steps["leftovers disconnected"].get("error") == "RayUnresponsive", context
        assert steps["leftovers disconnected"]["took"] < 1.0, context
        assert "done" in steps, context
        assert driver.returncode == 0, context
        # the ranks went with their raylet (before the throwaway Ray is stopped below)
        assert helpers.wait_dead(ready["pids"], timeout=5), f"ranks outlived: {ready}"
        print(f"raylet killed -> driver ended in {ended:.1f} s; "
              + ", ".join(f"{n}: {s['took']:.2f} s" for n, s in steps.items() if "took" in s))
