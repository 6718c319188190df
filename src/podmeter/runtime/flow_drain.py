"""Draining the datapath's flows: drain -> name both ends -> publish to readers -> add up per workload pair.

Runs in the agent's writer task, so the view it names flows with is exactly the view the writer works
from. The agent drains every ``--flow-interval`` seconds and once more whenever a change takes an address
from the pod holding it (``NodeView.renames``): right after the filter write, named with the pods as they
were before the change (a far end's change of holder in the PodSlices: before it is applied). So a flow is
always named by the pod that held the IP while its packets were counted (invariant I8: a pod deleted or
an IP reused between two periodic drains never hands its flows to the next holder).

Next stage: the feed (``adapters.flow_serving``) for ``podmeter observe``, and the workload series
(``model.flow_series``) for ``/metrics``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.endpoints import AddressBook, ChainedNames, Names
from podmeter.model.flow_records import FlowRecord, name_flows
from podmeter.model.flow_series import WorkloadFlows
from podmeter.model.flows import FlowSource
from podmeter.model.records import Pod

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
                 annotate: Callable[[list[FlowRecord]], list[FlowRecord]] | None = None) -> None:
        self.source, self.node, self.feed, self.series = source, node, feed, series
        self.others = list(others)
        self.annotate = annotate  # e.g. the drop drainer's retransmits (runtime.drop_drain)
        self.stats = DrainStats()
        # True when addresses changed hands without a drain before (it failed): who held an IP while the
        # entries now in the kernel were counted is unknown, so the next drain names every end world.
        self.owed = False

    def drain(self, pods: Iterable[Pod], *, named: bool = True) -> bool:
        """One drain, named with ``pods`` (the store as it is now), or every end ``world`` (``named``
        False: entries whose holders podmeter cannot know, e.g. a predecessor's); False if it failed."""
        started = time.perf_counter()
        try:
            entries = self.source.drain_flows()
        except Exception as exc:  # a kernel error: count it, keep the agent running, try next interval
            self.stats.errors += 1
            log.warning("flow drain failed (will retry next interval): %s: %s", type(exc).__name__, exc)
            return False
        self.stats.drains += 1
        if self.owed:
            named, self.owed = False, False
        if entries:
            if named:
                published = self.others[0] if self.others else None
                names: Names = ChainedNames(AddressBook(pods, published), *self.others)
            else:
                names = ChainedNames(AddressBook(()))
                self.stats.unnamed += len(entries)
            wall_offset = time.time() - time.monotonic()  # the kernel stamps CLOCK_MONOTONIC nanoseconds
            records = name_flows(entries, names, self.node, wall_offset)
            if self.annotate is not None:
                records = self.annotate(records)
            self.feed.publish(records)
            self.series.add(records, time.monotonic())
        self.stats.entries += len(entries)
        self.stats.last_entries = len(entries)
        self.stats.last_seconds = time.perf_counter() - started
        return True
