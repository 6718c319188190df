"""Slim records decoded with msgspec straight from Kubernetes JSON bytes.

Only the fields podmeter uses are decoded; everything else (managedFields, the pod spec's containers,
other annotations) is skipped by the decoder without building Python objects, which is what keeps a stored
pod small (see ``bench/core.py`` for bytes per pod). Every record is immutable: a new state of an object is a
new record, so a record held by the store is never changed behind the core's back.

Malformed input raises :class:`DecodeError`, which names the object (kind, namespace/name when they can be
read) and the offending field. Callers log and count it and keep the last good record of that object.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from typing import Annotated, Any, Final, TypeVar

import msgspec

OBSERVE_ANNOTATION: Final = "podmeter.io/observe"
TERMINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})

# Kubernetes' own limits, and only those: names are DNS subdomains (253), label values 63, label keys
# 253 + "/" + 63. How many labels, annotations or owner references an object has is bounded only by the
# object's total size, which the API server bounds: everything Kubernetes accepts decodes (memory is
# bounded by what the record keeps, not by refusing objects).
_Name = Annotated[str, msgspec.Meta(max_length=253)]
_Uid = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_RV = Annotated[str, msgspec.Meta(max_length=64)]
_LabelKey = Annotated[str, msgspec.Meta(max_length=317)]
_LabelValue = Annotated[str, msgspec.Meta(max_length=63)]
_Labels = dict[_LabelKey, _LabelValue]
_ShortText = Annotated[str, msgspec.Meta(max_length=253)]
_IPText = Annotated[str, msgspec.Meta(max_length=64)]

_T = TypeVar("_T")
# A dotted quad without leading zeros is already canonical: skip ipaddress (the hot path of decoding).
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_V4: Final = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")

_DNS1123_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # fullmatch: "$" would admit a trailing newline


class DecodeError(ValueError):
    """One object could not be decoded or validated. ``field`` is a JSON path like ``$.status.podIP``."""

    def __init__(self, kind: str, name: str, field: str, reason: str) -> None:
        super().__init__(f"{kind} {name or '<unnamed>'}: {field}: {reason}")
        self.kind = kind
        self.name = name
        self.field = field
        self.reason = reason


# --- wire shapes: what the decoder reads (unknown fields are skipped) -------------------------------


_ANNOTATIONS_TOTAL = 256 * 1024  # Kubernetes' limit on all of an object's annotations together


class _Annotations(msgspec.Struct):
    observe: Annotated[str, msgspec.Meta(max_length=_ANNOTATIONS_TOTAL)] | None = msgspec.field(
        default=None, name=OBSERVE_ANNOTATION)


class _OwnerRef(msgspec.Struct):
    kind: _ShortText = ""
    name: _Name = ""
    controller: bool = False


class _Meta(msgspec.Struct):
    uid: _Uid
    name: _Name = ""
    namespace: _Name = ""
    resourceVersion: _RV = ""
    labels: _Labels | None = None
    annotations: _Annotations | None = None
    deletionTimestamp: _ShortText | None = None
    ownerReferences: list[_OwnerRef] | None = None


class _PodSpec(msgspec.Struct):
    nodeName: _Name = ""
    hostNetwork: bool = False


class _PodIP(msgspec.Struct):
    ip: _IPText


class _PodStatus(msgspec.Struct):
    phase: _ShortText = ""
    podIP: _IPText = ""
    podIPs: list[_PodIP] | None = None


class _PodWire(msgspec.Struct):
    metadata: _Meta
    spec: _PodSpec | None = None
    status: _PodStatus | None = None


class _PodEventWire(msgspec.Struct):
    type: _ShortText
    object: _PodWire


class _NamespaceStatus(msgspec.Struct):
    phase: _ShortText = ""


class _NamespaceWire(msgspec.Struct):
    metadata: _Meta
    status: _NamespaceStatus | None = None


class _NodeMeta(msgspec.Struct):
    name: _Name = ""
    resourceVersion: _RV = ""


class _NodeAddress(msgspec.Struct):
    type: _ShortText
    address: _ShortText


class _NodeStatus(msgspec.Struct):
    addresses: list[_NodeAddress] | None = None


class _NodeWire(msgspec.Struct):
    metadata: _NodeMeta
    status: _NodeStatus | None = None


class _NameOnlyMeta(msgspec.Struct):
    name: Any = ""
    namespace: Any = ""


class _NameOnly(msgspec.Struct):
    metadata: _NameOnlyMeta | None = None


# --- records: what the store keeps ------------------------------------------------------------------


class Pod(msgspec.Struct, frozen=True, gc=False):
    """A pod as podmeter needs it. ``ips`` are canonical strings (see :func:`canonical_ip`), v4 and/or v6.

    ``labels`` is a flat tuple ``(k1, v1, k2, v2, ...)`` sorted by key, with interned strings: label sets
    repeat across replicas, and a flat tuple is the smallest container that keeps them.
    """

    uid: str
    namespace: str
    name: str
    node_name: str
    ips: tuple[str, ...]
    host_network: bool
    phase: str
    deleting: bool
    observe: bool
    labels: tuple[str, ...]
    resource_version: str
    owner_kind: str = ""
    owner_name: str = ""
    unusable_ips: tuple[str, ...] = ()  # addresses podmeter cannot key on (zone-scoped IPv6): ignored

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def label_dict(self) -> dict[str, str]:
        return dict(zip(self.labels[::2], self.labels[1::2], strict=True))


class Namespace(msgspec.Struct, frozen=True, gc=False):
    """A namespace as podmeter needs it."""

    name: str
    uid: str
    observe: bool
    phase: str
    labels: tuple[str, ...]
    resource_version: str


class Node(msgspec.Struct, frozen=True, gc=False):
    """A node as podmeter needs it: its name and the addresses other nodes reach it at (canonical IPs in the
    order ``status.addresses`` lists them; a hostname entry is not an address and is left out)."""

    name: str
    internal_ips: tuple[str, ...]
    external_ips: tuple[str, ...]
    resource_version: str

    @property
    def address(self) -> str | None:
        """Where the node's own services are reached from the cluster: its first InternalIP (the kubelet
        lists the primary one first), else its first ExternalIP (a node with no private address); None
        while the kubelet has reported neither."""
        for ips in (self.internal_ips, self.external_ips):
            if ips:
                return ips[0]
        return None


# --- decoding ----------------------------------------------------------------------------------------

_pod_decoder: Final = msgspec.json.Decoder(_PodWire)
_pod_event_decoder: Final = msgspec.json.Decoder(_PodEventWire)
_ns_decoder: Final = msgspec.json.Decoder(_NamespaceWire)
_node_decoder: Final = msgspec.json.Decoder(_NodeWire)
_name_decoder: Final = msgspec.json.Decoder(_NameOnly)


def canonical_ip(text: str) -> str:
    """The one spelling of an IP podmeter uses everywhere. Raises ValueError for anything but an address."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def decode_pod(data: bytes | dict[str, Any]) -> Pod:
    """Decode a Pod from JSON bytes (or an already-parsed dict, for the lab and tests)."""
    return _pod_record(decode_wire("Pod", data, _pod_decoder, _PodWire))


def decode_pod_event(line: bytes) -> tuple[str, Pod]:
    """One watch line carrying a pod, decoded in a single pass: (event type, pod).

    The fast path of the agent's pod watch. Anything it cannot take (a BOOKMARK or ERROR object, a bad
    pod) raises :class:`DecodeError`; the caller then takes the general path, which names the problem.
    """
    try:
        event = _pod_event_decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise DecodeError("Pod", "", "$", str(exc)) from None
    return event.type, _pod_record(event.object)


def _pod_record(wire: _PodWire) -> Pod:
    meta, spec = wire.metadata, wire.spec or _PodSpec()
    status = wire.status or _PodStatus()
    name = f"{meta.namespace}/{meta.name}"
    owner_kind, owner_name = _controller(meta.ownerReferences)
    ips, unusable = _pod_ips(status, name)
    return Pod(
        uid=meta.uid,
        namespace=sys.intern(meta.namespace),
        name=meta.name,
        node_name=sys.intern(spec.nodeName),
        ips=ips,
        host_network=spec.hostNetwork,
        phase=sys.intern(status.phase),
        deleting=meta.deletionTimestamp is not None,
        observe=_observed(meta.annotations),
        labels=_flat_labels(meta.labels),
        resource_version=meta.resourceVersion,
        owner_kind=sys.intern(owner_kind),
        owner_name=sys.intern(owner_name),
        unusable_ips=unusable,
    )


def decode_namespace(data: bytes | dict[str, Any]) -> Namespace:
    """Decode a Namespace from JSON bytes (or a parsed dict)."""
    wire = decode_wire("Namespace", data, _ns_decoder, _NamespaceWire)
    meta = wire.metadata
    if not meta.name:
        raise DecodeError("Namespace", "", "$.metadata.name", "missing")
    return Namespace(
        name=sys.intern(meta.name),
        uid=meta.uid,
        observe=_observed(meta.annotations),
        phase=(wire.status or _NamespaceStatus()).phase,
        labels=_flat_labels(meta.labels),
        resource_version=meta.resourceVersion,
    )


def decode_node(data: bytes | dict[str, Any]) -> Node:
    """Decode a Node from JSON bytes (or a parsed dict): its InternalIP and ExternalIP addresses."""
    wire = decode_wire("Node", data, _node_decoder, _NodeWire)
    meta = wire.metadata
    if not meta.name:
        raise DecodeError("Node", "", "$.metadata.name", "missing")
    internal: list[str] = []
    external: list[str] = []
    for entry in (wire.status or _NodeStatus()).addresses or ():
        found = {"InternalIP": internal, "ExternalIP": external}.get(entry.type)
        if found is None:  # Hostname, InternalDNS, ExternalDNS: names, not addresses
            continue
        try:
            ip = canonical_ip(entry.address)
        except ValueError:
            raise DecodeError("Node", meta.name, "$.status.addresses",
                              f"invalid {entry.type} {entry.address[:64]!r}") from None
        if "%" not in ip and ip not in found:  # a zone-scoped IPv6 address is not reachable from other nodes
            found.append(ip)
    return Node(name=meta.name, internal_ips=tuple(internal), external_ips=tuple(external),
                resource_version=meta.resourceVersion)


def decode_wire(
    kind: str, data: bytes | dict[str, Any], decoder: msgspec.json.Decoder[_T], typ: type[_T]
) -> _T:
    try:
        if isinstance(data, dict):
            return msgspec.convert(data, typ)
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        field, reason = _split_msgspec_error(str(exc))
        raise DecodeError(kind, object_name(data), field, reason) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(kind, "", "$", f"malformed JSON: {exc}") from None


def _split_msgspec_error(message: str) -> tuple[str, str]:
    # msgspec says "Expected `str`, got `int` - at `$.metadata.name`".
    reason, sep, where = message.rpartition(" - at ")
    if not sep:
        return "$", message
    return where.strip("`"), reason


def object_name(data: bytes | dict[str, Any]) -> str:
    try:
        named = msgspec.convert(data, _NameOnly) if isinstance(data, dict) else _name_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ""
    meta = named.metadata
    if meta is None or not isinstance(meta.name, str):
        return ""
    ns = meta.namespace if isinstance(meta.namespace, str) else ""
    return f"{ns}/{meta.name}"[:300] if ns else meta.name[:300]


def _pod_ips(status: _PodStatus, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the pod's usable IPs, the ones podmeter cannot key on). A zone-scoped IPv6 address
    (``fe80::1%eth0``) is an address, but not one a pod can be reached at cluster-wide nor one the
    datapath's 16-byte keys can hold: the pod is treated as not having it (and it is counted)."""
    if status.podIPs:
        raw = [entry.ip for entry in status.podIPs]
        field = "$.status.podIPs"
    elif status.podIP:
        raw = [status.podIP]
        field = "$.status.podIP"
    else:
        return (), ()
    ips: list[str] = []
    unusable: list[str] = []
    for text in raw:
        try:
            ip = text if _CANONICAL_V4.fullmatch(text) else canonical_ip(text)
        except ValueError:
            raise DecodeError("Pod", name, field, f"invalid IP address {text[:64]!r}") from None
        if "%" in ip:
            unusable.append(ip)
        elif ip not in ips:
            ips.append(ip)
    return tuple(ips), tuple(unusable)


def _observed(annotations: _Annotations | None) -> bool:
    return annotations is not None and annotations.observe == "true"


def _flat_labels(labels: dict[str, str] | None) -> tuple[str, ...]:
    if not labels:
        return ()
    flat: list[str] = []
    for key in sorted(labels):
        flat.append(sys.intern(key))
        flat.append(sys.intern(labels[key]))
    return tuple(flat)


def _controller(refs: list[_OwnerRef] | None) -> tuple[str, str]:
    for ref in refs or ():
        if ref.controller:
            return ref.kind, ref.name
    return "", ""


def is_dns1123_label(name: str) -> bool:
    """A valid namespace name: a DNS-1123 label of at most 63 characters."""
    return len(name) <= 63 and _DNS1123_LABEL.fullmatch(name) is not None
