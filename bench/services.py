"""What Services cost the agent: memory per Service and per EndpointSlice endpoint, and naming a drained
flow record through a Service against a plain pod-to-pod record, in the same run.

Memory: 10,000 Services (one ClusterIP, two ports) and their EndpointSlices (100,000 endpoints, 10 per
Service, 100 per slice at most), decoded from Kubernetes-shaped JSON by the agent's decoders into its
stores (``runtime.service_names``), the index built; tracemalloc of what stays, per Service and per
endpoint. Naming: 100,000 flow entries from this node's pods, to pods (the reference) or to ClusterIPs
whose connections conntrack translated (``model.flow_records.name_flows`` with the drain's entries
resolved once by ``ServiceNaming.resolve``, for the records and both series), median of rounds; the ratio
is the cost per record through a Service. Beside it, what indexing the drain's translations costs per
conntrack entry (its four tuples resolved to the Service and backend once, ``ServiceNaming``).

    .venv/bin/python -m bench.services
    .venv/bin/python -m bench.services --services 2000 --rounds 3

The TC program is the same with or without Services (nothing of this runs in the kernel): its
per-packet cost is ``bench.flows``' ``ns_per_packet_flows``. Its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

from bench.measure import json_line, table, traced_bytes
from podmeter.model.deltas import SERVICE_BACKENDS, SERVICES, Replace
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import EndpointCache, name_flows
from podmeter.model.flows import FlowCounts, FlowEntry, FlowKey, Observation
from podmeter.model.records import Pod, decode_pod
from podmeter.model.services import ServiceNaming, Translations, decode_service, decode_service_backends
from podmeter.runtime.service_names import ServiceNames

TCP = 6
PER_SERVICE = 10  # endpoints


def _ip(prefix: int, index: int) -> str:
    return f"10.{prefix + index // 65536}.{index // 256 % 256}.{index % 256}"


def service_json(i: int) -> bytes:
    return json.dumps({
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": f"svc-{i}", "namespace": f"ns-{i % 50}", "uid": f"s-{i:08d}",
                     "resourceVersion": str(i), "labels": {"app": f"svc-{i}"},
                     "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
        "spec": {"type": "ClusterIP", "clusterIP": _ip(96, i), "clusterIPs": [_ip(96, i)],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080},
                           {"name": "metrics", "protocol": "TCP", "port": 9090, "targetPort": 9090}],
                 "selector": {"app": f"svc-{i}"}, "sessionAffinity": "None", "ipFamilies": ["IPv4"]},
        "status": {"loadBalancer": {}}}).encode()


def slice_json(i: int) -> bytes:
    return json.dumps({
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": "IPv4",
        "metadata": {"name": f"svc-{i}-abcde", "namespace": f"ns-{i % 50}", "uid": f"e-{i:08d}",
                     "resourceVersion": str(i), "labels": {"kubernetes.io/service-name": f"svc-{i}"}},
        "endpoints": [{"addresses": [_ip(200, i * PER_SERVICE + k)], "conditions": {"ready": True},
                       "nodeName": f"node-{k}", "targetRef": {"kind": "Pod", "name": f"svc-{i}-{k}"}}
                      for k in range(PER_SERVICE)],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}, {"name": "metrics", "port": 9090}]}).encode()


def memory(services: int) -> tuple[float, float]:
    service_bodies = [service_json(i) for i in range(services)]
    slice_bodies = [slice_json(i) for i in range(services)]

    def build() -> ServiceNames:
        names = ServiceNames()

        async def fill() -> None:
            await names.apply_services(Replace(SERVICES, [decode_service(b) for b in service_bodies]))
            await names.apply_backends(Replace(SERVICE_BACKENDS, [decode_service_backends(b) for b in slice_bodies]))
        asyncio.run(fill())
        names.index()
        return names

    _, service_bytes = traced_bytes(lambda: _services_only(service_bodies))
    _, total = traced_bytes(build)
    return service_bytes / services, (total - service_bytes) / (services * PER_SERVICE)


def _services_only(bodies: list[bytes]) -> ServiceNames:
    names = ServiceNames()
    asyncio.run(names.apply_services(Replace(SERVICES, [decode_service(b) for b in bodies])))
    names.index()
    return names


def pods(count: int) -> list[Pod]:
    return [decode_pod(json.dumps({
        "metadata": {"name": f"client-{i}", "namespace": "shop", "uid": f"p-{i}", "resourceVersion": "1",
                     "ownerReferences": [{"kind": "ReplicaSet", "name": "client-5d9f7", "controller": True}]},
        "spec": {"nodeName": "node-a"}, "status": {"phase": "Running", "podIP": _ip(244, i)}}).encode())
        for i in range(count)]


def naming_ns(records: int, rounds: int) -> tuple[float, float, float]:
    local, backends = pods(100), pods(200)[100:]
    book = AddressBook([*local, *backends])
    plain: list[FlowEntry] = []
    through: list[FlowEntry] = []
    translations = []
    for i in range(records):
        client, backend = local[i % 100].ips[0], backends[i % 100].ips[0]
        counts = FlowCounts(3, 300, 1, 2, 0x10)
        plain.append((FlowKey(client, backend, 30000 + i % 30000, 8080, TCP, Observation.FROM_POD), counts))
        vip = _ip(96, i % 1000)
        sport = 30000 + i % 30000
        through.append((FlowKey(client, vip, sport, 80, TCP, Observation.FROM_POD), counts))
        translations.append(((TCP, client, sport, vip, 80), (TCP, backend, 8080, client, sport)))
    names = ServiceNames()
    asyncio.run(names.apply_services(Replace(SERVICES, [decode_service(service_json(i)) for i in range(1000)])))
    index = names.index()

    def timed(entries: list[FlowEntry], services: bool) -> tuple[float, float]:
        """(ns per record named, ns per translation indexed for the drain), the cyclic collector held as the
        agent's drain holds it (``runtime.flow_drain``)."""
        gc.disable()
        start = time.perf_counter()
        naming = ServiceNaming(index, Translations(translations)) if services else None
        indexed = time.perf_counter()
        name_flows(entries, EndpointCache(book), "node-a", 0.0, naming.resolve(entries) if naming else None)
        done = time.perf_counter()
        gc.enable()
        return (done - indexed) * 1e9 / len(entries), (indexed - start) * 1e9 / len(translations)

    plain_ns, service_ns, indexing_ns = [], [], []
    for _ in range(rounds):  # interleaved
        plain_ns.append(timed(plain, services=False)[0])
        named, indexed = timed(through, services=True)
        service_ns.append(named)
        indexing_ns.append(indexed)
    return statistics.median(plain_ns), statistics.median(service_ns), statistics.median(indexing_ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    per_service, per_endpoint = memory(args.services)
    plain, through, indexing = naming_ns(args.records, args.rounds)
    table([
        ("bytes_per_service", per_service, 300.0, f"{args.services:,} Services, target <= 300"),
        ("bytes_per_endpoint", per_endpoint, 100.0, f"{args.services * PER_SERVICE:,} endpoints, target <= 100"),
        ("ns_per_record_through_a_service", through, plain, "vs pod to pod, same run; target <= 1.5x"),
        ("ns_per_translation_indexed", indexing, None, "per conntrack entry, once per drain"),
    ])
    json_line({"bytes_per_service": per_service, "bytes_per_endpoint": per_endpoint,
               "ns_per_record_pod_to_pod": plain, "ns_per_record_through_service": through,
               "naming_ratio_service_vs_pod": through / plain, "ns_per_translation_indexed": indexing})


if __name__ == "__main__":
    main()
