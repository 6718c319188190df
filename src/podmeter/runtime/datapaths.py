"""Choosing and opening the agent's datapath: ``memory`` (no root, lab and tests) or ``ebpf`` (the kernel).

:func:`open_datapath` opens what :class:`~podmeter.runtime.settings.DatapathSettings` asks for: the filter
and counters, the flows, the pod links' attach manager and the drop tracing (``runtime.drop_drain``; only
the eBPF datapath has it). The agent process (``runtime.agent_process``) builds the agent on what it opened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Datapath, LinkCounts
from podmeter.model.dns import DnsSource
from podmeter.model.flows import FlowSource
from podmeter.runtime.drop_drain import DropTracing, open_drops
from podmeter.runtime.settings import DatapathSettings

log = logging.getLogger("podmeter.datapath")

LINK_PINS = "links"  # the directory of pinned TCX links inside the pin directory


class PodLinks(Protocol):
    """The links the datapath counts on (the eBPF attach manager): which they are, which pod IPs reach none."""

    def set_pod_ips(self, ips: Iterable[str]) -> None:
        """The IPs of every pod of this node, whole, each time they change: the links that carry them are
        the pods' links, the only ones counted on (cheap and thread-safe: the work is the manager's)."""
        ...

    def inherited(self, ips: Iterable[str]) -> frozenset[str]:
        """The IPs among ``ips`` whose link a predecessor left attached (the same pod's): what the kernel
        counted for them before this agent is their pods' (cheap: the manager's answer)."""
        ...

    def settled(self) -> bool:
        """Whether the links of the pod IPs last given are attached (the agent's first write waits for it)."""
        ...

    def link_counts(self) -> LinkCounts:
        """The links seen, attached and skipped (cheap: called at every scrape)."""
        ...

    def unlinked(self, ips: Iterable[str]) -> frozenset[str]:
        """The IPs among ``ips`` that reach no counted link (cheap: called at every scrape)."""
        ...

    async def watch(self) -> None:
        """Return never while links are followed; raise once that has failed (the agent supervises it)."""
        ...


@dataclass
class OpenDatapath:
    """A datapath with whatever it needs closed at shutdown (attach manager, drop tracing, descriptors)."""

    datapath: Datapath
    flows: FlowSource | None = None  # the same object when the datapath aggregates flows
    closers: list[Callable[[], None]] = field(default_factory=list)
    links: PodLinks | None = None  # None: the datapath has no links (memory)
    drops: DropTracing = field(default_factory=DropTracing)  # off unless the datapath traces drops
    dns: DnsSource | None = None  # the eBPF datapath's DNS maps (None: no DNS, e.g. the memory datapath)

    def close(self) -> None:
        self.drops.close()
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # shutdown must go on: log and continue
                log.exception("error while closing the datapath")


def open_datapath(settings: DatapathSettings) -> OpenDatapath:
    """Open the datapath; raises with an actionable message (the agent refuses to start half-blind). The
    drop tracing never raises: a kernel without it gets a notice and an agent without drop metrics."""
    if settings.kind == "memory":
        memory = MemoryDatapath(settings.filter_map_size, flow_capacity=settings.flow_map_size)
        logging.getLogger("podmeter.dns").info("DNS per pod is read by the eBPF datapath only: off with this one")
        return OpenDatapath(memory, memory, drops=_no_drops(settings))
    if settings.kind != "ebpf":
        raise ValueError(f"--datapath must be ebpf or memory, not {settings.kind!r}")
    from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath, InterfaceRule, LinkSelection

    bpffs = settings.bpffs
    datapath = EbpfDatapath.open(bpffs, filter_size=settings.filter_map_size, flow_size=settings.flow_map_size)
    assert datapath.programs is not None, "EbpfDatapath.open loads the programs"
    # No patterns: pod links found by what they are.
    rule = InterfaceRule(settings.interface_patterns, settings.interfaces)
    # Only the links that carry this node's pods (the agent gives their IPs): other programs' veths are
    # not the agent's to count on. Patterns and names given are attached whatever they carry.
    # TCX links pinned beside the maps: they outlive this process, so a restart counts every packet.
    manager = AttachManager(datapath.programs, rule=rule, selection=LinkSelection.PODS,
                            link_pins=Path(bpffs) / LINK_PINS)
    try:
        manager.start()
    except BaseException:
        datapath.close()
        raise
    log.info("eBPF datapath open: pins in %s, filter size %d, flow map size %d", bpffs, datapath.capacity,
             settings.flow_map_size)
    drops = open_drops(datapath, settings.drop_map_size)  # never fatal: a notice and drops off
    return OpenDatapath(datapath, datapath, [datapath.close, manager.stop], links=manager, drops=drops,
                        dns=datapath.dns)


def _no_drops(settings: DatapathSettings) -> DropTracing:
    """Drops are traced next to the eBPF datapath's filter map only."""
    if settings.drop_map_size == 0:
        notice = "drops and TCP health are off (--drop-map-size 0)"
    else:
        notice = "drops and TCP health are counted by the eBPF datapath only: off with this datapath"
    logging.getLogger("podmeter.drops").info("%s", notice)
    return DropTracing(None, [notice])
