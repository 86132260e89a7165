"""A rank's way into a joint world: ``px.joint_store(world)``, the store that answers only
the world's members, as a ``torch.distributed.Store``.

``px.rendezvous(*groups)`` (:mod:`phalanx.controller.joint`) hands every rank a dict: where
the world meets (``MASTER_ADDR``, ``MASTER_PORT``), its size and the rank's place in it, and
``STORE_SECRET``, 32 random bytes (hex) made for this world, which reach the rank inside a
call, over phalanx's authenticated links. Each rank turns it into a store::

    store = px.joint_store(world)              # rank 0 serves it, on MASTER_ADDR only
    pg = dist.ProcessGroupGloo(store, int(world["RANK"]), int(world["WORLD_SIZE"]))
    # or dist.init_process_group("nccl", store=store, rank=..., world_size=...)

The store is :mod:`phalanx.wire.kvstore`'s: rank 0 serves it on its node's address (never
the wildcard) and every member proves the secret before it reads or writes a key, where
torch's ``TCPStore`` (``init_method="tcp://..."``) listens on every interface and answers
anyone. ``px.weight_sync`` forms its own worlds on the same store (:func:`secret_store`).

torch lets a Python class be a ``Store``; but its Python half lives only as long as Python
holds it, while torch's C++ side (a process group, a ``PrefixStore``) keeps only the C++
half. So every store made here is held in :data:`_OPEN` until :meth:`close`: a store passed
straight to ``init_process_group`` keeps working however long its world lives.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from phalanx.wire import kvstore

SECRET_KEY = "STORE_SECRET"  # the key of px.rendezvous' dicts that holds the secret (hex)
DEFAULT_TIMEOUT = 300.0  # seconds: torch's default for a store

_OPEN: dict[int, Any] = {}  # id -> every store not closed yet (see the module docstring)
_OPEN_LOCK = threading.Lock()


def joint_store(world: Mapping[str, str], timeout: float = DEFAULT_TIMEOUT) -> Any:
    """The ``torch.distributed.Store`` of the joint world ``world`` describes (one of the
    dicts :func:`px.rendezvous <phalanx.controller.joint.rendezvous>` returns), for
    ``ProcessGroupGloo(store, rank, size)`` or ``init_process_group(backend, store=store,
    rank=..., world_size=...)``.

    Rank 0 serves it on ``MASTER_ADDR`` (that address only) and ``MASTER_PORT``; every rank
    proves ``STORE_SECRET`` before any key is read or written, so a stranger who connects
    to the port learns nothing and changes nothing. A rank that is not 0 keeps trying to
    reach rank 0 for up to ``timeout`` seconds (also the store's timeout for a key that is
    not there yet). The store lives until its ``close()`` (or the process's end).

    KeyError naming a key ``world`` lacks (a dict from an older phalanx has no
    ``STORE_SECRET``: ``init_method="tcp://..."`` still takes it, unauthenticated);
    ValueError for a value that is not what it should be; ``AuthenticationError`` when the
    peer at the address does not prove the same secret; ``OSError`` when rank 0 cannot
    listen there; a timeout when rank 0 never answers.
    """
    if not isinstance(world, Mapping):
        raise TypeError(f"joint_store() takes one rank's dict from px.rendezvous(), not "
                        f"{type(world).__name__}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", SECRET_KEY)
               if k not in world]
    if missing:
        older = (f"; a dict without {SECRET_KEY} comes from an older px.rendezvous"
                 if missing == [SECRET_KEY] else "")
        raise KeyError(f"joint_store(): the world's dict lacks {', '.join(missing)}{older}")
    try:
        port, rank, size = (int(world[k]) for k in ("MASTER_PORT", "RANK", "WORLD_SIZE"))
        secret = bytes.fromhex(world[SECRET_KEY])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"joint_store(): a value of the world's dict is not what "
                         f"px.rendezvous() makes: {exc}") from None
    if not 0 <= rank < size or not 0 < port < 65536:
        raise ValueError(f"joint_store(): RANK {rank} of WORLD_SIZE {size} at port {port} "
                         "is not a place in a world")
    return secret_store(world["MASTER_ADDR"], port, secret, serve=rank == 0, timeout=timeout)


def secret_store(host: str, port: int, secret: bytes, *, serve: bool,
                 timeout: float = DEFAULT_TIMEOUT) -> Any:
    """A torch Store on the world's store at ``host:port``: serving it there (``serve``)
    or a member's connection to it (made within ``timeout`` s)."""
    link: kvstore.KeyValueStore
    if serve:
        link = kvstore.StoreServer(host, port, secret, timeout=timeout)
    else:
        link = kvstore.StoreClient(host, port, secret, timeout)
    try:
        return _store_class()(link, (host, port, secret), timeout)
    except BaseException:
        link.close()
        raise


@functools.cache
def _store_class() -> type[Any]:
    """The Store class (made on first use: torch is imported only by a rank that joins)."""
    import torch.distributed as dist

    def failed(exc: Exception) -> Exception:
        """torch's error for what went wrong (a timeout is a RuntimeError torch's own
        barriers catch and retry on, as its stores' are)."""
        if isinstance(exc, kvstore.StoreTimeout):
            return dist.DistStoreError(str(exc))
        if isinstance(exc, kvstore.StoreClosed):
            return dist.DistNetworkError(str(exc))
        return exc

    # torch.distributed imports Store without declaring it exported: mypy objects
    store_base: Any = dist.Store  # type: ignore[attr-defined]

    class SecretStore(store_base):  # type: ignore[misc]
        """A joint world's store whose every member proved the world's secret
        (:mod:`phalanx.rank.joint`)."""

        def __init__(self, link: kvstore.KeyValueStore, where: tuple[str, int, bytes],
                     timeout: float) -> None:
            super().__init__()
            self._link = link
            self._where = where
            self.set_timeout(timedelta(seconds=timeout))
            with _OPEN_LOCK:
                _OPEN[id(self)] = self

        def _seconds(self, timeout: timedelta | None = None) -> float:
            """A wait's bound: ``timeout``, or the store's own where none (or 0, torch's
            "none") is given -- never an endless wait."""
            seconds = 0.0 if timeout is None else timeout.total_seconds()
            return seconds if seconds > 0 else float(self.timeout.total_seconds())

        def _do(self, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except (kvstore.StoreTimeout, kvstore.StoreClosed) as exc:
                raise failed(exc) from exc

        def set(self, key: str, value: str | bytes) -> None:
            self._do(self._link.set, key, _bytes(value))

        def get(self, key: str) -> bytes:
            return self._do(self._link.get, key, self._seconds())  # type: ignore[no-any-return]

        def add(self, key: str, value: int) -> int:
            return self._do(self._link.add, key, int(value))  # type: ignore[no-any-return]

        def compare_set(self, key: str, expected_value: str | bytes,
                        desired_value: str | bytes) -> bytes:
            return self._do(  # type: ignore[no-any-return]
                self._link.compare_set, key, _bytes(expected_value), _bytes(desired_value))

        def check(self, keys: list[str]) -> bool:
            return self._do(self._link.check, list(keys))  # type: ignore[no-any-return]

        def delete_key(self, key: str) -> bool:
            return self._do(self._link.delete, key)  # type: ignore[no-any-return]

        def num_keys(self) -> int:
            return self._do(self._link.num_keys)  # type: ignore[no-any-return]

        # the names torch's C++ side calls them by
        deleteKey = delete_key
        getNumKeys = num_keys

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self._do(self._link.wait, list(keys), self._seconds(timeout))

        def clone(self) -> Any:
            """Another connection to the same store (torch asks for one to split a world)."""
            host, port, secret = self._where
            return secret_store(host, port, secret, serve=False,
                                timeout=float(self.timeout.total_seconds()))

        @property
        def serving(self) -> bool:
            """Whether this rank serves the store."""
            return isinstance(self._link, kvstore.StoreServer)

        def stop_listening(self) -> None:
            """Take no new member (those connected stay): once every member is in."""
            if isinstance(self._link, kvstore.StoreServer):
                self._link.stop_listening()

        def close(self) -> None:
            """End this store: the server's every connection, or this member's own
            (idempotent). Its world's process groups need it no longer once formed."""
            with _OPEN_LOCK:
                _OPEN.pop(id(self), None)
            self._link.close()

        def __repr__(self) -> str:
            host, port, _ = self._where
            role = "serving" if self.serving else "member of"
            return f"<phalanx store: {role} {host}:{port}>"

    return SecretStore


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
