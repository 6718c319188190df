"""Retina's DNS series (``model.retina_dns``) in the Prometheus text format, rendered at scrape time on the
agent's ``/metrics`` with ``--retina-compat``: every family with its ``# HELP`` and ``# TYPE`` lines (counters,
as Retina's exporter types them) even before its first sample, the label names sorted as Retina's exporter
writes them, then podmeter's account of their bounds: ``podmeter_retina_dns_names`` (query names with
series of their own), ``podmeter_retina_dns_names_folded_total`` (messages whose name went to ``_other_``)
and ``podmeter_retina_dns_series_folded_total`` (messages that went to an overflow series)."""

from __future__ import annotations

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.retina_dns import HELP, LABELS, RetinaDns


def render_retina_dns(dns: RetinaDns) -> bytes:
    by_family: dict[str, list[tuple[tuple[str, ...], int]]] = {name: [] for name in dns.families}
    for (name, values), value in dns.values():
        by_family[name].append((values, value))
    out: list[str] = []
    for name in dns.families:
        out += [f"# HELP {name} {HELP[name]}", f"# TYPE {name} counter"]
        order = sorted(range(len(LABELS[name])), key=lambda i: LABELS[name][i])
        for values, value in sorted(by_family[name]):
            labels = ",".join(f'{LABELS[name][i]}="{escape(values[i])}"' for i in order)
            out.append(f"{name}{{{labels}}} {value}")
    out += ["# HELP podmeter_retina_dns_names Query names with Retina DNS series of their own.",
            "# TYPE podmeter_retina_dns_names gauge",
            f"podmeter_retina_dns_names {len(dns.names)}",
            "# HELP podmeter_retina_dns_names_folded_total DNS messages counted under the query _other_ "
            "(the name limit was reached).",
            "# TYPE podmeter_retina_dns_names_folded_total counter",
            f"podmeter_retina_dns_names_folded_total {dns.names_folded}",
            "# HELP podmeter_retina_dns_series_folded_total DNS messages counted in a Retina DNS overflow series.",
            "# TYPE podmeter_retina_dns_series_folded_total counter",
            f"podmeter_retina_dns_series_folded_total {dns.folded}"]
    return ("\n".join(out) + "\n").encode()
