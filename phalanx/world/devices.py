"""One book of a machine's GPUs: which device is held, and by whom (pure).

A pool that reserves GPUs, and a group that asks ``gpus_per_worker`` of them, takes them
from its machine's book and gives them back when it closes; a request for devices another
holder has is refused at once, naming the holders and what is still free, instead of two
groups being handed the same device. The local backend keeps one book in the controller
(every simulated node shares this machine's devices); each agent keeps the book of its
node. The book knows device ids, not which of them a machine shows now: the caller says
among which ids to take (a node's share of the visible ones).
"""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.errors import DevicesTaken


class DeviceBook:
    """Device id -> its holder ("pool-1", "group Policy-2 (4 ranks)"). Not thread-safe:
    its owner takes a lock around it."""

    def __init__(self) -> None:
        self._holders: dict[str, str] = {}

    def free(self, among: Sequence[str]) -> list[str]:
        """The devices of ``among`` no one holds, in order."""
        return [d for d in among if d not in self._holders]

    def take(self, count: int, holder: str, among: Sequence[str]) -> tuple[str, ...]:
        """The first ``count`` free devices of ``among``, held by ``holder`` from now on;
        DevicesTaken naming who holds the others when fewer are free (nothing taken)."""
        if count <= 0:
            return ()
        free = self.free(among)
        if len(free) < count:
            raise DevicesTaken(self.refusal(count, holder, among))
        taken = tuple(free[:count])
        for device in taken:
            self._holders[device] = holder
        return taken

    def refusal(self, count: int, holder: str, among: Sequence[str]) -> str:
        """Why ``holder`` cannot have ``count`` devices of ``among``."""
        held: dict[str, list[str]] = {}
        for device in among:
            if device in self._holders:
                held.setdefault(self._holders[device], []).append(device)
        taken = "; ".join(f"{who} holds {', '.join(ids)}" for who, ids in held.items())
        free = self.free(among)
        return (f"{holder} needs {count} GPU(s) of {', '.join(among) or 'none'}, but only "
                f"{len(free)} {'is' if len(free) == 1 else 'are'} free "
                f"({', '.join(free) or 'none'}): {taken or 'none is held'}; close the "
                "holder first, or ask for fewer")

    def give_back(self, holder: str) -> None:
        """Every device ``holder`` took is free again (nothing if it holds none)."""
        for device in [d for d, who in self._holders.items() if who == holder]:
            del self._holders[device]

    def holders(self) -> dict[str, list[str]]:
        """Holder -> the devices it holds."""
        out: dict[str, list[str]] = {}
        for device, who in self._holders.items():
            out.setdefault(who, []).append(device)
        return out
