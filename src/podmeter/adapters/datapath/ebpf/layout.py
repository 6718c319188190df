"""Key and value layouts of the pinned maps, mirroring the structs in ``bpf/podmeter.bpf.c``.

Addresses are 16 bytes: IPv6 as is, IPv4 mapped as ``::ffff:a.b.c.d`` so one map holds both families.
Integers are in host byte order (the kernel's view of a ``__u32``/``__u64``); address bytes are in network
order. docs/datapath.md shows the same layouts next to ``bpftool map dump`` output.

    filter   key   struct filter_key   { __u32 prefixlen = 128; __u8 addr[16]; }      20 bytes
             value __u8                  1 (present)                                    1 byte
    counters key   struct counter_key  { __u8 addr[16]; __u32 direction; }            20 bytes
             value struct counter_value { __u64 packets; __u64 bytes; }  per CPU        16 bytes
"""

from __future__ import annotations

import ipaddress
import socket
import struct

from podmeter.model.datapath import Direction, Traffic

ADDRESS_BYTES = 16
HOST_PREFIXLEN = 128
FILTER_KEY = struct.Struct(f"=I{ADDRESS_BYTES}s")
FILTER_VALUE = b"\x01"
COUNTER_KEY = struct.Struct(f"={ADDRESS_BYTES}sI")
COUNTER_VALUE = struct.Struct("=QQ")
COUNTER_STRIDE = 16  # round_up(sizeof(struct counter_value), 8)
_V4_MAPPED = b"\x00" * 10 + b"\xff\xff"
_HOST_PREFIX = struct.pack("=I", HOST_PREFIXLEN)

# Direction codes of the C program (PM_DIR_INGRESS / PM_DIR_EGRESS).
DIRECTION_CODES = {Direction.INGRESS: 0, Direction.EGRESS: 1}
_DIRECTIONS = {code: direction for direction, code in DIRECTION_CODES.items()}


def address_bytes(ip: str) -> bytes:
    """The 16-byte form of a canonical IP string. Raises ValueError for anything else.

    inet_pton rather than ipaddress: this runs once per IP per batch and is 20x faster.
    """
    try:
        if ":" in ip:
            return socket.inet_pton(socket.AF_INET6, ip)
        return _V4_MAPPED + socket.inet_pton(socket.AF_INET, ip)
    except (OSError, TypeError):
        raise ValueError(f"not an IP address: {ip!r}") from None


def address_text(raw: bytes) -> str:
    """The canonical string of a 16-byte address (IPv4-mapped addresses print as IPv4)."""
    if raw[:12] == _V4_MAPPED:
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    if raw[:12] == bytes(12):  # inet_ntop would print ::a.b.c.d where Python (and podmeter) say ::xxxx:yyyy
        return str(ipaddress.IPv6Address(raw))
    return socket.inet_ntop(socket.AF_INET6, raw)


def filter_key(ip: str) -> bytes:
    return _HOST_PREFIX + address_bytes(ip)


def decode_filter_key(raw: bytes) -> str:
    """The IP of a filter key. Raises ValueError for a key that is not a host entry (prefixlen 128)."""
    prefixlen, addr = FILTER_KEY.unpack(raw)
    if prefixlen != HOST_PREFIXLEN:
        raise ValueError(f"filter key with prefixlen {prefixlen}: podmeter writes host entries only")
    return address_text(addr)


def counter_key(ip: str, direction: Direction) -> bytes:
    return COUNTER_KEY.pack(address_bytes(ip), DIRECTION_CODES[direction])


def decode_counter_key(raw: bytes) -> tuple[str, Direction]:
    addr, code = COUNTER_KEY.unpack(raw)
    if code not in _DIRECTIONS:
        raise ValueError(f"counter key with unknown direction {code}")
    return address_text(addr), _DIRECTIONS[code]


def sum_per_cpu(raw: bytes) -> Traffic:
    """Add up a per-CPU counter array (one 16-byte slot per possible CPU: packets, then bytes)."""
    words = memoryview(raw).cast("Q")  # native-endian u64, as the kernel wrote them
    return Traffic(sum(words[0::2]), sum(words[1::2]))
