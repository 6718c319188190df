"""Drops and TCP health in the kernel tests (no tests here): what a drop tracer drained (:class:`Drained`),
routed pods and the drops and loss induced between them (nft rules, a lossy link, an unread connection), and
`podmeter agent` processes in the topology's host netns (:class:`AgentProcess`, also on a simulated kernel
without the tracepoint or BTF).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bpf_support import Pod, Topology, run
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf.drops import DropTracer
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.model.datapath import Direction
from podmeter.model.drops import DropDrain, TcpEvent
from waiting import stop_process


class Drained:
    """Everything drained so far, added up: drops by (ip, direction, reason), TCP events by (ip, event),
    dropped flows by (src, dst, sport, dport, protocol, reason), retransmits by connection."""

    def __init__(self, tracer: DropTracer) -> None:
        self.tracer = tracer
        self.drops: Counter[tuple[str, Direction, str]] = Counter()
        self.tcp: Counter[tuple[str, TcpEvent]] = Counter()
        self.flows: Counter[tuple[str, str, int, int, int, str]] = Counter()
        self.retransmits: Counter[tuple[str, str, int, int]] = Counter()

    def drain(self) -> DropDrain:
        taken = self.tracer.drain_drops()
        for key, packets in taken.drops:
            self.drops[tuple(key)] += packets  # type: ignore[index]
        for event, count in taken.tcp:
            self.tcp[event] += count
        for flow, counts in taken.flows:
            self.flows[flow.source, flow.destination, flow.source_port, flow.destination_port, flow.protocol,
                       flow.reason] += counts.packets
        for conn, count in taken.retransmits:
            self.retransmits[tuple(conn)] += count  # type: ignore[index]
        return taken

    def until(self, condition: Callable[[Drained], bool], timeout: float = 5.0) -> Drained:
        """Drain until ``condition`` holds, then once more after a pause (nothing may follow)."""
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            if condition(self) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        time.sleep(0.1)
        self.drain()
        return self


# --- pods, and drops and loss between them --------------------------------------------------------------


def routed_pod(topology: Topology, datapath: EbpfDatapath | None, *, ipv6: bool = False) -> Pod:
    """A pod whose default route is the host, which forwards between pods; observed if ``datapath``."""
    pod = topology.add_pod(ipv6=ipv6)
    run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)
    if datapath is not None:
        assert datapath.insert([pod.ip] + ([pod.ip6] if pod.ip6 else [])).error is None
    return pod


def nft(pod: Pod, *rules: str) -> None:
    """A table of this test in the pod's netns: input and output chains, then ``rules`` ("in ...")."""
    script = ["add table inet pmtest", "add chain inet pmtest in { type filter hook input priority 0; }",
              "add chain inet pmtest out { type filter hook output priority 0; }"]
    script += [f"add rule inet pmtest {rule}" for rule in rules]
    run("ip", "netns", "exec", pod.netns, "nft", "; ".join(script))


def lossy_link(topology: Topology, pod: Pod, rule: str) -> None:
    """Loss on the pod's link: a rule on the host side of its veth (netdev ingress: what the pod sends).
    Its sockets see the loss as the network's: what their stack handed over is lost after it (a rule in
    the pod's own output chain fails the send instead, which TCP does not retransmit)."""
    run("ip", "netns", "exec", topology.host, "nft",
        f"add table netdev pmloss{pod.host_veth}; add chain netdev pmloss{pod.host_veth} c "
        f"{{ type filter hook ingress device {pod.host_veth} priority 0; }}; "
        f"add rule netdev pmloss{pod.host_veth} c {rule}")


def udp_socket(pod: Pod, family: int = socket.AF_INET) -> socket.socket:
    with netns(pod.netns_path):
        return socket.socket(family, socket.SOCK_DGRAM)


def send(sock: socket.socket, target: tuple[str, int], count: int, size: int = 100) -> None:
    """``count`` datagrams; one a netfilter rule of the sender's own output drops fails with EPERM."""
    for _ in range(count):
        with contextlib.suppress(PermissionError):
            sock.sendto(b"d" * size, target)


def warm(client: Pod, server: Pod) -> None:
    """One datagram each way on an open port, so both neighbours are resolved (a packet that waits for
    ARP is queued, and a queue overflowing would be a drop of another reason)."""
    with udp_socket(server) as listener, udp_socket(client) as sender:
        listener.bind((server.ip, 0))
        listener.settimeout(5)
        sender.settimeout(5)
        sender.sendto(b"hi", listener.getsockname())
        _, peer = listener.recvfrom(100)
        listener.sendto(b"hi", peer)
        sender.recvfrom(100)


def upload(client: Pod, server: Pod, size: int) -> tuple[int, int]:
    """``size`` bytes from the client to a server in the other pod; returns (client port, server port)."""
    with netns(server.netns_path):
        listener = socket.socket()
    with netns(client.netns_path):
        sock = socket.socket()
    received = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                received.append(len(data))

    with listener, sock:
        listener.bind((server.ip, 0))
        listener.listen(1)
        thread = threading.Thread(target=serve)
        thread.start()
        sock.settimeout(60)
        sock.connect(listener.getsockname())
        ports = sock.getsockname()[1], listener.getsockname()[1]
        sock.sendall(b"u" * size)
        sock.shutdown(socket.SHUT_WR)
        thread.join(60)
    assert sum(received) == size
    return ports


@contextlib.contextmanager
def unread(client: Pod, server: Pod, size: int = 100) -> Iterator[tuple[int, int]]:
    """A connection from the client whose ``size`` bytes the server never reads: its listener closes with
    the connection still in its accept queue, so the kernel frees the queued data (QUEUE_PURGE). Yields
    (client port, server port) while the client's socket is still open."""
    with netns(server.netns_path):
        listener = socket.socket()
    with netns(client.netns_path):
        sock = socket.socket()
    with sock:
        with listener:
            listener.bind((server.ip, 0))
            listener.listen(1)
            sock.settimeout(5)
            sock.connect(listener.getsockname())
            ports = sock.getsockname()[1], listener.getsockname()[1]
            sock.sendall(b"q" * size)
            time.sleep(0.2)  # the segment waits in the connection no one accepted
        yield ports


# --- the agent as a process ------------------------------------------------------------------------------

# Runs the agent with the BTF path or a tracepoint name replaced, as on a kernel that lacks them.
SIMULATED = {
    "no-btf": "import podmeter.adapters.datapath.ebpf.btf as btf; btf.VMLINUX = '/nonexistent/vmlinux'",
    "no-kfree_skb": (
        "import podmeter.adapters.datapath.ebpf.drops as d; _open = d.DropTracer.open.__func__; "
        "d.DropTracer.open = classmethod(lambda cls, *a, **k: _open(cls, *a, **{**k, 'tracepoints': "
        "{'kfree_skb': 'kfree_skb_gone'}}))"),
    # The drop tracer as it was before its maps and links were pinned (the reference of the restart tests).
    "unpinned-drops": (
        "import podmeter.adapters.datapath.ebpf.drops as d; _open = d.DropTracer.open.__func__; "
        "d.DropTracer.open = classmethod(lambda cls, *a, **k: _open(cls, *a, **{**k, 'pins': None}))"),
}


class AgentProcess:
    """One `podmeter agent` process in the topology's host netns."""

    def __init__(self, topology: Topology, server: LabServer, pins: Path, log: Path, simulate: str | None = None,
                 args: Sequence[str] = ()):
        """``args``: more options (given last, they override the defaults here)."""
        self.topology, self.log_path = topology, log
        with topology.in_host(), socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        python = [sys.executable, "-c", f"{SIMULATED[simulate]}\nfrom podmeter.cli.main import main\n"
                  "raise SystemExit(main())"] if simulate else [sys.executable, "-m", "podmeter"]
        argv = ["nsenter", f"--net={topology.host_path}", "--", *python, "agent", "--node-name", "node-a",
                "--datapath", "ebpf", "--bpffs", str(pins), "--filter-map-size", "64", "--listen",
                f"127.0.0.1:{self.port}", "--flow-interval", "0.3", "--series-grace", "1",
                "--metrics-min-interval", "0", *args]
        env = {**os.environ, "KUBECONFIG": str(server.kubeconfig)}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        with self.topology.in_host():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                    return response.status, response.read().decode()
            except OSError as error:
                return getattr(error, "code", 0), str(error)

    def metric(self, pattern: str) -> int | None:
        """The value of the first sample matching ``pattern`` (a regex over the sample's name and labels)."""
        status, text = self.get("/metrics")
        if status != 200:
            return None
        for line in text.splitlines():
            if not line.startswith("#") and re.match(pattern + r" ", line):
                return int(float(line.rsplit(" ", 1)[1]))
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_process(self.proc)
