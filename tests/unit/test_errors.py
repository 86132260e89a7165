"""The error tree: every error survives pickling, and death records explain themselves."""

from __future__ import annotations

import pickle
import threading

import cloudpickle
import pytest

import phalanx
from phalanx.errors import (
    CallTimeout,
    GroupClosed,
    MembershipChanged,
    NodeInfo,
    PhalanxError,
    ProcessFailure,
    RemoteFailure,
    RemoteTraceback,
    SerializationError,
    StartupError,
    WorkerDied,
    WorkerError,
    chain_remote,
    likely_cause,
    signal_name,
)


def _failure(stage: str = "running the method", pickled: bytes | None = None) -> RemoteFailure:
    return RemoteFailure("ValueError", "bad value", "Traceback ...\nValueError: bad value\n",
                         stage, pickled)


ERRORS = {
    "PhalanxError": lambda: PhalanxError("plain"),
    "WorkerError": lambda: WorkerError(_failure(), rank=1, node=0, pid=123, method="train"),
    "WorkerError-stage": lambda: WorkerError(
        _failure("pickling the result"), rank=3, node=1, pid=7, method="step"
    ),
    "WorkerDied": lambda: WorkerDied(
        ProcessFailure(2, 1, 456, -9, ("line 1", "line 2")), method="train"
    ),
    "WorkerDied-no-method": lambda: WorkerDied(ProcessFailure(0, 0, None, None)),
    "StartupError": lambda: StartupError("could not start", rank=2, traceback="tb text"),
    "CallTimeout": lambda: CallTimeout("train", 1.5, [0, 2]),
    "GroupClosed": lambda: GroupClosed("closed"),
    "SerializationError": lambda: SerializationError(
        "cannot pickle", stage="pickling the arguments", rank=3
    ),
    "MembershipChanged": lambda: MembershipChanged(
        [NodeInfo(None, "10.0.0.9:32300")], [NodeInfo(1, "10.0.0.6:32300", (2, 3))],
        "train", "its connection ended"),
}


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("name", list(ERRORS))
def test_every_error_survives_pickling(name, dumps):
    error = ERRORS[name]()
    copy = pickle.loads(dumps(error))
    assert type(copy) is type(error)
    assert isinstance(copy, PhalanxError)
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert vars(copy) == vars(error)


def test_error_attributes_and_messages():
    err = ERRORS["WorkerError"]()
    assert (err.rank, err.node, err.pid, err.method) == (1, 0, 123, "train")
    assert (err.exc_type, err.stage) == ("ValueError", "running the method")
    for part in ("ValueError", "bad value", "rank 1", "node 0", "pid 123", "train()"):
        assert part in str(err)
    staged = ERRORS["WorkerError-stage"]()
    assert "while pickling the result of step()" in str(staged)

    died = ERRORS["WorkerDied"]()
    assert (died.rank, died.node, died.pid, died.exitcode) == (2, 1, 456, -9)
    assert died.signal == "SIGKILL"
    assert died.stderr_tail == ("line 1", "line 2")
    assert "line 1" in str(died) and "line 2" in str(died) and "train()" in str(died)

    timeout = ERRORS["CallTimeout"]()
    assert isinstance(timeout, TimeoutError)
    assert timeout.pending_ranks == [0, 2] and timeout.timeout == 1.5
    assert "[0, 2]" in str(timeout)

    ser = ERRORS["SerializationError"]()
    assert (ser.stage, ser.rank) == ("pickling the arguments", 3)


def test_public_errors_are_exported():
    for name in ("PhalanxError", "WorkerError", "WorkerDied", "StartupError", "CallTimeout",
                 "GroupClosed", "SerializationError", "ProcessFailure"):
        assert name in phalanx.__all__
        assert hasattr(phalanx, name)
    for name in phalanx.__all__:
        assert hasattr(phalanx, name), name


@pytest.mark.parametrize(
    ("exitcode", "signal", "cause_words"),
    [
        (-9, "SIGKILL", ["out-of-memory", "kill -9"]),
        (-11, "SIGSEGV", ["segmentation fault"]),
        (0, None, ["exit code 0"]),
        (3, None, ["code 3"]),
        (None, None, ["unknown"]),
    ],
)
def test_signal_name_and_likely_cause(exitcode, signal, cause_words):
    assert signal_name(exitcode) == signal
    cause = likely_cause(exitcode)
    for word in cause_words:
        assert word in cause
    failure = ProcessFailure(rank=1, node=0, pid=10, exitcode=exitcode)
    assert failure.signal == signal
    assert failure.cause == cause
    died = WorkerDied(failure)
    assert died.signal == signal and died.cause == cause and cause in str(died)


def test_unknown_signal_number_is_named():
    assert signal_name(-200) == "signal 200"
    assert "signal 200" in likely_cause(-200)


def test_remote_failure_rebuilds_the_original_with_the_remote_traceback():
    original = KeyError("missing")
    failure = _failure(pickled=cloudpickle.dumps(original))
    rebuilt = failure.rebuild()
    assert type(rebuilt) is KeyError and rebuilt.args == ("missing",)
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert "ValueError: bad value" in str(rebuilt.__cause__)

    error = chain_remote(WorkerError(failure, rank=0, node=0, pid=1, method="m"), failure)
    assert type(error.__cause__) is KeyError


def test_unrebuildable_remote_exception_still_carries_the_traceback():
    for pickled in (None, b"not a pickle", pickle.dumps("not an exception")):
        failure = _failure(pickled=pickled)
        assert failure.rebuild() is None
        error = chain_remote(WorkerError(failure, rank=0, node=0, pid=1, method="m"), failure)
        assert isinstance(error.__cause__, RemoteTraceback)
        assert "ValueError: bad value" in error.__cause__.text


class TwoArguments(Exception):
    """Pickle alone cannot rebuild it: it would call ``TwoArguments("a-2")``."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")
        self.a = a
        self.b = b


def _raised(exc: Exception) -> RemoteFailure:
    try:
        raise exc
    except Exception as raised:
        return RemoteFailure.from_exception(raised, "running the method", raised.__traceback__)


def _defined_here() -> type:
    """An exception class that cloudpickle pickles by value, like one from ``__main__``."""

    class LocalTwoArguments(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}-{b}")
            self.a = a
            self.b = b

    return LocalTwoArguments


@pytest.mark.parametrize("cls", [TwoArguments, _defined_here()],
                         ids=["by-reference", "by-value"])
def test_an_exception_whose_init_takes_two_arguments_is_rebuilt(cls):
    failure = _raised(cls("a", 2))
    assert (failure.exc_type, failure.message) == (cls.__name__, "a-2")
    with pytest.raises(cls) as info:
        raise failure.rebuild()
    rebuilt = info.value
    assert type(rebuilt) is cls
    assert rebuilt.args == ("a-2",) and (rebuilt.a, rebuilt.b) == ("a", 2)
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert f"{cls.__name__}: a-2" in rebuilt.__cause__.text


def test_an_exception_that_pickles_normally_is_rebuilt_through_its_init():
    failure = _raised(OSError(2, "No such file", "/missing"))
    rebuilt = failure.rebuild()
    assert type(rebuilt) is FileNotFoundError
    assert (rebuilt.errno, rebuilt.filename) == (2, "/missing")


def test_an_exception_that_cannot_be_pickled_travels_as_text():
    error = TwoArguments("a", 2)
    error.lock = threading.Lock()
    failure = _raised(error)
    assert failure.pickled is None and failure.rebuild() is None
    assert "TwoArguments: a-2" in failure.traceback


def test_code_pickled_by_value_shows_its_file_line_and_source():
    def lookup():
        return {}["missing"]

    def fail():
        try:
            lookup()
        except KeyError as exc:
            raise TwoArguments("a", 2) from exc

    shipped = cloudpickle.loads(cloudpickle.dumps(fail))  # nested: pickled by value
    try:
        shipped()
    except TwoArguments as exc:
        text = RemoteFailure.from_exception(exc, "running the method", exc.__traceback__).traceback
    assert "<dynamic-code>" not in text
    raise_line = fail.__code__.co_firstlineno + 4
    lookup_line = lookup.__code__.co_firstlineno + 1
    assert f'File "{__file__}", line {raise_line}, in fail\n' in text
    assert '    raise TwoArguments("a", 2) from exc\n' in text
    assert f'File "{__file__}", line {lookup_line}, in lookup\n' in text
    assert '    return {}["missing"]\n' in text


def test_a_membership_change_names_the_nodes_their_ranks_and_why():
    error = MembershipChanged(
        [NodeInfo(None, "10.0.0.9:32300")], [NodeInfo(1, "10.0.0.6:32300", (2, 3))],
        "train", "its connection ended")
    assert str(error) == (
        "the group's nodes changed while train() ran: removed node 1 (agent at "
        "10.0.0.6:32300, ranks [2, 3]): its connection ended; added the agent at "
        "10.0.0.9:32300 (not in the group yet); group.resize() admits the new nodes")
    assert error.removed[0].ranks == (2, 3) and error.added[0].node is None
