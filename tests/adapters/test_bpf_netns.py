"""Real packets: pods in network namespaces, veth pairs, the attach manager, UDP and TCP traffic.

Exactness: UDP counts are known by construction (one frame per datagram, 42 bytes of headers). TCP
segment counts depend on the stack (ACKs, GSO), so the test captures the host-side veth with an
AF_PACKET socket (an independent view of the same frames) and derives the expected counters from it.
The attached pods (the ``node`` fixture), ``udp_echo`` and ``Capture`` are in bpf_support.py.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bpf_support import UDP_HEADERS, Capture, Node, Pod, Topology, needs_root, run, udp_echo, unique
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath, InterfaceRule
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.adapters.datapath.ebpf.preflight import BARE_OBJECT_NAME, object_path
from podmeter.model.datapath import Direction, Traffic

pytestmark = needs_root

Opener = Callable[..., EbpfDatapath]
Counters = dict[tuple[str, Direction], Traffic]


def test_udp_is_counted_exactly_for_observed_pods_only(node: Node, topology: Topology) -> None:
    sizes = [1, 100, 1000, 1400, 37]
    udp_echo(topology, node.observed, sizes)
    udp_echo(topology, node.unobserved, sizes)
    expected = Traffic(len(sizes), sum(size + UDP_HEADERS for size in sizes))
    assert node.datapath.read_counters() == {
        (node.observed.ip, Direction.EGRESS): expected,
        (node.observed.ip, Direction.INGRESS): expected,
    }


def settled_counters(datapath: EbpfDatapath, capture: Capture, ip: str) -> Counters:
    """Compare while attached: a frame the stacks send between draining the capture and reading the
    counters (IPv6 neighbour discovery does so on its own schedule) only delays equality."""
    expected: Counters = {}
    for _ in range(20):
        for key, traffic in capture.expected_counters(ip).items():
            expected[key] = expected.get(key, Traffic()) + traffic
        if datapath.read_counters() == expected:
            break
        time.sleep(0.05)
    return expected


def tcp_exchange(topology: Topology, pod: Pod, upload: int, download: int) -> None:
    """The pod uploads ``upload`` bytes to a host server, which answers with ``download`` bytes."""
    with topology.in_host():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with netns(pod.netns_path):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    received = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            total = 0
            while chunk := conn.recv(65536):
                total += len(chunk)
            received.append(total)
            conn.sendall(b"d" * download)

    with listener, client:
        listener.bind((pod.host_ip, 0))
        listener.listen(1)
        server = threading.Thread(target=serve)
        server.start()
        client.settimeout(10)
        client.connect(listener.getsockname())
        client.sendall(b"u" * upload)
        client.shutdown(socket.SHUT_WR)
        got = 0
        while chunk := client.recv(65536):
            got += len(chunk)
        server.join(10)
    assert received == [upload]
    assert got == download


def test_tcp_counts_match_an_independent_capture(node: Node, topology: Topology) -> None:
    captures = [Capture(topology, pod.host_veth) for pod in (node.observed, node.unobserved)]
    try:
        tcp_exchange(topology, node.observed, upload=300_000, download=120_000)
        tcp_exchange(topology, node.unobserved, upload=50_000, download=50_000)
        expected = settled_counters(node.datapath, captures[0], node.observed.ip)
        assert captures[1].expected_counters(node.unobserved.ip)  # it did send, yet:
    finally:
        for capture in captures:
            capture.close()
    counters = node.datapath.read_counters()
    assert counters == expected
    assert counters[(node.observed.ip, Direction.EGRESS)].bytes > 300_000
    assert counters[(node.observed.ip, Direction.INGRESS)].bytes > 120_000


def test_ipv6_traffic_matches_an_independent_capture(topology: Topology, open_datapath: Opener) -> None:
    """Real IPv6: the datagrams, plus whatever ND the stacks send from the pod's address."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    pod = topology.add_pod(ipv6=True)
    assert pod.ip6 is not None
    assert datapath.insert([pod.ip6]).error is None
    capture = Capture(topology, pod.host_veth)
    try:
        with AttachManager(datapath.programs, netns=topology.host_path):
            udp_echo(topology, pod, [10, 500, 1200], ipv6=True)
            expected = settled_counters(datapath, capture, pod.ip6)
            counters = datapath.read_counters()
    finally:
        capture.close()
    assert counters == expected
    assert counters[(pod.ip6, Direction.EGRESS)].packets >= 3
    assert counters[(pod.ip6, Direction.INGRESS)].bytes >= 10 + 500 + 1200 + 3 * (14 + 40 + 8)


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_manager_follows_link_events(topology: Topology, open_datapath: Opener) -> None:
    """No resync timer in play: only netlink events can make these attaches and detaches happen."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    stray = unique("qq")
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
        assert manager.attached() == {}
        pod = topology.add_pod()
        run("ip", "-n", topology.host, "link", "add", stray, "type", "veth", "peer", "name", unique("qr"))
        wait_until(lambda: pod.host_veth in manager.attached())
        manager.sync()
        assert set(manager.attached()) == {pod.host_veth}  # the stray veth has both ends here: no pod's
        run("ip", "-n", topology.host, "link", "del", pod.host_veth)
        wait_until(lambda: manager.attached() == {})


def test_manager_follows_renames(topology: Topology, open_datapath: Opener) -> None:
    """With name patterns a rename is a change of the rule's input: renamed away from the pattern,
    detached; back, attached. Found by what it is, a pod link stays one under any name."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    pod = topology.add_pod()
    other = unique("qn")
    rule = InterfaceRule(patterns=("pm*",))
    with AttachManager(datapath.programs, rule=rule, netns=topology.host_path, resync_interval=3600) as manager:
        assert set(manager.attached()) == {pod.host_veth}
        run("ip", "-n", topology.host, "link", "set", pod.host_veth, "name", other)
        wait_until(lambda: manager.attached() == {})
        run("ip", "-n", topology.host, "link", "set", other, "name", pod.host_veth)
        wait_until(lambda: set(manager.attached()) == {pod.host_veth})
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
        run("ip", "-n", topology.host, "link", "set", pod.host_veth, "name", other)
        wait_until(lambda: set(manager.attached()) == {other})
        run("ip", "-n", topology.host, "link", "set", other, "name", pod.host_veth)
        wait_until(lambda: set(manager.attached()) == {pod.host_veth})


def test_explicit_interfaces_are_attached_by_name(topology: Topology, open_datapath: Opener) -> None:
    datapath = open_datapath(8)
    assert datapath.programs is not None
    odd = unique("qq")
    run("ip", "-n", topology.host, "link", "add", odd, "type", "veth", "peer", "name", unique("qr"))
    rule = InterfaceRule(patterns=(), explicit=(odd,))
    with AttachManager(datapath.programs, rule=rule, netns=topology.host_path) as manager:
        assert set(manager.attached()) == {odd}


def test_tc_mode_never_removes_what_it_did_not_create(topology: Topology, open_datapath: Opener) -> None:
    datapath = open_datapath(8)
    assert datapath.programs is not None
    pod = topology.add_pod()
    tc = ("tc", "-n", topology.host)
    run(*tc, "qdisc", "add", "dev", pod.host_veth, "clsact")
    run(*tc, "filter", "add", "dev", pod.host_veth, "ingress", "prio", "7", "handle", "7", "bpf", "da",
        "obj", str(object_path(BARE_OBJECT_NAME)), "sec", "tc")

    def filters() -> str:
        return run(*tc, "filter", "show", "dev", pod.host_veth, "ingress")

    with AttachManager(datapath.programs, mode=AttachMode.TC, netns=topology.host_path) as manager:
        assert set(manager.attached()) == {pod.host_veth}
        assert "pm_from_pod" in filters()
        assert "pm_parse_only" in filters()
    assert "pm_from_pod" not in filters()
    assert "pm_parse_only" in filters()
    assert "clsact" in run(*tc, "qdisc", "show", "dev", pod.host_veth)


def test_tc_mode_refuses_a_device_with_a_legacy_ingress_qdisc(topology: Topology, open_datapath: Opener) -> None:
    """Attaching there would put the egress program on ingress: refuse, report, attach the others."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    blocked, fine = topology.add_pod(), topology.add_pod()
    run("tc", "-n", topology.host, "qdisc", "add", "dev", blocked.host_veth, "ingress")
    with AttachManager(datapath.programs, mode=AttachMode.TC, netns=topology.host_path) as manager:
        assert set(manager.attached()) == {fine.host_veth}
        assert "legacy `ingress` qdisc" in manager.errors[blocked.host_veth]
        run("tc", "-n", topology.host, "qdisc", "del", "dev", blocked.host_veth, "ingress")
        manager.sync()
        assert set(manager.attached()) == {fine.host_veth, blocked.host_veth}
        assert manager.errors == {}


def test_capture_parser_reads_ipv4_addresses() -> None:
    """The test's own oracle: the offsets it reads are the IPv4 source and destination."""
    frame = b"\x00" * 12 + b"\x08\x00" + struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20, 0, 0, 64, 17, 0,
                                                     socket.inet_aton("1.2.3.4"), socket.inet_aton("5.6.7.8"))
    assert socket.inet_ntoa(frame[26:30]) == "1.2.3.4"
    assert socket.inet_ntoa(frame[30:34]) == "5.6.7.8"


def test_manager_keeps_up_with_a_burst_of_links(topology: Topology, open_datapath: Opener, tmp_path: Path) -> None:
    """30 pod veths appear at once, then vanish at once: every one is attached, then none."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    peers = unique("pmq")  # one namespace holds every peer: each host side's peer is elsewhere
    run("ip", "netns", "add", peers)
    names = [unique("pmb") for _ in range(30)]
    adds = "".join(f"link add {name} type veth peer name {unique('qb')} netns {peers}\n" for name in names)
    dels = "".join(f"link del {name}\n" for name in names)
    (tmp_path / "add").write_text(adds)
    (tmp_path / "del").write_text(dels)
    try:
        with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
            run("ip", "-n", topology.host, "-batch", str(tmp_path / "add"))
            wait_until(lambda: set(manager.attached()) == set(names))
            run("ip", "-n", topology.host, "-batch", str(tmp_path / "del"))
            wait_until(lambda: manager.attached() == {})
    finally:
        run("ip", "netns", "del", peers)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_nothing_leaks_across_open_attach_stop_close(topology: Topology, pin_dir: Path) -> None:
    topology.add_pod()
    before, threads = open_fds(), threading.active_count()
    for _ in range(5):
        datapath = EbpfDatapath.open(pin_dir, filter_size=8)
        assert datapath.programs is not None
        with AttachManager(datapath.programs, netns=topology.host_path) as manager:
            assert len(manager.attached()) == 1
        datapath.close()
    assert open_fds() == before
    assert threading.active_count() == threads
