"""Shared fixtures and helpers of the eBPF datapath tests (no tests here): pin directories, netns
topologies, pods attached in both modes (``node``), and traffic through them (``udp_echo``, ``Sender``,
``Capture``).

Everything a fixture creates (pins, namespaces, veths, attachments) is removed in ``finally`` blocks, so
a failing test leaves nothing behind. Names carry the pid and a counter: tests never collide with each
other, with a second test run, or with a lab running on the same machine.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath, preflight
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.model.datapath import Direction, Traffic

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf, netns)")
needs_tcx = pytest.mark.skipif(os.geteuid() != 0 or preflight.kernel_version() < preflight.TCX_KERNEL,
                               reason="TCX links need kernel >= 6.6")
BPFFS = Path("/sys/fs/bpf")
_serial = itertools.count()


def unique(prefix: str) -> str:
    """A short name unique to this process and call (fits an interface name: 15 chars)."""
    name = f"{prefix}{os.getpid() % 100000}x{next(_serial)}"
    assert len(name) <= 15, name
    return name


def remove_pin_dir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    """A fresh pin directory path (not created) inside bpffs; removed with its pins afterwards."""
    path = BPFFS / unique("pmtest")
    try:
        yield path
    finally:
        remove_pin_dir(path)


@pytest.fixture
def open_datapath(pin_dir: Path) -> Iterator[Callable[..., EbpfDatapath]]:
    """Open (load) datapaths on ``pin_dir``; every one opened is closed afterwards."""
    opened: list[EbpfDatapath] = []

    def opener(filter_size: int = 64, **options: Any) -> EbpfDatapath:
        datapath = EbpfDatapath.open(pin_dir, filter_size=filter_size, **options)
        opened.append(datapath)
        return datapath

    try:
        yield opener
    finally:
        for datapath in opened:
            datapath.close()


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@dataclass
class Pod:
    """A pod: its own netns, ``eth0`` inside, the host side of its veth in the host netns."""

    netns: str
    host_veth: str
    ip: str
    host_ip: str
    ip6: str | None = None  # set when the pod has IPv6 too
    host_ip6: str | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


@dataclass
class Topology:
    """A host netns (standing in for the node's root netns) with pods wired to it by veth pairs.

    Working in a private host netns keeps the tests away from interfaces of the real host (and of a
    lab running on it), and vice versa. IPv6 is disabled everywhere so the only traffic is the test's.
    """

    host: str = field(default_factory=lambda: unique("pmh"))
    pods: list[Pod] = field(default_factory=list)
    _subnets: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def host_path(self) -> str:
        return f"/run/netns/{self.host}"

    def create(self) -> None:
        run("ip", "netns", "add", self.host)
        self._disable_ipv6(self.host, "default")
        run("ip", "-n", self.host, "link", "set", "lo", "up")

    def add_pod(self, ipv6: bool = False, host_veth: str | None = None) -> Pod:
        """A pod with IPv4; with ``ipv6`` also IPv6 (and then the kernel's own ND/MLD traffic).
        ``host_veth``: the name of the host side (default ``pm...``, as the lab's node names them)."""
        n = next(self._subnets)
        pod = Pod(unique("pmp"), host_veth or unique("pm"), f"10.231.{n}.2", f"10.231.{n}.1")
        if ipv6:
            pod.ip6, pod.host_ip6 = f"fd00:231:{n}::2", f"fd00:231:{n}::1"
        run("ip", "netns", "add", pod.netns)
        self.pods.append(pod)
        self._disable_ipv6(pod.netns, "default")
        run("ip", "-n", self.host, "link", "add", pod.host_veth, "type", "veth", "peer", "name", "eth0",
            "netns", pod.netns)
        self._disable_ipv6(self.host, pod.host_veth, not ipv6)
        self._disable_ipv6(pod.netns, "eth0", not ipv6)
        if pod.ip6 is not None:
            run("ip", "-n", self.host, "addr", "add", f"{pod.host_ip6}/64", "dev", pod.host_veth, "nodad")
            run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip6}/64", "dev", "eth0", "nodad")
        run("ip", "-n", self.host, "addr", "add", f"{pod.host_ip}/24", "dev", pod.host_veth)
        run("ip", "-n", self.host, "link", "set", pod.host_veth, "up")
        run("ip", "-n", pod.netns, "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        run("ip", "-n", pod.netns, "link", "set", "eth0", "up")
        run("ip", "-n", pod.netns, "link", "set", "lo", "up")
        return pod

    def destroy(self) -> None:
        for name in [self.host, *(pod.netns for pod in self.pods)]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    def in_host(self) -> contextlib.AbstractContextManager[None]:
        return netns(self.host_path)

    def free_port(self) -> int:
        """A loopback TCP port free in the host netns (for a process about to listen there)."""
        with self.in_host(), socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    @staticmethod
    def _disable_ipv6(namespace: str, device: str, disable: bool = True) -> None:
        setting = f"net.ipv6.conf.{device}.disable_ipv6={int(disable)}"
        run("ip", "netns", "exec", namespace, "sysctl", "-qw", setting)


@pytest.fixture
def topology() -> Iterator[Topology]:
    topo = Topology()
    try:
        topo.create()
        yield topo
    finally:
        topo.destroy()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (a file system that fills), unmounted after the test (root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def server(topology: Topology) -> Iterator[LabServer]:
    """The lab API server on a thread that lives in the test's host netns (agents started in that netns
    reach it on its loopback)."""
    with topology.in_host():
        lab = LabServer(process=False)
        lab.start()
    try:
        yield lab
    finally:
        lab.stop()


# --- traffic through the topology -----------------------------------------------------------------------

UDP_HEADERS = 14 + 20 + 8  # Ethernet, IPv4, UDP: what a datagram adds to its payload on the wire
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


@dataclass
class Node:
    """Two pods of the ``topology``, both attached (the ``node`` fixture: TCX and tc), one observed."""

    datapath: EbpfDatapath
    manager: AttachManager
    observed: Pod
    unobserved: Pod


@pytest.fixture(params=[AttachMode.TCX, AttachMode.TC], ids=["tcx", "tc"])
def node(request: pytest.FixtureRequest, topology: Topology,
         open_datapath: Callable[..., EbpfDatapath]) -> Iterator[Node]:
    datapath = open_datapath(64)
    observed, unobserved = topology.add_pod(), topology.add_pod()
    assert datapath.insert([observed.ip]).error is None
    assert datapath.programs is not None
    manager = AttachManager(datapath.programs, mode=request.param, netns=topology.host_path)
    manager.start()
    try:
        assert set(manager.attached()) == {observed.host_veth, unobserved.host_veth}
        yield Node(datapath, manager, observed, unobserved)
    finally:
        manager.stop()


def udp_echo(topology: Topology, pod: Pod, sizes: list[int], ipv6: bool = False) -> None:
    """Send one datagram of each size from the pod to the host, which echoes it back."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    pod_ip, host_ip = (pod.ip6, pod.host_ip6) if ipv6 else (pod.ip, pod.host_ip)
    with topology.in_host():
        server = socket.socket(family, socket.SOCK_DGRAM)
    with netns(pod.netns_path):
        client = socket.socket(family, socket.SOCK_DGRAM)
    with server, client:
        server.bind((host_ip, 0))
        client.bind((pod_ip, 0))
        server.settimeout(5)
        client.settimeout(5)
        for size in sizes:
            client.sendto(b"u" * size, server.getsockname())
            data, peer = server.recvfrom(65536)
            server.sendto(data, peer)
            assert client.recvfrom(65536)[0] == data


class Sender:
    """UDP from a pod to the host at about RATE packets/s on a thread, counting what it sent."""

    RATE = 1000  # packets per second leaving the pod (while an agent is killed and restarted)
    PAYLOAD = 100

    def __init__(self, topology: Topology, pod: Pod) -> None:
        with topology.in_host():
            self.sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound: no ICMP unreachable back
        with netns(pod.netns_path):
            self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sink.bind((pod.host_ip, 0))
        self.client.bind((pod.ip, 0))
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        target, start = self.sink.getsockname(), time.monotonic()
        while not self._stop.is_set():
            self.client.sendto(b"p" * self.PAYLOAD, target)
            self.sent += 1
            time.sleep(max(0.0, start + self.sent / self.RATE - time.monotonic()))

    def __enter__(self) -> Sender:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()
        self.sink.close()

    def expected(self) -> Traffic:
        return Traffic(self.sent, self.sent * (self.PAYLOAD + UDP_HEADERS))


class Capture:
    """Every frame crossing one interface, with its true length and which way it went."""

    def __init__(self, topology: Topology, ifname: str) -> None:
        with topology.in_host():
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((ifname, 0))
        self.sock.setblocking(False)

    def expected_counters(self, observed: str) -> dict[tuple[str, Direction], Traffic]:
        """What the datapath should count for ``observed`` given the frames seen (no VLANs here)."""
        totals: dict[tuple[str, Direction], Traffic] = {}
        for frame, length, outgoing in self._drain():
            addresses = _addresses(frame)
            if addresses is None:
                continue
            src, dst = addresses
            key = (dst, Direction.INGRESS) if outgoing else (src, Direction.EGRESS)
            if key[0] == observed:
                totals[key] = totals.get(key, Traffic()) + Traffic(1, length)
        return totals

    def _drain(self) -> Iterator[tuple[bytes, int, bool]]:
        """(head of the frame, its full length, sent by the host?) for every captured frame."""
        head = bytearray(128)
        while True:
            try:  # with MSG_TRUNC a packet socket returns the frame's real length
                length, address = self.sock.recvfrom_into(head, len(head), socket.MSG_TRUNC)
            except BlockingIOError:
                return
            yield bytes(head[: min(length, len(head))]), length, address[2] == PACKET_OUTGOING

    def close(self) -> None:
        self.sock.close()


def _addresses(frame: bytes) -> tuple[str, str] | None:
    """(source, destination) of an untagged IPv4 or IPv6 frame, else None."""
    if len(frame) >= 34 and frame[12:14] == b"\x08\x00":
        return socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
    if len(frame) >= 54 and frame[12:14] == b"\x86\xdd":
        return _ntop6(frame[22:38]), _ntop6(frame[38:54])
    return None


def _ntop6(raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6, raw)


def get_in_host(topology: Topology, url: str) -> bytes:
    """A GET from the topology's host netns (its loopback: an agent started there); raises OSError."""
    with topology.in_host():
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=5) as response:
            body: bytes = response.read()
            return body
