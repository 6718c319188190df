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
from pathlib import Path

from agent_harness import Cluster, wait_for
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.model.datapath import Direction, Traffic
from test_bpf_netns import udp_echo
from bpf_support import Topology, needs_root

pytestmark = needs_root

GHOST, NEWCOMER = "10.99.0.7", "10.99.0.8"  # pods without interfaces: only the filter sees them


class Agents:
    """Starts `podmeter agent` processes in the host netns; kills whatever is left at the end."""

    def __init__(self, topology: Topology, server: LabServer, pins: Path, logs: Path) -> None:
        self.topology, self.server, self.pins, self.logs = topology, server, pins, logs
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        argv = ["nsenter", f"--net={self.topology.host_path}", "--", sys.executable, "-m", "podmeter",
                "agent", "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(self.pins),
                "--filter-map-size", "64", "--listen", f"127.0.0.1:{free_port(self.topology)}"]
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
