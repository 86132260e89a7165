"""The ports phalanx hands out (``MASTER_PORT``, a framework's service ports) are free on
every address of the machine, not only on the node's: torch's TCPStore binds the wildcard
address, and simulated nodes and agents hold ports on the other loopback addresses. A port
free on 127.0.0.1 but held on 127.0.0.2 made every wildcard bind on it fail."""

from __future__ import annotations

import contextlib
import socket

import pytest

from phalanx.node.machine import free_port, pick_free_ports

HELD = 300  # ports held on other addresses while phalanx picks
PICKS = 1000


def _bindable_on_every_address(port: int) -> bool:
    """Whether ``port`` can be bound on the wildcard address, as torch's TCPStore does
    (IPv6 with IPv4 mapped where the machine has both, else IPv4)."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture
def held_elsewhere():
    """Ports held (listening) on 127.0.0.2, and on ::1 where the machine has IPv6."""
    with contextlib.ExitStack() as stack:
        held: set[int] = set()
        places = [(socket.AF_INET, "127.0.0.2")]
        if socket.has_ipv6:
            places.append((socket.AF_INET6, "::1"))
        for family, address in places:
            for _ in range(HELD):
                sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind((address, 0))
                except OSError:  # no IPv6 loopback here
                    break
                sock.listen()
                held.add(sock.getsockname()[1])
        yield held


def test_no_port_handed_out_for_one_address_is_held_on_another(held_elsewhere):
    picked: list[int] = []
    unbindable: list[int] = []
    for i in range(PICKS // 10):
        ports = [free_port("127.0.0.1")] if i % 2 else pick_free_ports("127.0.0.1", 19)
        picked.extend(ports)
        # at once: a port of the kernel's range may be any process's a moment later
        unbindable.extend(port for port in ports if not _bindable_on_every_address(port))
    taken = sorted(set(picked) & held_elsewhere)
    assert not taken, f"{len(taken)} of {len(picked)} ports handed out are held: {taken[:10]}"
    assert not unbindable, f"not bindable on the wildcard address: {unbindable[:10]}"


def test_ports_picked_together_are_distinct():
    ports = pick_free_ports("127.0.0.1", 50)
    assert len(set(ports)) == 50
    assert all(0 < port < 65536 for port in ports)


def test_any_address_is_asked_with_an_empty_host():
    assert _bindable_on_every_address(free_port(""))
