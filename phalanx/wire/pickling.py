"""Serialisation of a frame's payload: one pickle stream and its protocol-5 buffers.

:func:`dumps` makes the segments a frame carries after its header (:mod:`.framing`): the
pickle stream first, then every out-of-band buffer (numpy arrays, torch CPU tensors, reduced
by :func:`reduce_tensor`) as a segment of its own, so large buffers are never copied through
Python bytes. :func:`dumps_fast` and :func:`dumps_plain` skip cloudpickle for the plain
values most calls carry. :func:`loads` is the inverse.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

# A hook sees every object the pickler reduces itself (not builtins' plain values) before
# anything else does: what it returns is that object's reduction, NotImplemented leaves it
# to the pickler. How the controller turns handles into what ranks read (and notes them).
Hook = Callable[[Any], Any]


def dumps(obj: Any, hook: Hook | None = None) -> list[Any]:
    """Pickle ``obj`` into ``[stream, *out_of_band_buffers]`` (cloudpickle, protocol 5).

    Classes and functions from ``__main__``, notebooks and closures are pickled by value;
    contiguous buffers (numpy, torch CPU tensors) are returned as memoryviews, not copied.
    """
    return dumps_noting(obj, hook)[0]


def dumps_noting(obj: Any, hook: Hook | None = None) -> tuple[list[Any], bool]:
    """:func:`dumps`, and whether a torch tensor went out of band (its views, once
    unpickled from shared memory, must be writable copies: torch has no read-only ones)."""
    buffers: list[pickle.PickleBuffer] = []
    with io.BytesIO() as file:
        pickler = _pickler()(file, protocol=5, buffer_callback=buffers.append)
        pickler.hook = hook
        pickler.dump(obj)
        stream = file.getvalue()
    if not buffers:
        return [stream], pickler.tensors
    return [stream, *(b.raw() for b in buffers)], pickler.tensors


@functools.cache
def _pickler() -> type:
    """cloudpickle's pickler, keeping the file name of code it ships by value.

    cloudpickle replaces it with ``<dynamic-code>`` (for reproducible pickles); kept, the
    ranks' tracebacks and stack dumps name the user's script and line, as local ones do.
    Imported on first use: a worker whose calls carry only plain data never pays for
    importing cloudpickle (~15 ms of every worker's start-up).
    """
    import types

    import cloudpickle  # type: ignore[import-untyped]  # cloudpickle ships no type hints

    base = cloudpickle.Pickler
    reduce_code = base.dispatch_table[types.CodeType]

    def keep_filename(code: types.CodeType) -> tuple[Any, ...]:
        rebuild, args = reduce_code(code)
        return rebuild, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>"
                              else a for a in args)

    def reducer_override(self: Any, obj: Any) -> Any:
        if self.hook is not None:
            reduced = self.hook(obj)
            if reduced is not NotImplemented:
                return reduced
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            reduced = reduce_tensor(obj)  # its bytes out of band, like numpy's
            if reduced is not None:
                self.tensors = True
                return reduced
        return base.reducer_override(self, obj)

    return type("Pickler", (base,), {
        "dispatch_table": collections.ChainMap({types.CodeType: keep_filename},
                                               base.dispatch_table),
        "reducer_override": reducer_override,
        "hook": None,  # see Hook
        "tensors": False,  # set once a torch tensor went out of band
    })


def reduce_tensor(tensor: Any) -> tuple[Any, ...] | None:
    """A plain CPU tensor as its bytes (an out-of-band buffer, never copied) and how to
    rebuild it; None for tensors torch must pickle itself (grad, sparse, quantized,
    not contiguous, other devices)."""
    torch = _torch()
    if (tensor.device.type != "cpu" or tensor.requires_grad or tensor.layout != torch.strided
            or not tensor.is_contiguous() or tensor.is_quantized or tensor.is_conj()
            or tensor.is_neg()):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    data: Any = b""
    if tensor.numel():
        try:  # numpy hands over the memory without a copy
            data = pickle.PickleBuffer(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # no numpy, or a dtype it cannot view
            return None
    return rebuild_tensor, (data, dtype, tuple(tensor.shape))


def rebuild_tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    torch = _torch()
    kind = getattr(torch, dtype)
    if not memoryview(data).nbytes:
        return torch.empty(shape, dtype=kind)
    if isinstance(data, bytes):  # pickled in-band (not by phalanx): give torch its own copy
        data = bytearray(data)
    with warnings.catch_warnings():  # a read-only view: the mapping under it is copy-on-write
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(kind).reshape(shape)


def _torch() -> Any:
    import torch

    return torch


_PLAIN_TYPES = frozenset({int, float, str, bytes, bool, type(None)})


def _is_plain(obj: Any, depth: int = 0) -> bool:
    """True for small builtin data that the stdlib pickler handles exactly like cloudpickle."""
    kind = type(obj)
    if kind in _PLAIN_TYPES:
        return True
    if depth >= 3:
        return False
    if kind is tuple or kind is list:
        if len(obj) > 16:
            return False
        for item in obj:
            if type(item) not in _PLAIN_TYPES and not _is_plain(item, depth + 1):
                return False
        return True
    if kind is dict:
        if len(obj) > 16:
            return False
        for key, item in obj.items():
            if type(key) is not str:
                return False
            if type(item) not in _PLAIN_TYPES and not _is_plain(item, depth + 1):
                return False
        return True
    return False


NO_ARGUMENTS = pickle.dumps(((), {}), protocol=5)  # a call's payload without arguments


_NONE = pickle.dumps(None, protocol=5)


def dumps_fast(obj: Any) -> list[Any]:
    """Like :func:`dumps`, with a shortcut through the C pickler for small builtin data."""
    return dumps_plain(obj) or dumps(obj)


def dumps_plain(obj: Any) -> list[Any] | None:
    """:func:`dumps_fast`'s shortcut: ``obj`` pickled if it is small builtin data (nothing
    in it can reduce itself: no handle, no buffer), else None."""
    if obj is None:
        return [_NONE]
    if _is_plain(obj):
        return [pickle.dumps(obj, protocol=5)]
    return None


def loads(segments: list[Any]) -> Any:
    """Inverse of :func:`dumps`: ``segments[0]`` is the stream, the rest its buffers."""
    return pickle.loads(segments[0], buffers=segments[1:])
