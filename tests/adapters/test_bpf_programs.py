"""The counting programs on synthetic frames (BPF_PROG_TEST_RUN) against the real pinned maps.

Every frame must pass (TC_ACT_UNSPEC, -1); a frame is counted exactly when its pod-side address (source
at tc ingress, destination at tc egress) is in the filter, and then by exactly its length.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bpf_support import needs_root
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.loader import Program
from podmeter.model.datapath import Direction, Traffic

pytestmark = needs_root

TC_ACT_UNSPEC = -1
POD_V4, OTHER_V4, PEER_V4 = "10.40.0.5", "10.40.0.6", "192.0.2.9"
POD_V6, OTHER_V6, PEER_V6 = "fd00:40::5", "fd00:40::6", "2001:db8::9"


@pytest.fixture
def datapath(open_datapath: Callable[..., EbpfDatapath]) -> EbpfDatapath:
    dp = open_datapath(64)
    assert dp.insert([POD_V4, POD_V6]).error is None
    return dp


def programs(dp: EbpfDatapath) -> tuple[Program, Program]:
    assert dp.programs is not None
    return dp.programs.from_pod, dp.programs.to_pod


def run(program: Program, frame: bytes, repeat: int = 1) -> None:
    assert program.test_run(frame, repeat).retval == TC_ACT_UNSPEC


@pytest.mark.parametrize(("pod", "peer"), [(POD_V4, PEER_V4), (POD_V6, PEER_V6)], ids=["v4", "v6"])
def test_observed_pod_is_counted_per_direction_exactly(datapath: EbpfDatapath, pod: str, peer: str) -> None:
    from_pod, to_pod = programs(datapath)
    leaving = f.udp_frame(pod, peer, size=100)
    entering = f.udp_frame(peer, pod, size=300)
    run(from_pod, leaving, repeat=7)
    run(to_pod, entering, repeat=3)
    assert datapath.read_counters() == {
        (pod, Direction.EGRESS): Traffic(7, 7 * len(leaving)),
        (pod, Direction.INGRESS): Traffic(3, 3 * len(entering)),
    }
    run(from_pod, leaving)
    assert datapath.read_counters()[(pod, Direction.EGRESS)] == Traffic(8, 8 * len(leaving))


@pytest.mark.parametrize(("other", "peer"), [(OTHER_V4, PEER_V4), (OTHER_V6, PEER_V6)], ids=["v4", "v6"])
def test_unobserved_pod_is_not_counted(datapath: EbpfDatapath, other: str, peer: str) -> None:
    from_pod, to_pod = programs(datapath)
    run(from_pod, f.udp_frame(other, peer), repeat=5)
    run(to_pod, f.udp_frame(peer, other), repeat=5)
    assert datapath.read_counters() == {}


def test_each_hook_keys_on_the_pod_side_address_only(datapath: EbpfDatapath) -> None:
    """tc ingress counts by source, tc egress by destination: an observed peer on the far side is not."""
    from_pod, to_pod = programs(datapath)
    run(from_pod, f.udp_frame(OTHER_V4, POD_V4))  # leaving an unobserved pod towards an observed one
    run(to_pod, f.udp_frame(POD_V4, OTHER_V4))  # entering an unobserved pod from an observed one
    assert datapath.read_counters() == {}


def test_non_ip_frames_pass_uncounted(datapath: EbpfDatapath) -> None:
    from_pod, to_pod = programs(datapath)
    # An ARP frame whose bytes, misread as IPv4, would carry the observed address as source.
    looks_like_ip = f.ipv4(POD_V4, POD_V4, b"")
    for program in (from_pod, to_pod):
        run(program, f.ethernet(f.ETH_P_ARP, looks_like_ip))
        run(program, f.ethernet(0x88CC, b"\x00" * 40))  # LLDP
    assert datapath.read_counters() == {}


def test_shortest_frames_pass_uncounted(datapath: EbpfDatapath) -> None:
    """The kernel's test runner accepts a bare header for non-IP ethertypes: a 14-byte frame."""
    from_pod, to_pod = programs(datapath)
    for program in (from_pod, to_pod):
        run(program, f.ethernet(f.ETH_P_ARP, b""))
        run(program, f.ethernet(f.ETH_P_8021Q, b""))  # a VLAN tpid and no tag at all
        run(program, f.ethernet(f.ETH_P_8021Q, b"\x00\x01\x08"))  # a tag cut in the middle
    assert datapath.read_counters() == {}


@pytest.mark.parametrize("family", ["v4", "v6"])
def test_truncated_ip_headers_pass_uncounted(datapath: EbpfDatapath, family: str) -> None:
    """Headers cut short (behind a VLAN tag, where the kernel's runner does not check them)."""
    from_pod, to_pod = programs(datapath)
    if family == "v4":
        header, ethertype = f.ipv4(POD_V4, POD_V4, b""), f.ETH_P_IP
    else:
        header, ethertype = f.ipv6(POD_V6, POD_V6, b""), f.ETH_P_IPV6
    for cut in (1, len(header) // 2, len(header) - 1):
        for program in (from_pod, to_pod):
            run(program, f.ethernet(ethertype, header[:cut], vlans=[7]))
    assert datapath.read_counters() == {}


def test_malformed_ip_headers_pass_uncounted(datapath: EbpfDatapath) -> None:
    from_pod, _ = programs(datapath)
    payload = f.udp(b"x" * 20)
    run(from_pod, f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, payload, version=6)))
    run(from_pod, f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, payload, ihl=4)))
    run(from_pod, f.ethernet(f.ETH_P_IPV6, f.ipv6(POD_V6, PEER_V6, payload, version=4)))
    assert datapath.read_counters() == {}


@pytest.mark.parametrize("vlans", [[100], [10, 20]], ids=["802.1Q", "QinQ"])
def test_vlan_tagged_frames_count_by_inner_address(datapath: EbpfDatapath, vlans: list[int]) -> None:
    """Up to two in-band tags are skipped (an offloaded tag never shows in the frame at all)."""
    from_pod, to_pod = programs(datapath)
    leaving = f.udp_frame(POD_V4, PEER_V4, vlans=vlans)
    entering = f.udp_frame(PEER_V6, POD_V6, vlans=vlans)
    run(from_pod, leaving)
    run(to_pod, entering)
    assert datapath.read_counters() == {
        (POD_V4, Direction.EGRESS): Traffic(1, len(leaving)),
        (POD_V6, Direction.INGRESS): Traffic(1, len(entering)),
    }


def test_three_vlan_tags_pass_uncounted(datapath: EbpfDatapath) -> None:
    from_pod, _ = programs(datapath)
    run(from_pod, f.udp_frame(POD_V4, PEER_V4, vlans=[1, 2, 3]))
    assert datapath.read_counters() == {}


def test_counting_stops_when_the_ip_leaves_and_restarts_from_zero(datapath: EbpfDatapath) -> None:
    """Delete + take (what the writer does) ends counting; a new owner of the IP starts at zero."""
    from_pod, _ = programs(datapath)
    frame = f.udp_frame(POD_V4, PEER_V4)
    run(from_pod, frame, repeat=4)
    assert datapath.delete([POD_V4]).applied == 1
    assert datapath.take_counters([POD_V4]) == {(POD_V4, Direction.EGRESS): Traffic(4, 4 * len(frame))}
    run(from_pod, frame, repeat=4)
    assert datapath.read_counters() == {}
    assert datapath.insert([POD_V4]).error is None
    run(from_pod, frame)
    assert datapath.read_counters() == {(POD_V4, Direction.EGRESS): Traffic(1, len(frame))}


def test_ipv4_options_do_not_matter(datapath: EbpfDatapath) -> None:
    """Only the fixed header is read: a packet with options (IHL 6) counts like any other."""
    from_pod, _ = programs(datapath)
    frame = f.ethernet(f.ETH_P_IP, f.ipv4(POD_V4, PEER_V4, b"\x01\x01\x01\x00" + f.udp(b"o"), ihl=6))
    run(from_pod, frame)
    assert datapath.read_counters() == {(POD_V4, Direction.EGRESS): Traffic(1, len(frame))}
