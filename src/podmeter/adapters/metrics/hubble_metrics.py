"""Hubble's metrics (``model.hubble_metrics``) in the Prometheus text format, rendered at scrape time.

:func:`render_hubble` is what the Hubble metrics listener (``--hubble-metrics-server``) serves: every family
of the ``--hubble-metrics`` value, its ``# HELP`` and ``# TYPE`` lines even before its first sample, the
samples sorted. :func:`render_hubble_figures` is podmeter's own account of them, on the agent's ``/metrics``:
``podmeter_hubble_metrics_series``, ``podmeter_hubble_metrics_folded_total`` (additions that went to an
overflow series: the cap was reached) and ``podmeter_hubble_metrics_unrecorded_total`` (flows of a drain
beyond the record ring, which have no record and so are not in Hubble's metrics).
"""

from __future__ import annotations

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.hubble_metrics import HubbleMetrics


def render_hubble(metrics: HubbleMetrics) -> bytes:
    by_family: dict[str, list[tuple[tuple[str, ...], int]]] = {f.name: [] for f in metrics.families}
    for (name, values), value in metrics.values():
        by_family[name].append((values, value))
    out: list[str] = []
    for family in metrics.families:
        out += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} counter"]
        for values, value in sorted(by_family[family.name]):
            labels = ",".join(f'{name}="{escape(v)}"' for name, v in zip(family.labels, values, strict=True))
            out.append(f"{family.name}{{{labels}}} {value}")
    return ("\n".join(out) + "\n").encode()


def render_hubble_figures(metrics: HubbleMetrics) -> bytes:
    lines = [
        "# HELP podmeter_hubble_metrics_series Series of Hubble's metrics (--hubble-metrics), overflow ones too.",
        "# TYPE podmeter_hubble_metrics_series gauge",
        f"podmeter_hubble_metrics_series {len(metrics.series)}",
        "# HELP podmeter_hubble_metrics_folded_total Additions to Hubble's metrics that went to an overflow series "
        "(the series limit was reached).",
        "# TYPE podmeter_hubble_metrics_folded_total counter",
        f"podmeter_hubble_metrics_folded_total {metrics.folded}",
        "# HELP podmeter_hubble_metrics_unrecorded_total Flows drained beyond the record ring (not in Hubble's).",
        "# TYPE podmeter_hubble_metrics_unrecorded_total counter",
        f"podmeter_hubble_metrics_unrecorded_total {metrics.unrecorded}",
    ]
    return ("\n".join(lines) + "\n").encode()
