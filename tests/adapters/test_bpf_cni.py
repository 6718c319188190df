"""Any CNI: pod links are found by what they are, not by their names.

A pod link is a veth (or netkit) whose peer lives in another network namespace; the node's other links
(a veth with both ends on the node, a bridge, an ifb, a dummy, the uplink of a node that is itself a
container) are left alone. Real namespaces and packets: veth pairs named as AWS VPC CNI, Azure CNI,
Antrea, OVN-Kubernetes, Calico, Cilium and the bridge plugin name them are attached and count exactly.
Such a veth is a pod's only if it carries one of the node's pod IPs: routed (a /32 to the host side),
bridged (the real bridge CNI plugin, called as a runtime calls it) and a late address are attached, a
veth into a namespace that is no pod is not, and is counted as skipped. And the other half of "never
silently count nothing": which observed pods' IPs reach no attached link, from the attach manager and
from a real `podmeter agent` (metric and /debug/state).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_harness import AgentHarness, Cluster
from bpf_support import UDP_HEADERS, Pod, Topology, get_in_host, needs_root, run, udp_echo, unique
from lab_server import LabServer
from metrics_support import metric
from podmeter.adapters.datapath.ebpf import AttachManager, AttachMode, EbpfDatapath, InterfaceRule, LinkSelection
from podmeter.adapters.datapath.ebpf import links as nl
from podmeter.adapters.datapath.ebpf.links import LinkInfo, changes
from podmeter.model.datapath import Direction, LinkCounts, Traffic
from podmeter.runtime.datapaths import open_datapath as open_agent_datapath
from podmeter.runtime.settings import DatapathSettings
from waiting import stop_process, wait_for

Opener = Callable[..., EbpfDatapath]


def cni_names() -> dict[str, str]:
    """How CNIs name the host side of a pod's link (unique to this process, at most 15 characters)."""
    serial = unique("")  # "<pid>x<n>"
    digits = "".join(c for c in serial if c.isdigit())
    return {
        "aws-vpc-cni": f"eni{digits}"[:15],  # eni + a hash of the pod
        "azure-cni": f"azv{digits}"[:15],  # azv + a hash of the container
        "antrea": f"web-{digits}"[:15],  # the pod's name, a dash and a hash
        "ovn-kubernetes": f"{int(digits):015x}"[-15:],  # the sandbox id's first 15 characters
        "calico": f"cali{digits}"[:15],
        "cilium": f"lxc{digits}"[:15],
        "bridge-plugin": f"veth{digits}"[:15],  # flannel, kindnet...
    }


@pytest.fixture(params=[AttachMode.TCX, AttachMode.TC], ids=["tcx", "tc"])
def mode(request: pytest.FixtureRequest) -> AttachMode:
    param: AttachMode = request.param
    return param


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    wait_for(condition, timeout)


@needs_root
def test_pod_links_named_like_other_cnis_are_attached_and_count_exactly(
        topology: Topology, open_datapath: Opener, mode: AttachMode) -> None:
    datapath = open_datapath(64)
    assert datapath.programs is not None
    pods = {cni: topology.add_pod(host_veth=name) for cni, name in cni_names().items()}
    assert datapath.insert([pod.ip for pod in pods.values()]).error is None
    sizes = [1, 300, 1400]
    with AttachManager(datapath.programs, mode=mode, netns=topology.host_path) as manager:
        assert set(manager.attached()) == {pod.host_veth for pod in pods.values()}
        assert manager.errors == {}
        for pod in pods.values():
            udp_echo(topology, pod, sizes)
    one_round = Traffic(len(sizes), sum(size + UDP_HEADERS for size in sizes))
    assert datapath.read_counters() == {
        (pod.ip, direction): one_round for pod in pods.values() for direction in Direction
    }


def add_link(topology: Topology, *args: str) -> bool:
    """``ip link add`` in the host netns; False when this kernel lacks the kind (no module)."""
    result = subprocess.run(["ip", "-n", topology.host, "link", "add", *args], capture_output=True, text=True)
    if result.returncode != 0 and "Unknown device type" in result.stderr:
        return False
    assert result.returncode == 0, result.stderr
    return True


@pytest.fixture
def outside() -> Iterator[str]:
    """A namespace for the far end of the node's uplink (the host a node container runs on)."""
    name = unique("pmo")
    run("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@needs_root
def test_links_of_the_node_that_are_not_pod_links_are_left_alone(
        topology: Topology, open_datapath: Opener, outside: str) -> None:
    datapath = open_datapath(8)
    assert datapath.programs is not None
    pod = topology.add_pod(host_veth=cni_names()["aws-vpc-cni"])
    add_link(topology, unique("qs"), "type", "veth", "peer", "name", unique("qt"))  # both ends on the node
    add_link(topology, unique("pmbr"), "type", "bridge")
    add_link(topology, unique("pmifb"), "type", "ifb")
    add_link(topology, unique("pmdum"), "type", "dummy")  # where the kernel has dummy devices
    # A node that is a container (kind, k3d): its eth0 is a veth whose peer is on the machine outside,
    # and it carries the node's default route: an uplink, not a pod link.
    uplink = unique("pmup")
    add_link(topology, uplink, "type", "veth", "peer", "name", "eth0", "netns", outside)
    for args in (("addr", "add", "10.232.0.2/24", "dev", uplink), ("link", "set", uplink, "up"),
                 ("route", "add", "default", "via", "10.232.0.1", "dev", uplink)):
        run("ip", "-n", topology.host, *args)
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
        assert set(manager.attached()) == {pod.host_veth}
        assert manager.errors == {}
        run("ip", "-n", topology.host, "route", "del", "default")  # no longer the uplink: a veth to elsewhere
        manager.sync()
        assert set(manager.attached()) == {pod.host_veth, uplink}


@needs_root
def test_every_link_of_a_multipath_default_route_is_an_uplink(
        topology: Topology, open_datapath: Opener, outside: str) -> None:
    datapath = open_datapath(8)
    assert datapath.programs is not None
    pod = topology.add_pod()
    uplinks = [unique("pmup"), unique("pmup")]
    for n, name in enumerate(uplinks):
        add_link(topology, name, "type", "veth", "peer", "name", f"eth{n}", "netns", outside)
        run("ip", "-n", topology.host, "addr", "add", f"10.233.{n}.2/24", "dev", name)
        run("ip", "-n", topology.host, "link", "set", name, "up")
    run("ip", "-n", topology.host, "route", "add", "default", "nexthop", "via", "10.233.0.1", "dev", uplinks[0],
        "nexthop", "via", "10.233.1.1", "dev", uplinks[1])
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
        assert set(manager.attached()) == {pod.host_veth}


@needs_root
def test_name_patterns_override_the_detection(topology: Topology, open_datapath: Opener) -> None:
    """``--interface-pattern``: the links whose names match, whatever they are, and no others."""
    datapath = open_datapath(8)
    assert datapath.programs is not None
    names = cni_names()
    eni, azv = topology.add_pod(host_veth=names["aws-vpc-cni"]), topology.add_pod(host_veth=names["azure-cni"])
    stray = "eni" + unique("s")
    add_link(topology, stray, "type", "veth", "peer", "name", unique("qt"))
    rule = InterfaceRule(patterns=("eni*",))
    with AttachManager(datapath.programs, rule=rule, netns=topology.host_path) as manager:
        assert set(manager.attached()) == {eni.host_veth, stray}
    with AttachManager(datapath.programs, rule=InterfaceRule(explicit=(stray,)), netns=topology.host_path) as manager:
        assert set(manager.attached()) == {eni.host_veth, azv.host_veth, stray}  # detection plus the name


def settled_unlinked(manager: AttachManager, ips: set[str], expected: set[str], timeout: float = 10.0) -> None:
    wait_for(lambda: manager.unlinked(ips) == expected, timeout, f"unlinked == {sorted(expected)}",
             lambda: f"unlinked is {sorted(manager.unlinked(ips))}, placed {manager.placed()}")


@needs_root
def test_which_pod_ips_reach_no_attached_link(topology: Topology, open_datapath: Opener) -> None:
    datapath = open_datapath(8)
    assert datapath.programs is not None
    web = topology.add_pod(host_veth=cni_names()["aws-vpc-cni"])
    db = topology.add_pod(host_veth=cni_names()["antrea"])
    ghost = "10.99.0.7"  # a pod whose link does not exist: no peer holds it, no route
    routed = "10.98.0.5"  # no peer holds it, but the node routes it through web's link
    bridged = "10.97.0.5"  # routed through a link that is not a pod's
    bridge = unique("pmbr")
    add_link(topology, bridge, "type", "bridge")
    run("ip", "-n", topology.host, "addr", "add", "10.97.0.1/24", "dev", bridge)
    run("ip", "-n", topology.host, "link", "set", bridge, "up")
    run("ip", "-n", topology.host, "route", "add", f"{routed}/32", "dev", web.host_veth)
    ips = {web.ip, db.ip, ghost, routed, bridged}
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=3600) as manager:
        assert manager.placed() == {web.ip: web.host_veth, db.ip: db.host_veth}  # the pods' own addresses
        assert manager.unlinked(ips) == set()  # not looked at yet: nothing is reported before it is
        settled_unlinked(manager, ips, {ghost, bridged})
        run("ip", "-n", topology.host, "link", "del", db.host_veth)  # the pod's link goes
        settled_unlinked(manager, ips, {ghost, bridged, db.ip})

        # A pod whose address comes after its link was attached (and read): found on a later look.
        late_ns, late_host, late_ip = unique("pmp"), unique("pml"), "10.96.0.9"
        run("ip", "netns", "add", late_ns)
        topology.pods.append(type(web)(late_ns, late_host, late_ip, ""))  # removed with the topology
        add_link(topology, late_host, "type", "veth", "peer", "name", "eth0", "netns", late_ns)
        run("ip", "-n", topology.host, "link", "set", late_host, "up")
        run("ip", "-n", late_ns, "link", "set", "eth0", "up")
        wait_until(lambda: late_host in manager.attached())
        settled_unlinked(manager, ips | {late_ip}, {ghost, bridged, db.ip, late_ip})
        run("ip", "-n", late_ns, "addr", "add", f"{late_ip}/32", "dev", "eth0")
        settled_unlinked(manager, ips | {late_ip}, {ghost, bridged, db.ip}, timeout=20)
        assert manager.placed()[late_ip] == late_host


# --- only the links that carry a pod of this node (LinkSelection.PODS, the agent's) ------------------------


def bare_pod(topology: Topology, ip: str, host_veth: str | None = None) -> Pod:
    """A pod's netns and veth, both ends up, and no address yet (the test places ``ip`` itself)."""
    pod = Pod(unique("pmp"), host_veth or unique("pmr"), ip, "")
    run("ip", "netns", "add", pod.netns)
    topology.pods.append(pod)  # removed with the topology
    add_link(topology, pod.host_veth, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
    run("ip", "-n", topology.host, "link", "set", pod.host_veth, "up")
    run("ip", "-n", pod.netns, "link", "set", "eth0", "up")
    return pod


def pod_manager(datapath: EbpfDatapath, topology: Topology, rule: InterfaceRule | None = None) -> AttachManager:
    assert datapath.programs is not None
    return AttachManager(datapath.programs, rule=rule, netns=topology.host_path, resync_interval=3600,
                         selection=LinkSelection.PODS)


def settled_counts(manager: AttachManager, expected: LinkCounts) -> None:
    wait_for(lambda: manager.link_counts() == expected, 10, f"link counts {expected}",
             lambda: f"counts {manager.link_counts()}, attached {sorted(manager.attached())}")


@needs_root
def test_only_links_that_carry_a_pod_ip_are_attached_routed_or_held(topology: Topology, open_datapath: Opener) -> None:
    datapath = open_datapath(8)
    pod = topology.add_pod(host_veth=cni_names()["calico"])  # its eth0 holds its IP
    stranger = topology.add_pod()  # another program's netns: a veth to the node, an address, no pod
    # Routed: the pod's IP is not on its eth0, but the node routes it (a /32) through the host side.
    routed = bare_pod(topology, "10.95.0.9")
    run("ip", "-n", routed.netns, "addr", "add", f"{routed.ip}/32", "dev", "lo")
    run("ip", "-n", topology.host, "route", "add", f"{routed.ip}/32", "dev", routed.host_veth)
    with pod_manager(datapath, topology) as manager:
        assert manager.attached() == {}  # no pod IP given yet: no veth is known to be a pod's
        assert manager.link_counts() == LinkCounts(seen=3, attached=0, skipped={"no_pod": 3})
        manager.set_pod_ips({pod.ip, routed.ip, "10.99.0.7"})  # and a pod with no link of its own
        wait_until(lambda: set(manager.attached()) == {pod.host_veth, routed.host_veth})
        settled_counts(manager, LinkCounts(seen=3, attached=2, skipped={"no_pod": 1}))
        manager.sync()  # a dump finds the same
        assert set(manager.attached()) == {pod.host_veth, routed.host_veth}
        assert stranger.host_veth not in manager.errors
        manager.set_pod_ips({routed.ip})  # the pod left the node; its veth is still there
        wait_until(lambda: set(manager.attached()) == {routed.host_veth})
        settled_counts(manager, LinkCounts(seen=3, attached=1, skipped={"no_pod": 2}))


@needs_root
def test_a_new_pods_link_is_attached_promptly_whichever_comes_first(
        topology: Topology, open_datapath: Opener) -> None:
    """Its IP known after its link is configured (a runtime reports the IP after the CNI's ADD), or before
    its link exists, or its address coming after the link with no link event at all."""
    datapath = open_datapath(8)
    with pod_manager(datapath, topology) as manager:
        first = topology.add_pod()
        manager.sync()
        assert manager.attached() == {}
        manager.set_pod_ips({first.ip})
        wait_until(lambda: first.host_veth in manager.attached(), timeout=2)

        manager.set_pod_ips({first.ip, "10.94.0.5", "10.94.0.6"})
        second = bare_pod(topology, "10.94.0.5")
        run("ip", "-n", second.netns, "addr", "add", f"{second.ip}/24", "dev", "eth0")
        wait_until(lambda: second.host_veth in manager.attached(), timeout=2)

        late = bare_pod(topology, "10.94.0.6")
        wait_until(lambda: manager.link_counts().seen == 3)
        run("ip", "-n", late.netns, "addr", "add", f"{late.ip}/24", "dev", "eth0")  # nothing tells the node
        wait_until(lambda: late.host_veth in manager.attached(), timeout=3)  # a recheck finds it


@needs_root
def test_names_given_are_attached_whatever_they_carry(topology: Topology, open_datapath: Opener) -> None:
    """--interface and --interface-pattern are the override: no pod IP needed."""
    datapath = open_datapath(8)
    stranger = topology.add_pod()
    eni = topology.add_pod(host_veth=cni_names()["aws-vpc-cni"])
    with pod_manager(datapath, topology, InterfaceRule(explicit=(stranger.host_veth,))) as manager:
        assert set(manager.attached()) == {stranger.host_veth}  # named; eni carries no pod IP given
        assert manager.link_counts() == LinkCounts(seen=2, attached=1, skipped={"no_pod": 1})
    with pod_manager(datapath, topology, InterfaceRule(patterns=("eni*",))) as manager:
        assert set(manager.attached()) == {eni.host_veth}
        assert manager.link_counts() == LinkCounts(seen=2, attached=1, skipped={"no_match": 1})


# --- the bridge CNI plugin, called as a container runtime calls it ------------------------------------------

CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
needs_bridge_plugin = pytest.mark.skipif(not (CNI_BIN / "bridge").is_file(),
                                         reason="no bridge CNI plugin (apt-get install containernetworking-plugins)")


class BridgeCni:
    """The bridge plugin with host-local IPAM in the test's host netns: ADD for each pod sandbox, DEL at
    the end. The host side of a pod's veth is what the plugin's result names outside the sandbox."""

    def __init__(self, topology: Topology, data_dir: Path) -> None:
        self.topology = topology
        self.bridge = unique("pmcni")
        self.config = json.dumps({
            "cniVersion": "1.0.0", "name": unique("pmnet"), "type": "bridge", "bridge": self.bridge,
            "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.236.0.0/24"}]], "dataDir": str(data_dir)},
        })
        self.added: list[Pod] = []

    def add(self) -> Pod:
        pod = Pod(unique("pmp"), "", "", "")
        run("ip", "netns", "add", pod.netns)
        self.topology.pods.append(pod)  # its netns goes with the topology
        run("ip", "netns", "exec", pod.netns, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
        result = self._call("ADD", pod)
        self.added.append(pod)
        pod.host_veth = next(i["name"] for i in result["interfaces"] if "sandbox" not in i and i["name"] != self.bridge)
        pod.ip, pod.host_ip = result["ips"][0]["address"].split("/")[0], result["ips"][0]["gateway"]
        return pod

    def delete_all(self) -> None:
        for pod in reversed(self.added):
            self._call("DEL", pod)
        self.added.clear()
        subprocess.run(["ip", "-n", self.topology.host, "link", "del", self.bridge], capture_output=True, check=False)

    def _call(self, command: str, pod: Pod) -> dict[str, Any]:
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "CNI_COMMAND": command,
               "CNI_CONTAINERID": pod.netns, "CNI_NETNS": pod.netns_path, "CNI_IFNAME": "eth0",
               "CNI_PATH": str(CNI_BIN)}
        done = subprocess.run(["nsenter", f"--net={self.topology.host_path}", "--", str(CNI_BIN / "bridge")],
                              input=self.config, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"bridge {command}: {done.stdout}{done.stderr}"
        result: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
        return result


@pytest.fixture
def bridge_cni(topology: Topology, tmp_path: Path) -> Iterator[BridgeCni]:
    cni = BridgeCni(topology, tmp_path / "ipam")
    try:
        yield cni
    finally:
        cni.delete_all()


@needs_root
@needs_bridge_plugin
def test_the_agent_attaches_to_the_bridge_plugins_pods_and_nothing_else(
        topology: Topology, bridge_cni: BridgeCni, lab_apiserver: LabServer, pin_dir: Path) -> None:
    """The agent's own wiring (runtime.datapaths.open_datapath, the pod IPs from its store): the pods of
    the bridge plugin, observed or not, and not the veth of a netns that is no pod's."""
    web, db = bridge_cni.add(), bridge_cni.add()
    stranger = topology.add_pod()
    add_link(topology, unique("qs"), "type", "veth", "peer", "name", unique("qt"))  # both ends here: not seen
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    cluster.namespace("quiet")
    cluster.pod("shop", "web", web.ip)
    cluster.pod("quiet", "db", db.ip)
    with topology.in_host():  # the attach worker starts from here: it works in the test's host netns
        opened = open_agent_datapath(DatapathSettings(bpffs=str(pin_dir), filter_map_size=64, drop_map_size=0))
    try:
        manager = opened.links
        assert isinstance(manager, AttachManager)
        assert manager.attached() == {}  # no pod known before the agent lists them
        harness = AgentHarness(lab_apiserver, datapath=opened.datapath, links=manager)
        with harness:
            wait_for(lambda: set(manager.attached()) == {web.host_veth, db.host_veth}, 10, "the pods' links",
                     lambda: f"attached {sorted(manager.attached())}, stranger {stranger.host_veth}")
            harness.wait_filter({web.ip})
            sizes = [1, 300, 1400]
            udp_echo(topology, web, sizes)
            udp_echo(topology, db, sizes)
            one_round = Traffic(len(sizes), sum(size + UDP_HEADERS for size in sizes))
            assert opened.datapath.read_counters() == {(web.ip, direction): one_round for direction in Direction}
            counts = LinkCounts(seen=3, attached=2, skipped={"no_pod": 1})
            wait_for(lambda: harness.on_loop(harness.agent.snapshot).links == counts, 10, f"links {counts}")
            cluster.delete_pod("quiet", "db")  # gone from the API; its sandbox is not torn down yet
            wait_for(lambda: set(manager.attached()) == {web.host_veth}, 10, "db's link detached")
    finally:
        opened.close()


# --- netkit (not in every kernel: the parser and the rule against the wire format) --------------------------


def attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + bytes(-length % 4)


def newlink(index: int, *attributes: bytes) -> bytes:
    body = struct.pack("=BBHiII", 0, 0, 1, index, 0, 0) + b"".join(attributes)
    return struct.pack("=IHHII", 16 + len(body), nl.RTM_NEWLINK, 0, 0, 0) + body


def netkit(index: int, name: str, mode: int, primary: bool = True, peer_elsewhere: bool = True) -> bytes:
    data = attr(nl.IFLA_NETKIT_PRIMARY, bytes([primary])) + attr(nl.IFLA_NETKIT_MODE, struct.pack("=I", mode))
    info = attr(nl.IFLA_INFO_KIND, b"netkit\0") + attr(nl.IFLA_INFO_DATA | 0x8000, data)  # NLA_F_NESTED
    peer = [attr(nl.IFLA_LINK_NETNSID, struct.pack("=i", 4)), attr(nl.IFLA_LINK, struct.pack("=i", 2))]
    return newlink(index, attr(nl.IFLA_IFNAME, name.encode() + b"\0"), attr(nl.IFLA_LINKINFO | 0x8000, info),
                   *(peer if peer_elsewhere else []))


def test_netkit_devices_are_read_from_the_wire() -> None:
    """The attributes as netkit_fill_info() writes them (include/uapi/linux/if_link.h: PRIMARY 2, MODE 5)."""
    datagram = netkit(9, "lxc1a2b", nl.NETKIT_L2) + netkit(10, "lxc3c4d", nl.NETKIT_L3) + \
        netkit(11, "nk-peer", nl.NETKIT_L2, primary=False) + netkit(12, "nk-here", nl.NETKIT_L2, peer_elsewhere=False)
    found = {c.index: c.link for c in changes(memoryview(datagram))}
    assert found[9] == LinkInfo("lxc1a2b", "netkit", 4, 2, nl.NETKIT_L2, True)
    assert found[10] == LinkInfo("lxc3c4d", "netkit", 4, 2, nl.NETKIT_L3, True)
    rule = InterfaceRule()
    selected = {index for index, link in found.items() if link is not None and rule.selects(link)}
    assert selected == {9, 10}  # primaries with their peer elsewhere; not a peer end, not a pair on the node


class Untouchable:
    """Stands for the attacher: an L3 netkit device must be refused before anything is attached."""

    mode = AttachMode.TCX

    def attach(self, ifindex: int, ifname: str) -> None:
        raise AssertionError("attach called")


def test_a_netkit_device_in_l3_mode_is_refused_with_the_reason() -> None:
    """Its packets carry no Ethernet header, which the programs parse: attached, it would count nothing."""
    manager = AttachManager.__new__(AttachManager)
    AttachManager.__init__(manager, programs=None)  # type: ignore[arg-type]
    manager.attacher = Untouchable()  # type: ignore[assignment]
    try:
        manager._attach(10, LinkInfo("lxc3c4d", "netkit", 4, 2, nl.NETKIT_L3, True))
        assert manager.attached() == {}
        assert "L3 mode" in manager.errors["lxc3c4d"]
        assert "Ethernet header" in manager.errors["lxc3c4d"]
    finally:
        manager.stop()


# --- the agent: pods whose link was not found, as a metric and in /debug/state --------------------------------


@needs_root
def test_the_agent_reports_observed_pods_whose_link_was_not_found(
        topology: Topology, server: LabServer, pin_dir: Path, tmp_path: Path) -> None:
    web = topology.add_pod(host_veth=cni_names()["aws-vpc-cni"])
    topology.add_pod()  # a netns that is no pod's: seen, skipped
    cluster = Cluster(server)
    with topology.in_host():
        cluster.namespace("shop", observe=True)
        cluster.pod("shop", "web", web.ip)
        cluster.pod("shop", "ghost", "10.99.0.7")  # observed, but no link leads to it
        port = free_port(topology)
    argv = ["nsenter", f"--net={topology.host_path}", "--", sys.executable, "-m", "podmeter", "agent",
            "--node-name", "node-a", "--datapath", "ebpf", "--bpffs", str(pin_dir), "--filter-map-size", "64",
            "--listen", f"127.0.0.1:{port}", "--metrics-min-interval", "0.1"]
    env = {**os.environ, "KUBECONFIG": str(server.kubeconfig)}
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def scrape() -> str:
            try:
                return get_in_host(topology, f"http://127.0.0.1:{port}/metrics").decode()
            except OSError:
                return ""

        wait_for(lambda: metric(scrape(), "podmeter_pods_without_link") == 1, 30, "pods_without_link 1",
                 lambda: log_path.read_text()[-3000:])
        state = json.loads(get_in_host(topology, f"http://127.0.0.1:{port}/debug/state"))
        assert state["pods_without_link"] == ["shop/ghost"]
        links = scrape()
        assert (metric(links, "podmeter_links_seen"), metric(links, "podmeter_links_attached")) == (2, 1)
        assert metric(links, 'podmeter_links_skipped{reason="no_pod"}') == 1
        udp_echo(topology, web, [100])
        wanted = ('podmeter_pod_bytes_total{', 'namespace="shop"', 'pod="web"', 'direction="egress"')
        wait_for(lambda: any(all(part in line for part in wanted) and float(line.rsplit(" ", 1)[1]) == 100 + UDP_HEADERS
                             for line in scrape().splitlines()), 10, "web's traffic counted")
        with topology.in_host():
            cluster.delete_pod("shop", "ghost")
        wait_for(lambda: metric(scrape(), "podmeter_pods_without_link") == 0, 30, "pods_without_link 0")
    finally:
        stop_process(agent)


def free_port(topology: Topology) -> int:
    with topology.in_host(), socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
