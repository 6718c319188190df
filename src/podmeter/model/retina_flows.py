"""Flow traffic keyed as Retina's remote-context pod-level series are, for ``--retina-compat=remote``.

Retina's dashboards of pod-level traffic query ``networkobservability_adv_forward_count`` by the labels of
both ends of a flow: ``source_ip``, ``source_namespace``, ``source_podname``, ``source_workload_kind``,
``source_workload_name`` and the same five for the destination, plus ``direction``. This module adds the
agent's forwarded flow records up by exactly that key, so those dashboards keep their queries.

The counting rule is Retina's, not :mod:`podmeter.model.flow_series`' "once per node": every record
counts, with ``direction`` ``EGRESS`` where it was seen leaving a pod and ``INGRESS`` where it was seen
entering one (a packet between two pods of the node is one series of each). Dropped records do not
count (Retina's forward series count forwarded packets only). An end no pod holds has ``unknown`` for its
namespace, pod and workload, a pod without a controller for its workload, as Retina writes them; ``ip``
is always the address.

Retina's drop series (``networkobservability_adv_drop_count``/``_bytes``) are the same keys plus
``reason``, from the records with verdict dropped (:class:`RetinaFlows` with ``verdict`` dropped): one
record, one count, whichever end was observed (``EGRESS`` when the source was: the packet was leaving a
pod). ``reason`` is Retina's name where one means exactly the kernel's reason (:data:`RETINA_REASONS`),
else the kernel's own name (``NO_SOCKET``): Retina's other reasons count events at other points than a
dropped packet (a failed ``connect()`` or ``accept()``), or a part of what the kernel names
``NETFILTER_DROP`` (a NAT or conntrack verdict) that the kernel's reason does not tell apart.

Bounds, the same as the workload-pair series: at most ``limit`` keys of their own (then one overflow key
per direction, every end label ``_other_``, and ``folded`` counts the records that went there), and a key
idle for ``idle`` seconds is dropped (if it carries traffic again it starts from zero: a counter reset).

Pure and synchronous; the metrics adapter reads :meth:`RetinaFlows.values` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import VERDICT_DROPPED, VERDICT_FORWARDED, FlowEnd, FlowRecord
from podmeter.model.flow_series import OTHER, CappedTraffic, DrainTotals, PairTraffic, WorkloadFlows
from podmeter.model.flows import Observation

UNKNOWN = "unknown"  # the value Retina writes for a label it has nothing for
INGRESS, EGRESS = "INGRESS", "EGRESS"  # Retina's remote-context direction values (the flow's own enum names)
END_LABELS = ("ip", "namespace", "podname", "workload_kind", "workload_name")
End = tuple[str, str, str, str, str]  # one end's values of END_LABELS
# Kernel drop reasons (skb_drop_reason names) whose drop is exactly what Retina counts under its own name:
# a netfilter hook's drop verdict, which Retina counts as IPTABLE_RULE_DROP where the hook returns.
RETINA_REASONS = {"NETFILTER_DROP": "IPTABLE_RULE_DROP"}


class RetinaKey(NamedTuple):
    """One remote-context series: the direction, :data:`END_LABELS` of the source and destination, and for
    a drop series its reason (empty for forwarded traffic)."""

    direction: str
    source: End
    destination: End
    reason: str = ""


_OTHER_END: End = (OTHER, OTHER, OTHER, OTHER, OTHER)


def overflow_key(direction: str, dropped: bool = False) -> RetinaKey:
    """The overflow key of a direction; a drop's has reason ``_other_`` too, so the bound holds whatever
    reasons the kernel has."""
    return RetinaKey(direction, _OTHER_END, _OTHER_END, OTHER if dropped else "")


def retina_reason(kernel: str | None) -> str:
    """A dropped record's ``reason`` label: Retina's name where it means the kernel's reason exactly, else
    the kernel's name (``UNKNOWN_DROP``, Retina's name for a reason it has not, if the record has none)."""
    if kernel is None:
        return "UNKNOWN_DROP"
    return RETINA_REASONS.get(kernel, kernel)


def retina_workload(kind: str, name: str) -> tuple[str, str]:
    """A pod's workload as Retina labels it: ``unknown`` twice for a pod without a controller (podmeter
    makes such a pod its own workload, kind ``Pod``: model.workloads)."""
    if not kind or kind == "Pod":
        return UNKNOWN, UNKNOWN
    return kind, name or UNKNOWN


def end_values(end: FlowEnd) -> End:
    """The end's label values as Retina writes them: the pod's, or ``unknown`` where there is none."""
    return address_values(end.ip, end.endpoint)


def address_values(ip: str, pod: Endpoint | None) -> End:
    if pod is None:
        return ip, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN
    return ip, pod.namespace, pod.pod, *retina_workload(pod.workload_kind, pod.workload)


def key_of(record: FlowRecord) -> RetinaKey:
    direction = EGRESS if record.observation is Observation.FROM_POD else INGRESS
    reason = retina_reason(record.drop_reason) if record.verdict == VERDICT_DROPPED else ""
    return RetinaKey(direction, end_values(record.source), end_values(record.destination), reason)


class RetinaFlows:
    """Traffic of one verdict (forwarded, or dropped for the drop series) per :class:`RetinaKey`, bounded by
    ``limit`` keys plus one overflow key per direction.

    Invariants: a key's value only grows while it exists; ``len(keys) <= limit + 2``; a key with no
    traffic for ``idle`` seconds is gone after the next :meth:`expire`.
    """

    def __init__(self, limit: int, idle: float, verdict: str = VERDICT_FORWARDED) -> None:
        self.verdict = verdict
        self.series: CappedTraffic[RetinaKey] = CappedTraffic(limit, idle)
        dropped = verdict == VERDICT_DROPPED
        self._overflow: Callable[[RetinaKey], RetinaKey] = lambda key: overflow_key(key.direction, dropped)

    @property
    def keys(self) -> dict[RetinaKey, PairTraffic]:
        return self.series.table

    @property
    def folded(self) -> int:
        return self.series.folded

    def add(self, records: Iterable[FlowRecord], now: float) -> None:
        series = self.series
        for record in records:
            if record.verdict == self.verdict:
                series.add(key_of(record), record.packets, record.bytes, now, self._overflow)

    def add_totals(self, drain: DrainTotals, names: Mapping[str, Endpoint | None], now: float) -> None:
        """Add one flow drain's entries (forwarded: a flow drain holds no drop) as :meth:`add` adds their
        records: per pair of addresses and direction, whatever the protocol (Retina's key has none)."""
        if self.verdict != VERDICT_FORWARDED:
            return
        keys: dict[tuple[str, str, bool], list[int]] = {}
        for (source, destination, _, from_pod), (packets, size, count) in drain.by_addresses.items():
            total = keys.get((source, destination, from_pod))
            if total is None:
                keys[source, destination, from_pod] = [packets, size, count]
            else:
                total[0] += packets
                total[1] += size
                total[2] += count
        series, overflow = self.series, self._overflow
        for (source, destination, from_pod), (packets, size, count) in keys.items():
            key = RetinaKey(EGRESS if from_pod else INGRESS, address_values(source, names[source]),
                            address_values(destination, names[destination]))
            series.add(key, packets, size, now, overflow, records=count)

    def expire(self, now: float) -> int:
        """Drop the keys idle for ``idle`` seconds or more; returns how many."""
        return self.series.expire(now)

    def values(self) -> Iterator[tuple[RetinaKey, PairTraffic]]:
        return self.series.values()


class WorkloadFlowsAndRetina(WorkloadFlows):
    """The workload-pair series, with Retina's remote-context series fed the same records and expired at
    the same ticks: the agent's flow drain and expiry see one :class:`WorkloadFlows` as ever. The drop
    series (:attr:`retina_drops`) are fed by the drop drain, whose records never reach the workload pairs,
    and expire at the same ticks."""

    def __init__(self, node: str, limit: int, idle: float) -> None:
        super().__init__(node, limit, idle)
        self.retina = RetinaFlows(limit, idle)
        self.retina_drops = RetinaFlows(limit, idle, VERDICT_DROPPED)

    def add(self, records: Iterable[FlowRecord], now: float) -> None:
        records = records if isinstance(records, list) else list(records)  # read twice
        super().add(records, now)
        self.retina.add(records, now)

    def add_totals(self, drain: DrainTotals, names: Mapping[str, Endpoint | None], now: float) -> None:
        super().add_totals(drain, names, now)
        self.retina.add_totals(drain, names, now)

    def expire(self, now: float) -> int:
        self.retina.expire(now)
        self.retina_drops.expire(now)
        return super().expire(now)
