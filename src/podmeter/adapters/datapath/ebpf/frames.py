"""Synthetic Ethernet frames for BPF_PROG_TEST_RUN (tests, the benchmark, self-checks).

Checksums are left zero: the counting program never looks at them.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Sequence

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
IPPROTO_ICMP = 1
IPPROTO_TCP = 6
IPPROTO_UDP = 17
IPPROTO_ICMPV6 = 58
IP_MF = 0x2000  # more fragments (in the 16-bit flags + fragment offset field)
TCP_FIN, TCP_SYN, TCP_RST, TCP_PSH, TCP_ACK = 0x01, 0x02, 0x04, 0x08, 0x10
DST_MAC = bytes.fromhex("02000000000b")
SRC_MAC = bytes.fromhex("02000000000a")


def ethernet(ethertype: int, payload: bytes, vlans: Sequence[int] = ()) -> bytes:
    """An Ethernet frame; each VLAN id adds a tag (outer first: 802.1ad, inner ones 802.1Q)."""
    tags = b""
    next_type = ethertype
    for depth, vid in reversed(list(enumerate(vlans))):
        tpid = ETH_P_8021AD if depth == 0 and len(vlans) > 1 else ETH_P_8021Q
        tags = struct.pack("!HH", vid & 0x0FFF, next_type) + tags
        next_type = tpid
    return DST_MAC + SRC_MAC + struct.pack("!H", next_type) + tags + payload


def udp(payload: bytes, sport: int = 40000, dport: int = 7) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp(payload: bytes = b"", sport: int = 40000, dport: int = 80, flags: int = TCP_ACK) -> bytes:
    """A TCP segment with a 20-byte header (no options)."""
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, flags, 65535, 0, 0) + payload


def icmp(icmp_type: int, code: int = 0, payload: bytes = b"") -> bytes:
    """An ICMP or ICMPv6 message: type, code, checksum (zero), identifier and sequence 1."""
    return struct.pack("!BBHHH", icmp_type, code, 0, 1, 1) + payload


def ipv4(
    src: str,
    dst: str,
    payload: bytes,
    *,
    version: int = 4,
    ihl: int = 5,
    protocol: int = IPPROTO_UDP,
    frag: int = 0,
) -> bytes:
    """An IPv4 packet; ``frag`` is the flags + fragment offset field (e.g. ``IP_MF | 0`` for a first
    fragment, ``185`` for one starting at byte 1480)."""
    header = struct.pack(
        "!BBHHHBBH4s4s",
        (version << 4) | ihl,
        0,
        20 + len(payload),
        0,
        frag,
        64,
        protocol,
        0,
        ipaddress.IPv4Address(src).packed,
        ipaddress.IPv4Address(dst).packed,
    )
    return header + payload


def ipv6(src: str, dst: str, payload: bytes, *, version: int = 6, next_header: int = IPPROTO_UDP) -> bytes:
    header = struct.pack(
        "!IHBB16s16s",
        version << 28,
        len(payload),
        next_header,
        64,
        ipaddress.IPv6Address(src).packed,
        ipaddress.IPv6Address(dst).packed,
    )
    return header + payload


def udp_frame(src: str, dst: str, size: int = 64, vlans: Sequence[int] = ()) -> bytes:
    """A UDP frame from ``src`` to ``dst`` (same family) carrying ``size`` bytes of payload."""
    payload = udp(b"p" * size)
    if ipaddress.ip_address(src).version == 4:
        return ethernet(ETH_P_IP, ipv4(src, dst, payload), vlans)
    return ethernet(ETH_P_IPV6, ipv6(src, dst, payload), vlans)


def ip_frame(src: str, dst: str, protocol: int, payload: bytes, vlans: Sequence[int] = ()) -> bytes:
    """An IPv4 or IPv6 frame (by the family of ``src``) carrying ``payload`` as ``protocol``."""
    if ipaddress.ip_address(src).version == 4:
        return ethernet(ETH_P_IP, ipv4(src, dst, payload, protocol=protocol), vlans)
    return ethernet(ETH_P_IPV6, ipv6(src, dst, payload, next_header=protocol), vlans)


def tcp_frame(src: str, dst: str, sport: int, dport: int, *, flags: int, size: int = 0) -> bytes:
    return ip_frame(src, dst, IPPROTO_TCP, tcp(b"t" * size, sport, dport, flags))


def icmp_frame(src: str, dst: str, icmp_type: int, code: int = 0, size: int = 56) -> bytes:
    """ICMP for IPv4 sources, ICMPv6 for IPv6 ones."""
    v4 = ipaddress.ip_address(src).version == 4
    return ip_frame(src, dst, IPPROTO_ICMP if v4 else IPPROTO_ICMPV6, icmp(icmp_type, code, b"i" * size))
