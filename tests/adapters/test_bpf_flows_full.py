"""A full flows map (root only): packets lost once each, and fairness between pods (issue 25).

* ``flows_lost`` counts packets, not observation points: a packet between two pods of the node passes
  ``pm_from_pod`` and then ``pm_to_pod``, and when neither can add it, it is one packet lost (counted
  where it left its pod, as the workload series count it), whatever its ends' observation. Checked with
  BPF_PROG_TEST_RUN on each branch of the rule, then with real traffic between pods, from the node and
  to it: ``flows_lost`` is exactly the packets sent that no owning observation point recorded.
* Past 3/4 of the map, each pod link may create only a share more entries until the next drain: a pod
  spraying new tuples cannot hide a quiet pod's flows (``datapath.Fairness``). Checked with frames on two
  pods' links and with real traffic. The per-pod counters stay exact throughout.

Tests that send a packet through both hooks pin the thread to one CPU: the rule relies on one packet's two
hooks running on one CPU (as forwarding does), and two BPF_PROG_TEST_RUN calls may not.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator

import pytest

from bpf_support import Pod, Topology, needs_root, run
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath, layout
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.datapath import Fairness, FlowMaps
from podmeter.adapters.datapath.ebpf.loader import Program
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.flows import UDP, FlowCounts, FlowEntry, FlowKey, Observation

pytestmark = needs_root

TC_ACT_UNSPEC = -1
FROM, TO = Observation.FROM_POD, Observation.TO_POD
A, B, C = "10.43.0.5", "10.43.0.6", "10.43.0.7"  # A and B observed pods, C a pod of the node not observed
ELSEWHERE = "192.0.2.20"  # another node, the node itself or the world: no pod link of this node
UDP_HEADERS = 14 + 20 + 8
Opener = Callable[..., EbpfDatapath]


def udp(src: str, dst: str, sport: int, dport: int, size: int = 10) -> bytes:
    return f.ip_frame(src, dst, f.IPPROTO_UDP, f.udp(b"u" * size, sport, dport))


def send(program: Program, frame: bytes, repeat: int = 1, ifindex: int = 0) -> None:
    assert program.test_run(frame, repeat, ifindex=ifindex).retval == TC_ACT_UNSPEC


def programs(dp: EbpfDatapath) -> tuple[Program, Program]:
    assert dp.programs is not None
    return dp.programs.from_pod, dp.programs.to_pod


def flow_maps(dp: EbpfDatapath) -> FlowMaps:
    assert dp.flows is not None
    return dp.flows


def junk_fill(dp: EbpfDatapath, count: int) -> None:
    """``count`` entries written into the active map by hand (the programs' fill count does not see them):
    with ``count`` = the capacity, every new flow finds the map full."""
    keys = [layout.flow_key(FlowKey(f"198.18.{n // 250}.{n % 250 + 1}", "198.19.0.1", n, 9, UDP, FROM))
            for n in range(count)]
    values = [layout.flow_value(FlowCounts(1, 1, 1, 1, 0))] * count
    assert dp.flows_map is not None
    outcome = dp.flows_map.update_batch(keys, values)
    assert outcome.error is None and outcome.applied == count


def real_entries(entries: list[FlowEntry]) -> dict[FlowKey, int]:
    """Packets per flow of the entries that are not ``junk_fill``'s."""
    return {key: counts.packets for key, counts in entries if not key.source.startswith("198.18.")}


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """Run on one CPU (both hooks of a packet run on one CPU when the kernel forwards it)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture
def full(open_datapath: Opener) -> Iterator[EbpfDatapath]:
    """A datapath observing A and B whose active flows map (8 entries) is full, on one CPU."""
    dp = open_datapath(64, flow_size=8)
    assert dp.insert([A, B]).error is None
    junk_fill(dp, 8)
    with one_cpu():
        yield dp


# --- lost packets, not observation points --------------------------------------------------------------


@pytest.mark.parametrize(("src", "dst"), [(A, B), (C, B), (A, C)], ids=["observed-observed", "unobserved-observed",
                                                                         "observed-unobserved"])
def test_a_packet_between_two_pods_of_the_node_is_lost_once(full: EbpfDatapath, src: str, dst: str) -> None:
    """Leaving one pod (pm_from_pod, which counts it) and entering the other (pm_to_pod, which does not):
    one packet lost, whichever end is observed. The per-pod counters count both pods exactly."""
    from_pod, to_pod = programs(full)
    frame = udp(src, dst, 4000, 53)
    for _ in range(5):  # packet by packet, as the kernel forwards them
        send(from_pod, frame)
        send(to_pod, frame)
    send(from_pod, frame, repeat=7)  # and in bursts
    send(to_pod, frame, repeat=7)
    assert full.flows_lost_traffic() == Traffic(12, 12 * len(frame))
    observed = {(ip, d) for ip, d in ((src, Direction.EGRESS), (dst, Direction.INGRESS)) if ip != C}
    assert full.read_counters() == {key: Traffic(12, 12 * len(frame)) for key in observed}


def test_a_packet_with_one_observation_point_is_lost_there(full: EbpfDatapath) -> None:
    """From elsewhere into a pod: only pm_to_pod sees it; out of a pod to elsewhere: only pm_from_pod."""
    from_pod, to_pod = programs(full)
    inbound, outbound = udp(ELSEWHERE, B, 5000, 80), udp(A, ELSEWHERE, 5001, 80)
    send(to_pod, inbound, repeat=3)
    send(from_pod, outbound, repeat=4)
    assert full.flows_lost_traffic() == Traffic(7, 3 * len(inbound) + 4 * len(outbound))
    assert full.read_counters() == {(B, Direction.INGRESS): Traffic(3, 3 * len(inbound)),
                                    (A, Direction.EGRESS): Traffic(4, 4 * len(outbound))}


def test_a_to_pod_miss_of_a_packet_its_from_pod_point_recorded_loses_nothing(open_datapath: Opener) -> None:
    """The map has room for the from-pod entry only: the packet is recorded where it is owned (left its
    pod), so the to-pod point's miss is no lost packet, even for a source that is not observed."""
    dp = open_datapath(64, flow_size=4)
    assert dp.insert([B]).error is None
    junk_fill(dp, 3)
    from_pod, to_pod = programs(dp)
    frame = udp(C, B, 6000, 53)
    with one_cpu():
        for _ in range(3):
            send(from_pod, frame)
            send(to_pod, frame)
    assert dp.flows_lost() == 0
    assert real_entries(dp.drain_flows()) == {FlowKey(C, B, 6000, 53, UDP, FROM): 3}
    assert dp.read_counters() == {(B, Direction.INGRESS): Traffic(3, 3 * len(frame))}


def test_only_the_last_loss_of_a_cpu_is_remembered_for_its_to_pod_point(full: EbpfDatapath) -> None:
    """The rule's limit, stated: the to-pod point recognises the packet its CPU's from-pod point just
    lost, which is the packet it sees when the kernel forwards one packet at a time. A source that is
    not observed, whose from-pod loss was followed by another flow's, counts twice."""
    from_pod, to_pod = programs(full)
    first, other = udp(C, B, 7000, 53), udp(C, B, 7001, 53)
    send(from_pod, first)
    send(from_pod, other)
    send(to_pod, first)
    assert full.flows_lost() == 3


# --- real traffic ------------------------------------------------------------------------------------------


def routed(topology: Topology, *pods: Pod) -> None:
    """Pods reach each other and the node through the node (the host netns routes between their /24s)."""
    run("ip", "netns", "exec", topology.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    for pod in pods:
        run("ip", "-n", pod.netns, "route", "add", "default", "via", pod.host_ip)


def udp_socket(namespace: str, address: str, port: int = 0) -> socket.socket:
    with netns(namespace):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, port))
    sock.settimeout(5)
    return sock


def deliver(sender: socket.socket, receiver: socket.socket, count: int, size: int = 20) -> None:
    for _ in range(count):
        sender.sendto(b"r" * size, receiver.getsockname())
        assert len(receiver.recv(65536)) == size


@pytest.fixture(params=[AttachMode.TCX, AttachMode.TC], ids=["tcx", "tc"])
def attach_mode(request: pytest.FixtureRequest) -> AttachMode:
    mode: AttachMode = request.param
    return mode


def test_real_traffic_into_a_full_map_loses_exactly_the_packets_not_recorded(
    topology: Topology, open_datapath: Opener, attach_mode: AttachMode
) -> None:
    """Pods a and b observed, c a pod of the node that is not, the node itself: traffic between each pair,
    into a flows map that is full but for the entries of one flow made before. flows_lost is the packets
    sent minus those recorded at the point that owns them (where they left a pod, else where they entered
    one); before issue 25 a packet between two pods counted twice."""
    dp = open_datapath(64, flow_size=32)
    a, b, c = topology.add_pod(), topology.add_pod(), topology.add_pod()
    routed(topology, a, b, c)
    assert dp.insert([a.ip, b.ip]).error is None
    assert dp.programs is not None
    manager = AttachManager(dp.programs, mode=attach_mode, netns=topology.host_path)
    manager.start()
    try:
        sockets = {
            "a": udp_socket(a.netns_path, a.ip), "b": udp_socket(b.netns_path, b.ip),
            "c": udp_socket(c.netns_path, c.ip), "node": udp_socket(topology.host_path, b.host_ip),
            "kept": udp_socket(a.netns_path, a.ip),
        }
        with contextlib.ExitStack() as stack:
            for sock in sockets.values():
                stack.enter_context(sock)
            pairs = {"a->b": ("a", "b"), "c->b": ("c", "b"), "a->c": ("a", "c"), "node->b": ("node", "b"),
                     "a->node": ("a", "node"), "b->c": ("b", "c")}
            for sender, receiver in pairs.values():  # neighbours resolved, so no packet waits for ARP
                deliver(sockets[sender], sockets[receiver], 1)
            deliver(sockets["kept"], sockets["b"], 1)  # the flow that keeps its entries
            dp.drain_flows()
            deliver(sockets["kept"], sockets["b"], 1)
            entries = len(dp.read_flows())
            assert entries == 2  # its from-pod and to-pod entries in the new active map
            junk_fill(dp, 32 - entries)
            lost_before = dp.flows_lost()
            sent = {"a->b": 40, "c->b": 30, "a->c": 20, "node->b": 25, "a->node": 15, "b->c": 10}
            for name, (sender, receiver) in pairs.items():
                deliver(sockets[sender], sockets[receiver], sent[name])
            deliver(sockets["kept"], sockets["b"], 50)
            recorded = real_entries(dp.drain_flows())
            kept_port, b_port = sockets["kept"].getsockname()[1], sockets["b"].getsockname()[1]
        kept = {FlowKey(a.ip, b.ip, kept_port, b_port, UDP, point): 51 for point in (FROM, TO)}
        assert recorded == kept  # nothing else found room
        assert dp.flows_lost() - lost_before == sum(sent.values())  # sent - recorded at the owning point
    finally:
        manager.stop()


# --- fairness ------------------------------------------------------------------------------------------------


@pytest.fixture
def links(topology: Topology) -> tuple[int, int]:
    """The ifindexes of two pods' host-side links (BPF_PROG_TEST_RUN runs there when the test is in the
    host netns): the noisy pod's and the quiet pod's."""
    noisy, quiet = topology.add_pod(), topology.add_pod()
    with topology.in_host():
        return socket.if_nametoindex(noisy.host_veth), socket.if_nametoindex(quiet.host_veth)


NOISY, QUIET, SPOOFED = "10.44.0.5", "10.44.0.6", "10.45.0.0"


def spray(dp: EbpfDatapath, links: tuple[int, int], noisy: int, quiet: int, spoof: bool = False) -> set[int]:
    """``noisy`` new flows on the noisy link, ``quiet`` on the quiet one spread among them (by source
    port); returns the quiet ports. With ``spoof`` the noisy pod sends from ever new addresses to the
    quiet pod (no address of its own: the rule charges the link)."""
    from_pod, _ = programs(dp)
    noisy_link, quiet_link = links
    every = noisy // quiet
    ports = set()
    for n in range(noisy):
        if spoof:
            frame = udp(f"10.45.{n // 250}.{n % 250 + 1}", QUIET, 1000 + n, 53)
        else:
            frame = udp(NOISY, ELSEWHERE, 1000 + n, 53)
        send(from_pod, frame, ifindex=noisy_link)
        if n % every == every // 2 and len(ports) < quiet:
            ports.add(30000 + n)
            send(from_pod, udp(QUIET, ELSEWHERE, 30000 + n, 53), repeat=2, ifindex=quiet_link)
    assert len(ports) == quiet
    return ports


@pytest.mark.parametrize("spoof", [False, True], ids=["own-address", "spoofed-sources"])
def test_a_pod_spraying_new_tuples_does_not_hide_a_quiet_pods_flows(
    open_datapath: Opener, topology: Topology, links: tuple[int, int], spoof: bool
) -> None:
    """1,024 entries: the noisy pod fills 3/4 of them, then gets its share (16) like anyone; the quiet
    pod's 10 flows an interval, spread through the spray, are all recorded, in each of three intervals.
    The packets refused are lost (counted), and the per-pod counters count every packet."""
    dp = open_datapath(64, flow_size=1024)
    assert dp.insert([NOISY, QUIET]).error is None
    fairness = flow_maps(dp).fairness
    assert fairness == Fairness(768, 16)
    frame_size = len(udp(NOISY, ELSEWHERE, 1, 53))
    with topology.in_host():
        for interval in range(3):
            lost_before = dp.flows_lost()
            ports = spray(dp, links, 3000, 10, spoof)
            entries = dp.drain_flows()
            quiet = {key.source_port for key, counts in entries if key.source == QUIET and counts.packets == 2}
            assert quiet == ports, interval
            noisy = len(entries) - len(quiet)
            assert fairness.threshold <= noisy <= fairness.threshold + fairness.share
            assert dp.flows_lost() - lost_before == 3000 - noisy
    expected = {(QUIET, Direction.EGRESS): Traffic(3 * 20, 3 * 20 * frame_size)}
    if not spoof:  # spoofed sources are no pod's: pm_from_pod counts no pod for them
        expected[(NOISY, Direction.EGRESS)] = Traffic(3 * 3000, 3 * 3000 * frame_size)
    assert dp.read_counters() == expected


def test_without_the_rule_the_spray_hides_the_quiet_pods_later_flows(
    open_datapath: Opener, topology: Topology, links: tuple[int, int]
) -> None:
    """The reference (``Fairness.off()``, the behaviour before): the map fills with the noisy pod's flows
    and every quiet flow after that is lost."""
    dp = open_datapath(64, flow_size=1024)
    assert dp.insert([NOISY, QUIET]).error is None
    flow_maps(dp).configure(Fairness.off())
    with topology.in_host():
        ports = spray(dp, links, 3000, 10)
        entries = dp.drain_flows()
    quiet = {key.source_port for key, _ in entries if key.source == QUIET}
    assert len(entries) == 1024 and len(quiet) < len(ports) / 2


def test_the_fairness_counts_start_again_at_each_drain(
    open_datapath: Opener, topology: Topology, links: tuple[int, int]
) -> None:
    """The drain resets flows_fill's count and empties flows_share (just before it flips)."""
    dp = open_datapath(64, flow_size=64)  # threshold 48, share 1
    assert dp.insert([NOISY]).error is None
    maps = flow_maps(dp)
    from_pod, _ = programs(dp)
    noisy_link, _ = links
    with topology.in_host():
        for n in range(60):
            send(from_pod, udp(NOISY, ELSEWHERE, 1000 + n, 53), ifindex=noisy_link)
    assert maps.fill_entries() == 49
    assert maps.share is not None and not maps.share.is_empty()
    assert len(dp.drain_flows()) == 49
    assert maps.fill_entries() == 0 and maps.share.is_empty()
    assert dp.flows_lost() == 11


def test_the_rule_is_configured_for_the_map_size_and_kept_across_a_restart(open_datapath: Opener) -> None:
    first = open_datapath(64, flow_size=4096)
    assert flow_maps(first).fairness == Fairness(3072, 64)
    assert first.insert([NOISY]).error is None
    from_pod, _ = programs(first)
    for n in range(5):
        send(from_pod, udp(NOISY, ELSEWHERE, 1000 + n, 53))
    first.close()
    second = open_datapath(64, flow_size=4096)  # the same pins: its count goes on with the map it keeps
    raw = flow_maps(second).fill
    assert raw is not None
    assert layout.FLOWS_FILL.unpack(raw.lookup(layout.FLOWS_FILL_KEY) or b"")[:3] == (5, 3072, 64)
    assert Fairness.for_capacity(4) == Fairness(3, 1)
    assert Fairness.for_capacity(1).threshold == 0  # a one-entry map has no rule (threshold 0 is "off")


def test_real_traffic_a_spraying_pod_leaves_room_for_a_quiet_one(
    topology: Topology, open_datapath: Opener
) -> None:
    """The same with real pods: the noisy pod sends 2,000 datagrams from 2,000 ports to the node, the
    quiet one 16 from 16 ports among them; every quiet flow is recorded, and both pods' counters count
    every datagram."""
    dp = open_datapath(64, flow_size=1024)
    noisy, quiet = topology.add_pod(), topology.add_pod()
    assert dp.insert([noisy.ip, quiet.ip]).error is None
    assert dp.programs is not None
    manager = AttachManager(dp.programs, mode=AttachMode.TCX, netns=topology.host_path)
    manager.start()
    try:
        with udp_socket(topology.host_path, noisy.host_ip) as to_noisy, \
                udp_socket(topology.host_path, quiet.host_ip) as to_quiet:
            quiet_ports = set()
            for n in range(2000):  # each datagram received before the next: none overflows a buffer
                with udp_socket(noisy.netns_path, noisy.ip, 20000 + n) as sender:
                    deliver(sender, to_noisy, 1, size=1)
                if n % 125 == 60:
                    with udp_socket(quiet.netns_path, quiet.ip, 40000 + n) as sender:
                        deliver(sender, to_quiet, 1, size=1)
                    quiet_ports.add(40000 + n)
        entries = dp.drain_flows()
    finally:
        manager.stop()
    assert {key.source_port for key, _ in entries if key.source == quiet.ip} == quiet_ports
    noisy_entries = sum(1 for key, _ in entries if key.source == noisy.ip)
    assert 768 <= noisy_entries <= 768 + 16 + 1  # the threshold, a share (a CPU racing another: one more)
    size = 1 + UDP_HEADERS
    counters = dp.read_counters()
    assert counters[(noisy.ip, Direction.EGRESS)] == Traffic(2000, 2000 * size)
    assert counters[(quiet.ip, Direction.EGRESS)] == Traffic(16, 16 * size)
