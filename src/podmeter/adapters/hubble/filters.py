"""A ``GetFlows`` request's allow list (``whitelist``) and deny list (``blacklist``) as a filter of flow records.

Hubble's rule: a record is sent if the allow list is empty or one of its filters matches, and none of the
deny list's filters matches. A filter matches if every field it sets matches (AND); a field matches if one
of its values does (OR). What each field means for podmeter's records:

- ``source_pod``/``destination_pod``: ``NS/PREFIX`` (namespace NS, pod names starting with PREFIX), ``NS/``
  (every pod of NS), ``PREFIX`` (namespace ``default``, as ``hubble observe --pod`` means it).
- ``source_ip``/``destination_ip``: an address or a CIDR range.
- ``source_port``/``destination_port``: a TCP or UDP port (as a string).
- ``protocol``: ``tcp``, ``udp``, ``icmpv4``, ``icmpv6``, ``sctp`` (any case), the record's layer 4 (a DNS
  record's too: its messages' UDP or TCP); ``dns`` the DNS records (Hubble's L7 DNS flows); ``http``,
  ``kafka`` (L7 podmeter does not read: no record is one).
- ``reply``: a DNS record is a reply if it is an answer; a flow record has no ``is_reply`` (podmeter tracks
  no connections) and matches neither value, as Hubble's filter treats a flow without it.
- ``verdict``, ``traffic_direction``, ``ip_version``, ``source_identity``/``destination_identity``
  (world is identity 2), ``node_name`` (``*`` wildcards; ``CLUSTER/NODE`` with cluster ``default``).
- ``event_type``: the type and sub-type ``adapters.hubble.flows`` gives the record (a trace at its
  observation point, a drop, or 129, an L7 event, for a DNS record: ``hubble observe --type l7``); type 0
  is any type, the sub-type counts only with ``match_sub_type``.
- ``tcp_flags``: a TCP record whose flags include every flag of one of the values.
- ``source_workload``/``destination_workload``: name and kind (an empty one matches any).
- ``source_label``/``destination_label``: Kubernetes label selectors (``app=web``, ``app!=web``,
  ``app in (a,b)``, ``app notin (a)``, ``app``, ``!app``, joined by commas), over the end's labels as
  ``adapters.hubble.flows`` writes them; a key without a source prefix (``k8s:``, ``reserved:``; ``any:``)
  matches it under any source. ``reserved:world`` selects the world.
- ``drop_reason_desc``: a dropped record whose Cilium drop code (``adapters.hubble.flows.drop_reason``) is
  one of the values; ``DROP_REASON_UNKNOWN`` selects the dropped records without one.
- ``source_cluster_name``/``destination_cluster_name``: podmeter knows one cluster, ``default``: a pod end
  is in it, a world end in none. An empty name is refused (as Hubble does).
- ``source_service``/``destination_service``: ``NS/PREFIX`` as pods, the Service whose frontend the end is
  (docs/services.md).
- ``uuid``, ``source_fqdn``/``destination_fqdn``, ``http_*``
  (status code, method, path, URL, header), ``dns_query`` (a regular expression: podmeter does not run a
  client's patterns), ``trace_id``, ``ip_trace_id``,
  ``source_ip_xlated``: podmeter's records carry none of these (no HTTP or Kafka; no translated source,
  observed at the pod, before any SNAT), so a filter that sets one matches no record (in an allow list it
  selects nothing, in a deny list it removes nothing), as Hubble's filters do on a flow without them.
- ``interface``, ``node_labels``, ``encrypted``, ``experimental.cel_expression``: a record has an
  interface, a node and an encryption state, and a CEL expression may hold for it, but podmeter does not
  know them (or evaluate CEL): matching nothing would let a deny list through what it excludes, so a
  filter that sets one is refused: :class:`UnsupportedFilter`, which the server answers with
  ``UNIMPLEMENTED`` naming the field.

A filter with a field this definition does not know (a newer client's), at any depth, is refused rather
than half applied: :class:`BadFilter`, which the server answers with ``INVALID_ARGUMENT``, as it does a bad
value.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from podmeter.adapters.hubble.flows import (
    CLUSTER,
    DIRECTIONS,
    VERDICTS,
    LabelSource,
    drop_reason,
    end_identity,
    end_labels,
    event_type,
    no_labels,
)
from podmeter.adapters.hubble.proto import flow_pb2
from podmeter.model.dns import Direction
from podmeter.model.flow_records import VERDICT_DROPPED, FlowEnd, FlowRecord
from podmeter.model.flows import ICMP, ICMPV6, TCP, TCP_FLAG_NAMES, UDP

Check = Callable[[FlowRecord], bool]
SCTP = 132
PROTOCOLS: dict[str, int | None] = {"tcp": TCP, "udp": UDP, "icmpv4": ICMP, "icmpv6": ICMPV6, "sctp": SCTP,
                                    "http": None, "dns": None, "kafka": None}
DEFAULT_NAMESPACE = "default"
ABSENT = ("uuid", "source_fqdn", "destination_fqdn", "http_status_code",
          "http_method", "http_path", "http_url", "http_header", "dns_query", "trace_id", "ip_trace_id",
          "source_ip_xlated")
# Filter fields about what a record has but podmeter does not know: the field, its number, and why.
UNSUPPORTED = (
    ("interface", 35, "podmeter's flows do not say on which interface their packets were seen"),
    ("node_labels", 36, "podmeter does not know its node's labels"),
    ("encrypted", 40, "podmeter does not know whether the node encrypts a flow"),
)
# Bounds on one request's filters (INVALID_ARGUMENT beyond): far above what a person or Relay asks, and what
# keeps the cost of matching a record bounded, however the request is built.
MAX_FILTERS = 256  # FlowFilters in a request (allow and deny lists together)
MAX_VALUES = 4096  # values of all the repeated fields of all its filters together
MAX_PATTERN = 256  # characters of one node name pattern or label selector
TCP_FLAG_BITS = {name: bit for bit, name in enumerate(TCP_FLAG_NAMES)}


class BadFilter(ValueError):
    """A filter podmeter cannot apply as asked: a bad value, or a field it does not know."""


class UnsupportedFilter(BadFilter):
    """A filter on something podmeter does not know about its flows (the message names the field)."""


def _never(record: FlowRecord) -> bool:
    return False


# --- one end -------------------------------------------------------------------------------------------


Side = Callable[[FlowRecord], FlowEnd]


def _source(record: FlowRecord) -> FlowEnd:
    return record.source


def _destination(record: FlowRecord) -> FlowEnd:
    return record.destination


def _named(values: Sequence[str], what: str) -> list[tuple[str | None, str]]:
    """``NS/PREFIX``, ``NS/`` or ``PREFIX`` (namespace ``default``) -> (namespace or None, name prefix), as
    Hubble reads its pod and Service filters."""
    wanted = []
    for value in values:
        namespace, slash, prefix = value.partition("/")
        if not slash:
            namespace, prefix = DEFAULT_NAMESPACE, value
        if not namespace and not prefix:
            raise BadFilter(f"{what} filter {value!r}: expected [NAMESPACE/][{what.upper()}-NAME-PREFIX]")
        wanted.append((namespace or None, prefix))
    return wanted


def _pods(values: Sequence[str], side: Side) -> Check:
    wanted = _named(values, "pod")

    def check(record: FlowRecord) -> bool:
        e = side(record).endpoint
        return e is not None and any((ns is None or e.namespace == ns) and e.pod.startswith(prefix)
                                     for ns, prefix in wanted)
    return check


def _services(values: Sequence[str], side: Side) -> Check:
    """The Service whose frontend the end is (docs/services.md), named as pods are."""
    wanted = _named(values, "service")

    def check(record: FlowRecord) -> bool:
        s = side(record).service
        return s is not None and any((ns is None or s.namespace == ns) and s.name.startswith(prefix)
                                     for ns, prefix in wanted)
    return check


@functools.lru_cache(maxsize=65536)
def _address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(ip)


def _ips(values: Sequence[str], side: Side) -> Check:
    """Addresses and CIDR ranges as one set of masked networks per prefix length: a record costs one set
    lookup per distinct prefix length (at most 33 + 129), however many ranges the filter lists."""
    by_length: dict[tuple[int, int], set[int]] = {}
    try:
        for value in values:
            network = ipaddress.ip_network(value, strict=False)
            by_length.setdefault((network.version, network.prefixlen), set()).add(int(network.network_address))
    except ValueError as exc:
        raise BadFilter(f"IP filter: {exc}") from None
    lengths = [(version, (1 << bits) - (1 << (bits - length)), networks)
               for (version, length), networks in sorted(by_length.items())
               for bits in ((32 if version == 4 else 128),)]

    def check(record: FlowRecord) -> bool:
        address = _address(side(record).ip)
        value = int(address)
        return any(address.version == version and value & mask in networks for version, mask, networks in lengths)
    return check


def _ports(values: Sequence[str], side: Side) -> Check:
    ports = set()
    for value in values:
        if not value.isdigit() or int(value) > 65535:
            raise BadFilter(f"port filter {value!r}: expected a port number 0-65535")
        ports.add(int(value))

    def check(record: FlowRecord) -> bool:
        return record.protocol in (TCP, UDP) and side(record).port in ports
    return check


def _workloads(values: Iterable[flow_pb2.Workload], side: Side) -> Check:
    wanted = [(w.name, w.kind.lower()) for w in values]

    def check(record: FlowRecord) -> bool:
        e = side(record).endpoint
        return e is not None and any((not name or e.workload == name) and (not kind or e.workload_kind.lower() == kind)
                                     for name, kind in wanted)
    return check


def _identities(values: Iterable[int], side: Side) -> Check:
    wanted = set(values)
    return lambda record: end_identity(side(record)) in wanted


def _clusters(values: Sequence[str], side: Side) -> Check:
    if "" in values:
        raise BadFilter("cluster name filter: a name must not be empty")
    if CLUSTER not in values:
        return _never  # another cluster's: none of this agent's records
    return lambda record: side(record).endpoint is not None


# --- label selectors -----------------------------------------------------------------------------------

_SET = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s+\(([^()]*)\)$")
_EQUALITY = re.compile(r"^([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)$")
_EXISTS = re.compile(r"^(!?)\s*([^\s!=(),]+)$")


@dataclass(frozen=True)
class Requirement:
    """One term of a selector: ``key`` (``source:key``, or a bare key for any source) and what its value
    must be: ``values`` (in), not ``values`` (notin, also true when absent), present, or absent."""

    key: str
    operator: str  # "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()


def _split_terms(selector: str) -> list[str]:
    terms: list[str] = []
    current: list[str] = []
    depth = 0
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(char)
    terms.append("".join(current))
    return [term.strip() for term in terms]


def _key(raw: str) -> str:
    source, colon, key = raw.partition(":")
    return key if colon and source == "any" else raw


def parse_selector(selector: str) -> tuple[Requirement, ...]:
    """A Kubernetes label selector, each key optionally with a Cilium source prefix (``k8s:app=web``)."""
    requirements = []
    for term in _split_terms(selector):
        if found := _SET.match(term):
            values = frozenset(v.strip() for v in found.group(3).split(",") if v.strip())
            requirements.append(Requirement(_key(found.group(1)), found.group(2), values))
        elif found := _EQUALITY.match(term):
            operator = "notin" if found.group(2) == "!=" else "in"
            requirements.append(Requirement(_key(found.group(1)), operator, frozenset({found.group(3)})))
        elif found := _EXISTS.match(term):
            requirements.append(Requirement(_key(found.group(2)), "!exists" if found.group(1) else "exists"))
        else:
            raise BadFilter(f"label selector {selector!r}: cannot read {term!r}")
    return tuple(requirements)


@functools.lru_cache(maxsize=4096)
def _label_index(labels: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``source:key`` and bare ``key`` -> the values they have among ``labels`` (``source:key=value``)."""
    index: dict[str, list[str]] = {}
    for label in labels:
        full, _, value = label.partition("=")
        index.setdefault(full, []).append(value)
        _, colon, key = full.partition(":")
        if colon:
            index.setdefault(key, []).append(value)
    return {key: tuple(values) for key, values in index.items()}


def selector_matches(requirements: Sequence[Requirement], labels: tuple[str, ...]) -> bool:
    index = _label_index(labels)
    for requirement in requirements:
        values = index.get(requirement.key, ())
        op = requirement.operator
        ok = (bool(values) if op == "exists" else not values if op == "!exists"
              else any(v in requirement.values for v in values) if op == "in"
              else not any(v in requirement.values for v in values))
        if not ok:
            return False
    return True


def _labels(values: Sequence[str], side: Side, labels: LabelSource) -> Check:
    if any(len(value) > MAX_PATTERN for value in values):
        raise BadFilter(f"a label selector longer than {MAX_PATTERN} characters")
    selectors = [parse_selector(value) for value in values]

    def check(record: FlowRecord) -> bool:
        have = end_labels(side(record), labels)
        return any(selector_matches(selector, have) for selector in selectors)
    return check


# --- the whole record ----------------------------------------------------------------------------------


def _protocols(values: Sequence[str]) -> Check:
    wanted = set()
    for value in values:
        if value.lower() not in PROTOCOLS:
            raise BadFilter(f"protocol filter {value!r}: expected one of {', '.join(PROTOCOLS)}")
        number = PROTOCOLS[value.lower()]
        if number is not None:
            wanted.add(number)
    if any(value.lower() == "dns" for value in values):
        return lambda record: record.dns is not None or record.protocol in wanted
    return lambda record: record.protocol in wanted


def _replies(values: Iterable[bool]) -> Check:
    """Hubble's ``reply``: the flows whose ``is_reply`` is one of the values; only a DNS record has one."""
    wanted = set(values)
    return lambda record: record.dns is not None and (record.dns.direction is Direction.RESPONSE) in wanted


def _tcp_flags(values: Iterable[flow_pb2.TCPFlags]) -> Check:
    masks: list[int | None] = []
    for flags in values:
        if flags.NS:
            masks.append(None)  # podmeter does not record NS: no record has it
            continue
        masks.append(sum(1 << bit for name, bit in TCP_FLAG_BITS.items() if getattr(flags, name)))

    def check(record: FlowRecord) -> bool:
        return record.protocol == TCP and any(m is not None and record.tcp_flags & m == m for m in masks)
    return check


def _wildcard(pattern: str) -> Callable[[str], bool]:
    """``*`` matches any run of characters; nothing else is special. Matched without backtracking (a
    regular expression of ``.*`` runs backtracks exponentially on a pattern of many stars): the first part
    is a prefix, the last a suffix, and each part between is found leftmost after the one before, which
    is a match whenever one exists. Linear in the name times the parts."""
    if len(pattern) > MAX_PATTERN:
        raise BadFilter(f"node name pattern of {len(pattern)} characters: at most {MAX_PATTERN}")
    parts = pattern.split("*")
    if len(parts) == 1:
        return lambda name: name == pattern
    head, middle, tail = parts[0], [p for p in parts[1:-1] if p], parts[-1]

    def matches(name: str) -> bool:
        if len(name) < len(head) + len(tail) or not name.startswith(head) or not name.endswith(tail):
            return False
        at, end = len(head), len(name) - len(tail)
        for part in middle:
            found = name.find(part, at, end)
            if found < 0:
                return False
            at = found + len(part)
        return True
    return matches


def _node_names(values: Sequence[str]) -> Check:
    patterns = []
    for value in values:
        cluster, slash, node = value.rpartition("/")
        if slash and not _wildcard(cluster or "*")(CLUSTER):
            continue  # another cluster's nodes: none of this agent's records
        patterns.append(_wildcard(node or "*"))
    return lambda record: any(matches(record.node) for matches in patterns)


def _event_types(values: Iterable[flow_pb2.EventTypeFilter]) -> Check:
    """Type 0 is any type (as in Hubble); the sub-type counts only with ``match_sub_type``."""
    wanted = [(v.type, v.sub_type if v.match_sub_type else None) for v in values]

    def check(record: FlowRecord) -> bool:
        kind, sub_type = event_type(record)
        return any(t in (0, kind) and (s is None or s == sub_type) for t, s in wanted)
    return check


def _drop_reasons(values: Iterable[int]) -> Check:
    wanted = set(values)
    return lambda record: record.verdict == VERDICT_DROPPED and drop_reason(record) in wanted


def unknown_fields_of(message: Message, prefix: str = "") -> list[str]:
    """The numbers of the fields ``message`` carries that its definition does not declare, nested ones as
    ``field.number`` (``experimental.2``), each once."""
    unknown = unknown_fields.UnknownFieldSet(message)
    found = [f"{prefix}{number}" for number in sorted({unknown[i].field_number for i in range(len(unknown))})]
    for field, value in message.ListFields():
        if field.type == field.TYPE_MESSAGE:
            for item in value if field.is_repeated else (value,):
                found.extend(unknown_fields_of(item, f"{prefix}{field.name}."))
    return list(dict.fromkeys(found))


def compile_filter(message: flow_pb2.FlowFilter, labels: LabelSource = no_labels) -> tuple[Check, ...]:
    """The checks of one FlowFilter (all must hold); :class:`BadFilter` for a value or field podmeter
    cannot apply, :class:`UnsupportedFilter` for a field about what it does not know."""
    unknown = unknown_fields_of(message)
    if unknown:
        raise BadFilter(f"the flow filter has fields podmeter does not know (numbers {', '.join(unknown)}); "
                        "see docs/hubble.md for the filters it supports")
    m = message
    for name, number, why in UNSUPPORTED:
        if len(getattr(m, name)):
            raise UnsupportedFilter(f"the flow filter field {name} ({number}) is not supported: {why}; "
                                    "see docs/hubble.md")
    if m.experimental.cel_expression:
        raise UnsupportedFilter("the flow filter field experimental.cel_expression (999.1) is not supported: "
                                "podmeter does not evaluate CEL expressions; see docs/hubble.md")
    checks: list[Check] = []
    for name in ABSENT:
        if len(getattr(m, name)):
            checks.append(_never)
    for side, pods, ips, ports, workloads, identities, selectors, clusters in (
        (_source, m.source_pod, m.source_ip, m.source_port, m.source_workload, m.source_identity, m.source_label,
         m.source_cluster_name),
        (_destination, m.destination_pod, m.destination_ip, m.destination_port, m.destination_workload,
         m.destination_identity, m.destination_label, m.destination_cluster_name),
    ):
        if pods:
            checks.append(_pods(pods, side))
        if ips:
            checks.append(_ips(ips, side))
        if ports:
            checks.append(_ports(ports, side))
        if workloads:
            checks.append(_workloads(workloads, side))
        if identities:
            checks.append(_identities(identities, side))
        if selectors:
            checks.append(_labels(selectors, side, labels))
        if clusters:
            checks.append(_clusters(clusters, side))
    if m.source_service:
        checks.append(_services(m.source_service, _source))
    if m.destination_service:
        checks.append(_services(m.destination_service, _destination))
    if m.protocol:
        checks.append(_protocols(m.protocol))
    if m.verdict:
        verdicts = set(m.verdict)
        checks.append(lambda r: VERDICTS.get(r.verdict, flow_pb2.VERDICT_UNKNOWN) in verdicts)
    if m.traffic_direction:
        directions = set(m.traffic_direction)
        checks.append(lambda r: DIRECTIONS[r.observation] in directions)
    if m.ip_version:
        versions = set(m.ip_version)
        checks.append(lambda r: (flow_pb2.IPv6 if ":" in r.source.ip else flow_pb2.IPv4) in versions)
    if m.tcp_flags:
        checks.append(_tcp_flags(m.tcp_flags))
    if m.node_name:
        checks.append(_node_names(m.node_name))
    if m.event_type:
        checks.append(_event_types(m.event_type))
    if m.drop_reason_desc:
        checks.append(_drop_reasons(m.drop_reason_desc))
    if m.reply:
        checks.append(_replies(m.reply))
    return tuple(checks)


def _any_matches(filters: tuple[tuple[Check, ...], ...], record: FlowRecord) -> bool:
    return any(all(check(record) for check in checks) for checks in filters)


@dataclass(frozen=True)
class HubbleSelection:
    """The records a ``GetFlows`` request wants: a selector of the flow-serving core
    (``adapters.flow_serving``); ``since`` and ``until`` are wall-clock seconds, bounds on the time of the
    record's last packet."""

    allow: tuple[tuple[Check, ...], ...] = ()
    deny: tuple[tuple[Check, ...], ...] = ()
    since: float | None = None
    until: float | None = None

    def matches(self, record: FlowRecord) -> bool:
        if self.since is not None and record.time < self.since:
            return False
        if self.until is not None and record.time > self.until:
            return False
        if self.allow and not _any_matches(self.allow, record):
            return False
        return not (self.deny and _any_matches(self.deny, record))


def _check_size(filters: Sequence[flow_pb2.FlowFilter]) -> None:
    if len(filters) > MAX_FILTERS:
        raise BadFilter(f"the request has {len(filters)} flow filters: at most {MAX_FILTERS}")
    values = sum(len(value) for f in filters for field, value in f.ListFields() if field.is_repeated)
    if values > MAX_VALUES:
        raise BadFilter(f"the request's flow filters have {values} values: at most {MAX_VALUES} in all")


def selection(whitelist: Sequence[flow_pb2.FlowFilter], blacklist: Sequence[flow_pb2.FlowFilter],
              since: float | None = None, until: float | None = None,
              labels: LabelSource = no_labels) -> HubbleSelection:
    _check_size([*whitelist, *blacklist])
    return HubbleSelection(since=since, until=until,
                           allow=tuple(compile_filter(f, labels) for f in whitelist),
                           deny=tuple(compile_filter(f, labels) for f in blacklist))
