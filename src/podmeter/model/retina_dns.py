"""Retina's DNS series, for ``--retina-compat``, kept from the DNS drain's records.

Retina counts DNS messages under two names, and its DNS dashboards (``standard-dns``) query their labels:

* ``networkobservability_dns_request_count`` and ``networkobservability_dns_response_count`` (the node's,
  in either context), both with ``return_code``, ``query_type``, ``query``, ``response`` and
  ``num_response``;
* with the remote context, ``networkobservability_adv_dns_request_count{query_type, query, source_*,
  destination_*}`` and ``networkobservability_adv_dns_response_count{return_code, query_type, query,
  response, num_response, source_*, destination_*}``, the ends' labels those of Retina's other
  remote-context series (``ip``, ``namespace``, ``podname``, ``workload_kind``, ``workload_name``:
  :func:`podmeter.model.retina_flows.end_values`).

Label values as Retina writes them: ``query`` the name as asked, lowercased, with its final dot;
``query_type`` the type's name (a number for one podmeter does not name); ``return_code`` in the node's
series the DNS tracer's names (``NoError``, ``NXDomain``, ``Refused``...: :data:`RETURN_CODES`; a query's
is its header's, ``NoError``), in the remote-context series Retina's own (``NOERROR``, ``NXDOMAIN``...,
empty past ``REFUSED``: :data:`ADV_RETURN_CODES`). podmeter reads no answer records, so ``response`` (the
answer's addresses) and ``num_response`` (their count) are empty for a response, and ``""``/``0`` for a
query as Retina writes a query's.

Bounded: query names are labels here (Retina's choice), so at most ``names_limit`` names have series of
their own on the node; a message with a name beyond them has ``query`` ``_other_`` and counts in
``names_folded``. At most ``limit`` series in all (then each family's overflow series, every label
``_other_``; ``folded`` counts the messages). A series ends when none of the pods whose messages it counts
is known any more and goes ``grace`` seconds later, or after ``idle`` seconds without a message; a name
leaves with its last series. Pure and synchronous; ``adapters.metrics.retina_dns`` renders at scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from podmeter.model.dns import qtype_name
from podmeter.model.flow_records import FlowEnd, FlowRecord
from podmeter.model.flow_series import OTHER
from podmeter.model.hubble_metrics import finished
from podmeter.model.retina_flows import END_LABELS, end_values

REQUESTS, RESPONSES = "networkobservability_dns_request_count", "networkobservability_dns_response_count"
ADV_REQUESTS, ADV_RESPONSES = ("networkobservability_adv_dns_request_count",
                               "networkobservability_adv_dns_response_count")
BASIC_LABELS = ("return_code", "query_type", "query", "response", "num_response")
_ENDS = (*(f"source_{name}" for name in END_LABELS), *(f"destination_{name}" for name in END_LABELS))
LABELS = {REQUESTS: BASIC_LABELS, RESPONSES: BASIC_LABELS, ADV_REQUESTS: ("query_type", "query", *_ENDS),
          ADV_RESPONSES: (*BASIC_LABELS, *_ENDS)}
HELP = {REQUESTS: "Total number of DNS query packets", RESPONSES: "Total number of DNS response packets",
        ADV_REQUESTS: "Total number of DNS query packets", ADV_RESPONSES: "Total number of DNS response packets"}
# The node-level series' return codes: the names of the DNS tracer Retina reads them from.
RETURN_CODES = {0: "NoError", 1: "FormErr", 2: "ServFail", 3: "NXDomain", 4: "NotImp", 5: "Refused",
                6: "YXDomain", 7: "YXRRSet", 8: "NXRRSet", 9: "NotAuth", 10: "NotZone"}
# The remote-context series' return codes: Retina names six and leaves the others empty.
ADV_RETURN_CODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
PodKey = tuple[str, str]  # namespace, name
SeriesKey = tuple[str, tuple[str, ...]]  # family, label values in LABELS' order


@dataclass(slots=True)
class Count:
    """One series: ``value`` only grows while it exists; ``pods``: those whose messages it counts."""

    value: int
    last: float
    pods: set[PodKey] = field(default_factory=set)
    ended_at: float | None = None


def return_code(rcode: int) -> str:
    return RETURN_CODES.get(rcode, str(rcode))


def _pod_of(end: FlowEnd) -> PodKey | None:
    e = end.endpoint
    return None if e is None else (e.namespace, e.pod)


class RetinaDns:
    """Retina's DNS series (the remote-context ones too with ``remote``).

    Invariants: a series' value only grows while it exists; ``len(series) <= limit`` plus one overflow
    series per family; ``names`` holds exactly the query names of the series (but ``_other_``) with how
    many series each, and ``len(names) <= names_limit``.
    """

    def __init__(self, names_limit: int, limit: int, idle: float, grace: float, *, remote: bool) -> None:
        if names_limit < 1 or limit < 1:
            raise ValueError("Retina's DNS series: the name and series limits are at least 1")
        self.names_limit, self.limit, self.idle, self.grace, self.remote = names_limit, limit, idle, grace, remote
        self.series: dict[SeriesKey, Count] = {}
        self.names: dict[str, int] = {}
        self.names_folded = 0  # messages whose name went to `_other_` (the name limit was reached)
        self.folded = 0  # messages that went to an overflow series (the series limit was reached)
        self._overflows: set[SeriesKey] = set()

    @property
    def families(self) -> tuple[str, ...]:
        return (REQUESTS, RESPONSES, *((ADV_REQUESTS, ADV_RESPONSES) if self.remote else ()))

    def add(self, records: Iterable[FlowRecord], now: float) -> None:
        """The DNS records of one drain (others are left out)."""
        for record in records:
            info = record.dns
            if info is None:
                continue
            response = info.rcode is not None
            pod = _pod_of(record.destination if response else record.source)
            name = self._name(info.query, info.count)
            qtype, rcode = qtype_name(info.qtype), info.rcode or 0
            if response:
                self._count(RESPONSES, (return_code(rcode), qtype, name, "", ""), info.count, now, pod)
            else:
                self._count(REQUESTS, (return_code(rcode), qtype, name, "", "0"), info.count, now, pod)
            if self.remote:
                ends = (*end_values(record.source), *end_values(record.destination))
                if response:
                    values = (ADV_RETURN_CODES.get(rcode, ""), qtype, name, "", "", *ends)
                    self._count(ADV_RESPONSES, values, info.count, now, pod)
                else:
                    self._count(ADV_REQUESTS, (qtype, name, *ends), info.count, now, pod)

    def _name(self, name: str, count: int) -> str:
        if name in self.names or len(self.names) < self.names_limit:
            return name
        self.names_folded += count
        return OTHER

    def _count(self, family: str, values: tuple[str, ...], amount: int, now: float, pod: PodKey | None) -> None:
        key = (family, values)
        series = self.series.get(key)
        if series is None:
            if len(self.series) - len(self._overflows) >= self.limit:
                self.folded += amount
                key = (family, (OTHER,) * len(values))
                self._overflows.add(key)
                series = self.series.get(key)
            if series is None:
                series = self.series[key] = Count(0, now)
                self._holds(key)
        series.value += amount
        series.last = now
        if pod is not None:
            series.pods.add(pod)
            series.ended_at = None

    def _holds(self, key: SeriesKey) -> None:
        name = self._query(key)
        if name != OTHER:
            self.names[name] = self.names.get(name, 0) + 1

    def _lets_go(self, key: SeriesKey) -> None:
        name = self._query(key)
        left = self.names.get(name, 0) - 1
        if left > 0:
            self.names[name] = left
        else:
            self.names.pop(name, None)

    @staticmethod
    def _query(key: SeriesKey) -> str:
        family, values = key
        return values[LABELS[family].index("query")]

    def expire(self, now: float, known_pods: Callable[[], Collection[PodKey]]) -> int:
        """End the series none of whose pods is known, drop those whose grace is over and the idle ones;
        returns how many went (their names with them, when no other series holds them)."""
        known = known_pods() if self.series else ()
        for series in self.series.values():
            series.pods.intersection_update(known)
            if series.pods:
                series.ended_at = None
            elif series.ended_at is None:
                series.ended_at = now
        done = [key for key, s in self.series.items() if finished(s.last, s.ended_at, now, self.idle, self.grace)]
        for key in done:
            self._lets_go(key)
            self._overflows.discard(key)
            del self.series[key]
        return len(done)

    def values(self) -> Iterator[tuple[SeriesKey, int]]:
        for key, series in self.series.items():
            yield key, series.value
