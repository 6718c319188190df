"""The agent's Hubble API (``observer.Observer``, ``grpc.health.v1.Health``) over real gRPC, fed with flow records.

A client built from the project's own definitions (the generated stubs) calls the server the agent runs
(``adapters.hubble.server.HubbleServer`` on a ``adapters.flow_serving.FlowFeed`` the test publishes into), as
`hubble observe`, `hubble status` and Hubble Relay call it: ``number=N`` returns the last N in order and
ends, ``follow`` streams new flows, every filter kind, the flow message's fields, ServerStatus, GetNodes,
the health check, a reader that stops reading is cut off and counted without the server's memory growing,
and the access rule (loopback, Unix socket, TLS with client certificates).
"""

from __future__ import annotations

import asyncio
import os
import resource
import stat
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from factories import make_pod
from hubble_support import Certificates, Client, make_certificates, ports, serving
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.flows import WORLD_IDENTITY, FlowMessages, pod_labels
from podmeter.adapters.hubble.proto import flow_pb2, health_pb2, observer_pb2, peer_pb2, peer_pb2_grpc
from podmeter.adapters.hubble.server import (
    AccessError,
    HubbleServer,
    hubble_config,
    parse_listen,
)
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import name_flows
from podmeter.model.flows import TCP, UDP, FlowCounts, FlowKey
from record_support import BASE, FROM, PODS, TO, odd_records, records, with_drops


def stamp(seconds: float) -> Timestamp:
    return Timestamp(seconds=int(seconds), nanos=round((seconds % 1) * 1e9))


@pytest.fixture
async def hubble() -> AsyncIterator[tuple[FlowFeed, HubbleServer, Client]]:
    feed = FlowFeed(100)
    async with serving(feed, labels=lambda e: pod_labels(PODS, e)) as (server, client):
        yield feed, server, client


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0,
                     describe: Callable[[], str] | None = None) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached" + (f": {describe()}" if describe else ""))


# --- GetFlows: how many, which ones, in which order ------------------------------------------------------


async def test_number_returns_the_last_n_oldest_first_then_ends_ok(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(20))
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(number=4), timeout=10)
    got = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    assert [r.flow.time.seconds for r in got] == [int(BASE) + i for i in (16, 17, 18, 19)]
    assert ports(got) == [40016, 8, 40018, 128]  # 17 and 19 are ICMP: their types
    assert all(r.node_name == "node-a" and r.time == r.flow.time for r in got)


async def test_first_returns_the_oldest_and_all_and_since_until_bound_the_time(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(20))
    assert [r.flow.time.seconds - int(BASE) for r in await client.flows(number=3, first=True)] == [0, 1, 2]
    assert len(await client.flows(number=2**64 - 1)) == 20  # hubble observe --all
    window = await client.flows(since=stamp(BASE + 5), until=stamp(BASE + 9))  # number 0: all in the window
    assert [r.flow.time.seconds - int(BASE) for r in window] == [5, 6, 7, 8, 9]
    assert [r.flow.time.seconds - int(BASE) for r in await client.flows(number=2, since=stamp(BASE + 5))] == [18, 19]
    assert await client.flows(number=0) == []  # nothing asked for: nothing, and the stream ends


async def test_first_with_follow_is_invalid_argument(hubble: Any) -> None:
    _, _, client = hubble
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.flows(first=True, follow=True, number=1)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "follow" in (error.value.details() or "")


async def test_follow_streams_new_flows_after_the_last_n_without_gap_or_repeat(hubble: Any) -> None:
    feed, server, client = hubble
    feed.publish(records(10))
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(number=2, follow=True))
    got = [await call.read() for _ in range(2)]
    await wait_until(lambda: feed.followers == 1)
    feed.publish(records(3, start=10))
    feed.publish(records(2, start=13))
    got += [await asyncio.wait_for(call.read(), 10) for _ in range(5)]
    assert [r.flow.time.seconds - int(BASE) for r in got] == [8, 9, 10, 11, 12, 13, 14]
    call.cancel()
    await wait_until(lambda: feed.followers == 0 and server.streams == 0)  # the follower left the feed


async def test_follow_with_since_and_no_number_sends_every_flow_since_then_first(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(5))
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True, since=stamp(BASE + 2)))
    got = [await asyncio.wait_for(call.read(), 10) for _ in range(3)]  # hubble observe -f --since ...
    await wait_until(lambda: feed.followers == 1)
    feed.publish(records(1, start=5))
    got.append(await asyncio.wait_for(call.read(), 10))
    assert [r.flow.time.seconds - int(BASE) for r in got] == [2, 3, 4, 5]
    call.cancel()


async def test_follow_alone_sends_no_history_and_until_ends_the_stream(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(5))
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True, until=stamp(BASE + 11)))
    await wait_until(lambda: feed.followers == 1)
    feed.publish(records(4, start=10))  # 10, 11, then 12 is past until: the stream ends with OK
    got = [r async for r in call]
    assert [r.flow.time.seconds - int(BASE) for r in got] == [10, 11]
    assert await call.code() == grpc.StatusCode.OK


# --- filters ---------------------------------------------------------------------------------------------


async def matching(client: Client, whitelist: list[dict[str, Any]] | None = None,
                   blacklist: list[dict[str, Any]] | None = None) -> list[int]:
    """The indexes (record i is at BASE + i) of the records a request with these filters returns."""
    got = await client.flows(number=1000, whitelist=[flow_pb2.FlowFilter(**f) for f in whitelist or []],
                             blacklist=[flow_pb2.FlowFilter(**f) for f in blacklist or []])
    return [r.flow.time.seconds - int(BASE) for r in got]


ALL = list(range(10))
WEB_TO_DB, WEB_TO_WORLD, WORLD_TO_WEB, DB_TO_WEB, CACHE_V6 = ([i for i in ALL if i % 5 == k] for k in range(5))

FILTERS: dict[str, tuple[list[dict[str, Any]], list[int]]] = {
    # hubble observe --namespace shop: [{source_pod: [shop/]}, {destination_pod: [shop/]}]
    "namespace": ([{"source_pod": ["shop/"]}, {"destination_pod": ["shop/"]}],
                  sorted(WEB_TO_DB + WEB_TO_WORLD + WORLD_TO_WEB + DB_TO_WEB)),
    "pod prefix in a namespace": ([{"source_pod": ["shop/web-"]}], sorted(WEB_TO_DB + WEB_TO_WORLD)),
    "pod without namespace is in default": ([{"source_pod": ["cache"]}], CACHE_V6),
    "pod without namespace elsewhere": ([{"source_pod": ["web"]}], []),
    "destination pod": ([{"destination_pod": ["shop/db-0"]}], WEB_TO_DB),
    "source ip": ([{"source_ip": ["10.0.0.2"]}], DB_TO_WEB),
    "destination cidr": ([{"destination_ip": ["8.8.0.0/16"]}], WEB_TO_WORLD),
    "v6 cidr": ([{"source_ip": ["fd00::/64"]}], CACHE_V6),
    "source port": ([{"source_port": ["40003"]}], [3]),
    "destination port": ([{"destination_port": ["5432", "53"]}], sorted(WEB_TO_DB + WEB_TO_WORLD)),
    "protocol": ([{"protocol": ["UDP"]}], WEB_TO_WORLD),
    "protocols icmp": ([{"protocol": ["icmpv4", "icmpv6"]}], sorted(WORLD_TO_WEB + CACHE_V6)),
    "l7 protocol": ([{"protocol": ["http"]}], []),
    "verdict forwarded": ([{"verdict": [flow_pb2.FORWARDED]}], ALL),
    "verdict dropped": ([{"verdict": [flow_pb2.DROPPED]}], []),
    "tcp flags SYN": ([{"tcp_flags": [flow_pb2.TCPFlags(SYN=True)]}], WEB_TO_DB),
    "tcp flags FIN or SYN+ACK": ([{"tcp_flags": [flow_pb2.TCPFlags(FIN=True), flow_pb2.TCPFlags(SYN=True, ACK=True)]}],
                                 sorted(WEB_TO_DB + DB_TO_WEB)),
    "tcp flags NS": ([{"tcp_flags": [flow_pb2.TCPFlags(NS=True)]}], []),
    "source workload": ([{"source_workload": [flow_pb2.Workload(name="web", kind="Deployment")]}],
                        sorted(WEB_TO_DB + WEB_TO_WORLD)),
    "destination workload kind only": ([{"destination_workload": [flow_pb2.Workload(kind="StatefulSet")]}], WEB_TO_DB),
    "bare pod workload": ([{"source_workload": [flow_pb2.Workload(name="cache", kind="Pod")]}], CACHE_V6),
    "source label": ([{"source_label": ["app=web"]}], sorted(WEB_TO_DB + WEB_TO_WORLD)),
    "label with source prefix": ([{"destination_label": ["k8s:app in (db, cache)"]}], WEB_TO_DB),
    "label set and not": ([{"source_label": ["app,app!=db,tier notin (back)"]}],
                          sorted(WEB_TO_DB + WEB_TO_WORLD + CACHE_V6)),
    "label namespace": ([{"source_label": ["io.kubernetes.pod.namespace=default"]}], CACHE_V6),
    "label world": ([{"source_label": ["reserved:world"]}], WORLD_TO_WEB),
    "label absent": ([{"destination_label": ["!app"]}], sorted(WEB_TO_WORLD + CACHE_V6)),
    "world identity": ([{"destination_identity": [WORLD_IDENTITY]}], sorted(WEB_TO_WORLD + CACHE_V6)),
    "traffic direction ingress": ([{"traffic_direction": [flow_pb2.INGRESS]}], sorted(WORLD_TO_WEB + DB_TO_WEB)),
    "ip version 6": ([{"ip_version": [flow_pb2.IPv6]}], CACHE_V6),
    "node name pattern": ([{"node_name": ["node-*"]}], ALL),
    "node name of another cluster": ([{"node_name": ["other/node-a"]}], []),
    "node name of this cluster": ([{"node_name": ["default/node-a"]}], ALL),
    "event type trace from endpoint": ([{"event_type": [flow_pb2.EventTypeFilter(type=4, match_sub_type=True,
                                                                                 sub_type=5)]}],
                                       sorted(WEB_TO_DB + WEB_TO_WORLD + CACHE_V6)),
    "fields podmeter flows never have": ([{"source_fqdn": ["example.com"]}], []),
    "http url": ([{"http_url": ["https://example.com/.*"]}], []),
    "http header": ([{"http_header": [flow_pb2.HTTPHeader(key="x-user", value="a")]}], []),
    "snat ip": ([{"source_ip_xlated": ["10.0.0.1"]}], []),  # observed at the pod: never translated
    "ip trace id": ([{"ip_trace_id": [7]}], []),
    "source cluster": ([{"source_cluster_name": ["default"]}], sorted(WEB_TO_DB + WEB_TO_WORLD + DB_TO_WEB + CACHE_V6)),
    "destination cluster": ([{"destination_cluster_name": ["other", "default"]}],
                            sorted(WEB_TO_DB + WORLD_TO_WEB + DB_TO_WEB)),
    # hubble observe --cluster default: either end in the cluster
    "cluster": ([{"source_cluster_name": ["default"]}, {"destination_cluster_name": ["default"]}], ALL),
    "another cluster": ([{"source_cluster_name": ["other"]}], []),
    "experimental without an expression": ([{"experimental": flow_pb2.FlowFilter.Experimental()}], ALL),
    "fields AND within a filter": ([{"source_pod": ["shop/"], "protocol": ["tcp"]}], sorted(WEB_TO_DB + DB_TO_WEB)),
    "empty filter matches all": ([{}], ALL),
}


@pytest.mark.parametrize("name", list(FILTERS))
async def test_each_filter_kind_in_the_allow_list(hubble: Any, name: str) -> None:
    feed, _, client = hubble
    feed.publish(records(10))
    whitelist, expected = FILTERS[name]
    assert await matching(client, whitelist) == expected


async def test_the_deny_list_removes_what_it_matches_from_the_allow_list(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(10))
    assert await matching(client, blacklist=[{"destination_ip": ["8.8.8.8"]}, {"protocol": ["icmpv6"]}]) == \
        sorted(WEB_TO_DB + WORLD_TO_WEB + DB_TO_WEB)
    assert await matching(client, [{"source_pod": ["shop/"]}], [{"protocol": ["udp"]}]) == sorted(WEB_TO_DB + DB_TO_WEB)
    assert await matching(client, blacklist=[{"source_fqdn": ["x"]}]) == ALL  # never matches: removes nothing
    assert await matching(client, blacklist=[{"http_url": ["/"]}, {"source_ip_xlated": ["10.0.0.1"]}]) == ALL
    assert await matching(client, blacklist=[{"destination_cluster_name": ["default"]}]) == \
        sorted(WEB_TO_WORLD + CACHE_V6)  # what leaves the cluster


async def test_follow_applies_the_filters_to_new_flows(hubble: Any) -> None:
    feed, _, client = hubble
    call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(
        follow=True, whitelist=[flow_pb2.FlowFilter(protocol=["tcp"])],
        blacklist=[flow_pb2.FlowFilter(tcp_flags=[flow_pb2.TCPFlags(FIN=True)])]))
    await wait_until(lambda: feed.followers == 1)
    feed.publish(records(10))
    got = [await asyncio.wait_for(call.read(), 10) for _ in range(2)]
    assert [r.flow.time.seconds - int(BASE) for r in got] == WEB_TO_DB
    call.cancel()


@pytest.mark.parametrize(("filter_", "word"), [
    ({"source_ip": ["10.0.0.300"]}, "IP"), ({"source_port": ["http"]}, "port"), ({"protocol": ["quic"]}, "protocol"),
    ({"source_label": ["app in web"]}, "label"), ({"source_pod": ["/"]}, "pod"),
    ({"destination_cluster_name": [""]}, "cluster"),
])
async def test_a_bad_filter_value_is_invalid_argument_that_says_which(hubble: Any, filter_: dict[str, Any],
                                                                      word: str) -> None:
    _, _, client = hubble
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.flows(number=1, whitelist=[flow_pb2.FlowFilter(**filter_)])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in (error.value.details() or "")


@pytest.mark.parametrize(("raw", "named"), [
    (bytes([0xB0, 0x3E, 0x01]), "998"),  # field 998, varint 1
    (bytes([0xBA, 0x3E, 0x02, 0x10, 0x01]), "experimental.2"),  # experimental (999) with its field 2, varint 1
    (bytes([0xD2, 0x01, 0x04, 0x0A, 0x00, 0x18, 0x01]), "source_workload.3"),  # a workload (26) with a field 3
])
async def test_a_filter_field_podmeter_does_not_know_is_refused_not_ignored(hubble: Any, raw: bytes,
                                                                           named: str) -> None:
    """A newer client's filter field, at the top or inside a field's message, must not be silently dropped:
    ignoring it would return flows the client excluded."""
    feed, _, client = hubble
    feed.publish(records(3))
    unknown = flow_pb2.FlowFilter.FromString(flow_pb2.FlowFilter(protocol=["tcp"]).SerializeToString() + raw)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.flows(number=1, whitelist=[unknown])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in (error.value.details() or "")


@pytest.mark.parametrize(("filter_", "named"), [
    ({"interface": [flow_pb2.NetworkInterface(name="lxc1")]}, "interface (35)"),
    ({"node_labels": ["kubernetes.io/os=linux"]}, "node_labels (36)"),
    ({"encrypted": [False]}, "encrypted (40)"),  # hubble observe --unencrypted
    ({"experimental": flow_pb2.FlowFilter.Experimental(cel_expression=["true"])}, "experimental.cel_expression"),
])
async def test_a_filter_on_what_podmeter_does_not_know_is_unimplemented_naming_the_field(
        hubble: Any, filter_: dict[str, Any], named: str) -> None:
    """Matching nothing would let a deny list through what it excludes: refused, in either list."""
    feed, _, client = hubble
    feed.publish(records(3))
    for lists in ({"whitelist": [flow_pb2.FlowFilter(**filter_)]}, {"blacklist": [flow_pb2.FlowFilter(**filter_)]}):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.flows(number=1, **lists)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert named in (error.value.details() or "") and "not supported" in (error.value.details() or "")


# --- what a flow message carries --------------------------------------------------------------------------


async def test_a_flow_carries_what_podmeter_knows_in_hubbles_fields(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(5))
    tcp, udp, icmp, back, v6 = (r.flow for r in await client.flows(number=5))
    assert (tcp.time.seconds, tcp.node_name, tcp.Type, tcp.verdict) == (int(BASE), "node-a", flow_pb2.L3_L4,
                                                                         flow_pb2.FORWARDED)
    assert (tcp.IP.source, tcp.IP.destination, tcp.IP.ipVersion) == ("10.0.0.1", "10.0.0.2", flow_pb2.IPv4)
    assert (tcp.l4.TCP.source_port, tcp.l4.TCP.destination_port) == (40000, 5432)
    assert tcp.l4.TCP.flags == flow_pb2.TCPFlags(SYN=True, ACK=True)
    assert back.l4.TCP.flags == flow_pb2.TCPFlags(FIN=True, PSH=True, ACK=True)
    assert (udp.l4.UDP.source_port, udp.l4.UDP.destination_port) == (40001, 53)
    assert (icmp.l4.ICMPv4.type, icmp.l4.ICMPv4.code) == (8, 0)
    assert (v6.l4.ICMPv6.type, v6.IP.ipVersion) == (128, flow_pb2.IPv6)
    source = tcp.source
    assert (source.cluster_name, source.namespace, source.pod_name, source.identity) == ("default", "shop",
                                                                                          "web-5d9f7-x2x7p", 0)
    assert [(w.kind, w.name) for w in source.workloads] == [("Deployment", "web")]
    assert list(source.labels) == ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop", "k8s:pod-template-hash=5d9f7",
                                   "k8s:tier=front"]
    assert [(w.kind, w.name) for w in tcp.destination.workloads] == [("StatefulSet", "db")]
    assert [(w.kind, w.name) for w in v6.source.workloads] == [("Pod", "cache")]
    world = udp.destination
    assert (world.identity, list(world.labels), world.pod_name, world.namespace, world.cluster_name) == (
        WORLD_IDENTITY, ["reserved:world"], "", "", "")
    # direction from the pod's point of view: leaving it is egress, entering it ingress
    assert (tcp.traffic_direction, tcp.trace_observation_point) == (flow_pb2.EGRESS, flow_pb2.FROM_ENDPOINT)
    assert (icmp.traffic_direction, icmp.trace_observation_point) == (flow_pb2.INGRESS, flow_pb2.TO_ENDPOINT)
    assert (tcp.event_type.type, tcp.event_type.sub_type, icmp.event_type.sub_type) == (4, 5, 0)
    assert not tcp.HasField("is_reply")  # unknown, printed as <> by hubble observe
    # The compact printer's last column: TCP flags as Hubble's agent lists them (SYN, ACK, RST, FIN, PSH...),
    # podmeter's own short text for the other protocols.
    assert [f.Summary for f in (tcp, udp, icmp, back, v6)] == [
        "TCP Flags: SYN, ACK", "UDP", "ICMPv4 type 8 code 0", "TCP Flags: ACK, FIN, PSH", "ICMPv6 type 128 code 0"]


DROPPED = [5, 6, 8, 9]


async def test_a_dropped_record_is_a_drop_event_with_the_cilium_code_where_one_has_its_meaning(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(with_drops(records(10)))
    flows = [r.flow for r in await client.flows(number=10)]
    assert [i for i, f in enumerate(flows) if f.verdict == flow_pb2.DROPPED] == DROPPED
    netfilter, exthdr, forwarded, unspecified = flows[5], flows[6], flows[7], flows[9]
    # The compact printer names the sub-type from Cilium's table: "Policy denied", not "255, 0".
    assert (netfilter.event_type.type, netfilter.event_type.sub_type) == (1, 133)
    assert netfilter.drop_reason_desc == flow_pb2.POLICY_DENIED
    assert (exthdr.event_type.type, exthdr.event_type.sub_type) == (1, 156)
    assert exthdr.drop_reason_desc == flow_pb2.INVALID_IPV6_EXTENSION_HEADER
    assert flows[8].drop_reason_desc == flow_pb2.INVALID_PACKET_DROPPED
    assert (unspecified.event_type.sub_type, unspecified.drop_reason_desc) == (255, flow_pb2.DROP_REASON_UNKNOWN)
    assert (forwarded.event_type.type, forwarded.drop_reason_desc) == (4, flow_pb2.DROP_REASON_UNKNOWN)
    assert netfilter.trace_observation_point == flow_pb2.FROM_ENDPOINT  # the observed end, as for forwarded flows
    assert flows[8].traffic_direction == flow_pb2.INGRESS
    # The kernel's reason, which no other Hubble field carries, is the summary hubble observe prints.
    assert [flows[i].Summary for i in DROPPED] == ["NETFILTER_DROP", "IPV6_BAD_EXTHDR", "TCP_CSUM", "NOT_SPECIFIED"]
    assert forwarded.Summary == "ICMPv4 type 8 code 0"


def event(kind: int, sub_type: int | None = None) -> flow_pb2.EventTypeFilter:
    """What `hubble observe --type KIND[:SUB]` sends."""
    if sub_type is None:
        return flow_pb2.EventTypeFilter(type=kind)
    return flow_pb2.EventTypeFilter(type=kind, match_sub_type=True, sub_type=sub_type)


DROP_FILTERS: dict[str, tuple[list[dict[str, Any]], list[int]]] = {
    "verdict dropped": ([{"verdict": [flow_pb2.DROPPED]}], DROPPED),
    "type drop": ([{"event_type": [event(1)]}], DROPPED),
    "type drop with the code": ([{"event_type": [event(1, 156)]}], [6]),
    "type drop with the unknown code": ([{"event_type": [event(1, 255)]}], [9]),
    "type drop policy denied": ([{"event_type": [event(1, 133)]}], [5]),
    "type trace": ([{"event_type": [event(4)]}], [0, 1, 2, 3, 4, 7]),
    "type trace to-endpoint": ([{"event_type": [event(4, 0)]}], [2, 3, 7]),
    "type 0 is any type": ([{"event_type": [event(0)]}], ALL),
    "type drop or trace": ([{"event_type": [event(1), event(4, 5)]}], [0, 1, 4, 5, 6, 8, 9]),
    "drop reason with a code": ([{"drop_reason_desc": [flow_pb2.INVALID_IPV6_EXTENSION_HEADER]}], [6]),
    "drop reason unknown": ([{"drop_reason_desc": [flow_pb2.DROP_REASON_UNKNOWN]}], [9]),  # dropped ones
    "drop reason policy denied": ([{"drop_reason_desc": [flow_pb2.POLICY_DENIED]}], [5]),
    "drop reason podmeter never gives": ([{"drop_reason_desc": [181]}], []),  # POLICY_DENY: Cilium's deny list
}


@pytest.mark.parametrize("name", list(DROP_FILTERS))
async def test_drop_filters(hubble: Any, name: str) -> None:
    feed, _, client = hubble
    feed.publish(with_drops(records(10)))
    whitelist, expected = DROP_FILTERS[name]
    assert await matching(client, whitelist) == expected


async def test_the_deny_list_removes_drops_by_type(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(with_drops(records(10)))
    assert await matching(client, blacklist=[{"event_type": [event(1)]}]) == [0, 1, 2, 3, 4, 7]


async def test_labels_of_a_pod_the_agent_no_longer_knows_are_absent(hubble: Any) -> None:
    feed, _, client = hubble
    gone = make_pod("gone", "shop", ips=("10.0.0.7",))
    (record,) = name_flows([(FlowKey("10.0.0.7", "8.8.8.8", 1, 2, UDP, FROM), FlowCounts(1, 1, 0, 0, 0))],
                           AddressBook([gone]), "node-a", BASE)
    feed.publish([record])
    (response,) = await client.flows(number=1)
    assert response.flow.source.pod_name == "gone" and list(response.flow.source.labels) == []


def test_the_hand_written_bytes_are_the_messages_bytes() -> None:
    """``FlowMessages.serialized`` (what the server sends) is byte for byte the serialization of the message
    ``FlowMessages.response`` builds with protobuf, for every shape of record."""
    messages = FlowMessages(lambda e: pod_labels(PODS, e))
    for record in odd_records():
        expected = messages.response(record).SerializeToString()
        assert messages.serialized(record) == expected, record
        assert messages.encoded(record) == expected


# --- status, nodes, health --------------------------------------------------------------------------------


async def test_server_status_counts_and_get_nodes_is_this_node(hubble: Any) -> None:
    feed, _, client = hubble
    feed.publish(records(30))
    feed.publish(records(90, start=30))  # 120 seen, the ring holds 100
    status = await client.observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=10)
    assert (status.num_flows, status.max_flows, status.seen_flows) == (100, 100, 120)
    assert status.num_connected_nodes.value == 1 and status.HasField("num_unavailable_nodes")
    assert status.num_unavailable_nodes.value == 0 and status.uptime_ns > 0 and status.version.startswith("podmeter")
    nodes = await client.observer.GetNodes(observer_pb2.GetNodesRequest(), timeout=10)
    (node,) = nodes.nodes
    assert (node.name, node.state, node.num_flows, node.max_flows, node.seen_flows) == ("node-a", 1, 100, 100, 120)
    assert node.tls.enabled is False and node.address == "127.0.0.1:0"


async def test_get_namespaces_lists_the_namespaces_of_both_ends_of_the_rings_flows_sorted(hubble: Any) -> None:
    feed, _, client = hubble
    empty = await client.observer.GetNamespaces(observer_pb2.GetNamespacesRequest(), timeout=10)
    assert list(empty.namespaces) == []  # no flow yet
    other = make_pod("api", "billing", ips=("10.0.0.9",))
    (inbound,) = name_flows([(FlowKey("8.8.8.8", "10.0.0.9", 1, 443, TCP, TO), FlowCounts(1, 1, 0, 0, 0))],
                            AddressBook([other]), "node-a", BASE)  # billing only as a destination
    feed.publish([*records(5), inbound])
    answer = await client.observer.GetNamespaces(observer_pb2.GetNamespacesRequest(), timeout=10)
    assert [(n.cluster, n.namespace) for n in answer.namespaces] == [
        ("default", "billing"), ("default", "default"), ("default", "shop")]  # world ends name none
    feed.publish(records(100, start=5))  # the ring (100) no longer holds the billing flow
    answer = await client.observer.GetNamespaces(observer_pb2.GetNamespacesRequest(), timeout=10)
    assert [n.namespace for n in answer.namespaces] == ["default", "shop"]


async def test_peer_notify_announces_this_node_for_relay_and_stays_open(hubble: Any) -> None:
    _, server, client = hubble
    call = peer_pb2_grpc.PeerStub(client.channel).Notify(peer_pb2.NotifyRequest())
    first = await asyncio.wait_for(call.read(), 10)
    assert (first.name, first.address, first.type) == ("node-a", f"127.0.0.1:{server.port}", peer_pb2.PEER_ADDED)
    assert not first.HasField("tls")  # no TLS
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(call.read()), 0.3)  # nothing else: one node, no changes
    call.cancel()


async def test_health_check_is_serving_for_hubbles_observer_service(hubble: Any) -> None:
    _, _, client = hubble
    for service in ("hubble.server.Observer", "observer.Observer", ""):
        answer = await client.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.health.Check(health_pb2.HealthCheckRequest(service="flow.Nothing"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


# --- bounded: slow readers ----------------------------------------------------------------------------------

STALLED_CLIENT = textwrap.dedent("""
    import sys, time, grpc
    from podmeter.adapters.hubble.proto import observer_pb2, observer_pb2_grpc
    stub = observer_pb2_grpc.ObserverStub(grpc.insecure_channel(sys.argv[1]))
    call = stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
    next(call)
    print("reading", flush=True)
    sys.stdin.readline()  # stop reading until told to go on
    count = 1
    try:
        for _ in call:
            count += 1
    except grpc.RpcError as error:
        print(count, error.code().name, error.details(), flush=True)
""")


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def test_a_reader_that_stops_reading_is_cut_off_counted_and_costs_no_memory(hubble: Any) -> None:
    feed, server, _ = hubble
    feed.write_timeout = 2.0
    reader = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STALLED_CLIENT, f"127.0.0.1:{server.port}", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert reader.stdin is not None and reader.stdout is not None
    try:
        await wait_until(lambda: feed.followers == 1)
        feed.publish(records(1))
        assert await asyncio.wait_for(reader.stdout.readline(), 10) == b"reading\n"
        batch = records(1000)
        before = rss_mib()
        for _ in range(3000):  # up to 3,000,000 records: a gap whenever the ring laps the reader, until the
            feed.publish(batch)  # client's window is full and a write waits past the write timeout
            await asyncio.sleep(0.005)
            if feed.cut_off:
                break
        await wait_until(lambda: feed.cut_off == 1 and feed.followers == 0 and server.streams == 0, 15,
                         lambda: f"cut off {feed.cut_off}, followers {feed.followers}, streams {server.streams}")
        grown = rss_mib() - before
        assert grown < 60, f"the server grew by {grown:.0f} MiB while a reader did not read"
        reader.stdin.write(b"go on\n")
        await reader.stdin.drain()
        received, code, *details = (await asyncio.wait_for(reader.stdout.readline(), 30)).decode().split(" ", 2)
        assert code == "RESOURCE_EXHAUSTED" and "cut off" in details[-1]
        assert 1 < int(received) < 3_000_000  # what gRPC had buffered before the server stopped writing
        assert feed.gaps > 0  # lapped meanwhile: told what it lost, not cut off for it
    finally:
        if reader.returncode is None:
            reader.kill()
        await reader.wait()


async def test_followers_beyond_the_feeds_limit_are_refused(hubble: Any) -> None:
    feed, _, client = hubble
    feed.max_followers = 2
    calls = [client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True)) for _ in range(2)]
    await wait_until(lambda: feed.followers == 2)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.flows(follow=True)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    await wait_until(lambda: feed.followers == 0)


# --- access: where it listens, who may connect ------------------------------------------------------------


def test_listen_addresses_and_the_access_rule() -> None:
    assert parse_listen("unix:///run/p/hubble.sock").unix_path == Path("/run/p/hubble.sock")
    assert parse_listen("unix:///run/p/hubble.sock").target == "unix:/run/p/hubble.sock"
    for local in ("127.0.0.1:4246", "[::1]:4246", "localhost:4246", "127.3.0.1:1"):
        assert parse_listen(local).local, local
    for remote in ("0.0.0.0:4246", ":4246", "[::]:4246", "10.0.0.1:4246", "node-a:4246"):
        assert not parse_listen(remote).local, remote
        with pytest.raises(AccessError, match="needs TLS with client certificates"):
            hubble_config(remote)
    for bad in ("4246", "unix:", "host:port", "127.0.0.1:70000"):
        with pytest.raises(AccessError, match="expected"):
            parse_listen(bad)
    assert hubble_config(None) is None
    with pytest.raises(AccessError, match="missing: --hubble-tls-client-ca"):
        hubble_config("0.0.0.0:4246", "cert.pem", "key.pem")
    with pytest.raises(AccessError, match="need --hubble-listen"):
        hubble_config(None, "cert.pem", "key.pem", "ca.pem")
    with pytest.raises(AccessError, match="cannot read"):
        hubble_config("0.0.0.0:4246", "/nonexistent/cert.pem", "key.pem", "ca.pem")


async def test_a_unix_socket_only_its_owner_and_group_reach(tmp_path: Path) -> None:
    feed = FlowFeed(10)
    feed.publish(records(3))
    path = tmp_path / "run" / "hubble.sock"
    server = HubbleServer(feed, "node-a", parse_listen(f"unix://{path}"))
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        async with Client(f"unix://{path}") as client:
            assert len(await client.flows(number=10)) == 3
    finally:
        await server.stop(0)
    assert not path.exists()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


async def test_tls_accepts_a_client_certificate_of_the_ca_and_refuses_others(certificates: Certificates) -> None:
    feed = FlowFeed(10)
    feed.publish(records(3))
    config = hubble_config("0.0.0.0:0", str(certificates.server_cert), str(certificates.server_key),
                           str(certificates.ca))
    assert config is not None
    server = HubbleServer(feed, "node-a", config.address, tls=config.tls)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        async with Client(target, certificates) as client:
            assert len(await client.flows(number=10)) == 3
            nodes = await client.observer.GetNodes(observer_pb2.GetNodesRequest(), timeout=10)
            assert nodes.nodes[0].tls.enabled
            notify = peer_pb2_grpc.PeerStub(client.channel).Notify(peer_pb2.NotifyRequest())
            peer = await asyncio.wait_for(notify.read(), 10)  # wildcard bind: Relay reaches the node by name
            assert (peer.address, peer.tls.server_name) == (f"node-a:{server.port}",
                                                            "node-a.default.hubble-grpc.cilium.io")
            notify.cancel()
        for refused in (Client(target, certificates, client_cert=False), Client(target, certificates, rogue=True),
                        Client(target)):  # no certificate, another CA's, plain text
            async with refused:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await refused.flows(number=10, timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_rotated_tls_files_are_used_by_new_connections_without_a_restart(tmp_path: Path) -> None:
    first, second = make_certificates(tmp_path / "first"), make_certificates(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    files = {name: live / f"{name}.pem" for name in ("cert", "key", "ca")}

    def install(certificates: Certificates) -> None:
        for name, source in (("cert", certificates.server_cert), ("key", certificates.server_key),
                             ("ca", certificates.ca)):
            files[name].write_bytes(source.read_bytes())
            os.utime(files[name], ns=(time.time_ns(), time.time_ns()))

    install(first)
    config = hubble_config("127.0.0.1:0", str(files["cert"]), str(files["key"]), str(files["ca"]))
    assert config is not None
    feed = FlowFeed(10)
    feed.publish(records(2))
    server = HubbleServer(feed, "node-a", config.address, tls=config.tls)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        async with Client(target, first) as client:
            assert len(await client.flows(number=10)) == 2
        install(second)  # as cert-manager or a Secret update would
        async with Client(target, second) as client:
            assert len(await client.flows(number=10)) == 2
        async with Client(target, first) as old:
            with pytest.raises(grpc.aio.AioRpcError):
                await old.flows(number=10, timeout=5)
    finally:
        await server.stop(0)


async def test_the_agent_refuses_to_start_on_a_remote_address_without_tls() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "podmeter", "agent", "--node-name", "n", "--datapath", "memory",
        "--hubble-listen", "0.0.0.0:4246", stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"needs TLS with client certificates (--hubble-tls-cert, --hubble-tls-key, --hubble-tls-client-ca)" in err
