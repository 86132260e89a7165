"""Who descends from whom (:func:`phalanx.node.proctree.descendants`): read from the
kernel's lists of children, it finds what the whole process table finds, threads' children
and grandchildren included, and no zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from phalanx.node import proctree

# A child that starts a grandchild from a second thread and a zombie of its own, then
# prints the grandchild's pid and waits to be killed.
TREE = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    started = []
    def start():
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    thread = threading.Thread(target=start)
    thread.start(); thread.join()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    print(started[0].pid, zombie.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_descendants_from_the_kernels_children_lists_match_the_process_table():
    child = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        grandchild, zombie = map(int, child.stdout.readline().split())
        # Below the child only: the test process's other children (a session's Ray, its
        # agents) come and go, and siblings may be listed in either order.
        found = proctree.descendants(child.pid)
        assert found == [grandchild]  # the thread's child, and not the zombie
        assert found == proctree.descendants(child.pid, proctree.parent_table())
        mine = proctree.descendants(os.getpid())
        assert mine.index(child.pid) < mine.index(grandchild)  # parents first
        assert zombie not in mine
        assert proctree.descendants(grandchild) == []
    finally:
        child.kill()
        child.wait(10)
    deadline = time.monotonic() + 10
    while proctree.state(grandchild) not in (None, "Z"):  # orphaned, then reaped by init
        os.kill(grandchild, 9)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_has_children_sees_an_exited_child_without_reaping_it():
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    deadline = time.monotonic() + 10
    while proctree.state(done.pid) != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proctree.has_children()
    assert done.wait(10) == 3  # its status is still there for its owner


# A single-threaded process that ends as the test says once its pipe is read: its pipe's
# write end closes as its exit begins, well before it is a zombie (about 2 ms here).
_ENDING = "import os, sys, time\nos.write(int(sys.argv[1]), b'r')\nos.read(0, 1)\n" \
          "os._exit(int(sys.argv[2])) if sys.argv[2] != 'kill' else time.sleep(60)"


@pytest.mark.parametrize("how, status", [("3", 3 << 8), ("kill", 9)])
def test_an_exiting_process_has_its_status_as_its_pipes_end(how, status):
    ready_read, ready_write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", _ENDING, str(ready_write), how],
                             pass_fds=(ready_write,), stdin=subprocess.PIPE)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        assert proctree.exit_status(child.pid) is None  # it runs
        if how == "kill":
            child.kill()
        else:
            child.stdin.write(b"x")
            child.stdin.flush()
        assert os.read(ready_read, 1) == b""  # its end of the pipe is closed: it exits
        assert proctree.exit_status(child.pid) == status  # zombie or not yet
    finally:
        os.close(ready_read)
        child.kill()
        child.wait(10)
        child.stdin.close()


def test_an_exit_with_0_counts_only_from_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while proctree.state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proctree.exit_status(child.pid) == 0
    child.wait(10)
    assert proctree.exit_status(child.pid) is None  # reaped: gone
