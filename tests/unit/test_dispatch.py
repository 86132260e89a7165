"""The dispatcher's waits, with no channel and no process: a task run on the pumping thread
(``call_soon``) stands in for an event arriving."""

from __future__ import annotations

import os
import threading
import time

import pytest

from phalanx.controller.dispatch import Dispatcher
from phalanx.wire.streams import ConnectionLost


@pytest.fixture
def dispatcher():
    dispatcher = Dispatcher()
    yield dispatcher
    dispatcher.release()


# a poll's timeout overflows past 2**31 ms (~25 days), a lock's past threading.TIMEOUT_MAX
@pytest.mark.parametrize("timeout", [3e6, 1e9, 1e12, threading.TIMEOUT_MAX * 2, float("inf")])
def test_a_leader_and_a_follower_wait_out_any_timeout(dispatcher, timeout):
    done = threading.Event()
    waited: list[bool] = []

    def wait() -> None:
        waited.append(dispatcher.wait(done.is_set, timeout))

    threads = [threading.Thread(target=wait) for _ in range(2)]  # one leads, one follows
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    assert all(thread.is_alive() for thread in threads) and not waited
    dispatcher.call_soon(done.set)
    for thread in threads:
        thread.join(10)
    assert waited == [True, True]


def test_a_wait_with_no_limit_ends_when_done(dispatcher):
    done = threading.Event()
    threading.Timer(0.05, dispatcher.call_soon, (done.set,)).start()
    assert dispatcher.wait(done.is_set, None)


def test_a_finite_timeout_still_ends_the_wait(dispatcher):
    assert dispatcher.wait(lambda: False, 0.05) is False


class _Watched:
    """A channel watching one pipe: its receive() and its fast read, each recording."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.received: list[int] = []
        self.read: list[bytes] = []

    def receive(self, fd: int) -> list:
        self.received.append(fd)
        os.read(fd, 4096)  # (the end again: empty)
        return []

    def read_now(self) -> list:
        data = os.read(self.fd, 4096)
        if not data:
            raise ConnectionLost("end of stream")
        self.read.append(data)
        return []


def test_a_watched_streams_reads_take_its_fast_read_and_its_end_its_receive(dispatcher):
    """watch(read=): each readable event is read by ``read`` alone, in one call; the
    stream's end (``read`` raising ConnectionLost) is handed to the channel's receive."""
    r, w = os.pipe()
    try:
        channel = _Watched(r)
        dispatcher.watch(r, channel, channel.read_now)
        for chunk in (b"one", b"two"):
            os.write(w, chunk)
            dispatcher.poll_now()
        assert channel.read == [b"one", b"two"] and channel.received == []
        os.close(w)
        w = -1
        dispatcher.poll_now()
        assert channel.received == [r]
        dispatcher.unwatch(r, channel)
        dispatcher.watch(r, channel)  # watched again without one: receive() reads
        dispatcher.poll_now()
        assert channel.received == [r, r] and channel.read == [b"one", b"two"]
        dispatcher.unwatch(r, channel)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
