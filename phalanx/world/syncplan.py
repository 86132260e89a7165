"""Weights moved by parts (pure): what each source rank holds of a tensor, what each target
rank wants of it, and the plan that moves every wanted element exactly once.

A tensor of a state dict is named and has a *full* shape. A source rank holds a block of
it (:class:`Block`: a whole tensor, a tensor-parallel shard, a replica of either; a user's
``get`` says so with :class:`Shard`); a target rank wants a region of it (a user's ``want``
says so with :class:`Region`, or None for the whole tensor). :func:`plan` turns the blocks
of every source and the regions of every target into :class:`Transfer` records, once per
formation::

    sources = {0: [Block("w", (0, 0), (2, 8), (8, 8), "float32", 4)], 1: [...], ...}
    targets = {(0, 0): {"w": Region((0, 0), (8, 4))}, (0, 1): {"w": None}}
    p = plan(sources, targets)
    p.for_source(0)      # what source 0 sends: to whom, which box of its block
    p.for_target((0, 0)) # what (0, 0) receives: from whom, where in its region
    p.wanted[(0, 0)]     # what (0, 0) allocates: per name its region, dtype, item size

How, for one target and one name:

1. **Cut.** The wanted region is cut along every boundary (per dimension) of the source
   blocks that meet it, into elementary boxes; each is held whole by some sources or by
   none (an error naming the part no source holds).
2. **Assign.** Elementary boxes with the same holders form one *piece*; each piece goes
   whole to one holder, the one that has sent the fewest bytes so far over the whole plan
   (ties to the smallest key). Targets go in key order, names in name order, pieces in
   row-major order, so the same input gives the same plan; replicas (data-parallel copies
   of one block) share the load across targets, and their loads differ by at most one
   piece.
3. **Merge.** A source's elementary boxes for the target are merged back, dimension by
   dimension (the last first), wherever two adjacent ones form a box: 4 row-sharded
   sources and a column region make exactly 4 transfers, one per source.

Every wanted element thus comes from one source, directly, and reaches its target once:
``per_target_bytes`` is the sum of the wanted regions' bytes. Partial overlaps between
blocks are allowed (any holder may send). Keys of sources and targets are opaque to the
plan: hashable and sortable among themselves (ranks, ``(group, rank)`` tuples).

Checks, each a ValueError naming the source or target, the name and the box: a block with
a negative number, dimensions that disagree, or reaching past its full shape; sources that
disagree on a name's full shape, dtype or item size; a source holding a name twice; a
target wanting a name no source holds, or a region outside the full shape; a wanted part
that no source holds.

Cuts are computed once per layout (full shape, item size, the sources' blocks) and
wanted region, and the merged boxes once per choice of sources for its pieces: a model's
layers laid out alike, and the targets wanting alike, share them. Measured (CPU time,
python 3.11, a loaded 2-core VM, best of 5), 8 sources, 16 targets each wanting a column
half, 500 names of 4096 x 4096 (``test_a_realistic_model_plans_quickly`` in
tests/unit/test_syncplan.py builds it)::

    8 row shards                         64,000 transfers   0.09 s
    2 replicas of 4 row shards           32,000 transfers   0.06 s
    8 row shards, 500 distinct shapes    64,000 transfers   0.26 s   (nothing shared)

Pure: no I/O, no torch. A :class:`Shard` carries the user's tensor untouched, as Any.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar


class Key(Protocol):
    """A source's or a target's key: hashable, and ordered among its kind."""

    def __hash__(self) -> int: ...

    def __lt__(self, other: Any, /) -> bool: ...


S = TypeVar("S", bound=Key)
T = TypeVar("T", bound=Key)

Dims = tuple[int, ...]


def _whole_numbers(value: Any, what: str) -> Dims:
    """``value`` as a tuple of ints (a list, a tuple, torch.Size, numpy ints), or TypeError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a tuple of whole numbers, got {value!r}")
    numbers = []
    for item in value:
        if isinstance(item, bool):
            raise TypeError(f"{what} must be a tuple of whole numbers, got {value!r}")
        try:
            numbers.append(operator.index(item))
        except TypeError:
            raise TypeError(f"{what} must be a tuple of whole numbers, got {value!r}") from None
    return tuple(numbers)


def _dims(value: Any, what: str) -> Dims:
    """``value`` as a tuple of non-negative ints, or TypeError / ValueError naming it."""
    numbers = _whole_numbers(value, what)
    if any(n < 0 for n in numbers):
        raise ValueError(f"{what} must not be negative, got {numbers}")
    return numbers


# -- regions ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Region:
    """A box of a tensor: ``shape`` elements along each dimension, from ``offset``.

    What a target rank of :func:`weight_sync` wants of a tensor (its ``want`` returns, per
    name, a Region or None for the whole tensor), and how a sync's plan names the parts it
    moves. Both are tuples of non-negative whole numbers of one length (a list is taken
    and made a tuple; a 0-d tensor's region is ``Region((), ())``)::

        px.Region(offset=(0, 512), shape=(4096, 512))   # columns 512..1023 of a 4096-row tensor
        tensor[region.slices()]                        # the region's part of a full tensor
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        offset = _dims(self.offset, "a Region's offset")
        shape = _dims(self.shape, "a Region's shape")
        if len(offset) != len(shape):
            raise ValueError(f"a Region's offset {offset} and shape {shape} must have one "
                             "number per dimension of the tensor, the same count")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        """The region of a whole tensor of ``shape``."""
        dims = _dims(shape, "a tensor's shape")
        return cls((0,) * len(dims), dims)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        """Where it ends along each dimension (exclusive): ``offset + shape``."""
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def volume(self) -> int:
        """Its number of elements."""
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Its index into a tensor of the coordinates it is in: ``tensor[r.slices()]``."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))

    def _same_ndim(self, other: Region) -> None:
        if other.ndim != self.ndim:
            raise ValueError(f"{other} and {self} have different numbers of dimensions")

    def contains(self, other: Region) -> bool:
        """Whether ``other`` lies within this region (an empty one counts by its bounds)."""
        self._same_ndim(other)
        return all(o <= p and p + s <= o + t for o, t, p, s
                   in zip(self.offset, self.shape, other.offset, other.shape, strict=True))

    def intersection(self, other: Region) -> Region | None:
        """The elements both hold, as a region; None when they hold none in common."""
        self._same_ndim(other)
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(h <= a for a, h in zip(lo, hi, strict=True)):
            return None
        return _region(lo, tuple(h - a for a, h in zip(lo, hi, strict=True)))

    def relative_to(self, outer: Region) -> Region:
        """This region in the coordinates of ``outer``, which must contain it."""
        if not outer.contains(self):
            raise ValueError(f"{self} is not within {outer}")
        return _region(_sub(self.offset, outer.offset), self.shape)


def _region(offset: Dims, shape: Dims) -> Region:
    """A Region of numbers already checked: a plan makes tens of thousands."""
    region = object.__new__(Region)
    region.__dict__.update(offset=offset, shape=shape)  # frozen: past __setattr__
    return region


# -- what a source holds ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Shard:
    """The block of a tensor one source rank of :func:`weight_sync` holds.

    Its ``get`` returns, per name, either a whole tensor or a Shard: ``tensor`` is this
    rank's block of the full tensor, whose shape is ``full``, starting at ``offset``
    (a tensor-parallel rank's rows or columns, a grid's cell). Several ranks may hold the
    same block (data-parallel replicas): the sync spreads the sending over them. ::

        px.Shard(weight, offset=(rank * 1024, 0), full=(4096, 4096))

    ``offset`` and ``full`` are tuples of non-negative whole numbers, one per dimension
    of ``tensor``, and the block must lie within ``full``: checked here where ``tensor``
    has a ``shape``, and when the sync plans its transfers in any case. The tensor is kept
    as given (compared by identity, never copied).
    """

    tensor: Any
    offset: tuple[int, ...]
    full: tuple[int, ...]

    def __post_init__(self) -> None:
        offset = _dims(self.offset, "a Shard's offset")
        full = _dims(self.full, "a Shard's full shape")
        if len(offset) != len(full):
            raise ValueError(f"a Shard's offset {offset} and full shape {full} must have one "
                             "number per dimension of the tensor, the same count")
        shape = getattr(self.tensor, "shape", None)
        if shape is not None:
            try:
                dims = _dims(shape, "the shape of a Shard's tensor")
            except (TypeError, ValueError):
                dims = None  # an unusual shape: the plan checks the block it reports
            if dims is not None and (len(dims) != len(full) or any(
                    o + s > f for o, s, f in zip(offset, dims, full, strict=True))):
                raise ValueError(
                    f"a Shard's tensor of shape {dims} at offset {offset} does not fit "
                    f"within its full shape {full}")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "full", full)

    def __repr__(self) -> str:
        shape = getattr(self.tensor, "shape", None)
        held = f"tensor of shape {tuple(shape)}" if shape is not None else type(
            self.tensor).__name__
        return f"Shard({held}, offset={self.offset}, full={self.full})"


@dataclasses.dataclass(frozen=True)
class Block:
    """What a source reports holding of one name: ``shape`` elements from ``offset`` of a
    tensor whose shape is ``full`` (a whole tensor: ``offset`` all zeros, ``shape ==
    full``), its ``dtype`` (as text, compared as given) and the bytes of one element.

    Made from what a rank reported, so only the types are checked here; :func:`plan`
    checks the numbers, naming the source.
    """

    name: str
    offset: Dims
    shape: Dims
    full: Dims
    dtype: str
    itemsize: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a block's name must be str, got {self.name!r}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"block {self.name!r}: dtype must be str, got {self.dtype!r}")
        if isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int):
            raise TypeError(f"block {self.name!r}: itemsize must be an int, got "
                            f"{self.itemsize!r}")
        for field in ("offset", "shape", "full"):
            value = _whole_numbers(getattr(self, field), f"block {self.name!r}'s {field}")
            object.__setattr__(self, field, value)

    @classmethod
    def whole(cls, name: str, full: Sequence[int], dtype: str, itemsize: int) -> Block:
        """A whole tensor's block."""
        dims = tuple(full)
        return cls(name, (0,) * len(dims), dims, dims, dtype, itemsize)

    @property
    def region(self) -> Region:
        return Region(self.offset, self.shape)


# -- the plan --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transfer(Generic[S, T]):
    """One message of a plan: ``box`` of tensor ``name`` (in the full tensor's
    coordinates) from ``source`` to ``target``. ``src_box`` is the same box in the
    coordinates of the source's block (what it slices of its tensor), ``dst_box`` in those
    of the target's region (where it lands in what the target allocated)."""

    source: S
    target: T
    name: str
    box: Region
    src_box: Region
    dst_box: Region
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What a target receives of one name, for it to allocate: ``region`` of the full
    tensor (whose shape is ``full``), its ``dtype`` and item size."""

    name: str
    region: Region
    full: Dims
    dtype: str
    itemsize: int

    @property
    def shape(self) -> Dims:
        return self.region.shape

    @property
    def nbytes(self) -> int:
        return self.region.volume * self.itemsize


@dataclasses.dataclass(frozen=True)
class Plan(Generic[S, T]):
    """Every transfer of one formation (see the module docstring), in target order, then
    name, then the box's offset; and for each target what it allocates (``wanted``),
    the bytes it receives and the bytes each source sends (every source, 0 if none)."""

    transfers: tuple[Transfer[S, T], ...]
    wanted: Mapping[T, Mapping[str, Wanted]]
    per_target_bytes: Mapping[T, int]
    per_source_bytes: Mapping[S, int]
    _by_source: Mapping[S, tuple[Transfer[S, T], ...]] = dataclasses.field(
        repr=False, compare=False)
    _by_target: Mapping[T, tuple[Transfer[S, T], ...]] = dataclasses.field(
        repr=False, compare=False)

    def for_source(self, key: S) -> tuple[Transfer[S, T], ...]:
        """What ``key`` sends, in target order, then name, then offset."""
        if key not in self.per_source_bytes:
            raise KeyError(f"{key!r} is not a source of this plan")
        return self._by_source.get(key, ())

    def for_target(self, key: T) -> tuple[Transfer[S, T], ...]:
        """What ``key`` receives, in name order, then offset."""
        if key not in self.per_target_bytes:
            raise KeyError(f"{key!r} is not a target of this plan")
        return self._by_target.get(key, ())


@dataclasses.dataclass
class _Tensor:
    """One name as the sources hold it: the agreed metadata, and each holder's block as
    (source index, offset, end), in source order."""

    name: str
    full: Dims
    dtype: str
    itemsize: int
    first: Any  # the first source's key, for the messages
    holders: list[tuple[int, Dims, Dims]]

    def layout(self) -> tuple[Any, ...]:
        """What its cuts depend on: names laid out alike (a model's layers) share them."""
        return (self.full, self.itemsize, tuple(self.holders))


# A box as (lo, hi) corners, hi exclusive: the plan's working form, cheap to make.
_Box = tuple[Dims, Dims]


@dataclasses.dataclass
class _Cut:
    """A wanted region of a layout, cut (the same for every name laid out alike and every
    target wanting it): its pieces -- each the holders (source indices) of its elementary
    boxes, those boxes, and its bytes -- and the transfers made of it, per choice of a
    source for each piece (the fields of each, but the name and the target)."""

    region: Region
    itemsize: int
    starts: dict[int, Dims]  # each holder's block offset
    pieces: list[tuple[list[int], list[_Box], int]]
    moves: dict[tuple[int, ...], list[dict[str, Any]]]


def _sorted_keys(keys: Iterable[Any], kind: str) -> list[Any]:
    try:
        return sorted(keys)
    except TypeError as exc:
        raise TypeError(f"the {kind} keys must be sortable among themselves: {exc}") from None


def _tensors(sources: Mapping[S, Sequence[Block]], order: list[S]) -> dict[str, _Tensor]:
    """Every name the sources hold, checked: each block on its own, then against the
    first source holding the same name."""
    tensors: dict[str, _Tensor] = {}
    for index, key in enumerate(order):
        seen: set[str] = set()
        blocks = sources[key]
        if isinstance(blocks, (str, bytes, Mapping)) or not isinstance(blocks, Iterable):
            raise TypeError(f"source {key!r}: expected a sequence of Blocks, got {blocks!r}")
        for block in blocks:
            if not isinstance(block, Block):
                raise TypeError(f"source {key!r}: expected a Block, got {block!r}")
            where = f"source {key!r} holds {block.name!r}"
            if block.name in seen:
                raise ValueError(f"{where} twice: one block per name and source")
            seen.add(block.name)
            offset, shape, full = block.offset, block.shape, block.full
            if not len(offset) == len(shape) == len(full):
                raise ValueError(
                    f"{where} with offset {offset}, shape {shape} and full shape {full}: "
                    "they must have one number per dimension, the same count")
            if any(n < 0 for n in offset + shape + full):
                raise ValueError(f"{where} with offset {offset}, shape {shape} and full "
                                 f"shape {full}: none may be negative")
            end = tuple(o + s for o, s in zip(offset, shape, strict=True))
            if any(e > f for e, f in zip(end, full, strict=True)):
                raise ValueError(f"{where} at offset {offset} with shape {shape}, which "
                                 f"reaches past its full shape {full}")
            if block.itemsize <= 0 or not block.dtype:
                raise ValueError(f"{where} with dtype {block.dtype!r} of itemsize "
                                 f"{block.itemsize}: a dtype and a positive itemsize")
            tensor = tensors.get(block.name)
            if tensor is None:
                tensors[block.name] = _Tensor(block.name, full, block.dtype, block.itemsize,
                                              key, [(index, offset, end)])
                continue
            if (full, block.dtype, block.itemsize) != (tensor.full, tensor.dtype,
                                                       tensor.itemsize):
                raise ValueError(
                    f"sources disagree on {block.name!r}: source {tensor.first!r} says full "
                    f"shape {tensor.full}, dtype {tensor.dtype} ({tensor.itemsize} bytes); "
                    f"source {key!r} says full shape {full}, dtype {block.dtype} "
                    f"({block.itemsize} bytes)")
            tensor.holders.append((index, offset, end))
    return tensors


def _merge(cells: list[_Box], ndim: int) -> list[_Box]:
    """Boxes that tile a set of grid-aligned cells, adjacent cells joined along each
    dimension in turn (the last first), in row-major order of their corners."""
    if len(cells) == 1:
        return cells  # the usual case: a source's part of a region is one cell
    boxes = cells
    for d in reversed(range(ndim)):
        lines: dict[_Box, list[_Box]] = {}
        for lo, hi in boxes:
            lines.setdefault((lo[:d] + lo[d + 1:], hi[:d] + hi[d + 1:]), []).append((lo, hi))
        merged: list[_Box] = []
        for line in lines.values():
            line.sort(key=lambda box: box[0][d])
            lo, hi = line[0]
            for next_lo, next_hi in line[1:]:
                if next_lo[d] == hi[d]:
                    hi = next_hi  # the same cross-section: only dimension d grows
                else:
                    merged.append((lo, hi))
                    lo, hi = next_lo, next_hi
            merged.append((lo, hi))
        boxes = merged
    return sorted(boxes)


def _describe(boxes: list[_Box]) -> str:
    shown = ", ".join(str(_region(lo, tuple(h - a for a, h in zip(lo, hi, strict=True))))
                      for lo, hi in boxes[:3])
    return shown + (f" and {len(boxes) - 3} more" if len(boxes) > 3 else "")


def _cut(tensor: _Tensor, region: Region, target: Any, source_keys: list[Any]) -> _Cut:
    """``region`` of ``tensor`` cut along its holders' boundaries into pieces (see the
    module docstring), or ValueError naming the part of it no source holds."""
    lo, hi = region.offset, region.end
    ndim = len(lo)
    relevant = [(index, b_lo, b_hi) for index, b_lo, b_hi in tensor.holders
                if all(max(b_lo[d], lo[d]) < min(b_hi[d], hi[d]) for d in range(ndim))]
    axes: list[list[tuple[int, int, int]]] = []  # per dimension: (start, stop, holders' bits)
    for d in range(ndim):
        cuts = {lo[d], hi[d]}
        for _, b_lo, b_hi in relevant:
            cuts.add(max(b_lo[d], lo[d]))
            cuts.add(min(b_hi[d], hi[d]))
        points = sorted(cuts)
        axis = []
        for start, stop in itertools.pairwise(points):
            bits = 0
            for bit, (_, b_lo, b_hi) in enumerate(relevant):
                if b_lo[d] <= start and stop <= b_hi[d]:
                    bits |= 1 << bit
            axis.append((start, stop, bits))
        axes.append(axis)
    everyone = (1 << len(relevant)) - 1
    groups: dict[int, list[_Box]] = {}
    missing: list[_Box] = []
    for cell in itertools.product(*axes):
        bits = everyone
        for _, _, held_by in cell:
            bits &= held_by
        box = (tuple(c[0] for c in cell), tuple(c[1] for c in cell))
        if bits:
            groups.setdefault(bits, []).append(box)
        else:
            missing.append(box)
    if missing:
        parts = _merge(missing, ndim)
        count = sum(math.prod(h - a for a, h in zip(*part, strict=True)) for part in parts)
        held = "; ".join(f"source {source_keys[index]!r} {_region(b_lo, _sub(b_hi, b_lo))}"
                         for index, b_lo, b_hi in tensor.holders[:8])
        raise ValueError(
            f"target {target!r} wants {tensor.name!r} at {region}, but no source holds "
            f"{_describe(parts)} of it ({count} of its {region.volume} elements); the "
            f"sources hold {held}" + (" ..." if len(tensor.holders) > 8 else ""))
    pieces = []
    for bits, boxes in groups.items():
        holders = [relevant[bit][0] for bit in range(len(relevant)) if bits >> bit & 1]
        size = sum(math.prod(_sub(b_hi, b_lo)) for b_lo, b_hi in boxes)
        pieces.append((holders, boxes, size * tensor.itemsize))
    starts = {index: b_lo for index, b_lo, _ in tensor.holders}
    return _Cut(region, tensor.itemsize, starts, pieces, {})


def _sub(a: Dims, b: Dims) -> Dims:
    return tuple(map(operator.sub, a, b))  # of one length, as every box's corners are


def plan(sources: Mapping[S, Sequence[Block]],
         targets: Mapping[T, Mapping[str, Region | None]]) -> Plan[S, T]:
    """The transfers that give every target the regions it wants, each element from one
    source holding it (see the module docstring). ValueError naming what is wrong (a
    source, a target, a name, a box) when the blocks disagree or do not cover a want;
    TypeError for arguments of the wrong type."""
    source_keys: list[S] = _sorted_keys(sources, "source")
    target_keys: list[T] = _sorted_keys(targets, "target")
    tensors = _tensors(sources, source_keys)
    load = [0] * len(source_keys)
    seen: dict[tuple[Any, ...], tuple[Wanted, _Cut]] = {}
    cuts: dict[tuple[Any, ...], _Cut] = {}
    layouts: dict[str, tuple[Any, ...]] = {}
    transfers: list[Transfer[S, T]] = []
    by_target: dict[T, tuple[Transfer[S, T], ...]] = {}
    wanted: dict[T, Mapping[str, Wanted]] = {}
    per_target: dict[T, int] = {}
    new = object.__new__
    for target in target_keys:
        wants = targets[target]
        if not isinstance(wants, Mapping):
            raise TypeError(f"target {target!r}: expected a mapping of name -> Region or "
                            f"None, got {wants!r}")
        first = len(transfers)
        mine: dict[str, Wanted] = {}
        for name in _sorted_keys(wants, f"target {target!r}'s name"):
            region = wants[name]
            # keyed by the region's numbers: a Region's own hash is a Python call
            key = (name,) if region is None else (name, getattr(region, "offset", None),
                                                   getattr(region, "shape", None))
            entry = seen.get(key)
            if entry is None:
                tensor, region = _checked(tensors, target, name, region)
                layout = layouts.get(name)
                if layout is None:
                    layout = layouts[name] = tensor.layout()
                cut_key = (layout, region.offset, region.shape)
                cut = cuts.get(cut_key)
                if cut is None:
                    cut = cuts[cut_key] = _cut(tensor, region, target, source_keys)
                entry = seen[key] = (
                    Wanted(name, region, tensor.full, tensor.dtype, tensor.itemsize), cut)
            mine[name], cut = entry
            choices = []
            for holders, _, nbytes in cut.pieces:
                best = holders[0]
                for index in holders[1:]:
                    if load[index] < load[best]:
                        best = index  # the fewest bytes so far; a tie keeps the first key
                load[best] += nbytes
                choices.append(best)
            chosen = tuple(choices)
            moves = cut.moves.get(chosen)
            if moves is None:
                moves = cut.moves[chosen] = _moves(cut, choices, source_keys)
            for fields in moves:
                transfer: Transfer[S, T] = new(Transfer)
                # frozen: filled past __setattr__, as a plan makes tens of thousands
                transfer.__dict__.update(fields, target=target, name=name)
                transfers.append(transfer)
        wanted[target] = types.MappingProxyType(mine)
        by_target[target] = tuple(transfers[first:])
        per_target[target] = sum(t.nbytes for t in by_target[target])
    by_source: dict[S, list[Transfer[S, T]]] = {key: [] for key in source_keys}
    for transfer in transfers:
        by_source[transfer.source].append(transfer)
    return Plan(
        transfers=tuple(transfers),
        wanted=types.MappingProxyType(wanted),
        per_target_bytes=types.MappingProxyType(per_target),
        per_source_bytes=types.MappingProxyType(
            {key: load[index] for index, key in enumerate(source_keys)}),
        _by_source=types.MappingProxyType({k: tuple(v) for k, v in by_source.items()}),
        _by_target=types.MappingProxyType(by_target),
    )


def _checked(tensors: Mapping[str, _Tensor], target: Any, name: Any,
             region: Any) -> tuple[_Tensor, Region]:
    """A want checked (the first target wanting it names itself in the errors): the name's
    tensor and the region wanted of it."""
    if not isinstance(name, str):
        raise TypeError(f"target {target!r} wants {name!r}: names are str")
    tensor = tensors.get(name)
    if tensor is None:
        held = sorted(tensors)
        raise ValueError(
            f"target {target!r} wants {name!r}, which no source holds (they hold "
            f"{len(held)} names: {', '.join(map(repr, held[:5]))}"
            f"{', ...' if len(held) > 5 else ''})")
    if region is None:
        region = _region((0,) * len(tensor.full), tensor.full)
    elif not isinstance(region, Region):
        raise TypeError(f"target {target!r} wants {name!r} as {region!r}: a px.Region, or "
                        "None for the whole tensor")
    elif region.ndim != len(tensor.full) or not all(
            e <= f for e, f in zip(region.end, tensor.full, strict=True)):
        raise ValueError(f"target {target!r} wants {name!r} at {region}, outside its full "
                         f"shape {tensor.full}")
    return tensor, region


def _moves(cut: _Cut, choices: list[int], source_keys: list[Any]) -> list[dict[str, Any]]:
    """The merged boxes each chosen source sends of the cut region, as a transfer's fields
    but the name and the target, in row-major order of their offsets."""
    cells: dict[int, list[_Box]] = {}
    for (_, boxes, _), index in zip(cut.pieces, choices, strict=True):
        cells.setdefault(index, []).extend(boxes)
    region, starts = cut.region, cut.starts
    moves = []
    for index, boxes in cells.items():
        for lo, hi in _merge(boxes, region.ndim):
            shape = _sub(hi, lo)
            moves.append((lo, index, {
                "source": source_keys[index], "box": _region(lo, shape),
                "src_box": _region(_sub(lo, starts[index]), shape),
                "dst_box": _region(_sub(lo, region.offset), shape),
                "nbytes": math.prod(shape) * cut.itemsize}))
    moves.sort(key=lambda move: move[:2])
    return [fields for _, _, fields in moves]
