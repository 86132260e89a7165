"""A slice of a group: ``group.slice(dp=1)``, a view with the group's call API restricted
to the ranks at some coordinates of its mesh (:class:`GroupSlice`).

A slice holds no machinery of its own. Its rank list and its mesh (with ``call_sharded``'s
plans, made once per call options as the group's are) are computed when it is made; every
call goes through the group's own :class:`~phalanx.controller.callpath.CallPath` with that
rank list as ``workers=``, so a slice costs no more per call than the group, and fails as
the group does (``GroupClosed`` once it is shut down, ``WorkerDied`` for a dead rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.controller.callforms import CallForms, Scope

if TYPE_CHECKING:
    from phalanx.controller.callpath import CallPath
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.meshcalls import Mesh
    from phalanx.world.sharding import Coordinates, NamedSharding


class GroupSlice(CallForms):
    """The ranks of ``group`` at some coordinates of its mesh (made by ``group.slice``).

    Ranks keep their group numbers: :attr:`ranks` lists them in order, :meth:`call_one`
    takes one of them, and :attr:`sharding` holds them on the axes the slice kept (an int
    coordinate removes its axis, a range or list keeps it, narrowed). ``call``,
    ``call_async``, ``map``, ``map_async``, ``call_one``, ``call_stream`` and
    ``call_sharded`` (over the kept axes) work as on the group; ``slice.train.call(...)``
    too, and ``slice.options(...)`` (every option but ``workers``). ``rank0_only_axes``
    names axes of the slice.
    """

    def __init__(self, group: WorkerGroup, calls: CallPath, mesh: Mesh) -> None:
        calls.check_open()
        self._group = group
        self._mesh = mesh
        self._sharding: NamedSharding = mesh.require("slice()")
        self._ranks: list[int] = self._sharding.ranks
        # The whole mesh: the group's own selection, which a call on it takes the short way.
        whole = self._ranks == list(range(group.world_size))
        self._init_forms(calls, Scope(mesh, "all" if whole else tuple(self._ranks),
                                      frozenset(self._ranks)))

    # -- what it holds ----------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        """The group's ranks in this slice, in order."""
        return list(self._ranks)

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    size = world_size

    @property
    def mesh(self) -> dict[str, int]:
        """The slice's axes and their sizes (``{}`` when every axis was given an int)."""
        return self._sharding.shape

    @property
    def sharding(self) -> NamedSharding:
        """The slice's axes, holding the group's ranks."""
        return self._sharding

    @property
    def group(self) -> WorkerGroup:
        return self._group

    def slice(self, **coords: Coordinates) -> GroupSlice:
        """A slice of this slice, by coordinates of its own axes."""
        return GroupSlice(self._group, self._path, self._mesh.sliced(coords))

    def __repr__(self) -> str:
        return f"<GroupSlice of group {self._group.name} ranks={self._ranks} mesh={self.mesh}>"
