"""A controller script's exit status is the one Python gives without phalanx.

Ctrl-C (SIGINT) in a script that leaves a group open, or uses ``with``, with or without a
call in flight: Python re-raises SIGINT on itself after its exit handlers, so the parent sees
the script killed by SIGINT (-2 here, 130 in a shell). Shutting a group down at exit must
not turn that into status 1.
"""

from __future__ import annotations

import select
import signal

import pytest

from tests import helpers

SCRIPTS = {
    "idle group left open": """
        group = px.WorkerGroup(Probe, procs_per_node=2, echo_output=False)
        group.call("pid")
        print("ready", flush=True)
        time.sleep(60)
    """,
    "call in flight": """
        group = px.WorkerGroup(Probe, procs_per_node=2, echo_output=False)
        print("ready", flush=True)
        group.call("sleep", 60)
    """,
    "pending future": """
        group = px.WorkerGroup(Probe, procs_per_node=2, echo_output=False)
        future = group.call_async("sleep", 60)
        print("ready", flush=True)
        time.sleep(60)
    """,
    "with block": """
        with px.WorkerGroup(Probe, procs_per_node=2, echo_output=False) as group:
            print("ready", flush=True)
            group.call("sleep", 60)
    """,
    "no group at all": """
        print("ready", flush=True)
        time.sleep(60)
    """,
}


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_ctrl_c_exits_as_python_does(tmp_path, case):
    script = helpers.write_script(tmp_path, """
        import time
        import phalanx as px
        from tests.workers import Probe
    """ + SCRIPTS[case])
    with helpers.running_script(script) as controller:
        ready, _, _ = select.select([controller.stdout], [], [], 30)
        assert ready and controller.stdout.readline().strip() == "ready", controller.stderr.read()
        controller.send_signal(signal.SIGINT)
        status = controller.wait(30)
        stderr = controller.stderr.read()
        assert status == -signal.SIGINT, f"exit status {status}, not killed by SIGINT:\n{stderr}"
        assert "KeyboardInterrupt" in stderr
