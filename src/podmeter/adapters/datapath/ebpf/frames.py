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
IPPROTO_UDP = 17
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


def ipv4(src: str, dst: str, payload: bytes, *, version: int = 4, ihl: int = 5) -> bytes:
    header = struct.pack(
        "!BBHHHBBH4s4s",
        (version << 4) | ihl,
        0,
        20 + len(payload),
        0,
        0,
        64,
        IPPROTO_UDP,
        0,
        ipaddress.IPv4Address(src).packed,
        ipaddress.IPv4Address(dst).packed,
    )
    return header + payload


def ipv6(src: str, dst: str, payload: bytes, *, version: int = 6) -> bytes:
    header = struct.pack(
        "!IHBB16s16s",
        version << 28,
        len(payload),
        IPPROTO_UDP,
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
