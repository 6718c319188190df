"""A flow record (``model.flow_records.FlowRecord``) as Hubble's ``flow.Flow`` and ``GetFlowsResponse``.

What a record carries maps onto Hubble's message like this (the compatibility table is in docs/hubble.md):

- ``time``: the last packet of the entry; ``node_name``: the agent's node.
- ``IP``: both addresses and the IP version; ``l4``: TCP (ports and the flags seen), UDP (ports), ICMPv4 or
  ICMPv6 (type and code); other protocols have no ``l4``.
- ``source``/``destination``: a pod is its cluster (``default``), namespace, name, workload (kind and name),
  numeric identity when the record has one, and its labels when the agent still knows the pod
  (``k8s:key=value``, plus ``k8s:io.kubernetes.pod.namespace=NS`` as Cilium labels pods); an address no pod
  holds (podmeter's ``world``) is Cilium's world: identity 2, the one label ``reserved:world``, no cluster.
- ``traffic_direction`` is from the pod's point of view: a packet entering a pod (``to-pod``) is ingress,
  one leaving it (``from-pod``) egress. ``trace_observation_point`` is ``TO_ENDPOINT``/``FROM_ENDPOINT``
  (for dropped records too: the end that was observed).
- ``Type`` is ``L3_L4``, ``verdict`` ``FORWARDED``, or ``DROPPED`` for a record of dropped packets;
  ``is_reply`` unset (podmeter tracks no connections, so it does not know).
- ``event_type``: a forwarded record is a trace event (type 4, sub-type 0 or 5 for to/from the pod), which
  Hubble's printers show as ``to-endpoint``/``from-endpoint``; a dropped one a drop event (type 1), so that
  ``hubble observe --type drop`` selects it. Cilium's drop events carry their drop code as the sub-type and
  in ``drop_reason_desc``. Those codes are Cilium's datapath's, podmeter's reasons the kernel's
  ``skb_drop_reason`` names: ``model.drop_codes`` maps each kernel reason whose meaning is a Cilium code's
  to it (``NETFILTER_DROP`` is ``POLICY_DENIED``, ``NO_SOCKET`` ``SOCKET_LOOKUP_FAILED``, ...: the table is in
  docs/hubble.md), so the compact printer names it ("Policy denied"); any other leaves ``drop_reason_desc``
  unknown and has the sub-type :data:`DROP_SUB_TYPE_UNKNOWN` (255, which Cilium does not use: Hubble's
  printers, naming the sub-type from Cilium's table, would show 0 as "Success"), the kernel's reason in the
  summary.
- ``Summary`` (deprecated in Hubble's API, still the last column of ``hubble observe``'s compact output):
  for TCP ``TCP Flags: SYN, ACK`` as Hubble's agent writes it (names in its order: SYN, ACK, RST, FIN, PSH,
  URG, ECE, CWR), here every flag seen in the entry, ``TCP`` if none; podmeter's own short text otherwise:
  ``UDP``, ``ICMPv4 type 8 code 0``, the protocol's number for others, and for a dropped record the kernel's
  reason name (``NETFILTER_DROP``), which no other Hubble field can carry.

A DNS record (``FlowRecord.dns``: one aggregate of a drain, docs/dns.md) is an L7 flow, as Cilium's DNS proxy
writes one: ``Type`` ``L7``, ``event_type`` type 129 (Cilium's access-log message, what ``hubble observe --type
l7`` selects), ``l7`` = {``type`` ``REQUEST`` for queries, ``RESPONSE`` for answers, ``latency_ns`` the mean
latency of the answers measured, ``dns`` = {the query with its final dot, ``qtypes`` its type's name,
``rcode`` (answers), ``observation_source`` ``podmeter``}}, ``is_reply`` false for queries and true for
answers (the compact printer draws ``pod <- server`` for them), no ``trace_observation_point`` (not a trace
event). Its ``Summary`` is the line Hubble's agent writes for DNS: ``DNS Query NAME TYPE``, ``DNS Answer
RCode: NXDOMAIN (Query NAME TYPE)`` (podmeter reads no answer section, so no addresses or TTL; the code by
its IANA name, also for ``NOERROR``). Nothing says how many messages the aggregate counts
(``podmeter observe --protocol dns -o json`` has it).

Hubble's flow has no packet or byte counts, no retransmit count and no field for the kernel's drop reason
but ``Summary``: the counts are absent from the message (``podmeter observe -o json`` and the metrics have them).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from podmeter.adapters.flow_serving import Encoded
from podmeter.adapters.hubble.proto import flow_pb2, observer_pb2
from podmeter.model import dns
from podmeter.model.drop_codes import CILIUM_CODES
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICT_DROPPED, DnsInfo, FlowEnd, FlowRecord
from podmeter.model.flows import ICMP, ICMPV6, TCP, TCP_FLAG_NAMES, UDP, Observation, protocol_name
from podmeter.model.records import Pod

# A pod's labels as the agent stores them, a flat tuple (k1, v1, k2, v2, ...); () when it does not know them.
LabelSource = Callable[[Endpoint], tuple[str, ...]]

CLUSTER = "default"  # podmeter knows one cluster; Cilium's default name for it (node names, TLS names, namespaces)
WORLD_IDENTITY = 2  # Cilium's reserved identity for addresses outside the cluster
WORLD_LABELS = ("reserved:world",)
NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
MESSAGE_TYPE_TRACE = 4  # Cilium's monitor message type of a trace event
TRACE_TO_ENDPOINT, TRACE_FROM_ENDPOINT = 0, 5  # its sub-types: to and from a pod (an "lxc")
MESSAGE_TYPE_DROP = 1  # Cilium's monitor message type of a drop event; its sub-type is the drop code
MESSAGE_TYPE_ACCESS_LOG = 129  # Cilium's monitor message type of an L7 (proxy access log) event: DNS records
OBSERVATION_SOURCE = "podmeter"  # who read the DNS message (Cilium's proxy says "proxy")
DROP_SUB_TYPE_UNKNOWN = 255  # the sub-type of a drop whose kernel reason has no Cilium code (Cilium's end at 205)
# Kernel drop reasons (skb_drop_reason names, without the SKB_DROP_REASON_ prefix) as the Cilium drop code
# whose meaning is theirs (model.drop_codes: the why of each is there and in docs/hubble.md).
DROP_REASONS: dict[str, flow_pb2.DropReason.ValueType] = {
    reason: flow_pb2.DropReason.Value(code.name) for reason, code in CILIUM_CODES.items()
}

POINTS = {Observation.TO_POD: flow_pb2.TO_ENDPOINT, Observation.FROM_POD: flow_pb2.FROM_ENDPOINT}
DIRECTIONS = {Observation.TO_POD: flow_pb2.INGRESS, Observation.FROM_POD: flow_pb2.EGRESS}
SUB_TYPES = {Observation.TO_POD: TRACE_TO_ENDPOINT, Observation.FROM_POD: TRACE_FROM_ENDPOINT}
VERDICTS = {"forwarded": flow_pb2.FORWARDED, "dropped": flow_pb2.DROPPED}
TCP_FLAG_FIELDS = TCP_FLAG_NAMES  # bit 0 first, as the kernel's byte
# The order in which Hubble's agent lists the flags in a flow's summary (not the bits' order).
SUMMARY_FLAGS = tuple(TCP_FLAG_FIELDS.index(name) for name in ("SYN", "ACK", "RST", "FIN", "PSH", "URG", "ECE", "CWR"))


def no_labels(endpoint: Endpoint) -> tuple[str, ...]:
    return ()


def pod_labels(pods: Mapping[str, Pod], endpoint: Endpoint) -> tuple[str, ...]:
    """The labels of the endpoint's pod in a store keyed by UID (the agent's), () once it is gone."""
    pod = pods.get(endpoint.uid)
    return pod.labels if pod is not None else ()


@functools.lru_cache(maxsize=4096)
def hubble_labels(namespace: str, flat: tuple[str, ...]) -> tuple[str, ...]:
    """A pod's labels as Cilium writes them: ``k8s:key=value``, sorted, with the namespace label."""
    pairs = [f"k8s:{key}={value}" for key, value in zip(flat[::2], flat[1::2], strict=True)]
    pairs.append(f"k8s:{NAMESPACE_LABEL}={namespace}")
    return tuple(sorted(pairs))


def end_labels(end: FlowEnd, labels: LabelSource) -> tuple[str, ...]:
    e = end.endpoint
    if e is None:
        return WORLD_LABELS
    flat = labels(e)
    return hubble_labels(e.namespace, flat) if flat else ()


def end_identity(end: FlowEnd) -> int:
    e = end.endpoint
    if e is None:
        return WORLD_IDENTITY
    return e.identity or 0


def ip_version(ip: str) -> flow_pb2.IPVersion.ValueType:
    return flow_pb2.IPv6 if ":" in ip else flow_pb2.IPv4


def drop_reason(record: FlowRecord) -> flow_pb2.DropReason.ValueType:
    """The Cilium drop code of a dropped record, ``DROP_REASON_UNKNOWN`` when its kernel reason has none (and for
    a forwarded record)."""
    if record.verdict != VERDICT_DROPPED or record.drop_reason is None:
        return flow_pb2.DROP_REASON_UNKNOWN
    return DROP_REASONS.get(record.drop_reason, flow_pb2.DROP_REASON_UNKNOWN)


def event_type(record: FlowRecord) -> tuple[int, int]:
    """The monitor event type and sub-type of the record's flow: a trace at its observation point, or a drop."""
    if record.dns is not None:
        return MESSAGE_TYPE_ACCESS_LOG, 0
    if record.verdict == VERDICT_DROPPED:
        return MESSAGE_TYPE_DROP, drop_reason(record) or DROP_SUB_TYPE_UNKNOWN
    return MESSAGE_TYPE_TRACE, SUB_TYPES[record.observation]


def timestamp(seconds: float) -> Timestamp:
    whole = int(seconds)
    return Timestamp(seconds=whole, nanos=min(999_999_999, max(0, round((seconds - whole) * 1e9))))


def tcp_flags(bits: int) -> flow_pb2.TCPFlags:
    return flow_pb2.TCPFlags(**{name: True for bit, name in enumerate(TCP_FLAG_FIELDS) if bits & (1 << bit)})


def layer4(record: FlowRecord) -> flow_pb2.Layer4 | None:
    sport, dport = record.source.port, record.destination.port
    if record.protocol == TCP:
        return flow_pb2.Layer4(TCP=flow_pb2.TCP(source_port=sport, destination_port=dport,
                                                flags=tcp_flags(record.tcp_flags)))
    if record.protocol == UDP:
        return flow_pb2.Layer4(UDP=flow_pb2.UDP(source_port=sport, destination_port=dport))
    if record.protocol == ICMP:
        return flow_pb2.Layer4(ICMPv4=flow_pb2.ICMPv4(type=sport, code=dport))
    if record.protocol == ICMPV6:
        return flow_pb2.Layer4(ICMPv6=flow_pb2.ICMPv6(type=sport, code=dport))
    return None


def summary(record: FlowRecord) -> str:
    """The flow's one line for Hubble's compact printer (the module docstring says what each shape gets)."""
    if record.dns is not None:
        return dns_summary(record.dns)
    if record.verdict == VERDICT_DROPPED:
        return record.drop_reason or "dropped"
    if record.protocol == TCP:
        flags = [TCP_FLAG_FIELDS[bit] for bit in SUMMARY_FLAGS if record.tcp_flags & (1 << bit)]
        return "TCP Flags: " + ", ".join(flags) if flags else "TCP"
    if record.protocol in (ICMP, ICMPV6):
        return f"{protocol_name(record.protocol)} type {record.source.port} code {record.destination.port}"
    return protocol_name(record.protocol)  # UDP, or the number of a protocol podmeter has no name for


def dns_summary(info: DnsInfo) -> str:
    """The Summary of a DNS record: Hubble's words for a DNS query or answer (the module docstring)."""
    asked = f"{info.query} {dns.qtype_name(info.qtype)}"
    if info.direction is dns.Direction.QUERY:
        return f"DNS Query {asked}"
    return f"DNS Answer RCode: {dns.rcode_name(info.rcode or 0)} (Query {asked})"


def layer7(info: DnsInfo) -> flow_pb2.Layer7:
    """A DNS record's ``l7``: request or response, the mean latency of the answers measured, the question."""
    query = info.direction is dns.Direction.QUERY
    record = flow_pb2.DNS(query=info.query, qtypes=[dns.qtype_name(info.qtype)], observation_source=OBSERVATION_SOURCE,
                          rcode=0 if query else info.rcode or 0)
    latency = info.latency_sum_ns // info.latency_count if info.latency_count else 0
    return flow_pb2.Layer7(type=flow_pb2.REQUEST if query else flow_pb2.RESPONSE, latency_ns=latency, dns=record)


ENCODED = 4096  # recent records kept encoded (at most the ring's: see adapters.flow_serving.Encoded)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a value >= 0 (every field podmeter writes by hand is unsigned or >= 0):
    up to five bytes (a port, the nanoseconds of a time) without a loop."""
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14))
    if value < 0x10000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80, value >> 21))
    if value < 0x800000000:
        return bytes((value & 0x7F | 0x80, value >> 7 & 0x7F | 0x80, value >> 14 & 0x7F | 0x80,
                      value >> 21 & 0x7F | 0x80, value >> 28))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(0x80)]


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    return tag + _varint(len(data)) + data


def _uint(tag: bytes, value: int) -> bytes:
    """A scalar field: nothing for 0 (proto3 writes no default), else its tag and varint."""
    return tag + _varint(value) if value else b""


VARINT, LENGTH = 0, 2
# Flow's fields (flow.proto), in field-number order, and those of its parts.
_TIME, _VERDICT, _IP, _L4 = _tag(1, LENGTH), _tag(2, VARINT), _tag(5, LENGTH), _tag(6, LENGTH)
_SOURCE, _DESTINATION, _NODE = _tag(8, LENGTH), _tag(9, LENGTH), _tag(11, LENGTH)
_TYPE_L3_L4 = _tag(10, VARINT) + _varint(flow_pb2.L3_L4)
_EVENT, _DIRECTION, _POINT, _DROP, _SUMMARY = (_tag(19, LENGTH), _tag(22, VARINT), _tag(24, VARINT), _tag(25, VARINT),
                                              _tag(100000, LENGTH))
_FIELD1, _FIELD2 = _tag(1, VARINT), _tag(2, VARINT)  # Timestamp, ports, type and code, CiliumEventType
_L4_TCP, _L4_UDP, _L4_ICMP = _tag(1, LENGTH), _tag(2, LENGTH), {ICMP: _tag(3, LENGTH), ICMPV6: _tag(4, LENGTH)}
_TCP_FLAGS = _tag(3, LENGTH)
_IP_SOURCE, _IP_DESTINATION = _tag(1, LENGTH), _tag(2, LENGTH)
_IP_V4, _IP_V6 = _tag(3, VARINT) + _varint(flow_pb2.IPv4), _tag(3, VARINT) + _varint(flow_pb2.IPv6)
_FLAG_BITS = [b"".join(_tag(bit + 1, VARINT) + b"\x01" for bit in range(8) if bits & (1 << bit)) for bits in range(256)]
_RESPONSE_FLOW, _RESPONSE_NODE, _RESPONSE_TIME = _tag(1, LENGTH), _tag(1000, LENGTH), _tag(1001, LENGTH)
FROM_POD = Observation.FROM_POD
_POINT_FIELDS = {o: _DIRECTION + _varint(DIRECTIONS[o]) + _POINT + _varint(POINTS[o]) for o in Observation}


class FlowMessages:
    """Turns records into ``GetFlowsResponse`` messages, and into their bytes once for every stream that sends
    them (a record followed by ten clients is encoded once). Both caches are bounded: the endpoint messages
    of recent ends (a pod's end repeats across its flows) are emptied when full, the encoded recent records
    drop their oldest.

    The bytes are written by hand (:meth:`serialized`): the wire format of exactly the message
    :meth:`response` builds, field by field in field-number order, where the parts that repeat across
    records (an end, the event type and summary, the node) are encoded once and kept. About 7 µs a record
    where building the message and serializing it took 27 (2-vCPU VM); a test holds the two to the same
    bytes for every shape of record."""

    CACHE = 4096

    def __init__(self, labels: LabelSource = no_labels, encoded: int = ENCODED) -> None:
        self.labels = labels
        self._endpoints: dict[tuple[Endpoint | None, tuple[str, ...]], flow_pb2.Endpoint] = {}
        self._endpoint_bytes: dict[tuple[Endpoint | None, tuple[str, ...]], tuple[bytes, bytes]] = {}
        self._parts: dict[object, tuple[bytes, ...]] = {}  # verdicts and events, nodes: their fields
        self._encoded = Encoded(self.serialized, encoded)
        self._second: tuple[int, bytes] = (0, b"")

    def endpoint(self, end: FlowEnd) -> flow_pb2.Endpoint:
        labels = end_labels(end, self.labels)
        key = (end.endpoint, labels)
        found = self._endpoints.get(key)
        if found is None:
            if len(self._endpoints) >= self.CACHE:
                self._endpoints.clear()
            found = self._endpoints[key] = self._endpoint_message(end, labels)
        return found

    @staticmethod
    def _endpoint_message(end: FlowEnd, labels: tuple[str, ...]) -> flow_pb2.Endpoint:
        e = end.endpoint
        found = flow_pb2.Endpoint(identity=end_identity(end), labels=labels)
        if e is not None:
            found.cluster_name = CLUSTER
            found.namespace = e.namespace
            found.pod_name = e.pod
            found.workloads.add(name=e.workload, kind=e.workload_kind)
        return found

    def flow(self, record: FlowRecord) -> flow_pb2.Flow:
        observation = record.observation
        kind, sub_type = event_type(record)
        flow = flow_pb2.Flow(
            time=timestamp(record.time),
            verdict=VERDICTS.get(record.verdict, flow_pb2.VERDICT_UNKNOWN),
            IP=flow_pb2.IP(source=record.source.ip, destination=record.destination.ip,
                           ipVersion=ip_version(record.source.ip)),
            l4=layer4(record),
            source=self.endpoint(record.source),
            destination=self.endpoint(record.destination),
            Type=flow_pb2.L3_L4,
            node_name=record.node,
            event_type=flow_pb2.CiliumEventType(type=kind, sub_type=sub_type),
            traffic_direction=DIRECTIONS[observation],
            trace_observation_point=POINTS[observation],
            Summary=summary(record),
        )
        if kind == MESSAGE_TYPE_DROP:
            flow.drop_reason_desc = drop_reason(record)
        if record.dns is not None:
            flow.Type = flow_pb2.L7
            flow.l7.CopyFrom(layer7(record.dns))
            flow.is_reply.value = record.dns.direction is dns.Direction.RESPONSE
            flow.ClearField("trace_observation_point")
        for end, field in ((record.source, flow.source_service), (record.destination, flow.destination_service)):
            if end.service is not None:
                field.name, field.namespace = end.service.name, end.service.namespace
        return flow

    def encoded(self, record: FlowRecord) -> bytes:
        """The serialized ``GetFlowsResponse`` of ``record`` (made once: see the class)."""
        return self._encoded(record)

    def response(self, record: FlowRecord) -> observer_pb2.GetFlowsResponse:
        flow = self.flow(record)
        return observer_pb2.GetFlowsResponse(flow=flow, node_name=record.node, time=flow.time)

    def serialized(self, record: FlowRecord) -> bytes:
        """``self.response(record).SerializeToString()``, written by hand (a flow through a Service, whose
        fields sit in the middle of the tail, and a DNS record, an aggregate of which a drain has at most the
        kernel map's 8,192 where it may have a million flows, are serialized by protobuf)."""
        if record.source.service is not None or record.destination.service is not None or record.dns is not None:
            return self.response(record).SerializeToString()
        seconds = record.time
        whole = int(seconds)
        if whole != self._second[0]:  # the records of a drain share few seconds
            self._second = (whole, _uint(_FIELD1, whole))
        stamp = self._second[1] + _uint(_FIELD2, min(999_999_999, max(0, round((seconds - whole) * 1e9))))
        stamp = _SMALL[len(stamp)] + stamp  # at most 11 bytes
        source, destination, protocol = record.source, record.destination, record.protocol
        get = self._parts.get
        src, dst = source.ip.encode(), destination.ip.encode()  # IP: at most 39 characters each
        addresses = b"".join((_IP_SOURCE, _SMALL[len(src)], src, _IP_DESTINATION, _SMALL[len(dst)], dst,
                              _IP_V6 if b":" in src else _IP_V4)) if src and dst else flow_pb2.IP(
            source=source.ip, destination=destination.ip, ipVersion=ip_version(source.ip)).SerializeToString()
        icmp = protocol in _L4_ICMP
        events = (protocol, record.tcp_flags, record.verdict, record.drop_reason, record.observation is FROM_POD,
                  source.port if icmp else 0, destination.port if icmp else 0)
        verdict = get(events)  # the verdict, and the fields from the event type on: they depend on these alone
        if verdict is None:
            verdict = self._part(events, (_uint(_VERDICT, VERDICTS.get(record.verdict, flow_pb2.VERDICT_UNKNOWN)),
                                          self._tail(record)))
        node = get(record.node)
        if node is None:
            name = record.node.encode()
            node = self._part(record.node, (_length_delimited(_NODE, name), _length_delimited(_RESPONSE_NODE, name)))
        ports = (_FIELD1 + _varint(source.port) if source.port else b"") + (
            _FIELD2 + _varint(destination.port) if destination.port else b"")
        if protocol == TCP:
            flags = _FLAG_BITS[record.tcp_flags & 0xFF]
            tcp = b"".join((ports, _TCP_FLAGS, _SMALL[len(flags)], flags))
            l4 = b"".join((_L4, _SMALL[len(tcp) + 2], _L4_TCP, _SMALL[len(tcp)], tcp))
        elif protocol == UDP:
            l4 = b"".join((_L4, _SMALL[len(ports) + 2], _L4_UDP, _SMALL[len(ports)], ports))
        elif icmp:
            l4 = b"".join((_L4, _SMALL[len(ports) + 2], _L4_ICMP[protocol], _SMALL[len(ports)], ports))
        else:
            l4 = b""
        flow = b"".join((_TIME, stamp, verdict[0], _IP, _SMALL[len(addresses)], addresses, l4,
                         self._end_bytes(source)[0], self._end_bytes(destination)[1], _TYPE_L3_L4, node[0],
                         verdict[1]))
        return b"".join((_RESPONSE_FLOW, _varint(len(flow)), flow, node[1], _RESPONSE_TIME, stamp))

    def _part(self, key: object, data: tuple[bytes, ...]) -> tuple[bytes, ...]:
        if len(self._parts) >= self.CACHE:
            self._parts.clear()
        self._parts[key] = data
        return data

    def _tail(self, record: FlowRecord) -> bytes:
        """The fields after the node's name: the event type, the direction and point, the drop reason, the
        summary (what depends on the protocol, flags, verdict and reason, and the observation point)."""
        kind, sub_type = event_type(record)
        event = _uint(_FIELD1, kind) + _uint(_FIELD2, sub_type)
        drop = _uint(_DROP, drop_reason(record)) if kind == MESSAGE_TYPE_DROP else b""
        return b"".join((_length_delimited(_EVENT, event), _POINT_FIELDS[record.observation], drop,
                         _length_delimited(_SUMMARY, summary(record).encode())))

    def _end_bytes(self, end: FlowEnd) -> tuple[bytes, bytes]:
        """The end's ``Endpoint`` as Flow's field ``source``, and as its field ``destination``."""
        labels = end_labels(end, self.labels)
        key = (end.endpoint, labels)
        found = self._endpoint_bytes.get(key)
        if found is None:
            if len(self._endpoint_bytes) >= self.CACHE:
                self._endpoint_bytes.clear()
            data = self._endpoint_message(end, labels).SerializeToString()
            found = (_length_delimited(_SOURCE, data), _length_delimited(_DESTINATION, data))
            self._endpoint_bytes[key] = found
        return found


def lost_message(lost: int, node: str) -> bytes:
    """The serialized ``GetFlowsResponse`` telling a follower that ``lost`` records went by unread: the
    agent's ring overwrote them first (``hubble observe`` prints it as lost events)."""
    now = timestamp(time.time())
    event = flow_pb2.LostEvent(source=flow_pb2.HUBBLE_RING_BUFFER, num_events_lost=lost)
    return observer_pb2.GetFlowsResponse(lost_events=event, node_name=node, time=now).SerializeToString()
