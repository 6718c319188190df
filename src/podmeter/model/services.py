"""Services: which address and port is a Service's frontend, which backend served a translated connection.

A Service is reached at its frontends: each ClusterIP, external IP and load-balancer ingress IP with each
of its ports, and any node's address with each NodePort. The node rewrites the destination to a backend
(DNAT) after podmeter's programs have seen the client's packets, so a client-side flow carries the
frontend; the kernel's conntrack entry of the connection gives the backend (:class:`Translations`, built
from ``adapters.conntrack``). EndpointSlices say which addresses are a Service's backends, which names
the Service on the server's side of a translated connection too.

Records are slim and immutable, decoded with the same rules as pods (everything Kubernetes accepts
decodes; malformed input is a :class:`~podmeter.model.records.DecodeError`); a headless Service
(``clusterIP: None``) has no frontend but its NodePorts (none) and its backends.

The next stage: :class:`ServiceNaming` is what ``model.flow_records.name_flows`` asks for each end.
"""

from __future__ import annotations

import sys
import weakref
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, groupby
from operator import itemgetter, not_, or_
from typing import Annotated, Any, Final

import msgspec

from podmeter.model.flows import FlowEntry, FlowKey, Observation
from podmeter.model.records import DecodeError, canonical_ip, decode_wire

SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
PROTOCOLS: Final = {"TCP": 6, "UDP": 17, "SCTP": 132}
MAX_PORTS: Final = 1024  # per Service or slice; Kubernetes bounds a slice's ports at 100, a Service's by size

_Name = Annotated[str, msgspec.Meta(max_length=253)]
_Text = Annotated[str, msgspec.Meta(max_length=253)]
_IP = Annotated[str, msgspec.Meta(max_length=64)]
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_LabelKey = Annotated[str, msgspec.Meta(max_length=317)]
_LabelValue = Annotated[str, msgspec.Meta(max_length=63)]


class ServiceName(msgspec.Struct, frozen=True, gc=False):
    """A Service, as a flow record names it (a :class:`Service` record is one: flows name it directly)."""

    namespace: str
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def named(self) -> tuple[str, str]:
        """(namespace, name): what compares two names whatever their record (a Service or a bare name)."""
        return self.namespace, self.name


class ServicePort(msgspec.Struct, frozen=True, gc=False):
    name: str
    protocol: int
    port: int
    node_port: int = 0


class PortTable(msgspec.Struct, frozen=True, weakref=True):
    """A Service's or an EndpointSlice's ports, one shared object for every record with the same ports
    (:func:`port_table`: most Services of a cluster declare one of a few port lists), with what lookups
    ask precomputed: ``keys``, the (port, protocol) pairs served."""

    ports: tuple[ServicePort, ...]
    keys: frozenset[tuple[int, int]]

    def __iter__(self) -> Iterator[ServicePort]:
        return iter(self.ports)

    def __len__(self) -> int:
        return len(self.ports)


# Port lists by value, weakly: a table lives as long as a record holds it (memory returns to baseline
# when the Services go). Filled by the decoders, on the event loop.
_port_tables: weakref.WeakValueDictionary[tuple[ServicePort, ...], PortTable] = weakref.WeakValueDictionary()


def port_table(ports: Iterable[ServicePort]) -> PortTable:
    """The shared table of ``ports`` (made on first use)."""
    listed = tuple(ports)
    table = _port_tables.get(listed)
    if table is None:
        table = _port_tables[listed] = PortTable(listed, frozenset((p.port, p.protocol) for p in listed))
    return table


class Service(ServiceName, frozen=True, gc=False):
    """A Service as podmeter needs it: its frontend addresses (canonical) and ports. Slim (``bench.services``):
    the first frontend (the ClusterIP, most Services' only one; "" for none) in a field of its own, the
    others in ``more``; the ports a shared :class:`PortTable`; no resourceVersion (a change podmeter does
    not see compares equal, and rebuilds nothing)."""

    uid: str
    type: str
    frontend: str
    ports: PortTable
    more: tuple[str, ...] = ()

    @property
    def frontends(self) -> tuple[str, ...]:
        return (self.frontend, *self.more) if self.frontend else self.more

    @property
    def resource_version(self) -> str:
        return ""


class ServiceBackends(msgspec.Struct, frozen=True, gc=False):
    """An EndpointSlice as podmeter needs it: the Service it belongs to, its addresses and ports. Slim
    (``bench.services``): IPv4 addresses packed, 4 bytes each (``v4``), IPv6 ones as text."""

    namespace: str
    name: str
    uid: str
    service: str  # the Service's name (label kubernetes.io/service-name); "" for a slice of no Service
    v4: bytes
    ports: PortTable
    v6: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def addresses(self) -> tuple[str, ...]:
        v4 = self.v4
        return (*(".".join(map(str, v4[i:i + 4])) for i in range(0, len(v4), 4)), *self.v6)

    @property
    def resource_version(self) -> str:
        return ""


def service_backends(namespace: str, name: str, uid: str, service: str, *, addresses: Iterable[str],
                     ports: Iterable[tuple[int, int]]) -> ServiceBackends:
    """A slice's record from canonical addresses and (protocol, port) pairs."""
    v4, v6 = bytearray(), []
    for address in addresses:
        if ":" in address:
            v6.append(address)
        else:
            v4 += bytes(map(int, address.split(".")))  # canonical: four decimal bytes
    return ServiceBackends(namespace, name, uid, service, bytes(v4),
                           port_table(ServicePort("", protocol, port) for protocol, port in ports), tuple(v6))


# --- wire shapes ----------------------------------------------------------------------------------------


class _Meta(msgspec.Struct):
    uid: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    name: _Name = ""
    namespace: _Name = ""
    resourceVersion: Annotated[str, msgspec.Meta(max_length=64)] = ""
    labels: dict[_LabelKey, _LabelValue] | None = None


class _WirePort(msgspec.Struct):
    port: _Port = 0
    name: _Text = ""
    protocol: _Text = "TCP"
    nodePort: _Port = 0


class _WireSpec(msgspec.Struct):
    type: _Text = "ClusterIP"
    clusterIP: _IP = ""
    clusterIPs: list[_IP] | None = None
    externalIPs: list[_IP] | None = None
    ports: Annotated[list[_WirePort], msgspec.Meta(max_length=MAX_PORTS)] | None = None


class _WireIngress(msgspec.Struct):
    ip: _IP = ""


class _WireLoadBalancer(msgspec.Struct):
    ingress: list[_WireIngress] | None = None


class _WireStatus(msgspec.Struct):
    loadBalancer: _WireLoadBalancer | None = None


class _WireService(msgspec.Struct):
    metadata: _Meta
    spec: _WireSpec | None = None
    status: _WireStatus | None = None


class _WireEndpoint(msgspec.Struct):
    addresses: list[_Text] | None = None


class _WireSlicePort(msgspec.Struct):
    port: _Port | None = None
    protocol: _Text = "TCP"


class _WireSlice(msgspec.Struct):
    metadata: _Meta
    addressType: _Text = ""
    endpoints: list[_WireEndpoint] | None = None
    ports: Annotated[list[_WireSlicePort], msgspec.Meta(max_length=MAX_PORTS)] | None = None


_service_decoder: Final = msgspec.json.Decoder(_WireService)
_slice_decoder: Final = msgspec.json.Decoder(_WireSlice)


def decode_service(data: bytes | dict[str, Any]) -> Service:
    """Decode a Service from JSON bytes (or a parsed dict)."""
    wire = decode_wire("Service", data, _service_decoder, _WireService)
    meta, spec = wire.metadata, wire.spec or _WireSpec()
    name = f"{meta.namespace}/{meta.name}"
    addresses = [*(spec.clusterIPs or [spec.clusterIP]), *(spec.externalIPs or ())]
    ingress = ((wire.status or _WireStatus()).loadBalancer or _WireLoadBalancer()).ingress or ()
    addresses += [entry.ip for entry in ingress]
    frontends = _addresses("Service", name, addresses)
    ports = port_table(ServicePort(sys.intern(p.name), PROTOCOLS[p.protocol], p.port, p.nodePort)
                       for p in spec.ports or () if p.protocol in PROTOCOLS)
    return Service(sys.intern(meta.namespace), meta.name, meta.uid, sys.intern(spec.type),
                   frontends[0] if frontends else "", ports, frontends[1:])


def decode_service_backends(data: bytes | dict[str, Any]) -> ServiceBackends:
    """Decode an EndpointSlice from JSON bytes (or a parsed dict). FQDN slices have no addresses here."""
    wire = decode_wire("EndpointSlice", data, _slice_decoder, _WireSlice)
    meta = wire.metadata
    name = f"{meta.namespace}/{meta.name}"
    listed = [] if wire.addressType == "FQDN" else [a for e in wire.endpoints or () for a in e.addresses or ()]
    return service_backends(
        sys.intern(meta.namespace), meta.name, meta.uid, sys.intern((meta.labels or {}).get(SERVICE_NAME_LABEL, "")),
        addresses=_addresses("EndpointSlice", name, listed),
        ports=((PROTOCOLS[p.protocol], p.port) for p in wire.ports or ()
               if p.protocol in PROTOCOLS and p.port is not None))


def _addresses(kind: str, name: str, texts: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for text in texts:
        if text in ("", "None"):  # no address (yet), or a headless Service
            continue
        try:
            ip = canonical_ip(text)
        except ValueError:
            raise DecodeError(kind, name, "$", f"invalid address {text[:64]!r}") from None
        if ip not in out:
            out.append(ip)
    return tuple(out)


# --- which Service an address and port is ------------------------------------------------------------

Frontend = tuple[str, int, int]  # (address, port, protocol number)
_Backend = ServiceName | dict[tuple[int, int], ServiceName]  # one Service, or by (port, protocol)


def _v4_number(address: str) -> int:
    a, b, c, d = address.split(".")
    return (int(a) << 24) | (int(b) << 16) | (int(c) << 8) | int(d)


class ServiceIndex:
    """Frontends and backends of the cluster's Services, as of one moment (rebuilt per drain from the
    agent's stores; a rebuild is one pass over the records, nothing is patched in place).

    Invariants: a frontend maps to the Service that declares it (two Services claiming one address and
    port, which the API server forbids for ClusterIPs: the one stored last); a backend address and port
    maps to the Service whose EndpointSlice lists it with that port.

    Slim (``bench.services``): frontends keyed by address alone, to the :class:`Service` record itself
    (its shared port table says which ports it serves; a list only for an address several Services
    share, as load balancers' may); IPv4 backends in a sorted array of numbers beside their Services'
    names (12 bytes an endpoint: looked up only for connections no frontend names, NodePorts), with a
    port map only for an address more than one Service lists."""

    def __init__(self, services: Iterable[Service], backends: Iterable[ServiceBackends] = ()) -> None:
        self._frontends: dict[str, Service | list[Service]] = {}
        self._node_ports: dict[tuple[int, int], Service] = {}
        self._v4_keys = array("I")
        self._v4_values: list[_Backend] = []
        self._v6: dict[str, _Backend] = {}
        for service in services:
            for address in service.frontends:
                held = self._frontends.get(address)
                if held is None:
                    self._frontends[address] = service
                else:
                    self._frontends[address] = [*(held if isinstance(held, list) else [held]), service]
            for served in service.ports:
                if served.node_port:
                    self._node_ports[(served.node_port, served.protocol)] = service
        self._index_backends(backends)

    def _index_backends(self, backends: Iterable[ServiceBackends]) -> None:
        v4: list[tuple[int, ServiceName, PortTable]] = []
        v6: dict[str, list[tuple[int, ServiceName, PortTable]]] = {}
        names: dict[tuple[str, str], ServiceName] = {}  # one record per Service, shared by its endpoints
        for backend in backends:
            if not backend.service or not backend.ports.keys:  # a slice without ports names no backend
                continue
            key = (backend.namespace, backend.service)
            named = names.get(key) or names.setdefault(key, ServiceName(*key))
            packed, ports = backend.v4, backend.ports
            v4 += [(int.from_bytes(packed[i:i + 4], "big"), named, ports) for i in range(0, len(packed), 4)]
            for address in backend.v6:
                v6.setdefault(address, []).append((0, named, ports))
        v4.sort(key=itemgetter(0))
        for number, group in groupby(v4, key=itemgetter(0)):
            self._v4_keys.append(number)
            self._v4_values.append(_backend_value(list(group)))
        self._v6 = {address: _backend_value(held) for address, held in v6.items()}

    def __len__(self) -> int:
        return len(self._frontends) + len(self._node_ports)

    @property
    def addresses(self) -> dict[str, Service | list[Service]]:
        """The frontend addresses (a membership test per record end: a C-level lookup)."""
        return self._frontends

    def sizes(self) -> tuple[int, int, int]:
        """(frontend addresses, NodePorts, backend addresses): what a test of baseline after churn reads."""
        return len(self._frontends), len(self._node_ports), len(self._v4_keys) + len(self._v6)

    def frontend(self, ip: str, port: int, protocol: int,
                 node_addresses: frozenset[str] = frozenset()) -> Service | None:
        """The Service reached at ``ip:port``: a frontend, or a NodePort at one of ``node_addresses``."""
        held = self._frontends.get(ip)
        if held is not None:
            wanted = (port, protocol)
            if isinstance(held, list):
                for service in reversed(held):
                    if wanted in service.ports.keys:
                        return service
            elif wanted in held.ports.keys:
                return held
        if ip in node_addresses:
            return self._node_ports.get((port, protocol))
        return None

    def backend(self, ip: str, port: int, protocol: int) -> ServiceName | None:
        """The Service whose EndpointSlice lists ``ip:port`` as a backend (the only Service listing ``ip``,
        whatever the port: a translated connection's backend port is one its slice lists)."""
        found: _Backend | None
        if ":" in ip:
            found = self._v6.get(ip)
        else:
            number, keys = _v4_number(ip), self._v4_keys
            at = bisect_left(keys, number)
            found = self._v4_values[at] if at < len(keys) and keys[at] == number else None
        return found.get((port, protocol)) if isinstance(found, dict) else found


def _backend_value(listed: Sequence[tuple[int, ServiceName, PortTable]]) -> _Backend:
    """One address's Services: the one, or by port when several list it."""
    if len({named for _, named, _ in listed}) == 1:
        return listed[0][1]
    return {key: named for _, named, ports in listed for key in ports.keys}


# --- which backend served a translated connection ------------------------------------------------------

FiveTuple = tuple[int, str, int, str, int]  # (protocol, source, source port, destination, destination port)


class Translations:
    """The node's translated connections (its conntrack entries with a rewritten destination): (original,
    reply) tuples of each, as conntrack gives them. :class:`ServiceNaming` indexes them by every tuple a
    flow record of the connection can carry."""

    def __init__(self, entries: Iterable[tuple[FiveTuple, FiveTuple]] = ()) -> None:
        self.entries = list(entries)

    def __len__(self) -> int:
        return len(self.entries)


class Resolved(msgspec.Struct, frozen=True, gc=False):
    """How one record's ends are named through Services: each end's Service (None: no Service's) and the
    address whose pod names it (the backend's where the record carries a frontend; None where that
    backend is not known), and the key the packets really had (``real``: the backend in place of the
    frontend; None: the record's own), which the workload series count. Made once per connection and
    drain (:class:`ServiceNaming`), shared by its records."""

    source_service: ServiceName | None
    source: str | None
    destination_service: ServiceName | None
    destination: str | None
    real: FlowKey | None = None


_KEY, _SOURCE, _DESTINATION = itemgetter(0), itemgetter(0), itemgetter(1)
ServedBy = tuple[ServiceName | None, str | None]  # (the end's Service, the address that really is that end)


class ServiceEnds:
    """One drain's entries as Services name them, resolved once (:meth:`ServiceNaming.resolve`) for the
    three that ask: the records (``model.flow_records.name_flows``), the workload series (:attr:`counted`)
    and the per-Service series (``model.service_series``).

    ``entries``: the drain's; ``found``: beside each, how Services name it (None: no end a Service's);
    ``touched``: how many have one."""

    __slots__ = ("_counted", "entries", "found", "touched")

    def __init__(self, entries: Sequence[FlowEntry], found: list[Resolved | None], touched: int) -> None:
        self.entries, self.found, self.touched = entries, found, touched
        self._counted: list[FlowEntry] | None = None

    @property
    def counted(self) -> Sequence[FlowEntry]:
        """Every entry, a translated one with the ends its packets really had (the backend in place of the
        frontend): what the workload series count."""
        if not self.touched:
            return self.entries
        if self._counted is None:
            counted = list(self.entries)
            for at in compress(range(len(counted)), self.found):
                real = self.found[at].real  # type: ignore[union-attr]  # compress: found, not None
                if real is not None:
                    counted[at] = (real, counted[at][1])
            self._counted = counted
        return self._counted

    def of(self, entries: Sequence[FlowEntry]) -> list[Resolved | None]:
        """``found`` for ``entries``, the drain's or some of them (a drain larger than the ring names its
        newest only)."""
        if entries is self.entries or len(entries) == len(self.entries):
            return self.found
        by_key = {entry[0]: found for entry, found in zip(self.entries, self.found, strict=True) if found is not None}
        return [by_key.get(key) for key, _ in entries]


class ServiceNaming:
    """What flow naming asks about Services for one drain: the index, the node's translations and the
    node addresses NodePorts are reached at.

    The translations are resolved once here, per connection, for its four tuples: the client's request
    (to the frontend), the request as the backend receives it, the backend's reply, and the reply as the
    client receives it; so a record through a Service costs one dict lookup of its key."""

    def __init__(self, index: ServiceIndex, translations: Translations | None = None,
                 node_addresses: Iterable[str] = ()) -> None:
        self.index = index
        self.translations = translations or Translations()
        self.node_addresses = frozenset(node_addresses)
        self._watched = frozenset(index.addresses).union(self.node_addresses)  # where a Service may be
        self._by_key: dict[tuple[str, str, int, int, int, Observation], Resolved] = {}
        for original, reply in self.translations.entries:
            self._add(original, reply)

    def _add(self, original: FiveTuple, reply: FiveTuple) -> None:
        """The connection's four records: the request leaving the client (from-pod, to the frontend) and
        entering the backend (to-pod, rewritten), the reply leaving the backend (from-pod) and entering
        the client (to-pod, from the frontend). On one node each tuple is seen at that one point only
        (the rewrite happens between the two links), so the table is keyed by the records' own keys."""
        protocol, client, client_port, front_ip, front_port = original
        _, backend, backend_port, answered, answered_port = reply  # ``answered``: the client, or the node (SNAT)
        service: ServiceName | None = self.index.frontend(front_ip, front_port, protocol, self.node_addresses)
        if service is None:
            service = self.index.backend(backend, backend_port, protocol)
        table, out, into = self._by_key, Observation.FROM_POD, Observation.TO_POD
        table[(client, front_ip, client_port, front_port, protocol, out)] = Resolved(
            None, client, service, backend, FlowKey(client, backend, client_port, backend_port, protocol, out))
        table[(front_ip, client, front_port, client_port, protocol, into)] = Resolved(
            service, backend, None, client, FlowKey(backend, client, backend_port, client_port, protocol, into))
        table[(answered, backend, answered_port, backend_port, protocol, into)] = Resolved(
            None, answered, service, backend)
        table[(backend, answered, backend_port, answered_port, protocol, out)] = Resolved(
            service, backend, None, answered)

    def resolve(self, entries: Sequence[FlowEntry]) -> ServiceEnds:
        """Each entry's ends, once for the drain: one lookup of its key among the translations', and for
        the others, of each address among the frontends and node addresses; both as chains of C-level
        maps over the entries (``bench.services``: a Python loop per entry cost more than the naming
        itself), Python only for the few untranslated entries an address of which is a Service's."""
        found: list[Resolved | None] = list(map(self._by_key.get, map(_KEY, entries)))
        missing = list(compress(range(len(found)), map(not_, found)))
        missed, watched = list(map(_KEY, map(entries.__getitem__, missing))), self._watched.__contains__
        suspects = map(or_, map(watched, map(_SOURCE, missed)), map(watched, map(_DESTINATION, missed)))
        touched = len(found) - len(missing)
        for at in compress(missing, suspects):
            key = entries[at][0]
            found[at] = self._untranslated(key[0], key[1], key[2], key[3], key[4])
            touched += found[at] is not None
        return ServiceEnds(entries, found, touched)

    def _untranslated(self, src: str, dst: str, sport: int, dport: int, protocol: int) -> Resolved | None:
        """A frontend, but no translation names its backend (yet, or any more)."""
        source = self.index.frontend(src, sport, protocol, self.node_addresses)
        destination = self.index.frontend(dst, dport, protocol, self.node_addresses)
        if source is None and destination is None:
            return None
        return Resolved(source, None if source is not None else src, destination,
                        None if destination is not None else dst)

    def ends(self, key: FiveTuple) -> tuple[ServedBy, ServedBy]:
        """For one tuple (conntrack's order): (the source's Service, the address that really sent it), and
        the same for the destination; what :meth:`resolve` gives a record of that tuple."""
        protocol, src, sport, dst, dport = key
        table = self._by_key
        found = table.get((src, dst, sport, dport, protocol, Observation.FROM_POD)) or table.get(
            (src, dst, sport, dport, protocol, Observation.TO_POD)) or self._untranslated(
            src, dst, sport, dport, protocol) or Resolved(None, src, None, dst)
        return (found.source_service, found.source), (found.destination_service, found.destination)
