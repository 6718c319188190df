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
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Final

import msgspec

from podmeter.model.flows import FlowEntry, FlowKey
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
    """A Service, as a flow record names it."""

    namespace: str
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class ServicePort(msgspec.Struct, frozen=True, gc=False):
    name: str
    protocol: int
    port: int
    node_port: int = 0


class Service(msgspec.Struct, frozen=True, gc=False):
    """A Service as podmeter needs it: its frontend addresses (canonical) and ports."""

    namespace: str
    name: str
    uid: str
    type: str
    frontends: tuple[str, ...]
    ports: tuple[ServicePort, ...]
    resource_version: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class ServiceBackends(msgspec.Struct, frozen=True, gc=False):
    """An EndpointSlice as podmeter needs it: the Service it belongs to, its addresses and ports."""

    namespace: str
    name: str
    uid: str
    service: str  # the Service's name (label kubernetes.io/service-name); "" for a slice of no Service
    addresses: tuple[str, ...]
    ports: tuple[tuple[int, int], ...]  # (protocol number, port)
    resource_version: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


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
    return Service(
        namespace=sys.intern(meta.namespace), name=meta.name, uid=meta.uid, type=sys.intern(spec.type),
        frontends=_addresses("Service", name, addresses),
        ports=tuple(ServicePort(sys.intern(p.name), PROTOCOLS.get(p.protocol, 0), p.port, p.nodePort)
                    for p in spec.ports or () if p.protocol in PROTOCOLS),
        resource_version=meta.resourceVersion,
    )


def decode_service_backends(data: bytes | dict[str, Any]) -> ServiceBackends:
    """Decode an EndpointSlice from JSON bytes (or a parsed dict). FQDN slices have no addresses here."""
    wire = decode_wire("EndpointSlice", data, _slice_decoder, _WireSlice)
    meta = wire.metadata
    name = f"{meta.namespace}/{meta.name}"
    listed = [] if wire.addressType == "FQDN" else [a for e in wire.endpoints or () for a in e.addresses or ()]
    return ServiceBackends(
        namespace=sys.intern(meta.namespace), name=meta.name, uid=meta.uid,
        service=sys.intern((meta.labels or {}).get(SERVICE_NAME_LABEL, "")),
        addresses=_addresses("EndpointSlice", name, listed),
        ports=tuple((PROTOCOLS[p.protocol], p.port) for p in wire.ports or ()
                    if p.protocol in PROTOCOLS and p.port is not None),
        resource_version=meta.resourceVersion,
    )


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


class ServiceIndex:
    """Frontends and backends of the cluster's Services, as of one moment (rebuilt per drain from the
    agent's stores; a rebuild is one pass over the records, nothing is patched in place).

    Invariants: a frontend maps to the Service that declares it (two Services claiming one frontend, which
    the API server forbids for ClusterIPs: the one stored last); a backend address and port maps to the
    Service whose EndpointSlice lists it with that port. Backends are keyed by address alone, the common
    case (one Service per pod address: a name shared by all its endpoints), with a port map only for an
    address more than one Service lists (``bench.services``: memory per endpoint)."""

    def __init__(self, services: Iterable[Service], backends: Iterable[ServiceBackends] = ()) -> None:
        self._frontends: dict[Frontend, ServiceName] = {}
        self._node_ports: dict[tuple[int, int], ServiceName] = {}
        self._backends: dict[str, ServiceName | dict[tuple[int, int], ServiceName]] = {}
        for service in services:
            named = ServiceName(service.namespace, service.name)
            for served in service.ports:
                for address in service.frontends:
                    self._frontends[(address, served.port, served.protocol)] = named
                if served.node_port:
                    self._node_ports[(served.node_port, served.protocol)] = named
        self._index_backends(backends)

    def _index_backends(self, backends: Iterable[ServiceBackends]) -> None:
        by_port: dict[str, dict[tuple[int, int], ServiceName]] = {}
        names: dict[tuple[str, str], ServiceName] = {}  # one record per Service, shared by its endpoints
        for backend in backends:
            if not backend.service:
                continue
            key = (backend.namespace, backend.service)
            named = names.get(key) or names.setdefault(key, ServiceName(*key))
            for address in backend.addresses:
                ports = by_port.setdefault(address, {})
                for protocol, number in backend.ports:
                    ports[(number, protocol)] = named
        for address, ports in by_port.items():
            held = set(ports.values())
            if held:  # a slice without ports names no backend
                self._backends[address] = next(iter(held)) if len(held) == 1 else ports

    def __len__(self) -> int:
        return len(self._frontends) + len(self._node_ports)

    def frontend(self, ip: str, port: int, protocol: int,
                 node_addresses: frozenset[str] = frozenset()) -> ServiceName | None:
        """The Service reached at ``ip:port``: a frontend, or a NodePort at one of ``node_addresses``."""
        found = self._frontends.get((ip, port, protocol))
        if found is None and ip in node_addresses:
            found = self._node_ports.get((port, protocol))
        return found

    def backend(self, ip: str, port: int, protocol: int) -> ServiceName | None:
        """The Service whose EndpointSlice lists ``ip:port`` as a backend (the only Service listing ``ip``,
        whatever the port: a translated connection's backend port is one its slice lists)."""
        found = self._backends.get(ip)
        return found.get((port, protocol)) if isinstance(found, dict) else found


# --- which backend served a translated connection ------------------------------------------------------

FiveTuple = tuple[int, str, int, str, int]  # (protocol, source, source port, destination, destination port)


class Translated(msgspec.Struct, frozen=True, gc=False):
    """How a record's tuple relates to a translated connection: which of its ends is the Service's
    (``"source"`` or ``"destination"``), the frontend address and port, and the backend's."""

    end: str
    frontend: tuple[str, int]
    backend: tuple[str, int]


class Translations:
    """The node's translated connections (its conntrack entries with a rewritten destination), indexed by
    every tuple a flow record of the connection can carry: the client's request (to the frontend), the
    request as the backend receives it, the backend's reply, and the reply as the client receives it."""

    def __init__(self, entries: Iterable[tuple[FiveTuple, FiveTuple]] = ()) -> None:
        """``entries``: (original, reply) tuples of each translated connection."""
        self._by_tuple: dict[FiveTuple, Translated] = {}
        for original, reply in entries:
            frontend, backend = (original[3], original[4]), (reply[1], reply[2])
            self._by_tuple[original] = Translated("destination", frontend, backend)
            self._by_tuple[_reversed(original)] = Translated("source", frontend, backend)
            self._by_tuple[reply] = Translated("source", frontend, backend)
            self._by_tuple[_reversed(reply)] = Translated("destination", frontend, backend)

    def __len__(self) -> int:
        return len(self._by_tuple) // 4

    def of(self, key: FiveTuple) -> Translated | None:
        return self._by_tuple.get(key)


def _reversed(key: FiveTuple) -> FiveTuple:
    protocol, src, sport, dst, dport = key
    return protocol, dst, dport, src, sport


ServedBy = tuple[ServiceName | None, str | None]  # (the end's Service, the address that really is that end)


class ServiceNaming:
    """What flow naming asks about Services for one drain: the index, the node's translations and the
    node addresses NodePorts are reached at."""

    def __init__(self, index: ServiceIndex, translations: Translations | None = None,
                 node_addresses: Iterable[str] = ()) -> None:
        self.index = index
        self.translations = translations or Translations()
        self.node_addresses = frozenset(node_addresses)

    def ends(self, key: FiveTuple) -> tuple[ServedBy, ServedBy]:
        """For a record's tuple: (the source's Service, the address that really sent it), and the same
        for the destination. The address is the backend's where the record carries the frontend (and
        None where the backend is not known), else the record's own."""
        protocol, src, sport, dst, dport = key
        translated = self.translations.of(key)
        if translated is not None:
            service = self._service_of(translated, protocol)
            backend_ip = translated.backend[0]
            if translated.end == "destination":
                return (None, src), (service, backend_ip)
            return (service, backend_ip), (None, dst)
        return self._untranslated(protocol, src, sport), self._untranslated(protocol, dst, dport)

    def _service_of(self, translated: Translated, protocol: int) -> ServiceName | None:
        front_ip, front_port = translated.frontend
        found = self.index.frontend(front_ip, front_port, protocol, self.node_addresses)
        if found is None:
            found = self.index.backend(translated.backend[0], translated.backend[1], protocol)
        return found

    def _untranslated(self, protocol: int, ip: str, port: int) -> ServedBy:
        service = self.index.frontend(ip, port, protocol, self.node_addresses)
        if service is not None:  # a frontend, but no entry names its backend (yet, or any more)
            return service, None
        return None, ip

    def real_ends(self, entries: Sequence[FlowEntry]) -> list[FlowEntry]:
        """``entries`` with each frontend a translation names replaced by its backend (address and port):
        the ends the packets really had, which the workload series count (a reply a client receives from a
        ClusterIP is the backend's, counted once where it left the backend's pod if that is here)."""
        by_tuple = self.translations.of
        out: list[FlowEntry] = []
        for entry in entries:
            (src, dst, sport, dport, protocol, observation), counts = entry
            translated = by_tuple((protocol, src, sport, dst, dport))
            if translated is None:
                out.append(entry)
            elif translated.end == "destination" and (dst, dport) == translated.frontend:
                backend, port = translated.backend
                out.append((FlowKey(src, backend, sport, port, protocol, observation), counts))
            elif translated.end == "source" and (src, sport) == translated.frontend:
                backend, port = translated.backend
                out.append((FlowKey(backend, dst, port, dport, protocol, observation), counts))
            else:
                out.append(entry)
        return out
