"""``podmeter agent``: the composition root on one node.

Three reflectors (this node's pods, namespaces, the MetricsConfiguration) feed one queue; one writer task
drains it, applies each delta to the view and flushes the difference to the datapath. Only the writer
task touches the view and the filter, so there is no lock to forget. A periodic resync, queued like any
delta, compares the filter with what the kernel really holds and repairs drift.

Nothing is flushed before every collection has been listed once: a pod listed before its namespace would
otherwise be judged without the namespace's annotation, and entries pinned by a predecessor would be
judged against a partial store. The first flush is a resync, which adopts what the predecessor left and
removes what nobody wants any more (invariant I6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmeter.adapters.kube.connection import Connection
from podmeter.adapters.kube.deltas import Delta, Replace, Upsert
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import METRICS_CONFIGURATIONS, NAMESPACES, PODS, ResourceKind
from podmeter.adapters.kube.transport import Transport
from podmeter.adapters.metrics.agent_state import AgentSnapshot
from podmeter.model.configuration import DEFAULT_NAME, NO_CONFIGURATION, MetricsConfiguration
from podmeter.model.datapath import Datapath, Direction, Traffic
from podmeter.model.traffic import TrafficLedger
from podmeter.model.view import NodeView
from podmeter.runtime.writer import Writer

log = logging.getLogger("podmeter.agent")

COLLECTIONS = (PODS, NAMESPACES, METRICS_CONFIGURATIONS)
MAX_BATCH = 512  # deltas applied between two flushes at most (bounds the latency of a flush)


@dataclass
class AgentSettings:
    node_name: str
    resync_interval: float = 60.0
    retry_interval: float = 1.0  # pause before retrying a flush the datapath refused
    series_grace: float = 30.0  # a pod's traffic series outlives its observation by this much (2 scrapes)
    reflector: Callable[[ResourceKind], ReflectorSettings] = field(
        default=lambda kind: ReflectorSettings()
    )


class _Resync:
    """Queued by the timer: the writer task does the resync between two deltas."""


class _Retry:
    """Queued after a refused flush: try again."""


class _Expire:
    """Queued by the timer: drop traffic series whose grace period is over."""


Item = Delta | _Resync | _Retry | _Expire


class Agent:
    """The running agent. Invariant: only :meth:`_write_loop` mutates ``writer`` (and so the datapath)."""

    def __init__(self, settings: AgentSettings, connection: Connection, datapath: Datapath) -> None:
        self.settings = settings
        self.connection = connection
        self.datapath = datapath
        self.ledger = TrafficLedger(settings.series_grace)
        self.writer = Writer(NodeView(settings.node_name, track_moves=True), datapath, on_release=self._released)
        self.queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=10_000)
        self.configuration: MetricsConfiguration | None = None
        self.synced: set[str] = set()
        self.ready = asyncio.Event()
        self.last_resync: float | None = None
        self._transport: Transport | None = None
        self._reflectors: list[Reflector] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._retry_scheduled = False

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._transport = self.connection.transport()
        for kind in COLLECTIONS:
            settings = self.settings.reflector(kind)
            if kind is PODS:
                settings.field_selector = f"spec.nodeName={self.settings.node_name}"
            self._reflectors.append(Reflector(kind, self._transport, self.queue.put, settings))
        self._tasks = [asyncio.create_task(r.run(), name=f"reflector-{r.kind.name}") for r in self._reflectors]
        self._tasks.append(asyncio.create_task(self._write_loop(), name="writer"))
        self._tasks.append(asyncio.create_task(self._resync_timer(), name="resync-timer"))
        self._tasks.append(asyncio.create_task(self._expire_timer(), name="expire-timer"))

    async def stop(self) -> None:
        """Stop watching, push what is queued, leave the datapath's pinned state in place."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._drain_queue()
        if self.ready.is_set():
            self.writer.flush()
        if self._transport is not None:
            await self._transport.close()

    # --- the writer task -------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while len(batch) < MAX_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            self.apply_batch(batch)

    def apply_batch(self, items: list[Item]) -> None:
        """Apply queued items, then push the result to the datapath. Only the writer task calls this
        (tests and benchmarks drive it directly, without reflectors)."""
        for item in items:
            self._apply(item)
        self._push()

    def _drain_queue(self) -> None:
        while not self.queue.empty():
            self._apply(self.queue.get_nowait())

    def _apply(self, item: Item) -> None:
        if isinstance(item, _Resync):
            if self.ready.is_set():
                self._resync()
            return
        if isinstance(item, _Retry):
            self._retry_scheduled = False
            return
        if isinstance(item, _Expire):
            self.ledger.expire(time.monotonic())
            return
        if item.resource == PODS.name:
            self._apply_pod(item)
        elif item.resource == NAMESPACES.name:
            self._apply_namespace(item)
        else:
            self._apply_configuration(item)
        if isinstance(item, Replace):
            self.synced.add(item.resource)

    def _apply_pod(self, delta: Delta) -> None:
        if isinstance(delta, Replace):
            self.writer.replace_pods(delta.items, delta.keep)
        elif isinstance(delta, Upsert):
            self.writer.upsert_pod(delta.item)
        else:
            self.writer.delete_pod(delta.key)

    def _apply_namespace(self, delta: Delta) -> None:
        if isinstance(delta, Replace):
            self.writer.replace_namespaces(delta.items, delta.keep)
        elif isinstance(delta, Upsert):
            self.writer.upsert_namespace(delta.item)
        else:
            self.writer.delete_namespace(delta.key)

    def _apply_configuration(self, delta: Delta) -> None:
        """Only the object named ``default`` counts; an invalid one never arrives here (the reflector
        skips and counts it), so the last valid configuration stays in force."""
        if isinstance(delta, Replace):
            if DEFAULT_NAME in delta.keep:
                return
            found = [c for c in delta.items if c.name == DEFAULT_NAME]
            self._set_configuration(found[0] if found else None)
        elif isinstance(delta, Upsert):
            if delta.item.name == DEFAULT_NAME:
                self._set_configuration(delta.item)
        elif delta.key == DEFAULT_NAME:
            self._set_configuration(None)

    def _set_configuration(self, config: MetricsConfiguration | None) -> None:
        self.configuration = config
        if self.writer.view.set_interest(config.interest if config else NO_CONFIGURATION):
            log.info("MetricsConfiguration %s", f"applied: {config.interest}" if config else "removed")

    def _push(self) -> None:
        if not self.ready.is_set():
            if len(self.synced) < len(COLLECTIONS):
                return
            self._resync()  # the first push: adopt or clean what a predecessor pinned
            self._attribute()  # counters a predecessor left become the owners' baselines
            self.ready.set()
            log.info("ready: %d pods, %d desired IPs", len(self.writer.view.pods), len(self.writer.view.desired))
            return
        if not self.writer.flush() or self.writer.dirty:
            self._schedule_retry()
        self._attribute()

    def _resync(self) -> None:
        self.writer.resync()
        self.last_resync = time.time()
        self._attribute()

    def _released(self, ips: list[str], final: dict[tuple[str, Direction], Traffic]) -> None:
        """IPs left the filter: their last counters close their owners' share (called inside a flush)."""
        self.ledger.release(ips, final, time.monotonic())

    def _attribute(self) -> None:
        """Give every IP whose holders changed to its new owner, with the kernel's counters as the base."""
        moved = self.writer.view.desired.take_moved()
        if not moved:
            return
        kernel = self.datapath.read_counters()
        now = time.monotonic()
        view = self.writer.view
        for ip in moved:
            self.ledger.assign(ip, view.owner(ip), kernel, now)

    def _schedule_retry(self) -> None:
        if self._retry_scheduled:
            return
        self._retry_scheduled = True
        asyncio.get_running_loop().call_later(self.settings.retry_interval, self.queue.put_nowait, _Retry())

    async def _expire_timer(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, self.settings.series_grace / 4))
            await self.queue.put(_Expire())

    async def _resync_timer(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_interval)
            await self.queue.put(_Resync())

    # --- views for the HTTP endpoints ------------------------------------------------------------

    def snapshot(self) -> AgentSnapshot:
        view, stats = self.writer.view, self.writer.stats
        events: dict[tuple[str, str], int] = {}
        relists: dict[tuple[str, str], int] = {}
        decode_errors: dict[str, int] = {}
        for r in self._reflectors:
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
            store_objects={"pods": len(view.pods), "namespaces": len(view.namespaces),
                           "metricsconfigurations": int(self.configuration is not None)},
            decode_errors=decode_errors,
            resyncs=stats.resyncs,
            ready=self.ready.is_set(),
        )

    def debug_state(self) -> dict[str, Any]:
        view = self.writer.view
        actual = sorted(self.datapath.contents())
        desired = {ip: [p.key for p in view.owners(ip)] for ip in view.desired}
        return {
            "node": self.settings.node_name,
            "ready": self.ready.is_set(),
            "pods": len(view.pods),
            "pod_uids": sorted(view.pods),  # what the store holds, for audits (the lab's I1 check)
            "namespaces": len(view.namespaces),
            "configuration": _interest_json(self.configuration),
            "filter": {
                "capacity": self.datapath.capacity,
                "desired": desired,
                "actual": actual,
                "overflow": sorted(self.writer.pending),
                "leaked": sorted(set(actual) - set(desired)),
                "missing": sorted(set(desired) - set(actual) - set(self.writer.pending)),
            },
            "last_resync": self.last_resync,
            "drift_repaired": dict(self.writer.stats.drift_repaired),
            "write_errors": {f"{op}/{errno}": n for (op, errno), n in self.writer.stats.write_errors.items()},
            "reflectors": {r.kind.name: {"resourceVersion": r.resource_version, "relists": dict(r.stats.relists),
                                         "failures": dict(r.stats.failures), "requests": r.stats.requests,
                                         "decode_errors": r.stats.decode_errors}
                           for r in self._reflectors},
        }


def _interest_json(config: MetricsConfiguration | None) -> dict[str, Any] | None:
    if config is None:
        return None
    i = config.interest
    return {"name": config.name, "resourceVersion": config.resource_version, "include": sorted(i.include),
            "exclude": sorted(i.exclude), "annotations": i.annotations}
