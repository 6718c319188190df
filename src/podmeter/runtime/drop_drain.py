"""Draining the datapath's drops and TCP events: drain -> credit to pods -> dropped flows to the feed.

Runs in the agent's writer task, at the same moments as the flow drain and just before it: every
``--flow-interval`` and right after any change of who holds an address. So each event is credited to the
pod that held the IP while it was counted (``model.drops.DropLedger`` remembers the owner an IP lost
since the last drain), dropped flows reach ``podmeter observe`` as records with verdict ``dropped``, and
the retransmits drained here are put on the flow records of the drain that follows
(:meth:`DropDrainer.annotate`, which the flow drainer calls). Drops of the ledger's lifecycle reasons
(``model.drops.LIFECYCLE_REASONS`` unless the agent runs with ``--drops-include-lifecycle``) are counted
apart by the ledger and make no records.

Across a restart (a source whose maps are pinned, :class:`Inheriting`): what a predecessor left in the
maps, and what its pinned links counted while no agent ran, is taken by the first drain after the first
push, once the ledger knows the owners, and credited to an IP's owner only if the predecessor recorded
that same pod as the owner (then the pod held the IP all along); the rest goes to the node totals. After
every drain the owners are recorded for a successor. Each entry is taken once (read and deleted), so
nothing is counted twice.

:func:`open_drops` opens the kernel side next to the agent's eBPF datapath, pinned in ``<--bpffs>/drops``.
It never fails the agent: a kernel without the tracepoints or BTF gets a notice in the log,
``podmeter_drop_tracing_enabled`` 0 for what is missing, and an agent that runs without drop metrics (and
without what a predecessor pinned for them: removed, so that nothing counts into maps nobody drains).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.drops import HOOKS, DropDrain, DropLedger, DropSource, DropStats, Retransmits, name_drops
from podmeter.model.endpoints import AddressBook, ChainedNames, Names
from podmeter.model.flow_records import FlowRecord
from podmeter.model.records import Pod

if TYPE_CHECKING:  # the eBPF adapter (ctypes) is imported by the eBPF datapath's opener only
    from podmeter.adapters.datapath.ebpf import EbpfDatapath

log = logging.getLogger("podmeter.drops")

DEFAULT_DROP_MAP_SIZE = 16384
DROP_PINS = "drops"  # inside the datapath's pin directory (ebpf.drops.PIN_DIR)


@runtime_checkable
class Inheriting(Protocol):
    """A drop source whose maps outlive the agent (``ebpf.drops.DropTracer`` with pins)."""

    @property
    def inherited(self) -> bool:
        """Whether the maps held a predecessor's entries when this agent opened them."""
        ...

    def held_throughout(self, owners: Mapping[str, str]) -> frozenset[str]:
        """The IPs of ``owners`` (IP -> pod UID) that the predecessor recorded with that same owner."""
        ...

    def record_owners(self, owners: Mapping[str, str]) -> None:
        """Record the owners as of the drain just made (IP -> pod UID), for a successor."""
        ...


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


def open_drops(datapath: EbpfDatapath, size: int = DEFAULT_DROP_MAP_SIZE, *, btf_path: str | None = None,
               tracepoints: Mapping[str, str] | None = None) -> DropTracing:
    """Trace drops and TCP health next to ``datapath`` (its ``filter`` map), or say clearly why not.

    ``size`` 0 turns it off. Never raises for a missing kernel feature: the reason is logged as a warning
    and returned in ``notices``. The maps and links are pinned in ``<pin directory>/drops`` (the datapath's
    lock guards it) and adopted from a predecessor there; off, whatever a predecessor pinned there is
    removed (its programs detached), so that nothing counts into maps nobody drains."""
    pins = datapath.pins.path / DROP_PINS if datapath.pins is not None else None
    if size == 0:
        return _off("drops and TCP health are off (--drop-map-size 0)", logging.INFO, pins)
    from podmeter.adapters.datapath.ebpf import btf
    from podmeter.adapters.datapath.ebpf.drops import DropsUnavailable, DropTracer

    try:
        tracer = DropTracer.open(datapath.filter_map, size, pins=pins, btf_path=btf_path or btf.VMLINUX,
                                 tracepoints=tracepoints)
    except (DropsUnavailable, ValueError) as error:
        return _off(f"drops and TCP health are off, the agent runs without them: {error}", logging.WARNING, pins)
    for notice in tracer.notices:
        log.warning("%s", notice)
    attached = [hook for hook, on in tracer.hooks.items() if on]
    adopted = sorted(tracer.adopted)
    log.info("drop tracing: %s attached%s; %d drop reasons named from the kernel's BTF", ", ".join(attached),
             f" ({', '.join(adopted)}: pinned links adopted)" if adopted else "", len(tracer.reasons))
    if tracer.inherited:
        log.info("drop maps reused from %s: what they hold is drained once the first pod list names the owners",
                 pins)
    return DropTracing(tracer, list(tracer.notices), [tracer.close])


def _off(notice: str, level: int, pins: Path | None = None) -> DropTracing:
    log.log(level, "%s", notice)
    if pins is not None:
        from podmeter.adapters.datapath.ebpf.drops import remove_pins

        try:
            if remove_pins(pins):
                log.info("removed the drop tracing pinned in %s (its programs detached)", pins)
        except OSError as error:
            log.warning("cannot remove the drop tracing pinned in %s: %s", pins, error)
    return DropTracing(None, [notice])


class DropDrainer:
    """Drains ``source`` into ``ledger`` (per-pod series) and ``feed`` (records with verdict dropped, but
    none of a reason the ledger counts apart: :attr:`DropLedger.lifecycle`).

    ``annotate_flows``: keep the drained retransmits for :meth:`annotate` (only when a flow drain follows;
    otherwise they would wait for nothing).
    """

    def __init__(self, source: DropSource, ledger: DropLedger, node: str, feed: FlowFeed,
                 others: Sequence[Names] = (), *, annotate_flows: bool = True,
                 series: Callable[[list[FlowRecord], float], None] | None = None) -> None:
        self.source, self.ledger, self.node, self.feed = source, ledger, node, feed
        self.others = list(others)
        self.stats = DropStats()
        self.retransmits = Retransmits() if annotate_flows else None
        # Series fed the dropped flow records too (Retina's remote drop series: model.retina_flows), or None.
        self.series = series
        self._failed = False  # the last drain failed: what the next one takes may span a change of hands
        # A predecessor's entries wait in the maps for the first drain after the owners are known.
        self._inheriting = source if isinstance(source, Inheriting) else None
        self._inherited = self._inheriting is not None and self._inheriting.inherited
        self._deferred = False

    def drain(self, pods: Iterable[Pod], *, others: Sequence[Names] | None = None) -> None:
        """One drain, named with ``pods`` (the store as it is now) and ``others`` (default: those given at
        construction; at a change of hands, the names as they were before it)."""
        if self._inherited and not self._deferred and not self.ledger.owners:
            # The first push drains before its resync gives the IPs their owners: a predecessor's entries
            # stay in the maps (nothing is lost if this agent dies too) for the next drain, which knows them.
            self._deferred = True
            return
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
        inherited, self._inherited = self._inherited, False
        if drained:
            self._add(drained, credit, pods, others, inherited)
        if self._inheriting is not None:
            try:
                self._inheriting.record_owners(self.ledger.owners)
            except Exception as exc:  # a successor then credits less, never more: keep running
                log.warning("recording the owners for a successor failed: %s: %s", type(exc).__name__, exc)

    def _add(self, drained: DropDrain, credit: bool, pods: Iterable[Pod], others: Sequence[Names] | None,
             inherited: bool) -> None:
        if inherited:  # the first drain after a restart: only IPs that kept their owner are credited
            kept = self._held_throughout(drained)
            ours, theirs = _split(drained, kept)
            self.ledger.add(ours, credit=credit)  # first: it credits the owners the IPs had at the last drain
            self.ledger.add(theirs, credit=False)
            pods = [pod for pod in pods if any(ip in kept for ip in pod.ips)]
            log.info("drops a predecessor left: %d packets of %d IPs credited to the pods that held them "
                     "throughout, %d packets of %d IPs to the node only", sum(n for _, n in ours.drops),
                     len({key.ip for key, _ in ours.drops}), sum(n for _, n in theirs.drops),
                     len({key.ip for key, _ in theirs.drops}))
        else:
            self.ledger.add(drained, credit=credit)
        lifecycle = self.ledger.lifecycle
        flows = [entry for entry in drained.flows if entry[0].reason not in lifecycle] if lifecycle else drained.flows
        if flows:
            others = self.others if others is None else others
            published = others[0] if others else None
            names = ChainedNames(AddressBook(pods, published), *others)
            wall_offset = time.time() - time.monotonic()
            records = name_drops(flows, names, self.node, wall_offset)
            self.feed.publish(records)
            if self.series is not None:
                self.series(records, time.monotonic())

    def annotate(self, records: list[FlowRecord]) -> list[FlowRecord]:
        """The flow drain's records with the retransmits of their connections (see ``model.drops``)."""
        return records if self.retransmits is None else self.retransmits.annotate(records)

    def _held_throughout(self, drained: DropDrain) -> frozenset[str]:
        """The IPs of ``drained`` whose owner as of the last drain (the one the ledger credits) is the owner
        the predecessor recorded."""
        assert self._inheriting is not None
        previous, owners = self.ledger.previous, self.ledger.owners
        ips = {key.ip for key, _ in drained.drops} | {ip for (ip, _), _ in drained.tcp}
        ips.update(ip for key, _ in drained.flows for ip, observed in (
            (key.source, key.source_observed), (key.destination, key.destination_observed)) if observed)
        crediting = {ip: uid for ip in ips
                     if (uid := previous[ip][0] if ip in previous else owners.get(ip)) is not None}
        return self._inheriting.held_throughout(crediting)


def _split(drained: DropDrain, kept: frozenset[str]) -> tuple[DropDrain, DropDrain]:
    """(the per-IP counts of ``kept`` IPs, the others'): what the ledger credits (flows are named apart)."""
    ours, theirs = DropDrain(), DropDrain()
    for key, packets in drained.drops:
        (ours if key.ip in kept else theirs).drops.append((key, packets))
    for key, size in drained.drop_bytes:
        (ours if key.ip in kept else theirs).drop_bytes.append((key, size))
    for entry in drained.tcp:
        (ours if entry[0][0] in kept else theirs).tcp.append(entry)
    return ours, theirs
