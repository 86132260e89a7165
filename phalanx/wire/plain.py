"""Plain data to bytes and back: what a frame header's fields may hold.

A header's fields (a method name, a rank's pid and methods, a failure's text, a node
request's counts and paths) are read before anything else of a frame, by the agent and by
the controller, so reading them must never run code: this format holds only ``None``,
``bool``, ``int``, ``float``, ``str``, ``bytes`` and ``list``, ``tuple`` and ``dict`` of
those, and :func:`loads` builds nothing else. Anything richer belongs in a frame's payload
(a pickle, read only once the frame passed its check in :mod:`phalanx.wire.seal`).

Each value is a tag byte and its data, little-endian::

    N | T | F                    None, True, False
    q <i64>                      an int that fits in 64 bits
    Q <u32 n> <n bytes>          any other int (signed, two's complement)
    d <f64>                      a float
    s <u32 n> <n bytes utf-8>    a str;  b: the same for bytes
    l <u32 n> <n values>         a list;  t: a tuple;  m: a dict, n key-value pairs

Subclasses of ``int``, ``float`` and ``str`` (an ``IntEnum``, say) come back as the plain
type. :func:`loads` raises :class:`ValueError` on anything malformed: a truncated value, an
unknown tag, trailing bytes, more than :data:`MAX_DEPTH` levels of nesting.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 32

_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_LO, _HI = -(1 << 63), 1 << 63


def dumps(value: Any) -> bytes:
    """``value`` as bytes; :class:`TypeError` names the first part that is not plain data."""
    parts: list[bytes] = []
    _dump(value, parts.append, 0)
    return b"".join(parts)


def _dump(value: Any, out: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"header fields nest deeper than {MAX_DEPTH} levels")
    if value is None:
        out(b"N")
    elif value is True:
        out(b"T")
    elif value is False:
        out(b"F")
    elif isinstance(value, int):
        if _LO <= value < _HI:
            out(b"q" + _I64.pack(value))
        else:
            data = int(value).to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out(b"Q" + _U32.pack(len(data)) + data)
    elif isinstance(value, float):
        out(b"d" + _F64.pack(value))
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out(b"s" + _U32.pack(len(data)) + data)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        out(b"b" + _U32.pack(len(data)) + data)
    elif isinstance(value, (list, tuple)):
        out((b"l" if isinstance(value, list) else b"t") + _U32.pack(len(value)))
        for item in value:
            _dump(item, out, depth + 1)
    elif isinstance(value, dict):
        out(b"m" + _U32.pack(len(value)))
        for key, item in value.items():
            _dump(key, out, depth + 1)
            _dump(item, out, depth + 1)
    else:
        raise TypeError(f"a header field must be plain data (None, bool, int, float, str, "
                        f"bytes, list, tuple, dict), not {type(value).__qualname__}: "
                        f"{value!r:.80}")


def loads(data: Any) -> Any:
    """The value :func:`dumps` made of ``data`` (bytes-like); :class:`ValueError` if it is
    not exactly one well-formed value."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    try:
        value, pos = _load(view, 0, 0)
    except (struct.error, IndexError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"malformed header fields: {exc}") from None
    if pos != len(view):
        raise ValueError(f"malformed header fields: {len(view) - pos} bytes after the value")
    return value


def _load(data: Any, pos: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise ValueError(f"malformed header fields: nested deeper than {MAX_DEPTH} levels")
    tag = data[pos]
    pos += 1
    if tag == 0x71:  # q
        return _I64.unpack_from(data, pos)[0], pos + 8
    if tag == 0x73 or tag == 0x62 or tag == 0x51:  # s, b, Q
        (size,) = _U32.unpack_from(data, pos)
        pos += 4
        end = pos + size
        if end > len(data):
            raise ValueError("malformed header fields: a value runs past the end")
        raw = bytes(data[pos:end])
        if tag == 0x73:
            return raw.decode("utf-8", "surrogatepass"), end
        if tag == 0x62:
            return raw, end
        return int.from_bytes(raw, "little", signed=True), end
    if tag == 0x4E:  # N
        return None, pos
    if tag == 0x54:  # T
        return True, pos
    if tag == 0x46:  # F
        return False, pos
    if tag == 0x64:  # d
        return _F64.unpack_from(data, pos)[0], pos + 8
    if tag == 0x6C or tag == 0x74 or tag == 0x6D:  # l, t, m
        (count,) = _U32.unpack_from(data, pos)
        pos += 4
        if count > len(data) - pos:  # every value takes at least one byte
            raise ValueError("malformed header fields: a count runs past the end")
        if tag == 0x6D:
            table = {}
            for _ in range(count):
                key, pos = _load(data, pos, depth + 1)
                table[key], pos = _load(data, pos, depth + 1)  # an unhashable key: TypeError
            return table, pos
        items = []
        for _ in range(count):
            item, pos = _load(data, pos, depth + 1)
            items.append(item)
        return (items if tag == 0x6C else tuple(items)), pos
    raise ValueError(f"malformed header fields: unknown tag {tag:#04x} at byte {pos - 1}")
