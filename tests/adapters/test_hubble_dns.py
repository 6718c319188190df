"""DNS records through the Hubble API as L7 DNS flows, over real gRPC with the project's own client.

The server reads the agent's two feeds (flows, and the DNS drain's records); the tests publish into both
and read as `hubble observe` does: the L7 fields of a query and an answer (a 253-character name, IPv6),
the hand-written bytes, the filters `--protocol dns`, `--type l7`, `--verdict`, pods and namespaces and
replies, the past of both feeds merged by time, follow interleaving them, lost events counted per feed,
and a read refused by either feed's bounds giving back its slot in the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from hubble_support import serving
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.flows import FlowMessages, pod_labels
from podmeter.adapters.hubble.proto import flow_pb2, observer_pb2
from podmeter.model.flows import TCP
from record_support import BASE, CART, DNS_PODS, dns_entry, dns_records, records

AAAA, TXT, NXDOMAIN = 28, 16, 3


@pytest.fixture
async def hubble() -> AsyncIterator[tuple[FlowFeed, FlowFeed, Any]]:
    flows, dns_feed = FlowFeed(100), FlowFeed(50)
    async with serving(flows, dns_feed=dns_feed, labels=lambda e: pod_labels(DNS_PODS, e)) as (_, client):
        yield flows, dns_feed, client


def ask_and_answer(at: float = BASE + 0.5) -> list[Any]:
    """web asks for cart (A) twice, answered NOERROR in 2 and 4 ms; cache asks gone. (AAAA) over IPv6: NXDOMAIN."""
    return dns_records([dns_entry("10.0.0.1", count=2), dns_entry("10.0.0.1", rcode=0, count=2, latency_ns=3_000_000),
                        dns_entry("fd00::3", "gone.nxdomain.test.", AAAA, server="fd00::53"),
                        dns_entry("fd00::3", "gone.nxdomain.test.", AAAA, NXDOMAIN, server="fd00::53",
                                  latency_ns=1_500_000)], at)


def flow_filter(**fields: Any) -> flow_pb2.FlowFilter:
    return flow_pb2.FlowFilter(**fields)


def summaries(responses: list[observer_pb2.GetFlowsResponse]) -> list[str]:
    return [r.flow.Summary for r in responses]


# --- the encoding -------------------------------------------------------------------------------------------


async def test_a_query_is_an_l7_dns_request_flow_from_the_pod_to_the_server(hubble: Any) -> None:
    _, dns_feed, client = hubble
    dns_feed.publish(ask_and_answer()[:1])
    (response,) = await client.flows(number=1)
    flow = response.flow
    assert (flow.Type, flow.verdict, flow.event_type.type, flow.event_type.sub_type) == (
        flow_pb2.L7, flow_pb2.FORWARDED, 129, 0)
    assert flow.l7.type == flow_pb2.REQUEST and flow.l7.latency_ns == 0
    assert (flow.l7.dns.query, list(flow.l7.dns.qtypes), flow.l7.dns.rcode, flow.l7.dns.observation_source) == (
        CART, ["A"], 0, "podmeter")
    assert list(flow.l7.dns.ips) == [] and list(flow.l7.dns.rrtypes) == []  # the answer section is not read
    assert flow.Summary == "DNS Query cart.shop.svc.cluster.local. A"
    assert flow.HasField("is_reply") and not flow.is_reply.value
    assert (flow.traffic_direction, flow.trace_observation_point) == (flow_pb2.EGRESS, flow_pb2.UNKNOWN_POINT)
    assert (flow.IP.source, flow.IP.destination, flow.IP.ipVersion) == ("10.0.0.1", "10.0.0.53", flow_pb2.IPv4)
    assert flow.l4.WhichOneof("protocol") == "UDP" and flow.l4.UDP.destination_port == 53
    assert (flow.source.namespace, flow.source.pod_name) == ("shop", "web-5d9f7-x2x7p")
    assert (flow.destination.namespace, flow.destination.pod_name) == ("kube-system", "coredns-7db6d-k2x9f")
    assert "k8s:k8s-app=kube-dns" in flow.destination.labels
    assert [(w.kind, w.name) for w in flow.destination.workloads] == [("ReplicaSet", "coredns-7db6d")]
    assert flow.time.seconds == int(BASE) and flow.node_name == "node-a"


async def test_an_answer_is_an_l7_dns_response_flow_with_its_rcode_and_mean_latency(hubble: Any) -> None:
    _, dns_feed, client = hubble
    dns_feed.publish(ask_and_answer())
    answers = [r.flow for r in await client.flows(number=10) if r.flow.l7.type == flow_pb2.RESPONSE]
    cart, gone = answers
    assert (cart.l7.dns.query, cart.l7.dns.rcode, cart.l7.latency_ns) == (CART, 0, 3_000_000)
    assert cart.Summary == "DNS Answer RCode: NOERROR (Query cart.shop.svc.cluster.local. A)"
    assert cart.is_reply.value and cart.traffic_direction == flow_pb2.INGRESS
    assert (cart.source.pod_name, cart.destination.pod_name) == ("coredns-7db6d-k2x9f", "web-5d9f7-x2x7p")
    assert cart.l4.UDP.source_port == 53
    assert (gone.l7.dns.query, list(gone.l7.dns.qtypes), gone.l7.dns.rcode, gone.l7.latency_ns) == (
        "gone.nxdomain.test.", ["AAAA"], NXDOMAIN, 1_500_000)
    assert gone.Summary == "DNS Answer RCode: NXDOMAIN (Query gone.nxdomain.test. AAAA)"
    assert (gone.IP.source, gone.IP.destination, gone.IP.ipVersion) == ("fd00::53", "fd00::3", flow_pb2.IPv6)
    assert (gone.destination.namespace, gone.destination.pod_name) == ("default", "cache")


async def test_a_253_character_name_and_dns_over_tcp_are_sent_whole(hubble: Any) -> None:
    _, dns_feed, client = hubble
    long_name = ".".join(["x" * 63] * 3 + ["y" * 61]) + "."  # 253 characters, and the final dot
    assert len(long_name) == 254
    dns_feed.publish(dns_records([dns_entry("10.0.0.1", long_name, TXT, NXDOMAIN, protocol=TCP)]))
    (response,) = await client.flows(number=1)
    assert response.flow.l7.dns.query == long_name and response.flow.l4.WhichOneof("protocol") == "TCP"
    assert response.flow.Summary == f"DNS Answer RCode: NXDOMAIN (Query {long_name} TXT)"


def test_the_hand_written_bytes_are_the_messages_bytes_for_dns_records() -> None:
    """What the server sends (``serialized``, ``encoded``) is the serialization of ``response``'s message."""
    messages = FlowMessages(lambda e: pod_labels(DNS_PODS, e))
    shapes = [*ask_and_answer(), *ask_and_answer(0.0), *dns_records([
        dns_entry("10.0.0.9", "unknown.pod.", 65535, 15, server="192.0.2.1", count=2**40, latency_ns=10**10),
        dns_entry("10.0.0.1", ".", 255, protocol=TCP)])]
    for record in shapes:
        expected = messages.response(record).SerializeToString()
        assert messages.serialized(record) == expected == messages.encoded(record), record
        assert messages.response(record).flow.Type == flow_pb2.L7


# --- filters ------------------------------------------------------------------------------------------------


async def test_protocol_dns_selects_the_dns_records_and_udp_the_dns_over_udp_too(hubble: Any) -> None:
    flows, dns_feed, client = hubble
    flows.publish(records(5))  # one UDP flow among them (web -> 8.8.8.8:53, not read as DNS: a flow)
    dns_feed.publish(ask_and_answer(BASE + 10) + dns_records([dns_entry("10.0.0.1", protocol=TCP)], BASE + 11))
    dns_flows = await client.flows(number=100, whitelist=[flow_filter(protocol=["dns"])])
    assert len(dns_flows) == 5 and all(r.flow.Type == flow_pb2.L7 for r in dns_flows)
    udp = await client.flows(number=100, whitelist=[flow_filter(protocol=["UDP"])])
    assert [r.flow.Type for r in udp] == [flow_pb2.L3_L4] + [flow_pb2.L7] * 4
    assert len(await client.flows(number=100, whitelist=[flow_filter(protocol=["tcp"])])) == 3  # 2 flows, 1 DNS
    assert len(await client.flows(number=100, whitelist=[flow_filter(protocol=["http"])])) == 0
    no_dns = await client.flows(number=100, blacklist=[flow_filter(protocol=["dns"])])
    assert len(no_dns) == 5 and all(r.flow.Type == flow_pb2.L3_L4 for r in no_dns)


async def test_type_l7_verdict_pods_namespaces_and_replies_filter_dns_records(hubble: Any) -> None:
    flows, dns_feed, client = hubble
    flows.publish(records(5))
    dns_feed.publish(ask_and_answer(BASE + 10))
    l7 = flow_filter(event_type=[flow_pb2.EventTypeFilter(type=129)])  # hubble observe --type l7
    assert len(await client.flows(number=100, whitelist=[l7])) == 4
    trace = flow_filter(event_type=[flow_pb2.EventTypeFilter(type=4)])  # --type trace: no DNS
    assert all(r.flow.Type == flow_pb2.L3_L4 for r in await client.flows(number=100, whitelist=[trace]))
    forwarded = await client.flows(number=100, whitelist=[flow_filter(verdict=[flow_pb2.FORWARDED], protocol=["dns"])])
    assert len(forwarded) == 4
    assert await client.flows(number=100, whitelist=[flow_filter(verdict=[flow_pb2.DROPPED], protocol=["dns"])]) == []
    web = await client.flows(number=100, whitelist=[flow_filter(source_pod=["shop/web"], protocol=["dns"]),
                                                    flow_filter(destination_pod=["shop/web"], protocol=["dns"])])
    assert summaries(web) == ["DNS Query cart.shop.svc.cluster.local. A",
                              "DNS Answer RCode: NOERROR (Query cart.shop.svc.cluster.local. A)"]
    default = await client.flows(number=100, whitelist=[flow_filter(source_pod=["default/"], event_type=[
        flow_pb2.EventTypeFilter(type=129)])])
    assert summaries(default) == ["DNS Query gone.nxdomain.test. AAAA"]
    to_kube_system = await client.flows(number=100, whitelist=[flow_filter(destination_pod=["kube-system/"])])
    assert len(to_kube_system) == 2 and all(r.flow.l7.type == flow_pb2.REQUEST for r in to_kube_system)
    replies = await client.flows(number=100, whitelist=[flow_filter(reply=[True])])
    assert [r.flow.l7.dns.rcode for r in replies] == [0, NXDOMAIN]  # flows have no is_reply: neither value
    assert len(await client.flows(number=100, whitelist=[flow_filter(reply=[False])])) == 2


# --- serving both feeds -------------------------------------------------------------------------------------


async def test_the_past_of_both_feeds_is_merged_by_time(hubble: Any) -> None:
    flows, dns_feed, client = hubble
    flows.publish(records(4))  # BASE + 0 .. 3
    dns_feed.publish(ask_and_answer(BASE + 1.5))
    dns_feed.publish(dns_records([dns_entry("10.0.0.1")], BASE + 3.5))
    got = await client.flows(number=100)
    times = [r.flow.time.seconds + r.flow.time.nanos / 1e9 - BASE for r in got]
    assert times == [0, 1, 1.5, 1.5, 1.5, 1.5, 2, 3, 3.5]
    last = await client.flows(number=3)
    assert [r.flow.Type for r in last] == [flow_pb2.L3_L4, flow_pb2.L3_L4, flow_pb2.L7]
    first = await client.flows(number=3, first=True)
    assert [r.flow.Type for r in first] == [flow_pb2.L3_L4, flow_pb2.L3_L4, flow_pb2.L7]
    status = await client.observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=10)
    assert (status.num_flows, status.max_flows, status.seen_flows) == (9, 150, 9)
    namespaces = await client.observer.GetNamespaces(observer_pb2.GetNamespacesRequest(), timeout=10)
    assert [n.namespace for n in namespaces.namespaces] == ["default", "kube-system", "shop"]


async def wait_until(condition: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_follow_interleaves_both_feeds_and_counts_lost_records_per_feed(hubble: Any) -> None:
    flows, dns_feed, client = hubble
    tasks = len(asyncio.all_tasks())
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
    await wait_until(lambda: flows.followers == 1 and dns_feed.followers == 1)
    flows.publish(records(1))
    first = await asyncio.wait_for(call.read(), 10)
    dns_feed.publish(ask_and_answer()[:1])
    second = await asyncio.wait_for(call.read(), 10)
    flows.publish(records(1, start=1))
    third = await asyncio.wait_for(call.read(), 10)
    assert [first.flow.Type, second.flow.Type, third.flow.Type] == [flow_pb2.L3_L4, flow_pb2.L7, flow_pb2.L3_L4]
    call.cancel()
    await wait_until(lambda: flows.streams == 0 and dns_feed.streams == 0)
    await wait_until(lambda: len(asyncio.all_tasks()) <= tasks)  # the waits on both feeds ended with the call

    # a follower that does not read while the DNS ring (50) laps it is told what it lost, in the DNS feed only
    slow = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True, whitelist=[
        flow_filter(protocol=["dns"])]))
    await wait_until(lambda: dns_feed.followers == 1)
    burst = dns_records([dns_entry("10.0.0.1", f"n{i}.test.") for i in range(200)])
    dns_feed.publish(burst)
    got = [await asyncio.wait_for(slow.read(), 10) for _ in range(51)]
    lost = [r.lost_events.num_events_lost for r in got if r.HasField("lost_events")]
    sent = [r.flow.l7.dns.query for r in got if r.HasField("flow")]
    assert lost == [150] and dns_feed.lost == 150 and flows.lost == 0
    assert sent == [f"n{i}.test." for i in range(150, 200)]
    slow.cancel()
    await wait_until(lambda: flows.streams == 0 and dns_feed.streams == 0)


async def test_a_read_refused_by_the_dns_feed_gives_back_its_flow_feed_slot() -> None:
    flows, dns_feed = FlowFeed(10), FlowFeed(10, max_followers=1)
    async with serving(flows, dns_feed=dns_feed) as (_, client):
        first = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
        await wait_until(lambda: dns_feed.followers == 1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.flows(follow=True)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (flows.streams, dns_feed.streams, dns_feed.refused) == (1, 1, 1)  # the first read's only
        first.cancel()
        await wait_until(lambda: flows.streams == 0 and dns_feed.streams == 0)


async def test_without_a_dns_feed_the_server_serves_the_flows_alone() -> None:
    flows = FlowFeed(10)
    flows.publish(records(3))
    async with serving(flows) as (_, client):
        got = await client.flows(number=10, whitelist=[flow_filter(protocol=["dns", "udp"])])
        assert [r.flow.Type for r in got] == [flow_pb2.L3_L4] and got[0].flow.l4.UDP.destination_port == 53
        status = await client.observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=10)
        assert status.max_flows == 10

