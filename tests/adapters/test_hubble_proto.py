"""The Hubble API definitions: wire-compatible with Hubble's published ones, and the committed stubs made from them.

- Every field podmeter sends or reads has the number and type of Hubble's published definition (the table
  below is that contract, written out); a request encoded by hand from those numbers, as `hubble observe`
  sends it, decodes into what it means.
- The generated modules are what ``make proto`` makes from the ``.proto`` files now (compared as
  descriptors, so a newer protoc's formatting does not matter): a ``.proto`` edited without
  ``make proto`` fails here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from podmeter.adapters.hubble.proto import flow_pb2, health_pb2, observer_pb2, peer_pb2, relay_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "src" / "podmeter" / "adapters" / "hubble" / "proto"
MODULES = {"flow": flow_pb2, "observer": observer_pb2, "relay": relay_pb2, "peer": peer_pb2, "health": health_pb2}

T = FieldDescriptor
# message -> field -> (number, type, repeated): Hubble's published numbers for what podmeter uses.
CONTRACT: dict[str, dict[str, tuple[int, int, bool]]] = {
    "flow.Flow": {"time": (1, T.TYPE_MESSAGE, False), "verdict": (2, T.TYPE_ENUM, False),
                  "IP": (5, T.TYPE_MESSAGE, False), "l4": (6, T.TYPE_MESSAGE, False),
                  "source": (8, T.TYPE_MESSAGE, False), "destination": (9, T.TYPE_MESSAGE, False),
                  "Type": (10, T.TYPE_ENUM, False),
                  "node_name": (11, T.TYPE_STRING, False), "event_type": (19, T.TYPE_MESSAGE, False),
                  "traffic_direction": (22, T.TYPE_ENUM, False), "trace_observation_point": (24, T.TYPE_ENUM, False),
                  "drop_reason_desc": (25, T.TYPE_ENUM, False), "is_reply": (26, T.TYPE_MESSAGE, False),
                  "Summary": (100000, T.TYPE_STRING, False)},
    "flow.IP": {"source": (1, T.TYPE_STRING, False), "destination": (2, T.TYPE_STRING, False),
                "ipVersion": (3, T.TYPE_ENUM, False), "encrypted": (4, T.TYPE_BOOL, False)},
    "flow.Layer4": {"TCP": (1, T.TYPE_MESSAGE, False), "UDP": (2, T.TYPE_MESSAGE, False),
                    "ICMPv4": (3, T.TYPE_MESSAGE, False), "ICMPv6": (4, T.TYPE_MESSAGE, False)},
    "flow.TCP": {"source_port": (1, T.TYPE_UINT32, False), "destination_port": (2, T.TYPE_UINT32, False),
                 "flags": (3, T.TYPE_MESSAGE, False)},
    "flow.UDP": {"source_port": (1, T.TYPE_UINT32, False), "destination_port": (2, T.TYPE_UINT32, False)},
    "flow.ICMPv4": {"type": (1, T.TYPE_UINT32, False), "code": (2, T.TYPE_UINT32, False)},
    "flow.ICMPv6": {"type": (1, T.TYPE_UINT32, False), "code": (2, T.TYPE_UINT32, False)},
    "flow.TCPFlags": {name: (number, T.TYPE_BOOL, False) for number, name in
                      enumerate(("FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR", "NS"), start=1)},
    "flow.Endpoint": {"ID": (1, T.TYPE_UINT32, False), "identity": (2, T.TYPE_UINT32, False),
                      "namespace": (3, T.TYPE_STRING, False), "labels": (4, T.TYPE_STRING, True),
                      "pod_name": (5, T.TYPE_STRING, False), "workloads": (6, T.TYPE_MESSAGE, True),
                      "cluster_name": (7, T.TYPE_STRING, False)},
    "flow.Workload": {"name": (1, T.TYPE_STRING, False), "kind": (2, T.TYPE_STRING, False)},
    "flow.CiliumEventType": {"type": (1, T.TYPE_INT32, False), "sub_type": (2, T.TYPE_INT32, False)},
    "flow.EventTypeFilter": {"type": (1, T.TYPE_INT32, False), "match_sub_type": (2, T.TYPE_BOOL, False),
                             "sub_type": (3, T.TYPE_INT32, False)},
    "flow.FlowFilter": {
        "source_ip": (1, T.TYPE_STRING, True), "source_pod": (2, T.TYPE_STRING, True),
        "destination_ip": (3, T.TYPE_STRING, True), "destination_pod": (4, T.TYPE_STRING, True),
        "verdict": (5, T.TYPE_ENUM, True), "event_type": (6, T.TYPE_MESSAGE, True),
        "source_fqdn": (7, T.TYPE_STRING, True), "destination_fqdn": (8, T.TYPE_STRING, True),
        "http_status_code": (9, T.TYPE_STRING, True), "source_label": (10, T.TYPE_STRING, True),
        "destination_label": (11, T.TYPE_STRING, True), "protocol": (12, T.TYPE_STRING, True),
        "source_port": (13, T.TYPE_STRING, True), "destination_port": (14, T.TYPE_STRING, True),
        "reply": (15, T.TYPE_BOOL, True), "source_service": (16, T.TYPE_STRING, True),
        "destination_service": (17, T.TYPE_STRING, True), "dns_query": (18, T.TYPE_STRING, True),
        "source_identity": (19, T.TYPE_UINT32, True), "destination_identity": (20, T.TYPE_UINT32, True),
        "http_method": (21, T.TYPE_STRING, True), "http_path": (22, T.TYPE_STRING, True),
        "tcp_flags": (23, T.TYPE_MESSAGE, True), "node_name": (24, T.TYPE_STRING, True),
        "ip_version": (25, T.TYPE_ENUM, True), "source_workload": (26, T.TYPE_MESSAGE, True),
        "destination_workload": (27, T.TYPE_MESSAGE, True), "trace_id": (28, T.TYPE_STRING, True),
        "uuid": (29, T.TYPE_STRING, True), "traffic_direction": (30, T.TYPE_ENUM, True),
        "http_url": (31, T.TYPE_STRING, True), "http_header": (32, T.TYPE_MESSAGE, True),
        "drop_reason_desc": (33, T.TYPE_ENUM, True), "source_ip_xlated": (34, T.TYPE_STRING, True),
        "interface": (35, T.TYPE_MESSAGE, True), "node_labels": (36, T.TYPE_STRING, True),
        "source_cluster_name": (37, T.TYPE_STRING, True), "destination_cluster_name": (38, T.TYPE_STRING, True),
        "ip_trace_id": (39, T.TYPE_UINT64, True), "encrypted": (40, T.TYPE_BOOL, True),
        "experimental": (999, T.TYPE_MESSAGE, False)},
    "flow.FlowFilter.Experimental": {"cel_expression": (1, T.TYPE_STRING, True)},
    "flow.HTTPHeader": {"key": (1, T.TYPE_STRING, False), "value": (2, T.TYPE_STRING, False)},
    "flow.NetworkInterface": {"index": (1, T.TYPE_UINT32, False), "name": (2, T.TYPE_STRING, False)},
    "observer.GetFlowsRequest": {"number": (1, T.TYPE_UINT64, False), "follow": (3, T.TYPE_BOOL, False),
                                 "blacklist": (5, T.TYPE_MESSAGE, True), "whitelist": (6, T.TYPE_MESSAGE, True),
                                 "since": (7, T.TYPE_MESSAGE, False), "until": (8, T.TYPE_MESSAGE, False),
                                 "first": (9, T.TYPE_BOOL, False)},
    "observer.GetFlowsResponse": {"flow": (1, T.TYPE_MESSAGE, False), "node_name": (1000, T.TYPE_STRING, False),
                                  "time": (1001, T.TYPE_MESSAGE, False)},
    "observer.ServerStatusResponse": {
        "num_flows": (1, T.TYPE_UINT64, False), "max_flows": (2, T.TYPE_UINT64, False),
        "seen_flows": (3, T.TYPE_UINT64, False), "uptime_ns": (4, T.TYPE_UINT64, False),
        "num_connected_nodes": (5, T.TYPE_MESSAGE, False), "num_unavailable_nodes": (6, T.TYPE_MESSAGE, False),
        "unavailable_nodes": (7, T.TYPE_STRING, True), "version": (8, T.TYPE_STRING, False)},
    "observer.GetNodesResponse": {"nodes": (1, T.TYPE_MESSAGE, True)},
    "observer.Node": {"name": (1, T.TYPE_STRING, False), "version": (2, T.TYPE_STRING, False),
                      "address": (3, T.TYPE_STRING, False), "state": (4, T.TYPE_ENUM, False),
                      "tls": (5, T.TYPE_MESSAGE, False), "uptime_ns": (6, T.TYPE_UINT64, False),
                      "num_flows": (7, T.TYPE_UINT64, False), "max_flows": (8, T.TYPE_UINT64, False),
                      "seen_flows": (9, T.TYPE_UINT64, False)},
    "observer.TLS": {"enabled": (1, T.TYPE_BOOL, False), "server_name": (2, T.TYPE_STRING, False)},
    "observer.GetNamespacesResponse": {"namespaces": (1, T.TYPE_MESSAGE, True)},
    "observer.Namespace": {"cluster": (1, T.TYPE_STRING, False), "namespace": (2, T.TYPE_STRING, False)},
    "peer.ChangeNotification": {"name": (1, T.TYPE_STRING, False), "address": (2, T.TYPE_STRING, False),
                                "type": (3, T.TYPE_ENUM, False), "tls": (4, T.TYPE_MESSAGE, False)},
    "peer.TLS": {"server_name": (1, T.TYPE_STRING, False)},
    "grpc.health.v1.HealthCheckRequest": {"service": (1, T.TYPE_STRING, False)},
    "grpc.health.v1.HealthCheckResponse": {"status": (1, T.TYPE_ENUM, False)},
}
ENUMS = {
    "flow.Verdict": {"VERDICT_UNKNOWN": 0, "FORWARDED": 1, "DROPPED": 2},
    "flow.FlowType": {"UNKNOWN_TYPE": 0, "L3_L4": 1, "L7": 2},
    "flow.TrafficDirection": {"TRAFFIC_DIRECTION_UNKNOWN": 0, "INGRESS": 1, "EGRESS": 2},
    "flow.TraceObservationPoint": {"UNKNOWN_POINT": 0, "FROM_ENDPOINT": 5, "TO_ENDPOINT": 101},
    "flow.IPVersion": {"IP_NOT_USED": 0, "IPv4": 1, "IPv6": 2},
    "flow.DropReason": {"DROP_REASON_UNKNOWN": 0, "INVALID_IPV6_EXTENSION_HEADER": 156},
    "relay.NodeState": {"UNKNOWN_NODE_STATE": 0, "NODE_CONNECTED": 1},
    "peer.ChangeNotificationType": {"UNKNOWN": 0, "PEER_ADDED": 1, "PEER_DELETED": 2, "PEER_UPDATED": 3},
    "grpc.health.v1.HealthCheckResponse.ServingStatus": {"UNKNOWN": 0, "SERVING": 1, "NOT_SERVING": 2},
}
METHODS = {"observer.Observer": {"GetFlows": (True,), "GetNodes": (False,), "ServerStatus": (False,),
                                  "GetNamespaces": (False,)},
           "peer.Peer": {"Notify": (True,)}, "grpc.health.v1.Health": {"Check": (False,)}}


def _message(full_name: str) -> object:
    package = full_name.split(".", maxsplit=1)[0]
    module = MODULES["health" if package == "grpc" else package]
    return module.DESCRIPTOR.pool.FindMessageTypeByName(full_name)


@pytest.mark.parametrize("message", list(CONTRACT))
def test_fields_have_hubbles_numbers_and_types(message: str) -> None:
    descriptor = _message(message)
    for name, (number, kind, repeated) in CONTRACT[message].items():
        field = descriptor.fields_by_name[name]  # type: ignore[attr-defined]
        assert (field.number, field.type, field.is_repeated) == (number, kind, repeated), f"{message}.{name}"


def test_enums_and_services_have_hubbles_values_and_names() -> None:
    pool = flow_pb2.DESCRIPTOR.pool
    for enum, values in ENUMS.items():
        descriptor = pool.FindEnumTypeByName(enum)
        for name, number in values.items():
            assert descriptor.values_by_name[name].number == number, f"{enum}.{name}"
    for service, methods in METHODS.items():
        descriptor = pool.FindServiceByName(service)
        for name, (streaming,) in methods.items():
            method = descriptor.methods_by_name[name]
            assert method.server_streaming == streaming and not method.client_streaming


def test_a_request_encoded_from_the_published_numbers_decodes_as_meant() -> None:
    """What `hubble observe --last 20 --follow --namespace shop --protocol tcp` sends, byte by byte."""
    def text(field: int, value: bytes) -> bytes:
        return bytes([field << 3 | 2, len(value)]) + value

    source = text(2, b"shop/") + text(12, b"tcp")  # FlowFilter.source_pod, .protocol
    destination = text(4, b"shop/") + text(12, b"tcp")  # FlowFilter.destination_pod, .protocol
    raw = (bytes([1 << 3, 20, 3 << 3, 1])  # number = 20, follow = true
           + text(6, source) + text(6, destination)  # whitelist
           + text(10, b"\n\x04time"))  # field_mask (10), which podmeter ignores: an unknown field
    request = observer_pb2.GetFlowsRequest.FromString(raw)
    assert (request.number, request.follow, request.first) == (20, True, False)
    assert [list(f.source_pod) for f in request.whitelist] == [["shop/"], []]
    assert [list(f.destination_pod) for f in request.whitelist] == [[], ["shop/"]]
    assert [list(f.protocol) for f in request.whitelist] == [["tcp"], ["tcp"]]


def test_the_newer_filter_fields_decode_from_their_published_numbers() -> None:
    """`hubble observe --from-cluster default --drop-reason-desc INVALID_IPV6_EXTENSION_HEADER --snat-ip
    10.0.0.1 --interface eth0 --cel-expression true`, as a current hubble encodes it (repeated enums packed)."""
    def text(field: int, value: bytes) -> bytes:
        tag = field << 3 | 2
        head = bytes([tag]) if tag < 0x80 else bytes([tag & 0x7F | 0x80, tag >> 7])
        return head + bytes([len(value)]) + value

    raw = (text(37, b"default") + text(33, bytes([0x9C, 0x01]))  # 156, packed
           + text(34, b"10.0.0.1") + text(35, text(2, b"eth0")) + text(999, text(1, b"true")))
    f = flow_pb2.FlowFilter.FromString(raw)
    assert list(f.source_cluster_name) == ["default"] and list(f.drop_reason_desc) == [156]
    assert list(f.source_ip_xlated) == ["10.0.0.1"] and [i.name for i in f.interface] == ["eth0"]
    assert list(f.experimental.cel_expression) == ["true"]


def test_a_response_puts_node_name_and_time_at_1000_and_1001() -> None:
    raw = observer_pb2.GetFlowsResponse(node_name="n").SerializeToString()
    assert raw == bytes([0xC2, 0x3E, 1]) + b"n"  # (1000 << 3 | 2) as a varint, length 1


def _all_messages(messages: Iterable[descriptor_pb2.DescriptorProto]) -> Iterator[descriptor_pb2.DescriptorProto]:
    for message in messages:
        yield message
        yield from _all_messages(message.nested_type)


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools (the dev extra)")
def test_the_committed_stubs_are_what_make_proto_makes_from_the_proto_files(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "src"), f"--descriptor_set_out={out}",
                    *(str(p.relative_to(ROOT / "src")) for p in sorted(PROTO.glob("*.proto")))],
                   check=True, cwd=ROOT / "src", capture_output=True)
    made = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file}
    for file in made.values():  # the generated modules embed their descriptors without JSON names
        for message in _all_messages(file.message_type):
            for field in message.field:
                field.ClearField("json_name")
    assert set(made) == {f"podmeter/adapters/hubble/proto/{name}.proto" for name in MODULES}
    for name, module in MODULES.items():
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert committed == made[f"podmeter/adapters/hubble/proto/{name}.proto"], f"{name}_pb2.py: run make proto"
    for name in ("observer", "peer", "health"):
        assert (PROTO / f"{name}_pb2_grpc.py").is_file() and (PROTO / f"{name}_pb2_grpc.pyi").is_file()
