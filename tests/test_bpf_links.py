"""The rtnetlink link reader of the attach manager, against the kernel and against a second opinion.

``dump_links`` must agree with ``ip -j link`` (iproute2, an independent reader of the same kernel
table), and the notifications it parses must describe each change as the kernel made it.
"""

from __future__ import annotations

import json
import struct

from podmeter.adapters.datapath.ebpf.links import LinkChange, changes, dump_links, link_events, read_changes
from test_bpf_support import Topology, needs_root, run, unique

pytestmark = needs_root
pytest_plugins = ["test_bpf_support"]  # its fixtures: topology


def ip_links(topology: Topology) -> dict[int, tuple[str, str | None]]:
    rows = json.loads(run("ip", "-n", topology.host, "-j", "-d", "link", "show"))
    return {row["ifindex"]: (row["ifname"], (row.get("linkinfo") or {}).get("info_kind")) for row in rows}


def test_dump_agrees_with_iproute2(topology: Topology) -> None:
    for _ in range(5):
        topology.add_pod()
    run("ip", "-n", topology.host, "link", "add", unique("qd"), "type", "veth", "peer", "name", unique("qd"))
    with topology.in_host():
        mine = dump_links()
    theirs = ip_links(topology)
    assert mine == theirs
    assert sum(1 for _, kind in mine.values() if kind == "veth") == 7
    assert ("lo", None) in mine.values()


def test_notifications_describe_each_change(topology: Topology) -> None:
    name, peer = unique("pme"), unique("qe")
    with topology.in_host(), link_events() as events:
        run("ip", "-n", topology.host, "link", "add", name, "type", "veth", "peer", "name", peer)
        with topology.in_host():
            index = {n: i for i, (n, _) in dump_links().items()}[name]
        run("ip", "-n", topology.host, "link", "set", name, "name", name + "r")
        run("ip", "-n", topology.host, "link", "del", name + "r")
        found = read_changes(events)
    assert found is not None
    mine = [c for c in found if c.index == index]
    assert mine[0] == LinkChange(index, (name, "veth"))
    assert LinkChange(index, (name + "r", "veth")) in mine
    assert mine[-1] == LinkChange(index, None)


def test_malformed_messages_end_the_walk_instead_of_looping() -> None:
    header = struct.pack("=IHHII", 8, 16, 0, 0, 0)  # a length shorter than the header itself
    assert list(changes(memoryview(header + bytes(64)))) == []
    body = bytes(4) + struct.pack("=i", 7) + bytes(8) + struct.pack("=HH", 2, 3)  # an attribute of length 2
    message = struct.pack("=IHHII", 16 + len(body), 16, 0, 0, 0) + body
    assert list(changes(memoryview(message))) == [LinkChange(7, ("", None))]
