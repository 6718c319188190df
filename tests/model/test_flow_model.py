"""Flows in the model: naming (pods, workloads, world, ICMP), the filters of ``podmeter observe``, the
bounded ring, the workload series (counting rule, cap, idle expiry, back to empty after churn), and the
attribution rule as a Hypothesis property (a flow is named by the pod that held the IP while its packets
were counted, across deletes and IP reuse between two drains), driven through the agent's writer task on
the in-memory datapath (the kernel's semantics).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_pod
from flow_support import FROM, TO, counts, flow_agent, key, sent_by
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.deltas import PODS, Delete, Upsert
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import (
    EndpointCache,
    FlowEnd,
    FlowFilter,
    FlowRecord,
    FlowRing,
    encode_json,
    name_flows,
    newest,
)
from podmeter.model.flow_series import OVERFLOW, DrainTotals, WorkloadFlows
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP, FlowCounts, FlowKey
from podmeter.model.records import Pod
from podmeter.model.retina_flows import WorkloadFlowsAndRetina
from podmeter.runtime.ticks import Tick

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def owned(pod: Pod, kind: str, name: str) -> Pod:
    return msgspec.structs.replace(pod, owner_kind=kind, owner_name=name)


# --- naming --------------------------------------------------------------------------------------------


def test_both_ends_are_named_with_their_workloads_and_unknown_addresses_are_world() -> None:
    web = owned(make_pod("web-5d9f7-x", "shop", ips=("10.0.0.1",), labels={"pod-template-hash": "5d9f7"}),
                "ReplicaSet", "web-5d9f7")
    db = owned(make_pod("db-0", "shop", ips=("10.0.0.2",)), "StatefulSet", "db")
    book = AddressBook([web, db])
    records = name_flows([(key("10.0.0.1", "10.0.0.2", 43210, 5432), counts(3, 180, flags=0b10010)),
                          (key("10.0.0.2", "8.8.8.8", 53000, 53, UDP), counts())], book, "node-a", 1000.0)
    by_dst = {r.destination.ip: r for r in records}
    tcp = by_dst["10.0.0.2"].to_json()
    assert tcp["source"] | {"identity": None} == {
        "ip": "10.0.0.1", "port": 43210, "service": None, "namespace": "shop", "pod": "web-5d9f7-x",
        "workload": "web", "workload_kind": "Deployment", "node": "node-a", "identity": None, "world": False}
    assert tcp["destination"]["workload"] == "db" and tcp["destination"]["workload_kind"] == "StatefulSet"
    assert (tcp["protocol"], tcp["packets"], tcp["bytes"], tcp["tcp_flags"]) == ("TCP", 3, 180, ["SYN", "ACK"])
    assert tcp["observation"] == "from-pod" and tcp["node"] == "node-a" and tcp["time"] == 1005.0
    world = by_dst["8.8.8.8"].to_json()["destination"]
    assert world["world"] is True and world["pod"] is None and world["namespace"] is None and world["port"] == 53

def test_icmp_carries_type_and_code_instead_of_ports() -> None:
    book = AddressBook([make_pod("a", ips=("10.0.0.1",))])
    (record,) = name_flows([(key("10.0.0.1", "10.0.0.9", 8, 0, ICMP), counts())], book, "n", 0.0)
    out = record.to_json()
    assert out["protocol"] == "ICMPv4" and out["icmp"] == {"type": 8, "code": 0}
    assert out["source"]["port"] is None and out["destination"]["port"] is None

def test_finished_and_host_network_pods_name_nothing() -> None:
    done = make_pod("done", ips=("10.0.0.1",), phase="Succeeded")
    host = make_pod("host", ips=("192.168.1.10",), host_network=True)
    book = AddressBook([done, host])
    assert book.endpoint("10.0.0.1") is None and book.endpoint("192.168.1.10") is None

def test_the_struct_encoding_is_the_contracts_json_byte_for_byte() -> None:
    """``encode_json`` (the NDJSON line of every reader) writes what ``to_json`` says, in its order."""
    web = owned(make_pod("web-5d9f7-x", "shop", ips=("10.0.0.1", "fd00::1"), labels={"pod-template-hash": "5d9f7"}),
                "ReplicaSet", "web-5d9f7")
    book = AddressBook([web, make_pod("db\u2028\x1b", "sh\"op", ips=("10.0.0.2",))])
    entries = [(key("10.0.0.1", "10.0.0.2", flags * 250, 65535 - flags, TCP if flags % 3 else UDP,
                    FROM if flags % 2 else TO), counts(flags, 60 * flags, flags, at=flags * 999_999_937))
               for flags in range(256)]
    entries += [(key("fd00::1", "2001:db8::9", 128, 0, ICMPV6), counts()), (key("8.8.8.8", "10.0.0.1", 3, 1, ICMP),
                                                                          counts()),
                (key("10.0.0.1", "192.0.2.1", 0, 0, 47), counts(at=0))]
    records = name_flows(entries, book, "node-\xe4", 1_790_000_000.0) + name_flows(entries[:9], book, "n", 0.0)
    identified = [msgspec.structs.replace(r.source, endpoint=msgspec.structs.replace(r.source.endpoint, identity=i))
                  if r.source.endpoint else r.source for i, r in enumerate(records[:40])]
    records += [msgspec.structs.replace(r, verdict="dropped", drop_reason=("NO_SOCKET", None)[i % 2], tcp_retransmits=i,
                                        source=identified[i]) for i, r in enumerate(records[:40])]
    for record in records:
        assert encode_json(record) == msgspec.json.encode(record.to_json()), record

def test_flow_end_equality_is_by_value() -> None:
    assert FlowEnd("10.0.0.1", 1) == FlowEnd("10.0.0.1", 1)


# --- attribution, as a property of the agent's writer task ---------------------------------------------


pools = st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"])

steps = st.lists(st.one_of(
    st.tuples(st.just("create"), pools),
    st.tuples(st.just("delete"), pools),
    st.tuples(st.just("send"), pools, st.integers(1, 9)),
    st.tuples(st.just("drain"), st.just("")),
    st.tuples(st.just("batch"), pools),  # delete the holder and create a new one in one batch
), max_size=40)

@settings(max_examples=150, deadline=None)
@given(steps)
def test_drained_flows_credit_each_pod_exactly_what_it_sent(plan: list[tuple[object, ...]]) -> None:
    """The property: attributed to the holder at count time, the drained aggregates equal what each pod
    really sent, whatever the interleaving of deletes, IP reuse, traffic and drains."""
    dp = MemoryDatapath()
    agent = flow_agent(dp)
    holder: dict[str, Pod] = {}
    truth: Counter[str] = Counter()
    serial = 0

    def create(ip: str) -> Upsert[Pod]:
        nonlocal serial
        serial += 1
        holder[ip] = make_pod(f"p{serial}", ips=(ip,), observe=True)
        return Upsert(PODS, holder[ip])

    for step in plan:
        kind, ip = str(step[0]), str(step[1])
        if kind == "create" and ip not in holder:
            agent.apply_batch([create(ip)])
        elif kind == "delete" and ip in holder:
            agent.apply_batch([Delete(PODS, holder.pop(ip).uid)])
        elif kind == "batch" and ip in holder:
            agent.apply_batch([Delete(PODS, holder.pop(ip).uid), create(ip)])
        elif kind == "send" and ip in holder:
            packets = int(step[2])  # type: ignore[call-overload]
            assert dp.record_flow(key(ip, "1.1.1.1"), packets, 100 * packets, time.monotonic_ns())
            truth[holder[ip].uid] += packets
        elif kind == "drain":
            agent.apply_batch([Tick.DRAIN])
    agent.apply_batch([Tick.DRAIN])
    assert sent_by(agent) == truth
    assert not dp.flows  # drained: the kernel side is back to empty


# --- filters and ring ----------------------------------------------------------------------------------


def _records() -> list[FlowRecord]:
    web = make_pod("web-1", "shop", ips=("10.0.0.1",))
    db = owned(make_pod("db-0", "shop", ips=("10.0.0.2",)), "StatefulSet", "db")
    job = make_pod("etl", "batch", ips=("10.0.1.1",))
    book = AddressBook([web, db, job])
    entries = [
        (key("10.0.0.1", "10.0.0.2", 40000, 5432, TCP, FROM), counts(at=1_000_000_000)),
        (key("10.0.0.1", "10.0.0.2", 40000, 5432, TCP, TO), counts(at=2_000_000_000)),
        (key("10.0.1.1", "8.8.8.8", 50000, 53, UDP), counts(at=3_000_000_000)),
        (key("10.0.1.1", "10.0.0.1", 8, 0, ICMP), counts(at=4_000_000_000)),
    ]
    return name_flows(entries, book, "node-a", 0.0)

@pytest.mark.parametrize(("wanted", "expected"), [
    (FlowFilter(), 4),
    (FlowFilter(namespace="batch"), 2),
    (FlowFilter(pod="shop/db-0"), 2),
    (FlowFilter(pod="db-0"), 2),
    (FlowFilter(pod="other/db-0"), 0),
    (FlowFilter(from_pod="web-1"), 2),
    (FlowFilter(to_pod="web-1"), 1),
    (FlowFilter(workload="shop/db"), 2),
    (FlowFilter(workload="world"), 1),
    (FlowFilter(protocol="udp"), 1),
    (FlowFilter(protocol="ICMP"), 1),
    (FlowFilter(protocol="icmpv6"), 0),
    (FlowFilter(port=5432), 2),
    (FlowFilter(port=8), 0),  # an ICMP type is not a port
    (FlowFilter(since=2.5), 2),
    (FlowFilter(namespace="shop", protocol="tcp", from_pod="web-1"), 2),
])
def test_each_filter_selects_what_it_says(wanted: FlowFilter, expected: int) -> None:
    assert sum(wanted.matches(r) for r in _records()) == expected

def test_the_ring_keeps_the_last_records_counts_what_fell_out_and_resumes_by_sequence() -> None:
    ring = FlowRing(3)
    records = _records()
    ring.extend(records)
    assert len(ring) == 3 and ring.dropped == 1 and ring.last_seq == 4
    assert [seq for seq, _ in ring.after(0)] == [2, 3, 4]
    assert [r for _, r in ring.after(3)] == [records[3]]
    assert ring.last(2) == records[2:]
    assert ring.last(5, FlowFilter(protocol="tcp")) == [records[1]]


# --- workload series -----------------------------------------------------------------------------------


def test_series_count_each_packet_once_per_node_cap_the_pairs_and_expire() -> None:
    flows = WorkloadFlows("node-a", limit=2, idle=60.0)
    records = _records()
    flows.add(records, now=100.0)
    pairs = {pair.destination_workload: t.packets for pair, t in flows.values()}
    # web -> db seen leaving web and entering db: once; etl -> world; etl -> web folded (limit 2)
    assert pairs == {"db": 1, "world": 1, OVERFLOW.destination_workload: 1}
    assert flows.folded == 1
    assert flows.expire(now=159.0) == 0 and flows.expire(now=161.0) == 3
    assert not flows.pairs

def test_a_to_pod_record_from_another_node_counts() -> None:
    flows = WorkloadFlows("node-b", limit=10, idle=60.0)
    web = _records()[1]  # to-pod at db; web's endpoint says node-a: traffic from another node
    assert web.observation is TO
    flows.add([web], now=1.0)
    assert sum(t.packets for _, t in flows.values()) == 1


def test_unnamed_same_node_packets_count_once_and_world_sources_still_count() -> None:
    """A drain whose ends cannot be named (a predecessor's entries: every end world) holds both records of
    each packet between two pods of this node; the pair series count the packet once, at the from-pod
    point, and a to-pod record without a from-pod twin (traffic from outside) still counts."""
    entries = [(key("10.0.0.1", "10.0.0.2", 4000, 80, obs=FROM), counts(3, 300)),
               (key("10.0.0.1", "10.0.0.2", 4000, 80, obs=TO), counts(3, 300)),
               (key("8.8.8.8", "10.0.0.2", 53, 5353, obs=TO), counts(2, 200))]
    records = name_flows(entries, AddressBook(()), "node-a", 0.0)
    assert all(r.source.endpoint is None and r.destination.endpoint is None for r in records)
    flows = WorkloadFlows("node-a", limit=10, idle=60.0)
    flows.add(records, now=1.0)
    assert sum(t.packets for _, t in flows.values()) == 3 + 2
    totals = WorkloadFlows("node-a", limit=10, idle=60.0)  # the agent's path: the entries, added up
    totals.add_totals(DrainTotals(entries), EndpointCache(AddressBook(())), now=1.0)
    assert sum(t.packets for _, t in totals.values()) == 3 + 2


# --- a drain's totals against its records ----------------------------------------------------------------


ADDRESSES = ["10.0.0.1", "10.0.0.2", "10.0.1.1", "10.9.0.9", "8.8.8.8", "fd00::1"]  # the last three: no pod here
_entries = st.lists(st.tuples(
    st.sampled_from(ADDRESSES), st.sampled_from(ADDRESSES), st.integers(0, 3), st.integers(0, 2),
    st.sampled_from([TCP, UDP, ICMP]), st.sampled_from([FROM, TO]), st.integers(1, 9), st.integers(0, 6),
), max_size=60)


def _drain(rows: list[tuple[str, str, int, int, int, object, int, int]]) -> list[tuple[FlowKey, FlowCounts]]:
    """One drain's entries: one per key (the kernel's), the later duplicates dropped."""
    out: dict[FlowKey, FlowCounts] = {}
    for source, destination, sport, dport, protocol, observation, packets, at in rows:
        flow = key(source, destination, sport, dport, protocol, observation)  # type: ignore[arg-type]
        out.setdefault(flow, counts(packets, 100 * packets, at=at * 1_000_000))
    return list(out.items())


def _book(named: bool) -> AddressBook:
    far = make_pod("far", "batch", ips=("10.0.1.1",), node="node-b")  # a pod of another node
    web = owned(make_pod("web-1", "shop", ips=("10.0.0.1",)), "StatefulSet", "web")
    return AddressBook([web, make_pod("db-0", "shop", ips=("10.0.0.2",)), far] if named else [])


@settings(max_examples=300, deadline=None)
@given(_entries, st.booleans())
def test_a_drains_totals_add_up_to_the_series_of_its_records(rows: list[Any], named: bool) -> None:
    """``add_totals`` (the agent's path: entries added up per pair of addresses, no records made) gives
    every series ``add`` gives from the drain's records, to-pod twins of unnamed sources included."""
    entries, book = _drain(rows), _book(named)
    from_records, from_totals = WorkloadFlowsAndRetina("node-a", 100, 60.0), WorkloadFlowsAndRetina("node-a", 100, 60.0)
    from_records.add(name_flows(entries, book, "node-a", 0.0), 1.0)
    from_totals.add_totals(DrainTotals(entries), EndpointCache(book), 1.0)
    assert {p: (t.packets, t.bytes) for p, t in from_totals.values()} == {
        p: (t.packets, t.bytes) for p, t in from_records.values()}
    assert {k: (t.packets, t.bytes) for k, t in from_totals.retina.values()} == {
        k: (t.packets, t.bytes) for k, t in from_records.retina.values()}


@settings(max_examples=200, deadline=None)
@given(_entries, st.integers(1, 4))
def test_past_the_series_limit_totals_fold_every_record_they_would_have(rows: list[Any], limit: int) -> None:
    entries, book = _drain(rows), _book(True)
    flows = WorkloadFlows("node-a", limit, 60.0)
    flows.add_totals(DrainTotals(entries), EndpointCache(book), 1.0)
    reference = WorkloadFlows("node-a", 1000, 60.0)
    reference.add(name_flows(entries, book, "node-a", 0.0), 1.0)
    assert len(flows.pairs) <= limit + 1
    assert sum(t.packets for t in flows.pairs.values()) == sum(t.packets for t in reference.pairs.values())
    assert (flows.folded > 0) == (len(reference.pairs) > limit)


@settings(max_examples=300, deadline=None)
@given(_entries, st.integers(0, 70))
def test_newest_keeps_the_tail_of_the_stable_time_order(rows: list[Any], count: int) -> None:
    entries = _drain(rows)
    kept = newest(entries, count)
    if len(entries) <= count:
        assert kept == entries
    else:
        assert kept == sorted(entries, key=lambda e: e[1].last_ns)[len(entries) - count:]


def test_records_passed_over_are_numbered_and_counted_as_fallen_out() -> None:
    ring = FlowRing(3)
    records = _records()
    ring.extend(records[:2])
    ring.extend(records[1:4], passed=5)  # a drain of 8: its 5 oldest never made
    assert (ring.last_seq, len(ring), ring.first_seq, ring.dropped) == (10, 3, 8, 7)
    assert [r for _, r in ring.after(0)] == records[1:4]
    with pytest.raises(ValueError, match="a ring's worth"):
        ring.extend(records[:2], passed=1)
