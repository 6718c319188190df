"""Label-set identities, pure: which labels count, the key of a label set, per-pod references, free IDs.

An *identity key* is a pod's namespace plus its labels after filtering, sorted by label key. Labels that
are unique per pod or per controller run (``job-name``, ``controller-uid``, ``pod-template-hash`` ...)
are filtered out by default, so the pods of one CronJob share one identity instead of taking a new one per
run (failure mode F13 in docs/design.md).

Nothing here does I/O; everything is synchronous and deterministic so that Hypothesis can drive it.
The backends (memory, etcd) and the operator live in the layers above and call into this module.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from podmeter.model.compaction import PeakTracker
from podmeter.model.refs import Refs

DEFAULT_EXCLUDED_LABELS: tuple[str, ...] = (
    "pod-template-hash",
    "controller-revision-hash",
    "controller-uid",
    "batch.kubernetes.io/controller-uid",
    "job-name",
    "batch.kubernetes.io/job-name",
    "batch.kubernetes.io/job-completion-index",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
)

# Cilium reserves 1-255; a cluster-wide identity is a 16-bit number above that.
DEFAULT_FIRST_ID = 256
DEFAULT_LAST_ID = 65535



class IdentityError(Exception):
    """Base class of identity errors that the operator counts instead of crashing on."""


class IdentityExhausted(IdentityError):
    """Every ID of the configured range is in use: the label set gets no identity until one is freed."""

    def __init__(self, first: int, last: int) -> None:
        super().__init__(f"identity range {first}-{last} exhausted: all {last - first + 1} IDs are in use")
        self.first = first
        self.last = last


class BadIdentityKey(IdentityError):
    """An encoded identity key (read back from a store) is malformed."""


@dataclass(frozen=True, slots=True)
class LabelFilter:
    """Which label keys take part in an identity.

    A label key is excluded iff it equals an entry of ``excluded``, or an entry ends with ``*`` and the
    key starts with the entry without its ``*`` (a prefix rule, e.g. ``example.com/*``).
    """

    excluded: frozenset[str] = frozenset(DEFAULT_EXCLUDED_LABELS)

    @classmethod
    def configure(cls, add: Iterable[str] = (), remove: Iterable[str] = ()) -> LabelFilter:
        """The default exclusions plus ``add`` minus ``remove``; an empty entry is an error."""
        added, removed = set(add), set(remove)
        for entry in added | removed:
            if not entry or entry == "*":
                raise ValueError(f"label exclusion entry {entry!r} is empty or matches everything")
        return cls(frozenset((set(DEFAULT_EXCLUDED_LABELS) | added) - removed))

    def excludes(self, key: str) -> bool:
        if key in self.excluded:
            return True
        return any(e.endswith("*") and key.startswith(e[:-1]) for e in self.excluded)


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """A namespace and a label set: ``labels`` is a flat tuple ``(k1, v1, k2, v2, ...)`` sorted by key.

    Invariant: label keys are unique and strictly increasing (the constructors below ensure it).
    ``encode()`` is a canonical text form: equal keys encode equally and ``decode(encode(k)) == k``.
    """

    namespace: str
    labels: tuple[str, ...] = ()

    def encode(self) -> str:
        return json.dumps([self.namespace, list(self.labels)], separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def decode(cls, text: str) -> IdentityKey:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise BadIdentityKey(f"identity key {text[:80]!r} is not JSON: {exc}") from None
        if not (
            isinstance(raw, list)
            and len(raw) == 2
            and isinstance(raw[0], str)
            and isinstance(raw[1], list)
            and all(isinstance(x, str) for x in raw[1])
            and len(raw[1]) % 2 == 0
        ):
            raise BadIdentityKey(f"identity key {text[:80]!r} is not [namespace, [k1, v1, ...]]")
        labels: list[str] = raw[1]
        return make_key(raw[0], zip(labels[::2], labels[1::2], strict=True), LabelFilter(frozenset()))

    def label_dict(self) -> dict[str, str]:
        return dict(zip(self.labels[::2], self.labels[1::2], strict=True))

    def __str__(self) -> str:
        pairs = ",".join(f"{k}={v}" for k, v in zip(self.labels[::2], self.labels[1::2], strict=True))
        return f"{self.namespace}:{{{pairs}}}"


def make_key(namespace: str, labels: Iterable[tuple[str, str]], label_filter: LabelFilter) -> IdentityKey:
    """The identity key of a pod: its namespace and its kept labels sorted by key."""
    kept = sorted((k, v) for k, v in labels if not label_filter.excludes(k))
    for (a, _), (b, _) in itertools.pairwise(kept):
        if a == b:
            raise BadIdentityKey(f"label {a!r} appears twice")
    return IdentityKey(namespace, tuple(x for pair in kept for x in pair))


def key_of_flat(namespace: str, flat_labels: tuple[str, ...], label_filter: LabelFilter) -> IdentityKey:
    """:func:`make_key` for labels given flat (``(k1, v1, k2, v2, ...)``), as the slim Pod keeps them."""
    return make_key(namespace, zip(flat_labels[::2], flat_labels[1::2], strict=True), label_filter)


@dataclass(frozen=True, slots=True)
class Crossing:
    """The side effects one reference change asks for: a key that went 0→1 and/or one that went 1→0."""

    acquired: IdentityKey | None = None
    released: IdentityKey | None = None

    def __bool__(self) -> bool:
        return self.acquired is not None or self.released is not None


NO_CROSSING = Crossing()


class PodRefs:
    """References to identity keys, one per pod UID.

    Invariants: a key is in ``counts()`` iff at least one pod UID currently refers to it, and its count
    is the number of such UIDs (:class:`~podmeter.model.refs.Refs` keeps them). A UID refers to at most
    one key, so a duplicate ADDED, a MODIFIED that does not change the key, or a DELETE for an unknown UID
    change nothing. Every key change is reported as a :class:`Crossing` only when a count goes 0→1 or
    1→0. All pods referring to one label set share one key object (``_canonical``).
    """

    def __init__(self) -> None:
        self._pods: dict[str, IdentityKey] = {}
        self._refs: Refs[IdentityKey] = Refs()
        self._canonical: dict[IdentityKey, IdentityKey] = {}
        self._pods_peak = PeakTracker()
        self._canonical_peak = PeakTracker()

    def __len__(self) -> int:
        return len(self._pods)

    def key_of(self, uid: str) -> IdentityKey | None:
        return self._pods.get(uid)

    def count(self, key: IdentityKey) -> int:
        return self._refs.count(key)

    def counts(self) -> dict[IdentityKey, int]:
        return {key: self._refs.count(key) for key in self._refs}

    def keys(self) -> Iterator[IdentityKey]:
        return iter(self._refs)

    def upsert(self, uid: str, key: IdentityKey) -> Crossing:
        old = self._pods.get(uid)
        if old is not None and old == key:
            return NO_CROSSING
        released = self._unref(old, uid) if old is not None else None
        shared = self._canonical.setdefault(key, key)
        self._canonical_peak.grew_to(len(self._canonical))
        acquired = shared if self._refs.add(shared, uid) else None
        self._pods[uid] = shared
        self._pods_peak.grew_to(len(self._pods))
        return Crossing(acquired, released)

    def delete(self, uid: str) -> Crossing:
        old = self._pods.pop(uid, None)
        if old is None:
            return NO_CROSSING
        if self._pods_peak.should_rebuild(len(self._pods)):
            self._pods = dict(self._pods)
        return Crossing(None, self._unref(old, uid))

    def replace_all(self, pods: Mapping[str, IdentityKey]) -> list[Crossing]:
        """Make the references exactly ``pods`` (a relist or a sweep); the crossings that took."""
        out = [c for uid in [u for u in self._pods if u not in pods] if (c := self.delete(uid))]
        out.extend(c for uid, key in pods.items() if (c := self.upsert(uid, key)))
        return out

    def _unref(self, key: IdentityKey, uid: str) -> IdentityKey | None:
        """Drop ``uid``'s reference to ``key``; the key if that was its last reference (1→0)."""
        if not self._refs.discard(key, uid):
            return None
        del self._canonical[key]
        if self._canonical_peak.should_rebuild(len(self._canonical)):
            self._canonical = dict(self._canonical)
        return key


@dataclass(slots=True)
class IdPool:
    """Numeric IDs of ``[first, last]``, handed out lowest free first.

    Invariants: an ID is in use iff it was taken and not released since; ``take()`` returns the lowest
    ID not in use. IDs below ``_next`` that are free are exactly ``_free`` (``_heap`` holds them, plus
    stale entries skipped lazily); ``_next`` drops back while the ID below it is free, so releasing
    everything returns the pool to its initial, empty state.
    """

    first: int = DEFAULT_FIRST_ID
    last: int = DEFAULT_LAST_ID
    _next: int = field(init=False)
    _free: set[int] = field(init=False, default_factory=set)
    _heap: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.last:
            raise ValueError(f"bad identity range {self.first}-{self.last}")
        self._next = self.first

    def __len__(self) -> int:
        return self._next - self.first - len(self._free)

    @property
    def capacity(self) -> int:
        return self.last - self.first + 1

    def in_use(self, ident: int) -> bool:
        return self.first <= ident < self._next and ident not in self._free

    def take(self) -> int:
        while self._heap:
            ident = heapq.heappop(self._heap)
            if ident in self._free:
                self._free.discard(ident)
                return ident
        if self._next > self.last:
            raise IdentityExhausted(self.first, self.last)
        self._next += 1
        return self._next - 1

    def take_specific(self, ident: int) -> None:
        """Mark ``ident`` in use (an ID claimed elsewhere, e.g. by another operator)."""
        if not self.first <= ident <= self.last:
            raise ValueError(f"identity {ident} outside range {self.first}-{self.last}")
        if ident in self._free:
            self._free.discard(ident)
            return
        while self._next < ident:
            self._free.add(self._next)
            heapq.heappush(self._heap, self._next)
            self._next += 1
        self._next = max(self._next, ident + 1)

    def release(self, ident: int) -> None:
        if not self.in_use(ident):
            return
        self._free.add(ident)
        heapq.heappush(self._heap, ident)
        while self._next > self.first and (self._next - 1) in self._free:
            self._next -= 1
            self._free.discard(self._next)
        if len(self._heap) > 2 * len(self._free) + 64:
            self._heap = sorted(self._free)
            self._free = set(self._free)
