"""`podmeter agent --datapath ebpf` with drops and TCP health, end to end (root): lab API server, a real agent
process, netns pods, induced drops and loss; /metrics, /debug/flows and `podmeter observe --verdict dropped`.
And an agent on a kernel without the tracepoint or BTF (simulated): a notice, drops off, ready anyway.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent_harness import Cluster, wait_for
from bpf_support import Topology, needs_root
from drop_support import AgentProcess, lossy_link, nft, routed_pod, send, udp_socket, unread, upload, warm
from lab_server import LabServer

pytestmark = needs_root


def test_induced_drops_and_loss_reach_metrics_records_and_observe(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    web, client, quiet = routed_pod(topology, None), routed_pod(topology, None), routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.namespace("quiet")
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "client", client.ip)
        cluster.pod("quiet", "other", quiet.ip)
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log")
    try:
        wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
        wait_for(lambda: agent.metric('podmeter_drop_tracing_enabled{hook="kfree_skb"}') == 1, 10, "drops on",
                 agent.log)
        wait_for(lambda: client.ip in json.loads(agent.get("/debug/state")[1])["filter"]["actual"], 10, "filter")
        warm(client, web)
        warm(quiet, web)
        nft(web, "in udp dport 9998 drop")
        with udp_socket(client) as sock:
            send(sock, (web.ip, 9998), 6)
        with udp_socket(quiet) as sock:
            send(sock, (web.ip, 9998), 4)  # from an unobserved pod: counted for web only

        web_in = 'podmeter_pod_drops_total{namespace="shop",pod="web",direction="ingress",reason="NETFILTER_DROP"}'
        client_out = ('podmeter_pod_drops_total{namespace="shop",pod="client",direction="egress",'
                      'reason="NETFILTER_DROP"}')
        wait_for(lambda: agent.metric(re.escape(web_in)) == 10, 10, "web's drops", agent.log)
        assert agent.metric(re.escape(client_out)) == 6
        assert agent.metric(r'podmeter_pod_drops_total\{namespace="quiet"[^}]*\}') is None

        # Loss on the client's link: the client retransmits, the web pod does not.
        lossy_link(topology, client, "meta l4proto tcp ip length > 100 numgen random mod 4 0 drop")
        client_port, web_port = upload(client, web, 2_000_000)
        wait_for(lambda: (agent.metric(r'podmeter_pod_tcp_retransmits_total\{namespace="shop",pod="client"\}') or 0)
                 > 0, 10, "client retransmits", agent.log)
        assert agent.metric(r'podmeter_pod_tcp_retransmits_total\{namespace="shop",pod="web"\}') == 0

        records = [json.loads(line) for line in agent.get("/debug/flows?last=100000")[1].splitlines()]
        dropped = [r for r in records if r["verdict"] == "dropped" and r["destination"]["port"] == 9998]
        assert sum(r["packets"] for r in dropped) == 10
        assert {(r["source"]["pod"], r["destination"]["pod"], r["drop_reason"], r["observation"]) for r in dropped} == {
            ("client", "web", "NETFILTER_DROP", "from-pod"), ("other", "web", "NETFILTER_DROP", "to-pod")}
        retransmitted = [r for r in records if r["verdict"] == "forwarded" and r["protocol"] == "TCP"
                         and r["source"]["port"] == client_port and r["destination"]["port"] == web_port]
        assert sum(r["tcp_retransmits"] for r in retransmitted) > 0
        assert {r["observation"] for r in retransmitted if r["tcp_retransmits"]} == {"from-pod"}

        observe = subprocess.run(
            ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "observe", "--server",
             f"127.0.0.1:{agent.port}", "--verdict", "dropped", "--last", "1000", "--port", "9998", "-o", "json"],
            capture_output=True, text=True, timeout=30, check=True)
        shown = [json.loads(line) for line in observe.stdout.splitlines()]
        assert shown and all(r["verdict"] == "dropped" and r["drop_reason"] == "NETFILTER_DROP" for r in shown)
        assert sum(r["packets"] for r in shown) == 10

        # A connection closed with data unread (QUEUE_PURGE): a lifecycle drop of both pods, no drop, no record.
        lifecycle_in = ('podmeter_pod_lifecycle_drops_total{namespace="shop",pod="web",direction="ingress",'
                        'reason="QUEUE_PURGE"}')
        with unread(client, web, size=40):  # small enough for the lossy rule above (ip length > 100) to spare
            wait_for(lambda: (agent.metric(re.escape(lifecycle_in)) or 0) >= 1, 10, "web's lifecycle drop", agent.log)
        purged = agent.metric(re.escape(lifecycle_in))
        assert agent.metric(re.escape(lifecycle_in.replace("web", "client").replace("ingress", "egress"))) == purged
        assert agent.metric(r'podmeter_pod_drops_total\{[^}]*reason="QUEUE_PURGE"\}') is None
        assert agent.metric(r'podmeter_node_drops_total\{[^}]*reason="QUEUE_PURGE"\}') is None
        assert agent.metric(re.escape('podmeter_node_lifecycle_drops_total{direction="ingress",'
                                      'reason="QUEUE_PURGE"}')) == purged
        records = [json.loads(line) for line in agent.get("/debug/flows?last=100000&verdict=dropped")[1].splitlines()]
        assert records and not [r for r in records if r["drop_reason"] == "QUEUE_PURGE"]

        with topology.in_host():  # the pod goes: its series go after the grace
            cluster.delete_pod("shop", "web")
        wait_for(lambda: agent.metric(re.escape(web_in)) is None, 10, "web's series gone", agent.log)
        assert agent.metric(re.escape('podmeter_node_drops_total{direction="ingress",reason="NETFILTER_DROP"}')) >= 10
    finally:
        agent.stop()


@pytest.mark.parametrize("simulate", ["no-btf", "no-kfree_skb"])
def test_a_kernel_without_the_tracepoint_or_btf_gets_a_notice_and_an_agent_without_drops(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path, simulate: str) -> None:
    web = routed_pod(topology, None)
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
    agent = AgentProcess(topology, server, pin_dir, tmp_path / "agent.log", simulate)
    try:
        wait_for(lambda: agent.get("/readyz")[0] == 200, 30, "agent ready", agent.log)
        assert agent.metric('podmeter_drop_tracing_enabled{hook="kfree_skb"}') == 0
        tcp_on = 0 if simulate == "no-btf" else 1
        assert agent.metric('podmeter_drop_tracing_enabled{hook="tcp_retransmit_skb"}') == tcp_on
        log = agent.log()
        if simulate == "no-btf":
            assert "drops and TCP health are off, the agent runs without them: cannot read the kernel's BTF at " \
                   "/nonexistent/vmlinux" in log
        else:
            assert "tracepoint skb:kfree_skb_gone is not in this kernel" in log
        nft(web, "in udp dport 9998 drop")
        with topology.in_host():
            host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with host:
            send(host, (web.ip, 9998), 3)
        received = r'podmeter_pod_packets_total\{namespace="shop",pod="web",direction="ingress"[^}]*\}'
        wait_for(lambda: (agent.metric(received) or 0) >= 3, 10, "traffic still counted", agent.log)
        assert agent.metric(r"podmeter_pod_drops_total\{[^}]*\}") is None
        assert agent.proc.poll() is None
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log()
