"""Handles on data held outside the controller: :class:`ObjectRef` and its one lifecycle.

Two things give the user a handle on data that lives on the nodes rather than in this
process: ``group.put(obj)`` (the object stored once per node, :mod:`.shared`) and a call
made with ``keep=True`` (each rank's result left on that rank, :mod:`.kept`). Both handles
are :class:`ObjectRef`\\ s -- a kept result's is the subclass :class:`ResultRef`, which
knows its rank and can be fetched -- and both go the same way into a call: anywhere in its
arguments, where the encoder (:meth:`.shared.SharedObjects.encode`) meets them, notes them
and pickles each as what its rank reads; nothing else may pickle one.

Rows of kept results are named by a :class:`SliceRef` (``ref[a:b]``, ``ref[[0, 2]]``,
``ref[mask]``, ``px.chunk``: see :mod:`.chunks`; which rows, as pure logic:
:mod:`phalanx.world.rowselect`), which holds the handles it cuts from and pickles as
where each is read and the rows of it.

Each handle has a record in the table of the part that made it (its *owner*, a
:class:`Keeper`), and every record goes through the one lifecycle :class:`RefState`. The
owner holds the record while calls in flight name it (its ``users``), so that freeing a
handle a running call uses takes effect when that call ends.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from phalanx.errors import ObjectFreed, ObjectLost
from phalanx.rank import kept as rankkept
from phalanx.rank import rows as rowslib
from phalanx.world import rowselect
from phalanx.world.rowselect import Rows


class RefState(enum.Enum):
    """Where the data behind a handle is in its life.

    ``LIVE``
        Held where it was made; a call may name it.
    ``FREED``
        Its handle was freed (``free()``, its last reference dropped) while calls in
        flight named it: no new call may; its holder lets go once the last of them ends.
    ``RELEASED``
        Its holder was told to let go (or the group shut down, taking it along). Final.
    ``LOST``
        Its holder died with it (the rank that kept a result). Final.

    Legal moves (any other is refused: a late free cannot revive or release twice)::

        LIVE      -> FREED | RELEASED | LOST
        FREED     -> RELEASED | LOST
        RELEASED  -> (none)
        LOST      -> (none)
    """

    LIVE = "live"
    FREED = "freed"
    RELEASED = "released"
    LOST = "lost"


_LEGAL = {
    RefState.LIVE: frozenset({RefState.FREED, RefState.RELEASED, RefState.LOST}),
    RefState.FREED: frozenset({RefState.RELEASED, RefState.LOST}),
    RefState.RELEASED: frozenset(),
    RefState.LOST: frozenset(),
}


class Record:
    """The controller's record of one held thing: its state, the calls using it, and why it
    ended when its handle did not end it (lost with its holder, its group shut down).
    Moved only under its owner's lock."""

    __slots__ = ("state", "users", "why")

    def __init__(self) -> None:
        self.state = RefState.LIVE
        self.users = 0  # calls in flight that name it
        self.why: str | None = None  # why it is LOST, or RELEASED without free()

    def move(self, to: RefState) -> bool:
        """Go to ``to`` if that is a legal move from here; whether it was."""
        if to not in _LEGAL[self.state]:
            return False
        self.state = to
        return True

    def free(self) -> bool:
        """The handle was freed: FREED while calls use it (False), else RELEASED (True:
        the holder must be told now). Nothing to do once it is no longer LIVE."""
        if self.state is not RefState.LIVE:
            return False
        if self.users:
            self.state = RefState.FREED
            return False
        self.state = RefState.RELEASED
        return True

    def unuse(self) -> bool:
        """A call that named it ended; True when that leaves a freed record unused (the
        holder must be told now)."""
        self.users -= 1
        if self.users == 0 and self.state is RefState.FREED:
            self.state = RefState.RELEASED
            return True
        return False

    @property
    def usable(self) -> bool:
        return self.state is RefState.LIVE


class Keeper(Protocol):
    """What owns records and makes their handles (a group's :class:`.shared.SharedObjects`
    or :class:`.kept.KeptResults`)."""

    def free(self, record: Any) -> None:
        """The handle of ``record`` was freed (see :meth:`Record.free`)."""

    def describe(self, record: Any) -> str:
        """What it is, for messages."""
        ...

    def reduce(self, ref: Any, consumer: Any) -> tuple[Any, ...]:
        """How handle ``ref`` pickles into a call of ``consumer`` (a group's
        :class:`.shared.SharedObjects`): what a rank calls to read it, and with what;
        TypeError / ObjectFreed / ObjectLost when it cannot go there."""
        ...


class ObjectRef:
    """A handle on data held outside the controller: an object stored once per node by
    :meth:`WorkerGroup.put`, or (:class:`ResultRef`) a result kept on a rank.

    Pass it anywhere in a call's arguments -- of its group, or of any other group on the
    same backend, whose nodes then hold a copy until it is freed; each rank receives the
    object. ``free()``
    releases it (so does dropping the last reference, and its group's shutdown);
    afterwards it raises :class:`~phalanx.errors.ObjectFreed` wherever it is passed.
    """

    __slots__ = ("__weakref__", "_finalizer", "_owner", "_record")
    # where it may be passed
    _GOES_TO = "calls of any group on the backend of the WorkerGroup that put it"

    def __init__(self, owner: Keeper, record: Record) -> None:
        self._owner = owner
        # a PutRecord or a KeptRecord: its id, nbytes, label (and rank) are the owner's
        self._record: Any = record
        self._finalizer = weakref.finalize(self, owner.free, record)
        self._finalizer.atexit = False  # the group's shutdown frees what is left

    @property
    def record(self) -> Any:
        """Its record in its owner's table (what the owner's interface takes)."""
        return self._record

    @property
    def owner(self) -> Keeper:
        return self._owner

    @property
    def state(self) -> RefState:
        state: RefState = self._record.state  # a Record's (_record: Any for its kinds' fields)
        return state

    @property
    def id(self) -> int:
        return int(self._record.id)

    @property
    def nbytes(self) -> int:
        """The size of its pickle and buffers: what is held for it."""
        return int(self._record.nbytes)

    @property
    def freed(self) -> bool:
        """Whether its handle was freed (it may still be held for calls in flight)."""
        return self._record.state in (RefState.FREED, RefState.RELEASED)

    def free(self) -> None:
        """Release the data (once the calls in flight that use it end). Idempotent."""
        self._finalizer()

    def reduce_for(self, consumer: Any) -> tuple[Any, ...]:
        """How this handle pickles into a call of ``consumer``'s group (see
        :meth:`Keeper.reduce`); the encoder's hook calls it."""
        return self._owner.reduce(self, consumer)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(f"{self!r} can only be passed in the arguments of {self._GOES_TO} "
                        "(phalanx pickles it there as what the rank reads)")

    def __copy__(self) -> ObjectRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ObjectRef:
        return self

    def __repr__(self) -> str:
        record = self._record
        return (f"<ObjectRef {record.id}: {record.label}, {size_text(record.nbytes)}"
                f"{_state_text(record)}>")


class ResultRef(ObjectRef):
    """A handle on a result kept on the rank that made it (``keep=True``).

    Pass it in any call of any group: the rank reads the value from the producer
    directly. ``get()`` fetches it here; one whose producer died raises
    :class:`~phalanx.errors.ObjectLost` naming it.
    """

    __slots__ = ()
    _GOES_TO = "a group's calls"

    @property
    def rank(self) -> int:
        return int(self._record.rank)

    @property
    def rows(self) -> int | None:
        """Its value's first dimension -- an array's, a list's length, the common one of a
        dict or tuple of arrays -- or None when it has none (see :func:`px.chunk
        <phalanx.controller.chunks.chunk>`)."""
        rows = self._record.rows
        return None if rows is None else int(rows)

    def get(self, timeout: float | None = None) -> Any:
        """The value, fetched to the controller (arrays read-only views where the producer
        is on this machine or on Ray; otherwise asked of the producing rank)."""
        owner: Any = self._owner
        return owner.get(self, timeout)

    def to_ray(self) -> Any:
        """A Ray ``ObjectRef`` of its value, for Ray code (``ray.get``, an actor's
        ``.remote()``), on the Ray backend: Ray's store makes it from the kept bytes, the
        controller never holding them. It lives as Ray's references do, apart from this
        handle. TypeError on another backend. A Ray ``ObjectRef`` passed as a call's
        argument reaches the method as its value, fetched by Ray on the rank."""
        owner: Any = self._owner
        return owner.to_ray(self)

    def __getitem__(self, index: object) -> SliceRef:
        """Rows of its value, as a :class:`SliceRef` (nothing is read until a rank's call
        names it): ``ref[a:b]``, ``ref[[0, 2, 5]]`` (row numbers, in that order) or
        ``ref[mask]`` (one bool per row); see :func:`phalanx.world.rowselect.index_rows`."""
        return slice_ref(self, index)

    def __repr__(self) -> str:
        record = self._record
        return (f"<ResultRef {self._owner.describe(record)}: {size_text(record.nbytes)}"
                f"{_state_text(record)}>")


Part = tuple[ResultRef, Rows]  # a kept result and rows of it (a run, or picked rows)


class SliceRef:
    """A handle on rows of kept results, in order: made by ``ref[a:b]``, ``ref[[0, 2]]``,
    ``ref[mask]`` or :func:`chunk`.

    Pass it anywhere in a call's arguments (any group's): the rank receives one value
    holding those rows (an empty list where it names no kept result at all: a chunk of
    ``px.chunk([], n)``). ``rows`` is how many; ``indices`` where they are in what it was
    cut from; ``get()`` fetches them here; indexing it again (``part[a:b]``,
    ``part[[1, 0]]``, ``part[mask]``) narrows it.
    """

    __slots__ = ("_indices", "_parts")

    def __init__(self, parts: Sequence[Part], indices: Rows | None = None) -> None:
        """``parts``: see :attr:`parts`; ``indices``: one for each of their rows (None:
        ``range(rows)``, the rows of the parts themselves)."""
        self._parts = parts if type(parts) is tuple else tuple(parts)
        self._indices = indices

    @property
    def parts(self) -> tuple[Part, ...]:
        """``(handle, rows)`` for each kept result it cuts rows from, in order: ``rows`` a
        ``range`` (a run of them, read as views) or a tuple of row numbers (picked ones,
        gathered into a value of their own). Empty for a handle on no kept result."""
        return self._parts

    @property
    def refs(self) -> tuple[ResultRef, ...]:
        return tuple(ref for ref, _ in self._parts)

    @property
    def rows(self) -> int:
        return rowselect.count_rows(self._parts)

    @property
    def indices(self) -> range | list[int]:
        """Where its rows are in what it was cut from, in order: the rows of ``ref`` for
        ``ref[...]``, of all of ``refs`` one after another for ``px.chunk(refs, n)``. A
        ``range`` when they are a run (a chunk's always are, unless ``select=`` picked its
        rows), else a list: index the controller's own per-row arrays with it
        (``advantages[c.indices]``, numpy or torch) to line them up with the rows the
        rank receives."""
        indices = self._indices
        if indices is None:
            return range(self.rows)
        return indices if isinstance(indices, range) else list(indices)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: object) -> SliceRef:
        rows = rowselect.index_rows(index, self.rows, self.__repr__)
        return SliceRef(rowselect.narrow(self._parts, rows), rows)

    def get(self, timeout: float | None = None) -> Any:
        """The rows, fetched to the controller (see :meth:`ResultRef.get`; each kept
        result once, however many parts cut it)."""
        values: dict[ResultRef, Any] = {}
        for ref, _ in self._parts:
            if ref not in values:
                values[ref] = ref.get(timeout)
        return rowslib.join([rowslib.cut(values[ref], rows) for ref, rows in self._parts])

    def reduce_for(self, consumer: Any) -> tuple[Any, ...]:
        """How it pickles into a call of ``consumer``'s group: where each kept result it
        cuts is read (as its handle pickles there), once however many parts cut it, and
        each part's rows (:func:`rankkept.read_rows`)."""
        sources: dict[ResultRef, int] = {}
        places: list[Any] = []
        parts: list[tuple[int, Rows]] = []
        for ref, rows in self._parts:
            source = sources.get(ref)
            if source is None:
                source = sources[ref] = len(places)
                places.append(ref.reduce_for(consumer)[1])
            parts.append((source, rows))
        return rankkept.read_rows, (places, parts)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(f"{self!r} can only be passed in the arguments of a group's calls "
                        "(phalanx pickles it there as what the rank reads)")

    def __repr__(self) -> str:
        if not self._parts:
            return "<SliceRef of 0 rows: no kept result>"
        spans = ", ".join(f"{ref.owner.describe(ref.record)} {_rows_text(rows)}"
                          for ref, rows in self._parts[:3])
        more = f", and {len(self._parts) - 3} more" if len(self._parts) > 3 else ""
        nbytes = sum(ref.nbytes for ref in set(self.refs))
        return f"<SliceRef of {self.rows} rows: {spans}{more} (of {size_text(nbytes)})>"


def _rows_text(rows: Rows) -> str:
    if isinstance(rows, range):
        return f"[{rows.start}:{rows.stop}]"
    shown = ", ".join(map(str, rows[:4]))
    return f"[[{shown}{', ...' if len(rows) > 4 else ''}]] ({len(rows)} rows)"


def rows_of(ref: Any, what: str = "the handle") -> int:
    """How many rows ``ref`` (a ResultRef or a SliceRef) names; TypeError naming ``what``
    when it is neither or its value has no rows."""
    if isinstance(ref, SliceRef):
        return ref.rows
    if not isinstance(ref, ResultRef):
        raise TypeError(f"{what} is {ref!r}: only kept results (ResultRef, SliceRef) have "
                        "rows; put() objects and plain values do not")
    rows = ref.record.rows
    if rows is None:
        raise TypeError(f"{what} ({ref!r}) has no rows: its value is not an array, a tensor, "
                        "a list, or a dict / tuple of arrays with one first dimension")
    return int(rows)


def slice_ref(ref: ResultRef, index: object) -> SliceRef:
    """``ref[index]`` (``ResultRef.__getitem__``)."""
    rows = rowselect.index_rows(index, rows_of(ref), ref.__repr__)
    return SliceRef([(ref, rows)], rows)


def _state_text(record: Record) -> str:
    if record.state is RefState.LIVE:
        return ""
    return f", lost: {record.why}" if record.state is RefState.LOST else ", freed"


def check_usable(record: Record, ref: Any) -> None:
    """ObjectFreed / ObjectLost unless ``record`` may be named by a new call."""
    if record.state is RefState.LIVE:
        return
    if record.state is RefState.LOST:
        raise ObjectLost(f"{ref.owner.describe(record)} is lost: {record.why}")
    if record.why is not None:
        raise ObjectFreed(f"{ref!r} was freed: {record.why}; {_again(ref)}")
    raise ObjectFreed(f"{ref!r} was freed; {_again(ref)}")


def _again(ref: Any) -> str:
    return ("keep the result again to use it" if isinstance(ref, ResultRef) else
            "put the object again to use it")


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: "1.5 MiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
