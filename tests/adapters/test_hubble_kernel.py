"""The Hubble API on real traffic: `podmeter agent --datapath ebpf --hubble-listen unix://...`, netns pods, packets.

The lab API server and the agent run in a private netns (as tests/adapters/test_bpf_agent.py does); the agent drains
the kernel's flows every 0.3 s, and a client built from the project's definitions reads them over the
agent's Unix socket: ``follow`` streams the pod's flows as they are drained, ``number=N`` returns the last
N in order, the filters select real flows, ServerStatus counts them, the health check answers, and with
TLS a client certificate is required. The pod's lookups to a real DNS server (dnsmasq) come back as L7 DNS
flows, with their names and response codes, through `--protocol dns`, `--type l7` and the pod filters.
The checks that count flows select the test's UDP: whatever else the kernel or the machine sends through
the pods' links (drops included) may be there too.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from agent_harness import Cluster
from bpf_support import Pod, Topology, needs_root
from dns_support import AAAA, A, Dnsmasq, ask_from, message
from hubble_support import Certificates, Client, make_certificates
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.hubble.proto import flow_pb2, health_pb2, observer_pb2
from waiting import wait_for

pytestmark = [needs_root, pytest.mark.skipif(not hasattr(EbpfDatapath, "drain_flows"),
                                             reason="the eBPF datapath has no kernel flows (drain_flows) yet")]


class Agent:
    """One `podmeter agent` process in the test's host netns, its Hubble API on a Unix socket."""

    def __init__(self, topology: Topology, server: LabServer, pins: Path, tmp: Path, *tls: str) -> None:
        self.socket = tmp / "hubble.sock"
        self.log_path = tmp / "agent.log"
        with topology.in_host(), socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        argv = ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "agent",
                "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(pins), "--filter-map-size", "64",
                "--listen", f"127.0.0.1:{port}", "--flow-interval", "0.3", "--hubble-listen", f"unix://{self.socket}",
                *tls]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env={**os.environ, "KUBECONFIG": str(server.kubeconfig)},
                                         stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def filtered(pins: Path) -> set[str]:
    try:
        with EbpfDatapath.open_pinned(pins) as reader:
            return reader.contents()
    except OSError:
        return set()


def udp_round(topology: Topology, pod: Pod, size: int) -> int:
    """One datagram from the pod to a host socket and back; returns the pod's port."""
    with topology.in_host():
        host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with netns(pod.netns_path):
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with host, client:
        host.bind((pod.host_ip, 53000))
        client.bind((pod.ip, 0))
        host.settimeout(5)
        client.settimeout(5)
        client.sendto(b"u" * size, host.getsockname())
        data, peer = host.recvfrom(65536)
        host.sendto(data, peer)
        assert client.recvfrom(65536)[0] == data
        return int(client.getsockname()[1])


@pytest.fixture
def node(topology: Topology, server: LabServer) -> tuple[Pod, Pod]:
    web, db = topology.add_pod(), topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.namespace("quiet")
        cluster.pod("shop", "web", web.ip)
        cluster.pod("quiet", "db", db.ip)
    return web, db


def source_filter(**fields: object) -> flow_pb2.FlowFilter:
    return flow_pb2.FlowFilter(**fields)  # type: ignore[arg-type]


async def test_hubble_clients_read_the_kernels_flows_live(
    topology: Topology, server: LabServer, node: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path
) -> None:
    web, db = node
    agent = Agent(topology, server, pin_dir, tmp_path)
    try:
        wait_for(lambda: filtered(pin_dir) == {web.ip} and agent.socket.exists(), 30, "the agent's filter and socket",
                 agent.log)
        async with Client(f"unix://{agent.socket}") as client:
            health = await client.health.Check(health_pb2.HealthCheckRequest(service="hubble.server.Observer"),
                                               timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            follow = client.observer.GetFlows(observer_pb2.GetFlowsRequest(
                follow=True, whitelist=[source_filter(source_pod=["shop/web"], protocol=["udp"])]))
            await asyncio.sleep(0.5)  # the follower subscribes
            pod_ports = []
            for size in (10, 200, 1000):
                pod_ports.append(udp_round(topology, web, size))
                udp_round(topology, db, size)  # neither end observed: no flow
                time.sleep(0.05)  # a coarse clock tick apart: the three flows' times are ordered
            streamed = [await asyncio.wait_for(follow.read(), 15) for _ in range(3)]
            follow.cancel()
            assert sorted(r.flow.l4.UDP.source_port for r in streamed) == sorted(pod_ports)
            first = streamed[0].flow
            assert (first.source.namespace, first.source.pod_name) == ("shop", "web")
            assert [(w.kind, w.name) for w in first.source.workloads] == [("Pod", "web")]
            assert "k8s:app=web" in first.source.labels
            assert (first.IP.source, first.IP.destination, first.IP.ipVersion) == (web.ip, web.host_ip, flow_pb2.IPv4)
            assert first.l4.UDP.destination_port == 53000 and first.node_name == "node-a"
            assert (first.traffic_direction, first.trace_observation_point) == (flow_pb2.EGRESS, flow_pb2.FROM_ENDPOINT)
            assert (first.verdict, first.Type, first.destination.identity) == (flow_pb2.FORWARDED, flow_pb2.L3_L4, 2)

            # the last N, in order
            last = await client.flows(number=2, whitelist=[source_filter(source_pod=["shop/"], protocol=["udp"])])
            assert [r.flow.l4.UDP.source_port for r in last] == pod_ports[1:]
            everything = await client.flows(number=100_000)
            times = [(r.flow.time.seconds, r.flow.time.nanos) for r in everything]
            assert times == sorted(times)
            udp = await client.flows(number=100, whitelist=[source_filter(protocol=["udp"])])
            assert len(udp) == 6  # 3 rounds, seen leaving and entering the pod

            # filters on real flows
            entering = await client.flows(number=100, whitelist=[source_filter(destination_pod=["shop/web"],
                                                                                protocol=["udp"])])
            assert sorted(r.flow.l4.UDP.destination_port for r in entering) == sorted(pod_ports)
            assert all(r.flow.traffic_direction == flow_pb2.INGRESS for r in entering)
            assert await client.flows(number=100, whitelist=[source_filter(protocol=["sctp"])]) == []
            assert len(await client.flows(number=100, whitelist=[source_filter(source_port=[str(pod_ports[0])])])) == 1
            to_web = source_filter(destination_ip=[f"{web.ip}/32"], protocol=["udp"])
            assert len(await client.flows(number=100, whitelist=[to_web])) == 3
            assert len(await client.flows(number=100, whitelist=[source_filter(protocol=["udp"])],
                                          blacklist=[source_filter(source_label=["app=web"])])) == 3
            assert await client.flows(number=100, whitelist=[source_filter(source_pod=["quiet/"])]) == []

            status = await client.observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=10)
            assert status.seen_flows >= len(everything) >= 6
            assert status.max_flows == 2 * 8192  # the flows' ring and the DNS records'

            assert status.num_flows == status.seen_flows  # the ring has not overflowed: it holds every flow
            assert status.num_connected_nodes.value == 1
        agent.stop()
        assert agent.proc.returncode == 0, agent.log()
        assert not agent.socket.exists()  # the socket goes with the agent
    finally:
        agent.stop()


async def test_the_pods_dns_lookups_are_l7_dns_flows(
    topology: Topology, server: LabServer, node: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path
) -> None:
    web, _ = node
    resolver = Dnsmasq(topology.host_path, web.host_ip)
    agent = Agent(topology, server, pin_dir, tmp_path)
    cart, gone, elsewhere = "cart.shop.svc.cluster.local.", "gone.nxdomain.test.", "elsewhere.example."
    req, resp = flow_pb2.REQUEST, flow_pb2.RESPONSE
    expected = {(req, cart, "A", 0), (resp, cart, "A", 0), (req, gone, "AAAA", 0), (resp, gone, "AAAA", 3),
                (req, elsewhere, "A", 0), (resp, elsewhere, "A", 5)}  # dnsmasq: NXDOMAIN, REFUSED

    def seen(responses: list[observer_pb2.GetFlowsResponse]) -> set[tuple[int, str, str, int]]:
        return {(r.flow.l7.type, r.flow.l7.dns.query, *r.flow.l7.dns.qtypes, r.flow.l7.dns.rcode) for r in responses}

    try:
        resolver.start()
        wait_for(lambda: filtered(pin_dir) == {web.ip} and agent.socket.exists(), 30, "the agent's filter and socket",
                 agent.log)
        async with Client(f"unix://{agent.socket}") as client:
            follow = client.observer.GetFlows(observer_pb2.GetFlowsRequest(
                follow=True, whitelist=[source_filter(protocol=["dns"])]))
            await asyncio.sleep(0.5)  # the follower subscribes
            for ident, (name, qtype) in enumerate([(cart, A), (cart, A), (gone, AAAA), (elsewhere, A)]):
                assert ask_from(web, resolver.address, message(ident, name, qtype)) is not None
            streamed: list[observer_pb2.GetFlowsResponse] = []
            while seen(streamed) != expected:  # a drain may split the two lookups of cart: then it is there twice
                assert len(streamed) < 20, seen(streamed)
                streamed.append(await asyncio.wait_for(follow.read(), 15))
            follow.cancel()
            flow = next(r.flow for r in streamed if r.flow.l7.dns.rcode == 3)
            assert (flow.Type, flow.event_type.type, flow.verdict) == (flow_pb2.L7, 129, flow_pb2.FORWARDED)
            assert flow.Summary == "DNS Answer RCode: NXDOMAIN (Query gone.nxdomain.test. AAAA)"
            assert flow.is_reply.value and flow.l7.latency_ns > 0 and flow.l7.dns.observation_source == "podmeter"
            assert (flow.IP.source, flow.IP.destination) == (resolver.address, web.ip)
            assert (flow.destination.namespace, flow.destination.pod_name, flow.source.identity) == ("shop", "web", 2)
            assert flow.l4.UDP.source_port == 53 and flow.traffic_direction == flow_pb2.INGRESS

            past = await client.flows(number=100, whitelist=[source_filter(protocol=["dns"])])
            assert seen(past) == expected
            l7 = await client.flows(number=100, whitelist=[source_filter(
                event_type=[flow_pb2.EventTypeFilter(type=129)], verdict=[flow_pb2.FORWARDED])])
            assert seen(l7) == expected
            asked = await client.flows(number=100, whitelist=[source_filter(source_pod=["shop/web"],
                                                                            protocol=["dns"])])
            assert {r.flow.Summary for r in asked} == {"DNS Query cart.shop.svc.cluster.local. A",
                                                      "DNS Query gone.nxdomain.test. AAAA",
                                                      "DNS Query elsewhere.example. A"}
            assert await client.flows(number=100, whitelist=[source_filter(source_pod=["quiet/"],
                                                                           protocol=["dns"])]) == []
            assert await client.flows(number=100, whitelist=[source_filter(
                protocol=["dns"], verdict=[flow_pb2.DROPPED])]) == []
            flows_only = await client.flows(number=100, blacklist=[source_filter(protocol=["dns"])])
            assert all(r.flow.Type == flow_pb2.L3_L4 for r in flows_only)
        agent.stop()
        assert agent.proc.returncode == 0, agent.log()
    finally:
        agent.stop()
        resolver.stop()


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    return make_certificates(tmp_path / "certs")


async def test_with_tls_the_agent_requires_a_client_certificate(
    topology: Topology, server: LabServer, node: tuple[Pod, Pod], pin_dir: Path, tmp_path: Path,
    certificates: Certificates,
) -> None:
    web, _ = node
    agent = Agent(topology, server, pin_dir, tmp_path, "--hubble-tls-cert", str(certificates.server_cert),
                  "--hubble-tls-key", str(certificates.server_key), "--hubble-tls-client-ca", str(certificates.ca))
    try:
        wait_for(lambda: filtered(pin_dir) == {web.ip} and agent.socket.exists(), 30, "the agent's filter and socket",
                 agent.log)
        port = udp_round(topology, web, 100)
        target = f"unix://{agent.socket}"
        async with Client(target, certificates) as client:
            for _ in range(50):
                got = await client.flows(number=10, whitelist=[source_filter(protocol=["udp"])])
                if len(got) == 2:
                    break
                await asyncio.sleep(0.1)
            assert sorted(p for r in got for p in (r.flow.l4.UDP.source_port, r.flow.l4.UDP.destination_port)
                          if p != 53000) == [port, port]
        for refused in (Client(target, certificates, client_cert=False), Client(target)):
            async with refused:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await refused.flows(number=10, timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        agent.stop()
