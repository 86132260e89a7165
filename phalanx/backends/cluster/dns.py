"""Finding the agents behind one DNS name (``ClusterBackend(dns=...)``).

A Kubernetes headless Service's name resolves to one A (or AAAA) record per ready pod.
:func:`resolve` returns every address of a name: through the system's resolver, or -- with
``nameserver="host:port"`` -- by asking that server directly over UDP (a test's DNS
server, a cluster DNS the system does not use). The wire format is built and read here
(:func:`build_query`, :func:`parse_addresses`: pure), stdlib only.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import struct

A, AAAA = 1, 28
_IN = 1
_HEADER = struct.Struct("!HHHHHH")  # id, flags, question, answer, authority, additional
_RR = struct.Struct("!HHIH")  # type, class, ttl, data length
NXDOMAIN = 3


class DNSError(OSError):
    """The name could not be resolved (no answer, a server failure, a malformed reply)."""


def build_query(name: str, qtype: int, query_id: int) -> bytes:
    """A recursive query for ``name``'s records of ``qtype``."""
    try:
        parts = [label.encode("idna") for label in name.rstrip(".").split(".") if label]
    except UnicodeError:
        parts = []
    if not parts or any(len(part) > 63 for part in parts):
        raise ValueError(f"not a DNS name: {name!r}")
    question = b"".join(bytes([len(part)]) + part for part in parts) + b"\0"
    return _HEADER.pack(query_id, 0x0100, 1, 0, 0, 0) + question + struct.pack("!HH", qtype,
                                                                               _IN)


def _skip_name(packet: bytes, pos: int) -> int:
    """The offset after a (possibly compressed) name starting at ``pos``."""
    while True:
        if pos >= len(packet):
            raise DNSError("a truncated name in the DNS reply")
        length = packet[pos]
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return pos + 2
        if length == 0:
            return pos + 1
        pos += 1 + length


def parse_addresses(packet: bytes, query_id: int, qtype: int) -> list[str]:
    """The addresses of ``qtype`` in a reply to query ``query_id``; [] for a name that does
    not exist; DNSError for a reply that is not one, or reports a failure."""
    packet = bytes(packet)
    if len(packet) < _HEADER.size:
        raise DNSError("a DNS reply shorter than its header")
    reply_id, flags, questions, answers, _, _ = _HEADER.unpack_from(packet)
    if reply_id != query_id or not flags & 0x8000:
        raise DNSError("not a reply to this query")
    code = flags & 0x000F
    if code == NXDOMAIN:
        return []
    if code:
        raise DNSError(f"the DNS server answered with error code {code}")
    pos = _HEADER.size
    for _ in range(questions):
        pos = _skip_name(packet, pos) + 4
    found = []
    for _ in range(answers):
        pos = _skip_name(packet, pos)
        if pos + _RR.size > len(packet):
            raise DNSError("a truncated record in the DNS reply")
        rtype, rclass, _, size = _RR.unpack_from(packet, pos)
        pos += _RR.size
        data = packet[pos:pos + size]
        if len(data) != size:
            raise DNSError("a truncated record in the DNS reply")
        pos += size
        if rclass == _IN and rtype == qtype == A and size == 4:
            found.append(str(ipaddress.IPv4Address(data)))
        elif rclass == _IN and rtype == qtype == AAAA and size == 16:
            found.append(str(ipaddress.IPv6Address(data)))
    return found


def resolve(name: str, nameserver: str | None = None, timeout: float = 2.0) -> list[str]:
    """Every address ``name`` resolves to, IPv4 first, without repeats."""
    if nameserver is None:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return []
            raise DNSError(f"cannot resolve {name!r}: {exc}") from None
        found = [str(info[4][0]) for info in infos]
    else:
        host, _, port = nameserver.rpartition(":")
        found = []
        for qtype in (A, AAAA):
            found += _ask((host.strip("[]"), int(port)), name, qtype, timeout)
    return sorted(dict.fromkeys(found), key=lambda a: (":" in a, a))


def _ask(server: tuple[str, int], name: str, qtype: int, timeout: float) -> list[str]:
    query_id = random.randrange(1 << 16)
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(build_query(name, qtype, query_id), server)
            while True:
                packet, _ = sock.recvfrom(65535)
                try:
                    return parse_addresses(packet, query_id, qtype)
                except DNSError as exc:
                    if "not a reply to this query" not in str(exc):
                        raise
        except TimeoutError:
            raise DNSError(f"the DNS server {server[0]}:{server[1]} did not answer within "
                           f"{timeout:g} s") from None
        except OSError as exc:
            if isinstance(exc, DNSError):
                raise
            raise DNSError(f"cannot ask the DNS server {server[0]}:{server[1]}: {exc}") from None
