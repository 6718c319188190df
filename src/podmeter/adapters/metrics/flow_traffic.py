"""Workload-to-workload flow series, rendered in the Prometheus text format at scrape time.

``podmeter_workload_flow_bytes_total`` and ``podmeter_workload_flow_packets_total`` with labels
``source_namespace``, ``source_workload_kind``, ``source_workload``, ``destination_namespace``,
``destination_workload_kind``, ``destination_workload`` and ``protocol`` (docs/flows.md). Workload
granularity only, never IPs or ports; the number of series is capped (``model.flow_series``).
"""

from __future__ import annotations

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.flow_series import WorkloadFlows, WorkloadPair

_SERIES = (
    ("podmeter_workload_flow_bytes_total", "Bytes between two workloads, by protocol (each packet once per node)."),
    ("podmeter_workload_flow_packets_total", "Packets between two workloads, by protocol."),
)
_LABELS = ("source_namespace", "source_workload_kind", "source_workload", "destination_namespace",
           "destination_workload_kind", "destination_workload", "protocol")


def _labels(pair: WorkloadPair) -> str:
    return "{" + ",".join(f'{name}="{escape(value)}"' for name, value in zip(_LABELS, pair, strict=True)) + "}"


def render_workload_flows(flows: WorkloadFlows) -> bytes:
    byte_lines: list[str] = []
    packet_lines: list[str] = []
    for pair, traffic in sorted(flows.values()):
        labels = _labels(pair)
        byte_lines.append(f"podmeter_workload_flow_bytes_total{labels} {traffic.bytes}")
        packet_lines.append(f"podmeter_workload_flow_packets_total{labels} {traffic.packets}")
    out: list[str] = []
    for (name, help_text), lines in zip(_SERIES, (byte_lines, packet_lines), strict=True):
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", *lines]
    return ("\n".join(out) + "\n").encode()
