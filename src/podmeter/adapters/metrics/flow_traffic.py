"""Workload-to-workload flow series, rendered in the Prometheus text format at scrape time.

``podmeter_workload_flow_bytes_total`` and ``podmeter_workload_flow_packets_total`` with labels
``source_namespace``, ``source_workload_kind``, ``source_workload``, ``destination_namespace``,
``destination_workload_kind``, ``destination_workload`` and ``protocol`` (docs/flows.md). Workload
granularity only, never IPs or ports; the number of series is capped (``model.flow_series``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.flow_series import PairTraffic, WorkloadFlows, WorkloadPair

K = TypeVar("K", bound=tuple[object, ...])  # a NamedTuple of label values: sorted as tuples

_SERIES = (
    ("podmeter_workload_flow_bytes_total", "Bytes between two workloads, by protocol (each packet once per node)."),
    ("podmeter_workload_flow_packets_total", "Packets between two workloads, by protocol."),
)
_LABELS = ("source_namespace", "source_workload_kind", "source_workload", "destination_namespace",
           "destination_workload_kind", "destination_workload", "protocol")


def _labels(pair: WorkloadPair) -> str:
    return "{" + ",".join(f'{name}="{escape(value)}"' for name, value in zip(_LABELS, pair, strict=True)) + "}"


def traffic_families(rows: Iterable[tuple[K, PairTraffic]], labels: Callable[[K], str],
                     families: tuple[tuple[str, str], tuple[str, str]], kind: str) -> list[str]:
    """A bytes family then a packets family (``families``: (name, help) of each) over the same keyed
    traffic, sorted by key, in one pass: the exposition lines, without the final newline."""
    byte_lines: list[str] = []
    packet_lines: list[str] = []
    for key, traffic in sorted(rows):
        text = labels(key)
        byte_lines.append(f"{families[0][0]}{text} {traffic.bytes}")
        packet_lines.append(f"{families[1][0]}{text} {traffic.packets}")
    out: list[str] = []
    for (name, help_text), lines in zip(families, (byte_lines, packet_lines), strict=True):
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]
    return out


def render_workload_flows(flows: WorkloadFlows) -> bytes:
    return ("\n".join(traffic_families(flows.values(), _labels, _SERIES, "counter")) + "\n").encode()
