"""Key and value layouts (pure: no kernel needed) and the interface rule of the attach manager."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.adapters.datapath.ebpf import InterfaceRule, layout
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.links import LinkInfo
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.records import canonical_ip

addresses = st.one_of(
    st.ip_addresses(v=4),
    st.ip_addresses(v=6),
    st.integers(0, 2**32 - 1).map(ipaddress.IPv6Address),  # ::a.b.c.d, where inet_ntop differs
)


@given(addresses)
def test_every_canonical_ip_survives_a_round_trip_through_the_key_bytes(address: object) -> None:
    ip = canonical_ip(str(address))
    assert layout.address_text(layout.address_bytes(ip)) == ip
    assert layout.decode_filter_key(layout.filter_key(ip)) == ip
    for direction in Direction:
        assert layout.decode_counter_key(layout.counter_key(ip, direction)) == (ip, direction)


def test_key_bytes_are_the_c_structs() -> None:
    """struct filter_key {u32 prefixlen; u8 addr[16]}, struct counter_key {u8 addr[16]; u32 direction}."""
    mapped = bytes(10) + b"\xff\xff" + bytes([10, 1, 2, 3])
    assert layout.filter_key("10.1.2.3") == struct.pack("=I", 128) + mapped
    assert layout.counter_key("10.1.2.3", Direction.EGRESS) == mapped + struct.pack("=I", 1)
    assert layout.counter_key("fd00::1", Direction.INGRESS) == (
        ipaddress.IPv6Address("fd00::1").packed + struct.pack("=I", 0)
    )


@pytest.mark.parametrize("bad", ["10.1.2", "10.1.2.3/32", "fd00::g", "", "pod-a"])
def test_anything_but_an_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not an IP address"):
        layout.filter_key(bad)


def test_a_prefix_entry_is_not_read_as_a_host() -> None:
    raw = struct.pack("=I", 120) + layout.address_bytes("fd00::")
    with pytest.raises(ValueError, match="prefixlen 120"):
        layout.decode_filter_key(raw)


def test_per_cpu_values_are_summed() -> None:
    raw = b"".join(layout.COUNTER_VALUE.pack(p, b) for p, b in [(1, 100), (0, 0), (5, 7)])
    assert layout.sum_per_cpu(raw) == Traffic(6, 107)


def test_interface_rule() -> None:
    """Pod links by what they are, whatever their names (more in tests/adapters/test_bpf_cni.py)."""
    rule = InterfaceRule()
    for name in ("pm1234x5", "veth9a8b7c", "lxc12ab", "cali0123", "eni1a2b3c4d5e6", "azv0a1b2c3d4e", "3f2a9c1b0d4e5f6"):
        assert rule.selects(LinkInfo(name, "veth", 3, 2))  # the peer in another netns
    assert rule.selects(LinkInfo("lxc12ab", "netkit", 3, 2, netkit_mode=0, netkit_primary=True))
    assert not rule.selects(LinkInfo("veth9a8b7c", "veth"))  # both ends here
    assert not rule.selects(LinkInfo("eth0", "veth", 0, 7), uplink=True)  # a node that is a container: its uplink
    assert not rule.selects(LinkInfo("pm-bridge", "bridge"))
    assert not rule.selects(LinkInfo("pmvx", None))
    patterns = InterfaceRule(patterns=("eni*",))
    assert patterns.selects(LinkInfo("eni1", "veth")) and patterns.selects(LinkInfo("eni2", None))
    assert not patterns.selects(LinkInfo("veth1", "veth", 3, 2))  # patterns replace the detection
    explicit = InterfaceRule(explicit=("ens5",))
    assert explicit.selects(LinkInfo("ens5", None))


def test_frames_carry_vlan_tags_outer_first() -> None:
    frame = f.udp_frame("10.0.0.1", "10.0.0.2", size=0, vlans=[10, 20])
    assert frame[12:14] == b"\x88\xa8"
    assert frame[14:18] == struct.pack("!HH", 10, 0x8100)
    assert frame[18:22] == struct.pack("!HH", 20, 0x0800)
    assert len(frame) == 14 + 8 + 20 + 8
