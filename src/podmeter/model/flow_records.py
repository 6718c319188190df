"""Flow records: drained kernel entries with both ends named, kept in a bounded ring, filtered for readers.

:func:`name_flows` turns the entries of one drain into :class:`FlowRecord`\\ s with the address book of the
moment their packets were counted (``model.endpoints``); of a drain larger than the ring only the newest
become records (:func:`newest`: nobody could read the others). A :class:`FlowRing` keeps the most recent
records for ``podmeter observe`` (bounded: the oldest fall out, and how many did is counted), each with a
sequence number so that a follower can ask for "everything after the last one I saw". A
:class:`FlowFilter` says which records a reader wants.

Next stage: ``model.flow_series`` adds the records up into per-workload-pair metrics; the agent streams
them to readers (``adapters.flow_http``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

import msgspec

from podmeter.model import dns
from podmeter.model.endpoints import Endpoint, Names
from podmeter.model.flows import (
    ICMP,
    ICMPV6,
    TCP,
    FlowEntry,
    Observation,
    protocol_name,
    tcp_flag_names,
)
from podmeter.model.services import Resolved, ServiceEnds, ServiceName

VERDICT_FORWARDED = "forwarded"
VERDICT_DROPPED = "dropped"  # the kernel dropped the packets (model.drops)
VERDICTS = (VERDICT_FORWARDED, VERDICT_DROPPED)
_PORTLESS = frozenset({ICMP, ICMPV6})


class FlowEnd(msgspec.Struct, frozen=True, gc=False):
    """One end of a flow: its address and port as on the wire, the pod it was (None: no pod known), and
    the Service whose frontend the address is (``model.services``: then ``endpoint`` is the backend pod
    that served the connection, None while the node's conntrack does not know it). Neither: ``world``."""

    ip: str
    port: int
    endpoint: Endpoint | None = None
    service: ServiceName | None = None

    @property
    def world(self) -> bool:
        return self.endpoint is None and self.service is None


class DnsInfo(msgspec.Struct, frozen=True, gc=False):
    """What a DNS record (``podmeter observe --protocol dns``) says beside the flow fields: one aggregate
    of a drain (``model.dns``), its name as asked (lowercased, final dot), its query type and response code
    (None for queries) as numbers, its message count and the latencies of its responses."""

    direction: dns.Direction
    query: str
    qtype: int
    rcode: int | None
    count: int
    latency_count: int = 0
    latency_sum_ns: int = 0
    buckets: tuple[int, ...] = (0,) * dns.BUCKETS

    def to_json(self) -> dict[str, Any]:
        return {"direction": self.direction.value, "query": self.query, "qtype": dns.qtype_name(self.qtype),
                "rcode": None if self.rcode is None else dns.rcode_name(self.rcode), "count": self.count,
                "latency_ms": dns.latency_ms(dns.DnsCounts(self.count, self.latency_count, self.latency_sum_ns,
                                                           self.buckets))}


class FlowRecord(msgspec.Struct, frozen=True, gc=False):
    """One drained flow entry, named. ``time`` and ``first`` are wall-clock seconds of the last and first
    packet; for ICMP, ``source.port`` is the type and ``destination.port`` the code."""

    time: float
    first: float
    node: str
    source: FlowEnd
    destination: FlowEnd
    protocol: int
    observation: Observation
    packets: int
    bytes: int
    tcp_flags: int
    verdict: str = VERDICT_FORWARDED
    drop_reason: str | None = None  # dropped: the reason as the kernel names it (NETFILTER_DROP)
    tcp_retransmits: int = 0  # TCP: segments of this connection its socket retransmitted (model.drops)
    dns: DnsInfo | None = None  # a DNS aggregate (model.dns), not a flow: only in the agent's DNS feed

    def to_json(self) -> dict[str, Any]:
        """The record as ``podmeter observe -o json`` prints it (a contract: see docs/flows.md)."""
        portless = self.protocol in _PORTLESS
        out: dict[str, Any] = {
            "time": self.time,
            "first": self.first,
            "node": self.node,
            "source": _end_json(self.source, portless),
            "destination": _end_json(self.destination, portless),
            "protocol": protocol_name(self.protocol),
            "observation": self.observation.value,
            "packets": self.packets,
            "bytes": self.bytes,
            "tcp_flags": tcp_flag_names(self.tcp_flags),
            "verdict": self.verdict,
            "drop_reason": self.drop_reason,
        }
        if self.protocol == TCP:
            out["tcp_retransmits"] = self.tcp_retransmits
        if portless:
            out["icmp"] = {"type": self.source.port, "code": self.destination.port}
        if self.dns is not None:
            out["dns"] = self.dns.to_json()
        return out


class _JsonService(msgspec.Struct, gc=False):
    namespace: str
    name: str


class _JsonEnd(msgspec.Struct, gc=False):
    """One end as :meth:`FlowRecord.to_json` writes it (the same keys in the same order)."""

    ip: str
    port: int | None
    service: _JsonService | None
    namespace: str | None
    pod: str | None
    workload: str | None
    workload_kind: str | None
    node: str | None
    identity: int | None
    world: bool


class _JsonIcmp(msgspec.Struct, gc=False):
    type: int
    code: int


class _JsonRecord(msgspec.Struct, gc=False):
    """A record as :meth:`FlowRecord.to_json` writes it; the fields it leaves out are ``UNSET`` here."""

    time: float
    first: float
    node: str
    source: _JsonEnd
    destination: _JsonEnd
    protocol: str
    observation: str
    packets: int
    bytes: int
    tcp_flags: list[str]
    verdict: str
    drop_reason: str | None
    tcp_retransmits: int | msgspec.UnsetType = msgspec.UNSET
    icmp: _JsonIcmp | msgspec.UnsetType = msgspec.UNSET
    dns: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


_FLAG_LISTS = [tcp_flag_names(bits) for bits in range(256)]
_encode_json = msgspec.json.Encoder().encode


def encode_json(record: FlowRecord) -> bytes:
    """``msgspec.json.encode(record.to_json())``, made from structs rather than dicts (about half the time:
    the NDJSON line every ``/debug/flows`` reader is sent). A test holds the two to the same bytes."""
    protocol = record.protocol
    portless = protocol in _PORTLESS
    return _encode_json(_JsonRecord(
        record.time, record.first, record.node, _json_end(record.source, portless),
        _json_end(record.destination, portless), protocol_name(protocol), record.observation.value,
        record.packets, record.bytes, _FLAG_LISTS[record.tcp_flags & 0xFF] if record.tcp_flags < 256 else
        tcp_flag_names(record.tcp_flags), record.verdict, record.drop_reason,
        record.tcp_retransmits if protocol == TCP else msgspec.UNSET,
        _JsonIcmp(record.source.port, record.destination.port) if portless else msgspec.UNSET,
        msgspec.UNSET if record.dns is None else record.dns.to_json()))


def _json_end(end: FlowEnd, portless: bool) -> _JsonEnd:
    e, s = end.endpoint, end.service
    port = None if portless else end.port
    service = None if s is None else _JsonService(s.namespace, s.name)
    if e is None:
        return _JsonEnd(end.ip, port, service, None, None, None, None, None, None, s is None)
    return _JsonEnd(end.ip, port, service, e.namespace, e.pod, e.workload, e.workload_kind, e.node, e.identity,
                    False)


def _end_json(end: FlowEnd, portless: bool) -> dict[str, Any]:
    e, s = end.endpoint, end.service
    return {
        "ip": end.ip,
        "port": None if portless else end.port,
        "service": None if s is None else {"namespace": s.namespace, "name": s.name},
        "namespace": e.namespace if e else None,
        "pod": e.pod if e else None,
        "workload": e.workload if e else None,
        "workload_kind": e.workload_kind if e else None,
        "node": e.node if e else None,
        "identity": e.identity if e else None,
        "world": end.world,
    }


class EndpointCache(dict[str, "Endpoint | None"]):
    """IP -> its endpoint, looked up in ``names`` on first use (one drain's cache: a hit is a C-level
    dict lookup, where a Python-level function per end cost a third of the naming). It is a
    :class:`Names` itself, so that one drain's naming and series share it."""

    __slots__ = ("_is_local", "_lookup")

    def __init__(self, names: Names) -> None:
        super().__init__()
        self._lookup, self._is_local = names.endpoint, names.is_local

    def __missing__(self, ip: str) -> Endpoint | None:
        found = self[ip] = self._lookup(ip)
        return found

    def endpoint(self, ip: str) -> Endpoint | None:
        return self[ip]

    def is_local(self, ip: str) -> bool:
        return self._is_local(ip)


_BY_TIME = attrgetter("time")


def name_flows(entries: Iterable[FlowEntry], names: Names, node: str, wall_offset: float,
               services: ServiceEnds | None = None) -> list[FlowRecord]:
    """Name both ends of each drained entry. ``wall_offset`` turns the kernel's monotonic nanoseconds into
    wall-clock seconds (wall time minus monotonic time, taken at the drain). Endpoints are looked up once
    per address per drain (``names`` may be the drain's :class:`EndpointCache`, then shared). The records
    are sorted by ``time`` (stable: entries with the same last packet time keep the drain's order).

    One comprehension, entries unpacked as tuples, records built with positional arguments: 100,000
    entries right after their drain are named in about 85 ms (``bench.flows``; 100 with attribute access,
    keywords and a lookup function)."""
    ends = names if isinstance(names, EndpointCache) else EndpointCache(names)
    if services is not None and services.touched:
        entries = entries if isinstance(entries, Sequence) else list(entries)
        return _name_with_services(entries, ends, node, wall_offset, services.of(entries))
    record, end = FlowRecord, FlowEnd
    out = [
        record(last_ns / 1e9 + wall_offset, first_ns / 1e9 + wall_offset, node,
               end(source, source_port, ends[source]), end(destination, destination_port, ends[destination]),
               protocol, observation, packets, size, tcp_flags)
        for (source, destination, source_port, destination_port, protocol, observation),
            (packets, size, first_ns, last_ns, tcp_flags) in entries
    ]
    out.sort(key=_BY_TIME)
    return out


def _name_with_services(entries: Sequence[FlowEntry], ends: EndpointCache, node: str, wall_offset: float,
                        services: list[Resolved | None]) -> list[FlowRecord]:
    """:func:`name_flows` when some entry of the drain has an end a Service's: those entries (``services``,
    beside each entry, resolved once for the drain by ``ServiceNaming.resolve``) name it, and a frontend
    by the backend that served the connection; the others are named as without Services."""
    record, end = FlowRecord, FlowEnd
    out = []
    for ((source, destination, source_port, destination_port, protocol, observation),
         (packets, size, first_ns, last_ns, tcp_flags)), found in zip(entries, services, strict=True):
        if found is None:
            source_end, destination_end = end(source, source_port, ends[source]), \
                end(destination, destination_port, ends[destination])
        else:
            source_ip, destination_ip = found.source, found.destination
            source_end = end(source, source_port, ends[source_ip] if source_ip is not None else None,
                             found.source_service)
            destination_end = end(destination, destination_port,
                                  ends[destination_ip] if destination_ip is not None else None,
                                  found.destination_service)
        out.append(record(last_ns / 1e9 + wall_offset, first_ns / 1e9 + wall_offset, node, source_end,
                          destination_end, protocol, observation, packets, size, tcp_flags))
    out.sort(key=_BY_TIME)
    return out


def name_dns(entries: Iterable[dns.DnsEntry], ends: EndpointCache, node: str, now: float) -> list[FlowRecord]:
    """The DNS records of one drain: one per aggregate, stamped with the drain's wall-clock time ``now``
    (the kernel keeps no time per aggregate). A query goes from the pod to the server's port 53, seen
    from-pod; a response the other way, seen to-pod. ``packets`` is the message count; ports of the pod
    and bytes are not aggregated (0)."""
    out = []
    for key, counts in entries:
        pod = FlowEnd(key.pod, 0, ends[key.pod])
        server = FlowEnd(key.server, 53, ends[key.server])
        query = key.direction is dns.Direction.QUERY
        info = DnsInfo(key.direction, key.name, key.qtype, None if query else key.rcode, counts.count,
                       counts.latency_count, counts.latency_sum_ns, counts.buckets)
        out.append(FlowRecord(now, now, node, pod if query else server, server if query else pod, key.protocol,
                              Observation.FROM_POD if query else Observation.TO_POD, counts.count, 0, 0,
                              dns=info))
    return out


def newest(entries: Sequence[FlowEntry], count: int) -> list[FlowEntry]:
    """The ``count`` entries whose last packet came last (all of them if there are no more), in the order
    :func:`name_flows` sorts records: by last packet time, ties in the drain's order. What a drain of more
    entries than the ring holds names as records (the ring would drop the others at once: nobody can read
    them). No Python work per entry but the list of last packet times: their counts (C), the oldest time
    kept, the entries from it on (C), sorted."""
    if len(entries) <= count:
        return list(entries)
    if count <= 0:
        return []
    lasts = [counts[3] for _, counts in entries]
    times = Counter(lasts)
    threshold, need = 0, count  # the oldest time kept
    for threshold in sorted(times, reverse=True):
        if times[threshold] >= need:
            break
        need -= times[threshold]
    kept = sorted(compress(entries, map(threshold.__le__, lasts)), key=_last_ns)  # stable: ties in drain order
    return kept[len(kept) - count:]


def _last_ns(entry: FlowEntry) -> int:
    return entry[1][3]


# --- what a reader wants ----------------------------------------------------------------------------


def _split_pod(text: str) -> tuple[str | None, str]:
    """``ns/name`` -> (ns, name); ``name`` -> (None, name): any namespace."""
    namespace, _, name = text.rpartition("/")
    return (namespace or None, name) if _ else (None, text)


def _end_matches(end: FlowEnd, pod: tuple[str | None, str]) -> bool:
    e = end.endpoint
    namespace, name = pod
    return e is not None and e.pod == name and (namespace is None or e.namespace == namespace)


def _service_matches(end: FlowEnd, service: tuple[str | None, str]) -> bool:
    s = end.service
    namespace, name = service
    return s is not None and s.name == name and (namespace is None or s.namespace == namespace)


def _workload_matches(end: FlowEnd, workload: tuple[str | None, str]) -> bool:
    e = end.endpoint
    namespace, name = workload
    if e is None:
        return name == "world" and namespace is None and end.service is None
    return e.workload == name and (namespace is None or e.namespace == namespace)


@dataclass(frozen=True)
class FlowFilter:
    """Which records a reader wants; every field set must match (AND), and a field names either end
    unless it says ``from``/``to``. Pods and workloads are ``name`` (any namespace) or ``ns/name``;
    ``world`` as a workload matches ends no pod holds. ``protocol`` is a name as records print it
    (case-insensitive: ``tcp``, ``udp``, ``icmpv4``, ``icmpv6``; ``icmp`` means either ICMP; ``dns`` the
    DNS records, whatever their transport)."""

    namespace: str | None = None
    pod: str | None = None
    from_pod: str | None = None
    to_pod: str | None = None
    workload: str | None = None
    service: str | None = None  # either end is this Service's frontend (or its backend, named with it)
    from_service: str | None = None
    to_service: str | None = None
    protocol: str | None = None
    port: int | None = None
    since: float | None = None  # wall-clock seconds: records whose last packet is at or after this
    verdict: str | None = None  # forwarded or dropped

    @property
    def everything(self) -> bool:
        """Whether this filter lets every record through (its readers skip matching)."""
        return self == _EVERYTHING

    def matches(self, record: FlowRecord) -> bool:
        if self.since is not None and record.time < self.since:
            return False
        if self.verdict is not None and record.verdict != self.verdict:
            return False
        if self.protocol is not None and not _protocol_matches(record, self.protocol):
            return False
        if self.port is not None and (record.protocol in _PORTLESS or self.port not in (record.source.port,
                                                                                          record.destination.port)):
            return False
        return self._ends_match(record)

    def _ends_match(self, record: FlowRecord) -> bool:
        ends = (record.source, record.destination)
        if self.namespace is not None and not any(e.endpoint is not None and e.endpoint.namespace == self.namespace
                                                  for e in ends):
            return False
        if self.pod is not None and not any(_end_matches(e, _split_pod(self.pod)) for e in ends):
            return False
        if self.from_pod is not None and not _end_matches(record.source, _split_pod(self.from_pod)):
            return False
        if self.to_pod is not None and not _end_matches(record.destination, _split_pod(self.to_pod)):
            return False
        if self.service is not None and not any(_service_matches(e, _split_pod(self.service)) for e in ends):
            return False
        if self.from_service is not None and not _service_matches(record.source, _split_pod(self.from_service)):
            return False
        if self.to_service is not None and not _service_matches(record.destination, _split_pod(self.to_service)):
            return False
        return self.workload is None or any(_workload_matches(e, _split_pod(self.workload)) for e in ends)


_EVERYTHING = FlowFilter()


def _protocol_matches(record: FlowRecord, wanted: str) -> bool:
    name = protocol_name(record.protocol).lower()
    wanted = wanted.lower()
    if wanted == "dns":  # the DNS records (the agent's DNS feed), whatever their transport
        return record.dns is not None
    return name == wanted or (wanted == "icmp" and record.protocol in _PORTLESS)


# --- the ring of recent records ---------------------------------------------------------------------


class FlowRing:
    """The most recent ``capacity`` records, each with a sequence number (1, 2, ...), in a circular buffer:
    the record numbered ``seq`` is at ``seq % capacity`` while it is in the ring, so a reader is a cursor
    (the last number it read) and finds its next record, or learns how many it missed, in O(1).

    Invariants: ``len(self) <= capacity``; the ring holds the records numbered ``first_seq`` to
    ``last_seq``, consecutive; ``dropped`` counts records that fell out (oldest first) to make room.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the flow buffer holds at least one record")
        self.capacity = capacity
        self._slots: list[FlowRecord | None] = [None] * capacity
        self.last_seq = 0
        self.dropped = 0

    def __len__(self) -> int:
        return min(self.last_seq, self.capacity)

    @property
    def first_seq(self) -> int:
        return self.last_seq - len(self) + 1

    def extend(self, records: Iterable[FlowRecord], passed: int = 0) -> None:
        """Append ``records``, after ``passed`` records that are numbered but fall out at once (a drain of
        more than the ring holds: only its newest are made, and ``records`` fill the ring)."""
        slots, capacity = self._slots, self.capacity
        if passed:
            records = list(records)
            if len(records) < capacity:
                raise ValueError("records passed over must be followed by a ring's worth of records")
            self.dropped += min(self.last_seq, capacity) + passed - min(self.last_seq + passed, capacity)
            self.last_seq += passed
        for record in records:
            if self.last_seq >= capacity:
                self.dropped += 1
            self.last_seq += 1
            slots[self.last_seq % capacity] = record

    def get(self, seq: int) -> FlowRecord | None:
        """The record numbered ``seq``; None once it fell out of the ring (or before it came)."""
        if not self.first_seq <= seq <= self.last_seq:
            return None
        return self._slots[seq % self.capacity]

    def span(self, low: int, high: int) -> list[FlowRecord]:
        """The records numbered ``low`` to ``high`` that the ring holds, oldest first (two list slices)."""
        low, high = max(low, self.first_seq), min(high, self.last_seq)
        if low > high:
            return []
        start, stop = low % self.capacity, high % self.capacity
        slots = self._slots[start:stop + 1] if start <= stop else self._slots[start:] + self._slots[:stop + 1]
        return slots  # type: ignore[return-value]  # every slot in the held range has a record

    def after(self, seq: int) -> Iterator[tuple[int, FlowRecord]]:
        """The records with a sequence number above ``seq`` still in the ring, oldest first."""
        for n in range(max(seq + 1, self.first_seq), self.last_seq + 1):
            record = self._slots[n % self.capacity]
            assert record is not None
            yield n, record

    def last(self, count: int, wanted: FlowFilter | None = None) -> list[FlowRecord]:
        """The last ``count`` records that match ``wanted``, oldest first."""
        found: list[FlowRecord] = []
        for n in range(self.last_seq, self.first_seq - 1, -1):
            if len(found) >= count:
                break
            record = self._slots[n % self.capacity]
            assert record is not None
            if wanted is None or wanted.matches(record):
                found.append(record)
        found.reverse()
        return found
