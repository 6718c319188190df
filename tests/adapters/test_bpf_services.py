"""Flows through a Service, end to end: a real `podmeter agent --datapath ebpf` in a private "node" netns,
the lab API server's Service (ClusterIP allocated by it) and EndpointSlice, the node's DNAT as kube-proxy's
nftables mode writes it (the lab's Service proxy rules), real netns pods and TCP connections to the lab's
echo servers (tests/service_support.py).

Each connection's records name the Service and the backend that served it (conntrack's, exactly per
backend), the workload-pair series count the bytes between client and backend workloads once per packet
and nothing as `world`, and `podmeter observe --to-service` selects them. A backend's IP reused by a pod
of another workload, a Service deleted during traffic, and a Service over IPv6.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_harness import Cluster
from bpf_support import Pod, Topology, needs_root
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf.netns import netns
from service_support import (
    PAYLOAD,
    SERVICE,
    calls,
    create_service,
    create_slice,
    get,
    proxy,
    records,
    requests_of,
    routed,
    running_agent,
    services_state,
    serving,
    set_slice,
    value,
)
from waiting import wait_for

pytestmark = needs_root


@pytest.mark.parametrize("kind", ["ClusterIP", "NodePort"])
def test_flows_through_a_service_name_the_service_and_the_backend_that_served_each(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, kind: str) -> None:
    """ClusterIP: to the allocated address and the Service's port. NodePort: to the node's own address (the
    client's gateway) and the allocated node port, rewritten by the same proxy to a local backend."""
    client, *backends = _pods(topology, server, 3)
    with topology.in_host():
        service = create_service(server, kind)
        made = create_slice(server, [b.ip for b in backends])
    proxy(topology, [service], [made])
    if kind == "NodePort":
        cluster_ip, service_port = client.host_ip, service["spec"]["ports"][0]["nodePort"]
    else:
        cluster_ip, service_port = service["spec"]["clusterIP"], 80
    with running_agent(topology, server, pin_dir, tmp_path) as port, \
            serving({f"web-{i}": b for i, b in enumerate(backends)}) as served:
        ports = calls(client, cluster_ip, service_port, 30)
        wait_for(lambda: _requests_seen(records(topology, port, to_service="shop/web"), ports), 20,
                 "every connection's request drained")
        found = records(topology, port)
        metrics = get(topology, port, "/metrics")
    by_port = requests_of(found, client.ip, cluster_ip)
    assert set(by_port) == set(ports)
    for record in by_port.values():
        destination = record["destination"]
        assert destination["service"] == SERVICE
        assert destination["port"] == service_port and destination["world"] is False  # the wire's
    assert _named(by_port) == dict(served.by_port), "each connection named by the backend that served it"
    replies = [r for r in found if r["source"]["ip"] == cluster_ip and r["destination"]["ip"] == client.ip]
    assert replies and all(r["source"]["service"] == SERVICE
                           and r["source"]["pod"].startswith("web-") for r in replies)
    assert not [r for r in found if r["destination"]["world"] and r["destination"]["ip"] == cluster_ip]
    pairs = [line for line in metrics.splitlines() if line.startswith("podmeter_workload_flow_bytes_total{")]
    assert any('destination_workload="web-' in line for line in pairs), pairs
    assert not [line for line in pairs if '"world"' in line], "no Service traffic counted as the world's"
    # The per-Service series count the same packets as the pairs, and the connections opened.
    requests = sum(value(line) for line in pairs if 'source_workload="client"' in line and '"web-' in line)
    replies = sum(value(line) for line in pairs if 'destination_workload="client"' in line and '"web-' in line)
    service = [line for line in metrics.splitlines() if line.startswith("podmeter_service_")]
    labels = 'service_namespace="shop",service="web",client_namespace="shop"'
    assert requests > 30 * PAYLOAD and replies > 30 * PAYLOAD
    assert sum(value(line) for line in service if line.startswith("podmeter_service_bytes_total{") and labels in line
               and 'direction="request"' in line) == requests
    assert sum(value(line) for line in service if line.startswith("podmeter_service_bytes_total{") and labels in line
               and 'direction="reply"' in line) == replies
    assert sum(value(line) for line in service if line.startswith("podmeter_service_connections_total{")) == 30


def _named(requests: dict[int, dict[str, Any]]) -> dict[int, str | None]:
    """Client port -> the backend pod its request record names."""
    return {port: record["destination"]["pod"] for port, record in requests.items()}


def _requests_seen(found: list[dict[str, Any]], ports: list[int]) -> bool:
    return {r["source"]["port"] for r in found} >= set(ports)


def test_a_backend_ip_reused_by_a_pod_of_another_workload_is_named_by_it_and_by_the_service_only_in_its_slice(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    """web-1 is deleted and its address goes to db-0 (another workload) while the Service keeps its name:
    new connections to that address name db-0 and no Service while the slice does not list it, and the
    Service web with db-0 once it does (each connection exactly as the backend that served it says)."""
    client, first, second = (topology.add_pod() for _ in range(3))
    routed(topology, [client, first, second])
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "client", client.ip)
        cluster.pod("shop", "web-0", first.ip)
        old = cluster.pod("shop", "web-1", second.ip)
        service = create_service(server)
        made = create_slice(server, [first.ip, second.ip])
    proxy(topology, [service], [made])
    cluster_ip = service["spec"]["clusterIP"]
    with running_agent(topology, server, pin_dir, tmp_path) as port:
        with serving({"web-0": first, "web-1": second}) as served:
            before = calls(client, cluster_ip, 80, 16)
        assert set(served.per_backend(before)) == {"web-0", "web-1"}, "both backends took some"
        with topology.in_host():
            cluster.delete_pod("shop", "web-1")
            made = set_slice(server, [first.ip])
        proxy(topology, [service], [made])
        with topology.in_host():
            new = cluster.pod("shop", "db-0", second.ip)
        _wait_state(topology, port, old["metadata"]["uid"], new["metadata"]["uid"], backends=1)
        with serving({"web-0": first, "db-0": second}) as served_after:
            through = calls(client, cluster_ip, 80, 8)
            direct = calls(client, second.ip, 8080, 8)
        with topology.in_host():
            made = set_slice(server, [first.ip, second.ip])  # db-0 now one of web's backends
        proxy(topology, [service], [made])
        _wait_state(topology, port, old["metadata"]["uid"], new["metadata"]["uid"], backends=2)
        with serving({"web-0": first, "db-0": second}) as served_listed:
            listed = calls(client, cluster_ip, 80, 24)
        wait_for(lambda: _requests_seen(records(topology, port, from_pod="shop/client"), before + through + direct
                                        + listed), 20, "every connection's request drained")
        found = records(topology, port)
    via_service = requests_of(found, client.ip, cluster_ip)
    named = _named(via_service)
    assert {p: named[p] for p in before} == {p: served.by_port[p] for p in before}
    assert {p: named[p] for p in through} == dict.fromkeys(through, "web-0") == {
        p: served_after.by_port[p] for p in through}, "the deleted backend's address is no longer the Service's"
    to_db = requests_of(found, client.ip, second.ip)
    assert {p: (to_db[p]["destination"]["pod"], to_db[p]["destination"]["workload"], to_db[p]["destination"]["service"])
            for p in direct} == dict.fromkeys(direct, ("db-0", "db-0", None)), "named by the new pod, not the Service"
    assert {p: named[p] for p in listed} == {p: served_listed.by_port[p] for p in listed}
    assert "db-0" in served_listed.per_backend(listed), "db-0 served some through the Service"
    assert all(via_service[p]["destination"]["service"] == SERVICE for p in before + through + listed)
    # At db-0's own link the requests it served through the Service name it and the Service.
    served_by_db = {p for p in listed if served_listed.by_port[p] == "db-0"}
    at_db = {r["source"]["port"]: r["destination"] for r in found if r["observation"] == "to-pod"
             and r["destination"]["ip"] == second.ip and r["source"]["port"] in served_by_db}
    assert set(at_db) == served_by_db and all(d["pod"] == "db-0" and d["service"] == SERVICE for d in at_db.values())


def test_a_service_deleted_during_traffic_leaves_new_records_and_the_agents_memory(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    """Connections go on while the Service, its slice and its rules are deleted: the records of new
    connections (to the backends, and tries at the old ClusterIP) name no Service, and the agent's Services
    stores and index are back to their sizes before the Service existed."""
    client, *backends = _pods(topology, server, 2)
    with running_agent(topology, server, pin_dir, tmp_path) as port:
        baseline = services_state(topology, port)
        with topology.in_host():
            service = create_service(server)
            made = create_slice(server, [b.ip for b in backends])
        proxy(topology, [service], [made])
        cluster_ip = service["spec"]["clusterIP"]
        wait_for(lambda: services_state(topology, port)["backends"] == 2, 15, "the agent knows the Service")
        with serving({f"web-{i}": b for i, b in enumerate(backends)}) as served:
            through = calls(client, cluster_ip, 80, 12)
            wait_for(lambda: _requests_seen(records(topology, port, to_service="shop/web"), through), 20,
                     "the connections through the Service drained while it is there")
            with topology.in_host():
                assert server.request("DELETE", "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/web-1")[0] \
                    == 200
                assert server.request("DELETE", "/api/v1/namespaces/shop/services/web")[0] == 200
            proxy(topology, [], [])
            wait_for(lambda: _sizes(services_state(topology, port)) == _sizes(baseline), 15,
                     "the agent's Services back to their baseline", lambda: str(services_state(topology, port)))
            direct = calls(client, backends[0].ip, 8080, 6)
            refused = _tries(client, cluster_ip, 4)
        wait_for(lambda: _requests_seen(records(topology, port, from_pod="shop/client"), through + direct + refused),
                 20, "every connection's request drained")
        found = records(topology, port)
        after = services_state(topology, port)
    assert _sizes(after) == _sizes(baseline), "nothing of the Service left (the API server's own `kubernetes` stays)"
    requests = requests_of(found, client.ip, cluster_ip)
    assert {p: requests[p]["destination"]["pod"] for p in through} == {p: served.by_port[p] for p in through}
    assert all(requests[p]["destination"]["service"] == SERVICE for p in through)
    assert {requests[p]["destination"]["service"] for p in refused} == {None}, "the name left new connections"
    assert all(requests[p]["destination"]["world"] for p in refused)
    to_backend = requests_of(found, client.ip, backends[0].ip)
    assert {(to_backend[p]["destination"]["pod"], to_backend[p]["destination"]["service"]) for p in direct} == {
        ("web-0", None)}


@pytest.fixture
def dual_stack(topology: Topology) -> Iterator[LabServer]:
    """The lab API server with an IPv6 service CIDR beside the IPv4 one."""
    with topology.in_host():
        lab = LabServer(process=False, service_cidr="10.96.0.0/16,fd00:96::/112")
        lab.start()
    try:
        yield lab
    finally:
        lab.stop()


def test_an_ipv6_cluster_ip_names_the_service_and_the_ipv6_backend_that_served_each_connection(
        topology: Topology, dual_stack: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    """An IPv6 ClusterIP (allocated by the lab API server), a v6 EndpointSlice, the node's ip6 DNAT, conntrack's
    IPv6 entries: each connection's request is named by the Service and the backend that served it."""
    server = dual_stack
    client, *backends = (topology.add_pod(ipv6=True) for _ in range(3))
    routed(topology, [client, *backends], ipv6=True)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        for name, pod in [("client", client), *((f"web-{i}", b) for i, b in enumerate(backends))]:
            cluster.pod("shop", name, None)
            status = {"status": {"phase": "Running", "podIP": pod.ip,
                                 "podIPs": [{"ip": pod.ip}, {"ip": pod.ip6}]}}
            assert server.request("PATCH", f"/api/v1/namespaces/shop/pods/{name}/status", status,
                                  "application/merge-patch+json")[0] == 200
        service = create_service(server, ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack")
        made = create_slice(server, [str(b.ip6) for b in backends], "IPv6")
    cluster_ip = service["spec"]["clusterIP"]
    assert ":" in cluster_ip, service["spec"]
    proxy(topology, [service], [made])
    with running_agent(topology, server, pin_dir, tmp_path) as port, \
            serving({f"web-{i}": b for i, b in enumerate(backends)}, ipv6=True) as served:
        wait_for(lambda: services_state(topology, port)["backends"] == 2, 15, "the agent knows the Service")
        ports = calls(client, cluster_ip, 80, 16)
        wait_for(lambda: _requests_seen(records(topology, port, to_service="shop/web"), ports), 20,
                 "every connection's request drained")
        found = records(topology, port)
    requests = requests_of(found, str(client.ip6), cluster_ip)
    assert set(requests) >= set(ports)
    assert {p: requests[p]["destination"]["pod"] for p in ports} == {p: served.by_port[p] for p in ports}
    assert all(requests[p]["destination"]["service"] == SERVICE for p in ports)
    assert len(served.per_backend(ports)) == 2, "both v6 backends took some"
    replies = [r for r in found if r["source"]["ip"] == cluster_ip and r["destination"]["ip"] == client.ip6
               and r["verdict"] == "forwarded"]  # a dropped record (a late SYN-ACK) is the drop drain's
    assert replies and all(r["source"]["service"] == SERVICE and r["source"]["pod"].startswith("web-")
                           for r in replies)


def _pods(topology: Topology, server: LabServer, backends: int) -> list[Pod]:
    """The client and ``backends`` pods web-0... (observed, routed through the node), on the API server."""
    client, *made = (topology.add_pod() for _ in range(1 + backends))
    routed(topology, [client, *made])
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "client", client.ip)
        for index, backend in enumerate(made):
            cluster.pod("shop", f"web-{index}", backend.ip)
    return [client, *made]


def _tries(client: Pod, address: str, count: int) -> list[int]:
    """Connections tried at ``address`` that cannot succeed (no rule, no route): their client ports."""
    ports = []
    for _ in range(count):
        with netns(client.netns_path):
            sock = socket.socket()
        with sock:
            sock.settimeout(1)
            sock.bind(("0.0.0.0", 0))
            ports.append(int(sock.getsockname()[1]))
            with contextlib.suppress(OSError):
                sock.connect((address, 80))
    return ports


def _sizes(state: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in state.items() if k not in ("translations_read", "last_translations")}


def _wait_state(topology: Topology, port: int, gone: str, there: str, backends: int) -> None:
    """Until the agent holds pod ``there`` and not ``gone``, and its index ``backends`` backend addresses."""
    def settled() -> bool:
        state = json.loads(get(topology, port, "/debug/state"))
        pods, held = state["pod_uids"], state["services"]["backends"]
        return there in pods and gone not in pods and held == backends
    wait_for(settled, 15, "the agent saw the change")
