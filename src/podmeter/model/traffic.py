"""Attributing the kernel's per-IP counters to pods, with a lifecycle that leaks nothing.

The kernel counts by IP. A pod's series is the traffic of the IPs it held *while it held them*:

* when a pod becomes the owner of an IP, the IP's current kernel value is its ``base``;
* when it stops owning it (the IP left the filter, or passed to another pod without ever leaving it),
  what the IP counted since ``base`` is moved into the pod's ``closed`` total; the next owner's base is
  the kernel value at that moment, so no byte is counted twice or for the wrong pod (F21 in docs/design.md);
* a series lives while its pod holds an IP, then ``grace`` seconds more (so the last scrape sees the final
  value), then it is dropped (F20); its traffic stays in the node totals.

Pure and synchronous: the agent calls :meth:`TrafficLedger.assign` and :meth:`TrafficLedger.release` from
the writer task and reads :meth:`TrafficLedger.series_values` at scrape time, on the same thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from podmeter.model.datapath import Direction, Traffic
from podmeter.model.pod_series import SeriesBook
from podmeter.model.records import Pod
from podmeter.model.workloads import workload_of

Counters = Mapping[tuple[str, Direction], Traffic]
ZERO = Traffic()


@dataclass(slots=True)
class PodSeries:
    """The traffic series of one pod (by UID). Invariant: ``ended_at`` is None iff ``ips`` is not empty."""

    uid: str
    namespace: str
    name: str
    workload_kind: str
    workload_name: str
    closed: dict[Direction, Traffic] = field(default_factory=dict)
    ips: set[str] = field(default_factory=set)
    ended_at: float | None = None

    def add_closed(self, direction: Direction, amount: Traffic) -> None:
        self.closed[direction] = self.closed.get(direction, ZERO) + amount


@dataclass(slots=True)
class _Ownership:
    uid: str
    base: dict[Direction, Traffic]


class TrafficLedger:
    """Who owns which IP's counters, and each pod's accumulated traffic.

    Invariants:
    * an IP is in ``owners`` iff it is in ``series[owners[ip].uid].ips``;
    * a series' value is ``closed + sum(kernel(ip) - base(ip) for ip in ips)``, and never decreases;
    * ``node_expired`` holds the final values of dropped series, so node totals never decrease either;
    * a series lives as :class:`~podmeter.model.pod_series.SeriesBook` says (while its pod holds an IP,
      then ``grace`` seconds).
    """

    def __init__(self, grace: float) -> None:
        self.owners: dict[str, _Ownership] = {}
        self.node_expired: dict[Direction, Traffic] = {}
        self._book: SeriesBook[PodSeries] = SeriesBook(grace, _new_series, self._expired)

    @property
    def series(self) -> dict[str, PodSeries]:
        """The live and ending series by pod UID (read-only for callers)."""
        return self._book.series

    def assign(self, ip: str, pod: Pod | None, kernel: Counters, now: float) -> None:
        """``pod`` owns ``ip`` from now on (None: nobody). ``kernel`` holds the IP's counters now."""
        current = self.owners.get(ip)
        if current is not None and pod is not None and current.uid == pod.uid:
            return
        now_value = {d: kernel.get((ip, d), ZERO) for d in Direction}
        if current is not None:
            self._close(ip, current, now_value, now)
        if pod is not None:
            self._book.holds(pod, ip)
            self.owners[ip] = _Ownership(pod.uid, now_value)

    def release(self, ips: list[str], final: Counters, now: float) -> None:
        """``ips`` left the filter; ``final`` are their last kernel counters (taken: the kernel starts over;
        an IP without an entry counted nothing)."""
        for ip in ips:
            current = self.owners.get(ip)
            if current is not None:
                self._close(ip, current, {d: final.get((ip, d), ZERO) for d in Direction}, now)

    def series_values(self, kernel: Counters) -> Iterator[tuple[PodSeries, Direction, Traffic]]:
        """Every live series' value per direction, with the kernel counters read for this scrape.
        (The hot loop of a scrape: plain integers inside, one Traffic per series and direction.)"""
        owners = self.owners
        for series in self.series.values():
            for direction in Direction:
                closed = series.closed.get(direction, ZERO)
                packets, size = closed.packets, closed.bytes
                for ip in series.ips:
                    now_value = kernel.get((ip, direction), ZERO)
                    since = _since(now_value, owners[ip].base[direction])
                    packets += since.packets
                    size += since.bytes
                yield series, direction, Traffic(packets, size)

    def node_totals(self, kernel: Counters,
                    values: Iterable[tuple[PodSeries, Direction, Traffic]] | None = None) -> dict[Direction, Traffic]:
        """Expired series plus live ones (pass ``values`` when the live ones were just computed)."""
        totals = dict(self.node_expired)
        for _series, direction, value in self.series_values(kernel) if values is None else values:
            totals[direction] = totals.get(direction, ZERO) + value
        return totals

    def expire(self, now: float) -> int:
        """Drop series whose grace period is over (their totals stay in the node's); returns how many."""
        return self._book.expire(now)

    # --- internals ----------------------------------------------------------------------------

    def _close(self, ip: str, ownership: _Ownership, now_value: Mapping[Direction, Traffic], now: float) -> None:
        del self.owners[ip]
        series = self._book.lets_go(ownership.uid, ip, now)
        if series is not None:
            for direction in Direction:
                series.add_closed(direction, _since(now_value.get(direction, ZERO), ownership.base[direction]))

    def _expired(self, series: PodSeries) -> None:
        """A series goes (grace over, or its pod observed again): its totals stay in the node's."""
        for direction, value in series.closed.items():
            self.node_expired[direction] = self.node_expired.get(direction, ZERO) + value


def _new_series(pod: Pod) -> PodSeries:
    kind, name = workload_of(pod)
    return PodSeries(pod.uid, pod.namespace, pod.name, kind, name)


def _since(now_value: Traffic, base: Traffic) -> Traffic:
    """Traffic counted since ``base``; never negative (a counter the kernel restarted counts from zero)."""
    if base == ZERO:
        return now_value
    if now_value.packets < base.packets or now_value.bytes < base.bytes:
        return now_value
    return Traffic(now_value.packets - base.packets, now_value.bytes - base.bytes)
