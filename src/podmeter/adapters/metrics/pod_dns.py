"""Per-pod DNS series, rendered in the Prometheus text format at scrape time (docs/dns.md, docs/metrics.md).

* ``podmeter_pod_dns_queries_total{namespace,pod,qtype}``: queries the pod sent, ``qtype`` by name (``A``,
  ``AAAA``, ``SRV``...; a number for a type podmeter does not name);
* ``podmeter_pod_dns_responses_total{namespace,pod,rcode}``: responses it received, ``rcode`` by name
  (``NOERROR``, ``NXDOMAIN``, ``SERVFAIL``, ``REFUSED``...);
* ``podmeter_pod_dns_response_seconds{namespace,pod}``: a histogram of the latency of those responses whose
  query was seen (buckets 1 ms .. 5 s; it exists at 0 from the moment the pod is observed);
* ``podmeter_dns_messages_total{verdict}``: every DNS message of an observed pod the kernel saw:
  ``parsed``, or why it was not read (``truncated``, ``bad_count``, ``label_long``, ``pointer``,
  ``name_long``, ``wrong_qr``, ``tcp``, ``full``) or was read without a latency (``pending_full``,
  ``expired``, ``unmatched``); ``podmeter_dns_drains_total``, ``_drain_errors_total``,
  ``podmeter_dns_unattributed_total`` (messages of an address no series held at their drain).

The series live and go with the pod (its grace, then gone: the lifecycle of ``model.pod_series``). Query
names are never a label: they are unbounded (``podmeter observe --protocol dns`` shows them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from podmeter.adapters.metrics.families import pruned
from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.dns import LATENCY_BOUNDS, DnsLedger, DnsSeries, Verdict, qtype_name, rcode_name

_HEADERS = {
    "podmeter_pod_dns_queries_total": ("counter", "DNS queries an observed pod sent, by query type."),
    "podmeter_pod_dns_responses_total": ("counter", "DNS responses an observed pod received, by response code."),
    "podmeter_pod_dns_response_seconds": (
        "histogram", "Time from an observed pod's DNS query to its response, for responses whose query was seen."),
    "podmeter_dns_messages_total": ("counter", "DNS messages of observed pods the kernel saw, by what became of them."),
    "podmeter_dns_unattributed_total": ("counter", "DNS messages of an address no pod series held at their drain."),
    "podmeter_dns_drains_total": ("counter", "Drains of the kernel DNS map."),
    "podmeter_dns_drain_errors_total": ("counter", "Drains of the kernel DNS map that failed."),
}
_LE = [f"{bound:g}" for bound in LATENCY_BOUNDS] + ["+Inf"]


class DrainCounts(Protocol):
    """The drainer's counters (``runtime.dns_drain.DnsDrainStats``)."""

    drains: int
    errors: int


class PodDnsExposition:
    """Renders the DNS series from the ledger and the kernel's verdict counts of the moment."""

    def __init__(self, ledger: DnsLedger, verdicts: Callable[[], Mapping[Verdict, int]] | None = None,
                 stats: DrainCounts | None = None) -> None:
        self._ledger, self._verdicts, self._stats = ledger, verdicts, stats
        self._labels: dict[str, str] = {}

    def render(self) -> bytes:
        lines: dict[str, list[str]] = {name: [] for name in _HEADERS}
        for series in self._ledger.series.values():
            self._series(series, lines)
        for verdict, count in (self._verdicts() if self._verdicts else {}).items():
            lines["podmeter_dns_messages_total"].append(
                f'podmeter_dns_messages_total{{verdict="{verdict.name.lower()}"}} {count}')
        lines["podmeter_dns_unattributed_total"].append(f"podmeter_dns_unattributed_total {self._ledger.unattributed}")
        if self._stats is not None:
            lines["podmeter_dns_drains_total"].append(f"podmeter_dns_drains_total {self._stats.drains}")
            lines["podmeter_dns_drain_errors_total"].append(f"podmeter_dns_drain_errors_total {self._stats.errors}")
        self._prune()
        out: list[str] = []
        for name, samples in lines.items():
            if samples:
                kind, help_text = _HEADERS[name]
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
        return ("\n".join(out) + "\n").encode() if out else b""

    def _series(self, series: DnsSeries, lines: dict[str, list[str]]) -> None:
        pod = self._pod_labels(series)
        for qtype, count in sorted(series.queries.items()):
            lines["podmeter_pod_dns_queries_total"].append(
                f'podmeter_pod_dns_queries_total{{{pod},qtype="{escape(qtype_name(qtype))}"}} {count}')
        for rcode, count in sorted(series.responses.items()):
            lines["podmeter_pod_dns_responses_total"].append(
                f'podmeter_pod_dns_responses_total{{{pod},rcode="{escape(rcode_name(rcode))}"}} {count}')
        histogram = lines["podmeter_pod_dns_response_seconds"]
        cumulative = 0
        for le, count in zip(_LE, series.buckets, strict=True):
            cumulative += count
            histogram.append(f'podmeter_pod_dns_response_seconds_bucket{{{pod},le="{le}"}} {cumulative}')
        histogram.append(f"podmeter_pod_dns_response_seconds_sum{{{pod}}} {series.latency_sum_ns / 1e9:.9g}")
        histogram.append(f"podmeter_pod_dns_response_seconds_count{{{pod}}} {series.latency_count}")

    def _pod_labels(self, series: DnsSeries) -> str:
        text = self._labels.get(series.uid)
        if text is None:
            text = self._labels[series.uid] = f'namespace="{escape(series.namespace)}",pod="{escape(series.name)}"'
        return text

    def _prune(self) -> None:
        self._labels = pruned(self._labels, self._ledger.series)
