"""Per-pod traffic series, read from the kernel counters at scrape time.

Series (see docs/metrics.md): ``podmeter_pod_bytes_total`` and ``podmeter_pod_packets_total`` with labels
``namespace``, ``pod``, ``direction``, ``workload_kind``, ``workload_name``; ``podmeter_node_bytes_total`` and
``podmeter_node_packets_total`` with ``direction``. With ``retina_compat`` (``--retina-compat``, Retina's
local context) the same per-pod values are also exported as Retina's advanced-mode series
``networkobservability_adv_forward_bytes`` and ``_count``: counters, as Retina's exporter types them, with
Retina's local-context labels and ``unknown`` where Retina writes it (docs/metrics.md, "Retina names").

The exposition is written directly in the Prometheus text format rather than through prometheus_client's
metric families: with 5,000 pods that is 20,000 samples per scrape, and building a family object per
sample costs several times the scrape budget (``bench/metrics.py`` measures both). Label strings are built
once per series and cached. The renderer only reads the ledger; it runs on the agent's event loop thread,
between two writer steps.
"""

from __future__ import annotations

from collections.abc import Callable

from podmeter.model.datapath import Direction, Traffic
from podmeter.model.retina_flows import UNKNOWN, retina_workload
from podmeter.model.traffic import Counters, PodSeries, TrafficLedger

POD_LABELS = ["namespace", "pod", "direction", "workload_kind", "workload_name"]
# Retina's names end in _count without being histograms, and its counters lack _total: promtool's lint says
# so (docs/metrics.md lists the findings); the names stay Retina's because its dashboards query them.
RETINA_HELP = {
    "networkobservability_adv_forward_bytes": "Forwarded bytes, under Retina's advanced pod-level name.",
    "networkobservability_adv_forward_count": "Forwarded packets, under Retina's advanced pod-level name.",
}
_HEADERS = {
    "podmeter_pod_bytes_total": ("counter", "Bytes of an observed pod's traffic, by direction (ingress: into it)."),
    "podmeter_pod_packets_total": ("counter", "Packets of an observed pod's traffic, by direction."),
    "podmeter_node_bytes_total": ("counter", "Bytes of all observed pods of this node, by direction."),
    "podmeter_node_packets_total": ("counter", "Packets of all observed pods of this node, by direction."),
    **{name: ("counter", text) for name, text in RETINA_HELP.items()},
}


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class PodTrafficExposition:
    """Renders the per-pod and node traffic series. Invariants: ``_labels`` and ``_retina_labels`` cache the label
    text of live series only (they are pruned when they hold many more entries than the ledger has series);
    a series' Retina labels never change while it exists (its ``ip`` is the one it was first rendered with,
    so the series keeps its identity through the grace period, when the pod holds no IP any more)."""

    def __init__(self, ledger: TrafficLedger, read_counters: Callable[[], Counters],
                 retina_compat: bool = False) -> None:
        self._ledger = ledger
        self._read_counters = read_counters
        self._retina = retina_compat
        self._labels: dict[tuple[str, Direction], str] = {}
        self._retina_labels: dict[str, str] = {}  # by series UID: every label but the direction
        self.node_totals: dict[Direction, Traffic] = {}  # of the last render (Retina's node series read them)

    def render(self) -> bytes:
        kernel = self._read_counters()
        lines: dict[str, list[str]] = {name: [] for name in _HEADERS}
        pod_bytes, pod_packets = lines["podmeter_pod_bytes_total"], lines["podmeter_pod_packets_total"]
        values = list(self._ledger.series_values(kernel))
        for series, direction, value in values:
            labels = self._label_text(series, direction)
            pod_bytes.append(f"podmeter_pod_bytes_total{labels} {value.bytes}")
            pod_packets.append(f"podmeter_pod_packets_total{labels} {value.packets}")
            if self._retina:
                retina = f'{{direction="{direction.value}",{self._retina_text(series)}}}'
                lines["networkobservability_adv_forward_bytes"].append(
                    f"networkobservability_adv_forward_bytes{retina} {value.bytes}")
                lines["networkobservability_adv_forward_count"].append(
                    f"networkobservability_adv_forward_count{retina} {value.packets}")
        self.node_totals = self._ledger.node_totals(kernel, values)
        for direction, total in sorted(self.node_totals.items(), key=lambda kv: kv[0].value):
            lines["podmeter_node_bytes_total"].append(
                f'podmeter_node_bytes_total{{direction="{direction.value}"}} {total.bytes}')
            lines["podmeter_node_packets_total"].append(
                f'podmeter_node_packets_total{{direction="{direction.value}"}} {total.packets}')
        self._prune()
        return _text(lines, self._retina)

    def _label_text(self, series: PodSeries, direction: Direction) -> str:
        key = (series.uid, direction)
        text = self._labels.get(key)
        if text is None:
            text = (f'{{namespace="{escape(series.namespace)}",pod="{escape(series.name)}",'
                    f'direction="{direction.value}",workload_kind="{escape(series.workload_kind)}",'
                    f'workload_name="{escape(series.workload_name)}"}}')
            self._labels[key] = text
        return text

    def _retina_text(self, series: PodSeries) -> str:
        text = self._retina_labels.get(series.uid)
        if text is None:
            ip = min(series.ips) if series.ips else UNKNOWN
            kind, name = retina_workload(series.workload_kind, series.workload_name)
            text = (f'ip="{ip}",namespace="{escape(series.namespace)}",podname="{escape(series.name)}",'
                    f'workload_kind="{escape(kind)}",workload_name="{escape(name)}"')
            self._retina_labels[series.uid] = text
        return text

    def _prune(self) -> None:
        live = self._ledger.series
        if len(self._labels) > 2 * len(Direction) * len(live) + 1024:
            self._labels = {key: text for key, text in self._labels.items() if key[0] in live}
        if len(self._retina_labels) > 2 * len(live) + 1024:
            self._retina_labels = {uid: text for uid, text in self._retina_labels.items() if uid in live}


def _text(lines: dict[str, list[str]], retina: bool) -> bytes:
    out: list[str] = []
    for name, samples in lines.items():
        if name.startswith("networkobservability_") and not retina:
            continue
        kind, help_text = _HEADERS[name]
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)
    return ("\n".join(out) + "\n").encode()
