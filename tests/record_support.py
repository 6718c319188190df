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


RESOLVER = "10.96.0.10"  # the cluster's DNS server: no pod of BOOK holds it


def dns_records(asked: list[tuple[str, str, int, int | None, int]]) -> list[FlowRecord]:
    """The DNS drain's records of ``asked``: (pod IP, name, qtype, rcode or None for a query, count)."""
    entries = [(dns.DnsKey(pod, RESOLVER, dns.Direction.QUERY if rcode is None else dns.Direction.RESPONSE,
                           name, qtype, rcode or 0, UDP), dns.DnsCounts(count))
               for pod, name, qtype, rcode, count in asked]
    return name_dns(entries, EndpointCache(BOOK), "node-a", BASE)
