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

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

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
        if limit < 1:
            raise ValueError("the flow series limit is at least 1")
        self.node = node
        self.limit = limit
        self.idle = idle
        self.pairs: dict[WorkloadPair, PairTraffic] = {}
        self.folded = 0  # records counted in the overflow series because the limit was reached
        self._peak = PeakTracker()

    def add(self, records: Iterable[FlowRecord], now: float) -> None:
        for record in records:
            if not self.counts_here(record):
                continue
            pair = self.pair_of(record)
            traffic = self.pairs.get(pair)
            if traffic is None:
                if len(self.pairs) - (OVERFLOW in self.pairs) >= self.limit:
                    self.folded += 1
                    pair = OVERFLOW
                    traffic = self.pairs.get(pair)
                if traffic is None:
                    traffic = self.pairs[pair] = PairTraffic()
                    self._peak.grew_to(len(self.pairs))
            traffic.packets += record.packets
            traffic.bytes += record.bytes
            traffic.last_active = now

    def counts_here(self, record: FlowRecord) -> bool:
        """Count at the from-pod point; at the to-pod point only what no pod of this node sent."""
        if record.observation is Observation.FROM_POD:
            return True
        source = record.source.endpoint
        return source is None or source.node != self.node

    @staticmethod
    def pair_of(record: FlowRecord) -> WorkloadPair:
        return WorkloadPair(*_workload(record.source.endpoint), *_workload(record.destination.endpoint),
                            protocol_name(record.protocol))

    def expire(self, now: float) -> int:
        """Drop the pairs idle for longer than ``idle``; returns how many."""
        idle = [pair for pair, traffic in self.pairs.items() if now - traffic.last_active >= self.idle]
        for pair in idle:
            del self.pairs[pair]
        if idle and self._peak.should_rebuild(len(self.pairs)):
            self.pairs = dict(self.pairs)
        return len(idle)

    def values(self) -> Iterator[tuple[WorkloadPair, PairTraffic]]:
        return iter(self.pairs.items())
