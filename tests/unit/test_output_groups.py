"""Output of several groups in one process (:mod:`phalanx.output.logs`): which group a line
or a log file is about.

Each group's pump is driven through real pipes standing for its ranks' stdout and stderr;
what it shows is read from the captured terminal, what it writes from the log files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from phalanx.output import console
from phalanx.output.collapse import line_prefix
from phalanx.output.logs import RUNNING, LogPump, OutputOptions, OutputTap, log_name, log_path
from tests import helpers

WAIT = 10.0  # seconds for a line to come through a pump


class Ranks:
    """Pipes standing for ``world`` ranks of one group, attached to its pump."""

    def __init__(self, pump: LogPump, world: int) -> None:
        self.pump = pump
        self._writers: list[tuple[int, int]] = []
        self._taps: list[OutputTap] = []
        for rank in range(world):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self._taps.append(pump.attach(rank, out_r, err_r))
            self._writers.append((out_w, err_w))

    def say(self, rank: int, text: str) -> None:
        os.write(self._writers[rank][0], text.encode() + b"\n")

    def stop(self) -> None:
        """The ranks end; the pump stops once their last words are in."""
        for out_w, err_w in self._writers:
            os.close(out_w)
            os.close(err_w)
        self._writers = []
        for tap in self._taps:
            assert tap.wait_closed(WAIT)
        self.pump.stop()


def group(name: str | None, world: int = 2, log_dir: Path | None = None,
          echo: bool = True) -> Ranks:
    options = OutputOptions.build(echo, True, None, log_dir, world, group=name)
    return Ranks(LogPump(options), world)


class Screen:
    """What the pumps showed on the (captured) terminal, read under the console's lock so
    that no line is lost to a write in the middle of a read."""

    def __init__(self, capfd) -> None:
        self._capfd = capfd
        self.lines: list[str] = []

    def shows(self, *wanted: str) -> list[str]:
        def seen() -> bool:
            with console.holding():
                self.lines += self._capfd.readouterr().out.splitlines()
            return set(wanted) <= set(self.lines)

        assert helpers.wait_until(seen, WAIT, interval=0.02), (wanted, self.lines)
        return self.lines


def test_a_line_prefix_names_the_group_only_when_given():
    assert line_prefix([3]) == "[rank 3]"
    assert line_prefix([0, 1, 2, 3]) == "[ranks 0-3]"
    assert line_prefix([3], "Policy") == "[Policy rank 3]"
    assert line_prefix([2, 0, 1], "policy.v1") == "[policy.v1 ranks 0-2]"


def test_a_log_files_name_puts_the_group_in_front():
    assert log_name(3, "stdout") == "rank-3.stdout.log"
    assert log_name(3, "stderr", "Policy-2") == "Policy-2.rank-3.stderr.log"
    assert log_path(Path("logs"), 0, "stdout", "a") == Path("logs/a.rank-0.stdout.log")


def test_lines_say_their_group_while_another_runs_and_collapse_within_it(capfd):
    screen = Screen(capfd)
    alpha = group("alpha")
    beta = None
    try:
        alpha.say(0, "alone")
        screen.shows("[rank 0] alone")  # a group alone: as ever

        beta = group("beta")
        for ranks in (alpha, beta):
            ranks.say(0, "the same text")
            ranks.say(1, "the same text")
        alpha.say(1, "alpha's own")
        lines = screen.shows("[alpha ranks 0-1] the same text", "[beta ranks 0-1] the same text",
                             "[alpha rank 1] alpha's own")
        assert lines.count("[alpha ranks 0-1] the same text") == 1, lines
        assert not [line for line in lines if line.endswith("the same text")
                    and not line.startswith(("[alpha ", "[beta "))], lines

        beta.stop()
        beta = None
        alpha.say(1, "alone again")
        screen.shows("[rank 1] alone again")  # the other group ended: back to [rank N]
    finally:
        for ranks in (alpha, beta):
            if ranks is not None:
                ranks.stop()


def test_a_pump_of_no_group_is_not_counted(capfd):
    """Pumps without a group's name (a pool's keeper, a Slurm job's) are not groups."""
    screen = Screen(capfd)
    keeper = group(None, echo=False)
    alpha = group("alpha")
    try:
        alpha.say(0, "still alone")
        screen.shows("[rank 0] still alone")
    finally:
        alpha.stop()
        keeper.stop()


def test_two_groups_given_one_log_dir_write_distinct_files(tmp_path, caplog):
    logs = tmp_path / "logs"
    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path)  # another path to the same directory: alias/logs
    alpha = group("alpha", log_dir=logs, echo=False)
    try:
        with caplog.at_level(logging.INFO, logger="phalanx.output.logs"):
            beta = group("beta", log_dir=alias / "logs", echo=False)
        try:
            # made (and checked) before any rank could start, under the names they write
            assert sorted(p.name for p in logs.iterdir()) == sorted(
                log_name(rank, stream, name) for rank in (0, 1)
                for stream in ("stdout", "stderr") for name in (None, "beta"))
            for rank in (0, 1):
                alpha.say(rank, f"alpha {rank}")
                beta.say(rank, f"beta {rank}")
        finally:
            beta.stop()
    finally:
        alpha.stop()
    for rank in (0, 1):
        assert log_path(logs, rank, "stdout").read_text() == f"alpha {rank}\n"
        assert log_path(logs, rank, "stdout", "beta").read_text() == f"beta {rank}\n"
    said = caplog.text
    assert "group beta" in said and "beta.rank-N" in said and "group alpha" in said, said

    # Both ended: the plain names are free again, for whichever group comes next.
    gamma = group("gamma", world=1, log_dir=logs, echo=False)
    gamma.say(0, "gamma 0")
    gamma.stop()
    assert log_path(logs, 0, "stdout").read_text() == "alpha 0\ngamma 0\n"
    assert not list(logs.glob("gamma.*"))


def test_a_group_of_the_same_name_again_takes_the_plain_names(tmp_path):
    """``phalanx run``'s next attempt, or a group made again under its name, appends to
    the files it wrote, even while the last one's pump may still be draining."""
    logs = tmp_path / "logs"
    first = group("train", world=1, log_dir=logs, echo=False)
    try:
        again = group("train", world=1, log_dir=logs, echo=False)
        again.say(0, "attempt 2")
        again.stop()
        # the plain names stay taken while the first still writes them
        other = group("other", world=1, log_dir=logs, echo=False)
        other.stop()
        first.say(0, "attempt 1")
    finally:
        first.stop()
    assert sorted(p.name for p in logs.iterdir()) == [
        "other.rank-0.stderr.log", "other.rank-0.stdout.log",
        "rank-0.stderr.log", "rank-0.stdout.log"]
    assert sorted(log_path(logs, 0, "stdout").read_text().splitlines()) == [
        "attempt 1", "attempt 2"]
    assert not RUNNING.several()


def test_a_pump_keeps_to_the_names_checked_unless_they_were_taken_meanwhile(tmp_path):
    """Between the check (``build``, as the group is made) and its pump's opening another
    group may come or go: a group keeps the names it was given, never writing the plain
    ones another writes."""
    logs = tmp_path / "logs"
    holder = group("holder", world=1, log_dir=logs, echo=False)
    named = OutputOptions.build(False, True, None, logs, 1, group="named")
    assert named.log_group == "named"
    holder.say(0, "holder")
    holder.stop()  # gone before "named" opens: it still writes named.rank-0.*
    plain = OutputOptions.build(False, True, None, logs, 1, group="plain")
    assert plain.log_group is None  # free as it is checked...
    taker = group("taker", world=1, log_dir=logs, echo=False)  # ...but taken before it opens
    late = [Ranks(LogPump(options), 1) for options in (named, plain)]
    for ranks, text in zip([taker, *late], ["taker", "named", "plain"], strict=True):
        ranks.say(0, text)
        ranks.stop()
    assert log_path(logs, 0, "stdout").read_text() == "holder\ntaker\n"
    assert log_path(logs, 0, "stdout", "named").read_text() == "named\n"
    assert log_path(logs, 0, "stdout", "plain").read_text() == "plain\n"
