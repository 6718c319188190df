"""What the Service tests through real netns pods share: a real `podmeter agent --datapath ebpf` in the
test's "node" netns, its flow records, metrics and /debug/state, the lab API server's Services and
EndpointSlices, the node's DNAT as kube-proxy's nftables mode writes it (the lab's Service proxy rules),
and the lab's own echo servers and client (``podmeter.lab.servicecheck``) in the pods."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bpf_support import Pod, Topology, run
from lab_server import LabServer
from podmeter.lab.service_proxy import apply, rules, ruleset
from podmeter.lab.servicecheck import Served, call, echo_servers
from podmeter.lab.traffic import Endpoint
from waiting import wait_for

PAYLOAD = 3000  # bytes each connection sends; the backend answers with as many
TARGET_PORT = 8080
SERVICE = {"namespace": "shop", "name": "web"}


def start_agent(topology: Topology, server: LabServer, pins: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
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


@contextlib.contextmanager
def running_agent(topology: Topology, server: LabServer, pins: Path, tmp_path: Path) -> Iterator[int]:
    """The agent, ready; its HTTP port. Stopped and waited at the end."""
    log = tmp_path / "agent.log"
    proc, port = start_agent(topology, server, pins, log)
    try:
        wait_for(lambda: ready(topology, port), 30, "the agent ready", log.read_text)
        yield port
    finally:
        proc.terminate()
        proc.wait(20)


def get(topology: Topology, port: int, path: str) -> str:
    with topology.in_host(), urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return str(answer.read().decode())


def ready(topology: Topology, port: int) -> bool:
    try:
        get(topology, port, "/readyz")
    except OSError:
        return False
    return True


def records(topology: Topology, port: int, **query: str) -> list[dict[str, Any]]:
    text = get(topology, port, "/debug/flows?" + "&".join(f"{k}={v}" for k, v in {"last": "8192", **query}.items()))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def services_state(topology: Topology, port: int) -> dict[str, int]:
    """The agent's Services stores and index sizes (/debug/state)."""
    state: dict[str, int] = json.loads(get(topology, port, "/debug/state"))["services"]
    return state


def routed(topology: Topology, pods: list[Pod], ipv6: bool = False) -> None:
    """The node forwards; each pod's default route leads to it."""
    run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    if ipv6:
        run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    for pod in pods:
        run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)
        if ipv6 and pod.host_ip6 is not None:
            run("ip", "-n", pod.netns, "-6", "route", "add", "default", "via", pod.host_ip6)


def create_service(server: LabServer, kind: str = "ClusterIP", **spec: Any) -> dict[str, Any]:
    status, _, made = server.request("POST", "/api/v1/namespaces/shop/services", {
        "metadata": {"name": "web"},
        "spec": {"type": kind, "ports": [{"name": "http", "port": 80, "targetPort": TARGET_PORT}], **spec}})
    assert status == 201, made
    return dict(made)


def slice_body(addresses: list[str], address_type: str = "IPv4") -> dict[str, Any]:
    return {"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": address_type, "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]}


def create_slice(server: LabServer, addresses: list[str], address_type: str = "IPv4") -> dict[str, Any]:
    status, _, made = server.request("POST", "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices",
                                     slice_body(addresses, address_type))
    assert status == 201, made
    return dict(made)


def set_slice(server: LabServer, addresses: list[str]) -> dict[str, Any]:
    """The slice's endpoints now ``addresses`` (a merge patch replaces the list)."""
    endpoints = slice_body(addresses)["endpoints"]
    status, _, made = server.request("PATCH", "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/web-1",
                                     {"endpoints": endpoints}, "application/merge-patch+json")
    assert status == 200, made
    return dict(made)


def proxy(topology: Topology, services: list[dict[str, Any]], slices: list[dict[str, Any]]) -> None:
    """The node's Service rules now these (kube-proxy's nftables shapes, the lab's proxy)."""
    with topology.in_host():
        apply(ruleset(rules(services, slices)))


def endpoint(pod: Pod, name: str, ipv6: bool = False) -> Endpoint:
    """A test pod as the lab's echo servers and client take it (``name``: what a server records)."""
    return Endpoint(name, (pod.ip6 or pod.ip) if ipv6 else pod.ip, pod.netns_path)


@contextlib.contextmanager
def serving(backends: dict[str, Pod], ipv6: bool = False) -> Iterator[Served]:
    """The lab's echo servers in the backend pods (by the pod name each records its connections under)."""
    served = Served()
    with echo_servers([endpoint(pod, name) for name, pod in backends.items()], TARGET_PORT, PAYLOAD, served, ipv6):
        yield served


def calls(client: Pod, address: str, port: int, count: int) -> list[int]:
    """``count`` connections from ``client``, PAYLOAD bytes there and back each; their client ports."""
    return [call(endpoint(client, "client"), address, port, PAYLOAD) for _ in range(count)]


def requests_of(found: list[dict[str, Any]], client_ip: str, address: str) -> dict[int, dict[str, Any]]:
    """The client's request records (from-pod, forwarded: a drop record is the drop drain's) to ``address``,
    by client port."""
    return {r["source"]["port"]: r for r in found if r["observation"] == "from-pod" and r["verdict"] == "forwarded"
            and r["source"]["ip"] == client_ip and r["destination"]["ip"] == address}


def value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])
