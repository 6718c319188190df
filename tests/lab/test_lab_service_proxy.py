"""The lab node's Service proxy: the rules it derives from Services and EndpointSlices, and, through real
netns pods and nftables, connections to a ClusterIP and a NodePort spread over the ready backends, and
the node's table gone when the proxy stops."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from bpf_support import Topology, needs_root, run
from lab_server import LabServer
from podmeter.lab.endpointslices import EndpointSliceController
from podmeter.lab.kube import KubeClient
from podmeter.lab.service_proxy import TABLE, Rule, ServiceProxy, apply, removal, rules, ruleset
from service_support import calls, serving
from waiting import wait_for


def service(name: str, cluster_ip: str, ports: list[dict[str, Any]], kind: str = "ClusterIP") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "shop", "uid": f"u-{name}"},
            "spec": {"type": kind, "clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ports": ports}}


def endpoint_slice(service_name: str, endpoints: list[tuple[str, bool]], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": f"{service_name}-x", "namespace": "shop", "uid": f"s-{service_name}",
                         "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv4", "ports": ports,
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints]}


@pytest.mark.fast
def test_rules_take_ready_backends_by_port_name_and_skip_what_has_none() -> None:
    services = [
        service("web", "10.96.0.10", [{"name": "http", "port": 80, "protocol": "TCP"},
                                      {"name": "metrics", "port": 9090, "protocol": "TCP"}]),
        service("dns", "10.96.0.53", [{"port": 53, "protocol": "UDP", "nodePort": 30053}], "NodePort"),
        service("headless", "None", [{"port": 80}]),
        service("empty", "10.96.0.11", [{"port": 80}]),
    ]
    slices = [
        endpoint_slice("web", [("10.0.1.5", True), ("10.0.1.6", False), ("10.0.2.7", True)],
                       [{"name": "http", "port": 8080, "protocol": "TCP"}]),
        endpoint_slice("dns", [("10.0.1.9", True)], [{"name": "", "port": 5353, "protocol": "UDP"}]),
        endpoint_slice("headless", [("10.0.1.8", True)], [{"name": "", "port": 80}]),
    ]
    assert rules(services, slices) == [
        Rule("ip", "tcp", "10.96.0.10", 80, (("10.0.1.5", 8080), ("10.0.2.7", 8080))),
        Rule("ip", "udp", "", 30053, (("10.0.1.9", 5353),)),
        Rule("ip", "udp", "10.96.0.53", 53, (("10.0.1.9", 5353),)),
    ]
    script = ruleset(rules(services, slices))
    web = ("ip daddr 10.96.0.10 tcp dport 80 dnat to numgen random mod 2 map "
           "{ 0 : 10.0.1.5 . 8080, 1 : 10.0.2.7 . 8080 }")
    assert web in script
    assert "fib daddr type local udp dport 30053" in script
    assert "shop" not in script and "web" not in script  # addresses and numbers only


@pytest.fixture
def node() -> Iterator[Topology]:
    topology = Topology()
    topology.create()
    try:
        run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        yield topology
    finally:
        topology.destroy()


@needs_root
def test_connections_to_a_cluster_ip_and_a_node_port_spread_over_the_ready_backends(node: Topology) -> None:
    client, *backends = (node.add_pod() for _ in range(4))
    for pod in (client, *backends):
        run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)
    ready = backends[:3]
    slices = [endpoint_slice("web", [*((b.ip, True) for b in ready)], [{"name": "http", "port": 8080}])]
    services = [service("web", "10.96.231.10", [{"name": "http", "port": 80, "nodePort": 30080}], "NodePort")]
    with serving({b.ip: b for b in backends}) as served:
        with node.in_host():
            apply(ruleset(rules(services, slices)))
        calls(client, "10.96.231.10", 80, 60)
        calls(client, client.host_ip, 30080, 6)  # a node address: the NodePort
    accepted = Counter(served.by_port.values())
    assert sum(accepted.values()) == 66
    assert set(accepted) == {b.ip for b in ready}, "every ready backend served, and only those"
    with node.in_host():
        apply(removal())
    assert TABLE not in run("ip", "netns", "exec", node.host, "nft", "list", "tables")


@needs_root
def test_the_proxy_follows_services_and_their_slices_on_the_lab_api_server(topology: Topology,
                                                                           server: LabServer) -> None:
    """The lab's API server allocates the ClusterIP, the lab's controller makes the slice from ready pods,
    the proxy (its threads in the node's netns) rewrites to them; the Service deleted, its rule goes, and the
    proxy stopped leaves no table."""

    node = topology  # the server's thread lives in its netns: the proxy reaches it on that loopback
    run("ip", "netns", "exec", node.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    client, *backends = (node.add_pod() for _ in range(3))
    for pod in (client, *backends):
        run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)
    with node.in_host():  # the test's own requests too
        assert server.request("POST", "/api/v1/namespaces", {"metadata": {"name": "shop"}})[0] == 201
        for index, backend in enumerate(backends):
            body = {"metadata": {"name": f"web-{index}", "labels": {"app": "web"}},
                    "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "nginx"}]}}
            assert server.request("POST", "/api/v1/namespaces/shop/pods", body)[0] == 201
            status = {"status": {"phase": "Running", "podIP": backend.ip,
                                 "conditions": [{"type": "Ready", "status": "True"}]}}
            assert server.request("PATCH", f"/api/v1/namespaces/shop/pods/web-{index}/status", status,
                                  "application/merge-patch+json")[0] == 200
        created = server.request("POST", "/api/v1/namespaces/shop/services", {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
        assert created[0] == 201
        cluster_ip = created[2]["spec"]["clusterIP"]
        with node.in_host():
            controller = EndpointSliceController(KubeClient.from_kubeconfig(str(server.kubeconfig)))
            controller.start()
            proxy = ServiceProxy(KubeClient.from_kubeconfig(str(server.kubeconfig)), watch_timeout=5)
            proxy.start()
        try:
            def table() -> str:  # "" until the proxy made it
                argv = ["ip", "netns", "exec", node.host, "nft", "list", "table", "ip", TABLE]
                return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

            wait_for(lambda: all(b.ip in table() for b in backends), 15, "the backends' rule")
            with serving({b.ip: b for b in backends}) as served:
                calls(client, cluster_ip, 80, 40)
            accepted = Counter(served.by_port.values())
            assert sum(accepted.values()) == 40 and set(accepted) == {b.ip for b in backends}
            assert server.request("DELETE", "/api/v1/namespaces/shop/services/web")[0] == 200
            wait_for(lambda: cluster_ip not in table(), 15, "the rule gone")
        finally:
            proxy.stop()
            controller.stop()
    assert TABLE not in run("ip", "netns", "exec", node.host, "nft", "list", "tables")
