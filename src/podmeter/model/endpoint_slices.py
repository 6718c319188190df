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
import ipaddress
import json
import sys
import weakref
import zlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any

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
# What an agent holds of one slice's identities: the operator writes one per identity its endpoints use, and
# Kubernetes labels are short (a key at most 317 bytes with its prefix, a value 63). A slice beyond is refused.
MAX_SLICE_IDENTITIES = MAX_SLICE_ENDPOINTS
MAX_IDENTITY_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 128, 317, 63
MAX_IDENTITY = 2**32 - 1  # the CRD's bound on an endpoint's identity, and the identities' keys
# The most slices the operator writes (819,200 endpoints at MOST each). An agent takes only the names the
# operator gives (``pods-N-B``, N a power of two up to this, B below N): at most 2 * MAX_SLICES - 1 slices,
# whatever else a writer of PodSlices creates.
MAX_SLICES = 4096

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
    return min(count, MAX_SLICES)


def slice_name(bucket: int, count: int) -> str:
    return f"{NAME_PREFIX}{count}-{bucket}"


def is_slice_name(name: str) -> bool:
    """Whether ``name`` is one :func:`slice_name` gives (see :data:`MAX_SLICES`)."""
    count, dash, bucket = name.removeprefix(NAME_PREFIX).partition("-")
    if not (name.startswith(NAME_PREFIX) and dash and _small_decimal(count) and _small_decimal(bucket)):
        return False
    n, b = int(count), int(bucket)
    return 0 < n <= MAX_SLICES and n & (n - 1) == 0 and b < n


def _small_decimal(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isascii() and text.isdecimal() and (text == "0" or text[0] != "0")


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
    identity: Annotated[int, msgspec.Meta(ge=1, le=MAX_IDENTITY)] | None = None


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


class LabelSet(msgspec.Struct, frozen=True, weakref=True):
    """An identity's labels (flat, sorted: k1, v1, k2, v2, ...). One object per distinct (identity, labels)
    in the process, however many slices carry it (see :func:`label_set`)."""

    identity: int
    flat: tuple[str, ...]

    def as_dict(self) -> dict[str, str]:
        return dict(zip(self.flat[::2], self.flat[1::2], strict=True))


# Shared label sets. Weak: an entry goes with the last slice that holds it, so nothing outlives the slices.
_label_sets: weakref.WeakValueDictionary[tuple[int, tuple[str, ...]], LabelSet] = weakref.WeakValueDictionary()


def label_set(identity: int, labels: Mapping[str, str]) -> LabelSet:
    """The one :class:`LabelSet` of these labels (a slice repeats the labels of the identities its pods
    use: shared, each slice costs a pointer per identity, not a copy)."""
    flat = tuple(_intern(x) for k in sorted(labels) for x in (k, labels[k]))
    found = _label_sets.get((identity, flat))
    if found is None:
        found = _label_sets[identity, flat] = LabelSet(identity, flat)
    return found


class PodSlice(msgspec.Struct, frozen=True, gc=False):
    """A decoded slice, kept in columns: row ``i`` is the address ``ips[i]`` (packed, 4 or 16 bytes; sorted,
    one row per address) of the pod ``pods[i]``, which runs on ``nodes[i]`` and belongs to ``owners[i]``
    (``namespace/kind/workload/identity``, see :func:`owner_key`).

    Why columns and not one record per endpoint: an agent holds every pod of the cluster (100,000s). A
    record per row cost its header and a pointer per field (80 bytes), a pair per address 56 more; here a
    row costs a pointer per column, the strings the columns share are interned (the interpreter frees them
    with their last user), and :class:`Endpoint` records are made when a flow end is named (once per address
    per drain). ``agent_endpoint_bytes_per_entry`` in ``bench.cluster`` measures it."""

    name: str
    resource_version: str
    ips: tuple[bytes, ...] = ()
    pods: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    labels: tuple[LabelSet, ...] = ()

    def row(self, packed: bytes) -> int:
        """The row of a packed address this slice lists, -1 if it lists none."""
        i = bisect_left(self.ips, packed)
        return i if i < len(self.ips) and self.ips[i] == packed else -1

    def endpoint_at(self, i: int) -> Endpoint:
        namespace, kind, rest = self.owners[i].split("/", 2)
        workload, _, identity = rest.rpartition("/")
        return Endpoint(namespace, self.pods[i], kind, workload, self.nodes[i], "",
                        int(identity) if identity else None)

    def endpoints(self) -> list[tuple[str, Endpoint]]:
        """(IP, endpoint) for every row, in row order."""
        return [(unpack_ip(ip), self.endpoint_at(i)) for i, ip in enumerate(self.ips)]

    def same_rows(self, other: PodSlice) -> bool:
        return (self.ips, self.pods, self.owners, self.nodes) == (other.ips, other.pods, other.owners,
                                                                  other.nodes)


def owner_key(namespace: str, kind: str, workload: str, identity: int | None) -> str:
    """What the pods of one workload with one identity share, as one interned string (a tuple would need a
    table of its own to be shared). Namespaces and kinds hold no ``/``; the identity is digits, last."""
    return _intern(f"{namespace}/{kind}/{workload}/{'' if identity is None else identity}")


def pack_ip(ip: str) -> bytes:
    """A slice's IP in packed form (4 or 16 bytes), checked as the API server checks pod IPs (ValueError;
    a zone-scoped IPv6 address is none: it names no pod)."""
    if "%" in ip:
        raise ValueError(ip)
    return ipaddress.ip_address(ip).packed


def lookup_key(ip: str) -> bytes | None:
    """The packed form of an address a flow names (the agent's own canonical text), None if it is none.
    IPv4 without the ``ipaddress`` parser: a flow end is looked up once per drain, 18,000 a drain."""
    if ":" in ip:
        if "%" in ip:
            return None
        try:
            return ipaddress.IPv6Address(ip).packed
        except ValueError:
            return None
    try:
        packed = bytes(map(int, ip.split(".")))
    except ValueError:
        return None
    return packed if len(packed) == 4 else None


def unpack_ip(packed: bytes) -> str:
    return ".".join(map(str, packed)) if len(packed) == 4 else str(ipaddress.IPv6Address(packed))


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


def decode_slice(data: bytes | dict[str, Any]) -> PodSlice:
    """A ``PodSlice`` object -> :class:`PodSlice`; :class:`DecodeError` names what is wrong. The identities'
    labels are kept, shared (:func:`label_set`). An address listed twice belongs to the endpoint listed last
    (the pod it was given to most recently)."""
    try:
        wire = msgspec.convert(data, _WireSlice) if isinstance(data, dict) else _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise DecodeError(KIND, "", "$", str(exc)) from None
    name = wire.metadata.name
    if not is_slice_name(name):
        raise DecodeError(KIND, name[:64], "$.metadata.name", f"not a name the operator gives (pods-N-B, N a power "
                          f"of two up to {MAX_SLICES}, B below N)")
    if len(wire.spec.endpoints) > MAX_SLICE_ENDPOINTS:
        raise DecodeError(KIND, name, "$.spec.endpoints", f"more than {MAX_SLICE_ENDPOINTS} endpoints")
    rows: dict[bytes, tuple[str, str, str]] = {}
    for n, e in enumerate(wire.spec.endpoints):
        if "/" in e.namespace or "/" in e.workloadKind:
            raise DecodeError(KIND, name, f"$.spec.endpoints[{n}]", "a namespace or kind with '/'")
        row = (e.name, owner_key(e.namespace, e.workloadKind, e.workload, e.identity), _intern(e.node))
        for m, ip in enumerate(e.ips):
            try:
                rows[pack_ip(ip)] = row
            except ValueError:
                raise DecodeError(KIND, name, f"$.spec.endpoints[{n}].ips[{m}]", f"not an IP: {ip!r}") from None
    ordered = sorted(rows.items())
    labels_of = _identity_labels(name, wire.spec.identities)
    return PodSlice(name, wire.metadata.resourceVersion, tuple(ip for ip, _ in ordered),
                    tuple(r[0] for _, r in ordered), tuple(r[1] for _, r in ordered),
                    tuple(r[2] for _, r in ordered), tuple(labels_of))


def identity_id(key: str) -> int | None:
    """An identities key as the operator writes it (decimal ASCII, 1..2^32-1) -> its ID, else None. Not
    ``str.isdigit`` and ``int``: those admit other scripts' digits ("²") and keys of thousands of digits."""
    if not 0 < len(key) <= 10 or not key.isascii() or not key.isdecimal() or key[0] == "0":
        return None
    ident = int(key)
    return ident if ident <= MAX_IDENTITY else None


def _identity_labels(name: str, identities: Mapping[str, _WireIdentity]) -> list[LabelSet]:
    if len(identities) > MAX_SLICE_IDENTITIES:
        raise DecodeError(KIND, name, "$.spec.identities", f"more than {MAX_SLICE_IDENTITIES} identities")
    labels_of = []
    for key, identity in identities.items():
        path = f"$.spec.identities[{key[:24]!r}]"
        ident = identity_id(key)
        if ident is None:
            raise DecodeError(KIND, name, path, f"not an identity ID (decimal, 1 to {MAX_IDENTITY})")
        labels = identity.labels
        if len(labels) > MAX_IDENTITY_LABELS:
            raise DecodeError(KIND, name, f"{path}.labels", f"more than {MAX_IDENTITY_LABELS} labels")
        if any(len(k) > MAX_LABEL_KEY or len(v) > MAX_LABEL_VALUE for k, v in labels.items()):
            raise DecodeError(KIND, name, f"{path}.labels",
                              f"a label longer than Kubernetes allows ({MAX_LABEL_KEY} key, {MAX_LABEL_VALUE} value)")
        labels_of.append(label_set(ident, labels))
    return labels_of


class ClusterEndpoints:
    """IP -> endpoint for every pod the stored slices publish (the agent's cluster-wide cache).

    Invariants: ``_by_ip[packed]`` is a stored slice that lists the address; an address listed by two
    slices (a pod moved between slices, seen mid-way) belongs to the slice stored last, and goes back to
    the other when that one goes. So the cache is exactly the union of the stored slices, whatever order
    their changes came in. An entry costs the address, a dict slot and the slice's columns (no record).
    """

    def __init__(self) -> None:
        self.slices: dict[str, PodSlice] = {}
        self._by_ip: dict[bytes, PodSlice] = {}
        self._peak = PeakTracker()
        # label set -> how many stored slices carry it. A count, not the holders (``model.refs``): the
        # store hands each slice's old and new version, so a slice cannot be counted twice; holder sets
        # cost 18 bytes per cluster pod at 100,000 (bench.cluster).
        self._label_holders: dict[LabelSet, int] = {}
        self._labels: dict[int, dict[LabelSet, None]] = {}  # identity -> its label sets held (the last wins)

    def __len__(self) -> int:
        return len(self._by_ip)

    def endpoint(self, ip: str) -> Endpoint | None:
        packed = lookup_key(ip)
        owner = self._by_ip.get(packed) if packed is not None else None
        return None if owner is None or packed is None else owner.endpoint_at(owner.row(packed))

    def is_local(self, ip: str) -> bool:
        return False  # the node's own pods are named by its store, before this cache is asked

    def labels(self, identity: int) -> tuple[str, ...]:
        """The labels of an identity (flat: k1, v1, ...), as the stored slices carry them; () if none does.
        Two slices disagree only mid-way through an identity's reuse: the set stored last answers."""
        held = self._labels.get(identity)
        return next(reversed(held)).flat if held else ()

    def items(self) -> Iterator[tuple[str, Endpoint]]:
        for packed, owner in self._by_ip.items():
            yield unpack_ip(packed), owner.endpoint_at(owner.row(packed))

    def changed(self, old: PodSlice | None, new: PodSlice | None) -> None:
        """A store change of one slice (the store's ``changed`` callback)."""
        name = new.name if new is not None else old.name if old is not None else ""
        if new is None:
            self.slices.pop(name, None)
        else:
            self.slices[name] = new
        by_ip = self._by_ip
        for packed in old.ips if old is not None else ():
            if by_ip.get(packed) is old:
                del by_ip[packed]
        if new is not None:
            by_ip.update(dict.fromkeys(new.ips, new))
        self._hold_labels(old, new)
        if old is not None and (new is None or old.ips != new.ips):
            self._refill_from_others(old)
        self._peak.grew_to(len(by_ip))
        if self._peak.should_rebuild(len(by_ip)):
            self._by_ip, self.slices = dict(by_ip), dict(self.slices)

    def renames(self, old: PodSlice | None, new: PodSlice | None) -> bool:
        """Whether replacing ``old`` by ``new`` would change the endpoint of any IP."""
        if old is None or new is None:
            return bool(old.ips if old is not None else new.ips if new is not None else ())
        return not old.same_rows(new)

    def _hold_labels(self, old: PodSlice | None, new: PodSlice | None) -> None:
        """Count the label sets ``new`` carries and ``old`` no longer does; act on 0→1 and 1→0 only."""
        before = set(old.labels) if old is not None else set()
        after = set(new.labels) if new is not None else set()
        holders = self._label_holders
        for gone in before - after:
            holders[gone] -= 1
            if not holders[gone]:
                del holders[gone]
                held = self._labels[gone.identity]
                del held[gone]
                if not held:
                    del self._labels[gone.identity]
        for came in after - before:
            holders[came] = holders.get(came, 0) + 1
            if holders[came] == 1:
                self._labels.setdefault(came.identity, {})[came] = None

    def _refill_from_others(self, gone: PodSlice) -> None:
        """Addresses ``gone`` listed that another stored slice also lists go to that slice."""
        orphans = {packed for packed in gone.ips if packed not in self._by_ip}
        if not orphans:
            return
        for other in self.slices.values():
            if other.name == gone.name:
                continue
            for packed in orphans.intersection(other.ips):
                self._by_ip[packed] = other


def endpoint_labels(endpoint: Endpoint, pods: Mapping[str, Pod], cluster: ClusterEndpoints) -> tuple[str, ...]:
    """An endpoint's labels (flat): its pod's own when the pod is one this node stores (by UID), else its
    identity's as the slices carry them (the labels the identity is made of, on any node); () if neither."""
    pod = pods.get(endpoint.uid) if endpoint.uid else None
    if pod is not None:
        return pod.labels
    return cluster.labels(endpoint.identity) if endpoint.identity is not None else ()


def expected_endpoints(pods: Iterable[Pod], identities: Mapping[str, int]) -> dict[str, tuple[str, str, int]]:
    """IP -> (namespace, pod, identity) that a cache must hold for these pods (I7, the lab's check):
    every pod that holds an address and whose UID has an identity in ``identities``."""
    out: dict[str, tuple[str, str, int]] = {}
    for pod in pods:
        if holds_address(pod) and pod.uid in identities:
            for ip in pod.ips:
                out[ip] = (pod.namespace, pod.name, identities[pod.uid])
    return out
