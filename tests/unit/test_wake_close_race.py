"""A wake-up racing the close of the pipe it writes to (``streams.WakePipe``): a burial
thread posts a rank's death to its group's dispatcher just as the group is closed and the
dispatcher released. The wake-up must then do nothing: not raise in the waker's thread
(a ``BrokenPipeError`` did, between the closes of the two ends), and not write its byte to
whatever descriptor took the closed write end's number since.

Every race here runs a bounded number of rounds or seconds, whichever ends first."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from phalanx.controller.dispatch import Dispatcher
from phalanx.wire import streams

ROUNDS = 2000  # one wake-up in a few hundred rounds met the old race's window
BUDGET = 5.0  # seconds per race at most (a loaded 2-core machine runs fewer rounds)


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """What threads raised while the test ran (``threading.excepthook``)."""
    caught: list[BaseException] = []
    previous = threading.excepthook

    def hook(args: Any) -> None:
        caught.append(args.exc_value)

    threading.excepthook = hook
    try:
        yield caught
    finally:
        threading.excepthook = previous


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def test_a_wake_after_the_close_writes_to_no_descriptor() -> None:
    wake = streams.WakePipe()
    old_write = wake._write_fd
    wake.close()
    read_fd, write_fd = os.pipe()  # someone else's pipe, on the number the write end had
    if write_fd != old_write:
        os.dup2(write_fd, old_write)
        os.close(write_fd)
        write_fd = old_write
    try:
        wake.wake()
        assert not _readable(read_fd), "the wake-up wrote into a pipe that is not its own"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_second_close_leaves_the_numbers_new_owners_hold() -> None:
    wake = streams.WakePipe()
    old = (wake.fd, wake._write_fd)
    wake.close()
    held = [os.open(os.devnull, os.O_RDONLY)]
    for number in old:  # someone else's files now, on the pipe's numbers
        if number not in held:
            os.dup2(held[0], number)
            held.append(number)
    wake.close()
    closed = []
    for fd in held:
        try:
            os.close(fd)
        except OSError:
            closed.append(fd)
    assert not closed, f"the second close closed descriptor(s) {closed}, another's"


def _race(make: Callable[[], Any], wake: Callable[[Any], None],
          close: Callable[[Any], None], errors: list[BaseException],
          rounds_at_most: int = ROUNDS) -> int:
    """Rounds of ``wake(target)`` in a loop on a thread against ``close(target)`` here, a
    fresh ``make()`` each round, until ``rounds_at_most`` ran, ``BUDGET`` s passed or a thread
    raised (into ``errors``); how many ran."""
    deadline = time.monotonic() + BUDGET
    rounds = 0
    while rounds < rounds_at_most and time.monotonic() < deadline and not errors:
        target = make()
        stop = threading.Event()

        def waker(target: Any = target, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                wake(target)

        thread = threading.Thread(target=waker, name=f"waker-{rounds}")
        thread.start()
        time.sleep(0.0005 * (rounds % 4))  # a varying moment of wake-ups first
        close(target)
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        rounds += 1
    return rounds


def test_wake_ups_racing_the_close_raise_nothing(thread_errors) -> None:
    rounds = _race(streams.WakePipe, streams.WakePipe.wake, streams.WakePipe.close,
                   thread_errors)
    assert rounds > 0
    assert not thread_errors, f"a waker's thread raised: {thread_errors[0]!r}"


def test_posts_racing_a_dispatchers_release_raise_nothing(thread_errors) -> None:
    """The path of the report: a death posted (``Dispatcher.post``, as a burial thread
    does) while the group's close releases the dispatcher."""

    def post(dispatcher: Dispatcher) -> None:
        dispatcher.post(None, [])  # type: ignore[arg-type]
        dispatcher.call_soon(lambda: None)

    # its window is narrower (the release marks it first, under a lock post takes too):
    # fewer rounds, a check that this path is covered rather than a hunt for the race
    rounds = _race(Dispatcher, post, Dispatcher.release, thread_errors, rounds_at_most=300)
    assert rounds > 0
    assert not thread_errors, f"a poster's thread raised: {thread_errors[0]!r}"
