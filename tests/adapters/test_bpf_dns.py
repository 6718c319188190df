"""DNS per pod in the kernel: the `dns` aggregates, the outstanding queries and the verdict counts (root).

BPF_PROG_TEST_RUN on crafted frames checks exact keys, counts and latencies, the bounds (a full map, a
flood of unanswered queries), TCP, and the sweep; real pods (netns, veth) asking a real DNS server
(dnsmasq) check the whole path: exact counts per pod by qtype and rcode, a 253-character name, malformed
packets counted and not read, a pod deleted between query and answer, and nothing left after uninstall.
"""

from __future__ import annotations

import time

import pytest

from bpf_support import needs_root
from dns_support import AAAA, SRV, DnsProgram, dns_program, message, name_of, response
from podmeter.adapters.datapath.ebpf.datapath import DNS_PENDING_SIZE
from podmeter.model import dns
from podmeter.model.dns import Direction, Verdict

pytestmark = needs_root


def _by_key(program: DnsProgram) -> dict[tuple[Direction, str, int, int], dns.DnsCounts]:
    merged = dns.merge(program.maps.drain().entries)
    return {(key.direction, key.name, key.qtype, key.rcode): counts for key, counts in merged.items()}


def test_queries_and_answers_are_aggregated_with_their_latency() -> None:
    with dns_program() as program:
        for ident in range(3):
            program.query(message(ident, "cart.shop.svc.cluster.local"), port=40000 + ident)
        program.query(message(9, "cart.shop.svc.cluster.local", AAAA), port=41000)
        time.sleep(0.003)  # the first answer 3 ms or more after its query
        program.answer(response(0, "cart.shop.svc.cluster.local"), port=40000)
        program.answer(response(1, "cart.shop.svc.cluster.local", rcode=3), port=40001)
        program.answer(response(2, "CART.shop.svc.cluster.local", rcode=3), port=40002)  # case: one name
        entries = program.maps.drain().entries
        assert {(key.pod, key.server, key.protocol) for key, _ in entries} == {("10.0.0.2", "10.96.0.10", 17)}
        found = {(key.direction, key.name, key.qtype, key.rcode): counts for key, counts in dns.merge(entries).items()}
        name = "cart.shop.svc.cluster.local."
        assert {k: c.count for k, c in found.items()} == {
            (Direction.QUERY, name, 1, 0): 3, (Direction.QUERY, name, AAAA, 0): 1,
            (Direction.RESPONSE, name, 1, 0): 1, (Direction.RESPONSE, name, 1, 3): 2}
        noerror = found[(Direction.RESPONSE, name, 1, 0)]
        assert noerror.latency_count == 1 and noerror.latency_sum_ns >= 3_000_000
        assert sum(noerror.buckets[:2]) == 0 and sum(noerror.buckets) == 1  # over 2 ms
        assert found[(Direction.QUERY, name, 1, 0)].latency_count == 0
        assert program.counts() == {Verdict.PARSED: 7}
        assert program.maps.drain().entries == []  # taken: the next drain starts from zero


def test_a_253_character_name_is_read_whole_and_a_longer_one_is_counted() -> None:
    with dns_program() as program:
        longest = name_of(253)
        program.query(message(1, longest, SRV))
        program.query(message(2, name_of(254)))
        assert list(_by_key(program)) == [(Direction.QUERY, longest + ".", SRV, 0)]
        assert program.counts() == {Verdict.PARSED: 1, Verdict.NAME_LONG: 1}


def test_malformed_messages_are_counted_and_not_read() -> None:
    with dns_program() as program:
        good = message(1, "a.test")
        program.query(good[:11])
        program.query(good[:-1])
        program.query(message(1, "a.test", qdcount=0))
        program.query(message(1, b"\xc0\x0c"))  # a pointer to itself: the loop is never followed
        program.query(message(1, b"\x05ab"))  # the label runs past the end
        program.query(message(1, b"\x50" + b"a" * 80 + b"\x00"))
        program.query(response(1, "a.test"))  # a response sent to port 53
        program.answer(message(1, "a.test"))  # a query coming from port 53
        assert program.maps.drain().entries == []
        assert program.counts() == {Verdict.TRUNCATED: 3, Verdict.BAD_COUNT: 1, Verdict.POINTER: 1,
                                    Verdict.LABEL_LONG: 1, Verdict.WRONG_QR: 2}


def test_a_compressed_answer_does_not_disturb_the_question() -> None:
    with dns_program() as program:
        program.query(message(4, "web.svc.cluster.local"))
        program.answer(response(4, "web.svc.cluster.local", compressed_answer=True))
        assert _by_key(program)[(Direction.RESPONSE, "web.svc.cluster.local.", 1, 0)].latency_count == 1


def test_tcp_is_read_when_the_segment_holds_one_message() -> None:
    with dns_program() as program:
        program.query(message(5, "big.test", 255), tcp=True)
        program.answer(response(5, "big.test", 255), tcp=True)
        split = message(6, "split.test")
        program.query(split, tcp=True, tcp_length=len(split) + 100)  # the rest in the next segment
        program.query(split + split, tcp=True, tcp_length=len(split))  # two messages in one segment
        found = _by_key(program)
        assert found[(Direction.RESPONSE, "big.test.", 255, 0)].latency_count == 1
        assert set(found) == {(Direction.QUERY, "big.test.", 255, 0), (Direction.RESPONSE, "big.test.", 255, 0)}
        assert program.counts() == {Verdict.PARSED: 2, Verdict.TCP: 2}


def test_a_full_map_is_counted_per_message() -> None:
    with dns_program(dns_size=2) as program:
        for ident, name in enumerate(["a.test", "b.test", "c.test", "c.test", "a.test"]):
            program.query(message(ident, name))
        assert {name for _, name, _, _ in _by_key(program)} == {"a.test.", "b.test."}
        assert program.counts() == {Verdict.PARSED: 3, Verdict.FULL: 2}


def test_the_outstanding_queries_stay_bounded_under_a_flood_and_are_swept() -> None:
    with dns_program() as program:
        for ident in range(DNS_PENDING_SIZE + 2000):
            program.query(message(ident & 0xFFFF, "flood.test"), port=20000 + ident // 0x10000)
        pending = program.maps.pending_count()
        assert DNS_PENDING_SIZE // 2 <= pending <= DNS_PENDING_SIZE
        assert program.maps.sweep(lambda ip: True) == 0  # all younger than 5 s, of an observed pod
        assert program.maps.sweep(lambda ip: True, now_ns=time.monotonic_ns() + 6_000_000_000) == pending
        program.query(message(1, "a.test"))
        assert program.maps.sweep(lambda ip: ip != program.pod) == 1  # its pod left the filter
        assert program.maps.pending_count() == 0
        program.answer(response(1, "a.test"))  # its query is gone: no latency, counted
        assert program.counts()[Verdict.UNMATCHED] == 1


def test_an_unobserved_pod_is_not_read() -> None:
    with dns_program() as program:
        assert program.datapath.delete([program.pod]).error is None
        program.query(message(1, "a.test"))
        program.answer(response(1, "a.test"))
        assert program.maps.drain().entries == [] and program.counts() == {}


@pytest.mark.parametrize("ip", ["fd00::2"])
def test_ipv6_pods(ip: str) -> None:
    program = DnsProgram.load(pod=ip)
    program.server = "fd00::a"
    try:
        program.query(message(3, "v6.test", AAAA))
        program.answer(response(3, "v6.test", AAAA))
        entries = program.maps.drain().entries
        assert {(key.pod, key.server) for key, _ in entries} == {(ip, "fd00::a")}
        assert sum(counts.latency_count for _, counts in entries) == 1
    finally:
        program.close()
