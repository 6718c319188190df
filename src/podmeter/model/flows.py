"""Flows as the datapath aggregates them: who talked to whom, counted in the kernel, drained by the agent.

The datapath keeps one entry per :class:`FlowKey` (source and destination address and port, IP protocol,
observation point) for packets where at least one end is an observed IP, and adds up packets, bytes, the
first and last time seen and the TCP flags seen (:class:`FlowCounts`). The agent drains the entries every
interval (reading and removing them), so what it handles grows with the number of flows, never with the
number of packets.

Next stage: ``model.flow_records`` names both ends of each drained entry.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

# IP protocol numbers podmeter names (others are reported by number).
TCP, UDP, ICMP, ICMPV6 = 6, 17, 1, 58
PROTOCOL_NAMES = {TCP: "TCP", UDP: "UDP", ICMP: "ICMPv4", ICMPV6: "ICMPv6"}

# TCP header flag bits, in the order of the flags byte (FIN is bit 0).
TCP_FLAG_NAMES = ("FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR")


class Observation(enum.StrEnum):
    """Where on the pod's link a packet was seen: leaving the pod, or entering it."""

    FROM_POD = "from-pod"
    TO_POD = "to-pod"


class FlowKey(NamedTuple):
    """One flow as the kernel keys it. Addresses are canonical IP strings (as ``model.records`` makes
    them). For ICMP, ``source_port`` carries the type and ``destination_port`` the code; protocols
    without ports have 0 in both."""

    source: str
    destination: str
    source_port: int
    destination_port: int
    protocol: int
    observation: Observation


class FlowCounts(NamedTuple):
    """What the kernel added up for one key since the last drain. Times are the kernel's monotonic clock
    in nanoseconds (``CLOCK_MONOTONIC``, coarse); ``tcp_flags`` is the OR of every packet's flags byte."""

    packets: int
    bytes: int
    first_ns: int
    last_ns: int
    tcp_flags: int


FlowEntry = tuple[FlowKey, FlowCounts]


def tcp_flag_names(flags: int) -> list[str]:
    return [name for bit, name in enumerate(TCP_FLAG_NAMES) if flags & (1 << bit)]


def protocol_name(protocol: int) -> str:
    return PROTOCOL_NAMES.get(protocol, str(protocol))


class FlowSource(Protocol):
    """What the agent needs from a datapath that aggregates flows (eBPF: the ``flows`` map; memory)."""

    @property
    def flow_capacity(self) -> int:
        """Maximum number of flow entries between two drains."""
        ...

    def drain_flows(self) -> list[FlowEntry]:
        """Read and remove every flow entry (each entry is read and removed at once: a packet counted
        meanwhile is in this drain or the next, never lost and never counted twice)."""
        ...

    def flows_lost(self) -> int:
        """Packets that could not be aggregated because the flow map was full, since the map was
        created (a counter that only grows)."""
        ...
