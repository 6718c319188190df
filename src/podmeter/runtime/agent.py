"""The agent's writer task: one node's pods, from the API server to the kernel's filter, in one loop.

The path of one pod event, in one pass: a reflector (this node's pods, the namespaces, the
MetricsConfigurations, the cluster's PodSlices) puts a typed delta on the one queue; the writer task takes
a batch and, for each delta, ``view.apply`` stores it, moves the desired filter and keeps who the addresses
it hands over named; then ``writer.flush`` writes the filter's crossings to the datapath, and what the flush
released (the final counters of IPs that left the filter) closes their owners' share in the traffic
ledger, which then gives every IP whose holder changed to its new owner (their counters read with the
datapath's narrow ``read_counters_of``). Last, the drains of flows and drops have their own place: after
the write, every ``--flow-interval`` and whenever the batch handed an address over, named with the view
as it was before (``NodeView.take_handover``: invariant I8). Only the writer task touches the view, the
writer and the ledgers, so there is no lock to forget.

Timers queue ticks (``runtime.ticks``): a resync (the write of that batch compares the filter with what the
kernel really holds and repairs drift), an expiry of the series whose grace is over, a drain. With
``watch_nodes`` (the Hubble API on), one more reflector keeps the cluster's nodes in ``nodes`` for the
Hubble API's peer list, outside the queue: nodes move nothing in the filter, and readiness never waits for
them.

Nothing is flushed before every collection has been listed once: a pod listed before its namespace would
otherwise be judged without the namespace's annotation, and entries pinned by a predecessor would be
judged against a partial store. The first flush is a resync, which adopts what the predecessor left and
removes what nobody wants any more (invariant I6, docs/design.md).

The process around it (the datapath it opens, the HTTP endpoints, the Hubble API) is
``runtime.agent_process``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.kube.connection import Connection
from podmeter.adapters.kube.reflector import Reflector
from podmeter.adapters.kube.resources import (
    METRICS_CONFIGURATIONS,
    NAMESPACES,
    NODES,
    POD_SLICES,
    PODS,
    SERVICE_BACKENDS,
    SERVICES,
    ResourceKind,
)
from podmeter.adapters.kube.transport import Transport
from podmeter.adapters.metrics.agent_state import AgentSnapshot, FlowSnapshot
from podmeter.adapters.metrics.retina import REMOTE
from podmeter.model.configuration import MetricsConfiguration
from podmeter.model.datapath import Datapath
from podmeter.model.deltas import Collection, Delta, Replace
from podmeter.model.dns import DnsLedger, DnsSource
from podmeter.model.drops import LIFECYCLE_REASONS, DropLedger, DropSource
from podmeter.model.endpoint_slices import endpoint_labels
from podmeter.model.endpoints import Endpoint, Names
from podmeter.model.flow_series import WorkloadFlows
from podmeter.model.flows import FlowSource
from podmeter.model.hubble_metrics import HubbleMetrics, dns_events
from podmeter.model.hubble_metrics_config import parse as parse_hubble_metrics
from podmeter.model.interest import holds_address
from podmeter.model.records import Node, Pod
from podmeter.model.retina_dns import RetinaDns
from podmeter.model.retina_flows import WorkloadFlowsAndRetina
from podmeter.model.service_series import ServiceTraffic
from podmeter.model.store import Store
from podmeter.model.traffic import TrafficLedger
from podmeter.model.view import NodeView, ViewDelta
from podmeter.runtime.datapaths import PodLinks
from podmeter.runtime.dns_drain import DnsDrainer
from podmeter.runtime.drop_drain import DropDrainer
from podmeter.runtime.flow_drain import FlowDrainer, TakenDrain
from podmeter.runtime.service_names import SERVICES_HINT, ServiceNames
from podmeter.runtime.settings import AgentSettings
from podmeter.runtime.supervision import Supervisor
from podmeter.runtime.ticks import Tick, every
from podmeter.runtime.writer import Pushed, Writer

__all__ = ["Agent", "AgentSettings", "Item"]

log = logging.getLogger("podmeter.agent")

KINDS: tuple[ResourceKind[Any], ...] = (PODS, NAMESPACES, METRICS_CONFIGURATIONS)
# Watched too, but readiness does not wait for them: without the operator's slices (the CRD not installed,
# no operator yet) far ends of flows are `world`, a degraded mode, not a reason to stay unready.
OPTIONAL_KINDS: tuple[ResourceKind[Any], ...] = (POD_SLICES,)
REQUIRED = frozenset(kind.collection for kind in KINDS)
# The cluster's nodes, watched only with ``AgentSettings.watch_nodes`` (the Hubble API's peers): never
# waited for, and a 403 (RBAC without nodes) or 404 is an empty list, the peers then this node alone.
NODES_HINT = ("the Hubble API announces this node only; grant the agent list and watch on nodes "
              "(deploy/base/agent-rbac.yaml) for Hubble Relay to find the others")
MAX_BATCH = 512  # deltas applied between two flushes at most (bounds the latency of a flush)
LINKS_SETTLE_MAX = 15.0  # seconds the first push waits for the pods' links at most
LINKS_POLL = 0.02  # seconds: how often the first push looks again whether the pods' links are attached


Item = ViewDelta | Tick


class Agent:
    """The running agent. Invariant: only :meth:`_write_loop` mutates ``writer`` (and so the datapath).

    ``flows`` and ``drops``: the datapath's flow and drop sources (None: not drained); ``links``: which
    pod IPs reach a link the datapath counts on (the eBPF attach manager; None: the datapath has none).
    """

    def __init__(self, settings: AgentSettings, connection: Connection, datapath: Datapath,
                 flows: FlowSource | None = None, drops: DropSource | None = None, *,
                 links: PodLinks | None = None, services: ServiceNames | None = None,
                 dns: DnsSource | None = None) -> None:
        self.settings = settings
        self.connection = connection
        self.datapath = datapath
        self.links = links
        # The cluster's Services (with flows only: they name flows' ends), fed like the nodes below.
        self.services = services if flows is not None else None
        node = settings.node_name
        self.view = NodeView(node, track_moves=True, track_handovers=flows is not None or drops is not None)
        self.writer = Writer(self.view.desired, datapath)
        self.ledger = TrafficLedger(settings.series_grace)
        self.flow_feed = FlowFeed(settings.flow_buffer)
        # With Retina's remote context (from the flow records), one table feeds both: the drains see one
        # WorkloadFlows as ever, and the drop drain feeds Retina's drop series.
        limit, idle = settings.flow_series_limit, settings.flow_series_idle
        self.retina = (WorkloadFlowsAndRetina(node, limit, idle)
                       if settings.retina_compat == REMOTE and flows is not None else None)
        self.workload_flows = self.retina if self.retina is not None else WorkloadFlows(node, limit, idle)
        self.drop_ledger = DropLedger(  # per-pod drops and TCP health (runtime.drop_drain)
            settings.series_grace, frozenset() if settings.drops_include_lifecycle else LIFECYCLE_REASONS)
        self.drops = (DropDrainer(drops, self.drop_ledger, node, self.flow_feed, [self.view.cluster],
                                  annotate_flows=flows is not None,
                                  series=self.retina.retina_drops.add if self.retina is not None else None)
                      if drops else None)
        self.service_traffic = ServiceTraffic(node, limit, idle)  # per Service and client workload
        self.flows = (FlowDrainer(flows, node, self.flow_feed, self.workload_flows, [self.view.cluster],
                                  annotate=self.drops.annotate if self.drops else None, services=self.services,
                                  service_traffic=self.service_traffic)
                      if flows else None)
        self.hubble_metrics = self._hubble_metrics(settings)
        self.dns_ledger = DnsLedger(settings.series_grace)  # per-pod DNS (runtime.dns_drain)
        self.dns_feed = FlowFeed(settings.flow_buffer)  # the DNS records (podmeter observe --protocol dns)
        self.dns = DnsDrainer(dns, self.dns_ledger, self.dns_feed, node, [self.view.cluster]) if dns else None
        self.retina_dns = self._retina_dns(settings) if dns else None
        if self.hubble_metrics is not None:  # Hubble's DNS families, from the DNS records the drain publishes
            hubble_metrics = self.hubble_metrics
            self.dns_feed.taps.append(lambda records, _: hubble_metrics.add_dns(dns_events(records), time.monotonic()))
        self.queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=10_000)
        self.synced: set[Collection[Any]] = set()
        self.ready = asyncio.Event()
        self.last_resync: float | None = None
        self._transport: Transport | None = None
        self._reflectors: list[Reflector[Any]] = []
        self.supervisor = Supervisor()
        self._retry_scheduled = False
        self._resync_due = False  # a resync tick came: the next write is a resync
        self._drain_due = False  # a drain tick came: the next drain place drains
        self._drain_deferred = False  # in the writer task: a drain's conntrack read is awaited after the batch
        self._taken: TakenDrain | None = None
        self._links_since: float | None = None  # when the first push began to wait for the pods' links
        # The cluster's nodes (settings.watch_nodes), applied on the event loop as their deltas come: they
        # move nothing in the view or the datapath, so they skip the writer's queue.
        self.nodes: Store[Node] = Store(NODES.collection)
        self._nodes_changed: list[Callable[[Node | None, Node | None], None]] = []
        self._pods_changed = True  # the node's pod IPs are to be computed again and given to links
        self._pod_ips: frozenset[str] | None = None  # the IPs last given to links

    def _hubble_metrics(self, settings: AgentSettings) -> HubbleMetrics | None:
        """Hubble's metrics (``--hubble-metrics``), fed every record the drains publish; None: off."""
        if settings.hubble_metrics is None:
            return None
        metrics = HubbleMetrics(parse_hubble_metrics(settings.hubble_metrics), settings.hubble_metrics_series_limit,
                                settings.flow_series_idle, settings.series_grace, self._endpoint_labels)
        self.flow_feed.taps.append(lambda records, passed: metrics.add(records, time.monotonic(), passed))
        return metrics

    def _retina_dns(self, settings: AgentSettings) -> RetinaDns | None:
        """Retina's DNS series (--retina-compat), fed every DNS record the drain publishes; None: off."""
        if settings.retina_compat is None:
            return None
        table = RetinaDns(settings.retina_dns_names_limit, settings.flow_series_limit, settings.flow_series_idle,
                          settings.series_grace, remote=settings.retina_compat == REMOTE)
        self.dns_feed.taps.append(lambda records, _: table.add(records, time.monotonic()))
        return table

    def _endpoint_labels(self, endpoint: Endpoint) -> tuple[str, ...]:
        return endpoint_labels(endpoint, self.view.pods, self.view.cluster)

    def known_pods(self) -> set[tuple[str, str]]:
        """(namespace, name) of every pod the agent knows: this node's and the cluster's endpoints."""
        known = {(pod.namespace, pod.name) for pod in self.view.pods.values()}
        known.update((e.namespace, e.pod) for _, e in self.view.cluster.items())
        return known

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._transport = self.connection.transport()
        for kind in (*KINDS, *OPTIONAL_KINDS):
            settings = self.settings.reflector(kind)
            settings.optional = kind is not PODS and kind is not NAMESPACES  # CRDs: a degraded mode if absent
            if kind is PODS:
                settings.field_selector = f"spec.nodeName={self.settings.node_name}"
            self._reflectors.append(Reflector(kind, self._transport, self.queue.put, settings))
        if self.settings.watch_nodes:
            self._reflectors.append(self._nodes_reflector(self._transport))
        if self.services is not None:
            self._reflectors += self._service_reflectors(self._transport, self.services)
        spawn = self.supervisor.spawn
        for reflector in self._reflectors:
            spawn(reflector.run(), f"reflector-{reflector.kind.name}")
        spawn(self._write_loop(), "writer")
        spawn(every(self.settings.resync_interval, self.queue, Tick.RESYNC), "resync-timer")
        spawn(every(max(0.2, self.settings.series_grace / 4), self.queue, Tick.EXPIRE), "expire-timer")
        if self.flows is not None or self.drops is not None or self.dns is not None:
            spawn(every(self.settings.flow_interval, self.queue, Tick.DRAIN), "flow-drain-timer")
        if self.links is not None:  # the attach worker (a thread): its death after start-up is a task's
            spawn(self.links.watch(), "attach")

    def _nodes_reflector(self, transport: Transport) -> Reflector[Node]:
        settings = self.settings.reflector(NODES)
        settings.optional, settings.missing_statuses, settings.missing_hint = True, frozenset({403, 404}), NODES_HINT
        return Reflector(NODES, transport, self._apply_nodes, settings)

    def _service_reflectors(self, transport: Transport, services: ServiceNames) -> list[Reflector[Any]]:
        made: list[Reflector[Any]] = []
        for kind, apply in ((SERVICES, services.apply_services), (SERVICE_BACKENDS, services.apply_backends)):
            settings = self.settings.reflector(kind)
            settings.optional, settings.missing_statuses = True, frozenset({403, 404})
            settings.missing_hint = SERVICES_HINT
            made.append(Reflector(kind, transport, apply, settings))
        return made

    async def _apply_nodes(self, delta: Delta[Node]) -> None:
        self.nodes.apply(delta, self._node_changed)

    def _node_changed(self, old: Node | None, new: Node | None) -> None:
        for changed in self._nodes_changed:
            changed(old, new)

    def cluster_nodes(self) -> Store[Node]:
        """The cluster's nodes as last listed and watched (empty unless ``settings.watch_nodes``)."""
        return self.nodes

    def on_nodes_changed(self, changed: Callable[[Node | None, Node | None], None]) -> None:
        """Call ``changed(old, new)`` on the event loop for each change a delta makes to :meth:`cluster_nodes`
        (a relist: one call per node it changed; the store, not the events, is the level)."""
        self._nodes_changed.append(changed)

    @property
    def task_failures(self) -> dict[str, int]:
        return dict(self.supervisor.failures)

    async def stop(self) -> None:
        """Stop watching, push what is queued, leave the datapath's pinned state in place."""
        await self.supervisor.cancel_all()
        while not self.queue.empty():
            self._take(self.queue.get_nowait())
        if self.ready.is_set():
            self._settle(self.writer.flush())
        if self._transport is not None:
            await self._transport.close()
        if self.services is not None:
            self.services.close()

    # --- the writer task -------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while len(batch) < MAX_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self._drain_deferred = True  # a flow drain through Services: its conntrack read off the loop
            try:
                self.apply_batch(batch)
            finally:
                self._drain_deferred = False
            taken, self._taken = self._taken, None
            if taken is not None and self.flows is not None:  # finished before the next batch: same order
                await self.flows.finish_async(taken)

    def apply_batch(self, items: list[Item]) -> None:
        """One pass of the writer task: each item to its place (a delta to the view, a tick to its job),
        then the write to the datapath, then the drains. Only the writer task calls this (tests and
        benchmarks drive it directly, without reflectors)."""
        interest = self.view.interest
        for item in items:
            self._take(item)
        if self.view.interest != interest:
            config = self.view.configuration
            log.info("MetricsConfiguration %s", f"applied: {config.interest}" if config else "removed")
        self._give_pod_ips()  # before the filter write: the link attaches while the IP enters the filter
        self._write()
        self._drain()

    def _take(self, item: Item) -> None:
        """A delta goes to the view; a tick's job runs here (expiry) or marks the write or the drain."""
        if item is Tick.RESYNC:
            self._resync_due = True
        elif item is Tick.RETRY:
            self._retry_scheduled = False
        elif item is Tick.EXPIRE:
            now = time.monotonic()
            self.ledger.expire(now)
            self.workload_flows.expire(now)
            self.service_traffic.expire(now)
            self.drop_ledger.expire(now)
            known = functools.cache(self.known_pods)  # built at most once a tick, by whichever asks first
            if self.hubble_metrics is not None:
                self.hubble_metrics.expire(now, known)
            self.dns_ledger.expire(now)
            if self.retina_dns is not None:
                self.retina_dns.expire(now, known)
        elif item is Tick.DRAIN:
            self._drain_due = True
        elif not isinstance(item, Tick):
            self.view.apply(item)
            self._pods_changed = self._pods_changed or item.collection is PODS.collection
            if isinstance(item, Replace):
                self.synced.add(item.collection)

    def _give_pod_ips(self) -> None:
        """Tell the links which IPs this node's pods hold, observed or not: the links that carry them are
        the pods' links. Not only the observed pods': a flow from an unobserved pod to an observed one is
        seen on the unobserved pod's link, and a pod that becomes observed is then counted at once."""
        if self.links is None or not self._pods_changed:
            return
        self._pods_changed = False
        node = self.settings.node_name
        ips = frozenset(ip for pod in self.view.pods.values() if pod.node_name == node and holds_address(pod)
                        for ip in pod.ips)
        if ips != self._pod_ips:
            self._pod_ips = ips
            self.links.set_pod_ips(ips)

    # --- the write -------------------------------------------------------------------------------

    def _write(self) -> None:
        """The filter's crossings to the datapath (a resync when one is due), once the agent is ready; the
        first write, once every collection is listed and the pods' links are attached, is a resync."""
        if not self.ready.is_set():
            if self.synced >= REQUIRED and self._links_settled():
                self._become_ready()
            return
        if self._resync_due:
            self._resync_due = False
            pushed = self.writer.resync()
            self.last_resync = time.time()
        else:
            pushed = self.writer.flush()
        if not pushed.ok or self.writer.dirty:
            self._schedule_retry()
        self._settle(pushed)

    def _become_ready(self) -> None:
        """What was counted before anyone owned an IP is nobody's but where a link says whose: drops go to
        the node totals only (the drop drainer credits a predecessor's by its owner record), a
        predecessor's flows are named by the pods whose links were adopted (a pod keeps its link for life:
        the same pod), every other address world (who held it while no agent ran is unknown), far ends
        too. Then the first resync adopts or cleans what a predecessor pinned."""
        self.view.take_handover()  # the drains below name with the view as it is: no change of hands owed
        self._drain_due = False
        if self.drops is not None:
            self.drops.drain(self.view.pods.values())
        if self.flows is not None:
            kept = self._pods_on_inherited_links()
            self.flows.drain(kept, named=bool(kept), others=[])
        if self.dns is not None:  # a predecessor's: whose is unknown (no series yet), the records unnamed
            self.dns.drain((), others=[], sweep=False)
        self._resync_due = False
        self._settle(self.writer.resync(), inherit=True)
        self.last_resync = time.time()
        self.ready.set()
        log.info("ready: %d pods, %d desired IPs", len(self.view.pods), len(self.view.desired))

    def _pods_on_inherited_links(self) -> list[Pod]:
        if self.links is None:
            return []
        pods = [pod for pod in self.view.pods.values() if holds_address(pod)]
        inherited = self.links.inherited(ip for pod in pods for ip in pod.ips)
        return [pod for pod in pods if inherited.issuperset(pod.ips)]

    def _links_settled(self) -> bool:
        """Whether the links of the pods listed are attached. The first push waits for it, so that what
        it writes is counted from then on: the links are the pods' only once their IPs are known, and a
        predecessor's TCX links died with it. Looked at again every LINKS_POLL seconds until then."""
        if self.links is None or self.links.settled():
            return True
        waited = time.monotonic() - self._links_since if self._links_since is not None else 0.0
        if self._links_since is None:
            self._links_since = time.monotonic()
        elif waited > LINKS_SETTLE_MAX:  # a stuck attach never keeps the agent from being ready
            log.warning("the pods' links are not all attached after %.0f s: ready anyway (podmeter_links_skipped "
                        "and /debug/state say which failed)", waited)
            return True
        self._schedule_retry(LINKS_POLL)
        return False

    def _settle(self, pushed: Pushed, inherit: bool = False) -> None:
        """The ledger follows what the datapath did: IPs that left the filter close their owners' share
        with their last counters; then every IP whose holders changed goes to its new owner, with the
        kernel's counters now as its base. ``inherit`` (the first push): for the IPs whose link a
        predecessor left attached (the same pod's link, so the same pod), what the kernel counted is their
        holders' (base zero), so a pod's series goes on from the kernel's count across a restart: the
        packets of the gap (the pinned links counted them) are in it, and nothing the predecessor reported
        is counted again (its series had the same value and restarts no lower). Other IPs may have
        changed hands while no agent ran: their counters are a base, as always (F21). IPs the resync
        removed were released with their final counters, unowned."""
        now = time.monotonic()
        if pushed.released:
            self.ledger.release(pushed.released, pushed.final, now)
            self.drop_ledger.release(pushed.released, now)
            self.dns_ledger.release(pushed.released, now)
        moved = self.view.take_moved()
        if not moved:
            return
        kernel = self.datapath.read_counters_of(moved)
        inherited = self.links.inherited(moved) if inherit and self.links is not None else frozenset()
        for ip in moved:
            owner = self.view.owner(ip)
            self.ledger.assign(ip, owner, {} if ip in inherited else kernel, now)
            self.drop_ledger.assign(ip, owner, now)
            self.dns_ledger.assign(ip, owner, now)

    def _schedule_retry(self, delay: float | None = None) -> None:
        if self._retry_scheduled:
            return
        self._retry_scheduled = True
        asyncio.get_running_loop().call_later(self.settings.retry_interval if delay is None else delay,
                                              self.queue.put_nowait, Tick.RETRY)

    # --- the drains ------------------------------------------------------------------------------

    def _drain(self) -> None:
        """The drains' place, after the write: when the batch handed an address over, named with the view
        as it was before (so the flows and drops counted until the filter write are their holders', and an
        IP leaving the filter does not wait for the kernel's flip of the flow maps); else when a drain tick
        came, named with the view as it is. Drops first: the retransmits they hold go on the records of the
        flow drain that follows. A drain that fails at a change of hands leaves entries whose holders are
        unknown: the next one names them world (never the next holder)."""
        handover = self.view.take_handover()
        due, self._drain_due = self._drain_due, False
        if not self.ready.is_set() or (handover is None and not due):
            return
        pods: Iterable[Pod] = self.view.pods.values() if handover is None else handover.pods
        others: Sequence[Names] = [self.view.cluster] if handover is None else [handover.cluster]
        if self.drops is not None:
            self.drops.drain(pods, others=others)
        if self.dns is not None:
            self.dns.drain(pods, others=others)
        if self.flows is not None:
            taken = self.flows.take(pods, others=others)
            if taken is None:
                self.flows.owed = self.flows.owed or handover is not None
            elif self._drain_deferred and taken.wants_translations:
                self._taken = taken  # the writer task finishes it (runtime.flow_drain.finish_async)
            else:
                self.flows.finish_here(taken)

    # --- views for the HTTP endpoints ------------------------------------------------------------

    def snapshot(self) -> AgentSnapshot:
        view, stats = self.view, self.writer.stats
        events: dict[tuple[str, str], int] = {}
        relists: dict[tuple[str, str], int] = {}
        decode_errors: dict[str, int] = {}
        failures: dict[tuple[str, str], int] = {}
        for r in self._reflectors:
            failures.update({(r.kind.name, cause): n for cause, n in r.stats.failures.items()})
            events.update({(r.kind.name, t): n for t, n in r.stats.events.items()})
            relists.update({(r.kind.name, why): n for why, n in r.stats.relists.items()})
            decode_errors[r.kind.name] = r.stats.decode_errors
        return AgentSnapshot(
            filter_entries=len(self.writer.installed),
            filter_desired=len(view.desired),
            filter_capacity=self.datapath.capacity,
            filter_overflow=self.writer.overflow,
            write_errors=dict(stats.write_errors),
            drift_repaired=dict(stats.drift_repaired),
            watch_events=events,
            relists=relists,
            watch_failures=failures,
            store_objects={"pods": len(view.pods), "namespaces": len(view.namespaces),
                           "metricsconfigurations": len(view.configuration_store),
                           "podslices": len(view.slice_store), "cluster_endpoints": len(view.cluster)},
            decode_errors=decode_errors,
            resyncs=stats.resyncs,
            ready=self.ready.is_set(),
            flows=self._flow_snapshot(),
            unusable_pod_ips=sum(len(p.unusable_ips) for p in view.pods.values()),
            task_failures=dict(self.task_failures),
            pods_without_link=None if (unlinked := self.pods_without_link()) is None else len(unlinked),
            links=self.links.link_counts() if self.links is not None else None,
        )

    def _flow_snapshot(self) -> FlowSnapshot | None:
        if self.flows is None:
            return None
        d, feed = self.flows.stats, self.flow_feed
        return FlowSnapshot(
            lost_packets=self.flows.source.flows_lost(), capacity=self.flows.source.flow_capacity,
            drains=d.drains, drain_errors=d.errors, entries=d.entries, last_drain_entries=d.last_entries,
            last_drain_seconds=d.last_seconds, series=len(self.workload_flows.pairs),
            series_folded=self.workload_flows.folded, followers=feed.followers,
            followers_cut_off=feed.cut_off, buffer_dropped=feed.ring.dropped, unnamed=d.unnamed,
            streams=feed.streams, streams_refused=feed.refused, followers_evicted=feed.evicted,
            reader_gaps=feed.gaps, reader_lost=feed.lost,
        )

    def debug_state(self) -> dict[str, Any]:
        view = self.view
        actual = sorted(self.datapath.contents())
        desired = {ip: [p.key for p in view.owners(ip)] for ip in view.desired}
        return {
            "node": self.settings.node_name,
            "ready": self.ready.is_set(),
            "pods": len(view.pods),
            "pod_uids": sorted(view.pods),  # what the store holds, for audits (the lab's I1 check)
            "namespaces": len(view.namespaces),
            "configuration": _interest_json(view.configuration),
            "filter": {
                "capacity": self.datapath.capacity,
                "desired": desired,
                "actual": actual,
                "overflow": sorted(self.writer.pending),
                "leaked": sorted(set(actual) - set(desired)),
                "missing": sorted(set(desired) - set(actual) - set(self.writer.pending)),
            },
            "last_resync": self.last_resync,
            "pods_without_link": self.pods_without_link(),
            "drift_repaired": dict(self.writer.stats.drift_repaired),
            "write_errors": {f"{op}/{errno}": n for (op, errno), n in self.writer.stats.write_errors.items()},
            "reflectors": {r.kind.name: {"resourceVersion": r.resource_version, "relists": dict(r.stats.relists),
                                         "failures": dict(r.stats.failures), "requests": r.stats.requests,
                                         "decode_errors": r.stats.decode_errors}
                           for r in self._reflectors},
            "services": self.services.debug() if self.services is not None else None,
        }

    def pods_without_link(self) -> list[str] | None:
        """Observed pods (``namespace/name``) none of whose IPs reach a link the datapath counts on: their
        traffic is not counted. None when the datapath has no links (memory)."""
        if self.links is None:
            return None
        unlinked = self.links.unlinked(self.view.desired)
        return sorted({pod.key for ip in unlinked for pod in self.view.owners(ip)})

    def debug_endpoints(self) -> dict[str, Any]:
        """The cluster-wide endpoint cache, IP -> endpoint (the lab's I7 check compares it with the pods)."""
        return {
            "node": self.settings.node_name,
            "slices": {name: s.resource_version for name, s in sorted(self.view.slice_store.objects.items())},
            "endpoints": {ip: {"namespace": e.namespace, "pod": e.pod, "workload": e.workload,
                               "workload_kind": e.workload_kind, "node": e.node, "identity": e.identity}
                          for ip, e in sorted(self.view.cluster.items())},
        }


def _interest_json(config: MetricsConfiguration | None) -> dict[str, Any] | None:
    if config is None:
        return None
    i = config.interest
    return {"name": config.name, "resourceVersion": config.resource_version, "include": sorted(i.include),
            "exclude": sorted(i.exclude), "annotations": i.annotations}
