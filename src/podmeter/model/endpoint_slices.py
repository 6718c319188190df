"""Cluster-wide endpoints: the pods of the cluster, batched into ``PodSlice`` objects, and read back.

The operator's leader publishes, for every pod that has an IP and holds an identity, one endpoint (IPs,
namespace, name, workload, node, identity ID) in a ``PodSlice`` custom resource of ``podmeter.io``; every
agent watches the slices and keeps an IP -> endpoint cache, which names the far end of its flows.

Level-triggered, like the rest of podmeter: :func:`desired_slices` is a pure function of the pods and the
identities, the operator diffs it against the slices the API server holds and writes only what differs,
and stale slices are deleted by the same diff.

* **Which slice.** An endpoint goes to bucket ``crc32(uid) mod N``: a pod never moves between slices while
  ``N`` stays, so a pod's change rewrites one slice. ``N`` is a power of two chosen so that slices hold
  about :data:`TARGET` endpoints; it doubles only when slices would hold more than :data:`MOST`, halves
  only when they would hold fewer than :data:`FEWEST` (hysteresis: a cluster hovering around a boundary
  does not reshuffle). A new leader starts from the number of slices it finds.
* **Identities in the slices.** Each slice carries the labels of the identities its endpoints use. Why not
  one object per identity: an agent then needs one watch, and never holds an endpoint whose identity's
  labels it has not got yet (two watches would race); the cost is a label set repeated in the slices where
  its pods fell, which the hash spreads, bounded by ``N`` copies.

Next stage: ``runtime.endpoint_publisher`` (operator) writes the slices; ``ClusterEndpoints`` (agent) reads
them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec

from podmeter.model.compaction import PeakTracker
from podmeter.model.endpoints import Endpoint
from podmeter.model.identity import IdentityKey
from podmeter.model.interest import holds_address
from podmeter.model.records import DecodeError, Pod
from podmeter.model.workloads import workload_of

GROUP, VERSION, PLURAL, KIND = "podmeter.io", "v1alpha1", "podslices", "PodSlice"
NAME_PREFIX = "pods-"
TARGET, MOST, FEWEST = 100, 200, 25
MAX_SLICE_ENDPOINTS = 1000  # what the CRD's schema allows in one slice (and what an agent accepts)

# identity_of(pod) -> (ID, key) of the identity the pod holds, or None (none allocated yet).
IdentityOf = Callable[[Pod], "tuple[int, IdentityKey] | None"]


def slice_count(endpoints: int, current: int) -> int:
    """How many slices ``endpoints`` endpoints go into, given ``current`` slices now (see the docstring)."""
    count = max(1, current)
    count = 1 << (count - 1).bit_length()  # a power of two
    while endpoints > count * MOST:
        count *= 2
    while count > 1 and endpoints < count * FEWEST:
        count //= 2
    return count


def slice_name(bucket: int, count: int) -> str:
    return f"{NAME_PREFIX}{count}-{bucket}"


def bucket_of(uid: str, count: int) -> int:
    return zlib.crc32(uid.encode()) % count


def endpoint_json(pod: Pod, identity: int) -> dict[str, Any]:
    kind, name = workload_of(pod)
    return {"uid": pod.uid, "namespace": pod.namespace, "name": pod.name, "ips": list(pod.ips),
            "workloadKind": kind, "workload": name, "node": pod.node_name, "identity": identity}


def desired_slices(pods: Iterable[Pod], identity_of: IdentityOf, current: int) -> dict[str, dict[str, Any]]:
    """Slice name -> its ``spec``, for the pods that have an IP and an identity. Deterministic: the same
    pods and identities always give the same slices, endpoints sorted by UID."""
    published: list[tuple[Pod, int, IdentityKey]] = []
    for pod in pods:
        if not holds_address(pod):
            continue
        found = identity_of(pod)
        if found is not None:
            published.append((pod, found[0], found[1]))
    count = slice_count(len(published), current)
    buckets: dict[int, list[tuple[Pod, int, IdentityKey]]] = {}
    for entry in published:
        buckets.setdefault(bucket_of(entry[0].uid, count), []).append(entry)
    slices: dict[str, dict[str, Any]] = {}
    for bucket, entries in buckets.items():
        entries.sort(key=lambda e: e[0].uid)
        identities = {str(ident): {"namespace": key.namespace, "labels": key.label_dict()}
                      for _, ident, key in entries}
        slices[slice_name(bucket, count)] = {
            "endpoints": [endpoint_json(pod, ident) for pod, ident, _ in entries],
            "identities": dict(sorted(identities.items(), key=lambda kv: int(kv[0]))),
        }
    return slices


# --- reading slices back (the agent) -------------------------------------------------------------------


class _WireEndpoint(msgspec.Struct):
    uid: str
    namespace: str
    name: str
    ips: list[str]
    node: str = ""
    workloadKind: str = ""
    workload: str = ""
    identity: int | None = None


class _WireIdentity(msgspec.Struct):
    namespace: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class _WireSpec(msgspec.Struct):
    endpoints: list[_WireEndpoint] = msgspec.field(default_factory=list)
    identities: dict[str, _WireIdentity] = msgspec.field(default_factory=dict)


class _WireMeta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""


class _WireSlice(msgspec.Struct):
    metadata: _WireMeta
    spec: _WireSpec = msgspec.field(default_factory=_WireSpec)


class PodSlice(msgspec.Struct, frozen=True, gc=False):
    """A decoded slice: its endpoints by IP, and the labels of their identities (flat, sorted)."""

    name: str
    resource_version: str
    endpoints: tuple[tuple[str, Endpoint], ...]  # (ip, endpoint), one per IP
    labels: tuple[tuple[int, tuple[str, ...]], ...] = ()


_decoder = msgspec.json.Decoder(_WireSlice)
_intern = sys.intern


class SliceDigest(msgspec.Struct, frozen=True, gc=False):
    """What the publishing operator keeps of a slice it reads back: enough to know whether it must be
    rewritten (the digest of its spec), not the spec itself."""

    name: str
    resource_version: str
    digest: str


def spec_digest(spec: Mapping[str, Any]) -> str:
    """A digest of a slice's spec that does not depend on key order (desired and read-back compare)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class _DigestWire(msgspec.Struct):
    metadata: _WireMeta
    spec: dict[str, Any] = msgspec.field(default_factory=dict)


_digest_decoder = msgspec.json.Decoder(_DigestWire)


def decode_slice_digest(data: bytes | dict[str, Any]) -> SliceDigest:
    try:
        wire = msgspec.convert(data, _DigestWire) if isinstance(data, dict) else _digest_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise DecodeError(KIND, "", "$", str(exc)) from None
    return SliceDigest(wire.metadata.name, wire.metadata.resourceVersion, spec_digest(wire.spec))


_IDENTITY_INTERN_MAX = 1 << 16
_identities: dict[int, int] = {}


def _shared(identity: int | None) -> int | None:
    """One int object per identity number, as strings are interned (a cache holds 100,000s of them);
    bounded, so a hostile slice cannot grow it."""
    if identity is None or len(_identities) >= _IDENTITY_INTERN_MAX:
        return identity
    return _identities.setdefault(identity, identity)


def decode_slice(data: bytes | dict[str, Any], labels: bool = False) -> PodSlice:
    """A ``PodSlice`` object -> :class:`PodSlice`; :class:`DecodeError` names what is wrong. The identities'
    labels are kept only if asked (``labels``): an agent names flows with IDs and does not need them."""
    try:
        wire = msgspec.convert(data, _WireSlice) if isinstance(data, dict) else _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise DecodeError(KIND, "", "$", str(exc)) from None
    name = wire.metadata.name
    if len(wire.spec.endpoints) > MAX_SLICE_ENDPOINTS:
        raise DecodeError(KIND, name, "$.spec.endpoints", f"more than {MAX_SLICE_ENDPOINTS} endpoints")
    endpoints: list[tuple[str, Endpoint]] = []
    for e in wire.spec.endpoints:
        endpoint = Endpoint(_intern(e.namespace), e.name, _intern(e.workloadKind), _intern(e.workload),
                            _intern(e.node), "", _shared(e.identity), name)
        endpoints.extend((ip, endpoint) for ip in e.ips)
    labels_of: list[tuple[int, tuple[str, ...]]] = []
    for ident, identity in wire.spec.identities.items() if labels else ():
        if ident.isdigit():
            labels_of.append((int(ident), tuple(x for k in sorted(identity.labels) for x in (k, identity.labels[k]))))
    return PodSlice(name, wire.metadata.resourceVersion, tuple(endpoints), tuple(labels_of))


class ClusterEndpoints:
    """IP -> endpoint for every pod the stored slices publish (the agent's cluster-wide cache).

    Invariants: ``_by_ip[ip]`` is the endpoint of ``ip`` in the slice named by its ``slice`` field, and that
    slice is stored and lists ``ip``; an IP listed by two slices (a pod moved between slices, seen mid-way) belongs
    to the slice stored last, and goes back to the other when that one goes. So the cache is exactly the
    union of the stored slices, whatever order their changes came in.
    """

    def __init__(self) -> None:
        self.slices: dict[str, PodSlice] = {}
        self._by_ip: dict[str, Endpoint] = {}
        self._peak = PeakTracker()

    def __len__(self) -> int:
        return len(self._by_ip)

    def endpoint(self, ip: str) -> Endpoint | None:
        return self._by_ip.get(ip)

    def is_local(self, ip: str) -> bool:
        return False  # the node's own pods are named by its store, before this cache is asked

    def labels(self, identity: int) -> dict[str, str]:
        """The labels of an identity, from any slice that carries them (asked on request only: a scan)."""
        for stored in self.slices.values():
            for ident, flat in stored.labels:
                if ident == identity:
                    return dict(zip(flat[::2], flat[1::2], strict=True))
        return {}

    def items(self) -> Iterator[tuple[str, Endpoint]]:
        return iter(self._by_ip.items())

    def changed(self, old: PodSlice | None, new: PodSlice | None) -> None:
        """A store change of one slice (the store's ``changed`` callback)."""
        name = new.name if new is not None else old.name if old is not None else ""
        if new is None:
            self.slices.pop(name, None)
        else:
            self.slices[name] = new
        by_ip = self._by_ip
        for ip, _ in old.endpoints if old is not None else ():
            current = by_ip.get(ip)
            if current is not None and current.slice == name:
                del by_ip[ip]
        for ip, endpoint in new.endpoints if new is not None else ():
            by_ip[ip] = endpoint
        if old is not None and (new is None or old.endpoints != new.endpoints):
            self._refill_from_others(old, name)
        self._peak.grew_to(len(self._by_ip))
        if self._peak.should_rebuild(len(self._by_ip)):
            self._by_ip, self.slices = dict(self._by_ip), dict(self.slices)

    def renames(self, old: PodSlice | None, new: PodSlice | None) -> bool:
        """Whether replacing ``old`` by ``new`` would change the endpoint of any IP."""
        before = dict(old.endpoints) if old is not None else {}
        after = dict(new.endpoints) if new is not None else {}
        return before != after

    def _refill_from_others(self, gone: PodSlice, name: str) -> None:
        """IPs ``gone`` listed that another stored slice also lists go to that slice."""
        orphans = {ip for ip, _ in gone.endpoints if ip not in self._by_ip}
        if not orphans:
            return
        for other in self.slices.values():
            if other.name == name:
                continue
            for ip, endpoint in other.endpoints:
                if ip in orphans:
                    self._by_ip[ip] = endpoint


def expected_endpoints(pods: Iterable[Pod], identities: Mapping[str, int]) -> dict[str, tuple[str, str, int]]:
    """IP -> (namespace, pod, identity) that a cache must hold for these pods (I7, the lab's check):
    every pod that holds an address and whose UID has an identity in ``identities``."""
    out: dict[str, tuple[str, str, int]] = {}
    for pod in pods:
        if holds_address(pod) and pod.uid in identities:
            for ip in pod.ips:
                out[ip] = (pod.namespace, pod.name, identities[pod.uid])
    return out
