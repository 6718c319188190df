"""Traffic per Service and client workload: what ``podmeter_service_*`` exports (docs/services.md).

Counted from one drain's entries as the node's pods saw them, each packet once per node: a request where
it left the client's pod (``from-pod``, its destination a Service's frontend), a reply where it entered
the client's pod (``to-pod``, its source the frontend). A TCP connection is counted when its client's
SYN is in a request entry. The client is a pod of this node (its workload); the number of series is
capped like the workload pairs (``model.flow_series.CappedTraffic``, the overflow under ``_other_``).

Next stage: ``adapters.metrics.service_traffic`` renders it at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_series import OTHER, CappedTraffic, PairTraffic
from podmeter.model.flows import TCP, Observation, protocol_name
from podmeter.model.services import ServiceEnds

SYN = 0x02
REQUEST, REPLY = "request", "reply"


class ServiceClient(NamedTuple):
    service_namespace: str
    service: str
    client_namespace: str
    client_workload_kind: str
    client_workload: str
    protocol: str


class ServiceKey(NamedTuple):
    client: ServiceClient
    direction: str  # request | reply


OVERFLOW_CLIENT = ServiceClient(OTHER, OTHER, "", "", OTHER, OTHER)


class ServiceTraffic:
    """Bytes and packets per (Service, client workload, protocol, direction), and TCP connections opened per
    (Service, client workload), bounded by ``limit`` keys each and forgotten after ``idle`` seconds."""

    def __init__(self, node: str, limit: int, idle: float) -> None:
        self.node = node
        self.traffic: CappedTraffic[ServiceKey] = CappedTraffic(limit, idle)
        self.connections: CappedTraffic[ServiceClient] = CappedTraffic(limit, idle)  # ``packets``: connections

    def add(self, services: ServiceEnds, names: Mapping[str, Endpoint | None], now: float) -> None:
        """The drain's entries with an end a Service's (resolved once for the drain)."""
        from_pod = Observation.FROM_POD
        for ((src, dst, _, _, protocol, observation), counts), resolved in zip(services.entries, services.found,
                                                                                strict=True):
            if resolved is None:
                continue
            source_service, destination_service = resolved.source_service, resolved.destination_service
            packets, size, _, _, flags = counts
            if observation is from_pod and destination_service is not None:
                client, service, direction = names[src], destination_service, REQUEST
            elif observation is not from_pod and source_service is not None:
                client, service, direction = names[dst], source_service, REPLY
            else:
                continue
            if client is None or client.node != self.node:
                continue  # a client of another node: counted there
            key = ServiceClient(service.namespace, service.name, client.namespace,
                                client.workload_kind, client.workload, protocol_name(protocol))
            self.traffic.add(ServiceKey(key, direction), packets, size, now, _overflow)
            if direction == REQUEST and protocol == TCP and flags & SYN:
                self.connections.add(key, 1, 0, now, _overflow_client)

    def expire(self, now: float) -> int:
        return self.traffic.expire(now) + self.connections.expire(now)

    def values(self) -> Iterator[tuple[ServiceKey, PairTraffic]]:
        return self.traffic.values()

    def opened(self) -> Iterator[tuple[ServiceClient, PairTraffic]]:
        return self.connections.values()


def _overflow(key: ServiceKey) -> ServiceKey:
    return ServiceKey(OVERFLOW_CLIENT, key.direction)


def _overflow_client(key: ServiceClient) -> ServiceClient:
    return OVERFLOW_CLIENT
