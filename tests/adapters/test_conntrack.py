"""The node's address translations from ctnetlink, against the kernel and against Debian's `conntrack`.

A real DNAT (an nftables rule in a private "node" netns, as kube-proxy's nftables mode writes one)
between real netns pods: a TCP and a UDP connection to a frontend address are rewritten to a backend,
and the reader gives each as the kernel keeps it (both tuples), and nothing for a connection the node
did not translate.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from bpf_support import Pod, Topology, needs_root, run
from podmeter.adapters import conntrack
from podmeter.adapters.conntrack import Translation, TranslationReader, Tuple, read_translations
from podmeter.adapters.datapath.ebpf.netns import netns

pytestmark = needs_root
FRONTEND = "10.96.231.7"
TCP, UDP = 6, 17


def node_with_pods(topology: Topology) -> tuple[Pod, Pod]:
    client, backend = topology.add_pod(), topology.add_pod()
    run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    for pod in (client, backend):
        run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)
    rules = f"""
table ip pmtest {{
  chain pre {{
    type nat hook prerouting priority dstnat;
    ip daddr {FRONTEND} tcp dport 80 dnat to {backend.ip}:8080
    ip daddr {FRONTEND} udp dport 53 dnat to {backend.ip}:5353
  }}
}}
"""
    subprocess.run(["ip", "netns", "exec", topology.host, "nft", "-f", "-"], input=rules, text=True, check=True)
    return client, backend


@contextlib.contextmanager
def tcp_server(pod: Pod, port: int) -> Iterator[None]:
    with netns(pod.netns_path):
        listener = socket.create_server(("0.0.0.0", port))
    held: list[socket.socket] = []
    thread = threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(5)
        for sock in (*held, listener):
            sock.close()


def connect(pod: Pod, address: str, port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with netns(pod.netns_path):
        sock = socket.socket(socket.AF_INET, kind)
    sock.settimeout(5)
    sock.connect((address, port))
    if kind == socket.SOCK_DGRAM:
        sock.send(b"query")
    return sock


def conntrack_tool(topology: Topology) -> set[tuple[Tuple, Tuple]]:
    """What `conntrack -L --dst-nat` lists: each entry's original and reply tuple."""
    text = run("ip", "netns", "exec", topology.host, "conntrack", "-L", "--dst-nat")
    found = set()
    for line in text.splitlines():
        protocol = int(line.split()[1])
        fields = re.findall(r"(src|dst|sport|dport)=(\S+)", line)
        values = [v for _, v in fields]
        first, second = values[:4], values[4:8]
        found.add((Tuple(protocol, first[0], int(first[2]), first[1], int(first[3])),
                   Tuple(protocol, second[0], int(second[2]), second[1], int(second[3]))))
    return found


@pytest.mark.skipif(shutil.which("conntrack") is None, reason="needs Debian's conntrack")
def test_translated_connections_are_read_as_the_kernel_keeps_them(topology: Topology) -> None:
    client, backend = node_with_pods(topology)
    with tcp_server(backend, 8080), tcp_server(backend, 9000), \
            connect(client, FRONTEND, 80) as tcp, connect(client, backend.ip, 9000) as direct, \
            connect(client, FRONTEND, 53, socket.SOCK_DGRAM) as udp:
        with topology.in_host():
            mine = read_translations()
        theirs = conntrack_tool(topology)
        tcp_port, udp_port, direct_port = tcp.getsockname()[1], udp.getsockname()[1], direct.getsockname()[1]
    assert {(t.original, t.reply) for t in mine} == theirs
    by_protocol = {t.original.protocol: t for t in mine}
    assert by_protocol[TCP] == Translation(Tuple(TCP, client.ip, tcp_port, FRONTEND, 80),
                                           Tuple(TCP, backend.ip, 8080, client.ip, tcp_port), False)
    assert by_protocol[UDP].frontend == (FRONTEND, 53)
    assert by_protocol[UDP].backend == (backend.ip, 5353)
    assert by_protocol[UDP].original.sport == udp_port
    assert all(t.original.sport != direct_port for t in mine), "the untranslated connection is left out"
    assert len(mine) == 2


def test_a_table_without_translations_reads_empty(topology: Topology) -> None:
    with topology.in_host():
        assert read_translations() == []


def test_an_unreadable_table_is_one_warning_and_no_names(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def refused() -> list[Translation]:
        raise PermissionError(1, "Operation not permitted")

    caplog.set_level("INFO", logger="podmeter.conntrack")
    reader = TranslationReader()
    monkeypatch.setattr(conntrack, "read_translations", refused)
    assert reader.read() == [] and reader.read() == []
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "CAP_NET_ADMIN" in warnings[0].getMessage()
    assert reader.failures == 2
    monkeypatch.setattr(conntrack, "read_translations", lambda: [])
    assert reader.read() == []
    assert any("can be read again" in r.getMessage() for r in caplog.records)
