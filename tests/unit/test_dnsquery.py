"""DNS queries and replies for ``ClusterBackend(dns=...)`` (pure), checked against dnslib's
own encoder and decoder."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.backends.cluster.dns import AAAA, A, DNSError, build_query, parse_addresses

dnslib = pytest.importorskip("dnslib", reason="the DNS tests need dnslib (pip install "
                                              "'phalanx[test]')")

NAME = "agents.ml.svc.cluster.local"


def reply_to(query: bytes, addresses: list[str], rcode: int = 0) -> bytes:
    request = dnslib.DNSRecord.parse(query)
    reply = request.reply()
    reply.header.rcode = rcode
    for address in addresses:
        if ":" in address:
            reply.add_answer(dnslib.RR(NAME, dnslib.QTYPE.AAAA, rdata=dnslib.AAAA(address)))
        else:
            reply.add_answer(dnslib.RR(NAME, dnslib.QTYPE.A, rdata=dnslib.A(address)))
    return reply.pack()


def test_a_query_is_what_a_dns_library_reads():
    parsed = dnslib.DNSRecord.parse(build_query(NAME, A, 4242))
    assert parsed.header.id == 4242 and parsed.header.rd == 1
    assert str(parsed.q.qname) == NAME + "." and parsed.q.qtype == dnslib.QTYPE.A


@given(st.lists(st.ip_addresses(v=4).map(str), max_size=20), st.integers(0, 65535))
def test_every_a_record_is_read_back(addresses, query_id):
    query = build_query(NAME, A, query_id)
    assert parse_addresses(reply_to(query, addresses), query_id, A) == addresses


@given(st.lists(st.ip_addresses(v=6).map(str), min_size=1, max_size=5))
def test_aaaa_records_are_read_and_a_records_left_out(addresses):
    query = build_query(NAME, AAAA, 7)
    found = parse_addresses(reply_to(query, [*addresses, "10.0.0.1"]), 7, AAAA)
    assert found == [str(ipaddress.IPv6Address(a)) for a in addresses]


def test_a_name_that_does_not_exist_has_no_addresses():
    query = build_query(NAME, A, 1)
    assert parse_addresses(reply_to(query, [], rcode=3), 1, A) == []


def test_a_server_failure_is_an_error():
    query = build_query(NAME, A, 1)
    with pytest.raises(DNSError, match="error code 2"):
        parse_addresses(reply_to(query, [], rcode=2), 1, A)


def test_a_reply_to_another_query_or_a_truncated_one_is_refused():
    query = build_query(NAME, A, 1)
    packet = reply_to(query, ["10.0.0.1", "10.0.0.2"])
    with pytest.raises(DNSError, match="not a reply to this query"):
        parse_addresses(packet, 2, A)
    for cut in (5, 20, len(packet) - 3):
        with pytest.raises(DNSError):
            parse_addresses(packet[:cut], 1, A)


@pytest.mark.parametrize("name", ["", ".", "a" * 64 + ".example"])
def test_a_malformed_name_is_refused(name):
    with pytest.raises(ValueError, match="not a DNS name"):
        build_query(name, A, 1)
