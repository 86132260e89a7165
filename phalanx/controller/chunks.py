"""Rows of kept results, without the bytes: ``ref[a:b]``, ``ref[[0, 2, 5]]``,
``ref[mask]`` and ``px.chunk(refs, n)``.

An RL loop's generators and trainers rarely number the same: four generator ranks keep
rollouts that three trainer ranks must split between them, often less the rows the
controller dropped (GRPO's groups whose rewards all tie). A :class:`SliceRef` names rows
of one or several kept results (:class:`~phalanx.controller.refs.ResultRef`\\ s, of any
groups) -- ``ref[...]`` on one, :func:`chunk` across several -- and goes into any call as
a handle does. The rank that receives it reads each producer's value where it is (a
mapping of the producer's memory on one machine, Ray's store on Ray), cuts the rows out
(a run of rows as views, nothing copied; picked rows gathered as numpy's ``a[[0, 2]]``
does) and joins the cuts into one value (arrays concatenated, dicts and tuples of arrays
field by field; see :mod:`phalanx.rank.rows`). No byte crosses the controller; ``get()``
fetches the rows here. Which rows a handle names is pure logic
(:mod:`phalanx.world.rowselect`); a chunk's ``indices`` say which of its input's rows it
holds, for the controller to cut its own per-row arrays alike.

A slice holds the handles it cuts from: they live as long as it does. Freeing one of
them frees its rows in every slice (the slice then raises
:class:`~phalanx.errors.ObjectFreed` where it is passed).
"""

from __future__ import annotations

from collections.abc import Iterable

from phalanx.controller.refs import Part, ResultRef, SliceRef, rows_of
from phalanx.world import rowselect


def chunk(refs: Iterable[ResultRef | SliceRef], n: int, *,
          select: object = None) -> list[SliceRef]:
    """``n`` handles covering the rows of ``refs`` one after the other, in order, their
    sizes differing by at most one row (the first ones the larger).

    ``refs`` are kept results (``keep=True``, ``px.keep()``) or handles on rows of them
    (``ref[a:b]``, ``ref[[0, 2]]``, other chunks), of any groups; a chunk that spans
    several of them reaches its rank as one value (their rows joined: see
    :mod:`phalanx.controller.chunks`). No ``refs`` at all give ``n`` empty chunks, each
    read by its rank as an empty list. Nothing is read or sent here.

    Each chunk's ``indices`` are the numbers of its rows among all of ``refs``' rows one
    after another: ``advantages[c.indices]`` cuts a per-row array of the controller's to
    the rows chunk ``c`` delivers. ``select``: only these of those rows are cut into
    chunks, in this order -- row numbers or a mask of bools, as ``ref[...]`` takes them
    (the chunks' ``indices`` are then the numbers of the rows each holds)."""
    refs = list(refs)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"chunk(): n must be an int, not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"chunk(): n must be at least 1, got {n}")
    parts: list[Part] = []
    for i, ref in enumerate(refs):
        if isinstance(ref, SliceRef):
            parts.extend(ref.parts)
        else:
            parts.append((ref, range(rows_of(ref, f"handle {i}"))))  # TypeError if not
    total = rowselect.count_rows(parts)
    rows: rowselect.Rows = range(total)
    if select is not None:
        rows = rowselect.index_rows(select, total, "chunk(select=...): rows")
    return [SliceRef(rowselect.narrow(parts, piece), piece)
            for piece in rowselect.split(rows, n)]
