"""Kernel drop reasons as Cilium's drop codes, where the meaning is the same.

podmeter's drops carry the kernel's reason (``enum skb_drop_reason``, without its ``SKB_DROP_REASON_``
prefix); Hubble's consumers read Cilium's drop codes (``flow.DropReason``: the compact printer names the
code of a drop event's sub-type, ``hubble_drop_total{reason}`` its enum name). :data:`CILIUM_CODES` maps a
kernel reason to the code whose meaning is the kernel's: the one the kernel names when it drops a packet
for that cause, not a near one. A reason not listed has no Cilium code (most describe the kernel's own
stack: a full socket buffer, a neighbour that does not answer, a socket's queues freed as it closes).
docs/hubble.md lists the table with the why of each entry.

Next stage: ``adapters.hubble.flows`` (a flow's drop code) and ``model.hubble_metrics`` (the reason label).
"""

from __future__ import annotations

from typing import NamedTuple


class CiliumCode(NamedTuple):
    code: int
    name: str  # the enum value's name in flow.proto


POLICY_DENIED = CiliumCode(133, "POLICY_DENIED")
INVALID_PACKET = CiliumCode(134, "INVALID_PACKET_DROPPED")
INVALID_SOURCE_IP = CiliumCode(132, "INVALID_SOURCE_IP")
INVALID_SOURCE_MAC = CiliumCode(130, "INVALID_SOURCE_MAC")
UNSUPPORTED_L3_PROTOCOL = CiliumCode(139, "UNSUPPORTED_L3_PROTOCOL")
UNKNOWN_L4_PROTOCOL = CiliumCode(142, "UNKNOWN_L4_PROTOCOL")
INVALID_IPV6_EXTENSION_HEADER = CiliumCode(156, "INVALID_IPV6_EXTENSION_HEADER")
EDT_HORIZON = CiliumCode(162, "REACHED_EDT_RATE_LIMITING_DROP_HORIZON")
FIB_LOOKUP_FAILED = CiliumCode(169, "FIB_LOOKUP_FAILED")
SOCKET_LOOKUP_FAILED = CiliumCode(178, "SOCKET_LOOKUP_FAILED")

CILIUM_CODES: dict[str, CiliumCode] = {
    # a netfilter rule decided to drop it: on a node, a NetworkPolicy's rule or kube-proxy's
    "NETFILTER_DROP": POLICY_DENIED,
    # malformed: too short, a truncated or bad header, a bad checksum
    "PKT_TOO_SMALL": INVALID_PACKET, "HDR_TRUNC": INVALID_PACKET, "IP_INHDR": INVALID_PACKET,
    "IP_CSUM": INVALID_PACKET, "TCP_CSUM": INVALID_PACKET, "UDP_CSUM": INVALID_PACKET,
    "ICMP_CSUM": INVALID_PACKET,
    # a source address that cannot be this packet's: reverse-path filter, martian, a local address
    "IP_RPFILTER": INVALID_SOURCE_IP, "IP_INVALID_SOURCE": INVALID_SOURCE_IP, "IP_LOCAL_SOURCE": INVALID_SOURCE_IP,
    "MAC_INVALID_SOURCE": INVALID_SOURCE_MAC,
    # no handler for the packet's L3 protocol (ethertype), or IPv6 off on the device
    "UNHANDLED_PROTO": UNSUPPORTED_L3_PROTOCOL, "IPV6DISABLED": UNSUPPORTED_L3_PROTOCOL,
    # no handler for the IP protocol
    "IP_NOPROTO": UNKNOWN_L4_PROTOCOL,
    "IPV6_BAD_EXTHDR": INVALID_IPV6_EXTENSION_HEADER,
    # fq's horizon: the packet's departure time (EDT) is too far ahead
    "FQ_HORIZON_LIMIT": EDT_HORIZON,
    # no route for the destination
    "IP_OUTNOROUTES": FIB_LOOKUP_FAILED, "IP_INNOROUTES": FIB_LOOKUP_FAILED,
    # no socket for the packet (a closed port)
    "NO_SOCKET": SOCKET_LOOKUP_FAILED,
}


def cilium_code(kernel_reason: str | None) -> CiliumCode | None:
    """The Cilium code of a kernel drop reason, None when none has its meaning."""
    return CILIUM_CODES.get(kernel_reason) if kernel_reason is not None else None
