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

The agent adds a drain's entries without making a record of each (:class:`DrainTotals`,
:meth:`WorkloadFlows.add_totals`: per pair of addresses first, then per pair of workloads); :meth:`add`
does the same from records, by the same rule (a property test holds the two equal).

Pure and synchronous; the metrics adapter reads :meth:`WorkloadFlows.values` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import FlowRecord
from podmeter.model.flows import FlowEntry, Observation, protocol_name

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

    def add(self, key: K, packets: int, size: int, now: float, overflow: Callable[[K], K], *, records: int = 1) -> None:
        """Add the traffic of ``records`` records of ``key`` (one drain's, added up by the caller)."""
        traffic = self.table.get(key)
        if traffic is None:
            if len(self.table) - len(self._overflows) >= self.limit:
                self.folded += records
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


AddressKey = tuple[str, str, int, bool]  # source and destination address, IP protocol, seen leaving a pod


class DrainTotals:
    """One drain's entries added up per pair of addresses, protocol and observation point, in the order of
    their first entry: what the series count, in one pass over the entries (packets, bytes and entries
    per key; the ends are named per key, not per entry)."""

    def __init__(self, entries: Sequence[FlowEntry]) -> None:
        self.entries = entries
        from_pod = Observation.FROM_POD
        totals: dict[AddressKey, list[int]] = {}
        get = totals.get
        for (source, destination, _, _, protocol, observation), (packets, size, _, _, _) in entries:
            key = (source, destination, protocol, observation is from_pod)
            total = get(key)
            if total is None:
                totals[key] = [packets, size, 1]
            else:
                total[0] += packets
                total[1] += size
                total[2] += 1
        self.by_addresses = totals

    def without_twins(self, keys: set[AddressKey]) -> dict[AddressKey, tuple[int, int, int]]:
        """For to-pod ``keys`` whose source has no name: their packets, bytes and entries less those whose
        5-tuple the from-pod point of the same drain saw too (the same packets: see
        :meth:`WorkloadFlows.add_totals`). One pass over the entries, for the drains that need it."""
        triples = {(source, destination, protocol) for source, destination, protocol, _ in keys}
        to_pod: list[tuple[AddressKey, tuple[int, int], int, int]] = []
        sent: set[tuple[str, str, int, int, int]] = set()
        for (source, destination, sport, dport, protocol, observation), (packets, size, _, _, _) in self.entries:
            if (source, destination, protocol) in triples:
                if observation is Observation.FROM_POD:
                    sent.add((source, destination, sport, dport, protocol))
                else:
                    to_pod.append(((source, destination, protocol, False), (sport, dport), packets, size))
        out = {key: (0, 0, 0) for key in keys}
        for key, (sport, dport), packets, size in to_pod:
            if (key[0], key[1], sport, dport, key[2]) not in sent:
                counted = out[key]
                out[key] = (counted[0] + packets, counted[1] + size, counted[2] + 1)
        return out


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
        """Add one drain's records. Records are added up per pair of endpoint objects and protocol first (a
        drain names every end of one IP, and every IP of one pod, with one endpoint object), so the table
        sees one addition per pair that talked, not one per record: the same sums, the same order of new
        pairs (their first record's), and ``folded`` still counts records.

        Counted at the from-pod point; at the to-pod point only what no pod of this node sent: a source
        named on another node, or a source without a name (world, or an end whose holder cannot be known,
        e.g. a predecessor's) whose packets the from-pod point of the same drain did not see."""
        batch = records if isinstance(records, list) else list(records)
        sent_here = sent_from_pods(batch)
        node, from_pod = self.node, Observation.FROM_POD
        totals: dict[tuple[int, int, int], list[Any]] = {}
        for record in batch:
            source = record.source.endpoint
            if record.observation is not from_pod and (
                    source.node == node if source is not None else flow_tuple(record) in sent_here):
                continue  # counted where it left a pod of this node
            ends = (id(source), id(record.destination.endpoint), record.protocol)
            total = totals.get(ends)
            if total is None:
                totals[ends] = [record, record.packets, record.bytes, 1]
            else:
                total[1] += record.packets
                total[2] += record.bytes
                total[3] += 1
        add, pair_of = self.series.add, self.pair_of
        for first, packets, size, count in totals.values():
            add(pair_of(first), packets, size, now, _to_overflow, records=count)

    def add_totals(self, drain: DrainTotals, names: Mapping[str, Endpoint | None], now: float) -> None:
        """Add one drain's entries, their ends named by ``names`` (the drain's ``EndpointCache``): what
        :meth:`add` does with their records, without making them. One addition per key of
        :class:`DrainTotals` (then per pair of workloads), not per entry."""
        node, totals = self.node, drain.by_addresses
        twins = {key for key in totals if not key[3] and names[key[0]] is None and (*key[:3], True) in totals}
        less_twins = drain.without_twins(twins) if twins else {}
        pairs: dict[tuple[int, int, int], list[Any]] = {}
        for key, counted in totals.items():
            source_ip, destination_ip, protocol, from_pod = key
            source = names[source_ip]
            if not from_pod and (source.node == node if source is not None  # counted where it left a pod here
                                 else key in less_twins and not less_twins[key][2]):
                continue
            packets, size, count = less_twins.get(key, counted)
            destination = names[destination_ip]
            ends = (id(source), id(destination), protocol)
            pair = pairs.get(ends)
            if pair is None:
                pairs[ends] = [source, destination, protocol, packets, size, count]
            else:
                pair[3] += packets
                pair[4] += size
                pair[5] += count
        add = self.series.add
        for source, destination, protocol, packets, size, count in pairs.values():
            add(_pair(source, destination, protocol), packets, size, now, _to_overflow, records=count)

    @staticmethod
    def pair_of(record: FlowRecord) -> WorkloadPair:
        return _pair(record.source.endpoint, record.destination.endpoint, record.protocol)

    def expire(self, now: float) -> int:
        """Drop the pairs idle for ``idle`` seconds or more; returns how many."""
        return self.series.expire(now)

    def values(self) -> Iterator[tuple[WorkloadPair, PairTraffic]]:
        return self.series.values()


FlowTuple = tuple[str, str, int, int, int]


def flow_tuple(record: FlowRecord) -> FlowTuple:
    return record.source.ip, record.destination.ip, record.source.port, record.destination.port, record.protocol


def sent_from_pods(records: Iterable[FlowRecord]) -> frozenset[FlowTuple]:
    """The flows of a drain seen leaving a pod of this node whose source has no name: the to-pod twins
    of their packets (the same packet entering another pod of the node, its source named the same way in
    the same drain, so without a name too) are not counted again. A named source needs no such set: its
    endpoint says whether it is of this node."""
    return frozenset(flow_tuple(r) for r in records
                     if r.source.endpoint is None and r.observation is Observation.FROM_POD)


def _pair(source: Endpoint | None, destination: Endpoint | None, protocol: int) -> WorkloadPair:
    return WorkloadPair(*_workload(source), *_workload(destination), protocol_name(protocol))


def _to_overflow(pair: WorkloadPair) -> WorkloadPair:
    return OVERFLOW
