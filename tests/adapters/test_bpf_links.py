"""The rtnetlink link reader of the attach manager, against the kernel and against a second opinion.

``dump_links``/``read_links`` must agree with ``ip -j -d link`` (iproute2, an independent reader of the
same kernel table), names, kinds and where each peer is, and the notifications it parses must describe
each change as the kernel made it.
"""

from __future__ import annotations

import json
import struct
import subprocess
import threading
from typing import Any

import pytest

from bpf_support import Topology, needs_root, run, unique
from podmeter.adapters.datapath.ebpf import links
from podmeter.adapters.datapath.ebpf.links import (
    LinkChange,
    LinkInfo,
    changes,
    dump_links,
    link_events,
    read_changes,
    read_links,
)

pytestmark = needs_root


def ip_rows(topology: Topology) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(run("ip", "-n", topology.host, "-j", "-d", "link", "show"))
    return rows


def ip_links(topology: Topology) -> dict[int, tuple[str, str | None]]:
    return {row["ifindex"]: (row["ifname"], (row.get("linkinfo") or {}).get("info_kind")) for row in ip_rows(topology)}


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


def test_peers_agree_with_iproute2(topology: Topology) -> None:
    """Where each link's peer is: in another netns (its id and the peer's index there) or here (none)."""
    pods = [topology.add_pod() for _ in range(3)]
    run("ip", "-n", topology.host, "link", "add", unique("qd"), "type", "veth", "peer", "name", unique("qd"))
    with topology.in_host():
        mine = read_links()
    for row in ip_rows(topology):
        link = mine[row["ifindex"]]
        assert link.name == row["ifname"]
        assert link.peer_netnsid == row.get("link_netnsid")
        assert link.peer_index == (row.get("link_index") if "link_netnsid" in row else None)
    elsewhere = {link.name for link in mine.values() if link.peer_elsewhere}
    assert elsewhere == {pod.host_veth for pod in pods}


def test_qdisc_kinds_agree_with_iproute2(topology: Topology) -> None:
    """The one question the attach manager asks about qdiscs (is a legacy ``ingress`` in clsact's way?),
    answered per interface as ``tc qdisc show dev`` answers it."""
    plain, legacy, both = (topology.add_pod() for _ in range(3))
    run("ip", "netns", "exec", topology.host, "tc", "qdisc", "add", "dev", legacy.host_veth, "ingress")
    run("ip", "netns", "exec", topology.host, "tc", "qdisc", "add", "dev", both.host_veth, "root", "pfifo")
    run("ip", "netns", "exec", topology.host, "tc", "qdisc", "add", "dev", both.host_veth, "clsact")
    indexes = {row["ifname"]: row["ifindex"] for row in ip_rows(topology)}
    with topology.in_host(), links.Rtnl() as rtnl:
        mine = {pod.host_veth: rtnl.qdisc_kinds(indexes[pod.host_veth]) for pod in (plain, legacy, both)}
    for pod in (plain, legacy, both):
        rows = json.loads(run("ip", "netns", "exec", topology.host, "tc", "-j", "qdisc", "show", "dev", pod.host_veth))
        assert mine[pod.host_veth] == {row["kind"] for row in rows}
    assert "ingress" in mine[legacy.host_veth] and "ingress" not in mine[plain.host_veth]
    assert {"pfifo", "clsact"} <= mine[both.host_veth]


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
    assert mine[0] == LinkChange(index, LinkInfo(name, "veth"))
    assert LinkChange(index, LinkInfo(name + "r", "veth")) in mine
    assert mine[-1] == LinkChange(index, None)


def test_malformed_messages_end_the_walk_instead_of_looping() -> None:
    header = struct.pack("=IHHII", 8, 16, 0, 0, 0)  # a length shorter than the header itself
    assert list(changes(memoryview(header + bytes(64)))) == []
    body = bytes(4) + struct.pack("=i", 7) + bytes(8) + struct.pack("=HH", 2, 3)  # an attribute of length 2
    message = struct.pack("=IHHII", 16 + len(body), 16, 0, 0, 0) + body
    assert list(changes(memoryview(message))) == [LinkChange(7, LinkInfo("", None))]


def test_links_that_exist_throughout_are_in_every_dump_taken_during_churn(topology: Topology) -> None:
    """Dumps taken while other links come and go (the kernel marks them interrupted) are redone, so a
    stable link is never missing: the attach manager would detach from it."""
    stable = {topology.add_pod().host_veth for _ in range(15)}
    stop = threading.Event()

    def churn() -> None:
        name = unique("qc")
        while not stop.is_set():
            subprocess.run(["ip", "-n", topology.host, "link", "add", name, "type", "veth", "peer", "name",
                            name + "p"], check=False, capture_output=True)
            subprocess.run(["ip", "-n", topology.host, "link", "del", name], check=False, capture_output=True)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        with topology.in_host():
            for _ in range(40):
                names = {name for name, _ in dump_links().values()}
                assert stable <= names
    finally:
        stop.set()
        worker.join()


def test_an_interrupted_dump_is_taken_again(monkeypatch: pytest.MonkeyPatch) -> None:
    lo, pm1 = LinkInfo("lo"), LinkInfo("pm1", "veth", 0, 2)
    answers = [({1: lo}, False), ({1: lo}, False), ({1: lo, 2: pm1}, True)]
    monkeypatch.setattr(links, "_dump_once", lambda: answers.pop(0))
    assert dump_links() == {1: ("lo", None), 2: ("pm1", "veth")}
    always_interrupted = [({1: lo}, False)] * links.DUMP_ATTEMPTS
    monkeypatch.setattr(links, "_dump_once", lambda: always_interrupted.pop(0))
    assert dump_links() == {1: ("lo", None)}  # the last one is used: notifications correct it
    assert always_interrupted == []
