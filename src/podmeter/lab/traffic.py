"""Known traffic between lab pods, so per-pod counts can be checked exactly.

Sockets are made inside the pods' namespaces (a thread enters the namespace only to create a socket;
the socket stays there) and the packets take the real path: pod A's eth0, A's host veth, the node's
routing, B's host veth, B's eth0. What the datapath must count (docs/datapath.md):

* UDP, ``n`` datagrams of ``size`` payload bytes over IPv4: A ``egress`` and B ``ingress`` each grow by
  exactly ``n`` packets and ``n * (size + 42)`` bytes; the other two directions by nothing (B has a bound
  socket, so no ICMP goes back; ARP is not IP and is never counted);
* TCP, ``size * n`` payload bytes: at least the payload each way it flows, and what left A is what
  entered B (the same socket buffers pass both veths).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from podmeter.lab.netns import in_namespace

UDP_OVERHEAD = 42  # Ethernet 14 + IPv4 20 + UDP 8, counted by the datapath with the payload
PORT = 5201
SO_RCVBUFFORCE = 33  # Linux: SO_RCVBUF beyond net.core.rmem_max (root)
RCVBUF = 16 << 20


@dataclass(frozen=True)
class Endpoint:
    """A pod as a traffic endpoint: its name (ns/name), its IP and its namespace path."""

    pod: str
    ip: str
    netns_path: str


def _socket_in(endpoint: Endpoint, kind: int) -> socket.socket:
    with in_namespace(endpoint.netns_path):
        return socket.socket(socket.AF_INET, kind)


class Pacer:
    """Spaces sends at ``rate`` per second (None: as fast as possible), on an absolute schedule so
    sleeping late does not slow the average down."""

    def __init__(self, rate: float | None) -> None:
        self.interval = 1.0 / rate if rate else 0.0
        self.next = time.monotonic()

    def wait(self) -> None:
        if self.interval:
            self.next += self.interval
            delay = self.next - time.monotonic()
            if delay > 0:
                time.sleep(delay)


@dataclass(frozen=True)
class Sent:
    """What an exchange did: how much arrived (UDP: datagrams, TCP: bytes) and the socket's own ports,
    so the flow it made can be found by its exact 5-tuple."""

    delivered: int
    source_port: int
    destination_port: int


class UdpSink:
    """A bound UDP receiver inside ``dst``'s namespace, with room for a whole burst: a datagram dropped at
    the socket was still counted on the veths, and the checks compare both."""

    def __init__(self, dst: Endpoint, port: int = PORT) -> None:
        self.port = port
        self.socket = _socket_in(dst, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
            self.socket.bind((dst.ip, port))
        except BaseException:
            self.socket.close()
            raise

    def receive(self, count: int, timeout: float = 3.0) -> int:
        """Read up to ``count`` datagrams (each within ``timeout``); how many came."""
        self.socket.settimeout(timeout)
        received = 0
        while received < count:
            try:
                self.socket.recv(65535)
            except TimeoutError:
                break
            received += 1
        return received

    def close(self) -> None:
        self.socket.close()


def send_datagrams(src: Endpoint, dst_ip: str, port: int, packets: int, size: int, *,
                   rate: float | None = None, source_port: int = 0) -> int:
    """Send ``packets`` datagrams of ``size`` bytes from ``src`` (bound to ``source_port``, 0: any) to
    ``dst_ip:port``; returns the source port the socket had."""
    sender = _socket_in(src, socket.SOCK_DGRAM)
    try:
        sender.bind((src.ip, source_port))
        payload, pacer = b"\x5a" * size, Pacer(rate)
        for _ in range(packets):
            sender.sendto(payload, (dst_ip, port))
            pacer.wait()
        bound: int = sender.getsockname()[1]
        return bound
    finally:
        sender.close()


def send_udp(src: Endpoint, dst: Endpoint, packets: int, size: int, rate: float | None = None, *,
             timeout: float = 3.0, port: int = PORT) -> Sent:
    """Send ``packets`` datagrams of ``size`` bytes from ``src`` to ``dst`` (``rate`` per second, or as
    fast as possible); ``delivered``: how many arrived."""
    sink = UdpSink(dst, port)
    try:
        source_port = send_datagrams(src, dst.ip, port, packets, size, rate=rate)
        return Sent(sink.receive(packets, timeout), source_port, port)
    finally:
        sink.close()


def send_tcp(src: Endpoint, dst: Endpoint, writes: int, size: int, rate: float | None = None, *,
             timeout: float = 5.0, port: int = PORT) -> Sent:
    """Stream ``writes`` writes of ``size`` bytes from ``src`` to ``dst`` over one connection (``rate``
    writes per second, or as fast as possible); ``delivered``: the bytes received. The connection opens
    (SYN) and closes (FIN, both ways) within the call."""
    listener = _socket_in(dst, socket.SOCK_STREAM)
    client = _socket_in(src, socket.SOCK_STREAM)
    received = [0]

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(timeout)
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                received[0] += len(chunk)

    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((dst.ip, port))
        listener.listen(1)
        listener.settimeout(timeout)
        server = threading.Thread(target=serve, name="lab-tcp-server", daemon=True)
        server.start()
        client.settimeout(timeout)
        client.bind((src.ip, 0))
        client.connect((dst.ip, port))
        source_port: int = client.getsockname()[1]
        chunk, pacer = b"\xa5" * size, Pacer(rate)
        for _ in range(writes):
            client.sendall(chunk)
            pacer.wait()
        client.shutdown(socket.SHUT_WR)
        server.join(timeout)
        return Sent(received[0], source_port, port)
    finally:
        client.close()
        listener.close()
