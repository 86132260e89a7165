"""SIGINT and SIGTERM to the launcher, forwarded to the ranks: :class:`SignalForwarder`.

torchrun's behaviour: the first SIGINT/SIGTERM goes to every rank still running the
program; SIGKILL follows to every rank after the grace period (``--grace``), or at once on
a second signal. A signal while a group starts interrupts the start. In a job of several
launchers, another node's failure stops this node's ranks the same way (:meth:`stop`).

The handler runs on the main thread between any two bytecodes, so it never raises: it
reads the group the current attempt registered (:meth:`watch`), sends signals, and writes
its notice straight to file descriptor 2 (the console lock may be held by the output
thread). During a start (:meth:`starting`), when there is no group yet, it kills the
worker processes this process started: the start then fails as it does when a worker
dies, stopping everything it started.

Both kinds of launcher use it the same way::

    with SignalForwarder(grace) as signals:
        ...                              # per attempt (phalanx.launcher.attempt):
        with signals.starting():
            group = WorkerGroup(...)
        signals.watch(group, ranks)      # then signals.finished(rank) as each one ends
        ...
        signals.unwatch()
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from phalanx.errors import PhalanxError


class SignalForwarder:
    """Forwards SIGINT/SIGTERM to the ranks still running the program; SIGKILL to every rank
    after ``grace`` seconds, or at once on a second signal.

    ``received`` is the first signal the launcher got (None: none); ``stopped`` says the
    job told this launcher to stop the current attempt (another node failed).
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.received: int | None = None
        self.stopped = False
        self._group: Any = None  # the attempt's group, once started
        self._running: set[int] = set()  # ranks whose program has not finished
        self._starting = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalForwarder:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._timer is not None:
            self._timer.cancel()

    @property
    def interrupted(self) -> bool:
        """Whether the current attempt is to end: a signal came, or the job said stop."""
        return self.received is not None or self.stopped

    def new_attempt(self) -> None:
        """A new attempt of the job begins: the previous one's stop is spent."""
        self.stopped = False

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While a group starts: a signal kills the workers this process started."""
        self._starting = True
        try:
            yield
        finally:
            self._starting = False

    def watch(self, group: Any, ranks: Iterable[int]) -> None:
        """From now on a signal is forwarded to ``group``'s ``ranks`` still running."""
        self._running = set(ranks)
        self._group = group

    def finished(self, rank: int) -> None:
        """``rank``'s program ended: a signal no longer goes to it."""
        self._running.discard(rank)

    def unwatch(self) -> None:
        """The attempt's group is being shut down: nothing to forward to any more."""
        self._group = None

    def stop(self, why: str) -> None:
        """Another node's failure ends this attempt: stop this node's ranks as a first
        SIGTERM would (callable from any thread)."""
        first = not self.stopped
        self.stopped = True
        self._forward(signal.SIGTERM, first, f"{why}; sent SIGTERM to this node's ranks")

    def _handle(self, signum: int, frame: object) -> None:
        first = self.received is None
        self.received = self.received or signum
        self._forward(signum, first, f"got {signal.Signals(signum).name}, forwarded it to "
                                     "the running ranks")

    def _forward(self, signum: int, first: bool, notice: str) -> None:
        if self._starting:
            _kill_children()  # the start sees its workers die and stops what it started
            return
        group = self._group
        if group is None:
            return
        if not first:
            self._kill(group)
            return
        try:
            group.send_signal(signum, workers=sorted(self._running))
        except PhalanxError:
            return
        _say(f"phalanx run: {notice} (SIGKILL in {self.grace:g} s)")
        self._timer = threading.Timer(self.grace, self._kill, args=(group,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _kill(group: Any) -> None:
        try:
            group.send_signal(signal.SIGKILL, workers="ready")
        except PhalanxError:
            pass


def _kill_children() -> None:
    """SIGKILL this process's phalanx workers (and their process groups): children of the
    node supervisor's keepers, on the local backend."""
    import psutil  # type: ignore[import-untyped]  # no stubs: types-psutil is not a dependency

    from phalanx.node.spawn import is_worker

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            lineage = [child.cmdline()]
            parent = child.parent()
            for _ in range(2):
                if parent is None:
                    break
                lineage.append(parent.cmdline())
                parent = parent.parent()
            if not is_worker(lineage):
                continue
        except psutil.Error:
            continue
        try:
            os.killpg(child.pid, signal.SIGKILL)  # each worker leads its own process group
        except OSError:
            try:
                child.kill()
            except psutil.Error:
                pass


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass
