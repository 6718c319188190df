"""The per-Service series: each packet once (a request at the client's from-pod point, a reply at its
to-pod point), clients of other nodes left to them, bounded by the cap, and gone after idling."""

from __future__ import annotations

import pytest

from podmeter.model.endpoints import Endpoint
from podmeter.model.flows import FlowCounts, FlowKey, Observation
from podmeter.model.service_series import OTHER, REPLY, REQUEST, ServiceTraffic
from podmeter.model.services import Service, ServiceIndex, ServiceNaming, ServicePort, Translations, port_table

pytestmark = pytest.mark.fast
TCP, SYN, ACK = 6, 0x02, 0x10
FROM, TO = Observation.FROM_POD, Observation.TO_POD


def naming(services: int = 1) -> ServiceNaming:
    ports = port_table([ServicePort("", TCP, 80)])
    made = [Service("shop", f"web-{i}", f"u{i}", "ClusterIP", f"10.96.0.{i + 1}", ports) for i in range(services)]
    return ServiceNaming(ServiceIndex(made), Translations())


def names(node: str = "node-a") -> dict[str, Endpoint | None]:
    client = Endpoint("shop", "client-1", "Deployment", "client", node)
    return {"10.0.2.7": client, "10.0.9.9": Endpoint("shop", "far", "Deployment", "far", "node-b")}


def entry(src: str, dst: str, sport: int, dport: int, observation: Observation, size: int, flags: int = ACK,
          ) -> tuple[FlowKey, FlowCounts]:
    return FlowKey(src, dst, sport, dport, TCP, observation), FlowCounts(2, size, 0, 0, flags)


def test_requests_and_replies_count_once_on_the_clients_node_with_its_connections() -> None:
    series = ServiceTraffic("node-a", limit=10, idle=60)
    series.add(naming().resolve([
        entry("10.0.2.7", "10.96.0.1", 4000, 80, FROM, 300, SYN),   # request, a new connection
        entry("10.96.0.1", "10.0.2.7", 80, 4000, TO, 900),          # its reply, entering the client
        entry("10.0.2.7", "10.96.0.1", 4001, 80, FROM, 100),        # a connection opened before
        entry("10.0.9.9", "10.96.0.1", 5000, 80, FROM, 700, SYN),   # a client of another node
        entry("10.0.2.7", "10.0.1.5", 4002, 8080, FROM, 50)]),      # to no Service
        names(), now=1.0)
    by_direction = {key.direction: traffic.bytes for key, traffic in series.values()}
    assert by_direction == {REQUEST: 400, REPLY: 900}
    ((client, opened),) = series.opened()
    assert (client.service, client.client_workload, opened.packets) == ("web-0", "client", 1)


def test_the_series_are_capped_and_go_after_idling() -> None:
    series = ServiceTraffic("node-a", limit=3, idle=10)
    series.add(naming(8).resolve([entry("10.0.2.7", f"10.96.0.{i + 1}", 4000, 80, FROM, 10, SYN) for i in range(8)]),
               names(), now=1.0)
    services = {key.client.service for key, _ in series.values()}
    assert len(services) == 4 and OTHER in services
    assert sum(t.bytes for _, t in series.values()) == 80
    assert series.expire(now=11.0) == 8  # 4 traffic keys, 4 connection keys
    assert not list(series.values()) and not list(series.opened())
