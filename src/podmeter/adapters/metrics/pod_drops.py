"""Per-pod drops and TCP health series, rendered in the Prometheus text format at scrape time.

Series (docs/metrics.md, docs/drops.md):

* ``podmeter_pod_drops_total{namespace,pod,direction,reason}``: packets of the pod the kernel dropped
  (``direction`` egress: the pod sent them; ingress: they were for it), ``reason`` as the kernel names
  it (``NETFILTER_DROP``); a series per (direction, reason) that occurred;
* ``podmeter_pod_tcp_retransmits_total{namespace,pod}``: segments the pod's sockets retransmitted;
* ``podmeter_pod_tcp_resets_total{namespace,pod,direction}``: RSTs the pod sent (egress) and its sockets
  received (ingress);
* ``podmeter_node_drops_total{direction,reason}``: every drop of an observed IP on this node, including
  pods whose series are gone;
* ``podmeter_pod_lifecycle_drops_total{namespace,pod,direction,reason}`` and
  ``podmeter_node_lifecycle_drops_total{direction,reason}``: the same for the reasons that are a socket's
  lifecycle, not a loss (``model.drops.LIFECYCLE_REASONS``: queued data freed as a socket closes), which
  the two series above and Retina's leave out (unless ``--drops-include-lifecycle``: then these are empty);
* ``podmeter_drops_lost_total{map}``: events not counted because a kernel map was full;
* ``podmeter_drop_tracing_enabled{hook}``: 1 while the hook is attached, 0 when it is off (a kernel
  without the tracepoint or BTF, the memory datapath, ``--drop-map-size 0``);
* ``podmeter_drop_drains_total``, ``podmeter_drop_drain_errors_total``;
* with ``retina_compat`` (``--retina-compat=local``, Retina's local context): the same per-pod drops as
  Retina's ``networkobservability_adv_drop_count`` (packets) and ``_bytes``, gauges as Retina's exporter
  types them, labels ``direction`` (``ingress``, ``egress``), ``ip``, ``namespace``, ``podname``, ``reason``
  (Retina's name where it means the kernel's reason exactly, else the kernel's:
  ``model.retina_flows.RETINA_REASONS``), ``workload_kind``, ``workload_name`` (docs/metrics.md, "Retina
  names"). They live and go with the pod's drop series (its grace, then gone: failure mode F20).

The retransmit and reset series of a live pod exist from the moment it is observed (at 0), so ``rate()``
sees the first event; drop series appear with their first drop. Written as text, like the traffic series,
with label strings cached per series.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from podmeter.adapters.metrics.families import pruned
from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.adapters.metrics.retina import RETINA_DROP_HELP
from podmeter.model.datapath import Direction
from podmeter.model.drops import HOOKS, DropLedger, DropSeries, DropStats, TcpEvent
from podmeter.model.retina_flows import UNKNOWN, retina_reason, retina_workload

_HEADERS = {
    "podmeter_pod_drops_total": ("counter", "Packets of an observed pod the kernel dropped, by direction and reason."),
    "podmeter_pod_tcp_retransmits_total": ("counter", "TCP segments an observed pod's sockets retransmitted."),
    "podmeter_pod_tcp_resets_total": ("counter", "TCP resets an observed pod sent (egress) and received (ingress)."),
    "podmeter_node_drops_total": ("counter", "Dropped packets of observed IPs on this node, by direction and reason."),
    "podmeter_pod_lifecycle_drops_total": (
        "counter", "Packets of an observed pod freed with a socket's queues as it closed (lifecycle, not loss)."),
    "podmeter_node_lifecycle_drops_total": (
        "counter", "Packets of observed IPs on this node freed with a socket's queues as it closed."),
    "podmeter_drops_lost_total": ("counter", "Drop and TCP events not counted because a kernel map was full."),
    "podmeter_drop_tracing_enabled": ("gauge", "1 while the hook is attached; 0: drops or TCP health are off."),
    "podmeter_drop_drains_total": ("counter", "Drains of the kernel drop and TCP maps."),
    "podmeter_drop_drain_errors_total": ("counter", "Drains of the kernel drop and TCP maps that failed."),
    **{name: ("gauge", text) for name, text in sorted(RETINA_DROP_HELP.items())},
}
_RESETS = ((Direction.EGRESS, TcpEvent.RESET_SENT), (Direction.INGRESS, TcpEvent.RESET_RECEIVED))


class PodDropExposition:
    """Renders the drop series from the ledger, the hooks and the loss counters of the moment.

    Invariant: a series' Retina labels never change while it exists (its ``ip`` is the lowest it held when
    first rendered, so the series keeps its identity through the grace period, when it holds none)."""

    def __init__(self, ledger: DropLedger, hooks: Callable[[], Mapping[str, bool]],
                 lost: Callable[[], Mapping[str, int]] | None = None, stats: DropStats | None = None,
                 retina_compat: bool = False) -> None:
        self._ledger = ledger
        self._hooks = hooks
        self._lost = lost
        self._stats = stats
        self._retina = retina_compat
        self._labels: dict[str, str] = {}
        self._retina_labels: dict[str, tuple[str, str]] = {}  # by series UID: its ip, its pod's labels

    def render(self) -> bytes:
        lines: dict[str, list[str]] = {name: [] for name in _HEADERS}
        drops, retransmits = lines["podmeter_pod_drops_total"], lines["podmeter_pod_tcp_retransmits_total"]
        resets, lifecycle = lines["podmeter_pod_tcp_resets_total"], lines["podmeter_pod_lifecycle_drops_total"]
        for series in self._ledger.values():
            pod = self._pod_labels(series)
            for (direction, reason), packets in sorted(series.drops.items()):
                drops.append(f'podmeter_pod_drops_total{{{pod},direction="{direction.value}",'
                             f'reason="{escape(reason)}"}} {packets}')
            for (direction, reason), packets in sorted(series.lifecycle.items()):
                lifecycle.append(f'podmeter_pod_lifecycle_drops_total{{{pod},direction="{direction.value}",'
                                 f'reason="{escape(reason)}"}} {packets}')
            if self._retina:
                self._retina_series(series, lines)
            retransmits.append(f"podmeter_pod_tcp_retransmits_total{{{pod}}} {series.tcp.get(TcpEvent.RETRANSMIT, 0)}")
            for direction, event in _RESETS:
                resets.append(f'podmeter_pod_tcp_resets_total{{{pod},direction="{direction.value}"}} '
                              f"{series.tcp.get(event, 0)}")
        for (direction, reason), packets in sorted(self._ledger.node_drops.items()):
            lines["podmeter_node_drops_total"].append(
                f'podmeter_node_drops_total{{direction="{direction.value}",reason="{escape(reason)}"}} {packets}')
        for (direction, reason), packets in sorted(self._ledger.node_lifecycle.items()):
            lines["podmeter_node_lifecycle_drops_total"].append(
                f'podmeter_node_lifecycle_drops_total{{direction="{direction.value}",reason="{escape(reason)}"}} '
                f"{packets}")
        for name, count in sorted((self._lost() if self._lost else {}).items()):
            lines["podmeter_drops_lost_total"].append(f'podmeter_drops_lost_total{{map="{name}"}} {count}')
        hooks = self._hooks()
        for hook in HOOKS:
            lines["podmeter_drop_tracing_enabled"].append(
                f'podmeter_drop_tracing_enabled{{hook="{hook}"}} {int(hooks.get(hook, False))}')
        if self._stats is not None:
            lines["podmeter_drop_drains_total"].append(f"podmeter_drop_drains_total {self._stats.drains}")
            lines["podmeter_drop_drain_errors_total"].append(f"podmeter_drop_drain_errors_total {self._stats.errors}")
        self._prune()
        out: list[str] = []
        for name, samples in lines.items():
            if not samples and name in ("podmeter_drop_drains_total", "podmeter_drop_drain_errors_total"):
                continue
            if name in RETINA_DROP_HELP and not self._retina:
                continue
            kind, help_text = _HEADERS[name]
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
        return ("\n".join(out) + "\n").encode()

    def _retina_series(self, series: DropSeries, lines: dict[str, list[str]]) -> None:
        """Retina's local-context drop samples of one pod (its labels are taken at its first render, even
        before it has a drop, so that they are the labels it had while it held its IPs)."""
        ip, pod = self._retina_text(series)
        for (direction, reason), packets in sorted(series.drops.items()):
            labels = (f'{{direction="{direction.value}",ip="{ip}",{pod},'
                      f'reason="{escape(retina_reason(reason))}",{self._retina_workload(series)}}}')
            size = series.drop_bytes.get((direction, reason), 0)
            for name, value in (("networkobservability_adv_drop_count", packets),
                                ("networkobservability_adv_drop_bytes", size)):
                lines[name].append(f"{name}{labels} {value}")

    def _retina_text(self, series: DropSeries) -> tuple[str, str]:
        """The series' ``ip`` and its ``namespace``/``podname`` label text."""
        found = self._retina_labels.get(series.uid)
        if found is None:
            ip = min(series.ips) if series.ips else UNKNOWN
            found = self._retina_labels[series.uid] = (
                ip, f'namespace="{escape(series.namespace)}",podname="{escape(series.name)}"')
        return found

    @staticmethod
    def _retina_workload(series: DropSeries) -> str:
        kind, name = retina_workload(series.workload_kind, series.workload_name)
        return f'workload_kind="{escape(kind)}",workload_name="{escape(name)}"'

    def _pod_labels(self, series: DropSeries) -> str:
        text = self._labels.get(series.uid)
        if text is None:
            text = self._labels[series.uid] = f'namespace="{escape(series.namespace)}",pod="{escape(series.name)}"'
        return text

    def _prune(self) -> None:
        self._labels = pruned(self._labels, self._ledger.series)
        self._retina_labels = pruned(self._retina_labels, self._ledger.series)
