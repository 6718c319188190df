"""Workload-to-workload traffic: the flow records of a node added up per pair of workloads and protocol.

Granularity is the workload (namespace, kind, name) at both ends and the protocol: never pod IPs or ports,
so the number of series is bounded by the pairs of workloads that talk, not by pods or connections. Two
more bounds:

* a **series limit**: once ``limit`` pairs exist, traffic of any new pair goes into one overflow series
  (workload ``_other_`` at both ends), and ``folded`` counts the records that went there;
* an **idle expiry**: a pair that carried nothing for ``idle`` seconds is dropped (as a pod's series is
  dropped after its grace), so pairs of workloads long gone do not stay; if it talks again, its series
  starts again from zero (a counter reset, which Prometheus' ``rate`` handles).

Each packet is counted once per node: at the point where it leaves a pod of this node, or where it enters
one when it came from elsewhere (another node, the node itself, the world). A packet between two pods of
the node is seen at both points and counted at the first.

Pure and synchronous; the metrics adapter reads :meth:`WorkloadFlows.values` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import FlowRecord
from podmeter.model.flows import Observation, protocol_name

WORLD = ("", "", "world")  # namespace, kind, name of an end no pod holds
OTHER = "_other_"


class WorkloadPair(NamedTuple):
    source_namespace: str
    source_kind: str
    source_workload: str
    destination_namespace: str
    destination_kind: str
    destination_workload: str
    protocol: str


OVERFLOW = WorkloadPair("", "", OTHER, "", "", OTHER, OTHER)


@dataclass(slots=True)
class PairTraffic:
    packets: int = 0
    bytes: int = 0
    last_active: float = 0.0


K = TypeVar("K", bound=Hashable)


class CappedTraffic(Generic[K]):
    """Traffic per key, bounded: at most ``limit`` keys of their own; past it, a new key's traffic goes to
    the overflow key its caller names (``folded`` counts the records that went there). The one table behind
    the workload pairs and Retina's remote-context series.

    Invariants: a key's value only grows while it exists; ``len(table) <= limit + overflow keys``; a key
    that carried nothing for ``idle`` seconds is gone after the next :meth:`expire`, and the table is
    rebuilt when it shrinks far below its peak (``model.compaction``).
    """

    def __init__(self, limit: int, idle: float) -> None:
        if limit < 1:
            raise ValueError("the flow series limit is at least 1")
        self.limit = limit
        self.idle = idle
        self.table: dict[K, PairTraffic] = {}
        self.folded = 0
        self._overflows: set[K] = set()  # overflow keys in the table (not counted against the limit)
        self._peak = PeakTracker()

    def add(self, key: K, packets: int, size: int, now: float, overflow: Callable[[K], K]) -> None:
        traffic = self.table.get(key)
        if traffic is None:
            if len(self.table) - len(self._overflows) >= self.limit:
                self.folded += 1
                key = overflow(key)
                self._overflows.add(key)
                traffic = self.table.get(key)
            if traffic is None:
                traffic = self.table[key] = PairTraffic()
                self._peak.grew_to(len(self.table))
        traffic.packets += packets
        traffic.bytes += size
        traffic.last_active = now

    def expire(self, now: float) -> int:
        """Drop the keys idle for ``idle`` seconds or more; returns how many."""
        idle = [key for key, traffic in self.table.items() if now - traffic.last_active >= self.idle]
        for key in idle:
            del self.table[key]
            self._overflows.discard(key)
        if idle and self._peak.should_rebuild(len(self.table)):
            self.table = dict(self.table)  # give the table's memory back after a peak (F14)
        return len(idle)

    def values(self) -> Iterator[tuple[K, PairTraffic]]:
        return iter(self.table.items())


def _workload(endpoint: Endpoint | None) -> tuple[str, str, str]:
    if endpoint is None:
        return WORLD
    return endpoint.namespace, endpoint.workload_kind, endpoint.workload


class WorkloadFlows:
    """Traffic per :class:`WorkloadPair`, bounded by ``limit`` pairs (plus the overflow series).

    Invariants: every series' value only grows while it exists; ``len(pairs) <= limit + 1``; a record
    is counted once per node (see the module docstring).
    """

    def __init__(self, node: str, limit: int, idle: float) -> None:
        self.node = node
        self.series: CappedTraffic[WorkloadPair] = CappedTraffic(limit, idle)

    @property
    def pairs(self) -> dict[WorkloadPair, PairTraffic]:
        return self.series.table

    @property
    def folded(self) -> int:
        return self.series.folded

    def add(self, records: Iterable[FlowRecord], now: float) -> None:
        series, batch = self.series, list(records)
        sent_here = sent_from_pods(batch)
        for record in batch:
            if self.counts_here(record, sent_here):
                series.add(self.pair_of(record), record.packets, record.bytes, now, _to_overflow)

    def counts_here(self, record: FlowRecord, sent_here: frozenset[FlowTuple] = frozenset()) -> bool:
        """Count at the from-pod point; at the to-pod point only what no pod of this node sent: a source
        named on another node, or a source without a name (world, or an end whose holder cannot be known,
        e.g. a predecessor's) whose packets the from-pod point of the same drain did not see."""
        if record.observation is Observation.FROM_POD:
            return True
        source = record.source.endpoint
        if source is None:
            return flow_tuple(record) not in sent_here
        return source.node != self.node

    @staticmethod
    def pair_of(record: FlowRecord) -> WorkloadPair:
        return WorkloadPair(*_workload(record.source.endpoint), *_workload(record.destination.endpoint),
                            protocol_name(record.protocol))

    def expire(self, now: float) -> int:
        """Drop the pairs idle for ``idle`` seconds or more; returns how many."""
        return self.series.expire(now)

    def values(self) -> Iterator[tuple[WorkloadPair, PairTraffic]]:
        return self.series.values()


FlowTuple = tuple[str, str, int, int, int]


def flow_tuple(record: FlowRecord) -> FlowTuple:
    return record.source.ip, record.destination.ip, record.source.port, record.destination.port, record.protocol


def sent_from_pods(records: Iterable[FlowRecord]) -> frozenset[FlowTuple]:
    """The flows of a drain seen leaving a pod of this node: their to-pod twins are the same packets."""
    return frozenset(flow_tuple(r) for r in records if r.observation is Observation.FROM_POD)


def _to_overflow(pair: WorkloadPair) -> WorkloadPair:
    return OVERFLOW
