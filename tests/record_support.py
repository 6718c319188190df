"""Flow records of every shape Hubble's encoders and filters meet: TCP with flags, UDP to the world, ICMP
and ICMPv6, IPv6 ends, pods of a Deployment, a StatefulSet and a bare pod (``records(n)``: record i at
``BASE + i``, source port ``40000 + i`` where it has ports)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from factories import make_pod
from podmeter.model import dns
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import EndpointCache, FlowRecord, name_dns, name_flows
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.model.records import Pod

FROM, TO = Observation.FROM_POD, Observation.TO_POD
BASE = 1_790_000_000.0  # wall-clock seconds of record 0; record i is at BASE + i
SYN, ACK, FIN, PSH = 0b10, 0b10000, 0b1, 0b1000


def owned(pod: Pod, kind: str, name: str) -> Pod:
    return msgspec.structs.replace(pod, owner_kind=kind, owner_name=name)


WEB = owned(make_pod("web-5d9f7-x2x7p", "shop", ips=("10.0.0.1",), labels={"app": "web", "tier": "front",
                                                                           "pod-template-hash": "5d9f7"}),
            "ReplicaSet", "web-5d9f7")
DB = owned(make_pod("db-0", "shop", ips=("10.0.0.2",), labels={"app": "db"}), "StatefulSet", "db")
CACHE = make_pod("cache", "default", ips=("fd00::3",), labels={"app": "cache"})  # a bare pod: its own workload
PODS = {pod.uid: pod for pod in (WEB, DB, CACHE)}
BOOK = AddressBook(PODS.values())

# One of each shape, repeated: (key, flags). Record i has source port 40000 + i where it has ports.
SHAPES: list[Callable[[int], tuple[FlowKey, int]]] = [
    lambda i: (FlowKey("10.0.0.1", "10.0.0.2", 40000 + i, 5432, TCP, FROM), SYN | ACK),  # web -> db
    lambda i: (FlowKey("10.0.0.1", "8.8.8.8", 40000 + i, 53, UDP, FROM), 0),  # web -> world
    lambda i: (FlowKey("8.8.8.8", "10.0.0.1", 8, 0, ICMP, TO), 0),  # world -> web, echo request
    lambda i: (FlowKey("10.0.0.2", "10.0.0.1", 40000 + i, 8080, TCP, TO), ACK | PSH | FIN),  # db -> web
    lambda i: (FlowKey("fd00::3", "2001:db8::9", 128, 0, ICMPV6, FROM), 0),  # cache -> world (v6)
]


def records(n: int, start: int = 0) -> list[FlowRecord]:
    entries = []
    for i in range(start, start + n):
        key, flags = SHAPES[i % len(SHAPES)](i)
        at = int(i * 1e9)
        entries.append((key, FlowCounts(1 + i % 3, 100 + i, at, at, flags)))
    return name_flows(entries, BOOK, "node-a", BASE)


def with_drops(batch: list[FlowRecord]) -> list[FlowRecord]:
    """The records with 5, 6, 8 and 9 dropped: by netfilter (Cilium's POLICY_DENIED), for a bad IPv6 extension
    header, for a bad TCP checksum (an invalid packet), for a reason the kernel does not specify (no code)."""
    reasons = {5: "NETFILTER_DROP", 6: "IPV6_BAD_EXTHDR", 8: "TCP_CSUM", 9: "NOT_SPECIFIED"}
    return [msgspec.structs.replace(r, verdict="dropped", drop_reason=reasons[i]) if i in reasons else r
            for i, r in enumerate(batch)]


def odd_records() -> list[FlowRecord]:
    """Shapes beyond the shared ones: every TCP flag byte, port 0 and the highest, a protocol without a
    name, times with no fraction and before one second, an identity, an unknown pod, every verdict."""
    book = AddressBook([msgspec.structs.replace(WEB, uid="w"), DB, CACHE])
    entries = [(FlowKey("10.0.0.1", "10.0.0.2", flags * 200, 65535 - flags, TCP, FROM if flags % 2 else TO),
                FlowCounts(1, 60, 0, flags * 999_999_937, flags)) for flags in range(256)]
    entries += [(FlowKey("10.0.0.2", "192.0.2.9", 0, 0, 47, FROM), FlowCounts(1, 1, 0, 0, 0)),
                (FlowKey("10.0.0.2", "192.0.2.9", 0, 65535, UDP, TO), FlowCounts(1, 1, 0, 10**9, 0)),
                (FlowKey("2001:db8::1", "fd00::3", 3, 4, ICMPV6, TO), FlowCounts(1, 1, 0, 5 * 10**8, 0)),
                (FlowKey("10.0.0.9", "10.0.0.1", 0, 0, ICMP, TO), FlowCounts(1, 1, 0, 1, 0))]
    named = name_flows(entries, book, "node-ä.example", 0.0) + name_flows(entries[:20], book, "n", BASE)
    identified = [msgspec.structs.replace(r, source=msgspec.structs.replace(r.source, endpoint=msgspec.structs.replace(
        r.source.endpoint, identity=70000))) for r in named[:10] if r.source.endpoint is not None]
    reasons = ("NETFILTER_DROP", "IPV6_BAD_EXTHDR", None)
    dropped = [msgspec.structs.replace(r, verdict="dropped", drop_reason=reasons[i % 3])
               for i, r in enumerate(named[:30])]
    return [*named, *identified, *dropped, *with_drops(records(40))]


# DNS records (model.dns aggregates, as the agent's DNS drain names them): web and cache ask a CoreDNS pod.
COREDNS = owned(make_pod("coredns-7db6d-k2x9f", "kube-system", ips=("10.0.0.53", "fd00::53"),
                         labels={"k8s-app": "kube-dns"}), "ReplicaSet", "coredns-7db6d")
DNS_PODS = {**PODS, COREDNS.uid: COREDNS}
CART = "cart.shop.svc.cluster.local."


def dns_entry(pod: str, name: str = CART, qtype: int = 1, rcode: int | None = None, *, server: str = "10.0.0.53",
              count: int = 1, latency_ns: int = 0, protocol: int = UDP) -> dns.DnsEntry:
    """One aggregate: a query (``rcode`` None) or an answer of ``rcode``, its answers ``latency_ns`` each."""
    direction = dns.Direction.QUERY if rcode is None else dns.Direction.RESPONSE
    timed = count if latency_ns and rcode is not None else 0
    return (dns.DnsKey(pod, server, direction, name, qtype, rcode or 0, protocol),
            dns.DnsCounts(count, timed, timed * latency_ns, (timed,) + (0,) * (dns.BUCKETS - 1)))


def dns_records(entries: list[dns.DnsEntry], at: float = BASE) -> list[FlowRecord]:
    return name_dns(entries, EndpointCache(AddressBook(DNS_PODS.values())), "node-a", at)


RESOLVER = "10.96.0.10"  # the cluster's DNS server: no pod of BOOK holds it


def asked_records(asked: list[tuple[str, str, int, int | None, int]]) -> list[FlowRecord]:
    """The DNS drain's records of ``asked``: (pod IP, name, qtype, rcode or None for a query, count)."""
    entries = [(dns.DnsKey(pod, RESOLVER, dns.Direction.QUERY if rcode is None else dns.Direction.RESPONSE,
                           name, qtype, rcode or 0, UDP), dns.DnsCounts(count))
               for pod, name, qtype, rcode, count in asked]
    return name_dns(entries, EndpointCache(BOOK), "node-a", BASE)
