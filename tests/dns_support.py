"""DNS messages built by hand (no resolver library: the tests control every byte), a small resolver client
for pods, a real DNS server (Debian's dnsmasq) in a netns, and the TC object loaded unpinned to run DNS
frames through (BPF_PROG_TEST_RUN). No tests here."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent_harness import Cluster
from bpf_support import Pod, Topology
from lab_server import LabServer
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.datapath import map_sizes
from podmeter.adapters.datapath.ebpf.dns import DnsMaps
from podmeter.adapters.datapath.ebpf.loader import Loaded, load
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.datapath.ebpf.preflight import object_path
from podmeter.model import dns

QR, RD = 0x8000, 0x0100
A, AAAA, TXT, SRV = 1, 28, 16, 33


def message(ident: int, name: bytes | str, qtype: int = A, *, flags: int = RD, qdcount: int = 1,
            answers: bytes = b"", ancount: int = 0) -> bytes:
    """A DNS message with one question (``name`` as text, or wire bytes as they are) and raw answers."""
    wire = dns.wire_name(name) if isinstance(name, str) else name
    return struct.pack("!HHHHHH", ident, flags, qdcount, ancount, 0, 0) + wire + struct.pack("!HH", qtype, 1) + answers


def response(ident: int, name: str, qtype: int = A, rcode: int = 0, *, compressed_answer: bool = False) -> bytes:
    """A response; with ``compressed_answer`` one A record whose owner is a pointer to the question."""
    answer = b""
    if compressed_answer:
        answer = struct.pack("!HHHIH", 0xC00C, A, 1, 30, 4) + bytes([10, 96, 0, 50])
    return message(ident, name, qtype, flags=QR | RD | 0x80 | rcode, answers=answer, ancount=int(compressed_answer))


def name_of(length: int) -> str:
    """A dotted name of exactly ``length`` characters (no final dot) in labels of at most 63 bytes."""
    labels, left = [], length
    while left > 64:
        labels.append("x" * 63)
        left -= 64
    if left == 64:  # a 63-byte label, a dot and nothing: split it 62 + dot + 1
        labels.append("x" * 62)
        left = 1
    labels.append("y" * left)
    name = ".".join(labels)
    assert len(name) == length, (len(name), length)
    return name


def tcp_segment(msg: bytes, sport: int, dport: int, length: int | None = None) -> bytes:
    """A segment with ``msg`` after its 2-byte length (``length``: another length than the message's)."""
    size = len(msg) if length is None else length
    return f.tcp(struct.pack("!H", size) + msg, sport, dport, f.TCP_ACK | f.TCP_PSH)


# --- the TC object, unpinned ---------------------------------------------------------------------------------


@dataclass
class DnsProgram:
    """podmeter.bpf.o loaded with fresh maps pinned nowhere, one pod observed."""

    loaded: Loaded
    datapath: EbpfDatapath
    pod: str = "10.0.0.2"
    server: str = "10.96.0.10"

    @classmethod
    def load(cls, dns_size: int = 64, pod: str = "10.0.0.2") -> DnsProgram:
        loaded = load(object_path(), None, map_sizes(8, 64, dns_size), ["pm_from_pod", "pm_to_pod"])
        datapath = EbpfDatapath.from_loaded(loaded)
        assert datapath.insert([pod]).error is None
        return cls(loaded, datapath, pod)

    @property
    def maps(self) -> DnsMaps:
        assert self.datapath.dns is not None
        return self.datapath.dns

    def query(self, msg: bytes, port: int = 40000, tcp: bool = False, tcp_length: int | None = None) -> None:
        """A frame leaving the pod to the server's port 53."""
        payload = tcp_segment(msg, port, 53, tcp_length) if tcp else f.udp(msg, port, 53)
        frame = f.ip_frame(self.pod, self.server, f.IPPROTO_TCP if tcp else f.IPPROTO_UDP, payload)
        self.loaded.programs["pm_from_pod"].test_run(frame)

    def answer(self, msg: bytes, port: int = 40000, tcp: bool = False) -> None:
        """A frame entering the pod from the server's port 53."""
        payload = tcp_segment(msg, 53, port) if tcp else f.udp(msg, 53, port)
        frame = f.ip_frame(self.server, self.pod, f.IPPROTO_TCP if tcp else f.IPPROTO_UDP, payload)
        self.loaded.programs["pm_to_pod"].test_run(frame)

    def counts(self) -> dict[dns.Verdict, int]:
        return {verdict: n for verdict, n in self.maps.counts().items() if n}

    def close(self) -> None:
        self.loaded.close()


@contextlib.contextmanager
def dns_program(dns_size: int = 64) -> Iterator[DnsProgram]:
    program = DnsProgram.load(dns_size)
    try:
        yield program
    finally:
        program.close()


# --- a resolver client and a real server -----------------------------------------------------------------


def ask(server: str, msg: bytes, *, port: int = 53, timeout: float = 2.0, source_port: int = 0) -> bytes | None:
    """Send one query over UDP from the calling thread's netns; the answer, or None on timeout."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.bind(("0.0.0.0", source_port))
        sock.sendto(msg, (server, port))
        try:
            return sock.recv(4096)
        except TimeoutError:
            return None


def ask_from(pod: Pod, server: str, msg: bytes, *, tcp: bool = False, timeout: float = 2.0) -> bytes | None:
    """One query from ``pod``'s netns (over TCP with ``tcp``); the answer, or None on a UDP timeout."""
    with netns(pod.netns_path):
        return ask_tcp(server, msg, timeout=timeout) if tcp else ask(server, msg, timeout=timeout)


def ask_tcp(server: str, msg: bytes, *, port: int = 53, timeout: float = 2.0) -> bytes:
    """One query over TCP (length-prefixed, in one segment: TCP_NODELAY and one send)."""
    with socket.create_connection((server, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("!H", len(msg)) + msg)
        size = struct.unpack("!H", _read(sock, 2))[0]
        return _read(sock, size)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("DNS server closed the connection")
        data += chunk
    return data


def rcode_of(answer: bytes) -> int:
    return struct.unpack_from("!H", answer, 2)[0] & 0xF


@dataclass
class Dnsmasq:
    """dnsmasq on ``address`` inside the netns at ``netns_path``: answers ``*.svc.cluster.local`` with
    10.96.0.50, ``*.nxdomain.test`` with NXDOMAIN, and refuses the rest (no upstream: --no-resolv)."""

    netns_path: str
    address: str
    process: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None

    def start(self) -> None:
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        self.workdir = Path(tempfile.mkdtemp(prefix="pmdns"))
        argv = [binary, "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
                f"--listen-address={self.address}", "--port=53", f"--pid-file={self.workdir / 'pid'}",
                "--address=/svc.cluster.local/10.96.0.50", "--address=/nxdomain.test/", "--user=root",
                "--group=root", "--log-facility=-", "--no-ping"]
        log = self.workdir / "log"
        with netns(self.netns_path), open(log, "wb") as out:
            self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {log.read_text(errors='replace')[-2000:]}")
            with netns(self.netns_path):
                if ask(self.address, message(1, "ready.svc.cluster.local"), timeout=0.2) is not None:
                    return
        raise RuntimeError("dnsmasq did not answer in 10 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def pod_with_resolver(topology: Topology, server: LabServer) -> tuple[Pod, Cluster, Dnsmasq]:
    """A pod ``shop/web`` of an observed namespace (in the lab server), and a dnsmasq (not started) on the
    node's side of its link, its resolver."""
    web = topology.add_pod()
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
    return web, cluster, Dnsmasq(topology.host_path, web.host_ip)
