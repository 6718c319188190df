"""Hubble's metrics of a real agent (root): `podmeter agent --datapath ebpf --hubble-metrics-server ...
--hubble-metrics ...`, netns pods, TCP and UDP traffic and netfilter drops, scraped over HTTP on their own
listener, linted by Debian's `promtool check metrics`; a deleted pod's series gone after the grace."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from agent_harness import Cluster, wait_for
from bpf_support import Topology, needs_root
from drop_support import AgentProcess, nft, routed_pod, send, udp_socket, upload, warm
from lab_server import LabServer

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = [needs_root, pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool missing")]
METRICS = ("drop tcp port-distribution icmp flows-to-world:any-drop "
           "flow:sourceContext=pod|reserved-identity;destinationContext=pod|reserved-identity;"
           "labelsContext=source_namespace,destination_namespace,traffic_direction")
SAMPLE = re.compile(r"(?P<name>[a-z_]+)\{(?P<labels>.*)\} (?P<value>\S+)")


def free_port(topology: Topology) -> int:
    with topology.in_host(), socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(topology: Topology, port: int) -> str:
    with topology.in_host(), urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return str(response.read().decode())


def samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    out = {}
    for line in text.splitlines():
        found = SAMPLE.fullmatch(line)
        if found and found["name"] == name:
            out[frozenset(re.findall(r'(\w+)="([^"]*)"', found["labels"]))] = float(found["value"])
    return out


def total(text: str, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for k, v in samples(text, name).items() if wanted <= k)


def test_a_real_agents_hubble_metrics_count_its_traffic_and_drops_and_lint_clean(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    web, client = routed_pod(topology, None), routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "client", client.ip)
    port = free_port(topology)
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log",
                         args=["--hubble-metrics-server", f"127.0.0.1:{port}", "--hubble-metrics", METRICS])
    try:
        wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
        wait_for(lambda: {web.ip, client.ip} <= set(json.loads(agent.get("/debug/state")[1])["filter"]["actual"]),
                 10, "filter")
        warm(client, web)
        upload(client, web, 200_000)  # TCP: a handshake, data, FINs
        nft(web, "in udp dport 9998 drop")
        with udp_socket(client) as sock:
            send(sock, (web.ip, 9998), 6)
        flows = "hubble_flows_processed_total"

        def dropped() -> float:
            return total(scrape(topology, port), "hubble_drop_total", reason="POLICY_DENIED", protocol="UDP")

        def into_web(text: str) -> float:
            return total(text, flows, verdict="FORWARDED", protocol="TCP", destination="shop/web",
                         subtype="to-endpoint", traffic_direction="ingress")

        wait_for(lambda: dropped() >= 6, 15, "the netfilter drops as POLICY_DENIED", agent.log)
        # The drops and the upload's flows reach the metrics with the drains that take them, not together.
        wait_for(lambda: into_web(scrape(topology, port)) > 0, 15, "the upload's flows", agent.log)
        text = scrape(topology, port)
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
        # Every packet web received was seen entering it: the upload's segments among them.
        assert into_web(text) >= 200_000 / 65536
        assert total(text, flows, verdict="DROPPED", type="Drop", source="shop/client",
                     destination="shop/web") >= 6
        assert total(text, "hubble_tcp_flags_total", flag="SYN", family="IPv4") >= 1
        assert total(text, "hubble_tcp_flags_total", flag="SYN-ACK", family="IPv4") >= 1
        assert total(text, "hubble_tcp_flags_total", flag="FIN") >= 2
        assert total(text, "hubble_port_distribution_total", protocol="TCP") > 0
        assert "podmeter_hubble_metrics_series" in agent.get("/metrics")[1]
        assert "hubble_flows_processed_total" not in agent.get("/metrics")[1]  # on their own listener only

        with topology.in_host():
            cluster.delete_pod("shop", "client")
        wait_for(lambda: not [k for k in samples(scrape(topology, port), flows)
                              if ("source", "shop/client") in k or ("destination", "shop/client") in k],
                 15, "client's series gone after the grace", agent.log)
        assert dropped() >= 6  # series that name no pod stay
    finally:
        agent.stop()


def test_a_refused_hubble_metric_stops_the_agent_with_exit_2(topology: Topology, server: LabServer,
                                                             pin_dir: Path, tmp_path: Path) -> None:
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log",
                         args=["--hubble-metrics-server", "127.0.0.1:0",
                               "--hubble-metrics", "flow:sourceContext=identity"])
    assert agent.proc.wait(30) == 2
    assert "sourceContext 'identity' of flow is not supported by podmeter" in agent.log()
