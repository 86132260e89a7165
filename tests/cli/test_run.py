"""End-to-end tests of the ``phalanx`` command: the real launcher, run in a subprocess.

User scripts are written to ``tmp_path``, which is also the launcher's working directory.
Where the tests need every rank at the same point (so that their identical lines collapse,
or so that every rank is known to be running before one fails), the scripts use
``phx_barrier.barrier()``: each rank writes its pid to a file and waits (bounded) for the
other ranks' files. The pid files also tell the tests which worker processes must be gone
once the launcher ended: workers are grandchildren of the test process, so the suite-wide
leftover check cannot see them once the launcher has exited.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import helpers

PHALANX = [sys.executable, "-m", "phalanx"]
RUN_TIMEOUT = 60.0  # seconds for one launcher run, however loaded the machine
READY_TIMEOUT = 30.0  # seconds for every rank of a Popen'ed launcher to report ready
EXIT_TIMEOUT = 20.0  # seconds for a signalled launcher to exit

BARRIER = '''\
"""Test helper: wait until every rank got here; leaves NAME-RESTART-RANK.pid files."""
import os
import time


def barrier(name="barrier", timeout=30.0):
    rank = os.environ["RANK"]
    world = int(os.environ["WORLD_SIZE"])
    restart = os.environ.get("PHALANX_RESTART_COUNT", "0")
    path = f"{name}-{restart}-{rank}.pid"
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f"{name}-{restart}-{r}.pid") for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not reach {name!r}")
        time.sleep(0.005)
'''

_PREFIX = re.compile(r"^\[ranks? ([0-9,\-]+)\] ?(.*)$")


# -- helpers ------------------------------------------------------------------------------


def launcher_env(**overrides: str | None) -> dict[str, str]:
    """The test's environment with the progress bar off; ``NAME=None`` removes NAME."""
    env = {**os.environ, "PHALANX_PROGRESS": "0"}
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def write(directory: Path, name: str, source: str) -> Path:
    """Write a (dedented) user file, and the barrier module next to it."""
    (directory / "phx_barrier.py").write_text(BARRIER)
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def phalanx(cwd: Path, *args: str, env: dict[str, str] | None = None,
            command: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the ``phalanx`` command to completion (bounded)."""
    return subprocess.run(
        [*(command or PHALANX), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=cwd,
        env=env or launcher_env(),
    )


def describe(result: subprocess.CompletedProcess) -> str:
    return (f"exit status {result.returncode}\n--- stdout\n{result.stdout}"
            f"--- stderr\n{result.stderr}")


def _ranks(spec: str) -> set[int]:
    ranks: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def prefixed(output: str) -> list[tuple[set[int], str]]:
    """The ``[rank N] text`` / ``[ranks 0-2] text`` lines of the launcher's output."""
    lines = []
    for line in output.splitlines():
        match = _PREFIX.match(line)
        if match:
            lines.append((_ranks(match.group(1)), match.group(2)))
    return lines


def ranks_saying(output: str, text: str) -> list[int]:
    """Every rank that wrote the line ``text`` (once per line shown, collapsed or not)."""
    return sorted(r for ranks, line in prefixed(output) if line == text for r in ranks)


def barrier_pids(directory: Path, name: str = "barrier") -> list[int]:
    return [int(p.read_text()) for p in sorted(directory.glob(f"{name}-*.pid"))]


def assert_gone(pids: list[int]) -> None:
    assert pids, "no worker pid was recorded"
    helpers.wait_dead(pids, timeout=5.0)
    alive = [p for p in pids if helpers.pid_alive(p)]
    for pid in alive:
        helpers.kill_quietly(pid, signal.SIGKILL)
    assert not alive, f"worker processes still running after the launcher ended: {alive}"


def report_lines(stderr: str) -> list[str]:
    """The root-cause report: the lines between its two rules."""
    lines = stderr.splitlines()
    rules = [i for i, line in enumerate(lines) if line == "=" * 72]
    assert len(rules) == 2, f"expected one root-cause report in:\n{stderr}"
    return lines[rules[0] + 1:rules[1]]


# -- help and version ---------------------------------------------------------------------


def test_help_lists_every_option_and_the_exit_statuses(tmp_path):
    script = Path(sys.executable).with_name("phalanx")
    if not script.exists():
        pytest.skip(f"no phalanx console script next to {sys.executable}")
    top = phalanx(tmp_path, "--help", command=[str(script)])
    assert top.returncode == 0, describe(top)
    assert "usage: phalanx" in top.stdout
    assert "run a script or module on every rank" in top.stdout
    assert top.stderr == ""

    run = phalanx(tmp_path, "run", "--help", command=[str(script)])
    assert run.returncode == 0, describe(run)
    text = run.stdout
    assert text.startswith("usage: phalanx run")
    for option in ("-n N", "--nproc-per-node", "--nodes", "--framework", "--gpus-per-worker",
                   "--max-restarts", "--log-dir", "--ranks", "--no-collapse", "--grace",
                   "--start-timeout", "-m, --module", "script.py | module"):
        assert option in text, f"{option} missing from the help:\n{text}"
    for framework in ("spmd", "torch", "jax", "tensorflow", "ray", "monarch"):
        assert framework in text
    assert "exit status:" in text
    for status in ("128+S", "bad command line", "root-cause report", "SIGKILL"):
        assert status in text, f"{status} missing from the exit status section:\n{text}"
    assert "examples:" in text

    bare = phalanx(tmp_path, command=[str(script)])
    assert bare.returncode == 2, describe(bare)
    assert "usage: phalanx" in bare.stderr


def test_version(tmp_path):
    import phalanx as package

    result = phalanx(tmp_path, "--version")
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == f"phalanx {package.__version__}"


# -- successful runs ----------------------------------------------------------------------

SHOW_ENV = """\
import os
import sys

from phx_barrier import barrier

e = os.environ
print(f"rank {e['RANK']} world {e['WORLD_SIZE']} local {e['LOCAL_RANK']} "
      f"local_world {e['LOCAL_WORLD_SIZE']} node {e['NODE_RANK']}")
barrier()
print(f"common argv={sys.argv[1:]!r} name={__name__} omp={e.get('OMP_NUM_THREADS')}")
"""


@pytest.mark.parametrize(("omp", "expected"), [(None, "1"), ("3", "3")])
def test_every_rank_runs_the_script_with_its_environment_and_args(tmp_path, omp, expected):
    write(tmp_path, "ok.py", SHOW_ENV)
    result = phalanx(tmp_path, "run", "-n", "3", "ok.py", "--lr", "0.1",
                     env=launcher_env(OMP_NUM_THREADS=omp))
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    for rank in range(3):
        assert f"[rank {rank}] rank {rank} world 3 local {rank} local_world 3 node 0" in lines, (
            describe(result))
    common = f"common argv=['--lr', '0.1'] name=__main__ omp={expected}"
    # Identical lines of all ranks (printed together thanks to the barrier) show once.
    assert [line for line in lines if common in line] == [f"[ranks 0-2] {common}"], (
        describe(result))
    assert len(barrier_pids(tmp_path)) == 3
    assert_gone(barrier_pids(tmp_path))
    assert "phalanx run failed" not in result.stderr


def test_nodes_give_each_rank_its_node_and_local_rank(tmp_path):
    write(tmp_path, "ok.py", SHOW_ENV)
    result = phalanx(tmp_path, "run", "--nodes", "2", "-n", "2", "ok.py",
                     env=launcher_env(OMP_NUM_THREADS=None))
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    for rank in range(4):
        expected = (f"[rank {rank}] rank {rank} world 4 local {rank % 2} local_world 2 "
                    f"node {rank // 2}")
        assert expected in lines, describe(result)
    assert "[ranks 0-3] common argv=[] name=__main__ omp=1" in lines, describe(result)


def test_arguments_after_the_script_go_to_the_script(tmp_path):
    write(tmp_path, "args.py", """\
        import sys
        print("argv", sys.argv[1:])
    """)
    result = phalanx(tmp_path, "run", "args.py", "-n", "5", "--help", "--", "-m")
    assert result.returncode == 0, describe(result)
    assert result.stdout.splitlines() == ["[rank 0] argv ['-n', '5', '--help', '--', '-m']"], (
        describe(result))


@pytest.mark.parametrize("module", ["mymod", "mypkg.train"])
def test_module_runs_as_main_with_its_args(tmp_path, module):
    source = """\
        import os
        import sys

        from phx_barrier import barrier

        barrier()
        print(f"module={MODULE} name={__name__} argv={sys.argv[1:]!r}")
    """
    if module == "mypkg.train":  # a relative import works: it runs as part of its package
        write(tmp_path, "mypkg/__init__.py", "")
        write(tmp_path, "mypkg/helper.py", "MODULE = 'mypkg.train'\n")
        write(tmp_path, "mypkg/train.py", "from .helper import MODULE\n" + textwrap.dedent(source))
    else:
        write(tmp_path, "mymod.py", "MODULE = 'mymod'\n" + textwrap.dedent(source))
    result = phalanx(tmp_path, "run", "-n", "2", "-m", module, "arg1", "--flag")
    assert result.returncode == 0, describe(result)
    line = f"module={module} name=__main__ argv=['arg1', '--flag']"
    assert result.stdout.splitlines() == [f"[ranks 0-1] {line}"], describe(result)


# -- failures -----------------------------------------------------------------------------

RAISE_LINE = '        raise ValueError("bad value 42")'
FAIL = f"""\
import os
import time

from phx_barrier import barrier


def step():
    barrier()
    if os.environ["RANK"] == "1":
{RAISE_LINE}
    time.sleep(30)


step()
"""


def test_exception_in_one_rank_stops_all_and_reports_its_traceback(tmp_path):
    source = FAIL
    path = write(tmp_path, "fail.py", source)
    line = source.splitlines().index(RAISE_LINE) + 1
    start = time.monotonic()
    result = phalanx(tmp_path, "run", "-n", "3", "fail.py")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, describe(result)
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to stop the other ranks"
    pids = barrier_pids(tmp_path)
    assert len(pids) == 3
    report = report_lines(result.stderr)
    assert report[0] == "phalanx run failed"
    assert report[1] == (
        f"root cause: rank 1 (node 0, pid {pids[1]}) raised ValueError: bad value 42")
    assert report[2] == "exit status: 1"
    traceback = "\n".join(report[3:])
    assert "Traceback (most recent call last):" in traceback
    assert f'File "{path}", line {line}, in step' in traceback
    assert RAISE_LINE.strip() in traceback
    assert traceback.rstrip().endswith("ValueError: bad value 42")
    assert_gone(pids)


def test_a_rank_exit_code_fails_the_run_and_is_the_status_with_exit_code_rank(tmp_path):
    write(tmp_path, "exit3.py", """\
        import os
        import sys
        import time

        from phx_barrier import barrier

        barrier()
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(30)
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "exit3.py")
    assert result.returncode == 1, describe(result)  # torchrun's status for any failure
    pids = barrier_pids(tmp_path)
    report = report_lines(result.stderr)
    assert report[1] == f"root cause: rank 1 (node 0, pid {pids[1]}) exited with code 3"
    assert report[2] == "exit status: 1"
    assert_gone(pids)
    own = phalanx(tmp_path, "run", "-n", "2", "--exit-code", "rank", "exit3.py")
    assert own.returncode == 3, describe(own)
    assert report_lines(own.stderr)[2] == "exit status: 3"


@pytest.mark.parametrize(("code", "status"), [("-1", 255), ("256", 1), ("True", 1)])
def test_exit_codes_outside_0_255_still_fail_with_a_shell_status(tmp_path, code, status):
    write(tmp_path, "odd_exit.py", f"""\
        import os
        import sys

        if os.environ["RANK"] == "1":
            sys.exit({code})
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "--exit-code", "rank", "odd_exit.py")
    assert result.returncode == status, describe(result)
    assert report_lines(result.stderr)[2] == f"exit status: {status}"


def test_sys_exit_with_a_message_prints_it_and_fails(tmp_path):
    write(tmp_path, "exitmsg.py", """\
        import os
        import sys

        if os.environ["RANK"] == "0":
            sys.exit("fatal: no config")
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "exitmsg.py")
    assert result.returncode == 1, describe(result)
    assert "[rank 0] fatal: no config" in result.stderr.splitlines(), describe(result)
    assert "root cause: rank 0" in result.stderr
    assert "exited with code 1" in result.stderr


def test_rank_killed_by_a_signal_reports_it_and_exit_code_rank_gives_128_plus_it(tmp_path):
    write(tmp_path, "suicide.py", """\
        import os
        import signal
        import sys
        import time

        from phx_barrier import barrier

        barrier()
        if os.environ["RANK"] == "0":
            print("about to die", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "--exit-code", "rank", "suicide.py")
    assert result.returncode == 137, describe(result)
    pids = barrier_pids(tmp_path)
    report = report_lines(result.stderr)
    assert report[1].startswith(f"root cause: rank 0 (node 0, pid {pids[0]}) killed by SIGKILL")
    assert report[2] == "exit status: 137"
    assert "last lines of its stderr:" in report
    assert "  about to die" in report
    assert_gone(pids)


RESTARTS = """\
import os
import sys

count = os.environ["PHALANX_RESTART_COUNT"]
print(f"restart {count} torchelastic {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
if os.environ["RANK"] == "1" and count != "2":
    sys.exit(5)
"""


def test_max_restarts_restarts_the_group_until_it_succeeds(tmp_path):
    write(tmp_path, "flaky.py", RESTARTS)
    result = phalanx(tmp_path, "run", "-n", "2", "--max-restarts", "2", "flaky.py")
    assert result.returncode == 0, describe(result)
    for count in range(3):  # the whole group ran again, rank 0 included
        assert ranks_saying(result.stdout, f"restart {count} torchelastic {count}") == [0, 1], (
            describe(result))
    assert ranks_saying(result.stdout, "restart 3 torchelastic 3") == []
    assert "restarting the group (restart 1 of 2)" in result.stderr
    assert "restarting the group (restart 2 of 2)" in result.stderr
    assert "phalanx run failed" not in result.stderr


def test_max_restarts_exhausted_reports_the_attempts(tmp_path):
    write(tmp_path, "flaky.py", RESTARTS)
    result = phalanx(tmp_path, "run", "-n", "2", "--max-restarts", "1", "--exit-code", "rank",
                     "flaky.py")
    assert result.returncode == 5, describe(result)
    assert ranks_saying(result.stdout, "restart 1 torchelastic 1") == [0, 1]
    assert ranks_saying(result.stdout, "restart 2 torchelastic 2") == []
    report = report_lines(result.stderr)
    assert report[0] == "phalanx run failed after 2 attempts"
    assert re.fullmatch(r"root cause: rank 1 \(node 0, pid \d+\) exited with code 5", report[1])
    assert report[2] == "exit status: 5"


# -- signals ------------------------------------------------------------------------------

SLEEPER = """\
import os
import time

try:
    print("ready", os.getpid(), flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    raise
"""

IGNORER = """\
import os
import signal
import time

signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""


class Launcher:
    """A launcher started in the background, its output going to files in ``directory``."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out_path = directory / "launcher.stdout"
        self.err_path = directory / "launcher.stderr"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [*PHALANX, "run", *args], stdout=out, stderr=err, cwd=directory,
                env=env or launcher_env(), start_new_session=True,  # own group, as in a shell
            )
        self.pids: list[int] = []

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def describe(self) -> str:
        return (f"exit status {self.proc.returncode}\n--- stdout\n{self.stdout}"
                f"--- stderr\n{self.stderr}")

    def wait_ready(self, world: int) -> list[int]:
        """The workers' pids once every rank printed ``ready <pid>``."""
        def ready() -> bool:
            found = re.findall(r"^\[rank (\d+)\] ready (\d+)$", self.stdout, re.MULTILINE)
            self.pids = [int(pid) for _, pid in found]
            return len(found) == world or self.proc.poll() is not None
        assert helpers.wait_until(ready, READY_TIMEOUT, interval=0.02), (
            f"the ranks did not all start within {READY_TIMEOUT} s\n{self.describe()}")
        assert len(self.pids) == world, f"the launcher ended early\n{self.describe()}"
        return self.pids

    def wait_stderr(self, text: str) -> None:
        assert helpers.wait_until(lambda: text in self.stderr, EXIT_TIMEOUT), (
            f"{text!r} not printed\n{self.describe()}")

    def wait(self) -> tuple[int, float]:
        """The exit status and how long it took to come."""
        start = time.monotonic()
        try:
            status = self.proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {EXIT_TIMEOUT} s\n{self.describe()}")
        return status, time.monotonic() - start

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids:
            helpers.kill_quietly(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
    launchers: list[Launcher] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(tmp_path, *args, env=env)
        launchers.append(launcher)
        return launcher

    yield start
    for launcher in launchers:
        launcher.cleanup()


@pytest.mark.parametrize("to_group", [False, True], ids=["kill", "ctrl-c"])
def test_sigint_interrupts_every_rank(tmp_path, launch, to_group):
    write(tmp_path, "sleeper.py", SLEEPER)
    launcher = launch("-n", "2", "sleeper.py")
    pids = launcher.wait_ready(2)
    if to_group:  # as a terminal does on Ctrl-C: the launcher's whole process group
        os.killpg(launcher.proc.pid, signal.SIGINT)
    else:
        launcher.proc.send_signal(signal.SIGINT)
    status, elapsed = launcher.wait()
    assert status == 130, launcher.describe()
    assert elapsed < 10, launcher.describe()
    assert ranks_saying(launcher.stdout, "interrupted") == [0, 1], launcher.describe()
    assert "got SIGINT, forwarded it to the running ranks" in launcher.stderr
    assert "stopped by SIGINT" in launcher.stderr
    assert "phalanx run failed" not in launcher.stderr
    assert_gone(pids)


def test_sigterm_terminates_every_rank(tmp_path, launch):
    write(tmp_path, "sleeper.py", SLEEPER)
    launcher = launch("-n", "2", "sleeper.py")
    pids = launcher.wait_ready(2)
    launcher.proc.send_signal(signal.SIGTERM)
    status, elapsed = launcher.wait()
    assert status == 143, launcher.describe()
    assert elapsed < 10, launcher.describe()
    assert "interrupted" not in launcher.stdout
    assert "got SIGTERM, forwarded it to the running ranks" in launcher.stderr
    assert "stopped by SIGTERM" in launcher.stderr
    assert "phalanx run failed" not in launcher.stderr
    assert_gone(pids)


def test_ranks_ignoring_sigint_are_killed_after_the_grace_period(tmp_path, launch):
    write(tmp_path, "ignorer.py", IGNORER)
    launcher = launch("-n", "2", "--grace", "1", "ignorer.py")
    pids = launcher.wait_ready(2)
    launcher.proc.send_signal(signal.SIGINT)
    status, elapsed = launcher.wait()
    assert status == 130, launcher.describe()
    assert elapsed < 8, f"{elapsed:.1f} s with --grace 1\n{launcher.describe()}"
    assert "(SIGKILL in 1 s)" in launcher.stderr
    assert_gone(pids)


def test_second_sigint_kills_at_once(tmp_path, launch):
    write(tmp_path, "ignorer.py", IGNORER)
    launcher = launch("-n", "2", "--grace", "60", "ignorer.py")
    pids = launcher.wait_ready(2)
    launcher.proc.send_signal(signal.SIGINT)
    launcher.wait_stderr("got SIGINT, forwarded it to the running ranks (SIGKILL in 60 s)")
    launcher.proc.send_signal(signal.SIGINT)
    status, elapsed = launcher.wait()
    assert status == 130, launcher.describe()
    assert elapsed < 8, f"{elapsed:.1f} s after the second SIGINT\n{launcher.describe()}"
    assert_gone(pids)


def test_workers_die_with_a_killed_launcher(tmp_path, launch):
    write(tmp_path, "sleeper.py", SLEEPER)
    launcher = launch("-n", "2", "sleeper.py")
    pids = launcher.wait_ready(2)
    launcher.proc.kill()
    status, _ = launcher.wait()
    assert status == -signal.SIGKILL
    assert_gone(pids)


# -- output options -----------------------------------------------------------------------

OUTPUT = """\
import os
import sys

from phx_barrier import barrier

rank = os.environ["RANK"]
print(f"out {rank}", flush=True)
print(f"err {rank}", file=sys.stderr, flush=True)
barrier()
print("same line", flush=True)
"""


def assert_log_files(directory: Path, world: int) -> None:
    for rank in range(world):
        stdout = directory / f"rank-{rank}.stdout.log"
        stderr = directory / f"rank-{rank}.stderr.log"
        assert stdout.read_text() == f"out {rank}\nsame line\n"
        assert stderr.read_text() == f"err {rank}\n"
    assert len(list(directory.iterdir())) == 2 * world


def test_log_dir_holds_each_ranks_output_without_prefixes(tmp_path):
    write(tmp_path, "output.py", OUTPUT)
    result = phalanx(tmp_path, "run", "-n", "3", "--log-dir", "logs", "output.py")
    assert result.returncode == 0, describe(result)
    assert_log_files(tmp_path / "logs", 3)
    for rank in range(3):  # the console still shows everything
        assert f"[rank {rank}] out {rank}" in result.stdout.splitlines()
        assert f"[rank {rank}] err {rank}" in result.stderr.splitlines()
    # shown once per rank, collapsed when the three lines came within the window
    assert ranks_saying(result.stdout, "same line") == [0, 1, 2], describe(result)


def test_ranks_shows_only_those_ranks_but_logs_all(tmp_path):
    write(tmp_path, "output.py", OUTPUT)
    result = phalanx(tmp_path, "run", "-n", "3", "--ranks", "1", "--log-dir", "logs", "output.py")
    assert result.returncode == 0, describe(result)
    assert sorted(result.stdout.splitlines()) == ["[rank 1] out 1", "[rank 1] same line"], (
        describe(result))
    assert result.stderr.splitlines() == ["[rank 1] err 1"], describe(result)
    assert_log_files(tmp_path / "logs", 3)


def test_a_flood_of_output_arrives_whole_on_the_console_and_in_the_files(tmp_path):
    write(tmp_path, "flood.py", """\
        import os

        for i in range(10000):
            print(os.environ["RANK"], i)
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "--log-dir", "logs", "flood.py")
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    for rank in range(2):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] {rank} {i}" for i in range(10000)]
        logged = (tmp_path / "logs" / f"rank-{rank}.stdout.log").read_text().splitlines()
        assert logged == [f"{rank} {i}" for i in range(10000)]


def test_no_collapse_shows_identical_lines_once_per_rank(tmp_path):
    write(tmp_path, "output.py", OUTPUT)
    result = phalanx(tmp_path, "run", "-n", "3", "--no-collapse", "output.py")
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert sorted(line for line in lines if line.endswith("same line")) == [
        "[rank 0] same line", "[rank 1] same line", "[rank 2] same line"], describe(result)
    assert not any(line.startswith("[ranks") for line in lines), describe(result)


# -- bad command lines --------------------------------------------------------------------

MARKER = """\
import os
open(f"started-{os.environ['RANK']}", "w").close()
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nosuch.py"], "phalanx run: no such file: 'nosuch.py'"),
        (["-m", "no_such_module_xyz"], "phalanx run: no module named 'no_such_module_xyz'"),
        (["-n", "0", "marker.py"],
         "argument -n/--nproc-per-node/--nproc_per_node: expected a positive integer, 'auto', "
         "'cpu' or 'gpu', got '0'"),
        (["-n", "lots", "marker.py"],
         "argument -n/--nproc-per-node/--nproc_per_node: expected a positive integer, 'auto', "
         "'cpu' or 'gpu', got 'lots'"),
        (["--ranks", "x", "marker.py"],
         "argument --ranks: expected ranks such as 0,2 or 0-3, got 'x'"),
        (["--framework", "nosuch", "marker.py"], "argument --framework: invalid choice"),
        (["--framework", "tensorflow", "-n", "2", "marker.py"],
         "framework='tensorflow' runs one worker process per node"),
        (["--nodes", "0", "marker.py"], "argument --nodes: expected a positive integer"),
        (["--grace", "-1", "marker.py"], "argument --grace: expected a number of seconds >= 0"),
        (["-n", "2", "--ranks", "5", "marker.py"], "names ranks [5] outside 0..1"),
        (["marker.py", "--max-restarts"], None),  # fine: the script's own argument
    ],
    ids=["missing-script", "missing-module", "n-zero", "n-word", "ranks-word",
         "unknown-framework", "tensorflow-two-per-node", "nodes-zero", "grace-negative",
         "ranks-outside", "script-option"],
)
def test_bad_command_line_exits_2_without_starting_anything(tmp_path, args, message):
    write(tmp_path, "marker.py", MARKER)
    result = phalanx(tmp_path, "run", *args)
    if message is None:  # the control case: the same script does start
        assert result.returncode == 0, describe(result)
        assert (tmp_path / "started-0").exists()
        return
    assert result.returncode == 2, describe(result)
    assert message in result.stderr, describe(result)
    if "tensorflow" in args:
        assert "procs_per_node" in result.stderr
    if "nosuch" in args:
        assert "nosuch" in result.stderr
    assert result.stdout == ""
    assert not list(tmp_path.glob("started-*")), "a rank started"
    assert "Traceback" not in result.stderr


# -- frameworks ---------------------------------------------------------------------------


@pytest.mark.slow
def test_torch_framework_all_reduce(tmp_path):
    helpers.requires("torch")
    write(tmp_path, "allreduce.py", """\
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g}")
        dist.destroy_process_group()
    """)
    result = phalanx(tmp_path, "run", "--framework", "torch", "-n", "2", "allreduce.py")
    assert result.returncode == 0, describe(result)
    for rank in range(2):
        assert f"[rank {rank}] rank {rank} of 2: sum 3" in result.stdout.splitlines(), (
            describe(result))



# -- programs that end in unusual ways, signals at awkward moments ---------------------------


def test_a_rank_ending_with_os_exit_0_has_succeeded(tmp_path):
    write(tmp_path, "quick_exit.py", """\
        import os
        import time

        if os.environ["RANK"] == "0":
            with open("rank0.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace("rank0.tmp", "rank0.pid")
        else:  # still working when rank 0 is gone (waited for, 10 s at most)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    with open("rank0.pid") as f:
                        os.kill(int(f.read()), 0)
                except FileNotFoundError:
                    pass
                except ProcessLookupError:
                    break
                time.sleep(0.02)
            print("rank 1 finished", flush=True)
        os._exit(0)  # skipping interpreter teardown, as jobs do to avoid slow exits
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "--max-restarts", "1", "quick_exit.py")
    assert result.returncode == 0, describe(result)
    assert "[rank 1] rank 1 finished" in result.stdout.splitlines(), describe(result)
    assert "restarting" not in result.stderr and "failed" not in result.stderr


def test_threads_the_program_left_running_are_waited_for(tmp_path):
    write(tmp_path, "upload.py", """\
        import threading
        import time

        def upload():
            time.sleep(0.3)  # the main thread has long returned by then
            with open("uploaded", "w") as f:
                f.write("done")

        threading.Thread(target=upload).start()  # not a daemon: Python waits for it
    """)
    result = phalanx(tmp_path, "run", "upload.py")
    assert result.returncode == 0, describe(result)
    assert (tmp_path / "uploaded").read_text() == "done"


def test_a_thread_pool_left_open_does_not_keep_the_rank_alive(tmp_path):
    write(tmp_path, "pool.py", """\
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(2)  # never shut down, as scripts often leave it

        def work():
            return 42

        print("result", pool.submit(work).result())
    """)
    result = phalanx(tmp_path, "run", "-n", "2", "pool.py")
    assert result.returncode == 0, describe(result)
    assert "[ranks 0-1] result 42" in result.stdout.splitlines(), describe(result)


@helpers.needs("ray")  # `phalanx run --framework ray` checks that the package is installed
def test_a_signal_while_the_group_starts_stops_the_start(tmp_path, launch):
    # A fake `ray` on PATH stands in for a framework service that is slow to come up.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ray"
    fake.write_text("#!/bin/sh\necho $$ > fake-ray.pid\nexec sleep 60\n")
    fake.chmod(0o755)
    write(tmp_path, "never.py", "print('must not run')\n")
    env = launcher_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    launcher = launch("--framework", "ray", "--start-timeout", "60", "never.py", env=env)
    pid_file = tmp_path / "fake-ray.pid"
    assert helpers.wait_until(pid_file.exists, READY_TIMEOUT), launcher.describe()
    fake_pid = int(pid_file.read_text())
    launcher.proc.send_signal(signal.SIGINT)
    status, elapsed = launcher.wait()
    assert status == 130, launcher.describe()
    assert elapsed < 10, launcher.describe()
    assert "must not run" not in launcher.stdout
    assert_gone([fake_pid])


def test_ranks_that_finished_are_not_interrupted(tmp_path, launch):
    write(tmp_path, "uneven.py", """\
        import os
        import time

        print("ready", os.getpid(), flush=True)
        if os.environ["RANK"] == "1":
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                raise
    """)
    launcher = launch("-n", "2", "uneven.py")
    pids = launcher.wait_ready(2)
    time.sleep(0.5)  # rank 0's program has returned; its worker idles
    launcher.proc.send_signal(signal.SIGINT)
    status, _ = launcher.wait()
    assert status == 130, launcher.describe()
    assert ranks_saying(launcher.stdout, "interrupted") == [1], launcher.describe()
    assert "Traceback" not in launcher.stdout + launcher.stderr, launcher.describe()
    assert_gone(pids)
