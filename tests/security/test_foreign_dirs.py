"""Directories phalanx reads trusted content from, made first by another local user.

A probe, as another user of the machine, made the directory a victim then gave phalanx:

- ``phalanx agent --store DIR``: it planted a file in ``DIR/blobs/`` under the hash of the
  victim's module, and the agent, counting a blob as held by its name alone, built the
  victim's code tree from it: the victim's rank ran the probe's code as the victim;
- ``SlurmBackend(state_dir=DIR)``: the controller dialled an agent address the probe wrote,
  a link at an agent's log had the victim's file overwritten, and a FIFO where the
  controller reads blocked it 15 s past its ``start_timeout`` of 3.

Now (:mod:`phalanx.output.ownfiles`): a store or ``state_dir`` is used only when it is a
directory of the user's that no one else can write to (refused otherwise, naming its path,
owner and mode); a blob is hashed again before a tree is built from it (a bad one is
removed and sent again, or refused naming it); the files of a job's directory are opened
without following links or blocking. Each test would fail on the code before (planted code
run, a victim's file written, a wait that never ends).

Another user's path needs root to make (``os.chown`` to ``nobody``); those tests are
skipped otherwise. No test here starts Slurm: the job's own steps are called directly
(with no ``sbatch`` on ``PATH``, so that nothing is ever submitted). Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import phalanx as px
from phalanx.backends.cluster.codesync import Store, version_of
from phalanx.backends.cluster.slurmjob import JobRequest, SlurmJob
from phalanx.errors import PhalanxError
from tests import helpers
from tests.agentcluster import free_port, terminate

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="making a path of another user needs root")
AGENT_HOST = "127.0.0.41"  # an address no other test module's agents use
BOUND = 10.0  # seconds: what must not block returns within this, or the test fails
VICTIM_WORDS = "the victim's own words\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def theirs(path: Path, mode: int = 0o755) -> Path:
    """``path`` made a directory of another user (``nobody``), ``mode``."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.chown(path, NOBODY, NOBODY)
    return path


def victim_file(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_WORDS)
    return victim


def bounded(fn: Callable[[], Any], fifos: list[Path]) -> BaseException | None:
    """Run ``fn`` on a thread; what it raised (None if it returned). It must end within
    BOUND s: if it blocks on one of ``fifos``, a writer opened and closed there lets it go
    (so that the thread ends), and the test fails."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(BOUND)
    if thread.is_alive():
        for fifo in fifos:  # a reader waits in open(): a writer lets it through, to EOF
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(BOUND)
        pytest.fail(f"blocked for {time.monotonic() - started:.0f} s on a FIFO")
    return outcome[0]


# ------------------------------------------------------------------------- the code store


@needs_root
def test_a_store_of_another_user_is_refused_naming_path_owner_and_mode(tmp_path):
    store = theirs(tmp_path / "store")
    with pytest.raises(ValueError) as info:
        Store(store)
    message = str(info.value)
    assert repr(str(store)) in message and "not to you" in message, message
    assert f"uid {NOBODY}" in message and "mode 0755" in message, message
    assert f"uid {os.geteuid()}" in message and "will not run code" in message, message
    assert list(store.iterdir()) == [], "something was made in a refused store"


@needs_root
@pytest.mark.parametrize("part", ["blobs", "trees"])
def test_a_stores_blobs_or_trees_of_another_user_is_refused(tmp_path, part):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    theirs(store / part)
    with pytest.raises(ValueError, match=f"uid {NOBODY}") as info:
        Store(store)
    assert repr(str(store / part)) in str(info.value)


@pytest.mark.parametrize(("bits", "who"), [(0o777, "everyone"), (0o1777, "everyone"),
                                           (0o770, "its group")])
def test_a_store_others_can_write_is_refused(tmp_path, bits, who):
    store = tmp_path / "store"
    store.mkdir()
    os.chmod(store, bits)
    with pytest.raises(ValueError, match=f"can be written by {who}") as info:
        Store(store)
    assert repr(str(store)) in str(info.value) and f"mode {bits:04o}" in str(info.value)
    assert list(store.iterdir()) == []


def test_a_link_at_the_store_is_refused_and_not_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "store"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        Store(link)
    assert list(real.iterdir()) == []


@needs_root
def test_a_store_given_away_after_the_agent_started_is_refused_at_its_next_use(tmp_path):
    store = Store(tmp_path / "store")
    data = b"x = 1\n"
    listing = [("m.py", sha(data), 0o644, len(data))]
    os.chown(store.root, NOBODY, NOBODY)
    for use in (lambda: store.missing(listing), lambda: store.tree(version_of(listing)),
                lambda: store.put(sha(data), data),
                lambda: store.build(version_of(listing), listing)):
        with pytest.raises(ValueError, match=f"uid {NOBODY}"):
            use()


def planted(store: Store, genuine: bytes, planted_text: bytes, owner: int | None) -> Path:
    """A file of ``planted_text`` at the name of ``genuine``'s hash in the store (owned by
    ``owner`` if given): what another user could leave there."""
    blob = store.blobs / sha(genuine)
    blob.write_bytes(planted_text)
    if owner is not None:
        os.chown(blob, owner, owner)
    return blob


GENUINE = b"def value():\n    return 1\n"
EVIL = b"def value():\n    return 'planted'\n"


@pytest.mark.parametrize("owner", ["mine", "nobody"])
def test_a_planted_blob_counts_as_missing_is_removed_and_the_tree_is_built_genuine(
        tmp_path, owner):
    if owner == "nobody" and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    store = Store(tmp_path / "store")
    blob = planted(store, GENUINE, EVIL, NOBODY if owner == "nobody" else None)
    listing = [("mod.py", sha(GENUINE), 0o644, len(GENUINE))]
    assert store.missing(listing) == [sha(GENUINE)]  # by its name alone it was "held"
    assert not blob.exists(), "the planted blob was kept"
    store.put(sha(GENUINE), GENUINE)
    tree = store.build(version_of(listing), listing)
    assert (tree / "mod.py").read_bytes() == GENUINE


def test_build_refuses_a_planted_blob_naming_it_and_removes_it(tmp_path):
    store = Store(tmp_path / "store")
    blob = planted(store, GENUINE, EVIL, None)
    listing = [("pkg/mod.py", sha(GENUINE), 0o644, len(GENUINE))]
    version = version_of(listing)
    with pytest.raises(ValueError) as info:
        store.build(version, listing)
    message = str(info.value)
    assert str(blob) in message and "pkg/mod.py" in message, message
    assert "does not match its hash" in message and "sends it again" in message, message
    assert store.tree(version) is None
    assert [p.name for p in store.trees.iterdir()] == []  # no staging left
    assert not blob.exists()
    assert store.missing(listing) == [sha(GENUINE)]


def test_a_link_at_a_blobs_name_is_not_followed_and_its_target_left_alone(tmp_path):
    store = Store(tmp_path / "store")
    victim = tmp_path / "genuine-elsewhere.py"
    victim.write_bytes(GENUINE)  # even with the right contents: not ours to run via a link
    blob = store.blobs / sha(GENUINE)
    blob.symlink_to(victim)
    listing = [("mod.py", sha(GENUINE), 0o644, len(GENUINE))]
    with pytest.raises(ValueError, match="symbolic link"):
        store.build(version_of(listing), listing)
    assert not os.path.lexists(blob) and victim.read_bytes() == GENUINE
    blob.symlink_to(victim)
    assert store.missing(listing) == [sha(GENUINE)]
    assert not os.path.lexists(blob) and victim.read_bytes() == GENUINE


def test_a_fifo_at_a_blobs_name_is_refused_without_blocking(tmp_path):
    store = Store(tmp_path / "store")
    fifo = store.blobs / sha(GENUINE)
    listing = [("mod.py", sha(GENUINE), 0o644, len(GENUINE))]
    os.mkfifo(fifo)
    assert bounded(lambda: store.missing(listing), [fifo]) is None
    assert not os.path.lexists(fifo)
    os.mkfifo(fifo)
    error = bounded(lambda: store.build(version_of(listing), listing), [fifo])
    assert isinstance(error, ValueError) and "not a regular file" in str(error), error


@needs_root
def test_a_tree_of_another_user_at_a_versions_name_is_not_run(tmp_path):
    store = Store(tmp_path / "store")
    listing = [("mod.py", sha(GENUINE), 0o644, len(GENUINE))]
    version = version_of(listing)
    (store.trees / version).mkdir()
    (store.trees / version / "mod.py").write_bytes(EVIL)
    os.chown(store.trees / version, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"uid {NOBODY}"):
        store.tree(version)
    with pytest.raises(ValueError, match="is not a directory of yours"):
        store.build(version, listing)


def test_a_version_that_is_a_path_is_refused(tmp_path):
    store = Store(tmp_path / "store")
    for version in ("../../x", "../" + "a" * 29, "/etc", "A" * 32):
        with pytest.raises(ValueError, match="not a code version"):
            store.tree(version)


# ------------------------------------------------------------ a real agent, a real group

WORK = '''\
from . import mod


class Worker:
    def value(self):
        return mod.value()
'''


def agent_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(helpers.REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.fixture
def token_file(tmp_path) -> str:
    return helpers.token_file(tmp_path)


@pytest.fixture
def package(tmp_path, monkeypatch) -> Iterator[tuple[Path, Path, type]]:
    """A package of the controller's, uniquely named, in ``tmp_path/code``: (code
    directory, its mod.py, the Worker class); importable here through sys.path."""
    name = f"guarded_{uuid.uuid4().hex[:10]}"
    code = tmp_path / "code"
    pkg = code / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_bytes(GENUINE)
    (pkg / "work.py").write_text(WORK)
    monkeypatch.syspath_prepend(str(code))
    try:
        yield code, pkg / "mod.py", importlib.import_module(f"{name}.work").Worker
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def start_agent(token_file: str, store: Path, **popen: Any) -> tuple[subprocess.Popen, str]:
    port = free_port(AGENT_HOST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "agent", "--host", AGENT_HOST, "--port", str(port),
         "--token-file", token_file, "--no-http", "--heartbeat-timeout", "10",
         "--store", str(store)],
        env=agent_env(), cwd=helpers.REPO, stdin=subprocess.DEVNULL, **popen)
    return proc, f"{AGENT_HOST}:{port}"


def test_a_real_agent_runs_the_shipped_code_not_a_blob_planted_under_its_hash(
        tmp_path, token_file, package):
    code, mod, worker = package
    store = Store(tmp_path / "store")  # the victim's own store, with a planted blob in it
    marker = tmp_path / "planted-code-ran"
    evil = f"open({str(marker)!r}, 'w').close()\n".encode() + EVIL
    blob = planted(store, mod.read_bytes(), evil, NOBODY if os.geteuid() == 0 else None)
    proc, address = start_agent(token_file, store.root)
    try:
        assert helpers.wait_until(lambda: proc.poll() is not None or _listening(address),
                                  20, interval=0.05)
        assert proc.poll() is None, "the agent exited"
        backend = px.ClusterBackend([address], token_file=token_file, sync=str(code))
        with px.WorkerGroup(worker, backend=backend, nodes=1, procs_per_node=1,
                            echo_output=False) as group:
            assert group.call("value") == [1]
        assert not marker.exists(), "the rank ran the planted code"
        assert blob.read_bytes() == mod.read_bytes()  # sent again, genuine
        assert os.stat(blob).st_uid == os.geteuid()
    finally:
        terminate([proc])


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


@needs_root
def test_a_real_agent_given_a_store_of_another_user_exits_saying_why(tmp_path, token_file):
    store = theirs(tmp_path / "store")
    proc, _ = start_agent(token_file, store, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        terminate([proc])
    assert proc.returncode == 1, stderr
    assert repr(str(store)) in stderr and f"uid {NOBODY}" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert list(store.iterdir()) == []


# ------------------------------------------------------------------- Slurm's state_dir


def job(state_dir: Path, **kwargs: Any) -> SlurmJob:
    """A job outside an allocation (nothing is submitted unless its start gets there)."""
    return SlurmJob(JobRequest(nodes=1), state_dir=str(state_dir), environ={}, **kwargs)


@pytest.fixture
def no_slurm_commands(tmp_path, monkeypatch) -> None:
    """No sbatch, srun or scontrol on PATH: whatever a test gets to, nothing reaches a
    Slurm (a test cluster of the session may be up)."""
    empty = tmp_path / "no-commands"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@needs_root
def test_a_state_dir_of_another_user_is_refused_before_anything_is_submitted(
        tmp_path, no_slurm_commands):
    state = theirs(tmp_path / "state")
    with pytest.raises(PhalanxError) as info:
        job(state).start()
    message = str(info.value)
    assert f"state_dir {str(state)!r}" in message and f"uid {NOBODY}" in message, message
    assert "not to you" in message and f"uid {os.geteuid()}" in message, message
    assert "will not read an agent address" in message, message
    assert list(state.iterdir()) == [], "a job directory was made in it"


@pytest.mark.parametrize("bits", [0o777, 0o1777, 0o775])
def test_a_state_dir_others_can_write_is_refused(tmp_path, no_slurm_commands, bits):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, bits)
    with pytest.raises(PhalanxError, match="can be written by") as info:
        job(state).start()
    assert repr(str(state)) in str(info.value) and f"mode {bits:04o}" in str(info.value)
    assert list(state.iterdir()) == []


def test_a_link_at_state_dir_is_refused(tmp_path, no_slurm_commands):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(real)
    with pytest.raises(PhalanxError, match="symbolic link"):
        job(tmp_path / "state").start()
    assert list(real.iterdir()) == []


def test_a_new_state_dir_is_private_and_so_is_the_jobs_directory(tmp_path):
    state = tmp_path / "a" / "state"
    made = job(state)
    made._prepare()
    try:
        for path in (state, Path(made.directory), Path(made.directory) / "agents"):
            assert os.lstat(path).st_mode & 0o777 == 0o700, path
        assert os.lstat(Path(made.directory) / "token").st_mode & 0o777 == 0o600
    finally:
        made.end()


def test_a_link_at_the_batch_scripts_name_is_not_followed(tmp_path, no_slurm_commands):
    victim = victim_file(tmp_path)
    made = job(tmp_path / "state")
    made._prepare()
    try:
        (Path(made.directory) / "job.sh").symlink_to(victim)
        with pytest.raises(PhalanxError) as info:
            made._submit()
        assert "symbolic link" in str(info.value) and "job.sh" in str(info.value)
    finally:
        made.end()
    assert victim.read_text() == VICTIM_WORDS


def test_a_fifo_at_an_agents_address_is_refused_without_blocking(tmp_path):
    made = job(tmp_path / "state", start_timeout=3)
    made._prepare()
    try:
        made.node_names = ["n1"]
        fifo = Path(made.directory) / "agents" / "n1"
        os.mkfifo(fifo)
        error = bounded(made._wait_agents, [fifo])
        assert isinstance(error, PhalanxError), error
        assert "n1" in str(error) and "FIFO" in str(error), error
        assert "will not dial" in str(error), error
    finally:
        made.end()


def test_a_link_at_an_agents_address_is_refused(tmp_path):
    made = job(tmp_path / "state", start_timeout=3)
    made._prepare()
    try:
        elsewhere = tmp_path / "their-address"
        elsewhere.write_text("127.0.0.1:1\n")
        (Path(made.directory) / "agents" / "n1").symlink_to(elsewhere)
        error = bounded(made._wait_agents, [])
        assert isinstance(error, PhalanxError) and "symbolic link" in str(error), error
        assert made.hosts == []
    finally:
        made.end()


def test_a_fifo_at_an_agents_log_does_not_block_the_error_that_quotes_it(tmp_path):
    made = job(tmp_path / "state", start_timeout=3)
    made._prepare()
    try:
        made.node_names = ["n1"]
        fifo = Path(made.directory) / "agent-n1.log"
        os.mkfifo(fifo)
        error = bounded(made._wait_agents, [fifo])  # no address: the error quotes the log
        assert isinstance(error, PhalanxError), error
        assert "did not start" in str(error) and "agent-n1.log: not read" in str(error), error
    finally:
        made.end()
