"""Which rows a handle names, as pure logic: ``ref[a:b]``, ``ref[[0, 2, 5]]``, ``ref[mask]``
and ``px.chunk``, normalised and composed without reading a byte.

A handle on rows of kept results (:class:`phalanx.controller.refs.SliceRef`) is a list of
*parts*, ``(source, rows)`` pairs, one after another: a source is a kept result (on the
controller's side) or where it is read (on the wire), and its :data:`Rows` are

- a run: a ``range`` of step 1 (``range(2, 5)``: rows 2, 3 and 4). A rank reads it as
  views of the producer's memory, nothing copied;
- picked rows: a tuple of row numbers, each within the source's rows, in the order asked
  (``(5, 0, 2)``; a number may repeat, as in numpy's indexing). A rank gathers them
  into a value of their own (numpy's ``a[[5, 0, 2]]``).

Picked rows that form a run are always written as the run (:func:`canonical`), so that
``ref[[2, 3, 4]]`` is read as views as ``ref[2:5]`` is. Every part names at least one row,
except the one part of a handle on no rows (which keeps a source so that its value has a
type: an empty array of the right columns, an empty dict of arrays); a handle of no parts
at all (``px.chunk([], n)``) reads as an empty list.

:func:`index_rows` turns what a user puts between brackets into :data:`Rows` (or says what
is wrong with it); :func:`narrow` takes such rows of a list of parts (a slice of a
slice, a selection of a chunk, ...); :func:`split` cuts rows into ``n`` chunks. Nothing
here reads a value, so all of it is checked by hypothesis against Python's and numpy's
own indexing.

May import: the standard library only (it is handed numpy arrays, but reads them through
their ``ndim``, ``dtype`` and ``tolist()``).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union

Rows = Union[range, tuple[int, ...]]  # noqa: UP007 - a runtime alias on 3.10
"""Rows of one value, in order: a run (``range``, step 1) or picked row numbers."""

S = TypeVar("S")  # a part's source: a kept result's handle, or where a rank reads it

# how many row numbers an error message shows of a long selection
_SHOWN = 6


def canonical(picked: Sequence[int]) -> Rows:
    """``picked`` row numbers as :data:`Rows`: the run they form, if they do (none: an
    empty run), else a tuple."""
    if isinstance(picked, range):
        return picked
    n = len(picked)
    if n == 0:
        return range(0)
    first = picked[0]
    if picked[-1] - first == n - 1 and all(
            b - a == 1 for a, b in itertools.pairwise(picked)):
        return range(first, first + n)
    return tuple(picked)


Name = Union[str, Callable[[], str]]  # noqa: UP007 - a runtime alias on 3.10
"""What a message calls the value indexed: a string, or what makes one (a handle's
``__repr__``: made only for an error, never on the way of an index that is fine)."""


def index_rows(index: object, count: int, what: Name) -> Rows:
    """The rows of a value of ``count`` rows that ``value[index]`` names, for a handle
    called ``what`` in messages.

    ``index`` is a slice (step 1: rows are cut in one piece), a list or ``range`` of row
    numbers (negative ones counted from the end, as Python's; a number may repeat), a list
    of bools with one per row (a mask: the rows where it is true), or a one-dimensional
    array (numpy, torch, ...) of either. TypeError for any other index (a single row
    number, a tuple, floats, strings), IndexError for a row number out of range or a mask
    of another length, ValueError for a slice of another step."""
    if isinstance(index, slice):
        start, stop, step = index.indices(count)
        if step != 1:
            raise ValueError(f"{_named(what)}[{_slice_text(index)}]: rows are cut in one "
                             "piece (step 1); pick others by a list of row numbers "
                             "(ref[[0, 2, 4]])")
        return range(start, max(start, stop))
    items, kind = _items(index, what)
    if kind == "mask":
        if len(items) != count:
            raise IndexError(f"{_named(what)}[mask]: a mask of length {len(items)} for a value of "
                             f"{count} rows (it needs one bool per row)")
        return canonical([row for row, keep in enumerate(items) if keep])
    picked = []
    for row in items:
        if not -count <= row < count:
            raise IndexError(f"{_named(what)}[{_rows_text(items)}]: row {row} is out of range for "
                             f"its {count} rows")
        picked.append(row + count if row < 0 else row)
    return canonical(picked)


def _named(what: Name) -> str:
    return what if isinstance(what, str) else what()


def _items(index: object, what: Name) -> tuple[Sequence[Any], str]:
    """The items of a selection, and whether they are a ``"mask"`` or ``"numbers"``."""
    if isinstance(index, tuple):
        # numpy reads a[0, 2] (a tuple) as a row and a column, never as rows 0 and 2
        hint = f": write ref[{list(index)!r}]" if all(
            isinstance(i, int) for i in index) else ""
        raise TypeError(f"{_named(what)}[{index!r}]: rows are picked by a list, not a tuple (a "
                        f"tuple indexes several dimensions){hint}")
    if isinstance(index, range):
        return index, "numbers"
    if isinstance(index, list):
        return _classify(index, what)
    ndim = getattr(index, "ndim", None)
    if ndim == 0 or (ndim is None and hasattr(index, "__index__")):  # one row number
        raise TypeError(f"{_named(what)}[{index!r}]: a handle is indexed by rows, as ref[a:b] or "
                        f"ref[[{index!r}]] (a handle on that one row)")
    if ndim is not None and callable(getattr(index, "tolist", None)) and not isinstance(
            index, type):
        if ndim != 1:
            raise TypeError(f"{_named(what)}[...]: rows are picked by a one-dimensional array, "
                            f"not one of {ndim} dimensions")
        dtype = getattr(index, "dtype", None)
        kind = getattr(dtype, "kind", None)  # numpy's (and jax's); torch's dtypes have none
        if kind is not None and kind not in "biuO":
            raise TypeError(f"{_named(what)}[...]: rows are picked by an array of integers or "
                            f"bools, not of {dtype}")
        listed = index.tolist()  # type: ignore[attr-defined]  # checked callable above
        if kind == "b":
            return listed, "mask"
        if kind in ("i", "u"):
            return listed, "numbers"
        return _classify(listed, what)  # torch's tensors, numpy's object arrays
    raise TypeError(f"{_named(what)}[{index!r}]: a handle is indexed by rows: a slice (ref[a:b]), "
                    "a list of row numbers (ref[[0, 2, 5]]) or a mask of bools, one per row")


def _classify(items: list[Any], what: Name) -> tuple[list[Any], str]:
    """A list's items as row numbers or a mask; TypeError naming the first item that is
    neither, or a list that mixes them."""
    bools = numbers = 0
    out: list[Any] = []
    for item in items:
        if isinstance(item, bool) or _is_numpy_bool(item):
            bools += 1
            out.append(bool(item))
            continue
        try:
            out.append(operator.index(item))
        except TypeError:
            raise TypeError(f"{_named(what)}[...]: rows are picked by integers or bools, not "
                            f"{type(item).__name__} ({item!r})") from None
        numbers += 1
    if bools and numbers:
        raise TypeError(f"{_named(what)}[...]: a selection mixes bools and row numbers; give "
                        "either a mask (one bool per row) or row numbers")
    return out, "mask" if bools else "numbers"


def _is_numpy_bool(item: object) -> bool:
    kind = type(item)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def _slice_text(index: slice) -> str:
    parts = ["" if p is None else repr(p) for p in (index.start, index.stop, index.step)]
    return ":".join(parts)


def _rows_text(items: Sequence[Any]) -> str:
    shown = ", ".join(map(repr, list(items[:_SHOWN])))
    more = f", ... {len(items)} in all" if len(items) > _SHOWN else ""
    return f"[{shown}{more}]"


def count_rows(parts: Sequence[tuple[S, Rows]]) -> int:
    """How many rows ``parts`` name together."""
    total = 0
    for _, rows in parts:  # (a loop: a handle has a few parts, and sum() of a generator
        total += len(rows)  # costs twice as much on each handle made)
    return total


def narrow(parts: Sequence[tuple[S, Rows]], rows: Rows) -> list[tuple[S, Rows]]:
    """The parts naming ``rows`` of the rows of ``parts`` one after another (each row
    number in range: :func:`index_rows`). Never empty while ``parts`` is not: no rows
    keep an empty part of a source (see the module's docstring)."""
    if isinstance(rows, range):
        return _cut(parts, rows.start, rows.stop)
    return _pick(parts, rows)


def _cut(parts: Sequence[tuple[S, Rows]], start: int, stop: int) -> list[tuple[S, Rows]]:
    out: list[tuple[S, Rows]] = []
    offset = 0
    for source, rows in parts:
        end = offset + len(rows)
        if start < end and offset < stop and offset < end:  # it has rows in [start, stop)
            lo = start - offset if start > offset else 0
            hi = (stop if stop < end else end) - offset
            if type(rows) is range:  # (made, not sliced: px.chunk's path, at every step)
                out.append((source, range(rows.start + lo, rows.start + hi)))
            else:
                out.append((source, canonical(rows[lo:hi])))
        offset = end
    if not out and parts:
        out.append(_empty(parts, start))
    return out


def _empty(parts: Sequence[tuple[S, Rows]], row: int) -> tuple[S, Rows]:
    """No rows, at ``row`` of the part it falls in (the end of the last one past it)."""
    offset = 0
    for source, rows in parts:
        if row < offset + len(rows):
            return source, _at(rows, row - offset)
        offset += len(rows)
    source, rows = parts[-1]
    return source, _at(rows, len(rows))


def _at(rows: Rows, i: int) -> range:
    """An empty run at position ``i`` of ``rows`` (a run's own row there; picked rows
    have no place between them: any empty run reads alike)."""
    if isinstance(rows, range):
        return range(rows.start + i, rows.start + i)
    return range(0)


def _pick(parts: Sequence[tuple[S, Rows]], picked: tuple[int, ...]) -> list[tuple[S, Rows]]:
    """The parts naming the rows ``picked`` of ``parts`` joined, in that order: one part
    for each stretch of them that falls in one source part."""
    if not picked:
        return [_empty(parts, 0)] if parts else []
    ends = list(itertools.accumulate(len(rows) for _, rows in parts))
    out: list[tuple[S, Rows]] = []
    current, start = -1, 0
    rows_of_current: Rows = range(0)
    taken: list[int] = []
    for row in picked:
        if not (current >= 0 and start <= row < ends[current]):
            if taken:
                out.append((parts[current][0], canonical(taken)))
            current = bisect.bisect_right(ends, row)
            rows_of_current = parts[current][1]
            start = ends[current] - len(rows_of_current)
            taken = []
        taken.append(rows_of_current[row - start])
    out.append((parts[current][0], canonical(taken)))
    return out


def split(rows: Rows, n: int) -> list[Rows]:
    """``rows`` cut into ``n`` pieces one after another, their sizes differing by at most
    one row (the first ones the larger)."""
    size, larger = divmod(len(rows), n)
    base = rows.start if isinstance(rows, range) else None
    out: list[Rows] = []
    first = 0
    for i in range(n):
        stop = first + size + (i < larger)
        if base is not None:  # (made, not sliced: px.chunk's path, at every step)
            out.append(range(base + first, base + stop))
        else:
            out.append(canonical(rows[first:stop]))
        first = stop
    return out
