"""Choosing and opening the agent's datapath: ``memory`` (no root, lab and tests) or ``ebpf`` (the kernel)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Datapath
from podmeter.model.flows import FlowSource

log = logging.getLogger("podmeter.datapath")


class PodLinks(Protocol):
    """Which pod IPs reach a link the datapath counts on (the eBPF attach manager)."""

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
    from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath, InterfaceRule

    datapath = EbpfDatapath.open(bpffs, filter_size=filter_map_size, flow_size=flow_map_size)
    assert datapath.programs is not None, "EbpfDatapath.open loads the programs"
    rule = InterfaceRule(patterns or (), interfaces)  # no patterns: pod links found by what they are
    manager = AttachManager(datapath.programs, rule=rule)
    try:
        manager.start()
    except BaseException:
        datapath.close()
        raise
    log.info("eBPF datapath open: pins in %s, filter size %d, flow map size %d", bpffs, datapath.capacity,
             flow_map_size)
    return OpenDatapath(datapath, datapath, [datapath.close, manager.stop], links=manager)
