"""``log_dir`` where other local users can reach it (``/tmp``...).

A probe made the log directory first, as another user, planted a link at a rank's log
file's name, and had the rank's output written into the victim's file; the logs were
0644. Now (:class:`phalanx.output.logs.LogDir`):

- a ``log_dir`` phalanx creates is 0700, and each log file 0600 (an existing one of ours
  is made 0600); an existing directory of ours that only we can write (0755) is used as
  it is;
- a directory another user owns, one that is group- or world-writable, or a link, is
  refused with a ``ValueError`` naming the path, the owner and the mode -- when the group is
  made, before any rank starts;
- a link at a log file's name is never followed: refused when the group is made, its target
  left alone; one planted later is skipped with a warning (that stream is not written to a
  file), target again untouched; a FIFO there is refused without blocking;
- the directory is opened once, and files are opened relative to it: swapping the path for a
  link to another directory afterwards changes nothing.

Refusals cost no processes: the suite's leftover check would see them. Making a path that
belongs to another user needs root; those tests are skipped otherwise.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import psutil
import pytest

import phalanx as px
from phalanx.output.logs import LogDir, LogPump, OutputOptions, log_path
from tests.workers import Probe

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="making a path of another user needs root")


def children() -> set[int]:
    return {proc.pid for proc in psutil.Process().children(recursive=True)}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def build(log_dir: Path, world: int = 2) -> OutputOptions:
    return OutputOptions.build(False, True, None, log_dir, world)


def planted_victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's own words\n")
    return victim


# ------------------------------------------------------------------------ modes of new paths


def test_a_new_log_dir_is_0700_and_its_files_0600(tmp_path):
    logs = tmp_path / "a" / "b" / "logs"
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        build(logs)
    finally:
        os.umask(old_umask)
    assert mode(logs) == 0o700
    files = sorted(p.name for p in logs.iterdir())
    assert files == [f"rank-{r}.{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    for path in logs.iterdir():
        assert mode(path) == 0o600, path
        assert os.lstat(path).st_uid == os.geteuid()


def test_an_own_0755_dir_is_used_as_it_is_and_old_0644_files_made_0600(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o755)
    old = log_path(logs, 0, "stdout")
    old.write_text("from the last run\n")
    os.chmod(old, 0o644)
    build(logs)
    assert mode(logs) == 0o755  # not tightened: only others' write access is refused
    assert mode(old) == 0o600
    assert old.read_text() == "from the last run\n"  # appended to, never truncated


# ------------------------------------------------------------------- directories refused


@pytest.mark.parametrize(("bits", "who"), [(0o777, "everyone"), (0o1777, "everyone"),
                                           (0o770, "its group"), (0o720, "its group")])
def test_a_log_dir_others_can_write_is_refused_naming_path_owner_and_mode(tmp_path, bits,
                                                                         who):
    logs = tmp_path / "shared"
    logs.mkdir()
    os.chmod(logs, bits)
    with pytest.raises(ValueError) as info:
        build(logs)
    message = str(info.value)
    assert repr(str(logs)) in message and who in message, message
    assert f"mode {bits:04o}" in message and f"uid {os.geteuid()}" in message, message
    assert not list(logs.iterdir()), "a file was made in a refused directory"
    assert mode(logs) == bits  # left alone


@needs_root
def test_a_log_dir_of_another_user_is_refused_naming_the_owner(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError) as info:
        build(theirs)
    message = str(info.value)
    assert repr(str(theirs)) in message and "not to you" in message, message
    assert f"uid {NOBODY}" in message and "mode 0755" in message, message
    assert not list(theirs.iterdir())


def test_a_link_at_log_dir_is_refused_and_not_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "logs"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link") as info:
        build(link)
    assert repr(str(link)) in str(info.value)
    assert not list(real.iterdir())


def test_a_dangling_link_at_log_dir_is_refused_and_nothing_is_created(tmp_path):
    target = tmp_path / "would-be"
    link = tmp_path / "logs"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        build(link)
    assert not target.exists()


# ------------------------------------------------------------------------ files refused


def test_a_link_planted_at_a_log_files_name_is_refused_and_its_target_untouched(tmp_path):
    victim = planted_victim(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    log_path(logs, 1, "stderr").symlink_to(victim)
    with pytest.raises(ValueError) as info:
        build(logs)
    message = str(info.value)
    assert "symbolic link" in message and "rank-1.stderr.log" in message, message
    assert victim.read_text() == "the victim's own words\n"
    assert mode(victim) == 0o644


def test_a_fifo_at_a_log_files_name_is_refused_without_blocking(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    os.mkfifo(log_path(logs, 0, "stdout"))
    with pytest.raises(ValueError, match="not a regular file"):
        build(logs)  # a plain open for writing would wait here for a reader


@needs_root
def test_a_log_file_of_another_user_is_refused(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    theirs = log_path(logs, 0, "stdout")
    theirs.write_text("")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"uid {NOBODY}"):
        build(logs)


# ---------------------------------------------------- after the check: links, a swapped path


def _pump_one_line(pump: LogPump, rank: int, text: bytes) -> None:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    tap = pump.attach(rank, out_r, err_r)
    os.write(out_w, text + b"\n")
    os.close(out_w)
    os.close(err_w)
    assert tap.wait_closed(5)


def test_a_link_planted_after_the_check_is_skipped_with_a_warning(tmp_path, caplog):
    victim = planted_victim(tmp_path)
    logs = tmp_path / "logs"
    options = build(logs, world=1)
    pump = LogPump(options)
    try:
        path = log_path(logs, 0, "stdout")
        path.unlink()
        path.symlink_to(victim)
        with caplog.at_level(logging.WARNING, logger="phalanx.output.logs"):
            _pump_one_line(pump, 0, b"secret output")
    finally:
        pump.stop()
    assert victim.read_text() == "the victim's own words\n"
    assert any("symbolic link" in r.getMessage() for r in caplog.records), caplog.text


def test_files_are_opened_in_the_directory_checked_even_if_the_path_is_swapped(tmp_path):
    logs = tmp_path / "logs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    options = build(logs, world=1)
    pump = LogPump(options)
    try:
        moved = tmp_path / "moved"
        logs.rename(moved)
        logs.symlink_to(elsewhere)  # the path now leads somewhere else
        _pump_one_line(pump, 0, b"to the checked directory")
    finally:
        pump.stop()
    assert not list(elsewhere.iterdir())
    assert log_path(moved, 0, "stdout").read_text() == "to the checked directory\n"


def test_log_dir_is_closed_with_the_pump(tmp_path):
    logs = tmp_path / "logs"
    with LogDir.open(logs) as opened:
        opened.open_file(0, "stdout").close()
    with pytest.raises(ValueError, match="closed"):
        opened.open_file(0, "stdout")


# -------------------------------------------------------------------- a real WorkerGroup


def test_a_group_writes_0600_logs_into_a_new_0700_log_dir(tmp_path):
    logs = tmp_path / "run" / "logs"
    with px.WorkerGroup(Probe, procs_per_node=2, log_dir=logs, echo_output=False,
                        backend="local") as group:
        group.map("say", text=["zero out", "one out"])
    assert mode(logs) == 0o700
    for rank, text in ((0, "zero out"), (1, "one out")):
        path = log_path(logs, rank, "stdout")
        assert path.read_text().splitlines() == [text]
        assert mode(path) == 0o600


def test_a_group_refuses_a_world_writable_log_dir_with_a_planted_link_before_any_rank(
        tmp_path):
    """The probe's case, as far as one user can play both: the directory others could
    write to, a link already at rank 0's stdout log."""
    victim = planted_victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    log_path(shared, 0, "stdout").symlink_to(victim)
    before = children()
    with pytest.raises(ValueError, match="can be written by everyone"):
        px.WorkerGroup(Probe, procs_per_node=2, log_dir=shared, echo_output=False,
                       backend="local")
    assert children() == before, "processes were started for a refused group"
    assert victim.read_text() == "the victim's own words\n"


@needs_root
def test_a_group_refuses_a_log_dir_another_user_made_first(tmp_path):
    victim = planted_victim(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    log_path(theirs, 0, "stdout").symlink_to(victim)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError) as info:
        px.WorkerGroup(Probe, procs_per_node=2, log_dir=theirs, echo_output=False,
                       backend="local")
    message = str(info.value)
    assert f"uid {NOBODY}" in message and "mode 0777" in message, message
    assert victim.read_text() == "the victim's own words\n"


def test_log_dir_on_every_backend_gives_private_files(make_group, tmp_path):
    logs = tmp_path / "every" / "logs"
    group = make_group(Probe, procs_per_node=2, log_dir=logs)
    group.call("say", "hello", stderr=True)
    group.shutdown()
    assert mode(logs) == 0o700
    for rank in (0, 1):
        path = log_path(logs, rank, "stderr")
        assert path.read_text().splitlines() == ["hello"]
        assert mode(path) == 0o600
