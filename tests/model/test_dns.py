"""DNS records and the parser's rules: the Python mirror (model.dns) is the oracle, and the kernel's parser
(bpf/podmeter_dns.h, through BPF_PROG_TEST_RUN on crafted frames) must agree with it on random valid and
malformed messages: truncated, bad counts, long and reserved labels, pointers in the question (a label
loop), names up to and past 255 bytes, compressed answers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dns_support import DnsProgram, message, name_of, response
from podmeter.adapters.metrics.pod_dns import PodDnsExposition
from podmeter.cli.observe import compact
from podmeter.model import dns
from podmeter.model.endpoints import AddressBook, ChainedNames
from podmeter.model.flow_records import EndpointCache, FlowFilter, encode_json, name_dns
from podmeter.model.records import Pod

fast = pytest.mark.fast
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf)")

labels = st.binary(min_size=1, max_size=63).map(lambda raw: bytes([len(raw)]) + raw)
wire_names = st.lists(labels, max_size=6).map(lambda parts: b"".join(parts) + b"\x00")


@fast
@given(st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=63), max_size=4))
def test_a_name_survives_wire_and_back(parts: list[str]) -> None:
    text = ".".join(parts) + "."
    assert dns.name_text(dns.wire_name(text)) == (text if parts else ".")


@fast
def test_names_are_lowercased_and_odd_bytes_escaped() -> None:
    assert dns.name_text(b"\x04CaRt\x03svc\x00") == "cart.svc."
    assert dns.name_text(b"\x03a.b\x02\x00\\\x00") == "a\\046b.\\000\\092."


@fast
@pytest.mark.parametrize("bad", [b"", b"\x03ab", b"\x01a\x00x", b"\x40" + b"a" * 64 + b"\x00"])
def test_a_broken_wire_name_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        dns.name_text(bad)


@fast
def test_the_mirror_reads_and_refuses_by_the_rules() -> None:
    q = dns.parse_question(message(7, "a.svc.cluster.local", 28))
    assert q == dns.Question(7, False, 0, 28, dns.wire_name("a.svc.cluster.local"))
    r = dns.parse_question(response(9, "x.test", 1, 3, compressed_answer=True))
    assert isinstance(r, dns.Question) and (r.response, r.rcode) == (True, 3)
    assert dns.parse_question(message(1, "a")[:11]) is dns.Verdict.TRUNCATED
    assert dns.parse_question(message(1, "a", qdcount=2)) is dns.Verdict.BAD_COUNT
    assert dns.parse_question(message(1, b"\xc0\x0c")) is dns.Verdict.POINTER  # a loop onto itself
    assert dns.parse_question(message(1, b"\x41" + b"a" * 65 + b"\x00")) is dns.Verdict.LABEL_LONG
    assert isinstance(dns.parse_question(message(1, name_of(253))), dns.Question)  # 255 wire bytes
    assert dns.parse_question(message(1, name_of(254))) is dns.Verdict.NAME_LONG
    assert dns.parse_question(message(1, "abc")[:-1]) is dns.Verdict.TRUNCATED  # qclass cut


@fast
def test_counts_add_and_merge_by_key() -> None:
    key = dns.DnsKey("10.0.0.2", "10.96.0.10", dns.Direction.RESPONSE, "a.", 1, 3, 17)
    one = dns.DnsCounts(1, 1, 5, (1,) + (0,) * 12)
    merged = dns.merge([(key, one), (key, one)])
    assert merged == {key: dns.DnsCounts(2, 2, 10, (2,) + (0,) * 12)}
    assert dns.latency_ms(merged[key]) == {"count": 2, "mean": 0.0, "buckets": {"1": 2}}
    assert dns.rcode_name(3) == "NXDOMAIN" and dns.rcode_name(23) == "23"
    assert dns.qtype_name(28) == "AAAA" and dns.qtype_name(4242) == "4242"


# --- the kernel agrees with the mirror --------------------------------------------------------------------


def _tail(draw: st.DrawFn) -> bytes:
    return draw(st.binary(max_size=40))


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """Valid questions, and every way of breaking one."""
    ident = draw(st.integers(0, 0xFFFF))
    qtype = draw(st.sampled_from([1, 28, 5, 33, 12, 16, 255, 4242]))
    kind = draw(st.sampled_from(["valid", "long", "truncated", "count", "pointer", "label", "compressed",
                                 "random"]))
    if kind == "long":
        return message(ident, name_of(draw(st.integers(240, 262))), qtype)
    if kind == "random":
        return draw(st.binary(max_size=300))
    wire = draw(wire_names)
    if kind == "pointer":
        wire = wire[:-1] + struct.pack("!H", 0xC000 | draw(st.integers(0, 0x3FFF)))
    elif kind == "label":
        wire = bytes([draw(st.integers(64, 191))]) + b"a" * draw(st.integers(0, 70)) + b"\x00"
    msg = message(ident, wire, qtype, qdcount=draw(st.integers(0, 3)) if kind == "count" else 1)
    if kind == "compressed":
        msg += struct.pack("!HHHIH", 0xC00C, 1, 1, 30, 4) + bytes(4)
    if kind == "truncated":
        msg = msg[: draw(st.integers(0, len(msg) - 1))]
    return msg + (_tail(draw) if kind == "valid" else b"")


@pytest.fixture(scope="module")
def program() -> Iterator[DnsProgram]:
    if os.geteuid() != 0:
        pytest.skip("needs root (bpf)")
    loaded = DnsProgram.load(dns_size=4096)
    try:
        yield loaded
    finally:
        loaded.close()


def _expected(msg: bytes, response_side: bool) -> tuple[dns.Verdict, dns.Question | None]:
    parsed = dns.parse_question(msg)
    if isinstance(parsed, dns.Verdict):
        return parsed, None
    if parsed.response != response_side:
        return dns.Verdict.WRONG_QR, None
    return dns.Verdict.PARSED, parsed


@needs_root
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages(), st.booleans(), st.booleans())
def test_the_kernel_parser_agrees_with_the_mirror(program: DnsProgram, msg: bytes, response_side: bool,
                                                  tcp: bool) -> None:
    if response_side:  # the flags' QR bit as a response carries it, so that both sides get valid ones
        msg = msg[:2] + bytes([msg[2] | 0x80]) + msg[3:] if len(msg) >= 3 else msg
    before = program.maps.counts()
    (program.answer if response_side else program.query)(msg, tcp=tcp)
    after = program.maps.counts()
    changed = {verdict for verdict in dns.Verdict if after[verdict] != before[verdict]}
    changed -= {dns.Verdict.UNMATCHED}  # a response without a query: informational, beside PARSED
    verdict, question = _expected(msg, response_side)
    assert changed == {verdict}, (msg, changed, verdict)
    entries = program.maps.drain().entries
    if question is None:
        assert entries == []
        return
    ((key, counts),) = entries
    assert (key.name, key.qtype, key.protocol, counts.count) == (
        dns.name_text(question.wire_name), question.qtype, 6 if tcp else 17, 1)
    assert key.rcode == (question.rcode if response_side else 0)
    assert key.direction is (dns.Direction.RESPONSE if response_side else dns.Direction.QUERY)


# --- the per-pod series and the records ---------------------------------------------------------------------


def _pod(uid: str, ip: str, name: str = "web") -> Pod:
    return Pod(uid, "shop", name, "node-a", (ip,), False, "Running", False, True, (), "1")


def _entry(direction: dns.Direction, qtype: int = 1, rcode: int = 0, count: int = 1, latency_bucket: int | None = None,
           pod: str = "10.0.0.2") -> dns.DnsEntry:
    buckets = [0] * dns.BUCKETS
    if latency_bucket is not None:
        buckets[latency_bucket] = count
    key = dns.DnsKey(pod, "10.96.0.10", direction, "cart.shop.svc.cluster.local.", qtype, rcode, 17)
    lat = count if latency_bucket is not None else 0
    return key, dns.DnsCounts(count, lat, lat * 3_000_000, tuple(buckets))


@fast
def test_a_pods_dns_series_lives_with_its_pod_then_its_grace() -> None:
    ledger = dns.DnsLedger(grace=30)
    web = _pod("u1", "10.0.0.2")
    ledger.assign("10.0.0.2", web, now=0)
    assert ledger.series["u1"].queries == {} and ledger.series["u1"].buckets == [0] * dns.BUCKETS  # at 0 at once
    holders = {"10.0.0.2": "u1"}
    ledger.add([_entry(dns.Direction.QUERY, 1, count=3), _entry(dns.Direction.QUERY, 28),
                _entry(dns.Direction.RESPONSE, 1, 3, count=2, latency_bucket=2),
                _entry(dns.Direction.RESPONSE, pod="10.0.0.9")], holders)
    series = ledger.series["u1"]
    assert (series.queries, series.responses) == ({1: 3, 28: 1}, {3: 2})
    assert (series.latency_count, series.buckets[2], ledger.unattributed) == (2, 2, 1)
    ledger.release(["10.0.0.2"], now=10)  # the pod goes: the series stays for its grace ...
    ledger.add([_entry(dns.Direction.RESPONSE, 1, 0)], holders)  # ... and takes its last answers
    assert ledger.expire(now=39) == 0 and ledger.series["u1"].responses == {3: 2, 0: 1}
    assert ledger.expire(now=40) == 1 and ledger.series == {}
    ledger.assign("10.0.0.2", web, now=50)  # observed again: a new series from zero
    assert ledger.series["u1"].responses == {} and ledger.owners == {"10.0.0.2": "u1"}


@fast
def test_a_dns_record_carries_the_flow_fields_and_the_dns_object() -> None:
    entries = [_entry(dns.Direction.QUERY, 28, count=2), _entry(dns.Direction.RESPONSE, 28, 3, 2, latency_bucket=2)]
    query, answer = name_dns(entries, EndpointCache(ChainedNames(AddressBook([_pod("u1", "10.0.0.2")]))),
                             "node-a", 1000.0)
    out = answer.to_json()
    assert out["dns"] == {"direction": "response", "query": "cart.shop.svc.cluster.local.", "qtype": "AAAA",
                          "rcode": "NXDOMAIN", "count": 2,
                          "latency_ms": {"count": 2, "mean": 3.0, "buckets": {"5": 2}}}
    assert (out["source"]["ip"], out["source"]["port"], out["destination"]["pod"]) == ("10.96.0.10", 53, "web")
    assert (out["protocol"], out["observation"], out["packets"]) == ("UDP", "to-pod", 2)
    assert query.to_json()["dns"]["rcode"] is None and query.to_json()["source"]["pod"] == "web"
    for record in (query, answer):  # the fast encoder writes the same bytes
        assert encode_json(record) == msgspec.json.encode(record.to_json())
    assert FlowFilter(protocol="dns").matches(answer) and not FlowFilter(protocol="tcp").matches(answer)
    assert FlowFilter(protocol="DNS", namespace="shop").matches(query)
    line = compact(json.loads(encode_json(answer)))
    assert "DNS response cart.shop.svc.cluster.local. AAAA NXDOMAIN 3 ms x2" in line


def test_the_dns_series_are_valid_prometheus_text() -> None:
    ledger = dns.DnsLedger(grace=30)
    ledger.assign("10.0.0.2", _pod("u1", "10.0.0.2"), now=0)
    ledger.add([_entry(dns.Direction.QUERY, 33), _entry(dns.Direction.RESPONSE, 33, 2, latency_bucket=12)],
               {"10.0.0.2": "u1"})
    text = PodDnsExposition(ledger, lambda: {dns.Verdict.PARSED: 2, dns.Verdict.POINTER: 1}).render().decode()
    assert 'podmeter_pod_dns_queries_total{namespace="shop",pod="web",qtype="SRV"} 1' in text
    assert 'podmeter_pod_dns_responses_total{namespace="shop",pod="web",rcode="SERVFAIL"} 1' in text
    assert 'podmeter_pod_dns_response_seconds_bucket{namespace="shop",pod="web",le="5"} 0' in text
    assert 'podmeter_pod_dns_response_seconds_bucket{namespace="shop",pod="web",le="+Inf"} 1' in text
    assert 'podmeter_dns_messages_total{verdict="pointer"} 1' in text
    assert "cart.shop" not in text  # names are never a label
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


drains = st.lists(st.lists(st.tuples(st.sampled_from(list(dns.Direction)), st.sampled_from([1, 28, 33]),
                                     st.integers(0, 5), st.integers(1, 9), st.sampled_from(["10.0.0.2", "10.0.0.3"])),
                           max_size=8), max_size=6)


@fast
@given(drains)
def test_the_series_of_drains_added_one_by_one_equal_those_of_all_at_once(batches: list[list[tuple[
        dns.Direction, int, int, int, str]]]) -> None:
    def ledger() -> dns.DnsLedger:
        made = dns.DnsLedger(grace=30)
        made.assign("10.0.0.2", _pod("u1", "10.0.0.2"), now=0)
        return made

    def entries(batch: list[tuple[dns.Direction, int, int, int, str]]) -> list[dns.DnsEntry]:
        return [_entry(d, qtype, rcode if d is dns.Direction.RESPONSE else 0, count,
                       latency_bucket=rcode if d is dns.Direction.RESPONSE else None, pod=ip)
                for d, qtype, rcode, count, ip in batch]

    incremental, at_once = ledger(), ledger()
    for batch in batches:
        incremental.add(entries(batch), {"10.0.0.2": "u1"})
    at_once.add(dns.merge(entry for batch in batches for entry in entries(batch)).items(), {"10.0.0.2": "u1"})
    assert incremental.series == at_once.series and incremental.unattributed == at_once.unattributed
