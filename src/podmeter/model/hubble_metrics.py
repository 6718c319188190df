"""Hubble's metrics, as Cilium names and labels them, kept from podmeter's flow records.

Each drain's records (forwarded and dropped) are added up into the families the ``--hubble-metrics`` value
names (``model.hubble_metrics_config``): ``hubble_flows_processed_total``, ``hubble_drop_total``,
``hubble_tcp_flags_total``, ``hubble_port_distribution_total``, ``hubble_icmp_total``,
``hubble_flows_to_world_total`` and the three ``hubble_dns_*`` families, with Hubble's label names and
values, plus each metric's context labels. How a podmeter record stands for Hubble's flow events:

* Hubble counts one flow event per packet its datapath traced; a podmeter record is one flow's packets over
  a drain interval, so a record counts ``packets`` in every family but ``hubble_tcp_flags_total``, where
  each flag the record's packets carried counts once (podmeter keeps the OR of the flags, not a count per
  flag; SYN, SYN-ACK, FIN and RST are nearly always one packet per connection and direction). Per packet,
  a figure does not depend on ``--flow-interval``.
* Like Hubble, a packet is counted at every point it was seen: leaving a pod of the node and entering one.
* podmeter tracks no connections, so no record is known to be a reply: where Hubble leaves replies out
  (the port distribution, flows to the world) and where it tells SYN from SYN-ACK, :func:`replies` judges
  by the record's partner in the same drain (the reverse flow whose first packet came first is the
  request), else by its ports (a reply comes from the lower port).
* Drop codes are the kernel's reason as Cilium's code where one has its meaning (``model.drop_codes``),
  else the kernel's name (``NETFILTER_DROP`` is ``POLICY_DENIED``; ``NOT_SPECIFIED`` stays itself).

Bounded: at most ``limit`` series in all; past it, a new series' counts go to its family's overflow series
(every label ``_other_``), and ``folded`` counts them. A series whose labels name a pod (contexts ``pod``,
``pod-name``, ``ip``; labels ``*_pod``, ``*_ip``) ends when that pod is gone and is dropped ``grace``
seconds later (:meth:`HubbleMetrics.expire`, as a pod's own series); any series idle for ``idle`` seconds
is dropped too (it starts again from zero if its traffic comes back: a counter reset, which ``rate``
handles).

DNS: the ``hubble_dns_*`` families count the DNS drain's aggregates (:func:`dns_events` of the records the
drain publishes: :meth:`HubbleMetrics.add_dns`), each its message count; a query is egress of its pod
(its ``source`` the pod), a response ingress (its ``destination`` the pod), so the per-direction contexts
apply as to flows. podmeter reads no answer records: ``ips_returned`` is empty for responses and
``hubble_dns_response_types_total`` has no samples (docs/metrics.md).

Pure and synchronous: the agent's writer task adds; ``adapters.metrics.hubble_metrics`` renders at scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from podmeter.model.compaction import PeakTracker
from podmeter.model.dns import qtype_name
from podmeter.model.drop_codes import cilium_code
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICT_DROPPED, FlowEnd, FlowRecord
from podmeter.model.flow_series import OTHER
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP, Observation
from podmeter.model.hubble_metrics_config import HubbleMetricsConfig, MetricSpec

# A pod's labels, flat (k1, v1, k2, v2, ...) sorted by key; () when they are not known.
LabelSource = Callable[[Endpoint], tuple[str, ...]]
PodKey = tuple[str, str]  # namespace, name

FLOWS, DROPS, TCP_FLAGS = "hubble_flows_processed_total", "hubble_drop_total", "hubble_tcp_flags_total"
PORTS, ICMPS, TO_WORLD = "hubble_port_distribution_total", "hubble_icmp_total", "hubble_flows_to_world_total"
DNS_QUERIES, DNS_RESPONSES, DNS_TYPES = ("hubble_dns_queries_total", "hubble_dns_responses_total",
                                         "hubble_dns_response_types_total")


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    labels: tuple[str, ...]


def families(spec: MetricSpec) -> tuple[Family, ...]:
    """The families one metric of the config exports, their label names in Cilium's order."""
    ctx = spec.context_label_names
    if spec.name == "flow":
        return (Family(FLOWS, "Total number of flows processed", ("protocol", "type", "subtype", "verdict", *ctx)),)
    if spec.name == "drop":
        return (Family(DROPS, "Number of drops", (*ctx, "reason", "protocol")),)
    if spec.name == "tcp":
        return (Family(TCP_FLAGS, "TCP flag occurrences", ("flag", "family", *ctx)),)
    if spec.name == "port-distribution":
        return (Family(PORTS, "Numbers of packets distributed by destination port", ("protocol", "port", *ctx)),)
    if spec.name == "icmp":
        return (Family(ICMPS, "Number of ICMP messages", ("family", "type", *ctx)),)
    if spec.name == "flows-to-world":
        port = ("port",) if spec.has("port") else ()
        return (Family(TO_WORLD, "Total number of flows to reserved:world", ("protocol", "verdict", *port, *ctx)),)
    query = ("query",) if spec.has("query") else ()
    return (Family(DNS_QUERIES, "Number of DNS queries observed", (*ctx, "rcode", "qtypes", "ips_returned", *query)),
            Family(DNS_RESPONSES, "Number of DNS responses observed",
                   (*ctx, "rcode", "qtypes", "ips_returned", *query)),
            Family(DNS_TYPES, "Number of DNS response types observed", (*ctx, "type", "qtypes", *query)))


class DnsEvent(Protocol):
    """What the DNS families need of DNS messages podmeter saw: ``count`` messages alike (a query, or a
    response to one), leaving the pod (``egress``: a query) or entering it (``ingress``: a response).
    ``ips`` and ``rrtypes`` are the answer's addresses and record types; None where the answer records
    were not read (podmeter's datapath reads the header and the question only)."""

    @property
    def source(self) -> FlowEnd: ...
    @property
    def destination(self) -> FlowEnd: ...
    @property
    def direction(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def response(self) -> bool: ...
    @property
    def dropped(self) -> bool: ...
    @property
    def query(self) -> str: ...
    @property
    def qtypes(self) -> tuple[str, ...]: ...
    @property
    def rcode(self) -> int: ...
    @property
    def ips(self) -> tuple[str, ...] | None: ...
    @property
    def rrtypes(self) -> tuple[str, ...] | None: ...


@dataclass(frozen=True, slots=True)
class DnsAggregate:
    """A :class:`DnsEvent` from one of the DNS drain's records (``model.flow_records.name_dns``): the
    messages of one aggregate, their answers not read."""

    source: FlowEnd
    destination: FlowEnd
    direction: str
    count: int
    response: bool
    query: str
    qtypes: tuple[str, ...]
    rcode: int
    dropped: bool = False
    ips: tuple[str, ...] | None = None
    rrtypes: tuple[str, ...] | None = None


def dns_events(records: Iterable[FlowRecord]) -> list[DnsAggregate]:
    """The DNS events of a drain's records (those without ``dns`` are not DNS: left out). A query is
    egress of its pod, a response ingress."""
    out = []
    for r in records:
        info = r.dns
        if info is None:
            continue
        response = info.rcode is not None
        out.append(DnsAggregate(r.source, r.destination, "ingress" if response else "egress", info.count,
                                response, info.query, (qtype_name(info.qtype),), info.rcode or 0))
    return out


@dataclass(slots=True)
class Series:
    """One series: its value only grows while it exists. ``pods``: the pods its labels name."""

    value: int
    last: float
    pods: tuple[PodKey, ...] = ()
    ended_at: float | None = None


SeriesKey = tuple[str, tuple[str, ...]]  # family name, label values in the family's order

# --- Hubble's label values ----------------------------------------------------------------------------

PROTOCOLS = {TCP: "TCP", UDP: "UDP", ICMP: "ICMPv4", ICMPV6: "ICMPv6"}
SUB_TYPES = {Observation.TO_POD: "to-endpoint", Observation.FROM_POD: "from-endpoint"}
DIRECTIONS = {Observation.TO_POD: "ingress", Observation.FROM_POD: "egress"}
APP_LABELS = frozenset({"app.kubernetes.io/name", "k8s-app", "app"})
POD_CONTEXTS = frozenset({"pod", "pod-name", "ip"})
WORLD_IDENTITY = "reserved:world"
FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
_ICMP4 = {0: ("EchoReply", {}), 3: ("DestinationUnreachable", {
    0: "Net", 1: "Host", 2: "Protocol", 3: "Port", 4: "FragmentationNeeded", 5: "SourceRoutingFailed",
    6: "NetUnknown", 7: "HostUnknown", 8: "SourceIsolated", 9: "NetAdminProhibited", 10: "HostAdminProhibited",
    11: "NetTOS", 12: "HostTOS", 13: "CommAdminProhibited", 14: "HostPrecedence", 15: "CutoffPrecedence"}),
    4: ("SourceQuench", {}), 5: ("Redirect", {0: "Network", 1: "Host", 2: "TOS+Network", 3: "TOS+Host"}),
    8: ("EchoRequest", {}), 9: ("RouterAdvertisement", {}), 10: ("RouterSolicitation", {}),
    11: ("TimeExceeded", {0: "TTLExceeded", 1: "FragmentReassemblyTimeExceeded"}),
    12: ("ParameterProblem", {0: "PointerIndicatesError", 1: "MissingOption", 2: "BadLength"}),
    13: ("Timestamp", {}), 14: ("TimestampReply", {})}
_ICMP6 = {1: ("DestinationUnreachable", {
    0: "NoRouteToDst", 1: "AdminProhibited", 2: "BeyondScopeOfSrc", 3: "AddressUnreachable", 4: "PortUnreachable",
    5: "SrcAddressFailedPolicy", 6: "RejectRouteToDst"}), 2: ("PacketTooBig", {}),
    3: ("TimeExceeded", {0: "HopLimitExceeded", 1: "FragmentReassemblyTimeExceeded"}),
    4: ("ParameterProblem", {0: "ErroneousHeaderField", 1: "UnrecognizedNextHeader", 2: "UnrecognizedIPv6Option"}),
    128: ("EchoRequest", {}), 129: ("EchoReply", {}), 133: ("RouterSolicitation", {}),
    134: ("RouterAdvertisement", {}), 135: ("NeighborSolicitation", {}), 136: ("NeighborAdvertisement", {}),
    137: ("Redirect", {})}


def icmp_type(protocol: int, kind: int, code: int) -> str:
    """An ICMP type and code as Hubble's label writes them: ``EchoRequest``, ``DestinationUnreachable(Port)``,
    ``TYPE(CODE)`` for a type it has no name for."""
    found = (_ICMP4 if protocol == ICMP else _ICMP6).get(kind)
    if found is None:
        return f"{kind}({code})"
    name, codes = found
    if not codes and code == 0:
        return name
    return f"{name}({codes.get(code, str(code))})"


def protocol(record: FlowRecord) -> str:
    return PROTOCOLS.get(record.protocol, "Unknown L4")


def ip_family(ip: str) -> str:
    return "IPv6" if ":" in ip else "IPv4"


def drop_reason(record: FlowRecord) -> str:
    """``hubble_drop_total{reason}``: Cilium's code name, else the kernel's reason name."""
    code = cilium_code(record.drop_reason)
    if code is not None:
        return code.name
    return record.drop_reason or "DROP_REASON_UNKNOWN"


def app_of(labels: tuple[str, ...]) -> str:
    """The pod's app as Hubble's ``app`` context reads it: the first of ``app.kubernetes.io/name``,
    ``k8s-app`` and ``app`` in the order of the pod's (sorted) labels, with a value."""
    for key, value in zip(labels[::2], labels[1::2], strict=True):
        if key in APP_LABELS and value:
            return value
    return ""


FlowTuple = tuple[str, str, int, int, int]


def _tuple(record: FlowRecord) -> FlowTuple:
    return record.source.ip, record.destination.ip, record.source.port, record.destination.port, record.protocol


def replies(records: list[FlowRecord]) -> list[bool]:
    """Whether each record is likely a reply (podmeter tracks no connections; see the module docstring):
    TCP with SYN and no ACK never is; a record whose reverse flow is in the batch is one if that flow's
    first packet came first; otherwise one from the lower port to a higher one is."""
    first: dict[FlowTuple, float] = {}
    for r in records:
        key = _tuple(r)
        first[key] = min(first.get(key, r.first), r.first)
    out = []
    for r in records:
        if r.protocol == TCP and r.tcp_flags & (SYN | ACK) == SYN:
            out.append(False)
            continue
        reverse = first.get((r.destination.ip, r.source.ip, r.destination.port, r.source.port, r.protocol))
        if reverse is not None and reverse != r.first:
            out.append(reverse < r.first)
        else:
            out.append(r.source.port < r.destination.port)
    return out


# --- the series -----------------------------------------------------------------------------------------


class HubbleMetrics:
    """The series of the metrics of ``config``.

    Invariants: a series' value only grows while it exists; ``len(series) <= limit`` plus one overflow
    series per family; every series' label values match its family's label names one to one; a series
    that names a pod no longer known is gone ``grace`` seconds after :meth:`expire` first saw it so, one
    idle for ``idle`` seconds at the next :meth:`expire`.
    """

    def __init__(self, config: HubbleMetricsConfig, limit: int, idle: float, grace: float,
                 labels: LabelSource | None = None) -> None:
        if limit < 1:
            raise ValueError("the Hubble metrics' series limit is at least 1")
        self.config, self.limit, self.idle, self.grace = config, limit, idle, grace
        self.labels: LabelSource = labels or (lambda endpoint: ())
        self.families = tuple(f for spec in config.metrics for f in families(spec))
        self.series: dict[SeriesKey, Series] = {}
        self.folded = 0  # additions that went to an overflow series
        self.unrecorded = 0  # flows of a drain with no record (beyond the ring): not counted
        self._overflows: set[SeriesKey] = set()  # overflow series in ``series`` (not counted against the limit)
        self._peak = PeakTracker()
        self._pod_ends = {spec.name: _pod_ends(spec) for spec in config.metrics}
        self.names_pods = any(any(ends) for ends in self._pod_ends.values())

    def add(self, records: list[FlowRecord], now: float, unrecorded: int = 0) -> None:
        """One drain's records (forwarded or dropped); ``unrecorded``: its flows that have none."""
        self.unrecorded += unrecorded
        if not records:
            return
        reply = replies(records)
        handlers = {"flow": self._flow, "drop": self._drop, "tcp": self._tcp, "icmp": self._icmp,
                    "port-distribution": self._port_distribution, "flows-to-world": self._flows_to_world}
        for spec in self.config.metrics:
            add = handlers.get(spec.name)
            if add is not None:
                for record, is_reply in zip(records, reply, strict=True):
                    add(spec, record, is_reply, now)

    def add_dns(self, events: Iterable[DnsEvent], now: float) -> None:
        """DNS messages, as Cilium counts its DNS proxy's: a query (or a query dropped) in the queries, a
        response in the responses and once per record type of its answer in the response types (none
        where the answer was not read). ``ips_returned`` is the answer's address count: ``0`` for a
        query, as Cilium writes it, and empty for a response whose answer was not read."""
        spec = self.config.get("dns")
        if spec is None:
            return
        for event in events:
            if spec.has("ignoreAAAA") and event.qtypes == ("AAAA",):
                continue
            ctx, pods = self._context(spec, event.source, event.destination, event.direction)
            query = (event.query,) if spec.has("query") else ()
            qtypes = ",".join(event.qtypes)
            if event.dropped or not event.response:
                rcode = "Policy denied" if event.dropped else ""
                self._count(DNS_QUERIES, (*ctx, rcode, qtypes, "0", *query), event.count, now, pods)
                continue
            ips = "" if event.ips is None else str(len(event.ips))
            self._count(DNS_RESPONSES, (*ctx, RCODES.get(event.rcode, str(event.rcode)), qtypes, ips, *query),
                        event.count, now, pods)
            for rrtype in event.rrtypes or ():
                self._count(DNS_TYPES, (*ctx, rrtype, qtypes, *query), event.count, now, pods)

    def expire(self, now: float, known_pods: Callable[[], Collection[PodKey]]) -> int:
        """End the series of pods no longer known, drop those whose grace is over and the idle ones;
        returns how many went. ``known_pods`` is asked only when some series names a pod."""
        known = known_pods() if self.names_pods and any(s.pods for s in self.series.values()) else ()
        done = []
        for key, series in self.series.items():
            if series.pods:
                if all(pod in known for pod in series.pods):
                    series.ended_at = None
                elif series.ended_at is None:
                    series.ended_at = now
            if finished(series.last, series.ended_at, now, self.idle, self.grace):
                done.append(key)
        for key in done:
            del self.series[key]
            self._overflows.discard(key)
        if done and self._peak.should_rebuild(len(self.series)):
            self.series = dict(self.series)
        return len(done)

    def values(self) -> Iterator[tuple[SeriesKey, int]]:
        for key, series in self.series.items():
            yield key, series.value

    # --- one record in one metric ---------------------------------------------------------------------

    def _flow(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
        dropped = r.verdict == VERDICT_DROPPED
        labels = (protocol(r), "Drop" if dropped else "Trace", "" if dropped else SUB_TYPES[r.observation],
                  "DROPPED" if dropped else "FORWARDED")
        self._count(FLOWS, (*labels, *ctx), r.packets, now, pods)

    def _drop(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        if r.verdict == VERDICT_DROPPED:
            ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
            self._count(DROPS, (*ctx, drop_reason(r), protocol(r)), r.packets, now, pods)

    def _tcp(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        if r.verdict == VERDICT_DROPPED or r.protocol != TCP or not r.tcp_flags & (FIN | SYN | RST):
            return
        ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
        family = ip_family(r.source.ip)
        flags = r.tcp_flags
        for flag in (("FIN",) if flags & FIN else ()) + (("SYN-ACK" if is_reply else "SYN",) if flags & SYN else ()) \
                + (("RST",) if flags & RST else ()):
            self._count(TCP_FLAGS, (flag, family, *ctx), 1, now, pods)

    def _port_distribution(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        if r.verdict == VERDICT_DROPPED or is_reply or r.protocol not in PROTOCOLS:
            return
        ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
        port = "0" if r.protocol in (ICMP, ICMPV6) else str(r.destination.port)
        self._count(PORTS, (protocol(r), port, *ctx), r.packets, now, pods)

    def _icmp(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        if r.protocol in (ICMP, ICMPV6):
            ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
            family = "IPv4" if r.protocol == ICMP else "IPv6"
            kind = icmp_type(r.protocol, r.source.port, r.destination.port)
            self._count(ICMPS, (family, kind, *ctx), r.packets, now, pods)

    def _flows_to_world(self, spec: MetricSpec, r: FlowRecord, is_reply: bool, now: float) -> None:
        if r.destination.endpoint is not None or r.protocol not in PROTOCOLS:
            return
        dropped = r.verdict == VERDICT_DROPPED
        if dropped and not spec.has("any-drop") and drop_reason(r) != "POLICY_DENIED":
            return
        if not dropped and is_reply:
            return
        if spec.has("syn-only") and (r.protocol != TCP or not r.tcp_flags & SYN or is_reply):
            return
        ctx, pods = self._context(spec, r.source, r.destination, DIRECTIONS[r.observation])
        port = () if not spec.has("port") else (
            (str(r.destination.port),) if r.protocol in (TCP, UDP) else ("",))
        count = 1 if spec.has("syn-only") else r.packets
        self._count(TO_WORLD, (protocol(r), "DROPPED" if dropped else "FORWARDED", *port, *ctx), count, now, pods)

    # --- labels and counting ----------------------------------------------------------------------------

    def _context(self, spec: MetricSpec, source: FlowEnd, destination: FlowEnd,
                 direction: str) -> tuple[tuple[str, ...], tuple[PodKey, ...]]:
        """The context label values of one flow or DNS message (labelsContext's, then source, destination)
        and the pods they name. ``direction`` (``egress``, ``ingress``) picks the per-direction contexts."""
        values = [self._label(label, source, destination, direction) for label in spec.labels]
        source_context, destination_context = spec.source_context(direction), spec.destination_context(direction)
        if spec.has_source:
            values.append(self._end_context(source_context, source))
        if spec.has_destination:
            values.append(self._end_context(destination_context, destination))
        source_pod, destination_pod = self._pod_ends[spec.name]
        if spec.is_per_direction:  # the contexts of this direction only: a series leaves with the pods it names
            source_pod = _names_pod(spec, "source", source_context)
            destination_pod = _names_pod(spec, "destination", destination_context)
        pods = tuple(_pod_key(e) for e, named in ((source, source_pod), (destination, destination_pod))
                     if named and e.endpoint is not None)
        return tuple(values), pods

    def _end_context(self, identifiers: tuple[str, ...], end: FlowEnd) -> str:
        for identifier in identifiers:
            value = self._identifier(identifier, end)
            if value:
                return value
        return ""

    def _identifier(self, identifier: str, end: FlowEnd) -> str:
        e = end.endpoint
        if identifier == "ip":
            return end.ip
        if identifier == "reserved-identity":
            return WORLD_IDENTITY if e is None else ""
        if e is None or identifier == "dns":  # dns: the names of an address (none known yet)
            return ""
        if identifier == "namespace":
            return e.namespace
        if identifier == "pod":
            return f"{e.namespace}/{e.pod}"
        if identifier == "pod-name":
            return e.pod
        if identifier == "workload-name":
            return e.workload
        return app_of(self.labels(e))  # app

    def _label(self, label: str, source: FlowEnd, destination: FlowEnd, direction: str) -> str:
        if label == "traffic_direction":
            return direction
        side, _, what = label.partition("_")
        end = source if side == "source" else destination
        e = end.endpoint
        if what == "ip":
            return end.ip
        if e is None:
            return ""
        if what == "pod":
            return e.pod
        if what == "namespace":
            return e.namespace
        if what == "workload":
            return e.workload
        return app_of(self.labels(e))  # app

    def _count(self, family: str, values: tuple[str, ...], amount: int, now: float, pods: tuple[PodKey, ...]) -> None:
        key = (family, values)
        series = self.series.get(key)
        if series is None:
            if len(self.series) - len(self._overflows) >= self.limit:
                self.folded += 1
                key, pods = (family, (OTHER,) * len(values)), ()
                self._overflows.add(key)
                series = self.series.get(key)
            if series is None:
                series = self.series[key] = Series(0, now, pods)
                self._peak.grew_to(len(self.series))
        series.value += amount
        series.last = now


def finished(last: float, ended_at: float | None, now: float, idle: float, grace: float) -> bool:
    """Whether a series last counted at ``last`` and ended at ``ended_at`` (None: not ended) goes now."""
    return now - last >= idle or (ended_at is not None and now - ended_at >= grace)


def _pod_key(end: FlowEnd) -> PodKey:
    e = end.endpoint
    assert e is not None
    return e.namespace, e.pod


def _pod_ends(spec: MetricSpec) -> tuple[bool, bool]:
    """Whether the source's and the destination's label values may name a pod (so leave with it)."""
    return (_names_pod(spec, "source", spec.all_contexts("source")),
            _names_pod(spec, "destination", spec.all_contexts("destination")))


def _names_pod(spec: MetricSpec, side: str, contexts: tuple[str, ...]) -> bool:
    return bool(POD_CONTEXTS.intersection(contexts)) or any(
        label in spec.labels for label in (f"{side}_pod", f"{side}_ip"))


RCODES = {0: "No Error", 1: "Format Error", 2: "Server Failure", 3: "Non-Existent Domain", 4: "Not Implemented",
          5: "Query Refused", 6: "Name Exists when it should not", 7: "RR Set Exists when it should not",
          8: "RR Set that should exist does not", 9: "Not Authorized", 10: "Name not contained in zone",
          11: "DSO-TYPE Not Implemented", 16: "Bad OPT Version", 17: "Key not recognized",
          18: "Signature out of time window", 19: "Bad TKEY Mode", 20: "Duplicate key name",
          21: "Algorithm not supported", 22: "Bad Truncation", 23: "Bad/missing Server Cookie"}
