"""Rows of kept results, without the bytes: ``ref[a:b]`` and ``px.chunk(refs, n)``.

An RL loop's generators and trainers rarely number the same: four generator ranks keep
rollouts that three trainer ranks must split between them. A :class:`SliceRef` names
rows of one or several kept results (:class:`~phalanx.controller.refs.ResultRef`s, of
any groups) -- ``ref[a:b]`` on one, :func:`chunk` across several -- and goes into any
call as a handle does. The rank that receives it reads each producer's value where it
is (a mapping of the producer's memory on one machine, Ray's store on Ray), cuts the
rows out (views: nothing is copied) and joins the cuts into one value
(arrays concatenated, dicts and tuples of arrays field by field; see
:mod:`phalanx.rank.rows`). No byte crosses the controller; ``get()`` fetches the rows
here.

A slice holds the handles it cuts from: they live as long as it does. Freeing one of
them frees its rows in every slice (the slice then raises
:class:`~phalanx.errors.ObjectFreed` where it is passed).
"""

from __future__ import annotations

from collections.abc import Iterable

from phalanx.controller.refs import Part, ResultRef, SliceRef, cut, rows_of


def chunk(refs: Iterable[ResultRef | SliceRef], n: int) -> list[SliceRef]:
    """``n`` handles covering the rows of ``refs`` one after the other, in order, their
    sizes differing by at most one row (the first ones the larger).

    ``refs`` are kept results (``keep=True``, ``px.keep()``) or slices of them, of any
    groups; a chunk that spans several of them reaches its rank as one value (their rows
    joined: see :mod:`phalanx.controller.chunks`). Nothing is read or sent here."""
    refs = list(refs)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"chunk(): n must be an int, not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"chunk(): n must be at least 1, got {n}")
    if not refs:
        raise ValueError("chunk(): no handles given")
    parts: list[Part] = []
    for i, ref in enumerate(refs):
        rows = rows_of(ref, f"handle {i}")
        if isinstance(ref, SliceRef):
            parts.extend(ref.parts)
        else:
            parts.append((ref, 0, rows))
    total = sum(stop - start for _, start, stop in parts)
    chunks, first = [], 0
    for i in range(n):
        size = total // n + (i < total % n)
        chunks.append(SliceRef(cut(parts, first, first + size)))
        first += size
    return chunks
