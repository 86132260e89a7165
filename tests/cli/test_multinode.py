"""``phalanx run --nnodes N``: one launcher per node, several launchers forming one world,
as torchrun's agents do. Each test starts real launchers (``python -m phalanx run``) on
this machine, one per simulated node, meeting at a free local port.

Launchers write their output to files in ``tmp_path`` (their working directory, where the
ranks' scripts live too), so several can run at once without anyone draining pipes. The
ranks of the sleeping scripts write their pid to ``pid-<RANK>``: ranks are grandchildren
of the test process (or orphans, once a launcher is killed), which the suite's leftover
check cannot see, so the tests check them, and the ``launchers`` fixture SIGKILLs whatever
is still running when a test ends, however it ended.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests import helpers

PHALANX_RUN = [sys.executable, "-m", "phalanx", "run"]
START_TIMEOUT = 30.0  # seconds for every rank of a job to be running, however loaded
RUN_TIMEOUT = 60.0  # seconds for a job to run to its end (torch imports take a few)
STOP_WITHIN = 15.0  # seconds for every launcher to end after a failure anywhere
GONE_WITHIN = 10.0  # seconds for the ranks to be gone once their launcher ended

_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")

# Each rank says it runs (its pid, in pid-<RANK>), then sleeps until it is stopped.
SLEEPER = """\
import os
import time

rank = os.environ["RANK"]
with open(f"pid-{rank}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"pid-{rank}.tmp", f"pid-{rank}")
print(f"rank {rank} sleeping", flush=True)
time.sleep(60)
"""

# Each rank says it runs, then waits (bounded) for the test's go-ahead file, and ends.
WAIT_FOR_GO = """\
import os
import sys
import time

rank = os.environ["RANK"]
with open(f"pid-{rank}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"pid-{rank}.tmp", f"pid-{rank}")
deadline = time.monotonic() + 30
while not os.path.exists("go"):
    if time.monotonic() > deadline:
        sys.exit("no go-ahead from the test")
    time.sleep(0.02)
print(f"rank {rank} done run_id={os.environ['TORCHELASTIC_RUN_ID']}", flush=True)
"""

SHOW_ENV = """\
import os

e = os.environ
open(f"ran-{e['RANK']}", "w").close()
print(f"rank={e['RANK']} world={e['WORLD_SIZE']} node={e['NODE_RANK']} "
      f"group={e['GROUP_RANK']} local={e['LOCAL_RANK']} run_id={e['TORCHELASTIC_RUN_ID']}",
      flush=True)
"""


# -- launchers ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Launcher:
    """One ``phalanx run`` process (a node's launcher), its output in files."""

    def __init__(self, name: str, args: list[str], directory: Path) -> None:
        self.name = name
        self.args = args
        self._out = directory / f"launcher-{name}.stdout"
        self._err = directory / f"launcher-{name}.stderr"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen([*PHALANX_RUN, *args], cwd=directory,
                                         env=helpers.script_env(), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL)

    @property
    def stdout(self) -> str:
        return self._out.read_text()

    @property
    def stderr(self) -> str:
        return self._err.read_text()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def describe(self) -> str:
        return (f"--- launcher {self.name} ({' '.join(self.args)}): exit status "
                f"{self.proc.poll()}\n--- stdout\n{self.stdout}--- stderr\n{self.stderr}")

    def ranks(self) -> dict[int, list[str]]:
        """The lines each rank showed through this launcher: ``[rank N] text``."""
        shown: dict[int, list[str]] = {}
        for line in self.stdout.splitlines():
            match = _LINE.match(line)
            if match:
                shown.setdefault(int(match.group(1)), []).append(match.group(2))
        return shown

    def listening_on(self, port: int) -> bool:
        """Whether this launcher listens on ``port`` (hosts the job there)."""
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


class Launchers:
    """The launchers of one test, and every process they started that the test saw: all
    SIGKILLed at the end if still running, so a failing test leaves nothing behind."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Launcher] = []
        self.watched: list[psutil.Process] = []

    def start(self, name: str, *args: str) -> Launcher:
        launcher = Launcher(name, list(args), self.directory)
        self.started.append(launcher)
        return launcher

    def node(self, name: str, port: int, nnodes: int, node_rank: int, *args: str) -> Launcher:
        """A launcher of a static rendezvous at 127.0.0.1:``port``."""
        return self.start(name, "--nnodes", str(nnodes), "--node-rank", str(node_rank),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), *args)

    def describe(self) -> str:
        return "\n".join(launcher.describe() for launcher in self.started)

    def wait(self, *launchers: Launcher, timeout: float) -> list[int]:
        """The exit statuses of ``launchers``, all ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        statuses = []
        for launcher in launchers:
            try:
                statuses.append(launcher.proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"launcher {launcher.name} still runs {timeout:g} s later\n"
                            f"{self.describe()}", pytrace=False)
        return statuses

    def rank_pids(self, world: int, timeout: float = START_TIMEOUT) -> dict[int, int]:
        """Wait until ranks ``0 .. world-1`` all wrote their pid; rank -> pid."""
        paths = [self.directory / f"pid-{rank}" for rank in range(world)]
        if not helpers.wait_until(lambda: all(p.exists() for p in paths), timeout, 0.05):
            missing = [p.name for p in paths if not p.exists()]
            pytest.fail(f"no {', '.join(missing)} within {timeout:g} s\n{self.describe()}",
                        pytrace=False)
        pids = {rank: int(path.read_text()) for rank, path in enumerate(paths)}
        for pid in pids.values():
            self.watch(pid)
        return pids

    def watch(self, pid: int) -> None:
        try:
            self.watched.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass

    def tree(self, launcher: Launcher) -> list[int]:
        """Every process the launcher started that runs now (also watched from now on)."""
        try:
            children = psutil.Process(launcher.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.watched.extend(children)
        return [child.pid for child in children]

    def cleanup(self) -> None:
        for launcher in self.started:
            if launcher.proc.poll() is None:
                self.tree(launcher)
                launcher.proc.kill()
        for proc in self.watched:
            try:
                proc.kill()  # only if still the same process: psutil checks its start time
            except psutil.Error:
                pass
        for launcher in self.started:
            try:
                launcher.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        psutil.wait_procs([p for p in self.watched if _running(p)], timeout=5)


def _running(proc: psutil.Process) -> bool:
    """Still running (a zombie, which only its parent can reap, is not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def launchers(tmp_path):
    group = Launchers(tmp_path)
    try:
        yield group
    finally:
        group.cleanup()


def script(directory: Path, name: str, source: str) -> str:
    (directory / name).write_text(textwrap.dedent(source))
    return name


def assert_gone(pids, launchers: Launchers) -> None:
    pids = list(pids)
    helpers.wait_dead(pids, timeout=GONE_WITHIN)
    alive = [pid for pid in pids if helpers.pid_alive(pid)]
    assert not alive, (f"processes still running after the launchers ended: {alive}\n"
                       f"{launchers.describe()}")


def report(stderr: str) -> str:
    """The root-cause report at the end of a launcher's stderr (between its two rules)."""
    lines = stderr.splitlines()
    rules = [i for i, line in enumerate(lines) if line == "=" * 72]
    assert len(rules) == 2, f"expected one root-cause report in:\n{stderr}"
    return "\n".join(lines[rules[0] + 1:rules[1]])


# -- a world of several launchers ---------------------------------------------------------


@helpers.needs("torch")
def test_two_launchers_form_one_world_and_all_reduce_across_it(tmp_path, launchers):
    reduce = script(tmp_path, "reduce.py", """\
        import os

        import torch
        import torch.distributed as dist

        e = os.environ
        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        print(f"rank={e['RANK']} world={e['WORLD_SIZE']} node={e['NODE_RANK']} "
              f"group={e['GROUP_RANK']} local={e['LOCAL_RANK']} sum={int(value.item())} "
              f"elastic={dist.is_torchelastic_launched()}", flush=True)
        dist.destroy_process_group()
    """)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "-n", "2", reduce)  # before its host: waits
    node0 = launchers.node("node0", port, 2, 0, "-n", "2", reduce)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()

    for launcher, node in ((node0, 0), (node1, 1)):
        shown = launcher.ranks()
        assert sorted(shown) == [2 * node, 2 * node + 1], launcher.describe()
        for rank, lines in shown.items():
            assert lines == [f"rank={rank} world=4 node={node} group={node} "
                             f"local={rank - 2 * node} sum=10 elastic=True"], \
                launcher.describe()
        assert "root cause" not in launcher.stderr


def test_a_rank_killed_on_one_node_stops_every_node_with_the_same_root_cause(tmp_path,
                                                                             launchers):
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "-n", "2", sleeper)
    node0 = launchers.node("node0", port, 2, 0, "-n", "2", sleeper)
    pids = launchers.rank_pids(4)

    killed = time.monotonic()
    helpers.kill_quietly(pids[3], signal.SIGKILL)
    statuses = launchers.wait(node0, node1, timeout=STOP_WITHIN)
    took = time.monotonic() - killed

    assert statuses == [1, 1], launchers.describe()  # torchrun's status for a failed rank
    assert took < STOP_WITHIN
    for launcher in (node0, node1):
        text = report(launcher.stderr)
        assert f"root cause: rank 3 (node 1, pid {pids[3]}) killed by SIGKILL" in text, \
            launcher.describe()
        assert "exit status: 1" in text
    assert "rank 3 (node 1) failed" in node0.stderr  # why node 0 stopped its own ranks
    assert_gone(pids.values(), launchers)


def test_a_restart_restarts_every_node_together(tmp_path, launchers):
    flaky = script(tmp_path, "flaky.py", """\
        import os
        import sys
        import time

        e = os.environ
        rank, attempt = e["RANK"], e["TORCHELASTIC_RESTART_COUNT"]
        print(f"rank {rank} attempt {attempt} of {e['TORCHELASTIC_MAX_RESTARTS']}",
              flush=True)
        open(f"started-{attempt}-{rank}", "w").close()
        # every rank printed before rank 2 fails (else one might be stopped before it did)
        deadline = time.monotonic() + 30
        while not all(os.path.exists(f"started-{attempt}-{r}") for r in range(4)):
            if time.monotonic() > deadline:
                sys.exit("the other ranks never started")
            time.sleep(0.01)
        if rank == "2" and attempt == "0":
            sys.exit(5)
    """)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "--max-restarts", "1", "-n", "2", flaky)
    node0 = launchers.node("node0", port, 2, 0, "--max-restarts", "1", "-n", "2", flaky)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()

    for launcher, mine in ((node0, [0, 1]), (node1, [2, 3])):
        shown = launcher.ranks()
        assert sorted(shown) == mine, launcher.describe()
        for rank in mine:
            assert shown[rank] == [f"rank {rank} attempt 0 of 1", f"rank {rank} attempt 1 of 1"]
        notice = ("phalanx run: rank 2 (node 1) exited with code 5; restarting every node "
                  "(restart 1 of 1)")
        assert launcher.stderr.count(notice) == 1, launcher.describe()
        assert "root cause" not in launcher.stderr


def test_when_the_restarts_run_out_every_launcher_reports_the_last_failure(tmp_path,
                                                                           launchers):
    failing = script(tmp_path, "failing.py", """\
        import os
        import sys

        if os.environ["RANK"] == "2":
            sys.exit(5)
    """)
    port = free_port()
    args = ("--max-restarts", "1", "--exit-code", "rank", "-n", "2", failing)
    node1 = launchers.node("node1", port, 2, 1, *args)
    node0 = launchers.node("node0", port, 2, 0, *args)
    # --exit-code rank: the failing rank's own status, on every node
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [5, 5], launchers.describe()
    for launcher in (node0, node1):
        assert "phalanx run failed after 2 attempts" in launcher.stderr, launcher.describe()
        text = report(launcher.stderr)
        assert re.search(r"root cause: rank 2 \(node 1, pid \d+\) exited with code 5", text)
        assert "exit status: 5" in text


def test_a_traceback_on_node_1_is_in_every_launchers_report(tmp_path, launchers):
    boom = script(tmp_path, "boom.py", """\
        import os


        def load():
            if os.environ["RANK"] == "3":
                raise ValueError("the data shard is empty")


        load()
    """)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "-n", "2", boom)
    node0 = launchers.node("node0", port, 2, 0, "-n", "2", boom)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [1, 1], launchers.describe()
    for launcher in (node0, node1):
        text = report(launcher.stderr)
        assert re.search(r"root cause: rank 3 \(node 1, pid \d+\) raised ValueError: "
                         r"the data shard is empty", text), launcher.describe()
        assert 'boom.py", line 6, in load' in text, launcher.describe()


# -- c10d: node ranks in the order of joining ---------------------------------------------


def c10d(launchers: Launchers, name: str, port: int, nnodes: str, *args: str) -> Launcher:
    return launchers.start(name, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           f"127.0.0.1:{port}", "--nnodes", nnodes, *args)


def test_c10d_launchers_get_node_ranks_in_joining_order_up_to_max(tmp_path, launchers):
    show = script(tmp_path, "show.py", SHOW_ENV)
    port = free_port()
    # a long last call: the attempt must start as soon as the MAX-th node joins
    conf = ("--rdzv-conf", "last_call_timeout=30")
    first = c10d(launchers, "first", port, "2:3", *conf, "-n", "1", show)
    assert helpers.wait_until(lambda: first.listening_on(port) or first.returncode is not None,
                              START_TIMEOUT, 0.05), launchers.describe()
    assert first.returncode is None, launchers.describe()  # the first to bind hosts
    others = [c10d(launchers, name, port, "2:3", *conf, "-n", "1", show)
              for name in ("second", "third")]
    assert launchers.wait(first, *others, timeout=20) == [0, 0, 0], launchers.describe()

    seen = {}
    for launcher in (first, *others):
        shown = launcher.ranks()
        assert len(shown) == 1, launcher.describe()
        (rank, lines), = shown.items()
        match = re.fullmatch(r"rank=(\d) world=3 node=(\d) group=(\d) local=0 run_id=\S+",
                             lines[0])
        assert match and len(lines) == 1, launcher.describe()
        assert int(match.group(1)) == int(match.group(2)) == int(match.group(3)) == rank
        seen[launcher.name] = rank
    assert seen["first"] == 0  # the host is node 0
    assert sorted(seen.values()) == [0, 1, 2]


def test_c10d_starts_with_min_nodes_once_the_last_call_passed(tmp_path, launchers):
    show = script(tmp_path, "show.py", SHOW_ENV)
    port = free_port()
    pair = [c10d(launchers, name, port, "2:3", "--rdzv-conf", "last_call_timeout=1", "-n",
                 "2", show) for name in ("a", "b")]
    assert launchers.wait(*pair, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()
    ranks = {}
    for launcher in pair:
        for rank, lines in launcher.ranks().items():
            node = rank // 2
            assert re.fullmatch(rf"rank={rank} world=4 node={node} group={node} "
                                rf"local={rank % 2} run_id=\S+", lines[0]), launcher.describe()
            ranks[rank] = launcher.name
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[0] == ranks[1] != ranks[2] == ranks[3]  # one launcher's ranks per node


# -- joining ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rendezvous", "expected"),
    [(["--nnodes", "3", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
       "{port}"],
      "root cause: the job could not start: node ranks 1, 2 never joined (joined: node 0 "
      "from {host}) within 1 s"),
     (["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}"],
      "root cause: the job could not start: 1 more node needed for the minimum of 2 (joined: "
      "{host}) within 1 s"),
     (["--nnodes", "3", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
       "{port}"],
      "phalanx run: no launcher hosts the job at 127.0.0.1:{port}")],
    ids=["static-host", "c10d-host", "static-member"],
)
def test_a_join_that_never_completes_fails_after_the_join_timeout(tmp_path, launchers,
                                                                  rendezvous, expected):
    show = script(tmp_path, "show.py", SHOW_ENV)
    port = free_port()
    args = [arg.format(port=port) for arg in rendezvous]
    began = time.monotonic()
    alone = launchers.start("alone", *args, "--rdzv-conf", "join_timeout=1", "-n", "1", show)
    assert launchers.wait(alone, timeout=STOP_WITHIN) == [1], launchers.describe()
    assert time.monotonic() - began < 10
    assert expected.format(port=port, host=socket.gethostname()) in alone.stderr, \
        alone.describe()
    assert not list(tmp_path.glob("ran-*"))  # no rank ran


def test_a_second_launcher_for_a_taken_node_rank_is_refused_and_the_job_goes_on(tmp_path,
                                                                                launchers):
    wait = script(tmp_path, "wait.py", WAIT_FOR_GO)
    port = free_port()
    node0 = launchers.node("node0", port, 2, 0, "-n", "1", wait)
    node1 = launchers.node("node1", port, 2, 1, "-n", "1", wait)
    pids = launchers.rank_pids(2)

    again1 = launchers.node("again1", port, 2, 1, "-n", "1", wait)
    assert launchers.wait(again1, timeout=STOP_WITHIN) == [1], launchers.describe()
    assert (f"phalanx run: the job at 127.0.0.1:{port} refused this launcher: node rank 1 "
            f"has already joined (from {socket.gethostname()})") in again1.stderr, \
        again1.describe()
    again0 = launchers.node("again0", port, 2, 0, "-n", "1", wait)
    assert launchers.wait(again0, timeout=STOP_WITHIN) == [1], launchers.describe()
    assert f"node 0 cannot host the job at 127.0.0.1:{port}" in again0.stderr, \
        again0.describe()

    assert node0.returncode is None and node1.returncode is None, launchers.describe()
    (tmp_path / "go").touch()
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()
    assert [sorted(node0.ranks()), sorted(node1.ranks())] == [[0], [1]]
    assert sorted(p.name for p in tmp_path.glob("pid-*")) == ["pid-0", "pid-1"]
    assert_gone(pids.values(), launchers)


def test_a_launcher_with_another_rdzv_id_is_refused_naming_both(tmp_path, launchers):
    wait = script(tmp_path, "wait.py", WAIT_FOR_GO)
    (tmp_path / "go").touch()
    port = free_port()
    node0 = launchers.node("node0", port, 2, 0, "--rdzv-id", "job-a", "-n", "1", wait)
    stranger = launchers.node("stranger", port, 2, 1, "--rdzv-id", "job-b", "-n", "1", wait)
    assert launchers.wait(stranger, timeout=STOP_WITHIN) == [1], launchers.describe()
    assert ("refused this launcher: this job's run id is 'job-a', not 'job-b' (--rdzv-id)"
            in stranger.stderr), stranger.describe()
    assert node0.returncode is None, launchers.describe()  # still waiting for its node 1

    node1 = launchers.node("node1", port, 2, 1, "--rdzv-id", "job-a", "-n", "1", wait)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()
    assert node0.ranks() == {0: ["rank 0 done run_id=job-a"]}
    assert node1.ranks() == {1: ["rank 1 done run_id=job-a"]}


# -- launchers gone or stopped ------------------------------------------------------------


def test_when_node_0s_launcher_is_killed_the_other_node_stops(tmp_path, launchers):
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "-n", "2", sleeper)
    node0 = launchers.node("node0", port, 2, 0, "-n", "2", sleeper)
    pids = launchers.rank_pids(4)
    node0_processes = launchers.tree(node0)  # its ranks, and what keeps them

    killed = time.monotonic()
    node0.proc.kill()
    assert launchers.wait(node0, timeout=10) == [-signal.SIGKILL]
    assert launchers.wait(node1, timeout=STOP_WITHIN) == [1], launchers.describe()
    assert time.monotonic() - killed < STOP_WITHIN
    assert "phalanx run: lost the job's host (node 0's launcher at 127.0.0.1:" \
        in node1.stderr, node1.describe()
    assert_gone([*pids.values(), *node0_processes], launchers)


def test_sigint_to_one_launcher_stops_every_node_naming_that_node(tmp_path, launchers):
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "-n", "2", sleeper)
    node0 = launchers.node("node0", port, 2, 0, "-n", "2", sleeper)
    pids = launchers.rank_pids(4)

    node1.proc.send_signal(signal.SIGINT)
    statuses = launchers.wait(node0, node1, timeout=STOP_WITHIN)
    assert statuses[1] == 128 + signal.SIGINT, launchers.describe()
    assert statuses[0] != 0, launchers.describe()
    assert "phalanx run: stopped by SIGINT" in node1.stderr, node1.describe()
    assert "root cause: node 1 was stopped: its launcher got SIGINT" in report(node0.stderr), \
        node0.describe()
    assert_gone(pids.values(), launchers)


# -- logs ---------------------------------------------------------------------------------


def test_each_node_logs_its_ranks_under_their_world_ranks(tmp_path, launchers):
    talk = script(tmp_path, "talk.py", """\
        import os
        import sys

        rank = os.environ["RANK"]
        print(f"out of rank {rank}")
        print(f"err of rank {rank}", file=sys.stderr)
    """)
    port = free_port()
    node1 = launchers.node("node1", port, 2, 1, "--log-dir", "logs1", "-n", "2", talk)
    node0 = launchers.node("node0", port, 2, 0, "--log-dir", "logs0", "-n", "2", talk)
    assert launchers.wait(node0, node1, timeout=RUN_TIMEOUT) == [0, 0], launchers.describe()
    for node, directory in enumerate((tmp_path / "logs0", tmp_path / "logs1")):
        mine = (2 * node, 2 * node + 1)
        assert sorted(p.name for p in directory.glob("rank-*")) == sorted(
            f"rank-{rank}.{stream}.log" for rank in mine for stream in ("stdout", "stderr"))
        for rank in mine:
            assert (directory / f"rank-{rank}.stdout.log").read_text() == f"out of rank {rank}\n"
            assert (directory / f"rank-{rank}.stderr.log").read_text() == f"err of rank {rank}\n"


def test_a_c10d_node_joining_a_running_world_below_max_re_forms_it(tmp_path, launchers):
    """As torchrun's agents: the running ranks stop (no restart spent) and every node
    starts again in a world that includes the newcomer."""
    sleeper = script(tmp_path, "sleeper.py", SLEEPER)
    port = free_port()
    first = [c10d(launchers, name, port, "2:3", "--rdzv-conf", "last_call_timeout=0.5",
                  "-n", "1", sleeper) for name in ("a", "b")]
    before = launchers.rank_pids(2)
    for rank in before:
        (tmp_path / f"pid-{rank}").unlink()
    late = c10d(launchers, "c", port, "2:3", "-n", "1", sleeper)
    after = launchers.rank_pids(3)
    assert not set(before.values()) & set(after.values())  # every rank started again
    for launcher in (*first, late):
        assert launcher.returncode is None, launcher.describe()
    for launcher in first:
        assert "a node joined; restarting every node as 3 nodes" in launcher.stderr
    assert "rank 2 sleeping" in late.stdout, late.describe()
