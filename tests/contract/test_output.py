"""Worker output at the controller: rank prefixes, collapsing, rank filter, per-rank files,
and which group a line or a file is about while several groups run."""

from __future__ import annotations

import re
import threading

import pytest

from phalanx.output import console
from tests import helpers
from tests.workers import Probe


def _read_captured(capfd):
    """What was captured since the last read, taken while no worker line is being written.

    pytest takes a capture as ``seek(0)``, ``read()``, ``seek(0)``, ``truncate()`` on the
    file the log pump's thread writes to (sharing its offset): a line written in between
    lands before the read position or is cut away, with the lines it overwrote. The pump
    writes every line under the console's lock, so reading under it loses none."""
    with console.holding():
        return capfd.readouterr()


def _wait_for_lines(capfd, out_lines: list[str], err_lines: list[str], timeout: float = 20.0):
    """Collect captured output until every wanted line arrived (the log pump is a thread)."""
    out, err = "", ""

    def seen() -> bool:
        nonlocal out, err
        chunk = _read_captured(capfd)
        out, err = out + chunk.out, err + chunk.err
        return set(out_lines) <= set(out.splitlines()) and set(err_lines) <= set(
            err.splitlines()
        )

    helpers.wait_until(seen, timeout, interval=0.05)
    return out.splitlines(), err.splitlines()


def test_lines_written_while_the_capture_is_read_are_all_kept(capfd):
    """The waits above read the capture while the pump's thread writes to it: nothing the
    pump wrote may go missing (a plain ``capfd.readouterr()`` loses lines here)."""
    count = 5000

    def write() -> None:
        for i in range(count):
            console.write_line("[rank 0]", f"line {i}")

    writer = threading.Thread(target=write)
    writer.start()
    out = ""
    while writer.is_alive():
        out += _read_captured(capfd).out
    writer.join()
    out += _read_captured(capfd).out
    assert out.splitlines() == [f"[rank 0] line {i}" for i in range(count)]


def test_each_line_is_prefixed_with_its_rank(make_group, capfd):
    group = make_group(Probe, procs_per_node=2, echo_output=True, collapse_output=False)
    group.call("say", "hello out")
    group.call("say", "hello err", stderr=True)
    want_out = ["[rank 0] hello out", "[rank 1] hello out"]
    want_err = ["[rank 0] hello err", "[rank 1] hello err"]
    out, err = _wait_for_lines(capfd, want_out, want_err)
    assert set(want_out) <= set(out), out
    assert set(want_err) <= set(err), err


def test_identical_lines_from_several_ranks_collapse_into_one(make_group, capfd):
    group = make_group(Probe, procs_per_node=4, echo_output=True)
    group.call("say", "same everywhere")
    group.map("say", text=["rank zero", "same pair", "same pair", "rank three"])
    want = ["[ranks 0-3] same everywhere", "[rank 0] rank zero", "[ranks 1-2] same pair",
            "[rank 3] rank three"]
    out, _ = _wait_for_lines(capfd, want, [])
    assert set(want) <= set(out), out
    assert not any(re.match(r"\[rank \d\] same", line) for line in out), out
    assert out.count("[ranks 0-3] same everywhere") == 1


def test_echo_output_false_keeps_worker_output_quiet(make_group, capfd):
    group = make_group(Probe, echo_output=False)
    group.call("say", "should not appear")
    group.shutdown()
    assert "should not appear" not in "".join(capfd.readouterr())


def test_log_ranks_shows_only_those_ranks(make_group, capfd):
    group = make_group(Probe, procs_per_node=3, echo_output=True, log_ranks=[1])
    group.map("say", text=["from zero", "from one", "from two"])
    group.call("say", "everyone", stderr=True)
    out, err = _wait_for_lines(capfd, ["[rank 1] from one"], ["[rank 1] everyone"])
    group.shutdown()
    rest = capfd.readouterr()
    everything = "\n".join([*out, *err, rest.out, rest.err])
    assert "from zero" not in everything and "from two" not in everything
    assert "[rank 0]" not in everything and "[rank 2]" not in everything


def test_log_dir_keeps_every_ranks_output_in_its_own_files(make_group, tmp_path, capfd):
    logs = tmp_path / "logs" / "run1"  # created on demand
    group = make_group(Probe, procs_per_node=2, echo_output=False, log_dir=logs)
    group.map("say", text=["zero out", "one out"])
    group.call("say", "both err", stderr=True)
    group.shutdown()
    for rank, text in ((0, "zero out"), (1, "one out")):
        assert (logs / f"rank-{rank}.stdout.log").read_text().splitlines() == [text]
        assert (logs / f"rank-{rank}.stderr.log").read_text().splitlines() == ["both err"]
    assert "zero out" not in capfd.readouterr().out  # files only, as asked


def test_long_lines_from_many_ranks_never_interleave(make_group, capfd):
    length, count = 70_000, 8  # each line takes many pipe reads
    group = make_group(Probe, procs_per_node=4, echo_output=True, collapse_output=False)
    group.call("say_long_lines", length, count)
    group.shutdown()
    out = capfd.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("[rank")]
    assert len(lines) == 4 * count
    for line in lines:
        match = re.fullmatch(r"\[rank (\d)\] (\d+)", line)
        assert match is not None, line[:80]
        assert match.group(2) == match.group(1) * length


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"log_ranks": [0, 5]}, ValueError, ["log_ranks", "5"]),
        ({"log_ranks": "0"}, TypeError, ["log_ranks"]),
        ({"log_ranks": [1.0]}, TypeError, ["log_ranks"]),
    ],
)
def test_bad_output_options_are_refused_before_start(make_group, options, error, words):
    with pytest.raises(error) as info:
        make_group(Probe, procs_per_node=2, **options)
    for word in words:
        assert word in str(info.value)


def test_a_log_dir_that_cannot_be_created_is_refused(make_group, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="log_dir"):
        make_group(Probe, log_dir=blocker / "sub")


def test_lines_say_their_group_while_two_groups_run(make_group, capfd):
    alpha = make_group(Probe, procs_per_node=2, echo_output=True, name="alpha")
    beta = make_group(Probe, procs_per_node=2, echo_output=True, name="beta")
    alpha.call("say", "the same text")
    beta.call("say", "the same text")
    alpha.map("say", text=["alpha zero", "alpha one"])
    beta.call("say", "beta err", stderr=True)
    want = ["[alpha ranks 0-1] the same text", "[beta ranks 0-1] the same text",
            "[alpha rank 0] alpha zero", "[alpha rank 1] alpha one"]
    out, err = _wait_for_lines(capfd, want, ["[beta ranks 0-1] beta err"])
    # collapsed within each group, never across groups, and no line without its group
    assert out.count("[alpha ranks 0-1] the same text") == 1, out
    assert out.count("[beta ranks 0-1] the same text") == 1, out
    assert not [line for line in [*out, *err] if line.startswith("[rank")], (out, err)

    beta.shutdown()
    alpha.call("say", "alone again")  # one group runs: lines as a single group's are
    out, _ = _wait_for_lines(capfd, ["[ranks 0-1] alone again"], [])
    assert "[alpha ranks 0-1] alone again" not in out


def test_two_groups_given_one_log_dir_write_distinct_files(make_group, tmp_path):
    logs = tmp_path / "logs"
    alpha = make_group(Probe, procs_per_node=2, log_dir=logs, name="alpha")
    beta = make_group(Probe, procs_per_node=2, log_dir=logs, name="beta")
    alpha.map("say", text=["alpha zero", "alpha one"])
    beta.map("say", text=["beta zero", "beta one"])
    beta.call("say", "beta err", stderr=True)
    alpha.shutdown()
    beta.shutdown()
    for rank, word in ((0, "zero"), (1, "one")):
        # the group alone there first keeps rank-N; the other's name is in front of its own
        assert (logs / f"rank-{rank}.stdout.log").read_text().splitlines() == [f"alpha {word}"]
        assert (logs / f"beta.rank-{rank}.stdout.log").read_text().splitlines() == [
            f"beta {word}"]
        assert "beta err" in (logs / f"beta.rank-{rank}.stderr.log").read_text()
        assert "beta err" not in (logs / f"rank-{rank}.stderr.log").read_text()
