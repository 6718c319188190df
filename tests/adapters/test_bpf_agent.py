"""`podmeter agent --datapath ebpf` end to end: lab API server, real agent processes, pinned maps, packets.

Everything runs inside a private netns (the lab API server's thread, the agents via nsenter, which
unlike `ip netns exec` keeps /sys/fs/bpf visible), so the agents attach only to this test's veths.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agent_harness import Cluster, wait_for
from bpf_support import Sender, Topology, get_in_host, needs_root, needs_tcx, udp_echo
from lab_server import LabServer
from metrics_support import metric
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.model.datapath import Direction, Traffic

pytestmark = needs_root

GHOST, NEWCOMER = "10.99.0.7", "10.99.0.8"  # pods without interfaces: only the filter sees them


class Agents:
    """Starts `podmeter agent` processes in the host netns; kills whatever is left at the end."""

    def __init__(self, topology: Topology, server: LabServer, pins: Path, logs: Path) -> None:
        self.topology, self.server, self.pins, self.logs = topology, server, pins, logs
        self.running: list[subprocess.Popen[bytes]] = []
        self.port = 0  # the last agent's HTTP port (in the host netns)

    def start(self) -> subprocess.Popen[bytes]:
        self.port = free_port(self.topology)
        argv = ["nsenter", f"--net={self.topology.host_path}", "--", sys.executable, "-m", "podmeter",
                "agent", "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(self.pins),
                "--filter-map-size", "64", "--listen", f"127.0.0.1:{self.port}", "--metrics-min-interval", "0.1"]
        env = {**os.environ, "KUBECONFIG": str(self.server.kubeconfig)}
        log = open(self.logs / f"agent-{len(self.running)}.log", "wb")  # noqa: SIM115 (closed by the child)
        with log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.running.append(proc)
        return proc

    def log(self) -> str:
        return "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(self.logs.glob("*.log")))

    def kill_all(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def free_port(topology: Topology) -> int:
    """A TCP port free in the host netns (bound and released)."""
    with topology.in_host(), socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(pins: Path) -> tuple[set[str], dict[tuple[str, Direction], Traffic]]:
    """What the kernel holds, read from this (separate) process."""
    try:
        with EbpfDatapath.open_pinned(pins) as reader:
            return reader.contents(), reader.read_counters()
    except OSError:
        return set(), {}


def test_agent_keeps_the_kernel_map_equal_to_desired_across_a_sigkill(
    topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path
) -> None:
    web, db = topology.add_pod(), topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.namespace("quiet")
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "ghost", GHOST)
        cluster.pod("quiet", "db", db.ip)
    agents = Agents(topology, server, pin_dir, tmp_path)
    sizes = [10, 200, 1000]
    one_round = Traffic(len(sizes), sum(size + 42 for size in sizes))
    try:
        first = agents.start()
        wait_for(lambda: pinned(pin_dir)[0] == {web.ip, GHOST}, 30, "filter == {web, ghost}", agents.log)
        udp_echo(topology, web, sizes)
        udp_echo(topology, db, sizes)
        assert pinned(pin_dir)[1] == {(web.ip, Direction.EGRESS): one_round, (web.ip, Direction.INGRESS): one_round}

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with topology.in_host():  # meanwhile: one observed pod goes, another comes
            cluster.delete_pod("shop", "ghost")
            cluster.pod("shop", "newcomer", NEWCOMER)

        second = agents.start()
        wait_for(lambda: pinned(pin_dir)[0] == {web.ip, NEWCOMER}, 30, "filter == {web, newcomer}", agents.log)
        udp_echo(topology, web, sizes)  # attached again, and counting on from where the first agent was
        twice = Traffic(2 * one_round.packets, 2 * one_round.bytes)
        assert pinned(pin_dir)[1] == {(web.ip, Direction.EGRESS): twice, (web.ip, Direction.INGRESS): twice}

        second.send_signal(signal.SIGTERM)
        assert second.wait(20) == 0, agents.log()
        assert pinned(pin_dir)[0] == {web.ip, NEWCOMER}  # the pins outlive the agent
    finally:
        agents.kill_all()


def attached(agents: Agents) -> float | None:
    try:
        return metric(get_in_host(agents.topology, f"http://127.0.0.1:{agents.port}/metrics").decode(),
                      "podmeter_links_attached")
    except OSError:
        return None


def pod_series(agents: Agents, metric: str) -> float | None:
    """The agent's value of ``metric`` for shop/web's egress (None: no such series, or no answer)."""
    try:
        text = get_in_host(agents.topology, f"http://127.0.0.1:{agents.port}/metrics").decode()
    except OSError:
        return None
    wanted = (metric + "{", 'namespace="shop"', 'pod="web"', 'direction="egress"')
    for line in text.splitlines():
        if all(part in line for part in wanted):
            return float(line.rsplit(" ", 1)[1])
    return None


@needs_tcx
def test_a_sigkilled_agent_loses_no_packet_of_the_gap(
    topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path
) -> None:
    """UDP at 1,000 pps from a pod; SIGKILL the agent, 1 s without one, a new agent: every packet is in the
    kernel's counters and in the pod's series of the new agent, once (the pinned links counted the gap,
    and the new agent credits what it finds to the pod that holds the IP)."""
    web = topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
    agents = Agents(topology, server, pin_dir, tmp_path)
    try:
        first = agents.start()
        wait_for(lambda: pod_series(agents, "podmeter_pod_packets_total") is not None and attached(agents) == 1,
                 30, "web's series and link", agents.log)
        base = pinned(pin_dir)[1].get((web.ip, Direction.EGRESS), Traffic())  # the pod's own (ARP is not counted)
        with Sender(topology, web) as sender:
            time.sleep(0.5)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            time.sleep(1.0)
            agents.start()
            wait_for(lambda: pod_series(agents, "podmeter_pod_packets_total") is not None, 30,
                     "the new agent's series of web", agents.log)
            time.sleep(0.5)
            sender.stop()
        time.sleep(0.1)  # the last datagrams cross the veth
        expected = base + sender.expected()
        assert sender.sent > 1500
        assert pinned(pin_dir)[1][(web.ip, Direction.EGRESS)] == expected
        wait_for(lambda: pod_series(agents, "podmeter_pod_packets_total") == expected.packets, 10,
                 f"web's packets == {expected.packets}", agents.log)
        assert pod_series(agents, "podmeter_pod_bytes_total") == expected.bytes
    finally:
        agents.kill_all()
