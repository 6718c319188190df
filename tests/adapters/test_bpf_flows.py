"""Flow aggregation in the kernel: the ``flows`` map, its loss counter and its drain (root only).

BPF_PROG_TEST_RUN on synthetic frames checks exact keys and counts (ports in host byte order, ICMP type
and code in the port fields, TCP flags ORed), which packets get a flow (at least one observed end), a
full map's losses, and that drains take every entry exactly once. Real pods (netns, veth, sockets) check
UDP, TCP and ICMP flows at both observation points against what was sent or an AF_PACKET capture.
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bpf_support import UDP_HEADERS, Capture, Node, Pod, Topology, needs_root, run
from podmeter.adapters.datapath.ebpf import EbpfDatapath, layout
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.datapath import FlowMaps
from podmeter.adapters.datapath.ebpf.libbpf import libbpf
from podmeter.adapters.datapath.ebpf.loader import Program
from podmeter.adapters.datapath.ebpf.maps import ENOTSUPP
from podmeter.adapters.datapath.ebpf.netns import netns
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP, FlowCounts, FlowEntry, FlowKey, Observation
from podmeter.model.records import canonical_ip

pytestmark = needs_root

TC_ACT_UNSPEC = -1
FROM, TO = Observation.FROM_POD, Observation.TO_POD
POD_V4, OTHER_V4, PEER_V4 = "10.41.0.5", "10.41.0.6", "192.0.2.9"
POD_V6, OTHER_V6, PEER_V6 = "fd00:41::5", "fd00:41::6", "2001:db8::9"
SYN, ACK, FIN, RST, PSH = f.TCP_SYN, f.TCP_ACK, f.TCP_FIN, f.TCP_RST, f.TCP_PSH
Totals = dict[FlowKey, tuple[int, int, int]]  # packets, bytes, tcp_flags


@pytest.fixture
def open_flows(open_datapath: Callable[..., EbpfDatapath]) -> Callable[..., EbpfDatapath]:
    """The shared opener, with a small flow map unless told otherwise."""
    return lambda filter_size=64, flow_size=1024: open_datapath(filter_size, flow_size=flow_size)


@pytest.fixture
def datapath(open_flows: Callable[..., EbpfDatapath]) -> EbpfDatapath:
    dp = open_flows()
    assert dp.insert([POD_V4, POD_V6]).error is None
    return dp


def programs(dp: EbpfDatapath) -> tuple[Program, Program]:
    assert dp.programs is not None
    return dp.programs.from_pod, dp.programs.to_pod


def send(program: Program, frame: bytes, repeat: int = 1) -> None:
    assert program.test_run(frame, repeat).retval == TC_ACT_UNSPEC


def key(src: str, dst: str, sport: int, dport: int, protocol: int, observation: Observation) -> FlowKey:
    return FlowKey(src, dst, sport, dport, protocol, observation)


def totals(entries: list[FlowEntry]) -> Totals:
    """Entries by key; fails if a key appears twice (a drain must never return an entry twice)."""
    out: Totals = {}
    for flow, counts in entries:
        assert flow not in out, f"{flow} returned twice"
        out[flow] = (counts.packets, counts.bytes, counts.tcp_flags)
    return out


def add(into: Totals, entries: list[FlowEntry]) -> None:
    for flow, (packets, size, flags) in totals(entries).items():
        old = into.get(flow, (0, 0, 0))
        into[flow] = (old[0] + packets, old[1] + size, old[2] | flags)


CLOCK_MONOTONIC_COARSE = 6  # linux/time.h; Python's time module does not name it


def coarse_now() -> int:
    """The clock bpf_ktime_get_coarse_ns() reads, from userspace."""
    return time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE)


def udp(src: str, dst: str, sport: int, dport: int, size: int) -> bytes:
    return f.ip_frame(src, dst, f.IPPROTO_UDP, f.udp(b"u" * size, sport, dport))


# --- layout ----------------------------------------------------------------------------------------------

addresses = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv6Address(n))),  # ::a.b.c.d, where inet_ntop differs
).map(canonical_ip)
u16, u64 = st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1)


@given(addresses, addresses, u16, u16, st.integers(0, 255), st.sampled_from(Observation), u64, u64, u64, u64,
       st.integers(0, 255))
def test_flow_entries_survive_a_round_trip_through_the_kernel_layout(
    src: str, dst: str, sport: int, dport: int, protocol: int, observation: Observation,
    packets: int, size: int, first: int, last: int, flags: int,
) -> None:
    flow = FlowKey(src, dst, sport, dport, protocol, observation)
    counts = FlowCounts(packets, size, first, last, flags)
    raw_key, raw_value = layout.flow_key(flow), layout.flow_value(counts)
    assert len(raw_key) == len(raw_value) == 40
    [(decoded, decoded_counts)] = layout.decode_flows(raw_key, raw_value, 1)
    assert (decoded, decoded_counts) == (flow, counts)
    assert type(decoded) is FlowKey and type(decoded_counts) is FlowCounts
    assert decoded.observation is observation
    assert layout.decode_flow_key(raw_key) == flow and layout.decode_flow_value(raw_value) == counts


# --- keys and counts (BPF_PROG_TEST_RUN) ------------------------------------------------------------------


@pytest.mark.parametrize(("pod", "peer"), [(POD_V4, PEER_V4), (POD_V6, PEER_V6)], ids=["v4", "v6"])
def test_udp_flows_have_exact_keys_counts_and_times(datapath: EbpfDatapath, pod: str, peer: str) -> None:
    from_pod, to_pod = programs(datapath)
    leaving, entering = udp(pod, peer, 4660, 53, 100), udp(peer, pod, 53, 4660, 300)
    before = coarse_now()
    send(from_pod, leaving, repeat=7)
    send(to_pod, entering, repeat=3)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    entries = datapath.drain_flows()
    assert totals(entries) == {
        key(pod, peer, 4660, 53, UDP, FROM): (7, 7 * len(leaving), 0),
        key(peer, pod, 53, 4660, UDP, TO): (3, 3 * len(entering), 0),
    }
    for _, counts in entries:
        assert before <= counts.first_ns <= counts.last_ns <= after
    # the counters count as they always did
    assert datapath.read_counters() == {
        (pod, Direction.EGRESS): Traffic(7, 7 * len(leaving)),
        (pod, Direction.INGRESS): Traffic(3, 3 * len(entering)),
    }


def test_the_key_bytes_are_the_documented_layout(datapath: EbpfDatapath) -> None:
    """Ports in host byte order at bytes 32-35, protocol at 36, observation at 37, zero padding."""
    from_pod, _ = programs(datapath)
    send(from_pod, udp(POD_V4, PEER_V4, 0x1234, 0xABCD, 10))
    assert datapath.flows_map is not None
    [(raw_key, raw_value)] = datapath.flows_map.collect_items()
    assert len(raw_key) == len(raw_value) == 40
    assert raw_key[:16] == layout.address_bytes(POD_V4)
    assert raw_key[16:32] == layout.address_bytes(PEER_V4)
    assert raw_key[32:36] == struct.pack("=HH", 0x1234, 0xABCD)
    assert raw_key[36:] == bytes([UDP, 0, 0, 0])
    packets, size, first, last, flags = struct.unpack("=QQQQQ", raw_value)
    assert (packets, flags) == (1, 0)
    assert size == len(udp(POD_V4, PEER_V4, 0x1234, 0xABCD, 10))
    assert first == last > 0
    assert layout.flow_key(key(POD_V4, PEER_V4, 0x1234, 0xABCD, UDP, FROM)) == raw_key


@pytest.mark.parametrize(("pod", "peer"), [(POD_V4, PEER_V4), (POD_V6, PEER_V6)], ids=["v4", "v6"])
def test_tcp_flags_of_a_connection_are_ored(datapath: EbpfDatapath, pod: str, peer: str) -> None:
    from_pod, to_pod = programs(datapath)
    out = [f.tcp_frame(pod, peer, 50000, 443, flags=SYN),
           f.tcp_frame(pod, peer, 50000, 443, flags=ACK, size=500),
           f.tcp_frame(pod, peer, 50000, 443, flags=FIN | ACK)]
    back = [f.tcp_frame(peer, pod, 443, 50000, flags=SYN | ACK), f.tcp_frame(peer, pod, 443, 50000, flags=RST)]
    for frame in out:
        send(from_pod, frame)
    for frame in back:
        send(to_pod, frame)
    assert totals(datapath.drain_flows()) == {
        key(pod, peer, 50000, 443, TCP, FROM): (3, sum(map(len, out)), SYN | ACK | FIN),
        key(peer, pod, 443, 50000, TCP, TO): (2, sum(map(len, back)), SYN | ACK | RST),
    }


def test_icmp_type_and_code_travel_in_the_port_fields(datapath: EbpfDatapath) -> None:
    from_pod, to_pod = programs(datapath)
    echo = f.icmp_frame(POD_V4, PEER_V4, 8)  # echo request
    reply = f.icmp_frame(PEER_V4, POD_V4, 0)
    unreachable = f.icmp_frame(PEER_V4, POD_V4, 3, code=1)  # host unreachable
    echo6 = f.icmp_frame(POD_V6, PEER_V6, 128)
    reply6 = f.icmp_frame(PEER_V6, POD_V6, 129)
    send(from_pod, echo, repeat=4)
    send(to_pod, reply, repeat=4)
    send(to_pod, unreachable)
    send(from_pod, echo6, repeat=2)
    send(to_pod, reply6, repeat=2)
    assert totals(datapath.drain_flows()) == {
        key(POD_V4, PEER_V4, 8, 0, ICMP, FROM): (4, 4 * len(echo), 0),
        key(PEER_V4, POD_V4, 0, 0, ICMP, TO): (4, 4 * len(reply), 0),
        key(PEER_V4, POD_V4, 3, 1, ICMP, TO): (1, len(unreachable), 0),
        key(POD_V6, PEER_V6, 128, 0, ICMPV6, FROM): (2, 2 * len(echo6), 0),
        key(PEER_V6, POD_V6, 129, 0, ICMPV6, TO): (2, 2 * len(reply6), 0),
    }


def test_fragments_other_protocols_and_short_headers_have_no_ports(datapath: EbpfDatapath) -> None:
    """Ports 0 wherever there is no transport header to read; every frame is still counted exactly."""
    from_pod, _ = programs(datapath)
    segment = f.udp(b"x" * 40, 7000, 8000)
    frames = {
        "first fragment": f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, segment, frag=f.IP_MF)),
        "later fragment": f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, segment, frag=185)),
        "gre": f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, segment, protocol=47)),
        "v6 hop-by-hop": f.ethernet(f.ETH_P_IPV6, f.ipv6(POD_V6, PEER_V6, bytes(8) + segment, next_header=0)),
        "short tcp": f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, f.tcp(sport=1, dport=2)[:10], protocol=TCP)),
        "short udp": f.ethernet(f.ETH_P_IPV6, f.ipv6(POD_V6, PEER_V6, segment[:7])),
        "options": f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, b"\x01\x01\x01\x00" + segment, ihl=6)),
    }
    for frame in frames.values():
        send(from_pod, frame)
    flows = totals(datapath.drain_flows())
    assert flows == {
        # a first fragment has its ports; so has a header with options (the transport header follows them)
        key(POD_V4, PEER_V4, 7000, 8000, UDP, FROM): (2, len(frames["first fragment"]) + len(frames["options"]), 0),
        key(POD_V4, PEER_V4, 0, 0, UDP, FROM): (1, len(frames["later fragment"]), 0),
        key(POD_V4, PEER_V4, 0, 0, 47, FROM): (1, len(frames["gre"]), 0),
        key(POD_V6, PEER_V6, 0, 0, 0, FROM): (1, len(frames["v6 hop-by-hop"]), 0),
        key(POD_V4, PEER_V4, 0, 0, TCP, FROM): (1, len(frames["short tcp"]), 0),
        key(POD_V6, PEER_V6, 0, 0, UDP, FROM): (1, len(frames["short udp"]), 0),
    }
    v4 = [frame for name, frame in frames.items() if name not in ("v6 hop-by-hop", "short udp")]
    assert datapath.read_counters() == {
        (POD_V4, Direction.EGRESS): Traffic(len(v4), sum(map(len, v4))),
        (POD_V6, Direction.EGRESS): Traffic(2, len(frames["v6 hop-by-hop"]) + len(frames["short udp"])),
    }


def test_vlan_tagged_frames_are_keyed_by_their_inner_headers(datapath: EbpfDatapath) -> None:
    from_pod, _ = programs(datapath)
    frame = f.ip_frame(POD_V4, PEER_V4, f.IPPROTO_UDP, f.udp(b"v", 5, 6), vlans=[10, 20])
    send(from_pod, frame)
    assert totals(datapath.drain_flows()) == {key(POD_V4, PEER_V4, 5, 6, UDP, FROM): (1, len(frame), 0)}


# --- which packets get a flow ----------------------------------------------------------------------------


@pytest.mark.parametrize(("other", "peer"), [(OTHER_V4, PEER_V4), (OTHER_V6, PEER_V6)], ids=["v4", "v6"])
def test_two_unobserved_ends_make_no_flow_and_no_counter(datapath: EbpfDatapath, other: str, peer: str) -> None:
    from_pod, to_pod = programs(datapath)
    send(from_pod, udp(other, peer, 1, 2, 10), repeat=5)
    send(to_pod, udp(peer, other, 2, 1, 10), repeat=5)
    assert datapath.drain_flows() == []
    assert datapath.read_counters() == {}


def test_an_observed_far_end_alone_makes_a_flow_but_no_counter(datapath: EbpfDatapath) -> None:
    """From an unobserved pod to an observed IP (and into an unobserved pod from one): a flow at that
    observation point; the counters still key on the pod-side address only."""
    from_pod, to_pod = programs(datapath)
    towards = udp(OTHER_V4, POD_V4, 1111, 2222, 20)
    away = udp(POD_V6, OTHER_V6, 3333, 4444, 30)
    send(from_pod, towards, repeat=2)
    send(to_pod, away, repeat=3)
    assert totals(datapath.drain_flows()) == {
        key(OTHER_V4, POD_V4, 1111, 2222, UDP, FROM): (2, 2 * len(towards), 0),
        key(POD_V6, OTHER_V6, 3333, 4444, UDP, TO): (3, 3 * len(away), 0),
    }
    assert datapath.read_counters() == {}


def test_no_flow_once_the_ip_has_left_the_filter(datapath: EbpfDatapath) -> None:
    """The writer's delete + take ends counting and flows alike; the counters invariant holds."""
    from_pod, _ = programs(datapath)
    frame = udp(POD_V4, PEER_V4, 1, 2, 10)
    send(from_pod, frame, repeat=2)
    assert datapath.delete([POD_V4]).applied == 1
    assert datapath.take_counters([POD_V4]) == {(POD_V4, Direction.EGRESS): Traffic(2, 2 * len(frame))}
    send(from_pod, frame, repeat=5)
    assert totals(datapath.drain_flows()) == {key(POD_V4, PEER_V4, 1, 2, UDP, FROM): (2, 2 * len(frame), 0)}
    assert datapath.read_counters() == {}


def test_a_full_flows_map_counts_its_losses_and_the_counters_stay_exact(
    open_flows: Callable[..., EbpfDatapath],
) -> None:
    dp = open_flows(flow_size=4)
    assert dp.insert([POD_V4]).error is None
    from_pod, _ = programs(dp)
    frames = [udp(POD_V4, PEER_V4, 1000 + n, 53, 10) for n in range(10)]
    for frame in frames:
        send(from_pod, frame, repeat=3)
    size = len(frames[0])
    assert dp.flow_capacity == 4
    assert dp.flows_lost() == 6 * 3
    assert dp.flows_lost_traffic() == Traffic(18, 18 * size)
    assert dp.read_counters() == {(POD_V4, Direction.EGRESS): Traffic(30, 30 * size)}
    assert totals(dp.drain_flows()) == {key(POD_V4, PEER_V4, 1000 + n, 53, UDP, FROM): (3, 3 * size, 0)
                                        for n in range(4)}
    send(from_pod, frames[9])  # drained: room again
    assert totals(dp.drain_flows()) == {key(POD_V4, PEER_V4, 1009, 53, UDP, FROM): (1, size, 0)}
    assert dp.flows_lost() == 18  # a counter that only grows


# --- draining ----------------------------------------------------------------------------------------------


def fill(dp: EbpfDatapath, count: int, repeat: int = 1) -> Totals:
    """``count`` distinct flows of the observed IPv4 pod, ``repeat`` packets each; what they should add."""
    from_pod, _ = programs(dp)
    expected: Totals = {}
    for n in range(count):
        frame = udp(POD_V4, PEER_V4, 20000 + n, 80, n % 50)
        send(from_pod, frame, repeat)
        expected[key(POD_V4, PEER_V4, 20000 + n, 80, UDP, FROM)] = (repeat, repeat * len(frame), 0)
    return expected


def test_a_drain_returns_each_entry_once_and_leaves_the_map_empty(datapath: EbpfDatapath) -> None:
    expected = fill(datapath, 300, repeat=2)
    assert totals(datapath.read_flows()) == expected  # reading leaves them
    assert totals(datapath.drain_flows(chunk=7)) == expected  # many chunks
    assert datapath.read_flows() == []
    assert datapath.flows_map is not None and datapath.flows_map.collect_keys() == []
    assert datapath.drain_flows() == []


def test_a_hundred_drains_interleaved_with_packets_lose_and_double_nothing(datapath: EbpfDatapath) -> None:
    from_pod, to_pod = programs(datapath)
    flows = [(from_pod, udp(POD_V4, PEER_V4, 30000 + n, 53, n), key(POD_V4, PEER_V4, 30000 + n, 53, UDP, FROM))
             for n in range(10)]
    flows += [(to_pod, udp(PEER_V6, POD_V6, 53, 30000 + n, n), key(PEER_V6, POD_V6, 53, 30000 + n, UDP, TO))
              for n in range(10)]
    sent: Totals = {}
    drained: Totals = {}
    for round_ in range(100):
        for n, (program, frame, flow) in enumerate(flows):
            if (round_ + n) % 3 == 0:
                continue  # some flows idle in some intervals
            repeat = 1 + (round_ * 7 + n) % 5
            send(program, frame, repeat)
            old = sent.get(flow, (0, 0, 0))
            sent[flow] = (old[0] + repeat, old[1] + repeat * len(frame), 0)
        add(drained, datapath.drain_flows(chunk=1 + round_ % 9))  # totals() inside: no key twice per drain
    assert drained == sent
    assert len(sent) == 20


STRESS_FLOWS, STRESS_DRAINS, STRESS_BURST = 8, 300, 2000  # 300 drains that take entries


def test_drains_under_hot_traffic_on_the_other_cpu_count_every_packet_exactly_once(datapath: EbpfDatapath) -> None:
    """The case a single flows map loses (0.35 % of packets for 8 hot flows and 2,000 drains: a packet
    added at the instant the drain deletes its entry): 8 flows hammered through BPF_PROG_TEST_RUN on the
    other CPU while the main thread drains back to back. With the double buffer every packet sent is in
    exactly one drain: the totals are exact, packets and bytes."""
    from_pod, _ = programs(datapath)
    frames = [udp(POD_V4, PEER_V4, 40000 + n, 53, 10 + n) for n in range(STRESS_FLOWS)]
    sent = [0] * STRESS_FLOWS
    stop = threading.Event()
    cpus = sorted(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)

    def traffic() -> None:  # ctypes releases the GIL: the test runs execute while the main thread drains
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[1]})  # this thread only: the other CPU
        while not stop.is_set():
            for n, frame in enumerate(frames):
                send(from_pod, frame, STRESS_BURST)
                sent[n] += STRESS_BURST

    drained: Totals = {}
    busy_drains = 0  # drains that took entries (one with nothing to take returns at once, without a flip)
    worker = threading.Thread(target=traffic)
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
    worker.start()
    deadline = time.monotonic() + 120
    try:
        while busy_drains < STRESS_DRAINS and time.monotonic() < deadline:
            entries = datapath.drain_flows()
            busy_drains += bool(entries)
            add(drained, entries)
    finally:
        stop.set()
        worker.join()
        os.sched_setaffinity(0, mine)
    add(drained, datapath.drain_flows())
    assert busy_drains == STRESS_DRAINS  # every one of them raced the traffic
    assert drained == {key(POD_V4, PEER_V4, 40000 + n, 53, UDP, FROM): (sent[n], sent[n] * len(frames[n]), 0)
                       for n in range(STRESS_FLOWS)}
    assert sum(sent) >= STRESS_DRAINS * STRESS_BURST
    assert datapath.read_counters()[(POD_V4, Direction.EGRESS)].packets == sum(sent)
    assert datapath.flows_lost() == 0


def active_name(dp: EbpfDatapath) -> str:
    """Which flows map the programs add to now (the slot of ``flows``, read from the kernel)."""
    assert dp.flows_map is not None
    return dp.flows_map.name


def flow_maps(dp: EbpfDatapath) -> FlowMaps:
    assert dp.flows is not None
    return dp.flows


def test_a_drain_flips_to_the_other_map_and_takes_the_old_one_an_idle_drain_flips_nothing(
    datapath: EbpfDatapath,
) -> None:
    assert active_name(datapath) == "flows_a"
    expected = fill(datapath, 3)
    assert totals(datapath.drain_flows()) == expected
    assert active_name(datapath) == "flows_b"
    assert datapath.drain_flows() == []
    assert active_name(datapath) == "flows_b"  # nothing to take: no flip (and no grace period to wait for)
    expected = fill(datapath, 2, repeat=4)
    assert totals(datapath.drain_flows()) == expected
    assert active_name(datapath) == "flows_a"
    flows = flow_maps(datapath)
    assert flows.a.is_empty() and flows.b.is_empty() and not flows.standby_dirty


def real_function() -> Any:
    return libbpf().lib.bpf_map_lookup_and_delete_batch


def test_without_batch_support_the_drain_goes_key_by_key(
    datapath: EbpfDatapath, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = fill(datapath, 40)
    calls = []

    def unsupported(*args: Any) -> int:
        calls.append(args)
        return -ENOTSUPP  # as the syscall does: the count passed in is left as it was

    monkeypatch.setattr(libbpf().lib, "bpf_map_lookup_and_delete_batch", unsupported)
    assert totals(datapath.drain_flows()) == expected
    assert len(calls) == 1
    assert datapath.read_flows() == []


def test_a_drain_that_loses_batch_support_midway_finishes_key_by_key_without_doubles(
    datapath: EbpfDatapath, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = fill(datapath, 60)
    real = real_function()
    calls = [0]

    def first_chunk_only(*args: Any) -> int:
        calls[0] += 1
        return int(real(*args)) if calls[0] == 1 else -errno.EINVAL

    monkeypatch.setattr(libbpf().lib, "bpf_map_lookup_and_delete_batch", first_chunk_only)
    assert totals(datapath.drain_flows(chunk=16)) == expected
    assert datapath.read_flows() == []


def test_another_error_keeps_the_rest_for_the_next_drain(
    datapath: EbpfDatapath, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = fill(datapath, 60)
    real = real_function()
    calls = [0]

    def then_fail(*args: Any) -> int:
        calls[0] += 1
        return int(real(*args)) if calls[0] == 1 else -errno.EIO

    with monkeypatch.context() as patch:
        patch.setattr(libbpf().lib, "bpf_map_lookup_and_delete_batch", then_fail)
        with caplog.at_level(logging.WARNING, logger="podmeter.datapath.ebpf"):
            first = totals(datapath.drain_flows(chunk=16))
    assert 0 < len(first) < len(expected)
    assert "the rest waits for the next drain" in caplog.text
    second = totals(datapath.drain_flows())
    assert not first.keys() & second.keys()
    assert {**first, **second} == expected


def test_an_entry_podmeter_did_not_write_is_skipped_not_the_drain(
    datapath: EbpfDatapath, caplog: pytest.LogCaptureFixture
) -> None:
    expected = fill(datapath, 20)
    assert datapath.flows_map is not None
    foreign = bytearray(layout.flow_key(key(POD_V4, PEER_V4, 1, 1, UDP, FROM)))
    foreign[37] = 7  # an observation code the program never writes
    datapath.flows_map.update(bytes(foreign), layout.flow_value(FlowCounts(1, 1, 1, 1, 0)))
    with caplog.at_level(logging.WARNING, logger="podmeter.datapath.ebpf"):
        assert totals(datapath.drain_flows()) == expected
    assert "skipping an entry podmeter did not write" in caplog.text
    assert datapath.flows_map.collect_keys() == []


@pytest.mark.parametrize("enabled", [True, False])
def test_a_drain_leaves_the_garbage_collector_as_it_found_it(datapath: EbpfDatapath, enabled: bool) -> None:
    fill(datapath, 5)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert len(datapath.drain_flows()) == 5
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


# --- pins --------------------------------------------------------------------------------------------------


def test_a_flows_pin_is_reused_at_its_size_and_replaced_otherwise(
    open_flows: Callable[..., EbpfDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    first = open_flows(flow_size=256)
    assert first.insert([POD_V4]).error is None
    expected = fill(first, 5)
    first.close()
    again = open_flows(flow_size=256)
    assert totals(again.read_flows()) == expected  # same size: the undrained entries continue
    again.close()
    with caplog.at_level(logging.WARNING, logger="podmeter.datapath.ebpf"):
        resized = open_flows(flow_size=512)
    assert resized.flow_capacity == 512
    assert resized.read_flows() == []
    assert "pinned map flows" in caplog.text and "its 5 undrained entries are lost" in caplog.text
    assert resized.contents() == {POD_V4}  # the filter is kept (and the counters: same size)
    assert resized.read_counters()[(POD_V4, Direction.EGRESS)].packets == 5


def test_a_flows_pin_of_another_layout_is_replaced_not_refused(
    open_flows: Callable[..., EbpfDatapath], pin_dir: Path
) -> None:
    pin_dir.mkdir(mode=0o700)
    run("bpftool", "map", "create", str(pin_dir / "flows"), "type", "hash", "key", "8", "value", "8",
        "entries", "16", "name", "flows")
    dp = open_flows(flow_size=128)
    assert dp.flows_map is not None
    assert (dp.flows_map.shape.key_size, dp.flows_map.shape.max_entries) == (40, 128)
    assert dp.insert([POD_V4]).error is None
    assert len(fill(dp, 3)) == len(dp.drain_flows()) == 3


def test_a_restart_keeps_the_active_map_and_drains_what_both_maps_hold(
    open_flows: Callable[..., EbpfDatapath],
) -> None:
    """A new agent on the same pins: the map its predecessor had active stays active (clsact filters left
    by a dead agent keep adding to it), its entries are in the first drain, and so is what a drain cut
    short left in the standby map."""
    first = open_flows(flow_size=256)
    assert first.insert([POD_V4]).error is None
    fill(first, 1)
    first.drain_flows()
    assert active_name(first) == "flows_b"
    undrained = fill(first, 5)
    leftover = key(POD_V4, PEER_V4, 1, 2, UDP, FROM)  # as a drain stopped between its flip and its end leaves
    flow_maps(first).a.update(layout.flow_key(leftover), layout.flow_value(FlowCounts(7, 700, 1, 2, 0)))
    first.close()
    again = open_flows(flow_size=256)
    assert active_name(again) == "flows_b"
    assert flow_maps(again).standby_dirty
    assert totals(again.drain_flows()) == {**undrained, leftover: (7, 700, 0)}
    assert not flow_maps(again).standby_dirty
    assert again.drain_flows() == []


@pytest.mark.parametrize("slot", ["empty", "stray map"])
def test_a_slot_map_that_holds_no_pinned_flows_map_is_replaced(
    open_flows: Callable[..., EbpfDatapath], pin_dir: Path, caplog: pytest.LogCaptureFixture, slot: str
) -> None:
    """The kernel does not say which inner layout a map-in-map accepts; only the map in its slot proves
    it. A ``flows`` whose slot is empty or holds a map that is not pinned here is replaced."""
    first = open_flows(flow_size=128)
    slot_id = flow_maps(first).slot.id
    first.close()
    if slot == "empty":
        run("bpftool", "map", "delete", "pinned", str(pin_dir / "flows"), "key", "0", "0", "0", "0")
    else:
        stray = pin_dir / "stray"
        run("bpftool", "map", "create", str(stray), "type", "hash", "key", "40", "value", "40", "entries", "8",
            "name", "stray")
        run("bpftool", "map", "update", "pinned", str(pin_dir / "flows"), "key", "0", "0", "0", "0", "value",
            "pinned", str(stray))
        stray.unlink()
    with caplog.at_level(logging.WARNING, logger="podmeter.datapath.ebpf"):
        dp = open_flows(flow_size=128)
    assert "pinned map flows (type 12" in caplog.text and "replaced by a new one" in caplog.text
    assert flow_maps(dp).slot.id != slot_id and active_name(dp) == "flows_a"
    assert dp.insert([POD_V4]).error is None
    assert len(fill(dp, 3)) == len(dp.drain_flows()) == 3


def test_bpftool_shows_the_active_map_by_id(datapath: EbpfDatapath, pin_dir: Path) -> None:
    """What docs/datapath.md tells an operator to run: the slot's value is the active map's id."""
    fill(datapath, 2)
    datapath.drain_flows()
    dump = json.loads(run("bpftool", "-j", "map", "dump", "pinned", str(pin_dir / "flows")))
    [entry] = dump
    active = json.loads(run("bpftool", "-j", "map", "show", "pinned", str(pin_dir / "flows_b")))
    assert int.from_bytes(bytes(int(byte, 16) for byte in entry["value"]), "little") == active["id"]
    assert json.loads(run("bpftool", "-j", "map", "dump", "pinned", str(pin_dir / "flows_a"))) == []


def test_readers_open_the_pinned_flows_maps(datapath: EbpfDatapath, pin_dir: Path) -> None:
    expected = fill(datapath, 4)
    with EbpfDatapath.open_pinned(pin_dir) as reader:
        assert reader.flow_capacity == datapath.flow_capacity
        assert totals(reader.read_flows()) == expected
        assert reader.flows_lost() == 0
    assert totals(datapath.drain_flows()) == expected


def inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "podmeter", "inspect", *args], capture_output=True,
                          check=False, text=True, timeout=60)


def test_inspect_flows_prints_a_table_and_json_without_draining(datapath: EbpfDatapath, pin_dir: Path) -> None:
    from_pod, to_pod = programs(datapath)
    syn = f.tcp_frame(POD_V4, PEER_V4, 50000, 443, flags=SYN)
    ping = f.icmp_frame(PEER_V6, POD_V6, 128)
    send(from_pod, syn, repeat=2)
    send(to_pod, ping)

    table = inspect("flows", "--bpffs", str(pin_dir))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "flows: 2 of 1024 entries; lost (map full): 0 packets, 0 bytes"
    assert lines[1].split() == ["OBSERVATION", "PROTO", "SOURCE", "DESTINATION", "PACKETS", "BYTES", "FIRST",
                                "LAST", "DETAIL"]
    assert lines[2].split()[:6] == ["from-pod", "TCP", f"{POD_V4}:50000", f"{PEER_V4}:443", "2", str(2 * len(syn))]
    assert lines[2].split()[-1] == "SYN"
    assert lines[3].split()[:6] == ["to-pod", "ICMPv6", PEER_V6, POD_V6, "1", str(len(ping))]
    assert lines[3].split()[-4:] == ["type", "128", "code", "0"]

    as_json = inspect("flows", "--bpffs", str(pin_dir), "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert {k: document[k] for k in ("capacity", "entries", "lost_packets", "lost_bytes")} == {
        "capacity": 1024, "entries": 2, "lost_packets": 0, "lost_bytes": 0}
    tcp_row = document["flows"][0]
    assert {k: tcp_row[k] for k in ("observation", "protocol", "protocol_name", "source", "source_port",
                                    "destination", "destination_port", "packets", "bytes", "tcp_flags",
                                    "tcp_flag_names")} == {
        "observation": "from-pod", "protocol": 6, "protocol_name": "TCP", "source": POD_V4, "source_port": 50000,
        "destination": PEER_V4, "destination_port": 443, "packets": 2, "bytes": 2 * len(syn), "tcp_flags": SYN,
        "tcp_flag_names": ["SYN"]}
    assert 0 < tcp_row["first_ns"] <= tcp_row["last_ns"]
    assert len(datapath.drain_flows()) == 2  # inspect read, the drain takes


def test_inspect_flows_without_a_flows_pin_says_so(datapath: EbpfDatapath, pin_dir: Path) -> None:
    (pin_dir / "flows").unlink()
    result = inspect("flows", "--bpffs", str(pin_dir))
    assert result.returncode == 1
    assert "no flows map pinned" in result.stderr


# --- the agent's capabilities ----------------------------------------------------------------------------

CAPABILITY_CHECK = """
import json
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.datapath import EbpfDatapath, map_sizes
from podmeter.adapters.datapath.ebpf.loader import load
from podmeter.adapters.datapath.ebpf.preflight import BARE_OBJECT_NAME, NOFLOWS_OBJECT_NAME, object_path
load(object_path(BARE_OBJECT_NAME), None, {}, ["pm_parse_only"]).close()
load(object_path(NOFLOWS_OBJECT_NAME), None, {"filter": 8, "counters": 16}, ["pm_from_pod", "pm_to_pod"]).close()
loaded = load(object_path(), None, map_sizes(8, 64), ["pm_from_pod", "pm_to_pod"])
datapath = EbpfDatapath.from_loaded(loaded)
datapath.insert(["10.42.0.5", "fd00:42::5"])
program = loaded.programs["pm_from_pod"]
program.test_run(f.tcp_frame("10.42.0.5", "192.0.2.1", 1000, 80, flags=f.TCP_SYN))
program.test_run(f.ethernet(f.ETH_P_IP, f.ipv4("10.42.0.5", "192.0.2.1", bytes(4) + f.udp(b"o", 2000, 53), ihl=6)))
program.test_run(f.icmp_frame("fd00:42::5", "2001:db8::1", 128))
rows = [list(key[:5]) + [counts.packets, counts.tcp_flags] for key, counts in datapath.drain_flows()]
print(json.dumps(sorted(rows)))
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_the_objects_load_and_aggregate_with_the_agents_capabilities_only() -> None:
    """CAP_BPF and CAP_NET_ADMIN, as the DaemonSet grants: no CAP_PERFMON, so the verifier applies its
    Spectre v1 rules (no variable offset added to a packet pointer, which the parser must not need)."""
    caps = "-all,+bpf,+net_admin"
    result = subprocess.run(["setpriv", "--reuid=0", f"--inh-caps={caps}", f"--ambient-caps={caps}",
                             f"--bounding-set={caps}", sys.executable, "-c", CAPABILITY_CHECK],
                            capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == sorted([
        ["10.42.0.5", "192.0.2.1", 1000, 80, TCP, 1, SYN],
        ["10.42.0.5", "192.0.2.1", 2000, 53, UDP, 1, 0],  # IPv4 options: the transport header copied
        ["fd00:42::5", "2001:db8::1", 128, 0, ICMPV6, 1, 0],
    ])


# --- real pods (the node fixture: two attached pods, TCX and tc) ----------------------------------------


def udp_exchange(topology: Topology, pod: Pod, sizes: list[int]) -> tuple[int, int]:
    """The pod sends each datagram to a host socket, which echoes it; returns (pod port, host port)."""
    with topology.in_host():
        server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with netns(pod.netns_path):
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with server, client:
        server.bind((pod.host_ip, 0))
        client.bind((pod.ip, 0))
        server.settimeout(5)
        client.settimeout(5)
        for size in sizes:
            client.sendto(b"u" * size, server.getsockname())
            data, peer = server.recvfrom(65536)
            server.sendto(data, peer)
            assert client.recvfrom(65536)[0] == data
        return client.getsockname()[1], server.getsockname()[1]


def test_real_udp_flows_at_both_observation_points(node: Node, topology: Topology) -> None:
    sizes = [1, 100, 1000, 1400, 37]
    pod_port, host_port = udp_exchange(topology, node.observed, sizes)
    udp_exchange(topology, node.unobserved, sizes)  # neither end observed: no flow
    expected = (len(sizes), sum(size + UDP_HEADERS for size in sizes), 0)
    pod, host = node.observed.ip, node.observed.host_ip
    assert totals(node.datapath.drain_flows()) == {
        key(pod, host, pod_port, host_port, UDP, FROM): expected,
        key(host, pod, host_port, pod_port, UDP, TO): expected,
    }


class FlowCapture(Capture):
    """The capture of tests/adapters/test_bpf_netns.py, read as flows: what the programs should aggregate."""

    def expected_flows(self, observed: str) -> Totals:
        out: Totals = {}
        for frame, length, outgoing in self._drain():
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":
                continue
            ihl = (frame[14] & 0x0F) * 4
            protocol = frame[23]
            src, dst = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
            if observed not in (src, dst):
                continue
            l4 = frame[14 + ihl :]
            sport, dport = struct.unpack("!HH", l4[:4]) if protocol in (TCP, UDP) else (0, 0)
            flags = l4[13] if protocol == TCP else 0
            flow = key(src, dst, sport, dport, protocol, TO if outgoing else FROM)
            old = out.get(flow, (0, 0, 0))
            out[flow] = (old[0] + 1, old[1] + length, old[2] | flags)
        return out


def tcp_connection(topology: Topology, pod: Pod, upload: int, download: int) -> tuple[int, int]:
    """A TCP connection from the pod to a host server, closed by both; returns (pod port, host port)."""
    with topology.in_host():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with netns(pod.netns_path):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(65536):
                pass
            conn.sendall(b"d" * download)

    with listener, client:
        listener.bind((pod.host_ip, 0))
        listener.listen(1)
        server = threading.Thread(target=serve)
        server.start()
        client.settimeout(10)
        client.connect(listener.getsockname())
        ports = client.getsockname()[1], listener.getsockname()[1]
        client.sendall(b"u" * upload)
        client.shutdown(socket.SHUT_WR)
        while client.recv(65536):
            pass
        server.join(10)
    return ports


def settle(datapath: EbpfDatapath, capture: FlowCapture, observed: str) -> tuple[Totals, Totals]:
    """Drain and read the capture until both agree (the last ACKs may still be on their way)."""
    drained: Totals = {}
    expected: Totals = {}
    for _ in range(40):
        add(drained, datapath.drain_flows())
        for flow, (packets, size, flags) in capture.expected_flows(observed).items():
            old = expected.get(flow, (0, 0, 0))
            expected[flow] = (old[0] + packets, old[1] + size, old[2] | flags)
        if drained == expected:
            break
        time.sleep(0.05)
    return drained, expected


def test_real_tcp_flows_match_an_independent_capture(node: Node, topology: Topology) -> None:
    capture = FlowCapture(topology, node.observed.host_veth)
    try:
        pod_port, host_port = tcp_connection(topology, node.observed, upload=200_000, download=80_000)
        tcp_connection(topology, node.unobserved, upload=1000, download=1000)
        drained, expected = settle(node.datapath, capture, node.observed.ip)
    finally:
        capture.close()
    assert drained == expected
    pod, host = node.observed.ip, node.observed.host_ip
    assert set(drained) == {key(pod, host, pod_port, host_port, TCP, FROM),
                            key(host, pod, host_port, pod_port, TCP, TO)}
    for _, _, flags in drained.values():
        assert flags & SYN and flags & FIN and flags & ACK
    assert drained[key(pod, host, pod_port, host_port, TCP, FROM)][1] > 200_000
    assert drained[key(host, pod, host_port, pod_port, TCP, TO)][1] > 80_000


def icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\x00"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ping(pod: Pod, count: int, payload: bytes) -> None:
    """``count`` echo requests from the pod to its host address over a raw socket; waits for each reply."""
    with netns(pod.netns_path):
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with sock:
        sock.settimeout(5)
        for seq in range(1, count + 1):
            header = struct.pack("!BBHHH", 8, 0, 0, 0x706D, seq)
            checksum = icmp_checksum(header + payload)
            sock.sendto(struct.pack("!BBHHH", 8, 0, checksum, 0x706D, seq) + payload, (pod.host_ip, 0))
            while True:  # a raw socket also sees other ICMP: wait for our reply
                packet = sock.recv(65536)
                icmp = packet[(packet[0] & 0x0F) * 4 :]
                if icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (0x706D, seq):
                    break


def test_real_icmp_echo_flows_at_both_observation_points(node: Node, topology: Topology) -> None:
    payload = b"p" * 56
    ping(node.observed, 3, payload)
    ping(node.unobserved, 3, payload)
    frame = 14 + 20 + 8 + len(payload)
    pod, host = node.observed.ip, node.observed.host_ip
    assert totals(node.datapath.drain_flows()) == {
        key(pod, host, 8, 0, ICMP, FROM): (3, 3 * frame, 0),
        key(host, pod, 0, 0, ICMP, TO): (3, 3 * frame, 0),
    }
    assert node.datapath.read_counters() == {
        (pod, Direction.EGRESS): Traffic(3, 3 * frame),
        (pod, Direction.INGRESS): Traffic(3, 3 * frame),
    }
