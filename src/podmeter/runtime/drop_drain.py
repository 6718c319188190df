"""Draining the datapath's drops and TCP events: drain -> credit to pods -> dropped flows to the feed.

Runs in the agent's writer task, at the same moments as the flow drain and just before it: every
``--flow-interval`` and right after any change of who holds an address. So each event is credited to the
pod that held the IP while it was counted (``model.drops.DropLedger`` remembers the owner an IP lost
since the last drain), dropped flows reach ``podmeter observe`` as records with verdict ``dropped``, and
the retransmits drained here are put on the flow records of the drain that follows
(:meth:`DropDrainer.annotate`, which the flow drainer calls). Drops of the ledger's lifecycle reasons
(``model.drops.LIFECYCLE_REASONS`` unless the agent runs with ``--drops-include-lifecycle``) are counted
apart by the ledger and make no records.

:func:`open_drops` opens the kernel side next to the agent's eBPF datapath. It never fails the agent: a
kernel without the tracepoints or BTF gets a notice in the log, ``podmeter_drop_tracing_enabled`` 0 for
what is missing, and an agent that runs without drop metrics.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.datapath import Datapath
from podmeter.model.drops import HOOKS, DropLedger, DropSource, DropStats, Retransmits, name_drops
from podmeter.model.endpoints import AddressBook, ChainedNames, Names
from podmeter.model.flow_records import FlowRecord
from podmeter.model.records import Pod

log = logging.getLogger("podmeter.drops")

DEFAULT_DROP_MAP_SIZE = 16384


@dataclass
class DropTracing:
    """The agent's drop tracing: the source (None: off), what is attached, and closers for shutdown."""

    source: DropSource | None = None
    notices: list[str] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def hooks(self) -> Mapping[str, bool]:
        return dict(self.source.hooks) if self.source is not None else dict.fromkeys(HOOKS, False)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # shutdown goes on
                log.exception("error while closing the drop tracing")
        self.closers = []


def open_drops(datapath: Datapath, size: int = DEFAULT_DROP_MAP_SIZE, *, btf_path: str | None = None,
               tracepoints: Mapping[str, str] | None = None) -> DropTracing:
    """Trace drops and TCP health next to ``datapath`` (its ``filter`` map), or say clearly why not.

    ``size`` 0 turns it off. Never raises for a missing kernel feature: the reason is logged as a warning
    and returned in ``notices``."""
    if size == 0:
        return _off("drops and TCP health are off (--drop-map-size 0)", logging.INFO)
    # Only an eBPF datapath has the filter map to trace next to; the eBPF adapter (ctypes, pyroute2) is
    # not imported for another datapath, which would cost an agent on the memory datapath ~10 MiB.
    ebpf = sys.modules.get("podmeter.adapters.datapath.ebpf")
    if ebpf is None or not isinstance(datapath, ebpf.EbpfDatapath):
        return _off("drops and TCP health are counted by the eBPF datapath only: off with this datapath",
                    logging.INFO)
    from podmeter.adapters.datapath.ebpf import btf
    from podmeter.adapters.datapath.ebpf.drops import DropsUnavailable, DropTracer

    try:
        tracer = DropTracer.open(datapath.filter_map, size, btf_path=btf_path or btf.VMLINUX, tracepoints=tracepoints)
    except (DropsUnavailable, ValueError) as error:
        return _off(f"drops and TCP health are off, the agent runs without them: {error}", logging.WARNING)
    for notice in tracer.notices:
        log.warning("%s", notice)
    attached = [hook for hook, on in tracer.hooks.items() if on]
    log.info("drop tracing: %s attached; %d drop reasons named from the kernel's BTF", ", ".join(attached),
             len(tracer.reasons))
    return DropTracing(tracer, list(tracer.notices), [tracer.close])


def _off(notice: str, level: int) -> DropTracing:
    log.log(level, "%s", notice)
    return DropTracing(None, [notice])


class DropDrainer:
    """Drains ``source`` into ``ledger`` (per-pod series) and ``feed`` (records with verdict dropped, but
    none of a reason the ledger counts apart: :attr:`DropLedger.lifecycle`).

    ``annotate_flows``: keep the drained retransmits for :meth:`annotate` (only when a flow drain follows;
    otherwise they would wait for nothing).
    """

    def __init__(self, source: DropSource, ledger: DropLedger, node: str, feed: FlowFeed,
                 others: Sequence[Names] = (), *, annotate_flows: bool = True) -> None:
        self.source, self.ledger, self.node, self.feed = source, ledger, node, feed
        self.others = list(others)
        self.stats = DropStats()
        self.retransmits = Retransmits() if annotate_flows else None
        # Series fed the dropped flow records too (Retina's remote drop series: model.retina_flows), or None.
        self.series: Callable[[list[FlowRecord], float], None] | None = None
        self._failed = False  # the last drain failed: what the next one takes may span a change of hands

    def drain(self, pods: Iterable[Pod]) -> None:
        """One drain, named with ``pods`` (the store as it is now)."""
        try:
            drained = self.source.drain_drops()
        except Exception as exc:  # a kernel error: count it, keep running, try next interval
            self.stats.errors += 1
            self._failed = True
            log.warning("drop drain failed (will retry next interval): %s: %s", type(exc).__name__, exc)
            return
        self.stats.drains += 1
        if self.retransmits is not None:
            self.retransmits.add(drained.retransmits)  # every drain: what waits too long is forgotten
        credit, self._failed = not self._failed, False
        if not drained:
            return
        self.ledger.add(drained, credit=credit)
        lifecycle = self.ledger.lifecycle
        flows = [entry for entry in drained.flows if entry[0].reason not in lifecycle] if lifecycle else drained.flows
        if flows:
            published = self.others[0] if self.others else None
            names = ChainedNames(AddressBook(pods, published), *self.others)
            wall_offset = time.time() - time.monotonic()
            records = name_drops(flows, names, self.node, wall_offset)
            self.feed.publish(records)
            if self.series is not None:
                self.series(records, time.monotonic())

    def annotate(self, records: list[FlowRecord]) -> list[FlowRecord]:
        """The flow drain's records with the retransmits of their connections (see ``model.drops``)."""
        return records if self.retransmits is None else self.retransmits.annotate(records)
