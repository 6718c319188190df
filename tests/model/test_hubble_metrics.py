"""Hubble's metrics from podmeter's records: names, labels, counts, the cap and the pods' lifecycle."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from podmeter.model.flow_records import VERDICT_DROPPED, FlowEnd, FlowRecord
from podmeter.model.flows import TCP, UDP
from podmeter.model.hubble_metrics import (
    DNS_QUERIES,
    DNS_RESPONSES,
    DNS_TYPES,
    DROPS,
    FLOWS,
    ICMPS,
    OTHER,
    PORTS,
    TCP_FLAGS,
    TO_WORLD,
    HubbleMetrics,
    dns_events,
    icmp_type,
    replies,
)
from podmeter.model.hubble_metrics_config import parse
from record_support import ACK, FIN, FROM, SYN, TO, WEB, asked_records, records

EVERYTHING = ("flow:sourceContext=pod|reserved-identity;destinationContext=pod|reserved-identity "
              "drop:sourceContext=namespace tcp:labelsContext=source_workload,destination_workload,traffic_direction "
              "port-distribution icmp flows-to-world dns")


def metrics(value: str = EVERYTHING, limit: int = 10_000, idle: float = 300.0, grace: float = 30.0) -> HubbleMetrics:
    return HubbleMetrics(parse(value), limit, idle, grace, lambda e: WEB.labels if e.uid == WEB.uid else ())


def by_family(m: HubbleMetrics) -> dict[str, dict[tuple[str, ...], int]]:
    out: dict[str, dict[tuple[str, ...], int]] = {f.name: {} for f in m.families}
    for (family, values), value in m.values():
        out[family][values] = value
    return out


def test_flows_count_packets_with_hubbles_labels_and_contexts() -> None:
    m = metrics()
    batch = records(5)
    m.add(batch, 1.0)
    flows = by_family(m)[FLOWS]
    assert sum(flows.values()) == sum(r.packets for r in batch)
    web_to_db = ("TCP", "Trace", "from-endpoint", "FORWARDED", "shop/web-5d9f7-x2x7p", "shop/db-0")
    assert flows[web_to_db] == batch[0].packets
    assert flows[("UDP", "Trace", "from-endpoint", "FORWARDED", "shop/web-5d9f7-x2x7p", "reserved:world")] == 2
    assert flows[("ICMPv4", "Trace", "to-endpoint", "FORWARDED", "reserved:world", "shop/web-5d9f7-x2x7p")] == 3
    icmp = by_family(m)[ICMPS]
    assert icmp == {("IPv4", "EchoRequest"): 3, ("IPv6", "EchoRequest"): 2}


def test_drops_carry_ciliums_code_where_one_has_the_kernels_meaning() -> None:
    m = metrics()
    dropped = [msgspec.structs.replace(r, verdict=VERDICT_DROPPED, drop_reason=reason)
               for r, reason in zip(records(2), ("NETFILTER_DROP", "NOT_SPECIFIED"), strict=True)]
    m.add(dropped, 1.0)
    families = by_family(m)
    assert families[DROPS] == {("shop", "POLICY_DENIED", "TCP"): dropped[0].packets,
                               ("shop", "NOT_SPECIFIED", "UDP"): 2}
    assert families[FLOWS][("TCP", "Drop", "", "DROPPED", "shop/web-5d9f7-x2x7p", "shop/db-0")] == dropped[0].packets
    assert families[TO_WORLD] == {}  # a drop that is not a policy's does not count (no any-drop)
    assert families[TCP_FLAGS] == {}  # Hubble's TCP flags are of forwarded packets only


def record(source: tuple[str, int], destination: tuple[str, int], flags: int, first: float,
           protocol: int = TCP, packets: int = 1) -> FlowRecord:
    base = records(1)[0]
    return msgspec.structs.replace(base, source=FlowEnd(*source), destination=FlowEnd(*destination),
                                   protocol=protocol, tcp_flags=flags, first=first, time=first, packets=packets)


def test_syn_and_syn_ack_are_told_apart_by_the_partner_then_by_the_ports() -> None:
    client, server = ("10.0.0.1", 40000), ("10.0.0.2", 5432)
    handshake = [record(server, client, SYN | ACK, 2.0), record(client, server, SYN | ACK | FIN, 1.0)]
    assert replies(handshake) == [True, False]
    alone = [record(server, client, SYN | ACK, 2.0)]  # its SYN was in the drain before
    assert replies(alone) == [True]
    assert replies([record(client, server, SYN, 5.0)]) == [False]  # SYN without ACK: never a reply
    m = metrics("tcp")
    m.add(handshake, 1.0)
    assert by_family(m)[TCP_FLAGS] == {("SYN-ACK", "IPv4"): 1, ("SYN", "IPv4"): 1, ("FIN", "IPv4"): 1}


def test_the_port_distribution_and_flows_to_world_leave_replies_out() -> None:
    out = record(("10.0.0.1", 40000), ("8.8.8.8", 53), 0, 1.0, UDP, packets=4)
    back = record(("8.8.8.8", 53), ("10.0.0.1", 40000), 0, 1.5, UDP, packets=4)
    m = metrics("port-distribution flows-to-world:port")
    m.add([out, back], 1.0)
    families = by_family(m)
    assert families[PORTS] == {("UDP", "53"): 4}
    assert families[TO_WORLD] == {("UDP", "FORWARDED", "53"): 4}


def test_labels_context_names_each_end_and_the_direction() -> None:
    m = metrics("tcp:labelsContext=source_workload,destination_workload,traffic_direction,source_app")
    m.add(records(1), 1.0)
    assert by_family(m)[TCP_FLAGS] == {("SYN", "IPv4", "web", "web", "db", "egress"): 1}


def test_icmp_types_are_named_as_hubble_names_them() -> None:
    assert icmp_type(1, 3, 3) == "DestinationUnreachable(Port)"
    assert icmp_type(1, 0, 0) == "EchoReply"
    assert icmp_type(58, 129, 0) == "EchoReply"
    assert icmp_type(1, 42, 7) == "42(7)"


def test_past_the_limit_new_series_fold_into_their_familys_overflow_series() -> None:
    m = metrics("flow:sourceContext=ip;destinationContext=ip", limit=2)
    batch = records(5)
    m.add(batch, 1.0)
    flows = by_family(m)[FLOWS]
    assert len(flows) == 3 and sum(flows.values()) == sum(r.packets for r in batch)
    assert flows[(OTHER,) * 6] == sum(r.packets for r in batch[2:])
    assert m.folded == 3


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 60))
def test_a_capped_table_keeps_every_count_of_an_uncapped_one(limit: int, drains: int, start: int) -> None:
    """Incremental with a cap == the recompute without one: the same series below the cap, the others
    summed per family in the overflow series."""
    capped, whole = metrics(limit=limit), metrics()
    for i in range(drains):
        batch = records(7, start + 7 * i)
        capped.add(batch, float(i))
        whole.add(batch, float(i))
    kept, everything = by_family(capped), by_family(whole)
    for family, series in everything.items():
        ours = kept[family]
        assert sum(ours.values()) == sum(series.values())
        assert all(series[values] == value for values, value in ours.items() if OTHER not in values)
    assert len(capped.series) <= limit + len(capped.families)


def test_a_series_that_names_a_pod_leaves_with_it_after_the_grace() -> None:
    m = metrics("flow:sourceContext=pod;destinationContext=workload-name", grace=30.0)
    m.add(records(2), 0.0)
    web, db = ("shop", "web-5d9f7-x2x7p"), ("shop", "db-0")
    assert m.expire(10.0, lambda: {web, db}) == 0
    assert m.expire(20.0, lambda: {db}) == 0  # web is gone: its series end now ...
    assert m.expire(40.0, lambda: {web, db}) == 0  # ... and it came back within the grace: they stay
    m.expire(45.0, lambda: {db})
    assert m.expire(74.0, lambda: {db}) == 0
    assert m.expire(75.0, lambda: {db}) == 2
    assert m.series == {}


def test_contexts_that_name_no_pod_outlive_the_pods_until_idle() -> None:
    m = metrics("flow:sourceContext=workload-name;destinationContext=namespace", idle=300.0)
    m.add(records(2), 0.0)
    assert not m.names_pods
    assert m.expire(100.0, set) == 0
    assert m.expire(300.0, set) == 2


RETINA_FLOW = "flow:sourceEgressContext=pod;destinationIngressContext=pod"  # Retina's Hubble chart's


def test_per_direction_contexts_name_the_source_of_egress_and_the_destination_of_ingress() -> None:
    m = metrics(RETINA_FLOW)
    batch = records(5)
    m.add(batch, 1.0)
    flows = by_family(m)[FLOWS]
    web = "shop/web-5d9f7-x2x7p"
    assert flows[("TCP", "Trace", "from-endpoint", "FORWARDED", web, "")] == batch[0].packets  # web -> db, egress
    assert flows[("TCP", "Trace", "to-endpoint", "FORWARDED", "", web)] == batch[3].packets  # db -> web, ingress
    assert flows[("ICMPv4", "Trace", "to-endpoint", "FORWARDED", "", web)] == batch[2].packets  # world -> web
    assert sum(flows.values()) == sum(r.packets for r in batch)


def test_a_per_direction_series_leaves_with_the_pod_it_names_only() -> None:
    m = metrics(RETINA_FLOW, grace=30.0)
    m.add(records(1), 0.0)  # web -> db, egress: names web, not db
    web, db = ("shop", "web-5d9f7-x2x7p"), ("shop", "db-0")
    assert [s.pods for s in m.series.values()] == [(web,)]
    m.expire(10.0, lambda: {web})
    assert m.expire(50.0, lambda: {web}) == 0  # db is gone: the series that does not name it stays
    m.expire(60.0, lambda: {db})
    assert m.expire(90.0, lambda: {db}) == 1


@dataclass(frozen=True)
class Dns:
    source: FlowEnd
    destination: FlowEnd
    response: bool
    query: str
    qtypes: tuple[str, ...]
    rcode: int = 0
    ips: tuple[str, ...] | None = ()
    rrtypes: tuple[str, ...] | None = ()
    dropped: bool = False
    count: int = 1

    @property
    def direction(self) -> str:
        return "ingress" if self.response else "egress"


def test_dns_families_exist_with_their_labels_and_count_what_they_are_given() -> None:
    m = metrics("dns:query;sourceContext=namespace")
    assert [f.name for f in m.families] == [DNS_QUERIES, DNS_RESPONSES, DNS_TYPES]
    assert m.families[0].labels == ("source", "rcode", "qtypes", "ips_returned", "query")
    web = records(1)[0].source
    dns = FlowEnd("10.96.0.10", 53)
    m.add_dns([Dns(web, dns, False, "db.shop.", ("A",)),
               Dns(dns, web, True, "db.shop.", ("A",), 0, ("10.0.0.2",), ("A",)),
               Dns(dns, web, True, "nope.", ("AAAA",), 3)], 1.0)
    families = by_family(m)
    assert families[DNS_QUERIES] == {("shop", "", "A", "0", "db.shop."): 1}
    assert families[DNS_RESPONSES] == {("", "No Error", "A", "1", "db.shop."): 1,
                                       ("", "Non-Existent Domain", "AAAA", "0", "nope."): 1}
    assert families[DNS_TYPES] == {("", "A", "A", "db.shop."): 1}


def test_points_of_observation_each_count_as_in_hubble() -> None:
    m = metrics("flow")
    batch = records(5)
    m.add(batch, 1.0)
    counted: Counter[str] = Counter()
    for (_, values), value in m.values():
        counted[values[2]] += value
    assert counted["from-endpoint"] == sum(r.packets for r in batch if r.observation is FROM)
    assert counted["to-endpoint"] == sum(r.packets for r in batch if r.observation is TO)


RETINA_DNS = "dns:query;sourceEgressContext=pod;destinationIngressContext=pod"  # Retina's Hubble chart's


def test_the_dns_drains_records_count_as_cilium_counts_its_proxys_messages() -> None:
    m = metrics(RETINA_DNS)
    web, db = "10.0.0.1", "10.0.0.2"
    m.add_dns(dns_events(asked_records([(web, "cart.shop.", 1, None, 3), (web, "cart.shop.", 1, 0, 3),
                                      (web, "gone.test.", 28, None, 2), (web, "gone.test.", 28, 3, 2),
                                      (db, "x.example.", 1, None, 1), (db, "x.example.", 1, 5, 1)])), 1.0)
    families = by_family(m)
    pod_web, pod_db = "shop/web-5d9f7-x2x7p", "shop/db-0"
    # a query is egress: its source is the pod (sourceEgressContext); no destination context for egress
    assert families[DNS_QUERIES] == {(pod_web, "", "", "A", "0", "cart.shop."): 3,
                                     (pod_web, "", "", "AAAA", "0", "gone.test."): 2,
                                     (pod_db, "", "", "A", "0", "x.example."): 1}
    # a response is ingress: its destination is the pod; its answer was not read, so ips_returned is empty
    assert families[DNS_RESPONSES] == {("", pod_web, "No Error", "A", "", "cart.shop."): 3,
                                       ("", pod_web, "Non-Existent Domain", "AAAA", "", "gone.test."): 2,
                                       ("", pod_db, "Query Refused", "A", "", "x.example."): 1}
    assert families[DNS_TYPES] == {}  # no answer records read, no response types


def test_dns_series_leave_with_the_pod_they_name_and_ignore_aaaa_drops_aaaa_only_questions() -> None:
    m = metrics(RETINA_DNS + ";ignoreAAAA", grace=30.0)
    m.add_dns(dns_events(asked_records([("10.0.0.1", "a.", 1, None, 1), ("10.0.0.1", "a.", 28, 0, 1)])), 0.0)
    assert [values for (_, values), _ in m.values()] == [("shop/web-5d9f7-x2x7p", "", "", "A", "0", "a.")]
    m.expire(1.0, set)
    assert m.expire(31.0, set) == 1 and m.series == {}


def test_dns_events_are_the_dns_records_only_with_the_direction_of_their_message() -> None:
    events = dns_events([*records(3), *asked_records([("10.0.0.1", "a.", 1, None, 4), ("10.0.0.1", "a.", 1, 2, 4)])])
    assert [(e.direction, e.response, e.count, e.qtypes, e.rcode, e.ips) for e in events] == [
        ("egress", False, 4, ("A",), 0, None), ("ingress", True, 4, ("A",), 2, None)]
    assert events[0].source.ip == events[1].destination.ip == "10.0.0.1"
