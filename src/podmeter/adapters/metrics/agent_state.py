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

from podmeter.adapters.metrics.families import by_one, counter, gauge, labelled_gauge, with_zeros
from podmeter.model.datapath import LinkCounts

DRIFT_KINDS = ("leaked", "missing")  # what a resync repairs (runtime.writer): exported from the start as 0


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
    watch_failures: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (resource, cause)
    store_objects: Mapping[str, int] = field(default_factory=dict)  # resource
    decode_errors: Mapping[str, int] = field(default_factory=dict)  # resource
    resyncs: int = 0
    ready: bool = False
    unusable_pod_ips: int = 0  # addresses of stored pods podmeter cannot key on (zone-scoped IPv6)
    task_failures: Mapping[str, int] = field(default_factory=dict)  # task name
    flows: FlowSnapshot | None = None  # None: the datapath aggregates no flows
    pods_without_link: int | None = None  # observed pods whose IPs reach no counted link; None: no links
    links: LinkCounts | None = None  # the node's links seen, attached, skipped; None: no links (memory)


@dataclass(frozen=True)
class FlowSnapshot:
    """The flow pipeline's numbers (docs/flows.md)."""

    lost_packets: int = 0  # kernel: packets not aggregated, the flow map being full
    capacity: int = 0
    drains: int = 0
    drain_errors: int = 0
    entries: int = 0  # flow entries drained since the start
    last_drain_entries: int = 0
    last_drain_seconds: float = 0.0
    series: int = 0
    series_folded: int = 0  # records counted in the overflow series (the series limit was reached)
    followers: int = 0
    followers_cut_off: int = 0  # reads cut off because their client did not read
    streams: int = 0  # reads open (following or not)
    streams_refused: int = 0
    followers_evicted: int = 0
    reader_gaps: int = 0
    reader_lost: int = 0  # records followers did not see: the ring overwrote them first
    buffer_dropped: int = 0  # records that fell out of the ring of recent flows
    unnamed: int = 0  # entries named world because who held their IPs when counted cannot be known


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
                      by_one(with_zeros(s.drift_repaired, DRIFT_KINDS)))
        yield counter("podmeter_resyncs", "Periodic resyncs of the filter against the kernel.", value=s.resyncs)
        yield gauge("podmeter_unusable_pod_ips", "Addresses of stored pods podmeter ignores (zone-scoped IPv6).",
                    s.unusable_pod_ips)
        yield counter("podmeter_task_failures", "Long-running tasks that died of an unexpected error.", ("task",),
                      by_one(s.task_failures))
        if s.pods_without_link is not None:
            yield gauge("podmeter_pods_without_link",
                        "Observed pods whose IPs reach no link the datapath is attached to (not counted).",
                        s.pods_without_link)
        if s.links is not None:
            yield from link_families(s.links)
        yield from watch_families(s.watch_events, s.relists, s.decode_errors, s.store_objects, s.watch_failures)
        if s.flows is not None:
            yield from flow_families(s.flows)


def link_families(links: LinkCounts) -> Iterator[Metric]:
    yield gauge("podmeter_links_seen", "Links that could be a pod's: a veth or netkit whose peer is in another "
                "network namespace.", links.seen)
    yield gauge("podmeter_links_attached", "Links the counting programs are attached to.", links.attached)
    yield labelled_gauge("podmeter_links_skipped", "Links seen that the counting programs are not attached to, by "
                         "reason (no_pod: it carries no IP of this node's pods).", "reason", links.skipped)


def flow_families(f: FlowSnapshot) -> Iterator[Metric]:
    yield counter("podmeter_flows_lost_packets", "Packets not aggregated because the kernel flow map was full.",
                  value=f.lost_packets)
    yield gauge("podmeter_flow_map_capacity", "max_entries of the kernel flow map.", f.capacity)
    yield counter("podmeter_flow_drains", "Drains of the kernel flow map.", value=f.drains)
    yield counter("podmeter_flow_drain_errors", "Drains of the kernel flow map that failed.", value=f.drain_errors)
    yield counter("podmeter_flow_entries_drained", "Flow entries drained from the kernel.", value=f.entries)
    yield counter("podmeter_flow_entries_unnamed", "Flow entries named world: who held their IPs when they were "
                  "counted cannot be known (a predecessor's, or a drain that failed before a change).",
                  value=f.unnamed)
    yield gauge("podmeter_flow_last_drain_entries", "Entries the last drain took.", f.last_drain_entries)
    yield gauge("podmeter_flow_last_drain_seconds", "How long the last drain took, naming included.",
                f.last_drain_seconds)
    yield gauge("podmeter_workload_flow_series", "Workload pairs with a series.", f.series)
    yield counter("podmeter_workload_flow_series_folded", "Flow records counted in the overflow series.",
                  value=f.series_folded)
    yield gauge("podmeter_flow_followers", "Readers following the flows.", f.followers)
    yield counter("podmeter_flow_followers_cut_off", "Reads of the flows cut off because their client read "
                  "nothing for the write timeout.", value=f.followers_cut_off)
    yield gauge("podmeter_flow_streams", "Reads of the flows open (/debug/flows and GetFlows, following or not).",
                f.streams)
    yield counter("podmeter_flow_streams_refused", "Reads of the flows refused: every slot taken.",
                  value=f.streams_refused)
    yield counter("podmeter_flow_followers_evicted", "Idle followers that yielded their slot to a new follower.",
                  value=f.followers_evicted)
    yield counter("podmeter_flow_reader_gaps", "Gaps told to followers: records the ring overwrote before they "
                  "read them.", value=f.reader_gaps)
    yield counter("podmeter_flow_reader_lost_records", "Records followers did not see (in gaps).",
                  value=f.reader_lost)
    yield counter("podmeter_flow_buffer_dropped", "Flow records that fell out of the ring of recent flows.",
                  value=f.buffer_dropped)


def watch_families(events: Mapping[tuple[str, str], int], relists: Mapping[tuple[str, str], int],
                   decode_errors: Mapping[str, int], store_objects: Mapping[str, int],
                   failures: Mapping[tuple[str, str], int] | None = None) -> Iterator[Metric]:
    """The reflectors' and stores' series, the same for the agent and the operator."""
    yield counter("podmeter_watch_failures", "Failed lists and watches by cause (StreamStalled: a watch that "
                  "sent nothing, not even a bookmark, within its progress deadline; http_NNN; TransportError).",
                  ("resource", "cause"), failures or {})
    yield counter("podmeter_watch_events", "Watch events received.", ("resource", "type"), events)
    yield counter("podmeter_watch_relists", "Lists and relists.", ("resource", "reason"), relists)
    yield counter("podmeter_decode_errors", "Objects skipped because they could not be decoded.",
                  ("resource",), by_one(with_zeros(decode_errors, store_objects)))  # 0 for each watched one
    yield labelled_gauge("podmeter_store_objects", "Objects in the store.", "resource", store_objects)
