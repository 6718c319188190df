"""The agent's state metrics, computed at scrape time by a custom collector (no gauges kept in sync).

The collector asks for an :class:`AgentSnapshot` on every scrape; the numbers in it are read from the
writer and the reflectors as they are at that moment, so a gauge can never drift from the state it
describes, and a series for a resource or error that never occurred does not exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from podmeter.adapters.metrics.families import by_one, counter, gauge, labelled_gauge


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
    """Exports the agent's ``podmeter_*`` state series (docs/metrics.md) from a snapshot taken per scrape."""

    def __init__(self, snapshot: Callable[[], AgentSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield gauge("podmeter_filter_entries", "IPs in the kernel filter map (as written by the agent).",
                    s.filter_entries)
        yield gauge("podmeter_filter_desired", "IPs of observed pods that should be in the filter.",
                    s.filter_desired)
        yield gauge("podmeter_filter_capacity", "max_entries of the filter map.", s.filter_capacity)
        yield gauge("podmeter_filter_overflow", "Desired IPs left out because the filter is full.",
                    s.filter_overflow)
        yield gauge("podmeter_ready", "1 once the first lists are applied and the datapath is loaded.",
                    int(s.ready))
        yield counter("podmeter_filter_write_errors", "Failed filter writes.", ("op", "errno"), s.write_errors)
        yield counter("podmeter_drift_repaired", "Filter entries repaired by a resync.", ("kind",),
                      by_one(s.drift_repaired))
        yield counter("podmeter_resyncs", "Periodic resyncs of the filter against the kernel.", value=s.resyncs)
        yield from watch_families(s.watch_events, s.relists, s.decode_errors, s.store_objects)


def watch_families(events: Mapping[tuple[str, str], int], relists: Mapping[tuple[str, str], int],
                   decode_errors: Mapping[str, int], store_objects: Mapping[str, int]) -> Iterator[Metric]:
    """The reflectors' and stores' series, the same for the agent and the operator."""
    yield counter("podmeter_watch_events", "Watch events received.", ("resource", "type"), events)
    yield counter("podmeter_watch_relists", "Lists and relists.", ("resource", "reason"), relists)
    yield counter("podmeter_decode_errors", "Objects skipped because they could not be decoded.",
                  ("resource",), by_one(decode_errors))
    yield labelled_gauge("podmeter_store_objects", "Objects in the store.", "resource", store_objects)
