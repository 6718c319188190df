"""DNS as the datapath aggregates it: the queries each observed pod sends and the answers it receives.

The TC programs read the header and the first question of every DNS message of an observed pod
(``bpf/podmeter_dns.h``) and add it to an entry keyed by :class:`DnsKey` (pod, server, direction, query
name, query type, response code, protocol), with a count and, for responses, a latency histogram
(:class:`DnsCounts`). The agent drains the entries with the flows.

:func:`parse_question` is the parser's rules in Python, the oracle the kernel's parser is tested
against (tests/model/test_dns.py): a message is either read whole or refused with one :class:`Verdict`,
never read partly. Pure and synchronous.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from podmeter.model.pod_series import SeriesBook
from podmeter.model.records import Pod

HEADER = struct.Struct("!HHHHHH")  # id, flags, qdcount, ancount, nscount, arcount
NAME_MAX = 255  # wire bytes of a name, its final zero included (RFC 1035 3.1)
LABEL_MAX = 63
BUCKETS = 13

# Upper bounds of the latency histogram's buckets, in seconds (the program's pm_dns_bucket); the 13th
# bucket is above the last bound (an answer later than 5 s has no latency: the query has expired).
LATENCY_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Query types and response codes by their IANA names (others are reported by number).
QTYPE_NAMES = {
    1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 13: "HINFO", 15: "MX", 16: "TXT", 28: "AAAA",
    33: "SRV", 35: "NAPTR", 39: "DNAME", 41: "OPT", 43: "DS", 46: "RRSIG", 47: "NSEC", 48: "DNSKEY",
    52: "TLSA", 64: "SVCB", 65: "HTTPS", 99: "SPF", 252: "AXFR", 255: "ANY", 257: "CAA",
}
RCODE_NAMES = {
    0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED", 6: "YXDOMAIN",
    7: "YXRRSET", 8: "NXRRSET", 9: "NOTAUTH", 10: "NOTZONE",
}


def qtype_name(qtype: int) -> str:
    return QTYPE_NAMES.get(qtype, str(qtype))


def rcode_name(rcode: int) -> str:
    return RCODE_NAMES.get(rcode, str(rcode))


class Direction(enum.StrEnum):
    """A query the pod sent, or a response it received."""

    QUERY = "query"
    RESPONSE = "response"


class Verdict(enum.IntEnum):
    """What became of a message: the slots of the program's ``dns_counts`` (same numbers)."""

    PARSED = 0
    TRUNCATED = 1
    BAD_COUNT = 2
    LABEL_LONG = 3
    POINTER = 4
    NAME_LONG = 5
    WRONG_QR = 6
    TCP = 7
    FULL = 8
    PENDING_FULL = 9
    EXPIRED = 10
    UNMATCHED = 11


@dataclass(frozen=True, slots=True)
class Question:
    """What the parser reads of a well-formed message."""

    id: int
    response: bool
    rcode: int
    qtype: int
    wire_name: bytes  # length-prefixed labels, the final zero included


def parse_question(message: bytes) -> Question | Verdict:
    """The header and first question of ``message`` (the DNS message alone, no transport bytes), or the
    verdict that refuses it. The rules and their order are the program's (pm_dns_question)."""
    if len(message) < HEADER.size:
        return Verdict.TRUNCATED
    ident, flags, qdcount, *_ = HEADER.unpack_from(message)
    if qdcount != 1:
        return Verdict.BAD_COUNT
    question = message[HEADER.size :]
    avail, pos = len(question), 0
    while True:
        if pos >= avail:
            return Verdict.TRUNCATED
        label = question[pos]
        if label == 0:
            break
        if label & 0xC0 == 0xC0:
            return Verdict.POINTER
        if label > LABEL_MAX:
            return Verdict.LABEL_LONG
        pos += label + 1
        if pos >= NAME_MAX:
            return Verdict.NAME_LONG
    name_len = pos + 1
    if name_len + 4 > avail:
        return Verdict.TRUNCATED
    qtype = question[name_len] << 8 | question[name_len + 1]
    return Question(ident, bool(flags >> 15), flags & 0xF, qtype, bytes(question[:name_len]))


_PLAIN = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


@functools.lru_cache(maxsize=4096)  # names repeat across pods and drains; bounded
def name_text(wire: bytes) -> str:
    """The dotted, lowercased form of a wire name (``cart.shop.svc.cluster.local.``; the root is ``.``).
    Bytes outside printable ASCII, dots and backslashes in labels are escaped as ``\\DDD`` (as dig
    prints them). Raises ValueError for bytes that are not a complete uncompressed name."""
    labels: list[str] = []
    pos = 0
    while True:
        if pos >= len(wire):
            raise ValueError("DNS name without its final zero")
        length = wire[pos]
        if length == 0:
            break
        if length > LABEL_MAX or pos + 1 + length > len(wire):
            raise ValueError(f"DNS label of {length} bytes at {pos}")
        raw = wire[pos + 1 : pos + 1 + length]
        plain = not raw.translate(None, _PLAIN)  # the common case: letters, digits, '-', '_'
        labels.append(raw.decode("ascii").lower() if plain else "".join(_char(byte) for byte in raw))
        pos += 1 + length
    if pos + 1 != len(wire):
        raise ValueError("bytes after the end of a DNS name")
    return ".".join(labels) + "."


def _char(byte: int) -> str:
    if 0x41 <= byte <= 0x5A:
        return chr(byte | 0x20)
    if 0x21 <= byte <= 0x7E and byte not in (0x2E, 0x5C):
        return chr(byte)
    return f"\\{byte:03d}"


def wire_name(text: str) -> bytes:
    """The wire form of a dotted ASCII name (tests, the lab): the inverse of :func:`name_text` for
    names without escapes. Raises ValueError for an empty label or one over 63 bytes."""
    labels = [label for label in text.rstrip(".").split(".")] if text.strip(".") else []
    out = bytearray()
    for label in labels:
        raw = label.encode("ascii")
        if not 1 <= len(raw) <= LABEL_MAX:
            raise ValueError(f"DNS label {label!r}: 1 to {LABEL_MAX} bytes")
        out += bytes([len(raw)]) + raw
    return bytes(out) + b"\x00"


@dataclass(frozen=True, slots=True)
class DnsKey:
    """One aggregate as the kernel keys it. ``pod`` and ``server`` are canonical IPs; ``name`` is
    :func:`name_text` of the question; ``rcode`` is 0 for queries."""

    pod: str
    server: str
    direction: Direction
    name: str
    qtype: int
    rcode: int
    protocol: int


@dataclass(frozen=True, slots=True)
class DnsCounts:
    """Messages, and for responses the latencies measured (count, sum, per bucket)."""

    count: int
    latency_count: int = 0
    latency_sum_ns: int = 0
    buckets: tuple[int, ...] = (0,) * BUCKETS

    def __add__(self, other: DnsCounts) -> DnsCounts:
        return DnsCounts(self.count + other.count, self.latency_count + other.latency_count,
                         self.latency_sum_ns + other.latency_sum_ns,
                         tuple(a + b for a, b in zip(self.buckets, other.buckets, strict=True)))


DnsEntry = tuple[DnsKey, DnsCounts]


def merge(entries: Iterable[DnsEntry]) -> dict[DnsKey, DnsCounts]:
    """Entries by key, added up: the kernel keys names as sent, so two spellings of one name (a resolver
    that randomises case) are two kernel entries and one here."""
    merged: dict[DnsKey, DnsCounts] = {}
    for key, counts in entries:
        known = merged.get(key)
        merged[key] = counts if known is None else known + counts
    return merged


def latency_ms(counts: DnsCounts) -> dict[str, object]:
    """The latency of an aggregate as ``podmeter observe`` prints it: count, mean and the bucket counts
    by upper bound in ms (``"+Inf"`` for the last)."""
    bounds = [f"{bound * 1000:g}" for bound in LATENCY_BOUNDS] + ["+Inf"]
    mean = counts.latency_sum_ns / counts.latency_count / 1e6 if counts.latency_count else None
    return {"count": counts.latency_count, "mean": None if mean is None else round(mean, 3),
            "buckets": {bound: n for bound, n in zip(bounds, counts.buckets, strict=True) if n}}


@dataclass
class DnsDrain:
    """One drain of the kernel's aggregates, and how many entries the decoder refused (counted, never
    raised: they are deleted from the kernel already)."""

    entries: list[DnsEntry] = field(default_factory=list)
    undecodable: int = 0


class DnsSource(Protocol):
    """What the agent needs of a datapath that reads DNS (eBPF: ``adapters.datapath.ebpf.dns.DnsMaps``)."""

    def drain(self) -> DnsDrain:
        """Read and remove every aggregate."""
        ...

    def counts(self) -> dict[Verdict, int]:
        """Messages aggregated and refused, by verdict, since the datapath's maps were created."""
        ...

    def sweep(self, observed: Callable[[str], bool], now_ns: int | None = None) -> int:
        """Forget outstanding queries that expired or whose pod is not ``observed``; returns how many."""
        ...


# --- the per-pod series ------------------------------------------------------------------------------------


@dataclass
class DnsSeries:
    """The DNS series of one pod (by UID): queries it sent by qtype, responses it received by rcode, and
    the latency histogram of those responses (per-bucket counts, not cumulative). Invariant: ``ended_at``
    is None iff ``ips`` is not empty; every count only grows while the series exists."""

    uid: str
    namespace: str
    name: str
    queries: dict[int, int] = field(default_factory=dict)
    responses: dict[int, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * BUCKETS)
    latency_count: int = 0
    latency_sum_ns: int = 0
    ips: set[str] = field(default_factory=set)
    ended_at: float | None = None

    def add(self, key: DnsKey, counts: DnsCounts) -> None:
        if key.direction is Direction.QUERY:
            self.queries[key.qtype] = self.queries.get(key.qtype, 0) + counts.count
            return
        self.responses[key.rcode] = self.responses.get(key.rcode, 0) + counts.count
        self.latency_count += counts.latency_count
        self.latency_sum_ns += counts.latency_sum_ns
        for index, count in enumerate(counts.buckets):
            self.buckets[index] += count


def _new_series(pod: Pod) -> DnsSeries:
    return DnsSeries(pod.uid, pod.namespace, pod.name)


class DnsLedger:
    """Who owns which observed IP, and each pod's DNS series (the per-pod lifecycle of
    :class:`~podmeter.model.pod_series.SeriesBook`: from the pod's first observed IP until ``grace``
    after its last). Query names are never kept here: they are unbounded (the records carry them).

    Invariant: an IP is in ``owners`` iff it is in ``series[owners[ip]].ips``. A drain is credited by the
    holders its caller names (the pods as they were while the messages were counted), to their series if
    they still have one (a pod in its grace gets its last answers); else to ``unattributed``.
    """

    def __init__(self, grace: float) -> None:
        self.owners: dict[str, str] = {}
        self.unattributed = 0  # messages of an IP without a series at their drain
        self._book: SeriesBook[DnsSeries] = SeriesBook(grace, _new_series)

    @property
    def series(self) -> dict[str, DnsSeries]:
        return self._book.series

    def assign(self, ip: str, pod: Pod | None, now: float) -> None:
        """``pod`` owns ``ip`` from now on (None: nobody)."""
        current = self.owners.get(ip)
        if pod is not None and current == pod.uid:
            return
        if current is not None:
            del self.owners[ip]
            self._book.lets_go(current, ip, now)
        if pod is not None:
            self._book.holds(pod, ip)
            self.owners[ip] = pod.uid

    def release(self, ips: Iterable[str], now: float) -> None:
        for ip in ips:
            self.assign(ip, None, now)

    def expire(self, now: float) -> int:
        return self._book.expire(now)

    def add(self, entries: Iterable[DnsEntry], holders: Mapping[str, str]) -> None:
        """Credit one drain; ``holders``: pod IP -> UID of the pod that held it while it was counted."""
        for key, counts in entries:
            uid = holders.get(key.pod)
            series = None if uid is None else self.series.get(uid)
            if series is None:
                self.unattributed += counts.count
            else:
                series.add(key, counts)
