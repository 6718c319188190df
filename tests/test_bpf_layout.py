"""Key and value layouts (pure: no kernel needed) and the interface rule of the attach manager."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.adapters.datapath.ebpf import InterfaceRule, layout
from podmeter.adapters.datapath.ebpf import frames as f
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
    rule = InterfaceRule()
    assert rule.matches("pm1234x5", "veth")
    assert rule.matches("veth9a8b7c", "veth")
    assert rule.matches("lxc12ab", "veth")
    assert rule.matches("cali0123", "veth")
    assert not rule.matches("eth0", "veth")
    assert not rule.matches("pm-bridge", "bridge")  # the name matches, but it is not a veth
    assert not rule.matches("pmvx", None)
    explicit = InterfaceRule(patterns=(), explicit=("ens5",))
    assert explicit.matches("ens5", None)
    assert not explicit.matches("veth1", "veth")


def test_frames_carry_vlan_tags_outer_first() -> None:
    frame = f.udp_frame("10.0.0.1", "10.0.0.2", size=0, vlans=[10, 20])
    assert frame[12:14] == b"\x88\xa8"
    assert frame[14:18] == struct.pack("!HH", 10, 0x8100)
    assert frame[18:22] == struct.pack("!HH", 20, 0x0800)
    assert len(frame) == 14 + 8 + 20 + 8
