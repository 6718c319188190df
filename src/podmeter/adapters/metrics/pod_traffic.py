"""Per-pod traffic series, read from the kernel counters at scrape time.

Series (see docs/metrics.md): ``podmeter_pod_bytes_total`` and ``podmeter_pod_packets_total`` with labels
``namespace``, ``pod``, ``direction``, ``workload_kind``, ``workload_name``; ``podmeter_node_bytes_total`` and
``podmeter_node_packets_total`` with ``direction``. With ``retina_compat`` the same per-pod values are also
exported under Retina's advanced-mode names for dashboards being migrated.

The collector reads; it never changes the ledger (the agent's writer task does that), and it runs on the
writer's event loop thread, so it sees the ledger between two writer steps, never in the middle of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from podmeter.model.traffic import Counters, TrafficLedger

POD_LABELS = ["namespace", "pod", "direction", "workload_kind", "workload_name"]
RETINA_LABELS = ["direction", "ip", "namespace", "podname", "workload_kind", "workload_name"]


class PodTrafficCollector(Collector):
    def __init__(self, ledger: TrafficLedger, read_counters: Callable[[], Counters], retina_compat: bool = False):
        self._ledger = ledger
        self._read_counters = read_counters
        self._retina = retina_compat

    def collect(self) -> Iterator[Metric]:
        kernel = self._read_counters()
        pod_bytes = CounterMetricFamily("podmeter_pod_bytes", "Bytes of an observed pod's traffic.",
                                        labels=POD_LABELS)
        pod_packets = CounterMetricFamily("podmeter_pod_packets", "Packets of an observed pod's traffic.",
                                          labels=POD_LABELS)
        retina_bytes = GaugeMetricFamily("networkobservability_adv_forward_bytes",
                                         "Retina-compatible: forwarded bytes of a pod.", labels=RETINA_LABELS)
        retina_count = GaugeMetricFamily("networkobservability_adv_forward_count",
                                         "Retina-compatible: forwarded packets of a pod.", labels=RETINA_LABELS)
        for series, direction, value in self._ledger.series_values(kernel):
            labels = [series.namespace, series.name, direction.value, series.workload_kind, series.workload_name]
            pod_bytes.add_metric(labels, value.bytes)
            pod_packets.add_metric(labels, value.packets)
            if self._retina:
                ip = min(series.ips) if series.ips else ""
                retina = [direction.value, ip, series.namespace, series.name, series.workload_kind,
                          series.workload_name]
                retina_bytes.add_metric(retina, value.bytes)
                retina_count.add_metric(retina, value.packets)
        yield pod_bytes
        yield pod_packets
        yield from self._node_totals(kernel)
        if self._retina:
            yield retina_bytes
            yield retina_count

    def _node_totals(self, kernel: Counters) -> Iterator[Metric]:
        totals = self._ledger.node_totals(kernel)
        node_bytes = CounterMetricFamily("podmeter_node_bytes", "Bytes of all observed pods of this node.",
                                         labels=["direction"])
        node_packets = CounterMetricFamily("podmeter_node_packets", "Packets of all observed pods of this node.",
                                           labels=["direction"])
        for direction, value in sorted(totals.items(), key=lambda item: item[0].value):
            node_bytes.add_metric([direction.value], value.bytes)
            node_packets.add_metric([direction.value], value.packets)
        yield node_bytes
        yield node_packets
