"""Key and value layouts of the pinned maps, mirroring the structs in ``bpf/podmeter.bpf.c``.

Addresses are 16 bytes: IPv6 as is, IPv4 mapped as ``::ffff:a.b.c.d`` so one map holds both families.
Integers are in host byte order (the kernel's view of a ``__u32``/``__u64``); address bytes are in network
order. docs/datapath.md shows the same layouts next to ``bpftool map dump`` output.

    filter   key   struct filter_key   { __u32 prefixlen = 128; __u8 addr[16]; }      20 bytes
             value __u8                  1 (present)                                    1 byte
    counters key   struct counter_key  { __u8 addr[16]; __u32 direction; }            20 bytes
             value struct counter_value { __u64 packets; __u64 bytes; }  per CPU        16 bytes
    flows_a, flows_b (two maps of one layout: the double-buffered flows)
             key   struct flow_key     { __u8 src[16]; __u8 dst[16]; __u16 sport; __u16 dport;
                                         __u8 protocol; __u8 observation; __u8 pad[2]; } 40 bytes
             value struct flow_value   { __u64 packets, bytes, first_ns, last_ns, tcp_flags; }  40 bytes
    flows    key   __u32 0 (one slot); value: the active flows map (written: its fd; read: its map id)
    flows_lost key __u32 0; value struct flows_lost_value { __u64 packets; __u64 bytes; }  per CPU
    flows_fill key __u32 0; value struct flows_fill { __u64 entries; __u32 threshold; __u32 share; }
    flows_share key __u32 ifindex (a pod's link); value __u64 entries created past the threshold
    flows_lost_seen (the programs' own: never read here) key __u32 0; value struct flow_key  per CPU
    dns      key   struct dns_key      { __u8 pod[16]; __u8 server[16]; __u16 qtype; __u8 rcode;
                                         __u8 direction; __u8 protocol; __u8 name_len; __u8 pad[2];
                                         __u8 qname[256]; }                           296 bytes
             value struct dns_value    { __u64 count, latency_count, latency_sum_ns; __u64 buckets[13]; }
    dns_pending (LRU) key struct dns_pending_key { __u8 pod[16]; __u16 port; __u16 id; }; value __u64 ns
    dns_counts key __u32 slot (model.dns.Verdict); value __u64  per CPU
    dns_scratch (the programs' own: never read here) key __u32 0; value struct dns_key  per CPU

Ports in flow keys are in host byte order (the program converts them); ICMP type and code travel in
``sport`` and ``dport``. ``observation`` is 0 for from-pod (``pm_from_pod``), 1 for to-pod.

The formats here (and the drop tracer's in ``drops.py``) are checked against the built objects' BTF
(:func:`drift`, :data:`MAP_MIRRORS`): the loader refuses an object whose structs have moved, naming the
struct and the member, and a test checks the shipped objects.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from podmeter.adapters.datapath.ebpf.btf import MapTypes, TypeLayout
from podmeter.model import dns
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.flows import FlowCounts, FlowEntry, FlowKey, Observation

ADDRESS_BYTES = 16
HOST_PREFIXLEN = 128
FILTER_KEY = struct.Struct(f"=I{ADDRESS_BYTES}s")
FILTER_VALUE = b"\x01"
COUNTER_KEY = struct.Struct(f"={ADDRESS_BYTES}sI")
COUNTER_VALUE = struct.Struct("=QQ")
COUNTER_STRIDE = 16  # round_up(sizeof(struct counter_value), 8)
_V4_MAPPED = b"\x00" * 10 + b"\xff\xff"
_HOST_PREFIX = struct.pack("=I", HOST_PREFIXLEN)

FLOW_KEY = struct.Struct(f"={ADDRESS_BYTES}s{ADDRESS_BYTES}sHHBB2x")
FLOW_VALUE = struct.Struct("=QQQQQ")  # packets, bytes, first_ns, last_ns, tcp_flags: FlowCounts' order
FLOWS_LOST_KEY = struct.pack("=I", 0)
FLOWS_SLOT_KEY = struct.pack("=I", 0)  # the one slot of the flows map-in-map
MAP_REF = struct.Struct("=I")  # a map-in-map value: an inner map's fd when written, its map id when read
FLOWS_LOST_VALUE = struct.Struct("=QQ")  # packets, bytes: one per possible CPU
FLOWS_LOST_STRIDE = 16  # round_up(sizeof(struct flows_lost_value), 8)
FLOWS_FILL_KEY = struct.pack("=I", 0)
FLOWS_FILL = struct.Struct("=QII")  # entries, threshold, share (struct flows_fill)
SHARE_KEY = struct.Struct("=I")  # a pod link's ifindex
SHARE_VALUE = struct.Struct("=Q")  # entries it created past the threshold

DNS_KEY = struct.Struct(f"={ADDRESS_BYTES}s{ADDRESS_BYTES}sHBBBB2x256s")
DNS_BUCKETS = struct.Struct(f"={dns.BUCKETS * 8}s")  # __u64 buckets[13]: one C member, one format item
DNS_VALUE = struct.Struct(f"=QQQ{DNS_BUCKETS.size}s")
DNS_PENDING_KEY = struct.Struct(f"={ADDRESS_BYTES}sHH")
DNS_PENDING_VALUE = struct.Struct("=Q")
DNS_COUNT_KEY = struct.Struct("=I")  # a slot: model.dns.Verdict
DNS_COUNT = struct.Struct("=Q")
_DNS_DIRECTIONS = (dns.Direction.QUERY, dns.Direction.RESPONSE)  # PM_DNS_QUERY, PM_DNS_RESPONSE

# Direction codes of the C program (PM_DIR_INGRESS / PM_DIR_EGRESS).
DIRECTION_CODES = {Direction.INGRESS: 0, Direction.EGRESS: 1}
_DIRECTIONS = {code: direction for direction, code in DIRECTION_CODES.items()}


# Observation codes of the C program (PM_OBS_FROM_POD / PM_OBS_TO_POD), indexed by code.
OBSERVATION_CODES = {Observation.FROM_POD: 0, Observation.TO_POD: 1}
_OBSERVATIONS = (Observation.FROM_POD, Observation.TO_POD)
# Building the NamedTuples with tuple.__new__ skips their Python-level __new__: a C call per entry.
_new_flow_key = partial(tuple.__new__, FlowKey)
_new_flow_counts = partial(tuple.__new__, FlowCounts)


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


class AddressTexts(dict[bytes, str]):
    """16-byte address -> canonical text, computed once per address (flows share their ends). Callers
    make one per drain, so it lives no longer than the entries it decodes."""

    def __missing__(self, raw: bytes) -> str:
        text = self[raw] = address_text(raw)
        return text


def flow_key(key: FlowKey) -> bytes:
    return FLOW_KEY.pack(
        address_bytes(key.source),
        address_bytes(key.destination),
        key.source_port,
        key.destination_port,
        key.protocol,
        OBSERVATION_CODES[key.observation],
    )


def flow_value(counts: FlowCounts) -> bytes:
    return FLOW_VALUE.pack(*counts)


def decode_flows(
    keys: bytes | memoryview, values: bytes | memoryview, count: int, texts: AddressTexts | None = None
) -> list[FlowEntry]:
    """The first ``count`` entries of a batch: ``keys`` and ``values`` are the kernel's packed arrays
    (``count * 40`` bytes each, or more). One ``iter_unpack`` per array, address texts cached, the
    tuples built by C calls: about 0.6 s per million entries. Raises ValueError on an observation code
    the program never writes."""
    texts = AddressTexts() if texts is None else texts
    key_rows = FLOW_KEY.iter_unpack(memoryview(keys)[: count * FLOW_KEY.size])
    counts = map(_new_flow_counts, FLOW_VALUE.iter_unpack(memoryview(values)[: count * FLOW_VALUE.size]))
    observations = _OBSERVATIONS
    try:
        flow_keys = [
            _new_flow_key((texts[source], texts[destination], sport, dport, protocol, observations[code]))
            for source, destination, sport, dport, protocol, code in key_rows
        ]
    except IndexError:
        raise ValueError("flow key with an unknown observation code") from None
    return list(zip(flow_keys, counts, strict=True))


def decode_flow_key(raw: bytes) -> FlowKey:
    return decode_flows(raw, bytes(FLOW_VALUE.size), 1)[0][0]


def decode_flow_value(raw: bytes) -> FlowCounts:
    return _new_flow_counts(FLOW_VALUE.unpack(raw))


def sum_lost(raw: bytes) -> tuple[int, int]:
    """(packets, bytes) of the per-CPU ``flows_lost`` value, summed over CPUs."""
    words = memoryview(raw).cast("Q")
    return sum(words[0::2]), sum(words[1::2])


def dns_key(key: dns.DnsKey, wire: bytes | None = None) -> bytes:
    """The kernel's key of ``key`` (tests); ``wire``: the name as sent (default: :func:`dns.wire_name`)."""
    name = dns.wire_name(key.name) if wire is None else wire
    return DNS_KEY.pack(address_bytes(key.pod), address_bytes(key.server), key.qtype, key.rcode,
                        _DNS_DIRECTIONS.index(key.direction), key.protocol, len(name), name)


def decode_dns_entry(key: bytes | memoryview, value: bytes | memoryview, texts: AddressTexts) -> dns.DnsEntry:
    """One ``dns`` entry. Raises ValueError for one the program cannot have written (a direction code,
    a name that is not a complete name of ``name_len`` bytes)."""
    pod, server, qtype, rcode, direction, protocol, name_len, qname = DNS_KEY.unpack(key)
    if direction >= len(_DNS_DIRECTIONS) or not 1 <= name_len <= dns.NAME_MAX or any(qname[name_len:]):
        raise ValueError(f"dns key with direction {direction}, name_len {name_len}")
    count, latency_count, latency_sum, buckets = DNS_VALUE.unpack(value)
    return (dns.DnsKey(texts[pod], texts[server], _DNS_DIRECTIONS[direction], dns.name_text(bytes(qname[:name_len])),
                       qtype, rcode, protocol),
            dns.DnsCounts(count, latency_count, latency_sum, tuple(memoryview(buckets).cast("Q"))))


def decode_dns(keys: bytes | memoryview, values: bytes | memoryview, count: int,
               texts: AddressTexts | None = None) -> tuple[list[dns.DnsEntry], int]:
    """The first ``count`` entries of a batch of the ``dns`` map, and how many were refused (total:
    a bad entry is counted, never raised; the batch is already deleted from the kernel)."""
    texts = AddressTexts() if texts is None else texts
    entries: list[dns.DnsEntry] = []
    bad = 0
    keys, values = memoryview(keys), memoryview(values)
    for i in range(count):
        try:
            entries.append(decode_dns_entry(keys[i * DNS_KEY.size : (i + 1) * DNS_KEY.size],
                                            values[i * DNS_VALUE.size : (i + 1) * DNS_VALUE.size], texts))
        except ValueError:
            bad += 1
    return entries, bad


def sum_dns_counts(raw: bytes) -> int:
    """A per-CPU ``dns_counts`` slot summed over CPUs."""
    return sum(memoryview(raw).cast("Q"))


# --- the check against the objects' BTF ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mirror:
    """A struct format of the Python side and where it is defined (for messages): what it mirrors is
    the key or value type of a map in an object."""

    where: str
    format: struct.Struct


_U8, _U32, _U64 = struct.Struct("=B"), struct.Struct("=I"), struct.Struct("=Q")
_SLOT = Mirror("layout.FLOWS_SLOT_KEY", _U32)  # the __u32 0 of one-slot maps

# Map name -> (key, value) mirrors of every map the TC object defines (podmeter.bpf.c; the noflows build
# has the first two). None: the map names no such type (a map-in-map's values are maps).
MAP_MIRRORS: dict[str, tuple[Mirror | None, Mirror | None]] = {
    "filter": (Mirror("layout.FILTER_KEY", FILTER_KEY), Mirror("layout.FILTER_VALUE", _U8)),
    "counters": (Mirror("layout.COUNTER_KEY", COUNTER_KEY), Mirror("layout.COUNTER_VALUE", COUNTER_VALUE)),
    "flows_a": (Mirror("layout.FLOW_KEY", FLOW_KEY), Mirror("layout.FLOW_VALUE", FLOW_VALUE)),
    "flows_b": (Mirror("layout.FLOW_KEY", FLOW_KEY), Mirror("layout.FLOW_VALUE", FLOW_VALUE)),
    "flows": (_SLOT, None),
    "flows_lost": (_SLOT, Mirror("layout.FLOWS_LOST_VALUE", FLOWS_LOST_VALUE)),
    "flows_lost_seen": (_SLOT, Mirror("layout.FLOW_KEY", FLOW_KEY)),
    "flows_fill": (_SLOT, Mirror("layout.FLOWS_FILL", FLOWS_FILL)),
    "flows_share": (Mirror("layout.SHARE_KEY", SHARE_KEY), Mirror("layout.SHARE_VALUE", SHARE_VALUE)),
    "dns": (Mirror("layout.DNS_KEY", DNS_KEY), Mirror("layout.DNS_VALUE", DNS_VALUE)),
    "dns_pending": (Mirror("layout.DNS_PENDING_KEY", DNS_PENDING_KEY),
                    Mirror("layout.DNS_PENDING_VALUE", DNS_PENDING_VALUE)),
    "dns_counts": (Mirror("layout.DNS_COUNT_KEY", DNS_COUNT_KEY), Mirror("layout.DNS_COUNT", DNS_COUNT)),
    "dns_scratch": (_SLOT, Mirror("layout.DNS_KEY", DNS_KEY)),
}


def drop_mirrors() -> dict[str, tuple[Mirror | None, Mirror | None]]:
    """The same for the drop tracer's object (podmeter_drops.bpf.c), from the formats of ``drops.py``."""
    from podmeter.adapters.datapath.ebpf import drops  # drops imports this module

    count = Mirror("drops.COUNT", drops.COUNT)
    return {
        "filter": MAP_MIRRORS["filter"],
        "drops": (Mirror("drops.DROP_KEY", drops.DROP_KEY), Mirror("drops.DROP_VALUE", drops.DROP_VALUE)),
        "drop_flows": (Mirror("drops.DROP_FLOW_KEY", drops.DROP_FLOW_KEY),
                       Mirror("drops.DROP_FLOW_VALUE", drops.DROP_FLOW_VALUE)),
        "tcp": (Mirror("drops.TCP_KEY", drops.TCP_KEY), count),
        "tcp_flows": (Mirror("drops.TCP_FLOW_KEY", drops.TCP_FLOW_KEY), count),
        "drops_lost": (Mirror("the __u32 slot index of drops.drops_lost()", _U32), count),
    }


def all_mirrors() -> dict[str, tuple[Mirror | None, Mirror | None]]:
    """Every map name podmeter's objects define -> its mirrors (the name ``filter`` is the same map in
    both objects)."""
    return {**MAP_MIRRORS, **drop_mirrors()}


_FORMAT_ITEM = re.compile(r"(\d*)([xcbB?hHiIlLqQnNefdspP])")


def format_fields(layout: struct.Struct) -> list[tuple[int, int]]:
    """(offset, size) of each item of a struct format with standard sizes (``=``, ``<``, ``>``, ``!``),
    in order. A string (``16s``) or a run of pad bytes (``2x``) is one item, as an array is one member
    in C; ``QQ`` is two. Raises ValueError for a format with native alignment (``@``), which may pad."""
    text = layout.format.replace(" ", "")
    if not text or text[0] not in "=<>!":
        raise ValueError(f"struct format {layout.format!r} has native alignment: use '=' (no implicit padding)")
    fields: list[tuple[int, int]] = []
    offset = 0
    for count, code in _FORMAT_ITEM.findall(text[1:]):
        repeat = int(count) if count else 1
        size = struct.calcsize("=" + code)
        if code in "sxp":
            fields.append((offset, repeat * size))
            offset += repeat * size
            continue
        for _ in range(repeat):
            fields.append((offset, size))
            offset += size
    if offset != layout.size:
        raise ValueError(f"cannot read struct format {layout.format!r}")
    return fields


def _bytes(size: int) -> str:
    return f"{size} byte" if size == 1 else f"{size} bytes"


def type_drift(what: str, built: TypeLayout, mirror: Mirror) -> list[str]:
    """How the type ``built`` (from an object's BTF) and ``mirror`` disagree, one sentence each, naming
    the struct and the member; empty when they match: the same size, and for a struct one format item
    per member at the member's offset with its size."""
    fields = format_fields(mirror.format)
    problems: list[str] = []
    if built.size != mirror.format.size:
        problems.append(f"{what}: {built.name} is {_bytes(built.size)} in the object but {mirror.where} "
                        f"({mirror.format.format!r}) is {_bytes(mirror.format.size)}")
    if not built.is_struct:
        if len(fields) != 1:
            problems.append(f"{what}: {built.name} is one value but {mirror.where} has {len(fields)} fields")
        return problems
    for index, member in enumerate(built.members):
        if not member.whole_bytes:
            problems.append(f"{what}: {built.name} member {member.name} is a bitfield, which no struct format "
                            "mirrors")
            continue
        if index >= len(fields):
            problems.append(f"{what}: {built.name} member {member.name} (offset {member.offset}, "
                            f"{_bytes(member.size)}) has no field in {mirror.where}, which ends at offset "
                            f"{mirror.format.size}")
            continue
        offset, size = fields[index]
        if (offset, size) != (member.offset, member.size):
            problems.append(f"{what}: {built.name} member {member.name} is at offset {member.offset} "
                            f"({_bytes(member.size)}) in the object but field {index} of {mirror.where} "
                            f"({mirror.format.format!r}) is at offset {offset} ({_bytes(size)})")
    for index in range(len(built.members), len(fields)):
        offset, size = fields[index]
        problems.append(f"{what}: {mirror.where} field {index} (offset {offset}, {_bytes(size)}) has no "
                        f"member in {built.name}")
    return problems


def drift(maps: Mapping[str, MapTypes],
          mirrors: Mapping[str, tuple[Mirror | None, Mirror | None]]) -> list[str]:
    """Every disagreement between the key and value types of an object's maps (``btf.ObjectBtf.maps()``)
    and their mirrors. A map without mirrors is not compared (it is not one podmeter reads)."""
    problems: list[str] = []
    for name, types in maps.items():
        if name not in mirrors:
            continue
        for part, built, mirror in (("key", types.key, mirrors[name][0]), ("value", types.value, mirrors[name][1])):
            if mirror is None:
                continue
            if built is None:
                problems.append(f"map {name}: the object names no {part} type, {mirror.where} expects one")
                continue
            problems.extend(type_drift(f"map {name} {part}", built, mirror))
    return problems
