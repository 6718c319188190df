"""Choosing and opening the agent's datapath: ``memory`` (no root, lab and tests) or ``ebpf`` (the kernel)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Datapath, LinkCounts
from podmeter.model.flows import FlowSource

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
    """A datapath with whatever it needs closed at shutdown (attach manager, descriptors)."""

    datapath: Datapath
    flows: FlowSource | None = None  # the same object when the datapath aggregates flows
    closers: list[Callable[[], None]] = field(default_factory=list)
    links: PodLinks | None = None  # None: the datapath has no links (memory)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # shutdown must go on: log and continue
                log.exception("error while closing the datapath")


def open_datapath(kind: str, bpffs: str, filter_map_size: int, interfaces: tuple[str, ...] = (),
                  patterns: tuple[str, ...] | None = None, *, flow_map_size: int = 65536) -> OpenDatapath:
    """Open the datapath; raises with an actionable message (the agent refuses to start half-blind)."""
    if kind == "memory":
        memory = MemoryDatapath(filter_map_size, flow_capacity=flow_map_size)
        return OpenDatapath(memory, memory)
    if kind != "ebpf":
        raise ValueError(f"--datapath must be ebpf or memory, not {kind!r}")
    from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath, InterfaceRule, LinkSelection

    datapath = EbpfDatapath.open(bpffs, filter_size=filter_map_size, flow_size=flow_map_size)
    assert datapath.programs is not None, "EbpfDatapath.open loads the programs"
    rule = InterfaceRule(patterns or (), interfaces)  # no patterns: pod links found by what they are
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
             flow_map_size)
    return OpenDatapath(datapath, datapath, [datapath.close, manager.stop], links=manager)
