"""DNS per pod in the kernel: the `dns` aggregates, the outstanding queries and the verdict counts (root).

BPF_PROG_TEST_RUN on crafted frames checks exact keys, counts and latencies, the bounds (a full map, a
flood of unanswered queries), TCP, and the sweep; real pods (netns, veth) asking a real DNS server
(dnsmasq) check the whole path: exact counts per pod by qtype and rcode, a 253-character name, malformed
packets counted and not read, a pod deleted between query and answer, and nothing left after uninstall.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import wait_for
from bpf_support import Node, Topology, get_in_host, needs_root, run
from dns_support import (
    AAAA,
    SRV,
    TXT,
    A,
    Dnsmasq,
    DnsProgram,
    ask,
    ask_from,
    dns_program,
    message,
    name_of,
    pod_with_resolver,
    rcode_of,
    response,
)
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.datapath import DNS_PENDING_SIZE
from podmeter.adapters.datapath.ebpf.netns import netns
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
        program.datapath.take_counters([program.pod])  # as the agent's handover does: the IP is no one's now
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


# --- real pods, a real DNS server ---------------------------------------------------------------------------


@pytest.fixture
def dnsmasq(node: Node, topology: Topology) -> Iterator[Dnsmasq]:
    """dnsmasq on the node (the topology's host netns), on the observed pod's gateway address."""
    server = Dnsmasq(topology.host_path, node.observed.host_ip)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_real_queries_are_counted_per_pod_by_qtype_and_rcode(node: Node, dnsmasq: Dnsmasq,
                                                             topology: Topology) -> None:
    pod, server, datapath = node.observed, dnsmasq.address, node.datapath
    assert datapath.dns is not None
    datapath.dns.drain()  # the server's readiness probe came from the host: nothing, but start clean
    long_name = name_of(253 - len(".nxdomain.test")) + ".nxdomain.test"
    asked = [("cart.shop.svc.cluster.local", A, 0)] * 3 + [("gone.nxdomain.test", AAAA, 3)] * 2 + [
        ("elsewhere.example", A, 5), (long_name, TXT, 3)]
    for ident, (name, qtype, rcode) in enumerate(asked):
        answer = ask_from(pod, server, message(ident, name, qtype))
        assert answer is not None and rcode_of(answer) == rcode, name
    answer = ask_from(pod, server, message(99, "db.shop.svc.cluster.local", A), tcp=True)
    assert rcode_of(answer or b"\x00" * 4) == 0
    ask_from(node.unobserved, node.unobserved.host_ip, message(7, "x.svc.cluster.local"))  # not observed
    silent = pod.host_ip.rsplit(".", 1)[0] + ".53"  # an address of the node where nothing serves DNS
    run("ip", "-n", topology.host, "addr", "add", f"{silent}/32", "dev", pod.host_veth)
    with netns(pod.netns_path):  # malformed, to it: counted, not read
        for broken in (message(1, "a.test")[:9], message(1, b"\xc0\x0c"), message(1, "a.test", qdcount=2)):
            assert ask(silent, broken, timeout=0.3) is None
    entries = dns.merge(datapath.dns.drain().entries)
    assert {(key.pod, key.server) for key in entries} == {(pod.ip, server)}
    found = {(key.direction, key.name, key.qtype, key.rcode, key.protocol): c.count for key, c in entries.items()}
    svc, gone = "cart.shop.svc.cluster.local.", "gone.nxdomain.test."
    assert found == {
        (Direction.QUERY, svc, A, 0, 17): 3, (Direction.RESPONSE, svc, A, 0, 17): 3,
        (Direction.QUERY, gone, AAAA, 0, 17): 2, (Direction.RESPONSE, gone, AAAA, 3, 17): 2,
        (Direction.QUERY, "elsewhere.example.", A, 0, 17): 1, (Direction.RESPONSE, "elsewhere.example.", A, 5, 17): 1,
        (Direction.QUERY, long_name + ".", TXT, 0, 17): 1, (Direction.RESPONSE, long_name + ".", TXT, 3, 17): 1,
        (Direction.QUERY, "db.shop.svc.cluster.local.", A, 0, 6): 1,
        (Direction.RESPONSE, "db.shop.svc.cluster.local.", A, 0, 6): 1,
    }
    responses = [c for key, c in entries.items() if key.direction is Direction.RESPONSE]
    assert all(c.latency_count == c.count and c.latency_sum_ns > 0 for c in responses)
    counts = datapath.dns.counts()
    assert (counts[Verdict.PARSED], counts[Verdict.TRUNCATED], counts[Verdict.POINTER], counts[Verdict.BAD_COUNT]) == (
        16, 1, 1, 1)


def test_a_pod_deleted_between_query_and_answer_leaves_nothing(node: Node, topology: Topology) -> None:
    """The answer comes after the pod's address left the filter: not counted, and its query is swept."""
    pod, datapath = node.observed, node.datapath
    assert datapath.dns is not None
    with topology.in_host():  # a server on the node's port 53 that answers by hand, after the delete
        server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with server, netns(pod.netns_path), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as asker:
        server.bind((pod.host_ip, 53))
        server.settimeout(5)
        asker.sendto(message(42, "late.test"), (pod.host_ip, 53))
        _, peer = server.recvfrom(512)
        assert datapath.dns.pending_count() == 1
        assert datapath.delete([pod.ip]).error is None  # the pod is deleted
        datapath.take_counters([pod.ip])  # and its counters taken, as the agent's handover does
        server.sendto(response(42, "late.test", rcode=3), peer)
    entries = datapath.dns.drain().entries
    assert [key.direction for key, _ in entries] == [Direction.QUERY]  # the answer was not the pod's any more
    assert datapath.dns.sweep(lambda ip: ip in datapath.contents()) == 1
    assert datapath.dns.pending_count() == 0


# --- the agent, end to end -----------------------------------------------------------------------------------


def _agent(topology: Topology, server: LabServer, pins: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    argv = ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "agent",
            "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(pins), "--filter-map-size", "64",
            "--listen", f"127.0.0.1:{port}", "--metrics-min-interval", "0.1", "--flow-interval", "0.3",
            "--series-grace", "1"]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env={**os.environ, "KUBECONFIG": str(server.kubeconfig)}, stdout=out,
                                stderr=subprocess.STDOUT)


def _dns_samples(topology: Topology, port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        text = get_in_host(topology, f"http://127.0.0.1:{port}/metrics").decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if "dns" in s.name}


def _map_ids(pins: Path) -> set[int]:
    with EbpfDatapath.open_pinned(pins) as reader:
        assert reader.dns is not None
        return {reader.dns.aggregates.id, reader.dns.pending.id, reader.dns.counts_map.id}


def test_the_agent_serves_dns_per_pod_and_leaves_nothing_after_uninstall(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    web, cluster, resolver = pod_with_resolver(topology, server)
    port = topology.free_port()
    agent = _agent(topology, server, pin_dir, port, tmp_path / "agent.log")
    pod = (("namespace", "shop"), ("pod", "web"))

    def log() -> str:
        return (tmp_path / "agent.log").read_text(errors="replace")[-3000:]

    try:
        resolver.start()
        wait_for(lambda: ("podmeter_pod_dns_response_seconds_count", pod) in _dns_samples(topology, port), 30,
                 "web's DNS series", log)
        time.sleep(0.5)  # the pod's link attached (its series exist once its IP is in the filter)
        for ident, (name, qtype) in enumerate([("cart.shop.svc.cluster.local", A)] * 2 + [
                ("gone.nxdomain.test", AAAA), ("elsewhere.example", A)]):
            assert ask_from(web, resolver.address, message(ident, name, qtype)) is not None
        expected = {
            ("podmeter_pod_dns_queries_total", (*pod, ("qtype", "A"))): 3.0,
            ("podmeter_pod_dns_queries_total", (*pod, ("qtype", "AAAA"))): 1.0,
            ("podmeter_pod_dns_responses_total", (*pod, ("rcode", "NOERROR"))): 2.0,
            ("podmeter_pod_dns_responses_total", (*pod, ("rcode", "NXDOMAIN"))): 1.0,
            ("podmeter_pod_dns_responses_total", (*pod, ("rcode", "REFUSED"))): 1.0,
            ("podmeter_pod_dns_response_seconds_count", pod): 4.0,
        }
        wait_for(lambda: all(_dns_samples(topology, port).get(k) == v for k, v in expected.items()), 20,
                 "web's DNS counts", lambda: _dns_samples(topology, port))
        observed = run("nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "observe",
                       "--server", f"127.0.0.1:{port}", "--protocol", "dns", "-o", "json", "--last", "100")
        records = [json.loads(line) for line in observed.splitlines()]
        answers = {(r["dns"]["query"], r["dns"]["qtype"], r["dns"]["rcode"]): r["dns"]["count"] for r in records
                   if r["dns"]["direction"] == "response"}
        assert answers == {("cart.shop.svc.cluster.local.", "A", "NOERROR"): 2,
                           ("gone.nxdomain.test.", "AAAA", "NXDOMAIN"): 1, ("elsewhere.example.", "A", "REFUSED"): 1}
        assert all(r["destination"]["pod"] == "web" for r in records if r["dns"]["direction"] == "response")
        assert all(r["dns"]["latency_ms"]["count"] == r["dns"]["count"] for r in records if r["dns"]["rcode"])
        compact_lines = run("nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter",
                            "observe", "--server", f"127.0.0.1:{port}", "--protocol", "dns", "--last", "100")
        assert "gone.nxdomain.test. AAAA NXDOMAIN" in compact_lines
        ids = _map_ids(pin_dir)

        with topology.in_host():
            cluster.delete_pod("shop", "web")  # its series go after their grace
        wait_for(lambda: not any(labels == pod or set(pod) <= set(labels)
                                 for _, labels in _dns_samples(topology, port)), 20, "web's DNS series gone", log)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(20) == 0, log()
        run("rm", "-r", str(pin_dir))  # the uninstall (docs/install.md)
        deadline = time.monotonic() + 10  # maps are freed after the programs, after an RCU grace period
        while ids & {int(str(m["id"])) for m in json.loads(run("bpftool", "-j", "map", "show") or "[]")}:
            assert time.monotonic() < deadline, "the DNS maps outlived the uninstall"
            time.sleep(0.1)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        resolver.stop()
