"""Draining the datapath's flows: drain -> name both ends -> publish to readers -> add up per workload pair.

Runs in the agent's writer task, so the view it names flows with is exactly the view the writer works
from. The agent drains every ``--flow-interval`` seconds and once more whenever a change hands an address
over (``NodeView.apply`` reports it; a pod's or a far end's in the PodSlices): right after the filter
write, named with the view as it was before the change (``NodeView.take_handover``). So a flow is always
named by the pod that held the IP while its packets were counted (invariant I8: a pod deleted or an IP
reused between two periodic drains never hands its flows to the next holder).

Next stage: the feed (``adapters.flow_serving``) for ``podmeter observe``, and the workload series
(``model.flow_series``) for ``/metrics``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from podmeter.adapters.conntrack import Translation
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.endpoints import AddressBook, ChainedNames, Names
from podmeter.model.flow_records import EndpointCache, FlowRecord, name_flows, newest
from podmeter.model.flow_series import DrainTotals, WorkloadFlows
from podmeter.model.flows import FlowEntry, FlowSource
from podmeter.model.records import Pod
from podmeter.model.service_series import ServiceTraffic
from podmeter.runtime.service_names import ServiceNames

log = logging.getLogger("podmeter.flows")


@dataclass
class DrainStats:
    """Counters exported as metrics; they only grow (but ``last_*``, the latest drain)."""

    drains: int = 0
    entries: int = 0
    errors: int = 0
    last_entries: int = 0
    last_seconds: float = 0.0
    unnamed: int = 0  # entries named world because their holders could not be known


class FlowDrainer:
    """Drains ``source`` and hands named records to ``feed`` and ``series``.

    ``others`` are the names of pods beyond this node (the seam for cluster-wide endpoints); the node's
    own pods come from the store at each drain.
    """

    def __init__(self, source: FlowSource, node: str, feed: FlowFeed, series: WorkloadFlows,
                 others: Sequence[Names] = (), *,
                 annotate: Callable[[list[FlowRecord]], list[FlowRecord]] | None = None,
                 services: ServiceNames | None = None, service_traffic: ServiceTraffic | None = None) -> None:
        self.source, self.node, self.feed, self.series = source, node, feed, series
        self.services = services  # the cluster's Services (runtime.service_names): the names of frontends
        self.service_traffic = service_traffic  # their series (model.service_series)
        self.others = list(others)
        self.annotate = annotate  # e.g. the drop drainer's retransmits (runtime.drop_drain)
        self.stats = DrainStats()
        # True when addresses changed hands without a drain before (it failed): who held an IP while the
        # entries now in the kernel were counted is unknown, so the next drain names every end world.
        self.owed = False

    def drain(self, pods: Iterable[Pod], *, named: bool = True, others: Sequence[Names] | None = None) -> bool:
        """One drain, named with ``pods`` (the store as it is now) and ``others`` (default: those given at
        construction; at a change of hands, the names as they were before it), or every end ``world``
        (``named`` False: entries whose holders podmeter cannot know, e.g. a predecessor's); False if it
        failed. All of it here, the node's conntrack read in the calling thread: :meth:`take` then
        :meth:`finish_async` is the same with that read in a worker thread (the agent's writer task)."""
        taken = self.take(pods, named=named, others=others)
        if taken is None:
            return False
        self.finish_here(taken)
        return True

    def finish_here(self, taken: TakenDrain) -> None:
        """:meth:`finish`, the node's conntrack read in the calling thread."""
        self.finish(taken, self.services.read() if taken.wants_translations and self.services else None)

    def take(self, pods: Iterable[Pod], *, named: bool = True, others: Sequence[Names] | None = None,
             ) -> TakenDrain | None:
        """The drain's first half, at its place in the writer's order: the kernel's entries taken, and the
        names of the moment (None if the kernel failed). :meth:`finish` names and publishes them.

        The cyclic collector is held from here to the end of :meth:`finish`: the drain's entries (three
        tuples each, 300,000 objects for 100,000 flows, none in a cycle) are all freed by their counts
        when it ends, so a collection that ran meanwhile would only walk them, and promote them to where
        the next full collection walks them again. What stays (the ring's records) is not tracked by the
        collector."""
        collecting = gc.isenabled()
        gc.disable()
        taken = None
        try:
            taken = self._take(pods, named, self.others if others is None else others)
        finally:
            if collecting and taken is None:
                gc.enable()
        if taken is not None:
            taken.collecting = collecting
        return taken

    def _take(self, pods: Iterable[Pod], named: bool, others: Sequence[Names]) -> TakenDrain | None:
        started = time.perf_counter()
        try:
            entries = self.source.drain_flows()
        except Exception as exc:  # a kernel error: count it, keep the agent running, try next interval
            self.stats.errors += 1
            log.warning("flow drain failed (will retry next interval): %s: %s", type(exc).__name__, exc)
            return None
        if self.owed:
            named, self.owed = False, False
        if named:
            published = others[0] if others else None
            names: Names = ChainedNames(AddressBook(pods, published), *others)
        else:
            names = ChainedNames(AddressBook(()))
            self.stats.unnamed += len(entries)
        wall_offset = time.time() - time.monotonic()  # the kernel stamps CLOCK_MONOTONIC nanoseconds
        wants = bool(entries) and named and self.services is not None and self.services.wants_translations()
        return TakenDrain(entries, EndpointCache(names), wall_offset, named, started, wants)

    async def finish_async(self, taken: TakenDrain) -> None:
        """:meth:`finish`, the node's conntrack read in the Services' worker thread meanwhile (a dump of
        10,000 translations takes about 190 ms: ``bench.conntrack``), so the event loop goes on serving.
        Cancelled while it waits: finished without translations (the entries are not lost)."""
        translations = None
        try:
            if taken.wants_translations and self.services is not None:
                translations = await self.services.read_async()
        finally:
            self.finish(taken, translations)

    def finish(self, taken: TakenDrain, translations: list[Translation] | None) -> None:
        """The drain's second half: name the taken entries (through Services with the node's
        ``translations``, read after the entries were taken: every connection drained is in them while
        conntrack keeps it) and hand the records to the feed and the series."""
        try:
            self._finish(taken, translations)
        finally:
            if taken.collecting:
                gc.enable()

    def _finish(self, taken: TakenDrain, translations: list[Translation] | None) -> None:
        entries, ends = taken.entries, taken.ends
        if entries:
            naming = self.services.naming(translations) if self.services is not None and taken.named else None
            services = naming.resolve(entries) if naming is not None else None  # once, for all three below
            kept = newest(entries, self.feed.ring.capacity)
            records = name_flows(kept, ends, self.node, taken.wall_offset, services)
            if self.annotate is not None:
                records = self.annotate(records)
            self.feed.publish(records, passed=len(entries) - len(kept))
            now = time.monotonic()
            self.series.add_totals(DrainTotals(services.counted if services is not None else entries), ends, now)
            if services is not None and self.service_traffic is not None:
                self.service_traffic.add(services, ends, now)
        self.stats.drains += 1  # counted once its records are published: readers wait on it (the lab)
        self.stats.entries += len(entries)
        self.stats.last_entries = len(entries)
        self.stats.last_seconds = time.perf_counter() - taken.started


@dataclass
class TakenDrain:
    """A drain between its halves (``FlowDrainer.take`` and ``finish``): the kernel's entries, the names
    of the moment they were taken, and whether naming them wants the node's translations."""

    entries: list[FlowEntry]
    ends: EndpointCache  # each address named once, for the records and the series
    wall_offset: float
    named: bool
    started: float
    wants_translations: bool
    collecting: bool = False  # the cyclic collector was on before take(): finish() turns it on again
