"""Huge output lines: a worker writing 50 MB without a newline must not slow the controller,
swell its memory, hold up other ranks' calls or blow up a WorkerDied message."""

from __future__ import annotations

import os
import sys
import threading
import time

import psutil
import pytest

from phalanx import WorkerDied, config
from phalanx.output.logs import LogPump, OutputOptions
from tests import helpers
from tests.workers import Probe

SIZE = 50_000_000  # bytes of the huge line
MB = 1 << 20


class Writer(Probe):
    """Writes huge lines of one repeated character."""

    def write_unterminated(self, size: int, stderr: bool = False) -> int:
        """``size`` x's and no newline, in one write."""
        stream = sys.stderr if stderr else sys.stdout
        stream.write("x" * size)
        stream.flush()
        return size

    def write_paced(self, size: int, chunk: int, pause: float) -> int:
        """``size`` x's and no newline, ``chunk`` at a time with a pause after each."""
        piece = "x" * chunk
        for _ in range(size // chunk):
            sys.stdout.write(piece)
            sys.stdout.flush()
            time.sleep(pause)
        return size

    def fill_stderr_then_exit(self, size: int, code: int) -> None:
        sys.stderr.write("y" * size + "\nfatal: giving up\n")
        sys.stderr.flush()
        os._exit(code)


class PeakRss:
    """The controller's peak resident memory above where it stood at the start."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB


def test_a_50_mb_line_without_newline_passes_quickly_in_prefixed_pieces(make_group, capfd):
    group = make_group(Writer, echo_output=True)
    started = time.monotonic()
    group.call("write_unterminated", SIZE, timeout=30)
    group.call("say", "\nafter", timeout=30)  # ends the huge line, then a normal one
    group.shutdown()  # every line is out (reading capfd while lines arrive can lose some)
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"a 50 MB line took {elapsed:.1f} s to pass"
    lines = capfd.readouterr().out.splitlines()
    assert lines[-1] == "[rank 0] after"
    pieces = lines[:-1]
    for piece in pieces:
        text = piece.removeprefix("[rank 0] ")
        assert len(text) <= config.MAX_LINE_BYTES and text == "x" * len(text), piece[:80]
    assert sum(len(piece) - len("[rank 0] ") for piece in pieces) == SIZE


def test_the_controller_memory_stays_bounded_and_log_files_get_every_byte(
    make_group, tmp_path, capfd
):
    group = make_group(Writer, echo_output=True, log_dir=tmp_path)
    log = tmp_path / "rank-0.stdout.log"
    expected = SIZE + len("\nend\n")
    with PeakRss() as rss:
        group.call("write_unterminated", SIZE, timeout=30)
        group.call("say", "\nend")
        assert helpers.wait_until(lambda: log.stat().st_size >= expected, 10)
    assert rss.growth_mb < 60, f"the controller grew by {rss.growth_mb:.0f} MB"
    assert log.stat().st_size == expected
    with log.open("rb") as file:
        for _ in range(SIZE // MB):
            assert file.read(MB) == b"x" * MB
        assert file.read() == b"x" * (SIZE % MB) + b"\nend\n"


def test_a_death_after_a_50_mb_stderr_line_gives_a_short_message(make_group):
    group = make_group(Writer, procs_per_node=2)
    with pytest.raises(WorkerDied) as info:
        group.call_one(0, "fill_stderr_then_exit", SIZE, 3, timeout=30)
    died = info.value
    message = str(died)
    assert len(message) < 10_000, f"WorkerDied's message is {len(message)} characters long"
    assert (died.rank, died.exitcode) == (0, 3)
    assert message.startswith("rank 0 ") and "code 3" in message
    assert "fatal: giving up" in message
    assert sum(map(len, died.stderr_tail)) <= config.STDERR_TAIL_CHARS


def test_other_ranks_calls_are_not_held_up_by_a_huge_line(make_group, capfd):
    group = make_group(Writer, procs_per_node=2, echo_output=True)
    started = time.monotonic()
    writing = group.call_async("write_paced", SIZE, MB, 0.02, workers=[0])  # 1 s at least
    time.sleep(0.1)
    latencies = []
    for _ in range(10):
        call_started = time.monotonic()
        assert group.call_one(1, "echo", 1, timeout=10) == ((1,), {})
        latencies.append(time.monotonic() - call_started)
        time.sleep(0.02)
    assert not writing.done(), "rank 0 finished writing before the calls were made"
    assert max(latencies) < 0.5, [round(t, 3) for t in latencies]
    assert writing.result(timeout=30) == [SIZE]
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"rank 0's paced 50 MB line took {elapsed:.1f} s to pass"


def test_pieces_split_no_character_and_the_tail_says_what_it_cut(tmp_path, capsys):
    """At the pump itself: a long line of 2-byte characters, cut where no character is split;
    the log file gets the bytes unchanged; the stderr tail keeps the line's start."""
    limit = config.MAX_LINE_BYTES
    data = ("é" * (limit // 2 + 10) + "\r\nshort\n").encode() + b"z" * (2 * limit + 1)
    pump = LogPump(OutputOptions(echo=True, log_dir=tmp_path))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    tap = pump.attach(0, out_r, err_r)
    os.close(out_w)

    def write() -> None:
        with os.fdopen(err_w, "wb") as pipe:
            pipe.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(10)
    assert tap.wait_closed(10)
    pump.stop()
    shown = capsys.readouterr().err.splitlines()
    assert [len(line) for line in shown] == [
        len("[rank 0] ") + n for n in (limit // 2, 10, len("short"), limit, limit, 1)
    ]
    assert "".join(line[len("[rank 0] "):] for line in shown[:2]) == "é" * (limit // 2 + 10)
    assert (tmp_path / "rank-0.stderr.log").read_bytes() == data + b"\n"
    kept = config.STDERR_TAIL_LINE_BYTES
    head, short, last = tap.stderr_tail()
    assert head == "é" * (kept // 2) + f" ... [{limit + 20 - kept} bytes cut]"
    assert short == "short"
    assert last == "z" * kept + f" ... [{2 * limit + 1 - kept} bytes cut]"
