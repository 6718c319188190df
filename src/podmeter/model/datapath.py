"""The seam between the core and a packet datapath (the kernel's eBPF maps, or memory).

IPs cross this seam as canonical strings: IPv4 dotted quad (``10.0.0.7``) or compressed IPv6
(``fd00::7``), exactly as :func:`podmeter.model.records.canonical_ip` produces them. Converting to kernel
key layouts is the adapter's business.

Batch operations have the kernel's semantics: they apply elements in order, stop at the first error and
report how many they applied. Callers must honour that count (a partial batch that is ignored leaves
kernel and userspace out of sync: failure mode F6 in docs/design.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Direction(enum.StrEnum):
    """Traffic direction as seen from the pod. A ``str`` enum: hashing it is a C call, which matters on
    the scrape path (tens of thousands of dictionary lookups per scrape)."""

    INGRESS = "ingress"  # into the pod
    EGRESS = "egress"  # out of the pod


@dataclass(frozen=True, slots=True)
class Traffic:
    """A counter value: packets and bytes (summed over CPUs)."""

    packets: int = 0
    bytes: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.packets + other.packets, self.bytes + other.bytes)


class DatapathError(Exception):
    """A datapath operation failed for one element; ``errno`` says why (``ENOSPC``, ``EIO`` ...)."""

    def __init__(self, errno_name: str, message: str) -> None:
        super().__init__(message)
        self.errno_name = errno_name


class FilterFull(DatapathError):
    """The filter map has no room for another entry (the kernel's E2BIG on a full hash, ENOSPC on an LPM trie)."""

    def __init__(self, message: str = "filter map is full") -> None:
        super().__init__("ENOSPC", message)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Outcome of a batch: the first ``applied`` elements took effect; ``error`` stopped the rest."""

    applied: int
    error: DatapathError | None = None


@dataclass(frozen=True, slots=True)
class LinkCounts:
    """What a datapath that attaches to the node's links found: ``seen``, the links that could be a pod's (a
    veth or netkit whose peer is in another network namespace); ``attached``, the links its programs are
    attached to; ``skipped``, the links seen that they are not attached to, by reason."""

    seen: int = 0
    attached: int = 0
    skipped: Mapping[str, int] = field(default_factory=dict)


class Datapath(Protocol):
    """What the writer needs from a datapath. Implementations: memory (tests, lab) and eBPF (kernel)."""

    @property
    def capacity(self) -> int:
        """Maximum number of filter entries."""
        ...

    def insert(self, ips: Sequence[str]) -> BatchResult:
        """Insert IPs into the filter in order; stop at the first failure."""
        ...

    def delete(self, ips: Sequence[str]) -> BatchResult:
        """Delete IPs from the filter in order; deleting an absent IP is an error (``ENOENT``)."""
        ...

    def contents(self) -> set[str]:
        """What the filter really holds now (read back from the datapath, not remembered)."""
        ...

    def read_counters(self) -> dict[tuple[str, Direction], Traffic]:
        """Current per-IP counters, summed over CPUs (every one: a scrape)."""
        ...

    def read_counters_of(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        """Current counters of these IPs only, summed over CPUs, left in place (a lookup per key: an IP
        that changed hands gets the kernel's count as its new owner's base without reading every entry)."""
        ...

    def take_counters(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        """Read the counters of these IPs one last time and remove them from the datapath."""
        ...
