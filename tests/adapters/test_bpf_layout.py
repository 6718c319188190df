"""Key and value layouts (pure: no kernel needed), checked against the built objects' BTF, and the interface
rule of the attach manager."""

from __future__ import annotations

import ipaddress
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.adapters.datapath.ebpf import InterfaceRule, btf, drops, layout, loader, preflight
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.errors import LoadFailed
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


# --- the layouts against the built objects' BTF (Cilium's alignchecker, for podmeter's mirrors) -------------

OBJECTS = sorted(Path(preflight.object_path()).parent.glob("*.bpf.o"))


@pytest.fixture
def fresh_checks() -> Iterator[None]:
    """The loader caches each object's check; a test that changes a mirror must not leave its answer."""
    loader._drift.cache_clear()
    try:
        yield
    finally:
        loader._drift.cache_clear()


@pytest.mark.parametrize("path", OBJECTS, ids=[path.name for path in OBJECTS])
def test_every_map_of_the_shipped_objects_is_laid_out_as_the_python_side_reads_it(path: Path) -> None:
    maps = btf.read_object_btf(path).maps()
    mirrors = layout.all_mirrors()
    assert set(maps) <= set(mirrors), f"maps without a mirror in layout.py: {set(maps) - set(mirrors)}"
    assert layout.drift(maps, mirrors) == []
    loader.check_layouts(path)  # what every load does first


def test_the_objects_define_the_maps_the_python_side_mirrors() -> None:
    """Each mirror is checked against some object (a stale mirror of a map no object has would pass)."""
    defined = {name for path in OBJECTS for name in btf.read_object_btf(path).maps()}
    assert set(layout.all_mirrors()) == defined


def test_the_object_btf_has_the_documented_structs() -> None:
    """struct flow_key as docs/datapath.md draws it, read from the object (not from the Python formats)."""
    flows = btf.read_object_btf(preflight.object_path()).maps()["flows_a"]
    assert flows.key is not None and flows.value is not None
    assert flows.key.name == "struct flow_key" and flows.key.size == 40
    assert [(m.name, m.offset, m.size) for m in flows.key.members] == [
        ("src", 0, 16), ("dst", 16, 16), ("sport", 32, 2), ("dport", 34, 2), ("protocol", 36, 1),
        ("observation", 37, 1), ("pad", 38, 2)]
    assert flows.value.name == "struct flow_value" and [m.name for m in flows.value.members] == [
        "packets", "bytes", "first_ns", "last_ns", "tcp_flags"]
    drops_maps = btf.read_object_btf(preflight.object_path(drops.OBJECT_NAME)).maps()
    assert drops_maps["drop_flows"].value == flows.value  # one struct flow_value (bpf/podmeter_flow.h)
    assert layout.drop_mirrors()["drop_flows"][1] == layout.Mirror("drops.DROP_FLOW_VALUE", drops.DROP_FLOW_VALUE)


def test_a_moved_field_is_named_with_its_struct_and_offsets() -> None:
    maps = btf.read_object_btf(preflight.object_path()).maps()
    swapped = layout.Mirror("layout.FLOW_KEY", struct.Struct("=16s16sHBHB2x"))  # dport and protocol swapped
    problems = layout.drift(maps, {"flows_a": (swapped, None)})
    assert problems == [
        "map flows_a key: struct flow_key member dport is at offset 34 (2 bytes) in the object but field 3 of "
        "layout.FLOW_KEY ('=16s16sHBHB2x') is at offset 34 (1 byte)",
        "map flows_a key: struct flow_key member protocol is at offset 36 (1 byte) in the object but field 4 of "
        "layout.FLOW_KEY ('=16s16sHBHB2x') is at offset 35 (2 bytes)",
    ]
    longer = layout.Mirror("layout.COUNTER_VALUE", struct.Struct("=QQQ"))
    assert layout.drift(maps, {"counters": (None, longer)}) == [
        "map counters value: struct counter_value is 16 bytes in the object but layout.COUNTER_VALUE ('=QQQ') "
        "is 24 bytes",
        "map counters value: layout.COUNTER_VALUE field 2 (offset 16, 8 bytes) has no member in struct "
        "counter_value",
    ]
    scalar = layout.Mirror("drops.COUNT", struct.Struct("=I"))
    assert layout.drift(maps, {"flows_share": (None, scalar)}) == [
        "map flows_share value: __u64 is 8 bytes in the object but drops.COUNT ('=I') is 4 bytes"]


def test_an_object_whose_layout_drifted_is_refused_before_it_is_opened(
    monkeypatch: pytest.MonkeyPatch, fresh_checks: None
) -> None:
    monkeypatch.setitem(layout.MAP_MIRRORS, "counters", (
        layout.Mirror("layout.COUNTER_KEY", struct.Struct("=16sH2x")), layout.MAP_MIRRORS["counters"][1]))
    with pytest.raises(loader.LayoutMismatch, match=r"struct counter_key member direction is at offset 16 "
                                                    r"\(4 bytes\) in the object but field 1 of layout.COUNTER_KEY"):
        loader.BpfObject(preflight.object_path())
    assert issubclass(loader.LayoutMismatch, LoadFailed)  # the agent refuses to start; drops are then off


def test_the_drop_tracers_mirrors_are_drops_py_formats(monkeypatch: pytest.MonkeyPatch, fresh_checks: None) -> None:
    """drops.py's formats are read where they are (a change there is checked against its object too)."""
    monkeypatch.setattr(drops, "DROP_KEY", struct.Struct(f"={layout.ADDRESS_BYTES}sIB"))
    with pytest.raises(loader.LayoutMismatch, match="map drops key: struct drop_key is 24 bytes in the object"):
        loader.check_layouts(preflight.object_path(drops.OBJECT_NAME))


def test_struct_formats_are_read_item_by_item() -> None:
    assert layout.format_fields(layout.FLOW_KEY) == [(0, 16), (16, 16), (32, 2), (34, 2), (36, 1), (37, 1), (38, 2)]
    assert layout.format_fields(struct.Struct("<2Q I")) == [(0, 8), (8, 8), (16, 4)]
    with pytest.raises(ValueError, match="native alignment"):
        layout.format_fields(struct.Struct("QI"))


def test_what_is_not_an_object_with_btf_says_so(tmp_path: Path) -> None:
    text = tmp_path / "x.o"
    text.write_text("not an object")
    with pytest.raises(btf.BtfError, match="not an ELF file"):
        btf.read_object_btf(text)
    with pytest.raises(btf.BtfError, match=r"has no \.BTF section"):
        btf.read_object_btf(os.path.realpath(sys.executable))  # an ELF file without BTF
    with pytest.raises(LoadFailed, match="cannot read the BTF of"):
        loader.check_layouts(text)
