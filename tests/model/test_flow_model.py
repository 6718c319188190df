"""Flows in the model: naming (pods, workloads, world, ICMP), the filters of ``podmeter observe``, the
bounded ring, the workload series (counting rule, cap, idle expiry, back to empty after churn), and the
attribution rule as a Hypothesis property (a flow is named by the pod that held the IP while its packets
were counted, across deletes and IP reuse between two drains), driven through the agent's writer task on
the in-memory datapath (the kernel's semantics).
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_pod
from flow_support import FROM, TO, counts, flow_agent, key, sent_by
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.deltas import PODS, Delete, Upsert
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowEnd, FlowFilter, FlowRecord, FlowRing, name_flows
from podmeter.model.flow_series import OVERFLOW, WorkloadFlows
from podmeter.model.flows import ICMP, TCP, UDP
from podmeter.model.records import Pod
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
        "ip": "10.0.0.1", "port": 43210, "namespace": "shop", "pod": "web-5d9f7-x", "workload": "web",
        "workload_kind": "Deployment", "node": "node-a", "identity": None, "world": False}
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
