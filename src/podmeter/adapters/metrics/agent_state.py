"""The agent's state metrics, computed at scrape time by a custom collector (no gauges kept in sync).

The collector asks for an :class:`AgentSnapshot` on every scrape; the numbers in it are read from the
writer and the reflectors as they are at that moment, so a gauge can never drift from the state it
describes, and a series for a resource or error that never occurred does not exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class AgentSnapshot:
    """What the collector exports. Counters only grow; gauges are current values."""

    filter_entries: int = 0
    filter_desired: int = 0
    filter_capacity: int = 0
    filter_overflow: int = 0
    write_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (op, errno)
    drift_repaired: Mapping[str, int] = field(default_factory=dict)  # kind
    watch_events: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (resource, type)
    relists: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (resource, reason)
    store_objects: Mapping[str, int] = field(default_factory=dict)  # resource
    decode_errors: Mapping[str, int] = field(default_factory=dict)  # resource
    resyncs: int = 0
    ready: bool = False


class AgentStateCollector(Collector):
    """Exports the ``podmeter_*`` state series named in DESIGN.md from a snapshot taken per scrape."""

    def __init__(self, snapshot: Callable[[], AgentSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield _gauge("podmeter_filter_entries", "IPs in the kernel filter map (as written by the agent).",
                     s.filter_entries)
        yield _gauge("podmeter_filter_desired", "IPs of observed pods that should be in the filter.",
                     s.filter_desired)
        yield _gauge("podmeter_filter_capacity", "max_entries of the filter map.", s.filter_capacity)
        yield _gauge("podmeter_filter_overflow", "Desired IPs left out because the filter is full.",
                     s.filter_overflow)
        yield _gauge("podmeter_ready", "1 once the first lists are applied and the datapath is loaded.",
                     int(s.ready))
        yield _counter("podmeter_filter_write_errors", "Failed filter writes.", ("op", "errno"),
                       s.write_errors)
        yield _counter("podmeter_drift_repaired", "Filter entries repaired by a resync.", ("kind",),
                       {(k,): v for k, v in s.drift_repaired.items()})
        yield _counter("podmeter_watch_events", "Watch events received.", ("resource", "type"), s.watch_events)
        yield _counter("podmeter_watch_relists", "Lists and relists.", ("resource", "reason"), s.relists)
        yield _counter("podmeter_decode_errors", "Objects skipped because they could not be decoded.",
                       ("resource",), {(k,): v for k, v in s.decode_errors.items()})
        yield _counter("podmeter_resyncs", "Periodic resyncs of the filter against the kernel.", (),
                       {(): s.resyncs})
        store = GaugeMetricFamily("podmeter_store_objects", "Objects in the agent's store.", labels=["resource"])
        for resource, count in sorted(s.store_objects.items()):
            store.add_metric([resource], count)
        yield store


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, labels: tuple[str, ...],
             values: Mapping[tuple[str, str], int] | Mapping[tuple[str], int] | Mapping[tuple[()], int]
             ) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family
