"""Drops and TCP health per pod: what the kernel's drop and TCP tracepoints counted, credited to pods.

The datapath counts, for observed IPs only (docs/drops.md):
* dropped packets by address, direction and reason (:class:`DropKey`), and by dropped flow
  (:class:`DropFlowKey`: both ends, ports, protocol, reason) for the flow records with verdict dropped;
* TCP events of a pod's own sockets by local address (:class:`TcpEvent`: retransmits, resets sent and
  received), and retransmits by connection (:class:`ConnectionKey`) for the flow records.

The agent drains everything each flow interval (:class:`DropDrain`: read and deleted, so amounts are
deltas) and at every change of who holds an address, once more (right after the filter write). So what a
drain takes was counted while the IP had the owner it had at the previous drain: :class:`DropLedger`
credits it to that owner if the IP changed hands since, else to its owner now. Drops whose reason is
lifecycle, not loss (:data:`LIFECYCLE_REASONS`: a socket's queues freed as it closes) are counted apart,
in their own series, and make no dropped-flow records, unless the agent is told to show them as drops
(``--drops-include-lifecycle``). The ledger's series live
as the per-pod traffic series do (one lifecycle for both, ``model.pod_series``): a series exists while its
pod holds an observed IP, then ``grace`` seconds more, then it is gone (its counts stay in the node
totals); a pod observed again starts from zero.

Pure and synchronous, like the traffic ledger: the writer task calls it; the scrape reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from podmeter.model.datapath import Direction
from podmeter.model.endpoints import Names
from podmeter.model.flow_records import VERDICT_DROPPED, EndpointCache, FlowEnd, FlowRecord
from podmeter.model.flows import TCP, FlowCounts, Observation
from podmeter.model.pod_series import SeriesBook
from podmeter.model.records import Pod
from podmeter.model.workloads import workload_of

# The datapath's hooks, by tracepoint name (what `podmeter_drop_tracing_enabled{hook}` names).
HOOK_DROPS = "kfree_skb"
HOOK_RETRANSMITS = "tcp_retransmit_skb"
HOOK_RESETS_SENT = "tcp_send_reset"
HOOK_RESETS_RECEIVED = "tcp_receive_reset"
HOOKS = (HOOK_DROPS, HOOK_RETRANSMITS, HOOK_RESETS_SENT, HOOK_RESETS_RECEIVED)

# Reasons of ``enum skb_drop_reason`` (as the kernel names them) that are a socket's lifecycle, not a loss:
# packets the network delivered to a socket, still queued when the kernel frees the socket's queues as it
# closes or disconnects. QUEUE_PURGE: a queue freed in bulk (on pods' traffic: the receive queue of a TCP
# connection disconnected with unread data, e.g. one its listener closed before accepting it);
# SOCKET_CLOSE: a socket close()d with data queued; UNIX_DISCONNECT: a Unix socket's receive queue emptied
# as it disconnects. Counted apart (:attr:`DropLedger.lifecycle`), out of the drop series and the
# dropped-flow records (docs/drops.md).
LIFECYCLE_REASONS = frozenset({"QUEUE_PURGE", "SOCKET_CLOSE", "UNIX_DISCONNECT"})


class TcpEvent(enum.StrEnum):
    """A TCP event of a pod's own socket (its local address is the pod's)."""

    RETRANSMIT = "retransmit"  # a segment retransmitted
    RESET_SENT = "reset_sent"  # a RST the pod's stack sent
    RESET_RECEIVED = "reset_received"  # a RST one of its sockets accepted


class DropKey(NamedTuple):
    """Drops of one observed address: ``direction`` egress when it was the source (leaving the pod),
    ingress when it was the destination; ``reason`` as the kernel names it (``NETFILTER_DROP``)."""

    ip: str
    direction: Direction
    reason: str


class DropFlowKey(NamedTuple):
    """One dropped flow: ports are 0 for protocols without them (ICMP: type and code, as in flows)."""

    source: str
    destination: str
    source_port: int
    destination_port: int
    protocol: int
    source_observed: bool
    destination_observed: bool
    reason: str


class ConnectionKey(NamedTuple):
    """A TCP connection as the socket sees it: local end first."""

    local: str
    remote: str
    local_port: int
    remote_port: int


@dataclass(frozen=True)
class DropDrain:
    """What one drain of the datapath took (each entry once: read and deleted)."""

    drops: list[tuple[DropKey, int]] = field(default_factory=list)  # packets
    flows: list[tuple[DropFlowKey, FlowCounts]] = field(default_factory=list)
    tcp: list[tuple[tuple[str, TcpEvent], int]] = field(default_factory=list)  # (local IP, event): count
    retransmits: list[tuple[ConnectionKey, int]] = field(default_factory=list)
    drop_bytes: list[tuple[DropKey, int]] = field(default_factory=list)  # bytes of the same keys as ``drops``

    def __bool__(self) -> bool:
        return bool(self.drops or self.flows or self.tcp or self.retransmits)


class DropSource(Protocol):
    """What the agent needs from a datapath that traces drops and TCP health."""

    @property
    def hooks(self) -> Mapping[str, bool]:
        """Each hook of :data:`HOOKS`: True while it is attached."""
        ...

    def drain_drops(self) -> DropDrain:
        """Read and remove every entry of the drop and TCP maps."""
        ...

    def drops_lost(self) -> Mapping[str, int]:
        """Events not counted because their map was full, by map, since the maps were created."""
        ...


# --- the per-pod series ----------------------------------------------------------------------------------


@dataclass(slots=True)
class DropSeries:
    """The drop and TCP series of one pod (by UID). Invariant: ``ended_at`` is None iff ``ips`` is not
    empty. Every count only grows while the series exists."""

    uid: str
    namespace: str
    name: str
    workload_kind: str = ""
    workload_name: str = ""
    drops: dict[tuple[Direction, str], int] = field(default_factory=dict)
    drop_bytes: dict[tuple[Direction, str], int] = field(default_factory=dict)  # for Retina's adv_drop_bytes
    lifecycle: dict[tuple[Direction, str], int] = field(default_factory=dict)  # drops of a lifecycle reason
    tcp: dict[TcpEvent, int] = field(default_factory=dict)
    ips: set[str] = field(default_factory=set)
    ended_at: float | None = None


class DropLedger:
    """Who owns which IP, and each pod's drops and TCP events since its series began.

    Invariants:
    * an IP is in ``owners`` iff it is in ``series[owners[ip]].ips``;
    * ``previous`` holds, for each IP that lost its owner since the last drain, that owner and when (the
      first loss wins), so it has at most one entry per IP and every :meth:`add` empties it. An IP that
      lost its owner at one moment and got another at a later one, with no drain in between, cannot be
      split: its owner there is None (its events go to the node only). The agent drains at every change
      of hands, so that happens only for an address freed without one (interest removed) and reused
      within the same flow interval;
    * ``node_drops``, ``node_drop_bytes``, ``node_lifecycle`` and ``node_tcp`` hold every amount ever added,
      credited to a pod or not (an IP nobody owned at the drain: it left the filter between the count and
      the drain), so they never decrease;
    * a drop whose reason is in ``lifecycle`` goes to ``lifecycle`` counts (the series' and
      ``node_lifecycle``), never to ``drops`` counts, and the other way round; its bytes are not kept;
    * a series exists iff its pod holds an observed IP, or lost its last one less than ``grace`` ago
      (the lifecycle of :class:`~podmeter.model.pod_series.SeriesBook`, shared with the traffic ledger).
    """

    def __init__(self, grace: float, lifecycle: frozenset[str] = LIFECYCLE_REASONS) -> None:
        self.lifecycle = lifecycle  # reasons counted apart (empty: every reason is a drop)
        self.owners: dict[str, str] = {}
        self.previous: dict[str, tuple[str | None, float]] = {}
        self.node_drops: dict[tuple[Direction, str], int] = {}
        self.node_drop_bytes: dict[tuple[Direction, str], int] = {}  # the bytes of node_drops' packets
        self.node_lifecycle: dict[tuple[Direction, str], int] = {}
        self.node_tcp: dict[TcpEvent, int] = {}
        self.unattributed = 0  # events of IPs no pod owned at their drain
        self._book: SeriesBook[DropSeries] = SeriesBook(grace, _new_series)

    @property
    def series(self) -> dict[str, DropSeries]:
        """The live and ending series by pod UID (read-only for callers)."""
        return self._book.series

    def assign(self, ip: str, pod: Pod | None, now: float) -> None:
        """``pod`` owns ``ip`` from now on (None: nobody)."""
        current = self.owners.get(ip)
        if pod is not None and current == pod.uid:
            return
        if current is not None:
            self._close(ip, current, now)
        elif pod is not None and ip in self.previous and self.previous[ip][1] != now:
            self.previous[ip] = (None, now)  # freed earlier, reused now, no drain between: not splittable
        if pod is not None:
            self._book.holds(pod, ip)
            self.owners[ip] = pod.uid

    def release(self, ips: Iterable[str], now: float) -> None:
        """``ips`` left the filter: nobody owns them any more."""
        for ip in ips:
            current = self.owners.get(ip)
            if current is not None:
                self._close(ip, current, now)

    def add(self, drain: DropDrain, *, credit: bool = True) -> None:
        """Credit one drain to the owners its IPs had at the previous drain (:attr:`previous`, for those
        that changed hands since), else now. ``credit`` False: to the node totals only (what it holds may
        span a change of owner whose drain failed). Reasons of :attr:`lifecycle` are counted apart."""
        lifecycle = self.lifecycle
        for (ip, direction, reason), packets in drain.drops:
            key = (direction, reason)
            apart = reason in lifecycle
            node = self.node_lifecycle if apart else self.node_drops
            node[key] = node.get(key, 0) + packets
            series = self._owner_series(ip) if credit else None
            if series is None:
                self.unattributed += packets
            else:
                counts = series.lifecycle if apart else series.drops
                counts[key] = counts.get(key, 0) + packets
        # Bytes go to the owner their packets went to (only packets are counted as unattributed).
        for (ip, direction, reason), size in drain.drop_bytes:
            if reason in lifecycle:
                continue
            key = (direction, reason)
            self.node_drop_bytes[key] = self.node_drop_bytes.get(key, 0) + size
            series = self._owner_series(ip) if credit else None
            if series is not None:
                series.drop_bytes[key] = series.drop_bytes.get(key, 0) + size
        for (ip, event), count in drain.tcp:
            self.node_tcp[event] = self.node_tcp.get(event, 0) + count
            series = self._owner_series(ip) if credit else None
            if series is None:
                self.unattributed += count
            else:
                series.tcp[event] = series.tcp.get(event, 0) + count
        self.previous = {}

    def expire(self, now: float) -> int:
        """Drop series whose grace is over; returns how many."""
        return self._book.expire(now)

    def values(self) -> Iterator[DropSeries]:
        return iter(self.series.values())

    def _owner_series(self, ip: str) -> DropSeries | None:
        uid = self.previous[ip][0] if ip in self.previous else self.owners.get(ip)
        return None if uid is None else self.series.get(uid)

    def _close(self, ip: str, uid: str, now: float) -> None:
        self.previous.setdefault(ip, (uid, now))
        del self.owners[ip]
        self._book.lets_go(uid, ip, now)


def _new_series(pod: Pod) -> DropSeries:
    return DropSeries(pod.uid, pod.namespace, pod.name, *workload_of(pod))


@dataclass
class DropStats:
    """The drainer's counters (exported as metrics); they only grow."""

    drains: int = 0
    errors: int = 0


# --- dropped flows as flow records -------------------------------------------------------------------------


def name_drops(entries: Iterable[tuple[DropFlowKey, FlowCounts]], names: Names, node: str,
               wall_offset: float) -> list[FlowRecord]:
    """Flow records with verdict ``dropped`` for the dropped flows of one drain, both ends named as of now
    (the drain comes before any change of owner). ``observation`` says which end was observed: from-pod
    when the source was (the packet was leaving that pod), else to-pod (it was on its way into one)."""
    ends = EndpointCache(names)
    out = []
    for key, counts in entries:
        out.append(FlowRecord(
            time=counts.last_ns / 1e9 + wall_offset, first=counts.first_ns / 1e9 + wall_offset, node=node,
            source=FlowEnd(key.source, key.source_port, ends[key.source]),
            destination=FlowEnd(key.destination, key.destination_port, ends[key.destination]),
            protocol=key.protocol,
            observation=Observation.FROM_POD if key.source_observed else Observation.TO_POD,
            packets=counts.packets, bytes=counts.bytes, tcp_flags=counts.tcp_flags,
            verdict=VERDICT_DROPPED, drop_reason=key.reason,
        ))
    out.sort(key=lambda r: r.time)
    return out


class Retransmits:
    """Retransmits by connection, waiting to be put on the flow records of the same connection.

    A retransmitted segment leaves the socket's pod a few microseconds after the tracepoint counted it, so
    its flow entry is usually drained in the same interval, sometimes in the next: what finds no record by
    the drain after next is forgotten (the per-pod counts have it anyway). So what waits is bounded by the
    connections that retransmitted in two intervals, whether or not flows are drained meanwhile.
    """

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str, int, int], tuple[int, int]] = {}  # key -> (count, drain added)
        self._drain = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, entries: Iterable[tuple[ConnectionKey, int]]) -> None:
        """The retransmits of one drain (called at every drain, with or without entries)."""
        self._drain += 1
        if self._waiting:
            self._waiting = {k: v for k, v in self._waiting.items() if self._drain - v[1] < 2}
        for key, count in entries:
            old = self._waiting.get(key)
            self._waiting[key] = (count + (old[0] if old else 0), self._drain)

    def annotate(self, records: list[FlowRecord]) -> list[FlowRecord]:
        """``records`` with ``tcp_retransmits`` set on the record of each waiting connection: the
        from-pod record of its local end (where the segments left), else its to-pod record."""
        waiting = self._waiting
        if not waiting:
            return records
        chosen: dict[tuple[str, str, int, int], int] = {}
        for index, record in enumerate(records):
            if record.protocol != TCP or record.verdict == VERDICT_DROPPED:
                continue
            key = (record.source.ip, record.destination.ip, record.source.port, record.destination.port)
            if key in waiting and (key not in chosen or record.observation is Observation.FROM_POD):
                chosen[key] = index
        if not chosen:
            return records
        out = list(records)
        for key, index in chosen.items():
            record = out[index]
            out[index] = msgspec.structs.replace(record, tcp_retransmits=record.tcp_retransmits + waiting.pop(key)[0])
        return out
