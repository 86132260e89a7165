"""The dispatcher's waits, with no channel and no process: a task run on the pumping thread
(``call_soon``) stands in for an event arriving."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.controller.dispatch import Dispatcher


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
