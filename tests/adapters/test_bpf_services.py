"""Flows through a Service, end to end: a real `podmeter agent --datapath ebpf` in a private "node" netns,
the lab API server's Service (ClusterIP allocated by it) and EndpointSlice, the node's DNAT as kube-proxy's
nftables mode writes it (the lab's Service proxy rules), real netns pods and TCP connections.

Each connection's records name the Service and the backend that served it (conntrack's, exactly per
backend), the workload-pair series count the bytes between client and backend workloads once per packet
and nothing as `world`, and `podmeter observe --to-service` selects them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agent_harness import Cluster
from bpf_support import Pod, Topology, needs_root
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.lab.service_proxy import apply, rules, ruleset
from waiting import wait_for

pytestmark = needs_root
PAYLOAD = 3000  # bytes each connection sends; the backend answers with as many


def agent(topology: Topology, server: LabServer, pins: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    with topology.in_host(), socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    argv = ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "agent",
            "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(pins), "--filter-map-size", "64",
            "--listen", f"127.0.0.1:{port}", "--flow-interval", "0.5", "--metrics-min-interval", "0.1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env={**os.environ, "KUBECONFIG": str(server.kubeconfig)}, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc, port


def records(topology: Topology, port: int, **query: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/debug/flows?" + "&".join(f"{k}={v}" for k, v in {"last": "8192", **query}.items())
    with topology.in_host(), urllib.request.urlopen(url, timeout=10) as answer:
        return [json.loads(line) for line in answer.read().splitlines() if line.strip()]


def echo_server(pod: Pod, port: int, served: Counter[str], stop: threading.Event) -> threading.Thread:
    with netns(pod.netns_path):
        listener = socket.create_server(("0.0.0.0", port))
    listener.settimeout(0.2)

    def loop() -> None:
        with listener:
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    continue
                with connection:
                    got = b""
                    while len(got) < PAYLOAD:
                        got += connection.recv(65536)
                    connection.sendall(got)
                served[pod.ip] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def call(client: Pod, address: str, port: int) -> int:
    """One connection through the Service: PAYLOAD bytes there and back; the client's port."""
    with netns(client.netns_path):
        sock = socket.socket()
    with sock:
        sock.settimeout(5)
        sock.connect((address, port))
        sock.sendall(b"x" * PAYLOAD)
        got = b""
        while len(got) < PAYLOAD:
            got += sock.recv(65536)
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", ["ClusterIP", "NodePort"])
def test_flows_through_a_service_name_the_service_and_the_backend_that_served_each(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, kind: str) -> None:
    """ClusterIP: to the allocated address and the Service's port. NodePort: to the node's own address (the
    client's gateway) and the allocated node port, rewritten by the same proxy to a local backend."""
    run = subprocess.run
    run(["ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
    client, *backends = (topology.add_pod() for _ in range(4))
    for pod in (client, *backends):
        run(["ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip], check=True)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "client", client.ip)
        for index, backend in enumerate(backends):
            cluster.pod("shop", f"web-{index}", backend.ip)
        status, _, service = server.request("POST", "/api/v1/namespaces/shop/services", {
            "metadata": {"name": "web"},
            "spec": {"type": kind, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        assert status == 201, service
        endpoint_slice = {
            "metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [b.ip], "conditions": {"ready": True}} for b in backends]}
        status, _, made = server.request("POST", "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices",
                                         endpoint_slice)
        assert status == 201, made
        apply(ruleset(rules([service], [made])))
    if kind == "NodePort":
        cluster_ip, service_port = client.host_ip, service["spec"]["ports"][0]["nodePort"]
    else:
        cluster_ip, service_port = service["spec"]["clusterIP"], 80
    proc, port = agent(topology, server, pin_dir, tmp_path / "agent.log")
    served: Counter[str] = Counter()
    stop = threading.Event()
    threads = [echo_server(b, 8080, served, stop) for b in backends]
    try:
        wait_for(lambda: _ready(topology, port), 30, "the agent ready", (tmp_path / "agent.log").read_text)
        ports = [call(client, cluster_ip, service_port) for _ in range(30)]
        wait_for(lambda: _requests_seen(records(topology, port, to_service="shop/web"), ports), 20,
                 "every connection's request drained")
        found = records(topology, port)
        metrics = _get(topology, port, "/metrics")
    finally:
        stop.set()
        for thread in threads:
            thread.join(2)
        proc.terminate()
        proc.wait(20)
    assert sum(served.values()) == 30
    by_port = {r["source"]["port"]: r for r in found
               if r["source"]["ip"] == client.ip and r["destination"]["ip"] == cluster_ip}
    assert set(by_port) == set(ports)
    named: Counter[str] = Counter()
    for record in by_port.values():
        destination = record["destination"]
        assert destination["service"] == {"namespace": "shop", "name": "web"}
        assert destination["port"] == service_port and destination["world"] is False  # the wire's
        named[next(b.ip for i, b in enumerate(backends) if destination["pod"] == f"web-{i}")] += 1
    assert named == served, "each connection named by the backend that served it"
    replies = [r for r in found if r["source"]["ip"] == cluster_ip and r["destination"]["ip"] == client.ip]
    assert replies and all(r["source"]["service"] == {"namespace": "shop", "name": "web"}
                           and r["source"]["pod"].startswith("web-") for r in replies)
    assert not [r for r in found if r["destination"]["world"] and r["destination"]["ip"] == cluster_ip]
    pairs = [line for line in metrics.splitlines() if line.startswith("podmeter_workload_flow_bytes_total{")]
    assert any('destination_workload="web-' in line for line in pairs), pairs
    assert not [line for line in pairs if '"world"' in line], "no Service traffic counted as the world's"
    # The per-Service series count the same packets as the pairs, and the connections opened.
    requests = sum(_value(line) for line in pairs if 'source_workload="client"' in line and '"web-' in line)
    replies = sum(_value(line) for line in pairs if 'destination_workload="client"' in line and '"web-' in line)
    service = [line for line in metrics.splitlines() if line.startswith("podmeter_service_")]
    labels = 'service_namespace="shop",service="web",client_namespace="shop"'
    assert requests > 30 * PAYLOAD and replies > 30 * PAYLOAD
    assert sum(_value(line) for line in service if line.startswith("podmeter_service_bytes_total{") and labels in line
               and 'direction="request"' in line) == requests
    assert sum(_value(line) for line in service if line.startswith("podmeter_service_bytes_total{") and labels in line
               and 'direction="reply"' in line) == replies
    assert sum(_value(line) for line in service if line.startswith("podmeter_service_connections_total{")) == 30


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def _get(topology: Topology, port: int, path: str) -> str:
    with topology.in_host(), urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return str(answer.read().decode())


def _ready(topology: Topology, port: int) -> bool:
    try:
        _get(topology, port, "/readyz")
    except OSError:
        return False
    return True


def _requests_seen(found: list[dict[str, Any]], ports: list[int]) -> bool:
    return {r["source"]["port"] for r in found} >= set(ports)
