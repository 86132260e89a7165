"""Rows of a value: how a kept result is counted, sliced and joined along its first axis.

A handle on a kept result can be sliced (``ref[a:b]``) and several can be re-cut into
equal parts (``px.chunk``) when the value has *rows*: it is

- an array (anything with a ``shape`` of at least one dimension: numpy, torch, jax):
  its rows are its first axis;
- a dict or tuple (named tuples too) of such arrays, all with the same first dimension (a
  batch of fields: ``{"tokens": ..., "lengths": ...}``): each field is cut the same way;
- a list: its items are its rows, whatever they are (rollouts of different lengths; a
  list's meaning never depends on its items' lengths, so its cuts join back the same way).

A handle names rows of a value as :data:`~phalanx.world.rowselect.Rows`: a run
(``ref[a:b]``), which :func:`take` cuts as views (of shared memory: nothing is copied),
or picked row numbers (``ref[[0, 2, 5]]``, ``ref[mask]``), which :func:`pick` gathers
into a value of their own as numpy's ``a[[0, 2, 5]]`` does (each field of a dict alike,
a list's items by number). Nothing here does I/O or imports numpy or torch itself (a
value's own type says which it is); the rank cuts what it reads and joins the parts of a
handle that spans several producers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a handle's rows are; the rank never needs the module itself
    from phalanx.world.rowselect import Rows


class Shape(enum.Enum):
    """How a value's rows are laid out."""

    ARRAY = "array"  # its first axis
    FIELDS = "fields"  # a dict / list / tuple of arrays sharing a first dimension
    ITEMS = "items"  # a list's items


def _first_dim(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    if type(value) is type or not isinstance(shape, Sequence) or not shape:
        return None
    try:
        return int(shape[0])
    except (TypeError, ValueError):  # a symbolic dimension
        return None


def _fields(value: Any) -> list[Any] | None:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, tuple):
        return list(value)
    return None


def _rebuild(like: tuple[Any, ...], fields: Any) -> tuple[Any, ...]:
    """A tuple of ``like``'s type holding ``fields`` (a named tuple takes them one by one)."""
    if hasattr(like, "_fields"):
        return type(like)(*fields)
    return type(like)(fields)


def layout(value: Any) -> tuple[Shape, int] | None:
    """How ``value``'s rows are laid out and how many there are; None if it has none."""
    rows = _first_dim(value)
    if rows is not None:
        return Shape.ARRAY, rows
    if isinstance(value, list):
        return Shape.ITEMS, len(value)
    fields = _fields(value)
    if fields:
        dims = {_first_dim(f) for f in fields}
        if len(dims) == 1 and None not in dims:
            return Shape.FIELDS, int(dims.pop())  # type: ignore[arg-type]
    return None


def rows_of(value: Any) -> int | None:
    """The number of rows of ``value`` (see the module's docstring); None if it has none."""
    found = layout(value)
    return None if found is None else found[1]


def _layout_or_refuse(value: Any) -> tuple[Shape, int]:
    found = layout(value)
    if found is None:
        raise TypeError(f"a {type(value).__name__} has no rows to slice: only arrays, "
                        "tensors, lists, and dicts / tuples of arrays with one first "
                        "dimension do")
    return found


def take(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of ``value`` (views where the value's type makes them)."""
    shape, rows = _layout_or_refuse(value)
    if start == 0 and stop >= rows:
        return value
    if shape is not Shape.FIELDS:
        return value[start:stop]
    if isinstance(value, dict):
        return {key: field[start:stop] for key, field in value.items()}
    return _rebuild(value, [field[start:stop] for field in value])


def pick(value: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of ``value`` (row numbers within its rows, in that order; a number
    may repeat), gathered into a new value of its kind: an array indexed by them (numpy,
    torch, jax: by its own library), each field of a dict or tuple of arrays alike, a
    list's items by number."""
    shape, _ = _layout_or_refuse(value)
    if shape is Shape.ARRAY:
        return _gather(value, indices)
    if shape is Shape.ITEMS:
        return [value[i] for i in indices]
    if isinstance(value, dict):
        return {key: _gather(field, indices) for key, field in value.items()}
    return _rebuild(value, [_gather(field, indices) for field in value])


def cut(value: Any, rows: Rows) -> Any:
    """``rows`` of ``value``: a run by :func:`take` (views), picked rows by :func:`pick`."""
    if isinstance(rows, range):
        return take(value, rows.start, rows.stop)
    return pick(value, rows)


def _gather(array: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of an array, indexed by an array of its own library (on its
    device): torch takes a list as numpy does, but jax refuses one."""
    library = type(array).__module__.partition(".")[0]
    if library == "torch":
        import torch

        return array[torch.as_tensor(indices, dtype=torch.long, device=array.device)]
    if library in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return array[jnp.asarray(indices, dtype=int)]
    import numpy

    return array[numpy.asarray(indices, dtype=numpy.intp)]


def join(values: Sequence[Any]) -> Any:
    """The rows of ``values`` one after the other, as one value of their kind (arrays
    concatenated; dicts, lists and tuples of arrays field by field; lists of items
    chained); no values at all (a handle on no kept result), an empty list. TypeError
    naming the first part that does not match the first."""
    if not values:
        return []
    if len(values) == 1:
        return values[0]
    first = values[0]
    found = layout(first)
    if found is None:
        raise TypeError(f"cannot join parts of type {type(first).__name__}: they have no rows")
    shape = found[0]
    for i, value in enumerate(values[1:], 1):
        other = layout(value)
        if other is None or other[0] is not shape or type(value) is not type(first) or (
                shape is Shape.FIELDS and not _same_fields(first, value)):
            raise TypeError(f"cannot join the parts of a chunk: part {i} is "
                            f"{_kind(value)}, part 0 {_kind(first)}")
    if shape is Shape.ARRAY:
        return _concatenate(values)
    if shape is Shape.ITEMS:
        return [item for value in values for item in value]
    if isinstance(first, dict):
        return {key: _concatenate([v[key] for v in values]) for key in first}
    return _rebuild(first, [_concatenate(list(column)) for column in zip(*values, strict=True)])


def _same_fields(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b)
    return len(a) == len(b)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict of {sorted(map(str, value))}"
    found = layout(value)
    shape = "" if found is None else f" ({found[0].value}, {found[1]} rows)"
    return f"a {type(value).__name__}{shape}"


def _concatenate(arrays: Sequence[Any]) -> Any:
    """Arrays of one library, joined along their first axis by that library."""
    library = type(arrays[0]).__module__.partition(".")[0]
    if library == "torch":
        import torch

        return torch.cat(list(arrays))
    if library in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.concatenate(list(arrays))
    import numpy

    return numpy.concatenate(arrays)
