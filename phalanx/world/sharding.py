"""Named sharding: ranks arranged on named axes, and who gets which slice of a call's data.

:class:`NamedSharding` is API-compatible with NeMo-RL's: an N-d layout holding every rank
once, with a name per axis. :func:`plan_sharded_call` turns a sharding and the
``call_sharded`` options into a :class:`ShardedPlan` (which rank is called with which index
path into the data, which results are kept) following NeMo-RL's
``run_all_workers_sharded_data`` / ``MultiWorkerFuture.get_results`` rules:

- data arguments are nested lists indexed by ``in_sharded_axes`` in the order given;
- along ``replicate_on_axes`` every rank receives the same slice;
- every other axis is *free*: only coordinate 0 receives data; the others are not called,
  or called with ``None`` for every data argument (``dummy_calls_to_free_axes``);
- results come from ranks that received data and sit at coordinate 0 of every axis in
  ``output_is_replicated``.

Pure logic: no processes, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from phalanx.errors import NonIntegerLayoutError, UnknownAxisError


class NamedSharding:
    """An N-dimensional arrangement of ranks with named axes.

    Error messages begin with NeMo-RL's exact wording (tests matching on them pass) and may
    add detail after it.

    >>> s = NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])
    >>> s.shape, s.get_worker_coords(2), s.get_ranks(dp=1).layout.tolist()
    ({'dp': 2, 'tp': 2}, {'dp': 1, 'tp': 0}, [2, 3])
    >>> s
    NamedSharding(shape=(2, 2), names=['dp', 'tp'], layout=[[0 1]
     [2 3]])
    """

    def __init__(self, layout: Sequence[Any] | np.ndarray, names: Sequence[str]) -> None:
        try:
            array = np.array(layout)
        except ValueError as exc:  # ragged nesting
            raise ValueError(
                f"Could not create NumPy array from layout: {exc} "
                "(the layout must be a regular N-d nesting of integer ranks)"
            ) from None
        if not np.issubdtype(array.dtype, np.integer):
            if not np.issubdtype(array.dtype, np.floating):
                raise NonIntegerLayoutError(
                    f"Layout must contain only integer rank IDs. Got dtype {array.dtype}."
                )
            fractional = np.mod(array, 1) != 0  # NaN and inf count as fractional too
            if fractional.any():
                raise NonIntegerLayoutError(
                    "Layout must contain only integer rank IDs. "
                    f"Got {array[fractional].tolist()[:5]}."
                )
            array = array.astype(np.int64)
        self._names = [str(n) for n in names]
        if array.ndim != len(self._names):
            raise ValueError(
                f"Number of dimensions in layout ({array.ndim}) "
                f"must match the number of names ({len(self._names)}). "
                f"The layout has shape {array.shape}; the names are {self._names}."
            )
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"Axis names must be distinct, got {self._names}")
        values, counts = np.unique(array, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"Duplicate ranks found in layout: {values[counts > 1].tolist()}. "
                "Each rank must appear exactly once."
            )
        self._layout: np.ndarray = array
        self._axis = {name: i for i, name in enumerate(self._names)}
        self._coords = {
            int(rank): dict(zip(self._names, (int(c) for c in index), strict=True))
            for index, rank in np.ndenumerate(array)
        }

    @classmethod
    def from_mesh(cls, mesh: Mapping[str, int]) -> NamedSharding:
        """The row-major layout of ``mesh`` (``{"dp": 2, "tp": 2}``: dp=0 -> ranks 0, 1)."""
        for name, size in mesh.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"mesh axis {name!r} must have a positive integer size, got {size!r}"
                )
        sizes = list(mesh.values())
        return cls(np.arange(int(np.prod(sizes))).reshape(sizes), list(mesh))

    # -- shape ------------------------------------------------------------------------

    @property
    def layout(self) -> np.ndarray:
        return np.copy(self._layout)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self._names, (int(n) for n in self._layout.shape), strict=True))

    @property
    def ndim(self) -> int:
        return self._layout.ndim

    @property
    def size(self) -> int:
        return int(self._layout.size)

    @property
    def ranks(self) -> list[int]:
        return sorted(self._coords)

    def get_axis_index(self, name: str) -> int:
        self.check_axes([name])
        return self._axis[name]

    def get_axis_size(self, name: str) -> int:
        return int(self._layout.shape[self.get_axis_index(name)])

    def check_axes(self, axes: Iterable[str]) -> None:
        """UnknownAxisError (naming the valid axes) unless every name in ``axes`` is one of
        this sharding's axes."""
        for name in axes:
            if name not in self._axis:
                # '{name}', not {name!r}: NeMo-RL's exact text, whatever quotes repr picks.
                raise UnknownAxisError(
                    f"Invalid axis name: '{name}'. Valid names are: {self._names}"
                )

    # -- lookups ----------------------------------------------------------------------

    def get_worker_coords(self, worker_id: int) -> dict[str, int]:
        coords = self._coords.get(int(worker_id)) if _is_int(worker_id) else None
        if coords is None:
            if _is_int(worker_id):
                detail = f"The layout holds {self._describe_ranks()}."
            else:
                detail = f"Worker IDs are integers, got {type(worker_id).__name__} {worker_id!r}."
            raise ValueError(f"Worker ID {worker_id} not found in sharding layout. {detail}")
        return dict(coords)

    def contains_worker_id(self, worker_id: int) -> bool:
        """True when ``worker_id`` is in the layout (when :meth:`get_worker_coords` finds it)."""
        return _is_int(worker_id) and int(worker_id) in self._coords

    def replace_worker_id(self, old_id: int, new_id: int) -> bool:
        """Put ``new_id`` in ``old_id``'s place, in place; False (and no change) when
        ``old_id`` is not in the layout.

        As in NeMo-RL, for a replacement worker taking over a dead one's slot:
        ``get_worker_coords(new_id)`` then gives what ``get_worker_coords(old_id)`` gave.
        Unlike NeMo-RL, a ``new_id`` already elsewhere in the layout raises instead of
        leaving a rank twice. Equality and hash follow the new layout: do not replace ranks
        of a sharding used as a dict key or set member, nor of a group's ``sharding`` (the
        group keeps plans and dp leaders computed from it).
        """
        if not self.contains_worker_id(old_id):
            return False
        if not _is_int(new_id):
            raise NonIntegerLayoutError(
                "Layout must contain only integer rank IDs. "
                f"Cannot replace worker ID {old_id} with {type(new_id).__name__} {new_id!r}."
            )
        old, new = int(old_id), int(new_id)
        if new == old:
            return True
        if new in self._coords:
            raise ValueError(
                f"Duplicate ranks found in layout: [{new}]. Cannot replace worker ID {old} "
                f"with {new}: {new} is already at {self._coords[new]}."
            )
        info = np.iinfo(self._layout.dtype)
        if not info.min <= new <= info.max:  # e.g. a uint8 layout given by the user
            int64 = np.iinfo(np.int64)
            if not int64.min <= new <= int64.max:
                raise NonIntegerLayoutError(
                    "Layout must contain only integer rank IDs. "
                    f"Worker ID {new} does not fit in a 64-bit integer."
                )
            self._layout = self._layout.astype(np.int64)
        coords = self._coords.pop(old)
        self._layout[tuple(coords[name] for name in self._names)] = new
        self._coords[new] = coords
        return True

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The sub-sharding over the axes not named, or the rank when every axis is named."""
        self.check_axes(coords)
        index: list[Any] = [slice(None)] * self.ndim
        for name, value in coords.items():
            size = self.get_axis_size(name)
            if not _is_int(value):
                raise IndexError(
                    f"Index {value!r} for axis '{name}' with size {size} is not an integer"
                )
            if not 0 <= value < size:
                raise IndexError(
                    f"Index {value} is out of bounds for axis '{name}' with size {size}"
                )
            index[self._axis[name]] = value
        sub = self._layout[tuple(index)]
        rest = [n for n in self._names if n not in coords]
        if not rest:
            return int(sub)
        return NamedSharding(sub, rest)

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """Sorted ranks at the given coordinates (other axes: any); [] when out of range."""
        self.check_axes(coords)
        index: list[Any] = [slice(None)] * self.ndim
        for name, value in coords.items():
            if not 0 <= value < self.get_axis_size(name):
                return []
            index[self._axis[name]] = value
        return sorted(int(r) for r in np.ravel(self._layout[tuple(index)]))

    @staticmethod
    def is_axis_zero(coords: Mapping[str, int], axes: Iterable[str]) -> bool:
        """True when ``coords`` is 0 on every axis in ``axes`` (missing axes count as 0)."""
        return all(coords.get(axis, 0) == 0 for axis in axes)

    def _describe_ranks(self) -> str:
        ranks = self.ranks
        if not ranks:
            return "no ranks"
        if ranks == list(range(ranks[0], ranks[-1] + 1)):
            return f"ranks {ranks[0]}..{ranks[-1]}"
        shown = ", ".join(map(str, ranks[:8]))
        return f"ranks {shown}{', ...' if len(ranks) > 8 else ''}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.tobytes(), self._layout.shape))

    def __repr__(self) -> str:
        # NeMo-RL's text: "(4)" for one axis, not "(4,)", and numpy's str() of the layout.
        shape = ", ".join(str(n) for n in self._layout.shape)
        return f"NamedSharding(shape=({shape}), names={self._names}, layout={self._layout})"


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ShardedPlan:
    """Who is called with which data, and whose results are kept (rank order)."""

    called_ranks: list[int]
    paths: dict[int, tuple[int, ...] | None]  # index path into each data argument; None: dummy
    result_ranks: list[int]
    sharded_axes: tuple[str, ...] = ()
    sharded_sizes: tuple[int, ...] = ()  # sizes of sharded_axes, for checking the data


def plan_sharded_call(
    sharding: NamedSharding,
    in_sharded_axes: Sequence[str] = (),
    replicate_on_axes: Sequence[str] = (),
    output_is_replicated: Sequence[str] = (),
    dummy_calls_to_free_axes: bool = False,
) -> ShardedPlan:
    """The dispatch plan of a ``call_sharded`` (see the module docstring for the rules)."""
    for label, axes in (
        ("in_sharded_axes", in_sharded_axes),
        ("replicate_on_axes", replicate_on_axes),
        ("output_is_replicated", output_is_replicated),
    ):
        if isinstance(axes, str):
            raise TypeError(f"{label} must be a list of axis names, got the string {axes!r}")
        for axis in axes:
            if axis not in sharding.names:
                raise ValueError(f"{label}: unknown axis {axis!r}; the axes are {sharding.names}")
    both = [a for a in in_sharded_axes if a in replicate_on_axes]
    if both:
        raise ValueError(f"axis {both[0]!r} cannot be both sharded and replicated")
    free = [a for a in sharding.names if a not in in_sharded_axes and a not in replicate_on_axes]
    called: list[int] = []
    paths: dict[int, tuple[int, ...] | None] = {}
    results: list[int] = []
    for rank in sharding.ranks:
        coords = sharding.get_worker_coords(rank)
        if all(coords[a] == 0 for a in free):
            called.append(rank)
            paths[rank] = tuple(coords[a] for a in in_sharded_axes)
            if all(coords[a] == 0 for a in output_is_replicated):
                results.append(rank)
        elif dummy_calls_to_free_axes:
            called.append(rank)
            paths[rank] = None
    sizes = tuple(sharding.get_axis_size(a) for a in in_sharded_axes)
    return ShardedPlan(called, paths, results, tuple(in_sharded_axes), sizes)


def validate_sharded_value(
    value: Any, in_sharded_axes: Sequence[str], sharding: NamedSharding, label: str
) -> None:
    """Check that ``value`` is a nested list indexed by the sharded axes, in order."""
    sizes = [sharding.get_axis_size(axis) for axis in in_sharded_axes]
    check_nested(value, in_sharded_axes, sizes, label)


def check_nested(value: Any, axes: Sequence[str], sizes: Sequence[int], label: str) -> None:
    """:func:`validate_sharded_value` with the axis sizes already looked up."""
    if len(sizes) == 1 and type(value) is list and len(value) == sizes[0]:
        return  # the common one-axis case, well formed
    level = [value]
    for depth, (axis, size) in enumerate(zip(axes, sizes, strict=True)):
        below: list[Any] = []
        for item in level:
            if type(item) is not list and not isinstance(item, (list, tuple)):
                raise ValueError(
                    f"{label}: expected a list of {size} items for sharded axis {axis!r} "
                    f"(nesting level {depth}), got {type(item).__name__}"
                )
            if len(item) != size:
                raise ValueError(
                    f"{label}: axis {axis!r} has size {size} but the data at nesting level "
                    f"{depth} has {len(item)} items"
                )
            below.extend(item)
        level = below


def take(value: Any, path: Sequence[int]) -> Any:
    """``value[path[0]][path[1]]...``"""
    for i in path:
        value = value[i]
    return value


def leaves(sharding: NamedSharding, in_sharded_axes: Sequence[str]) -> list[tuple[int, ...]]:
    """Every index path into data sharded along ``in_sharded_axes``."""
    return list(itertools.product(*(range(sharding.get_axis_size(a)) for a in in_sharded_axes)))


def rank0_only(sharding: NamedSharding, ranks: Sequence[int], axes: Sequence[str]) -> list[int]:
    """The ranks of ``ranks`` at coordinate 0 on every axis in ``axes``."""
    if isinstance(axes, str):
        raise TypeError(f"rank0_only_axes must be a list of axis names, got the string {axes!r}")
    sharding.check_axes(axes)
    return [r for r in ranks if sharding.is_axis_zero(sharding.get_worker_coords(r), axes)]


def dp_leaders(sharding: NamedSharding, dp_axis: str) -> list[int]:
    """Ranks at coordinate 0 on every axis but ``dp_axis``, in data-parallel order."""
    others = [a for a in sharding.names if a != dp_axis]
    leaders = [
        r for r in sharding.ranks if sharding.is_axis_zero(sharding.get_worker_coords(r), others)
    ]
    if dp_axis in sharding.names:
        leaders.sort(key=lambda r: sharding.get_worker_coords(r)[dp_axis])
    return leaders


def sharding_for(mesh: NamedSharding | Mapping[str, int], world_size: int) -> NamedSharding:
    """A group's sharding from its ``mesh=`` argument, checked against the world size."""
    sharding = mesh if isinstance(mesh, NamedSharding) else NamedSharding.from_mesh(mesh)
    if sharding.ranks != list(range(world_size)):
        raise ValueError(
            f"mesh {sharding.shape} with layout {sharding.layout.tolist()} must hold every "
            f"rank 0..{world_size - 1} exactly once "
            f"(it has {sharding.size} ranks for a world size of {world_size})"
        )
    return sharding


# -- slices, tied axes, data-parallel leaders ---------------------------------------------

Coordinates = int | range | Sequence[int]
"""One axis of a slice: an int (the axis goes), or a range or list of coordinates (it stays,
narrowed to them, in increasing order)."""


def _describe_axes(sharding: NamedSharding) -> str:
    return ", ".join(f"{name!r} (size {size})" for name, size in sharding.shape.items()) or "none"


def _coordinates(axis: str, size: int, value: Coordinates, what: str) -> int | list[int]:
    picked: int | list[int]
    if _is_int(value):
        picked = int(value)
        chosen = [picked]
    elif isinstance(value, (range, list, tuple)):
        given = list(value)
        for c in given:
            if not _is_int(c):
                raise TypeError(f"{what}: axis {axis!r} takes integer coordinates, got {c!r}")
        chosen = [int(c) for c in given]
        if not chosen:
            raise ValueError(f"{what}: axis {axis!r} (size {size}) is given no coordinate")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"{what}: axis {axis!r} is given a coordinate twice: {chosen}")
        picked = sorted(chosen)
    else:
        raise TypeError(f"{what}: axis {axis!r} takes an int, a range or a list of ints, "
                        f"got {type(value).__name__} {value!r}")
    for c in chosen:
        if not 0 <= c < size:
            raise ValueError(f"{what}: coordinate {c} is out of range for axis {axis!r} "
                             f"of size {size} (0..{size - 1})")
    return picked


def slice_sharding(sharding: NamedSharding, coords: Mapping[str, Coordinates],
                   what: str = "slice()") -> NamedSharding:
    """The part of ``sharding`` at ``coords`` (``{"dp": 1, "tp": range(0, 2)}``): an int
    removes its axis, a range or list keeps it with only those coordinates (renumbered from
    0 in increasing order). The result holds the same rank ids; with every axis given an int
    it has no axis and one rank."""
    shape = sharding.shape
    for axis in coords:
        if axis not in shape:
            raise ValueError(f"{what}: unknown axis {axis!r}; the mesh's axes are "
                             f"{_describe_axes(sharding)}")
    index: list[Any] = []
    for axis, size in shape.items():
        if axis in coords:
            index.append(_coordinates(axis, size, coords[axis], what))
        else:
            index.append(slice(None))
    array = sharding.layout
    for dim in reversed(range(len(index))):  # one axis at a time: no numpy broadcasting
        array = array[(slice(None),) * dim + (index[dim],)]
    names = [a for a in shape if not _is_int(coords.get(a, ()))]
    return NamedSharding(array, names)


def tied_groups(sharding: NamedSharding, tied_axes: Sequence[str]) -> list[list[int]]:
    """The ranks that differ only along ``tied_axes`` (one group per coordinate of the other
    axes, each in rank order), sorted by their first rank."""
    if isinstance(tied_axes, str):
        raise TypeError(f"tied_axes must be a list of axis names, got the string {tied_axes!r}")
    for axis in tied_axes:
        if axis not in sharding.names:
            raise ValueError(f"tied_axes: unknown axis {axis!r}; the mesh's axes are "
                             f"{_describe_axes(sharding)}")
    others = [a for a in sharding.names if a not in tied_axes]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in sharding.ranks:
        coords = sharding.get_worker_coords(rank)
        groups.setdefault(tuple(coords[a] for a in others), []).append(rank)
    return sorted(groups.values())


def check_tied(sharding: NamedSharding, tied_axes: Sequence[str],
               node_of: Callable[[int], int], layout: str = "") -> None:
    """ValueError unless the ranks of each of :func:`tied_groups` sit on one node
    (``node_of(rank)``); the message names the axes, the ranks and their nodes
    (``layout``: a description of the layout to add to it)."""
    for group in tied_groups(sharding, tied_axes):
        nodes = sorted({node_of(r) for r in group})
        if len(nodes) > 1:
            where = "; ".join(
                f"node {n}: ranks {[r for r in group if node_of(r) == n]}" for n in nodes)
            raise ValueError(
                f"tied_axes {list(tied_axes)}: ranks {group} differ only along "
                f"{', '.join(repr(a) for a in tied_axes)} and must be on one node, but the "
                f"layout{' ' + layout if layout else ''} puts them on nodes {nodes} ({where})"
            )


def check_dp_leaders(sharding: NamedSharding, dp_axis: str, leaders: Sequence[int]) -> list[int]:
    """``leaders`` checked as a group's data-parallel leaders: one per replica (coordinate
    of ``dp_axis``; the whole mesh is one replica without that axis), each a rank of its
    replica, so distinct and in range. Returns them as a list."""
    if isinstance(leaders, (str, bytes)) or not isinstance(leaders, Sequence):
        raise TypeError(f"dp_leaders must be a list of ranks, got {type(leaders).__name__} "
                        f"{leaders!r}")
    leaders = list(leaders)
    for rank in leaders:
        if not _is_int(rank):
            raise TypeError(f"dp_leaders must hold integer ranks, got {rank!r}")
    has_dp = dp_axis in sharding.names
    replicas = sharding.get_axis_size(dp_axis) if has_dp else 1
    if len(leaders) != replicas:
        along = f"{replicas} along {dp_axis!r}" if has_dp else f"no {dp_axis!r} axis: 1"
        raise ValueError(f"dp_leaders {leaders} must hold one rank per data-parallel replica "
                         f"({along}), got {len(leaders)}")
    world = sharding.size
    for rank in leaders:
        if not sharding.contains_worker_id(rank):
            raise ValueError(f"dp_leaders {leaders}: rank {rank} is outside the group's ranks "
                             f"0..{world - 1}")
    if len(set(leaders)) != len(leaders):
        raise ValueError(f"dp_leaders {leaders} names a rank twice")
    for i, rank in enumerate(leaders):
        members = sharding.get_ranks_by_coord(**{dp_axis: i}) if has_dp else sharding.ranks
        if int(rank) not in members:
            raise ValueError(f"dp_leaders {leaders}: leader {i} (rank {rank}) is not a rank of "
                             f"data-parallel replica {i} (ranks {members})")
    return [int(r) for r in leaders]
